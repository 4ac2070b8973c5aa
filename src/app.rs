//! The imperative shell: parse, validate, choose implementations once, run, report, exit.

use std::fs;
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::anyhow;
use clap::Parser;
use serde_json::{Value, json};

use crate::cli::{Cli, Command, ForgejoArgs, OutputFormat, RunArgs, StatusArgs, SweepArgs};
use crate::cycle::{self, Clock, CycleConfig, End, Sleep, World};
use crate::dry::{DryClock, DryForgejo, DryLauncher, DryTofu, Fixture, FixtureForgejo, Plan};
use crate::escape::{escape_controls, needs_escape};
use crate::forgejo::{Forgejo, HttpForgejo, Scope, load_ca_file, validate_url};
use crate::launch::CommandLauncher;
use crate::model::label_names;
use crate::planner::Policy;
use crate::report::Report;
use crate::secret::Secret;
use crate::signals::StopFlag;
use crate::state::{FileStore, MemoryStore, read_state_file, write_atomic};
use crate::sweep;
use crate::time::Timestamp;
use crate::tofu::CliTofu;

pub const EXIT_OK: u8 = 0;
pub const EXIT_FAILED: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_LOCKED: u8 = 75;
pub const LAST_RUN_FILE: &str = "last-run.json";
pub const LOCK_FILE: &str = "cycle.lock";

/// A reason to stop before doing anything, with its exit status.
pub(crate) struct Fatal(pub(crate) u8, pub(crate) String);

pub(crate) fn usage(msg: impl Into<String>) -> Fatal {
    Fatal(EXIT_USAGE, msg.into())
}

pub fn main() -> ExitCode {
    // First of all, before the token is read: no process of our user (tofu, a provider, a
    // module's local-exec, the launch command) may read our memory, environment or descriptors
    // through /proc, and no core dump may hold the token.
    if let Err(e) = crate::secret::forbid_dumping() {
        eprintln!(
            "error: cannot make this process non-dumpable (prctl PR_SET_DUMPABLE 0): {e}; \
             refusing to run, since a process of the same user could then read the Forgejo \
             token from its memory"
        );
        return ExitCode::from(EXIT_FAILED);
    }
    let cli = Cli::parse();
    let (verbose, dry_run, sub) = match &cli.command {
        Command::Run(a) => (a.common.local.verbose, a.common.dry_run, "run"),
        Command::Sweep(a) => (a.common.local.verbose, a.common.dry_run, "sweep"),
        Command::Status(a) => (a.local.verbose, false, "status"),
        Command::Check(a) => (a.common.local.verbose, false, "check"),
    };
    init_logging(verbose, dry_run);
    log::debug!(
        "ci-ephemeral-provisioner {} ({sub})",
        env!("CARGO_PKG_VERSION")
    );
    let result = match cli.command {
        Command::Run(a) => cmd_run(a),
        Command::Sweep(a) => cmd_sweep(a),
        Command::Status(a) => cmd_status(a),
        Command::Check(a) => crate::check::cmd_check(a),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(Fatal(code, msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(code)
        }
    }
}

/// Info by default; debug with `-v`; warnings only for dry-runs, whose product is the plan on
/// stdout (their "deleted" would be a lie). `RUST_LOG`, when set, replaces all of that (on a
/// default of warnings).
fn init_logging(verbose: bool, dry_run: bool) {
    let mut b = env_logger::Builder::new();
    match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => {
            // Warnings and errors stay on unless RUST_LOG itself sets a lower default.
            b.filter_level(log::LevelFilter::Warn);
            b.parse_filters(&spec);
        }
        _ => {
            b.filter_level(log::LevelFilter::Warn);
            let ours = match (verbose, dry_run) {
                (true, _) => log::LevelFilter::Debug,
                (false, true) => log::LevelFilter::Warn,
                (false, false) => log::LevelFilter::Info,
            };
            b.filter_module("ci_ephemeral_provisioner", ours);
        }
    }
    b.target(env_logger::Target::Stderr);
    if stderr_is_journal() {
        // journald stamps every line itself, and reads the priority from a `<N>` prefix
        // (sd-daemon(3)), so `journalctl -p err` finds failures.
        b.format(|buf, record| {
            use std::io::Write;
            let p = priority(record.level());
            let target = record.target();
            let text = if target.starts_with("ci_ephemeral_provisioner") {
                record.args().to_string()
            } else {
                format!("{target}: {}", record.args())
            };
            // Every line of a multi-line message (tofu's stderr) keeps the priority.
            writeln!(buf, "<{p}>{}", text.replace('\n', &format!("\n<{p}>")))
        });
    }
    let inner = b.build();
    let max = inner.filter();
    if log::set_boxed_logger(Box::new(CappedLogger { inner })).is_ok() {
        log::set_max_level(max);
    }
}

