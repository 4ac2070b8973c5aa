//! The command line. Every flag also reads `CI_EPHEMERAL_PROVISIONER_<FLAG>`; the command line wins.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::adapters::events_file::MIN_MAX_BYTES;
use crate::core::time::parse_duration;

/// `--version`: the crate's version and the commit it was built from (build.rs: `unknown` when
/// built outside a git checkout, `-dirty` when tracked files differed from that commit).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("CI_EPHEMERAL_PROVISIONER_COMMIT"),
    ")"
);

/// The end of `run --help` (and `-h`).
const RUN_EXAMPLES: &str = "\
Examples:
  # A pool's flags (each also CI_EPHEMERAL_PROVISIONER_<FLAG>), tried first: all must pass
  ci-ephemeral-provisioner check --forgejo-url https://forgejo.example.org \\
      --token-file /etc/ci/forgejo-token --labels debian:host \\
      --tofu-dir /etc/ci/module --launch-command /etc/ci/launch.sh
  # What one run would do now, GET requests only: the same flags and --dry-run
  ci-ephemeral-provisioner run --dry-run --forgejo-url https://forgejo.example.org \\
      --token-file /etc/ci/forgejo-token --labels debian:host \\
      --tofu-dir /etc/ci/module --launch-command /etc/ci/launch.sh
  # In a checkout of the source: a plan on a bundled world, no network, no token
  ci-ephemeral-provisioner run --dry-run --fixture fixtures/fresh-cycle.json --labels debian:host";

#[derive(Debug, Parser)]
#[command(
    name = "ci-ephemeral-provisioner",
    version = VERSION,
    about = "Runs VM-isolated, ephemeral Forgejo Actions runners: one provisioner cycle per start.",
    long_about = "Runs VM-isolated, ephemeral Forgejo Actions runners: one provisioner cycle per start.\n\n\
A systemd timer starts `run`. With no cycle in progress and no waiting job it asks Forgejo once and \
exits 0. Otherwise it creates a VM with OpenTofu, registers one ephemeral runner per waiting job and \
starts it on the VM through the launch command, deletes registrations that never consumed themselves, \
runs `tofu destroy` at the end and, only after that destroy succeeded, sweeps the offline \
registrations whose name starts with the runner prefix. At rest there is no VM, no registration and \
no cycle.json.\n\n\
Every flag can also be set through CI_EPHEMERAL_PROVISIONER_<FLAG> (upper case, - as _), e.g. \
CI_EPHEMERAL_PROVISIONER_FORGEJO_URL. A flag on the command line wins.\n\n\
Exit status: 0 success or nothing to do; 1 a step of this run failed; 2 usage or configuration error; \
75 another run holds the lock.",
    after_help = "`run --help` ends with examples; `check` tries a configuration and changes nothing."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
// One value per process, parsed once: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Run one provisioner cycle (the timer's job).
    #[command(after_help = RUN_EXAMPLES)]
    Run(RunCommand),
    /// Delete offline registrations with the runner prefix; refused while a cycle is in progress.
    Sweep(SweepArgs),
    /// Check everything a cycle will need and change nothing: the token file, Forgejo (version
    /// ≥ 15, the token accepted for the scope), the tofu binary and module (init and validate in
    /// a temporary copy), the launch command, the state directory, labels and prefix. Takes the
    /// flags and environment of `run` but --dry-run and --fixture; one line per check; exit 0
    /// when all pass, 1 when one fails, 2 on a usage or configuration error (then it stops there).
    /// With --boot also the canary: one VM booted and probed (75 when the slot is busy).
    Check(CheckArgs),
    /// Show the cycle in progress, the last run, the last events and any warning (with --check:
    /// exit 1 on a warning, a health check). Read-only: takes no lock.
    Status(StatusArgs),
    /// Answer one webhook delivery of Forgejo on the connection systemd passes as fd 3 (a socket
    /// unit with Accept=yes): accept it only with a valid X-Forgejo-Signature for the secret, then
    /// touch each --wake-file (which starts the pools' idle slots through their .path units) and
    /// answer 200; refuse an unsigned, badly signed, oversized, slow or malformed request with a
    /// 4xx saying why. Never needs the Forgejo token. Exit 0 once it answered, 1 when a wake file
    /// or its state could not be written, 2 on a configuration error (no socket, no secret).
    Hook(HookArgs),
}

