//! One file per command (`run`, `sweep`, `status`, `check`) and what they share: exit codes,
//! the configuration checks and (`wiring`) the one choice of implementations for live runs and
//! dry-runs.

pub mod check;
pub mod run;
pub mod status;
pub mod sweep;
pub mod wiring;

use std::path::{Path, PathBuf};

use crate::adapters::files::SlotDir;
use crate::adapters::files::{read_state_file, write_atomic};
use crate::adapters::forgejo_http::Scope;
use crate::adapters::forgejo_http::validate_url;
use crate::cli::DryRunArgs;
use crate::cli::ForgejoArgs;
use crate::cli::LocalArgs;
use crate::cli::OutputFormat;
use crate::cli::RunArgs;
use crate::core::escape::escape_controls;
use crate::core::labels::Labels;
use crate::core::planner::Policy;
use crate::core::report::Report;
use crate::core::secret::Secret;
use crate::core::time::Timestamp;
use crate::driver::cycle::CycleConfig;
use crate::driver::cycle::End;
use anyhow::anyhow;
use serde_json::{Value, json};

pub const EXIT_OK: u8 = 0;

pub const EXIT_FAILED: u8 = 1;

pub const EXIT_USAGE: u8 = 2;

pub const EXIT_LOCKED: u8 = 75;

pub const LAST_RUN_FILE: &str = "last-run.json";

/// A reason to stop before doing anything, with its exit status.
pub struct Fatal(pub u8, pub String);

pub(crate) fn usage(msg: impl Into<String>) -> Fatal {
    Fatal(EXIT_USAGE, msg.into())
}