/// The syslog priority of a log level (sd-daemon(3) prefixes).
pub fn priority(level: log::Level) -> u8 {
    match level {
        log::Level::Error => 3,
        log::Level::Warn => 4,
        log::Level::Info => 6,
        log::Level::Debug | log::Level::Trace => 7,
    }
}

/// `JOURNAL_STREAM` names our stderr (`<device>:<inode>`): systemd connected it to journald.
/// A child that merely inherited the variable with stderr redirected elsewhere keeps the normal
/// format.
fn stderr_is_journal() -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = stream.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let meta = std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .map(fs::File::from)
        .and_then(|f| f.metadata());
    match (meta, dev.parse::<u64>(), ino.parse::<u64>()) {
        (Ok(m), Ok(d), Ok(i)) => m.dev() == d && m.ino() == i,
        _ => false,
    }
}

/// The effective configuration at debug level: every flag as parsed (defaults filled in), the
/// state directory, and the token only as `<redacted>`.
fn log_config(args: &dyn std::fmt::Debug, token: Option<&Secret>, dir: Option<&Path>) {
    if !log::log_enabled!(log::Level::Debug) {
        return;
    }
    log::debug!("effective configuration: {args:?}");
    log::debug!(
        "state directory: {}; Forgejo token: {}",
        dir.map_or_else(|| "(none: dry-run)".into(), |d| d.display().to_string()),
        match token {
            Some(t) => format!("{t:?} (redacted)"),
            None => "(not read)".into(),
        }
    );
}

/// `--metrics-file` must be a `.prom` file: node_exporter's textfile collector reads no other.
pub(crate) fn check_metrics_file(common: &ForgejoArgs) -> Result<(), Fatal> {
    if let Some(p) = &common.metrics_file
        && p.extension().and_then(|e| e.to_str()) != Some("prom")
    {
        return Err(usage(format!(
            "--metrics-file {} must end in .prom: node_exporter's textfile collector reads only *.prom files",
            p.display()
        )));
    }
    Ok(())
}

/// Never lets the HTTP and TLS stack log below info, whatever `RUST_LOG` says (however
/// specific): their debug and trace output is where request headers — the token — appear.
struct CappedLogger {
    inner: env_logger::Logger,
}

impl CappedLogger {
    fn allowed(meta: &log::Metadata<'_>) -> bool {
        let t = meta.target();
        let http_stack = ["ureq", "ureq_proto", "rustls"]
            .iter()
            .any(|m| t == *m || t.starts_with(&format!("{m}::")));
        !http_stack || meta.level() <= log::Level::Info
    }
}

impl log::Log for CappedLogger {
    fn enabled(&self, meta: &log::Metadata<'_>) -> bool {
        Self::allowed(meta) && self.inner.enabled(meta)
    }

    /// A record is one line whatever it holds: control characters (a runner name from Forgejo
    /// with `\n<3>…`, an ESC sequence, tofu's multi-line stderr) are written escaped, so no text
    /// can forge a log line (or a journald priority) or drive a terminal.
    fn log(&self, record: &log::Record<'_>) {
        if !Self::allowed(record.metadata()) {
            return;
        }
        let text = record.args().to_string();
        if !text.chars().any(needs_escape) {
            self.inner.log(record);
            return;
        }
        let escaped = escape_controls(&text);
        self.inner.log(
            &log::Record::builder()
                .metadata(record.metadata().clone())
                .module_path(record.module_path())
                .file(record.file())
                .line(record.line())
                .args(format_args!("{escaped}"))
                .build(),
        );
    }

    fn flush(&self) {
        self.inner.flush();
    }
}

pub(crate) fn state_dir(arg: &Option<PathBuf>) -> PathBuf {
    if let Some(d) = arg {
        return d.clone();
    }
    if let Some(d) = std::env::var_os("STATE_DIRECTORY") {
        // systemd may pass several directories separated by ':'; the first is ours.
        if let Some(first) = d.to_string_lossy().split(':').next()
            && !first.is_empty()
        {
            return PathBuf::from(first);
        }
    }
    PathBuf::from("/var/lib/ci-ephemeral-provisioner")
}