impl Command {
    /// `-v`, whether this is a dry-run (which logs warnings only), and the command's name: how
    /// to set up logging.
    pub fn logging(&self) -> (bool, bool, &'static str) {
        match self {
            Command::Run(a) => (a.args.common.local.verbose, a.dry.dry_run, "run"),
            Command::Sweep(a) => (a.common.local.verbose, a.dry.dry_run, "sweep"),
            Command::Status(a) => (a.local.verbose, false, "status"),
            Command::Check(a) => (a.args.common.local.verbose, false, "check"),
            Command::Hook(a) => (a.verbose, false, "hook"),
        }
    }
}

/// `--store`: where the pool's state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    Files,
    Pg,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

/// Where Forgejo is and whose registrations are ours: the flags of `run`, `sweep` and `check`
/// that `status --remote` reads too (one definition each: one variable, one default).
#[derive(Debug, Args)]
pub struct ForgejoTarget {
    /// Base URL of Forgejo (≥ 15), e.g. https://forgejo.example.org: required wherever Forgejo
    /// is asked (not by a dry-run with --fixture). Plain http only to loopback; no
    /// user:password@, no #fragment.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_FORGEJO_URL", value_name = "URL")]
    pub forgejo_url: Option<String>,

    /// File holding the Forgejo API token (owned by this user, mode 0600 or stricter), or `-`:
    /// read it from standard input, which no child then sees (what the role does) [default:
    /// $CREDENTIALS_DIRECTORY/forgejo-token when that variable is set].
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_TOKEN_FILE", value_name = "PATH")]
    pub token_file: Option<PathBuf>,

    /// Where runners are registered: admin, user, org/NAME or repo/OWNER/NAME.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_SCOPE",
        default_value = "admin",
        value_name = "SCOPE"
    )]
    pub scope: String,

    /// PEM file of the CA certificates to trust for https, instead of the built-in Mozilla
    /// roots: a private CA, or /etc/ssl/certs/ca-certificates.crt for the system's store.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_CA_FILE", value_name = "PATH")]
    pub ca_file: Option<PathBuf>,

    /// Timeout of each Forgejo request, from connecting to the end of the body. Redirects are
    /// not followed; HTTPS_PROXY, HTTP_PROXY and ALL_PROXY are honoured for https, never for
    /// a loopback URL.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_HTTP_TIMEOUT", default_value = "30s", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub http_timeout: Duration,

    /// Name prefix of our registrations (`<prefix><cycle id>-<n>-<time>`). Only registrations
    /// with this prefix are ever deleted. Must not be empty; at most 128 bytes. Give each pool
    /// on each host its own, never the start of another's: a sweep deletes every offline
    /// registration with its prefix.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_RUNNER_PREFIX",
        default_value = "ephemeral-",
        value_name = "PREFIX"
    )]
    pub runner_prefix: String,

    /// At most this many registrations deleted by one sweep (the rest is reported and left for the next).
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_SWEEP_MAX_DELETIONS",
        default_value_t = 50,
        value_name = "N"
    )]
    pub sweep_max_deletions: usize,
}

#[derive(Debug, Args)]
pub struct ForgejoArgs {
    #[command(flatten)]
    pub target: ForgejoTarget,

    /// The audit trail <state-dir>/events.jsonl is rotated to events.jsonl.1 past this size
    /// (so it takes at most twice this). Written as 10MiB, 512KiB or bytes; at least 16KiB.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_EVENTS_MAX_BYTES", default_value = "10MiB", value_parser = crate::cli::parse_bytes, value_name = "SIZE")]
    pub events_max_bytes: u64,