impl From<crate::adapters::files::StateDirError> for Fatal {
    fn from(e: crate::adapters::files::StateDirError) -> Fatal {
        use crate::adapters::files::StateDirError::*;
        match e {
            Unsafe(m) => Fatal(EXIT_USAGE, m),
            Locked(m) => Fatal(EXIT_LOCKED, m),
            Failed(m) => Fatal(EXIT_FAILED, m),
        }
    }
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

/// This run's slot of the pool in the state directory (`--slots`, `--slot`).
pub(crate) fn slot_dir(local: &LocalArgs) -> Result<SlotDir, Fatal> {
    let max = crate::core::slots::MAX_SLOTS;
    if !(1..=max).contains(&local.slots) {
        return Err(usage(format!(
            "--slots {} is out of range: a pool has 1 to {max} slots",
            local.slots
        )));
    }
    if !(1..=local.slots).contains(&local.slot) {
        return Err(usage(format!(
            "--slot {} is out of range: with --slots {} it is 1 to {}",
            local.slot, local.slots, local.slots
        )));
    }
    Ok(SlotDir {
        pool: state_dir(&local.state_dir),
        k: local.slot,
        n: local.slots,
    })
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
        Some(p) if p.as_os_str() == crate::core::secret::STDIN_PATH => {
            return crate::adapters::token::read_token_stdin().map_err(|e| usage(format!("{e:#}")));
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
    crate::adapters::token::read_token_file(&path).map_err(|e| usage(format!("{e:#}")))
}

/// `--fixture` only makes sense for a dry-run (clap's `requires` is satisfied by a
/// `…_DRY_RUN=false` variable, so this checks the value).
pub(crate) fn check_fixture(dry: &DryRunArgs) -> Result<(), Fatal> {
    if dry.fixture.is_some() && !dry.dry_run {
        return Err(usage(
            "--fixture needs --dry-run: a fixture world can only be planned against, never acted on",
        ));
    }
    Ok(())
}

/// Longest `--runner-prefix`: with the cycle id, sequence number and time a name stays well
/// within Forgejo's 255 bytes. (`CreateRunner` would cut a longer name to 252 bytes and "…" and
/// answer 201, `models/actions/runner.go`: the lost-POST lookup by exact name and the time the
/// sweep reads at the end of a name would then fail.)
pub const MAX_PREFIX_BYTES: usize = 128;

pub(crate) fn check_prefix(prefix: &str) -> Result<(), Fatal> {
    if prefix.is_empty() {
        return Err(usage(
            "--runner-prefix must not be empty: it is the only mark of the registrations this tool may delete",
        ));
    }
    if prefix.len() > MAX_PREFIX_BYTES {
        return Err(usage(format!(
            "--runner-prefix is {} bytes long; at most {MAX_PREFIX_BYTES}: runner names (prefix, cycle id, number, time) must fit Forgejo's 255 bytes, past which it cuts them",
            prefix.len()
        )));
    }
    Ok(())
}

pub(crate) fn forgejo_target(common: &ForgejoArgs) -> Result<(String, Scope), Fatal> {
    let url = common.forgejo_url.as_deref().ok_or_else(|| {
        usage("--forgejo-url is required (or CI_EPHEMERAL_PROVISIONER_FORGEJO_URL)")
    })?;
    let url = validate_url(url).map_err(|e| usage(format!("--forgejo-url: {e:#}")))?;
    let scope = Scope::parse(&common.scope).map_err(|e| usage(format!("--scope: {e:#}")))?;
    Ok((url, scope))
}

pub(crate) fn policy(a: &RunArgs, labels: &Labels) -> Policy {
    Policy {
        runner_prefix: a.common.runner_prefix.clone(),
        label_names: labels.names(),
        max_jobs_per_vm: a.max_jobs_per_vm,
        idle_timeout: a.idle_timeout,
        registration_grace: a.registration_grace,
        max_cycle_duration: a.max_cycle_duration,
        hard_deadline: a.hard_deadline,
        // Twice the longest a POST can take from our side: by then it has landed or never will.
        intent_settle: a.common.http_timeout.saturating_mul(2),
        job_pickup_timeout: a.job_pickup_timeout,
        share: a.share,
        take_over_after: a.take_over_after,
        sweep_min_age: crate::core::slots::sweep_min_age(
            a.registration_grace,
            a.launch_timeout,
            a.common.http_timeout.saturating_mul(2),
        ),
        reuse_within: a.reuse_within,
        warm: crate::core::warm::WarmPolicy {
            count: a.warm,
            max_age: a.warm_max_age,
            during: a.warm_during.clone().unwrap_or_default(),
        },
    }
}

pub(crate) fn cycle_config(
    a: &RunArgs,
    policy: Policy,
    labels: &Labels,
    forgejo_url: String,
) -> CycleConfig {
    CycleConfig {
        policy,
        poll_interval: a.poll_interval,
        labels: labels.given().to_string(),
        forgejo_url,
        sweep_max_deletions: a.common.sweep_max_deletions,
        slot: a.common.local.slot,
        backoff: backoff_policy(a),
    }
}

pub(crate) fn backoff_policy(a: &RunArgs) -> crate::core::backoff::BackoffPolicy {
    crate::core::backoff::BackoffPolicy {
        max_failed_cycles: a.max_failed_cycles,
        initial: a.failure_backoff,
        max: a.failure_backoff_max,
    }
}

/// The checks of `run`'s flags that need no I/O; the labels, when they pass.
pub(crate) fn validate_run_args(a: &RunArgs) -> Result<Labels, Fatal> {
    check_prefix(&a.common.runner_prefix)?;
    slot_dir(&a.common.local)?;
    let labels = Labels::parse(a.labels.as_deref().unwrap_or_default())
        .map_err(|e| usage(e.to_string()))?
        .ok_or_else(|| {
            usage("--labels is required: the runner labels this pool serves, e.g. --labels debian:host")
        })?;
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
            crate::core::time::format_duration(a.hard_deadline),
            crate::core::time::format_duration(a.max_cycle_duration)
        )));
    }
    backoff_policy(a).check().map_err(usage)?;
    if a.warm > a.common.local.slots {
        return Err(usage(format!(
            "--warm {} is more than --slots {}: a warm VM occupies a slot; raise --slots or lower --warm",
            a.warm, a.common.local.slots
        )));
    }
    // A warm VM that lives only a few polls is boots and destroys for nothing.
    if a.warm > 0 && a.warm_max_age < a.poll_interval.saturating_mul(10) {
        return Err(usage(format!(
            "--warm-max-age ({}) must be at least 10 times --poll-interval ({}): a warm VM replaced after a few polls costs boots for nothing",
            crate::core::time::format_duration(a.warm_max_age),
            crate::core::time::format_duration(a.poll_interval)
        )));
    }
    check_metrics_file(&a.common)?;
    Ok(labels)
}