/// The Forgejo token: `--token-file -` reads standard input (the role's units:
/// `StandardInput=file:…`), a path reads that file, and without the flag
/// `$CREDENTIALS_DIRECTORY/forgejo-token` (`LoadCredential=`). Called at most once per process:
/// standard input is `/dev/null` after it was read.
pub(crate) fn read_token(arg: &Option<PathBuf>) -> Result<Secret, Fatal> {
    let path = match arg {
        Some(p) if p.as_os_str() == crate::secret::STDIN_PATH => {
            return crate::secret::read_token_stdin().map_err(usage);
        }
        Some(p) => p.clone(),
        None => match std::env::var_os("CREDENTIALS_DIRECTORY") {
            Some(d) => Path::new(&d).join("forgejo-token"),
            None => {
                return Err(usage(
                    "no Forgejo token: pass --token-file PATH, or --token-file - with the token on standard input (under systemd, LoadCredential=forgejo-token:… works too)",
                ));
            }
        },
    };
    crate::secret::read_token_file(&path).map_err(usage)
}

/// `--fixture` only makes sense for a dry-run (clap's `requires` is satisfied by a
/// `…_DRY_RUN=false` variable, so this checks the value).
fn check_fixture(common: &ForgejoArgs) -> Result<(), Fatal> {
    if common.fixture.is_some() && !common.dry_run {
        return Err(usage(
            "--fixture needs --dry-run: a fixture world can only be planned against, never acted on",
        ));
    }
    Ok(())
}

/// Longest `--runner-prefix`: with the cycle id and sequence number a name stays well within
/// Forgejo's `VARCHAR(255)` (the REST registration stores it as sent; a longer one fails).
pub const MAX_PREFIX_BYTES: usize = 128;

pub(crate) fn check_prefix(prefix: &str) -> Result<(), Fatal> {
    if prefix.is_empty() {
        return Err(usage(
            "--runner-prefix must not be empty: it is the only mark of the registrations this tool may delete",
        ));
    }
    if prefix.len() > MAX_PREFIX_BYTES {
        return Err(usage(format!(
            "--runner-prefix is {} bytes long; at most {MAX_PREFIX_BYTES}: runner names (prefix, cycle id, number) must fit Forgejo's 255 characters",
            prefix.len()
        )));
    }
    Ok(())
}

/// The Forgejo client of a live run or a live dry-run.
pub(crate) fn http_forgejo(
    common: &ForgejoArgs,
    url: &str,
    scope: Scope,
    token: &Secret,
    label_names: &[String],
) -> Result<HttpForgejo, Fatal> {
    let ca = match &common.ca_file {
        Some(path) => Some(load_ca_file(path).map_err(|e| usage(format!("--ca-file: {e}")))?),
        None => None,
    };
    Ok(HttpForgejo::new(
        url,
        scope,
        token,
        label_names,
        common.http_timeout,
        ca.as_deref(),
    ))
}

pub(crate) fn forgejo_target(common: &ForgejoArgs) -> Result<(String, Scope), Fatal> {
    let url = common.forgejo_url.as_deref().ok_or_else(|| {
        usage("--forgejo-url is required (or CI_EPHEMERAL_PROVISIONER_FORGEJO_URL)")
    })?;
    let url = validate_url(url).map_err(|e| usage(format!("--forgejo-url: {e}")))?;
    let scope = Scope::parse(&common.scope).map_err(|e| usage(format!("--scope: {e}")))?;
    Ok((url, scope))
}

/// Holds `cycle.lock` for as long as it lives.
struct Lock {
    _file: fs::File,
}

/// What is at the state directory's path, and whether this user may keep its state there.
pub(crate) enum StateDir {
    Usable,
    /// Nothing there yet; `run` and `sweep` create it (0700).
    Missing,
}