    /// Prometheus text file written (atomically, mode 0644) when a run or sweep gets past the
    /// lock (with run_in_progress 1) and again when it ends (and as check --boot's VM comes and
    /// goes), for node_exporter's textfile collector, e.g.
    /// /var/lib/prometheus/node-exporter/ci-ephemeral-provisioner.prom. Must end in .prom.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_METRICS_FILE",
        value_name = "PATH"
    )]
    pub metrics_file: Option<PathBuf>,

    /// Name of this pool: every sample in --metrics-file then carries the label pool="NAME", so
    /// the files of several pools on one host can share node_exporter's textfile directory.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_METRICS_POOL",
        value_name = "NAME",
        requires = "metrics_file",
        value_parser = parse_pool_name
    )]
    pub metrics_pool: Option<String>,

    #[command(flatten)]
    pub local: LocalArgs,
}

/// `run`: what `check` takes too, and the dry-run's flags.
#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub struct RunCommand {
    #[command(flatten)]
    pub args: RunArgs,

    #[command(flatten)]
    pub dry: DryRunArgs,
}

/// The flags of a dry-run (`run` and `sweep`; `check` never acts, so it has none of them).
#[derive(Debug, Args)]
pub struct DryRunArgs {
    /// Never POST, DELETE, run tofu, lock or write: only GET requests; print the plan and exit 0
    /// (1 when the world could not be read, so the plan is incomplete).
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_DRY_RUN")]
    pub dry_run: bool,

    /// With --dry-run: take the world from this JSON file instead of Forgejo (no network, no token,
    /// no state dir). Format: {"runners": [...], "jobs": [...] or null, and optionally "cycle":
    /// <cycle.json or null> and "now": "<RFC 3339>"}; any other key is an error, except comments
    /// in keys that start with _.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_FIXTURE",
        value_name = "FILE",
        requires = "dry_run"
    )]
    pub fixture: Option<PathBuf>,
}