pub(crate) fn events_file(
    dir: &Path,
    common: &ForgejoArgs,
) -> Box<crate::adapters::events_file::EventsFile> {
    Box::new(crate::adapters::events_file::EventsFile::new(
        dir,
        common.events_max_bytes,
    ))
}

/// The metrics file at the start of a run: the counters so far, and that a run is in progress.
/// A failure here is only logged: the write at the end of the run reports it.
/// Where the metrics go, and the `pool` label they carry.
#[derive(Clone)]
pub(crate) struct MetricsTarget<'a> {
    path: &'a Path,
    /// `pool` (`--metrics-pool`) and, in a pool of several slots, `slot`.
    labels: Vec<(&'static str, String)>,
    /// The pool's state directory (its failure backoff).
    pool: PathBuf,
}

pub(crate) fn metrics_target(common: &ForgejoArgs) -> Option<MetricsTarget<'_>> {
    common.metrics_file.as_deref().map(|path| {
        let mut labels = Vec::new();
        if let Some(pool) = &common.metrics_pool {
            labels.push(("pool", pool.clone()));
        }
        if common.local.slots > 1 {
            labels.push(("slot", common.local.slot.to_string()));
        }
        MetricsTarget {
            path,
            labels,
            pool: state_dir(&common.local.state_dir),
        }
    })
}

pub(crate) fn announce_run(dir: &Path, metrics: Option<MetricsTarget<'_>>, started: Timestamp) {
    let Some(MetricsTarget { path, labels, pool }) = metrics else {
        return;
    };
    let counters = crate::adapters::files::load_counters(dir).unwrap_or_else(|e| {
        log::warn!("{e:#}; the metrics file shows the counters from zero until a run rewrites it");
        crate::core::metrics::Counters::default()
    });
    let cycle = read_state_file(&dir.join(crate::core::state::STATE_FILE));
    let backoff = pool_backoff(&pool);
    let text = crate::core::metrics::render(
        &counters,
        &cycle_view(&cycle),
        backoff.as_ref(),
        Some(started),
        &labels,
    );
    if let Err(e) = crate::adapters::files::write_textfile(path, &text) {
        log::warn!("--metrics-file: {e:#}");
    }
}

/// The pool's failure backoff for the metrics; none when it cannot be read (the run that
/// needs it reports that).
fn pool_backoff(pool: &Path) -> Option<crate::core::backoff::Backoff> {
    crate::adapters::files::read_backoff_file(&pool.join(crate::core::backoff::BACKOFF_FILE))
        .inspect_err(|e| log::warn!("{e:#}; the metrics file shows no failure backoff"))
        .ok()
}

fn cycle_view(
    cycle: &anyhow::Result<Option<crate::core::state::CycleState>>,
) -> crate::core::metrics::CycleView<'_> {
    match cycle {
        Ok(None) => crate::core::metrics::CycleView::None,
        Ok(Some(s)) => crate::core::metrics::CycleView::Active(s),
        Err(_) => crate::core::metrics::CycleView::Unreadable,
    }
}