/// Refuses a state directory that is not a directory, or that someone else could change under
/// us: owned by another user, or writable by group or others (exit 2, with what to fix).
pub(crate) fn inspect_state_dir(dir: &Path) -> Result<StateDir, Fatal> {
    let meta = match fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(StateDir::Missing),
        Err(e) => {
            return Err(Fatal(
                EXIT_FAILED,
                format!("cannot inspect state directory {}: {e}", dir.display()),
            ));
        }
    };
    if !meta.is_dir() {
        return Err(usage(format!(
            "state directory {} is not a directory; point --state-dir (or $STATE_DIRECTORY) at a directory, or move what is there",
            dir.display()
        )));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(usage(format!(
            "state directory {} is owned by uid {}, not by this user (uid {me}): another user could change the cycle state under us; `chown` it to the service's user or point --state-dir elsewhere",
            dir.display(),
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(usage(format!(
            "state directory {} is writable by group or others (mode {mode:04o}): anyone in them could replace the cycle state; run `chmod go-w {}`",
            dir.display(),
            dir.display()
        )));
    }
    Ok(StateDir::Usable)
}

fn take_lock(dir: &Path) -> Result<Lock, Fatal> {
    if let StateDir::Missing = inspect_state_dir(dir)? {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| {
                Fatal(
                    EXIT_FAILED,
                    format!("cannot create state directory {}: {e}", dir.display()),
                )
            })?;
    }
    let path = dir.join(LOCK_FILE);
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| {
            Fatal(
                EXIT_FAILED,
                format!("cannot open lock file {}: {e}", path.display()),
            )
        })?;
    match file.try_lock() {
        Ok(()) => Ok(Lock { _file: file }),
        Err(fs::TryLockError::WouldBlock) => Err(Fatal(
            EXIT_LOCKED,
            format!("another run holds {}; nothing was done", path.display()),
        )),
        Err(fs::TryLockError::Error(e)) => Err(Fatal(
            EXIT_FAILED,
            format!("cannot lock {}: {e}", path.display()),
        )),
    }
}

/// Takes `<dir>/cycle.lock` exactly as `run` and `sweep` do, for tests that model a second
/// invocation racing the first. `Err((exit status, message))` when another holder has it.
pub fn lock_state_dir(dir: &Path) -> Result<impl Sized + use<>, (u8, String)> {
    take_lock(dir).map_err(|Fatal(code, message)| (code, message))
}

struct RealClock {
    stop: StopFlag,
}

impl Clock for RealClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }

    fn sleep(&mut self, d: Duration) -> Sleep {
        let end = std::time::Instant::now() + d;
        loop {
            if self.stop.is_raised() {
                return Sleep::Interrupted;
            }
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Sleep::Slept;
            }
            std::thread::sleep(left.min(Duration::from_millis(100)));
        }
    }

    fn stop_requested(&self) -> bool {
        self.stop.is_raised()
    }

    fn new_cycle_id(&mut self, now: Timestamp) -> String {
        let mut buf = [0u8; 2];
        let random = fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut buf))
            .map(|()| u16::from_be_bytes(buf))
            .unwrap_or_else(|_| (std::process::id() as u16) ^ (now.0 as u16));
        format!("{}-{random:04x}", now.compact())
    }
}

pub(crate) fn policy(a: &RunArgs, labels: &str) -> Policy {
    Policy {
        runner_prefix: a.common.runner_prefix.clone(),
        label_names: label_names(labels),
        max_jobs_per_vm: a.max_jobs_per_vm,
        idle_timeout: a.idle_timeout,
        registration_grace: a.registration_grace,
        max_cycle_duration: a.max_cycle_duration,
        hard_deadline: a.hard_deadline,
        // Twice the longest a POST can take from our side: by then it has landed or never will.
        intent_settle: a.common.http_timeout.saturating_mul(2),
        job_pickup_timeout: a.job_pickup_timeout,
        reuse_within: a.reuse_within,
    }
}

fn cycle_config(a: &RunArgs, policy: Policy, labels: String, forgejo_url: String) -> CycleConfig {
    CycleConfig {
        policy,
        poll_interval: a.poll_interval,
        labels,
        forgejo_url,
        sweep_max_deletions: a.common.sweep_max_deletions,
    }
}