/// The flags of `run` that `check` takes too.
#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub struct RunArgs {
    #[command(flatten)]
    pub common: ForgejoArgs,

    /// Runner labels, comma-separated, each NAME:SCHEME as forgejo-runner's --label reads it,
    /// e.g. debian:host: required. Schemes: host (jobs run on the VM), docker (also a NAME
    /// alone; needs a Docker engine on the VM), lxc; blanks around a name or scheme, empty
    /// entries and other schemes are refused. Jobs match when their runs_on ⊆ the label names.
    /// The launch command gets them as RUNNER_LABELS and must pass each entry to forgejo-runner
    /// as --label: a runner without labels is given no job.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_LABELS", value_name = "LIST")]
    pub labels: Option<String>,

    #[command(flatten)]
    pub module: ModuleArgs,

    /// Program that starts one runner on the VM: no arguments, RUNNER_* / JOB_HANDLE /
    /// FORGEJO_URL / TOFU_OUTPUT_* in its environment, the runner token as one line on stdin.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_LAUNCH_COMMAND",
        value_name = "PATH"
    )]
    pub launch_command: Option<PathBuf>,

    #[command(flatten)]
    pub grace: GraceArgs,

    /// Runners started on one VM before it is torn down; 1 gives every job a VM of its own.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_MAX_JOBS_PER_VM",
        default_value_t = 10,
        value_name = "N"
    )]
    pub max_jobs_per_vm: u32,

    /// Whose jobs may follow each other on one VM: repo (jobs of the repository of the VM's
    /// first job), owner (of that repository's owner) or pool (any job the pool serves). A job
    /// outside gets a fresh VM.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_REUSE_WITHIN",
        value_enum,
        default_value = "repo",
        value_name = "BOUNDARY"
    )]
    pub reuse_within: crate::core::planner::ReuseWithin,

    /// Tear down when no job has waited for this long while the VM was free.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_IDLE_TIMEOUT", default_value = "5m", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub idle_timeout: Duration,

    /// How long after its launch our runner may sit idle while its job is still listed as
    /// waiting (Forgejo holds it back, e.g. behind a concurrency group) before the VM goes and the
    /// job is held: no runner is registered for it again for this long, twice as long each time
    /// after, at most 1h (or this long, if it is longer).
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_JOB_PICKUP_TIMEOUT", default_value = "10m", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub job_pickup_timeout: Duration,

    /// How often Forgejo is asked while a cycle runs.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_POLL_INTERVAL", default_value = "5s", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub poll_interval: Duration,

    /// No new registration after this; the VM is torn down once free.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_MAX_CYCLE_DURATION", default_value = "6h", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub max_cycle_duration: Duration,

    /// Past this the VM is torn down even with a runner up (an error, exit 1). Not shorter than
    /// --max-cycle-duration.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_HARD_DEADLINE", default_value = "24h", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub hard_deadline: Duration,

    /// After this many cycles of the pool in a row ended with a failure (apply, launch, a runner
    /// that never connected, wrong labels, destroy) and without serving a job, no slot of the
    /// pool starts a new VM for --failure-backoff (doubled with each further failed cycle, at
    /// most --failure-backoff-max); runs meanwhile exit 0 saying until when. A cycle that serves
    /// a job ends it. 0 turns the backoff off.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_MAX_FAILED_CYCLES",
        default_value_t = 3,
        value_name = "N"
    )]
    pub max_failed_cycles: u32,

    /// The first backoff after --max-failed-cycles failed cycles (at least 1s).
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_FAILURE_BACKOFF", default_value = "2m", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub failure_backoff: Duration,

    /// The longest backoff, however many cycles failed (not shorter than --failure-backoff).
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_FAILURE_BACKOFF_MAX", default_value = "1h", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub failure_backoff_max: Duration,
    /// Unused VMs the pool keeps booted, so that a job is launched at the next poll, with no VM
    /// boot on its way. A run with no job to serve makes one (tofu apply, no registration) while
    /// fewer are up, and waits on it for a job (asking Forgejo every --poll-interval); its first
    /// job may be any repository's, and --reuse-within applies after it. A warm VM occupies a
    /// slot (at most --slots); none is made while the pool backs off. 0: none.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_WARM",
        default_value_t = 0,
        value_name = "N"
    )]
    pub warm: u32,

    /// An unused warm VM older than this (since its apply) is destroyed, and a later run makes a
    /// new one (images change). At least 10 × --poll-interval.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_WARM_MAX_AGE", default_value = "1h", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub warm_max_age: Duration,

    /// When --warm applies, in UTC: comma-separated windows `[DAYS ]HH:MM-HH:MM`, DAYS a day,
    /// a range or days joined by `+`, e.g. 'Mon..Fri 07:00-19:00, Sat 09:00-13:00'. Outside them
    /// the pool keeps no warm VM. Unset: always.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_WARM_DURING", value_parser = crate::core::warm::Windows::parse, value_name = "WINDOWS")]
    pub warm_during: Option<crate::core::warm::Windows>,

    /// The file the webhook receiver (`hook --wake-file`) touches for this slot. Its change ends
    /// a wait at once; for --wake-window after it, a run looks for jobs every second (or every
    /// --poll-interval, if shorter) and one with nothing to do keeps looking instead of exiting
    /// (for at most 10 windows in all). Unset: no webhooks, the timer alone.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_WAKE_FILE", value_name = "PATH")]
    pub wake_file: Option<PathBuf>,

    /// How long after a webhook delivery a run keeps looking for its jobs (Forgejo may deliver a
    /// push before it has written the push's jobs). 0s: one look. At most 10m.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_WAKE_WINDOW", default_value = "30s", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub wake_window: Duration,
}