/// Adds the run to counters.json and writes the metrics file. A failure to write either is a
/// failure of the run (exit 1), reported like any other.
fn record_run(dir: &Path, metrics: Option<MetricsTarget<'_>>, report: &mut Report) {
    let before = match crate::adapters::files::load_counters(dir) {
        Ok(c) => c,
        Err(e) => {
            log::warn!("{e:#}; the counters start again from zero");
            crate::core::metrics::Counters::default()
        }
    };
    let mut counters = before.clone();
    counters.record(report);
    if let Some(MetricsTarget { path, labels, pool }) = metrics {
        let cycle = read_state_file(&dir.join(crate::core::state::STATE_FILE));
        let backoff = pool_backoff(&pool);
        let text = crate::core::metrics::render(
            &counters,
            &cycle_view(&cycle),
            backoff.as_ref(),
            None,
            &labels,
        );
        if let Err(e) = crate::adapters::files::write_textfile(path, &text) {
            report.fail(format!("--metrics-file: {e:#}"));
            report.settle();
            counters = before.clone();
            counters.record(report);
        }
    }
    if let Err(e) = crate::adapters::files::save_counters(dir, &counters) {
        report.fail(format!("{e:#}"));
        report.settle();
    }
}

/// Sets the exit status, records the run (counters, metrics file), keeps the report as
/// last-run.json, prints it.
pub(crate) fn finish(
    mut report: Report,
    end: End,
    dir: Option<&Path>,
    output: OutputFormat,
    metrics: Option<MetricsTarget<'_>>,
) -> Result<u8, Fatal> {
    if let End::Config(msg) = end {
        // Kept in last-run.json too: `status` must show why runs stopped doing anything.
        report.fail(msg);
        report.outcome = crate::core::report::Outcome::ConfigurationError;
    }
    let end_at = report.now();
    report.finished_at = Some(end_at);
    report.duration_ms = end_at.since(report.started_at).as_millis() as u64;
    report.settle();
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

pub(crate) fn print_plan(actions: &[Value], report: &Report, output: OutputFormat) {
    match output {
        OutputFormat::Json => {
            // One document: the plan, how it ends, and the errors it met (logged on stderr).
            let failures = report.failures.len() as u64 + report.failures_not_listed;
            let doc =
                json!({ "actions": actions, "outcome": report.outcome, "failures": failures });
            println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        }
        OutputFormat::Text => {
            if actions.is_empty() {
                println!(
                    "plan: nothing to do ({})",
                    escape_controls(&report.outcome.to_string())
                );
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
                println!("then: {}", escape_controls(&report.outcome.to_string()));
            }
            let failures = report.failures.len() as u64 + report.failures_not_listed;
            if failures > 0 {
                println!("{failures} error(s), logged above");
            }
        }
    }
}

#[cfg(test)]
mod name_tests {
    use super::MAX_PREFIX_BYTES;
    use crate::core::slots::{MAX_SLOTS, registered_at, registration_name};
    use crate::core::time::Timestamp;
    use forgejo_model::rules::{RUNNER_NAME_MAX_BYTES, stored_runner_name};

    /// The longest name the product registers (the longest prefix, a cycle id of the last slot,
    /// the largest sequence number) is stored by Forgejo as sent: its lost-POST lookup by exact
    /// name and the sweep's reading of its time still work.
    #[test]
    fn the_longest_registration_name_is_stored_as_sent() {
        let at = Timestamp::parse_rfc3339("2099-12-31T23:59:59Z").unwrap();
        let prefix = "é".repeat(MAX_PREFIX_BYTES / 2);
        assert_eq!(prefix.len(), MAX_PREFIX_BYTES);
        assert!(super::check_prefix(&prefix).is_ok());
        assert!(super::check_prefix(&format!("{prefix}x")).is_err());
        let cycle_id = format!("{}-ffff-s{MAX_SLOTS}", at.compact());
        let name = registration_name(&prefix, &cycle_id, u32::MAX, at);
        assert!(name.len() <= RUNNER_NAME_MAX_BYTES, "{} bytes", name.len());
        assert_eq!(stored_runner_name(&name), name);
        assert_eq!(registered_at(&name), Some(Ok(at)));
        // What Forgejo would do to a longer one: the time at its end would be lost.
        let long = format!("{}{name}", "x".repeat(RUNNER_NAME_MAX_BYTES));
        assert_eq!(registered_at(&stored_runner_name(&long)), None);
    }
}