/// The checks of `run`'s flags that need no I/O; the labels, when they pass.
pub(crate) fn validate_run_args(a: &RunArgs) -> Result<String, Fatal> {
    check_prefix(&a.common.runner_prefix)?;
    let labels = a.labels.clone().unwrap_or_default();
    if label_names(&labels).is_empty() {
        return Err(usage(
            "--labels is required: the runner labels this pool serves, e.g. --labels debian:host",
        ));
    }
    if a.max_jobs_per_vm == 0 {
        return Err(usage("--max-jobs-per-vm must be at least 1"));
    }
    for (flag, d) in [
        ("--poll-interval", a.poll_interval),
        ("--job-pickup-timeout", a.job_pickup_timeout),
        ("--launch-timeout", a.launch_timeout),
        ("--http-timeout", a.common.http_timeout),
    ] {
        if d.is_zero() {
            return Err(usage(format!("{flag} must be longer than 0")));
        }
    }
    if a.hard_deadline < a.max_cycle_duration {
        return Err(usage(format!(
            "--hard-deadline ({}) must not be shorter than --max-cycle-duration ({}): the deadline is the backstop past the normal end of a cycle",
            crate::time::format_duration(a.hard_deadline),
            crate::time::format_duration(a.max_cycle_duration)
        )));
    }
    check_metrics_file(&a.common)?;
    Ok(labels)
}

fn cmd_run(a: RunArgs) -> Result<u8, Fatal> {
    check_fixture(&a.common)?;
    let labels = validate_run_args(&a)?;
    let policy = policy(&a, &labels);

    if a.common.dry_run {
        log_config(&a, None, None);
        return dry_run(&a, policy, labels);
    }

    let (url, scope) = forgejo_target(&a.common)?;
    let token = read_token(&a.common.token_file)?;
    let dir = state_dir(&a.common.local.state_dir);
    log_config(&a, Some(&token), Some(&dir));
    let mut forgejo = http_forgejo(&a.common, &url, scope, &token, &policy.label_names)?;
    drop(token);
    let _lock = take_lock(&dir)?;
    let stop = StopFlag::install().map_err(|e| Fatal(EXIT_FAILED, format!("{e:#}")))?;

    let mut tofu = CliTofu {
        bin: a.tofu_bin.clone(),
        dir: a.tofu_dir.clone(),
        stop: stop.clone(),
    };
    let mut launcher = CommandLauncher {
        command: a.launch_command.clone(),
        timeout: a.launch_timeout,
        stop: stop.clone(),
    };
    let mut store = FileStore::new(&dir);
    let mut clock = RealClock { stop };
    let cfg = cycle_config(&a, policy, labels, url);
    let mut report = Report::new("run", false, Timestamp::now());
    report.set_audit(events_file(&dir, &a.common));
    announce_run(&dir, metrics_target(&a.common), report.started_at);
    let mut world = World {
        forgejo: &mut forgejo,
        tofu: &mut tofu,
        launcher: &mut launcher,
        store: &mut store,
        clock: &mut clock,
    };
    let end = cycle::run(&mut world, &cfg, &mut report);
    finish(
        report,
        end,
        Some(&dir),
        a.common.local.output,
        metrics_target(&a.common),
    )
}

fn events_file(dir: &Path, common: &ForgejoArgs) -> Box<crate::audit::EventsFile> {
    Box::new(crate::audit::EventsFile::new(dir, common.events_max_bytes))
}

/// The metrics file at the start of a run: the counters so far, and that a run is in progress.
/// A failure here is only logged: the write at the end of the run reports it.
/// Where the metrics go, and the `pool` label they carry.
#[derive(Clone, Copy)]
struct MetricsTarget<'a> {
    path: &'a Path,
    pool: Option<&'a str>,
}

fn metrics_target(common: &ForgejoArgs) -> Option<MetricsTarget<'_>> {
    common.metrics_file.as_deref().map(|path| MetricsTarget {
        path,
        pool: common.metrics_pool.as_deref(),
    })
}

fn announce_run(dir: &Path, metrics: Option<MetricsTarget<'_>>, started: Timestamp) {
    let Some(MetricsTarget { path, pool }) = metrics else {
        return;
    };
    let counters = crate::metrics::load(dir).unwrap_or_default();
    let cycle = read_state_file(&dir.join(crate::state::STATE_FILE));
    let text = crate::metrics::render(&counters, &cycle_view(&cycle), Some(started), pool);
    if let Err(e) = crate::metrics::write_textfile(path, &text) {
        log::warn!("--metrics-file: {e:#}");
    }
}

fn cycle_view(
    cycle: &anyhow::Result<Option<crate::state::CycleState>>,
) -> crate::metrics::CycleView<'_> {
    match cycle {
        Ok(None) => crate::metrics::CycleView::None,
        Ok(Some(s)) => crate::metrics::CycleView::Active(s),
        Err(_) => crate::metrics::CycleView::Unreadable,
    }
}