/// `check`: the flags of `run`, and the canary.
#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub struct CheckArgs {
    #[command(flatten)]
    pub args: RunArgs,

    /// Also boot one VM (the canary): tofu apply of the module, the launch command asked to
    /// probe it (RUNNER_ACTION=probe: reachable, ready, forgejo-runner's --version), tofu
    /// destroy whatever happened. Fails when the runner is older than 12.8; prints its version
    /// and how long apply, readiness and destroy took. No registration is made. Takes the slot's
    /// lock and is refused (exit 75) while the slot has a cycle in progress; a canary VM left by
    /// a killed one is destroyed by the next run or canary.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_BOOT")]
    pub boot: bool,
}

#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub struct SweepArgs {
    #[command(flatten)]
    pub common: ForgejoArgs,

    #[command(flatten)]
    pub dry: DryRunArgs,

    #[command(flatten)]
    pub grace: GraceArgs,
}

#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub struct StatusArgs {
    /// Exit 1 when there is a warning (a health check): no success within --max-success-age,
    /// none since runs began (or no run at all), the last destroy failed, a cycle older than
    /// --max-cycle-duration, the pool backing off (its failure backoff), an unreadable state file.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_CHECK")]
    pub check: bool,

    /// Warn when the last successful run ended longer ago than this.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_MAX_SUCCESS_AGE", default_value = "1h", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub max_success_age: Duration,

    /// Warn when the cycle in progress started longer ago than this (the `run` flag of the same
    /// name and variable).
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_MAX_CYCLE_DURATION", default_value = "6h", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub max_cycle_duration: Duration,

    #[command(flatten)]
    pub remote: RemoteArgs,

    #[command(flatten)]
    pub local: LocalArgs,
}

/// `status --remote`, and the flags it reads: those of `run` and `sweep` of the same names and
/// variables (so the pool's environment file serves it as it is).
#[derive(Debug, Args)]
pub struct RemoteArgs {
    /// Also show what the pool owns outside this host, read-only: its registrations in Forgejo
    /// (GET requests only; each with the cycle that holds it and what a sweep would do with it)
    /// and the resources in the module's tofu state (`tofu show -json`; none without
    /// --tofu-dir). Takes the Forgejo flags of `sweep` and --tofu-bin, --tofu-dir of `run`; the
    /// token must be readable by this user (or on standard input, --token-file -).
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_REMOTE")]
    pub remote: bool,

    #[command(flatten)]
    pub target: ForgejoTarget,

    #[command(flatten)]
    pub grace: GraceArgs,

    #[command(flatten)]
    pub module: ModuleArgs,
}

/// How young a registration a sweep spares (with twice --http-timeout): `run`'s, `sweep`'s and
/// `status --remote`'s.
#[derive(Debug, Args)]
pub struct GraceArgs {
    /// How long a launched registration may stay offline (starting) before it is deleted (as
    /// never connected when Forgejo never saw it idle or active: a failed start); also how long an
    /// idle runner may outlive its job. With --launch-timeout and twice --http-timeout: how young
    /// a registration (by the time in its name) a sweep spares.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_REGISTRATION_GRACE", default_value = "3m", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub registration_grace: Duration,

    /// The launch command is killed after this long and counts as failed (see
    /// --registration-grace).
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_LAUNCH_TIMEOUT", default_value = "2m", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub launch_timeout: Duration,
}

/// The VM module: `run`'s and `check`'s, whose state `status --remote` reads.
#[derive(Debug, Args)]
pub struct ModuleArgs {
    /// The OpenTofu binary (terraform is CLI-compatible).
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_TOFU_BIN",
        default_value = "tofu",
        value_name = "PATH"
    )]
    pub tofu_bin: PathBuf,

    /// Directory of the VM module (a run needs it once a cycle must start; status --remote
    /// reads its state). It gets the variable `cycle_id` (TF_VAR_cycle_id).
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_TOFU_DIR", value_name = "DIR")]
    pub tofu_dir: Option<PathBuf>,
}

