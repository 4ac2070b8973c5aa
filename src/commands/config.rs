//! Reading and checking the configuration: the flags (their checks that need no I/O), the
//! environment (`STATE_DIRECTORY`, `CREDENTIALS_DIRECTORY`), the token, and what the core is
//! given of them (the policy, the cycle's configuration, the sweep's minimum age).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::adapters::files::SlotDir;
use crate::adapters::forgejo_http::{Scope, validate_url};
use crate::cli::{DryRunArgs, ForgejoArgs, LocalArgs, RunArgs};
use crate::commands::exit::{Fatal, usage};
use crate::core::backoff::BackoffPolicy;
use crate::core::labels::Labels;
use crate::core::planner::Policy;
use crate::core::secret::Secret;
use crate::core::time::format_duration;
use crate::core::warm::WarmPolicy;
use crate::driver::cycle::CycleConfig;

/// `--metrics-file` must be a `.prom` file: node_exporter's textfile collector reads no other.
pub(crate) fn check_metrics_file(common: &ForgejoArgs) -> Result<(), Fatal> {
    match &common.metrics_file {
        Some(p) => check_metrics_path(p),
        None => Ok(()),
    }
}

/// `--metrics-file` of any command.
pub(crate) fn check_metrics_path(p: &Path) -> Result<(), Fatal> {
    if p.extension().and_then(|e| e.to_str()) != Some("prom") {
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

/// The pool's state directory: `--state-dir`, else systemd's `$STATE_DIRECTORY`, else
/// `/var/lib/ci-ephemeral-provisioner`.
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

/// Where Forgejo is (`--forgejo-url`, checked) and whose runners are ours (`--scope`).
pub(crate) fn forgejo_target(common: &ForgejoArgs) -> Result<(String, Scope), Fatal> {
    let url = common.target.forgejo_url.as_deref().ok_or_else(|| {
        usage("--forgejo-url is required (or CI_EPHEMERAL_PROVISIONER_FORGEJO_URL)")
    })?;
    let url = validate_url(url).map_err(|e| usage(format!("--forgejo-url: {e:#}")))?;
    let scope = Scope::parse(&common.target.scope).map_err(|e| usage(format!("--scope: {e:#}")))?;
    Ok((url, scope))
}

/// How long after a registration's POST it has landed or never will: twice the longest a POST
/// can take from our side (`--http-timeout`).
pub(crate) fn intent_settle(common: &ForgejoArgs) -> Duration {
    intent_settle_of(common.target.http_timeout)
}

/// [`intent_settle`] of an `--http-timeout`.
pub(crate) fn intent_settle_of(http_timeout: Duration) -> Duration {
    http_timeout.saturating_mul(2)
}

/// The age below which the sweep spares a registration of ours: its owner may still be starting
/// it. `run` (its teardown's sweep) and `sweep` compute it from the same flags.
pub(crate) fn sweep_min_age(
    registration_grace: Duration,
    launch_timeout: Duration,
    common: &ForgejoArgs,
) -> Duration {
    crate::core::sweep::spare::sweep_min_age(
        registration_grace,
        launch_timeout,
        intent_settle(common),
    )
}

pub(crate) fn policy(a: &RunArgs, labels: &Labels) -> Policy {
    Policy {
        runner_prefix: a.common.target.runner_prefix.clone(),
        label_names: labels.names(),
        max_jobs_per_vm: a.max_jobs_per_vm,
        idle_timeout: a.idle_timeout,
        registration_grace: a.grace.registration_grace,
        max_cycle_duration: a.max_cycle_duration,
        hard_deadline: a.hard_deadline,
        intent_settle: intent_settle(&a.common),
        job_pickup_timeout: a.job_pickup_timeout,
        sweep_min_age: sweep_min_age(
            a.grace.registration_grace,
            a.grace.launch_timeout,
            &a.common,
        ),
        reuse_within: a.reuse_within,
        warm: WarmPolicy {
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
        sweep_max_deletions: a.common.target.sweep_max_deletions,
        host: String::new(),
        slot: a.common.local.slot,
        backoff: backoff_policy(a),
        wake: match &a.wake_file {
            Some(_) => crate::core::wake::WakePolicy::new(a.wake_window, a.poll_interval),
            None => crate::core::wake::WakePolicy::default(),
        },
    }
}

pub(crate) fn backoff_policy(a: &RunArgs) -> BackoffPolicy {
    BackoffPolicy {
        max_failed_cycles: a.max_failed_cycles,
        initial: a.failure_backoff,
        max: a.failure_backoff_max,
    }
}

/// The checks of `run`'s flags that need no I/O; the labels, when they pass.
pub(crate) fn validate_run_args(a: &RunArgs) -> Result<Labels, Fatal> {
    check_prefix(&a.common.target.runner_prefix)?;
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
        ("--launch-timeout", a.grace.launch_timeout),
        ("--http-timeout", a.common.target.http_timeout),
    ] {
        if d.is_zero() {
            return Err(usage(format!("{flag} must be longer than 0")));
        }
    }
    if a.hard_deadline < a.max_cycle_duration {
        return Err(usage(format!(
            "--hard-deadline ({}) must not be shorter than --max-cycle-duration ({}): the deadline is the backstop past the normal end of a cycle",
            format_duration(a.hard_deadline),
            format_duration(a.max_cycle_duration)
        )));
    }
    backoff_policy(a).check().map_err(usage)?;
    check_warm(a)?;
    if a.wake_window > crate::core::wake::MAX_WAKE_WINDOW {
        return Err(usage(format!(
            "--wake-window {} is longer than {}: a woken run looks every second for that long",
            format_duration(a.wake_window),
            format_duration(crate::core::wake::MAX_WAKE_WINDOW)
        )));
    }
    check_metrics_file(&a.common)?;
    Ok(labels)
}

/// `--warm` fits the pool's slots, and a warm VM lives long enough to be worth its boot.
fn check_warm(a: &RunArgs) -> Result<(), Fatal> {
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
            format_duration(a.warm_max_age),
            format_duration(a.poll_interval)
        )));
    }
    Ok(())
}