/// Adds the run to counters.json and writes the metrics file. A failure to write either is a
/// failure of the run (exit 1), reported like any other.
fn record_run(dir: &Path, metrics: Option<MetricsTarget<'_>>, report: &mut Report) {
    let before = match crate::metrics::load(dir) {
        Ok(c) => c,
        Err(e) => {
            log::warn!("{e:#}; the counters start again from zero");
            crate::metrics::Counters::default()
        }
    };
    let mut counters = before.clone();
    counters.record(report);
    if let Some(MetricsTarget { path, pool }) = metrics {
        let cycle = read_state_file(&dir.join(crate::state::STATE_FILE));
        let text = crate::metrics::render(&counters, &cycle_view(&cycle), None, pool);
        if let Err(e) = crate::metrics::write_textfile(path, &text) {
            report.fail(format!("--metrics-file: {e:#}"));
            report.settle(report.exit_code == i32::from(EXIT_USAGE));
            counters = before.clone();
            counters.record(report);
        }
    }
    if let Err(e) = crate::metrics::save(dir, &counters) {
        report.fail(format!("{e:#}"));
        report.settle(report.exit_code == i32::from(EXIT_USAGE));
    }
}

/// Sets the exit status, records the run (counters, metrics file), keeps the report as
/// last-run.json, prints it.
fn finish(
    mut report: Report,
    end: End,
    dir: Option<&Path>,
    output: OutputFormat,
    metrics: Option<MetricsTarget<'_>>,
) -> Result<u8, Fatal> {
    let config_error = match end {
        End::Config(msg) => {
            // Kept in last-run.json too: `status` must show why runs stopped doing anything.
            report.fail(msg);
            report.outcome = "configuration_error".into();
            true
        }
        End::Done => false,
    };
    let end_at = Timestamp::now();
    report.finished_at = Some(end_at);
    report.duration_ms = end_at.since(report.started_at).as_millis() as u64;
    report.settle(config_error);
    report.sync_audit();
    if let Some(dir) = dir {
        record_run(dir, metrics, &mut report);
    }
    if let Some(dir) = dir {
        let path = dir.join(LAST_RUN_FILE);
        let written = serde_json::to_vec_pretty(&report)
            .map_err(|e| anyhow!("cannot encode the report: {e}"))
            .and_then(|mut b| {
                b.push(b'\n');
                write_atomic(&path, &b)
            });
        if let Err(e) = written {
            report.fail(format!("cannot write {}: {e:#}", path.display()));
            report.exit_code = 1;
        }
    }
    match output {
        OutputFormat::Json => println!(
            "{}",
            serde_json::to_string_pretty(&report)
                .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
        ),
        OutputFormat::Text => println!("{}", report.text()),
    }
    Ok(report.exit_code as u8)
}

fn dry_run(a: &RunArgs, policy: Policy, labels: String) -> Result<u8, Fatal> {
    let plan: Plan = Plan::default();
    let mut tofu = DryTofu { plan: plan.clone() };
    let mut launcher = DryLauncher { plan: plan.clone() };
    let (inner, cycle, holds, now, url): (Box<dyn Forgejo>, _, _, _, String) =
        match &a.common.fixture {
            Some(path) => {
                let fx = Fixture::load(path).map_err(|e| usage(format!("{e:#}")))?;
                let inner = FixtureForgejo {
                    runners: fx.runners,
                    jobs: fx.jobs,
                    label_names: policy.label_names.clone(),
                };
                (
                    Box::new(inner),
                    fx.cycle,
                    crate::holds::Holds::default(),
                    fx.now.unwrap_or_else(Timestamp::now),
                    "https://forgejo.invalid".into(),
                )
            }
            None => {
                let (url, scope) = forgejo_target(&a.common)?;
                let token = read_token(&a.common.token_file)?;
                let dir = state_dir(&a.common.local.state_dir);
                let cycle = read_state_file(&dir.join(crate::state::STATE_FILE))
                    .map_err(|e| Fatal(EXIT_FAILED, format!("{e:#}")))?;
                let holds = crate::state::read_holds_file(&dir.join(crate::holds::HOLDS_FILE))
                    .map_err(|e| Fatal(EXIT_FAILED, format!("{e:#}")))?;
                let inner = http_forgejo(&a.common, &url, scope, &token, &policy.label_names)?;
                (Box::new(inner), cycle, holds, Timestamp::now(), url)
            }
        };
    let mut forgejo = DryForgejo::new(inner, plan.clone());
    let mut store = MemoryStore {
        state: cycle,
        holds,
    };
    let mut clock = DryClock { now };
    let cfg = cycle_config(a, policy, labels, url);
    let mut report = Report::new("run", true, now);
    let mut world = World {
        forgejo: &mut forgejo,
        tofu: &mut tofu,
        launcher: &mut launcher,
        store: &mut store,
        clock: &mut clock,
    };
    let end = cycle::run(&mut world, &cfg, &mut report);
    if let End::Config(msg) = end {
        return Err(usage(msg));
    }
    let actions: Vec<Value> = plan.borrow().clone();
    print_plan(&actions, &report, a.common.local.output);
    // The plan's own failures (a hard-deadline teardown, say) are what the run would report;
    // the dry-run itself failed only when it could not read the world.
    Ok(if forgejo.read_errors == 0 {
        EXIT_OK
    } else {
        EXIT_FAILED
    })
}