/// `hook`: the webhook receiver's flags.
#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub struct HookArgs {
    /// The webhook's secret, as set in Forgejo (surrounding whitespace dropped; must not be
    /// empty) [default: $CREDENTIALS_DIRECTORY/webhook-secret (systemd's LoadCredential=)]. A
    /// file given here must be owned by this user, mode 0600 or 0400.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_SECRET_FILE",
        value_name = "PATH"
    )]
    pub secret_file: Option<PathBuf>,

    /// A file to touch (created when missing) for each accepted delivery: one per slot of each
    /// pool to wake, the --wake-file of that slot's runs. An absolute path; at least one.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_WAKE_FILE",
        value_name = "PATH",
        required = true,
        value_delimiter = ','
    )]
    pub wake_file: Vec<PathBuf>,

    /// Directory of hook-state.json (the delivery ids seen last and the counts by reason)
    /// [default: $STATE_DIRECTORY, else /var/lib/ci-ephemeral-provisioner-hook].
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

    /// Prometheus text file (.prom) written after each request: the requests by outcome and
    /// reason, when the pools were last woken.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_METRICS_FILE",
        value_name = "PATH"
    )]
    pub metrics_file: Option<PathBuf>,

    /// The whole request must have arrived within this long, or it is refused as slow (408).
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_READ_TIMEOUT", default_value = "10s", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub read_timeout: Duration,

    /// Debug logging on stderr (RUST_LOG overrides).
    #[arg(short, long, env = "CI_EPHEMERAL_PROVISIONER_VERBOSE")]
    pub verbose: bool,
}

/// Flags every subcommand has: where the state lives, how to print, how much to log.
#[derive(Debug, Args)]
pub struct LocalArgs {
    /// Directory of cycle.json, cycle.lock, last-run.json, events.jsonl (and events.jsonl.1),
    /// counters.json, held-jobs.json and the pool's backoff.json; owned by this user, not
    /// writable by group or others
    /// [default: $STATE_DIRECTORY, else /var/lib/ci-ephemeral-provisioner].
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

    /// How many slots the pool has, 1 to 64: that many runs of this pool, one per slot, serve its
    /// jobs at once, each with its own VM. All slots share --state-dir, --tofu-dir,
    /// --runner-prefix and --labels.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_SLOTS",
        default_value_t = 1,
        value_name = "N"
    )]
    pub slots: u32,

    /// Which slot of the pool this is (1 to --slots). Slot 1 keeps its files in the state
    /// directory, slot K ≥ 2 in its slot-K/ directory; tofu runs slot K ≥ 2 in the workspace
    /// slot-K with its own TF_DATA_DIR, and every slot's module gets TF_VAR_slot.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_SLOT",
        default_value_t = 1,
        value_name = "K"
    )]
    pub slot: u32,

    /// Where the pool's state lives: files (in --state-dir: a pool of one host) or pg (in
    /// PostgreSQL, for a pool whose hosts serve one set of jobs with one --runner-prefix; the
    /// connection from PG_CONN_STR in the environment, as OpenTofu's pg backend reads it, and
    /// the module's tofu state must be in PostgreSQL too). With pg, every host of the pool
    /// renews a lease there, and a live host adopts and tears down the cycles of a host whose
    /// lease lapsed. last-run.json, events.jsonl, counters.json and the metrics stay local.
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_STORE",
        value_enum,
        default_value = "files",
        value_name = "STORE"
    )]
    pub store: StoreKind,

    /// With --store pg (required there): the pool this host serves, as every host of it names
    /// it (1 to 63 of letters, digits, '-', '_', '.'). Its tofu workspaces are POOL-CYCLE_ID.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_POOL", value_name = "NAME")]
    pub pool: Option<String>,

    /// With --store pg: this host's id in the pool [default: the host name]. Two live hosts (or
    /// two state directories) with one id are refused.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_HOST_ID", value_name = "NAME")]
    pub host_id: Option<String>,

    /// With --store pg: how long a host may be silent (no run renewing its lease, on the
    /// database's clock) before another host adopts its cycles: several times the timer's
    /// interval. A running process renews it every third of it.
    #[arg(long, env = "CI_EPHEMERAL_PROVISIONER_LEASE", default_value = "2m", value_parser = parse_duration, value_name = "DURATION", allow_hyphen_values = true)]
    pub lease: Duration,

    /// text (a short summary) or json (one JSON document on stdout).
    #[arg(
        long,
        env = "CI_EPHEMERAL_PROVISIONER_OUTPUT",
        value_enum,
        default_value = "text",
        value_name = "FORMAT"
    )]
    pub output: OutputFormat,

    /// Debug logging on stderr (RUST_LOG overrides).
    #[arg(short, long, env = "CI_EPHEMERAL_PROVISIONER_VERBOSE")]
    pub verbose: bool,
}