/// Where the metrics go, and the labels they carry.
#[derive(Clone)]
pub(crate) struct MetricsTarget<'a> {
    pub(crate) path: &'a Path,
    /// `pool` (`--metrics-pool`) and, in a pool of several slots, `slot`.
    pub(crate) labels: Vec<(&'static str, String)>,
    /// The pool's state directory (its failure backoff).
    pub(crate) pool: PathBuf,
}

/// The metrics file of `--metrics-file`, if any.
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

/// With `--store pg`: this slot of this host in the pool (`--pool`, `--host-id`, `--lease`),
/// checked; `None` with the files store. `forgejo`: whose job attempts are claimed.
pub(crate) fn pool_slot(
    local: &LocalArgs,
    forgejo: &str,
) -> Result<Option<crate::adapters::pg_store::PoolSlot>, Fatal> {
    if local.store == crate::cli::StoreKind::Files {
        for (flag, given) in [
            ("--pool", local.pool.is_some()),
            ("--host-id", local.host_id.is_some()),
        ] {
            if given {
                return Err(usage(format!(
                    "{flag} is for --store pg; with --store files a pool is this host's --state-dir"
                )));
            }
        }
        return Ok(None);
    }
    let pool = local.pool.clone().ok_or_else(|| {
        usage("--store pg needs --pool NAME: the pool this host serves, named alike on every host of it")
    })?;
    crate::core::pool::check_name("--pool", &pool).map_err(usage)?;
    let host = match &local.host_id {
        Some(h) => h.clone(),
        None => host_name().map_err(|e| usage(format!("{e:#}; pass --host-id NAME")))?,
    };
    crate::core::pool::check_name("--host-id", &host).map_err(usage)?;
    if local.lease < crate::core::pool::MIN_LEASE {
        return Err(usage(format!(
            "--lease {} is too short: at least {} (several times the timer's interval)",
            format_duration(local.lease),
            format_duration(crate::core::pool::MIN_LEASE)
        )));
    }
    let slot = slot_dir(local)?;
    Ok(Some(crate::adapters::pg_store::PoolSlot {
        pool,
        machine: machine(&slot.pool, &host),
        host,
        forgejo: forgejo.to_string(),
        k: slot.k,
        n: slot.n,
        lease: local.lease,
    }))
}

/// The host name (`/proc/sys/kernel/hostname`), the default `--host-id`.
fn host_name() -> anyhow::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").map_err(|e| {
        anyhow::anyhow!("cannot read the host name (/proc/sys/kernel/hostname): {e}")
    })?;
    let name = name.trim().split('.').next().unwrap_or("").to_string();
    if name.is_empty() {
        anyhow::bail!("the host name is empty");
    }
    Ok(name)
}

/// What tells two hosts with one id apart: the host name, `/etc/machine-id` and the state
/// directory (two state directories are two hosts).
fn machine(state_dir: &Path, host: &str) -> String {
    let id = std::fs::read_to_string("/etc/machine-id").unwrap_or_default();
    let name = host_name().unwrap_or_else(|_| host.to_string());
    let dir = std::path::absolute(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    format!("{name} {} {}", id.trim(), dir.display())
}

#[cfg(test)]
mod name_tests {
    use super::MAX_PREFIX_BYTES;
    use crate::core::slots::MAX_SLOTS;
    use crate::core::sweep::spare::{registered_at, registration_name};
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