fn print_plan(actions: &[Value], report: &Report, output: OutputFormat) {
    match output {
        OutputFormat::Json => {
            // Exactly the plan; how it ends is on stderr.
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({ "actions": actions })).unwrap_or_default()
            );
            eprintln!("plan ends: {}", report.outcome);
        }
        OutputFormat::Text => {
            if actions.is_empty() {
                println!("plan: nothing to do ({})", escape_controls(&report.outcome));
            } else {
                println!("plan ({} action(s)):", actions.len());
                for a in actions {
                    let mut line = a["action"].as_str().unwrap_or("?").to_string();
                    if let Some(obj) = a.as_object() {
                        // What it acts on first, why last.
                        const ORDER: [&str; 5] =
                            ["runner_id", "name", "job_id", "job_handle", "reason"];
                        let rank = |k: &str| {
                            ORDER
                                .iter()
                                .position(|o| *o == k)
                                .unwrap_or(ORDER.len() - 1)
                        };
                        let mut fields: Vec<_> =
                            obj.iter().filter(|(k, _)| *k != "action").collect();
                        fields.sort_by_key(|(k, _)| rank(k));
                        for (k, v) in fields {
                            line.push_str(&format!(
                                " {k}={}",
                                v.as_str()
                                    .map(str::to_string)
                                    .unwrap_or_else(|| v.to_string())
                            ));
                        }
                    }
                    println!("  {}", escape_controls(&line));
                }
                println!("then: {}", escape_controls(&report.outcome));
            }
            let failures = report.failures.len() as u64 + report.failures_not_listed;
            if failures > 0 {
                println!("{failures} error(s), logged above");
            }
        }
    }
}