/// A pool name for the `pool` label: 1–64 of letters, digits, `-`, `_`, `.` (what a systemd
/// instance name and an Ansible pool name comfortably hold).
fn parse_pool_name(s: &str) -> anyhow::Result<String> {
    let ok = (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(s.to_string())
    } else {
        Err(anyhow!(
            "{s:?} is not a pool name: use 1 to 64 letters, digits, '-', '_' or '.'"
        ))
    }
}

/// Parses `--events-max-bytes`: `10MiB`, `512KiB`, `1GiB` or plain bytes.
pub fn parse_bytes(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let (digits, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1024,
        "M" | "MiB" => 1024 * 1024,
        "G" | "GiB" => 1024 * 1024 * 1024,
        _ => return Err(anyhow!("{s:?} is not a size like 10MiB, 512KiB or 1048576")),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| anyhow!("{s:?} is not a size like 10MiB, 512KiB or 1048576"))?;
    let bytes = n
        .checked_mul(mult)
        .ok_or_else(|| anyhow!("{s:?} is too large"))?;
    if bytes < MIN_MAX_BYTES {
        bail!("{s:?} is below the minimum of {} KiB", MIN_MAX_BYTES / 1024);
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use std::collections::BTreeMap;
    use std::ffi::OsString;

    // Mutation caught: a flag that two commands define each for itself (status's
    // --max-cycle-duration beside run's, or a copy of a shared group's) with another default or
    // variable than the other's, or a variable that is not CI_EPHEMERAL_PROVISIONER_<FLAG>.
    #[test]
    fn a_flag_has_one_variable_and_one_default_in_every_command() {
        type Seen = (String, Option<OsString>, Vec<OsString>);
        let cli = Cli::command();
        let mut seen: BTreeMap<String, Seen> = BTreeMap::new();
        for sub in cli.get_subcommands() {
            for arg in sub.get_arguments() {
                let Some(long) = arg.get_long() else {
                    continue;
                };
                let env = arg.get_env().map(|e| e.to_os_string());
                if let Some(e) = &env {
                    let want = format!(
                        "CI_EPHEMERAL_PROVISIONER_{}",
                        long.to_uppercase().replace('-', "_")
                    );
                    assert_eq!(e.to_str(), Some(want.as_str()), "--{long}");
                }
                let defaults: Vec<OsString> = arg
                    .get_default_values()
                    .iter()
                    .map(|d| d.to_os_string())
                    .collect();
                match seen.get(long) {
                    Some((first, e, d)) => assert_eq!(
                        (e, d),
                        (&env, &defaults),
                        "--{long} of {} and of {first}",
                        sub.get_name()
                    ),
                    None => {
                        seen.insert(
                            long.to_string(),
                            (sub.get_name().to_string(), env, defaults),
                        );
                    }
                }
            }
        }
        // Every command's flags were seen, and those `status --remote` shares with `run`.
        for long in ["labels", "remote", "boot", "tofu-dir", "registration-grace"] {
            assert!(seen.contains_key(long), "--{long} not seen: {seen:?}");
        }
    }
}