fn cmd_sweep(a: SweepArgs) -> Result<u8, Fatal> {
    let c = &a.common;
    check_prefix(&c.runner_prefix)?;
    check_fixture(c)?;
    check_metrics_file(c)?;
    if c.dry_run {
        log_config(&a, None, None);
        let plan: Plan = Plan::default();
        let inner: Box<dyn Forgejo> = match &c.fixture {
            Some(path) => {
                let fx = Fixture::load(path).map_err(|e| usage(format!("{e:#}")))?;
                if fx.cycle.is_some() {
                    return Err(Fatal(EXIT_FAILED, "the fixture has a cycle in progress: a sweep is refused while a VM may exist".into()));
                }
                Box::new(FixtureForgejo {
                    runners: fx.runners,
                    jobs: fx.jobs,
                    label_names: vec![],
                })
            }
            None => {
                let (url, scope) = forgejo_target(c)?;
                let token = read_token(&c.token_file)?;
                refuse_if_cycle(&state_dir(&c.local.state_dir))?;
                Box::new(http_forgejo(c, &url, scope, &token, &[])?)
            }
        };
        let mut f = DryForgejo::new(inner, plan.clone());
        let mut report = Report::new("sweep", true, Timestamp::now());
        let sw = sweep::sweep(&mut f, &c.runner_prefix, c.sweep_max_deletions);
        for failure in sweep::sweep_failures(&sw) {
            report.fail(failure);
        }
        report.outcome = "would_sweep".into();
        report.sweep = Some(sw);
        let actions: Vec<Value> = plan.borrow().clone();
        print_plan(&actions, &report, c.local.output);
        return Ok(if f.read_errors == 0 {
            EXIT_OK
        } else {
            EXIT_FAILED
        });
    }
    let (url, scope) = forgejo_target(c)?;
    let token = read_token(&c.token_file)?;
    let dir = state_dir(&c.local.state_dir);
    log_config(&a, Some(&token), Some(&dir));
    let mut forgejo = http_forgejo(c, &url, scope, &token, &[])?;
    drop(token);
    let _lock = take_lock(&dir)?;
    let mut report = Report::new("sweep", false, Timestamp::now());
    report.set_audit(events_file(&dir, c));
    announce_run(&dir, metrics_target(c), report.started_at);
    if let Err(Fatal(_, msg)) = refuse_if_cycle(&dir) {
        // Past the lock: kept in last-run.json, counted in the metrics, exit 1. The report
        // names the cycle in progress that is the reason.
        if let Ok(Some(s)) = read_state_file(&dir.join(crate::state::STATE_FILE)) {
            report.cycle_id = Some(s.cycle_id);
        }
        report.fail(msg);
        report.outcome = "refused".into();
        return finish(
            report,
            End::Done,
            Some(&dir),
            c.local.output,
            metrics_target(c),
        );
    }
    // No cycle.json: no VM can exist. The last destroy that succeeded is named as well.
    let last_destroy = crate::metrics::load(&dir)
        .ok()
        .and_then(|k| k.last_destroy_ok);
    let evidence = match &last_destroy {
        Some(d) => format!(
            "offline, name has our prefix, no cycle in progress (no cycle.json); last successful tofu destroy: cycle {} at {}",
            d.cycle_id.as_deref().unwrap_or("?"),
            d.at.map(|t| t.to_string()).unwrap_or_else(|| "?".into())
        ),
        None => "offline, name has our prefix, no cycle in progress (no cycle.json)".into(),
    };
    let last_destroyed = last_destroy.and_then(|d| d.cycle_id);
    let sw = sweep::sweep_with(
        &mut forgejo,
        &c.runner_prefix,
        c.sweep_max_deletions,
        &mut |r, result| {
            report.sweep_deletion(r, result, last_destroyed.as_deref(), &evidence);
        },
    );
    for failure in sweep::sweep_failures(&sw) {
        report.fail(failure);
    }
    report.outcome = "swept".into();
    report.sweep = Some(sw);
    finish(
        report,
        End::Done,
        Some(&dir),
        c.local.output,
        metrics_target(c),
    )
}

fn refuse_if_cycle(dir: &Path) -> Result<(), Fatal> {
    let path = dir.join(crate::state::STATE_FILE);
    match read_state_file(&path) {
        Ok(None) => Ok(()),
        Ok(Some(s)) => Err(Fatal(
            EXIT_FAILED,
            format!(
                "cycle {} is in progress ({}): a VM may still exist, so the sweep is refused; `run` sweeps after its destroy",
                s.cycle_id,
                path.display()
            ),
        )),
        Err(e) => Err(Fatal(EXIT_FAILED, format!("{e:#}; the sweep is refused"))),
    }
}

fn cmd_status(a: StatusArgs) -> Result<u8, Fatal> {
    let dir = state_dir(&a.local.state_dir);
    // Read-only and often run by root: the owner is not ours to judge here, only that the
    // directory is there (a typo must not look like a host where no run happened yet).
    match fs::metadata(&dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(usage(format!(
                "state directory {} is not a directory; point --state-dir at the pool's state directory",
                dir.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(usage(format!(
                "state directory {} does not exist: is --state-dir right? (the service creates it when it first starts; under the Ansible role it is /var/lib/ci-ephemeral-provisioner/<pool>)",
                dir.display()
            )));
        }
        Err(e) => {
            return Err(Fatal(
                EXIT_FAILED,
                format!("cannot inspect state directory {}: {e}", dir.display()),
            ));
        }
    }
    let limits = crate::status::Limits {
        max_success_age: a.max_success_age,
        max_cycle_duration: a.max_cycle_duration,
    };
    let doc = crate::status::gather(&dir, &limits, Timestamp::now());
    match a.local.output {
        OutputFormat::Json => {
            println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        }
        OutputFormat::Text => println!("{}", crate::status::text(&doc)),
    }
    let healthy = doc["healthy"].as_bool().unwrap_or(false);
    Ok(if a.check && !healthy {
        EXIT_FAILED
    } else {
        EXIT_OK
    })
}
