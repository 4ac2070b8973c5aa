//! `cycle.json`: what the provisioner must remember between runs, and its strict parser.
//!
//! The file exists exactly while a cycle may own a VM or a runner registration. Every change is
//! written before the side effect it announces (intent first), atomically: see
//! `adapters::files`.

use std::collections::BTreeMap;

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::core::backoff::{CycleOutcome, FailureReason};
use crate::core::time::Timestamp;

pub const STATE_VERSION: u64 = 1;

pub const STATE_FILE: &str = "cycle.json";

/// cycle.json never legitimately grows past a few KiB; anything larger is refused unread.
pub const MAX_STATE_BYTES: u64 = 1024 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// cycle.json written, `tofu apply` not yet known to have succeeded.
    Applying,
    /// The VM exists; registrations are created and watched.
    Running,
    /// Teardown decided: registrations are cleaned up and `tofu destroy` runs.
    TearingDown,
    /// `tofu destroy` succeeded; what remains is forgetting registrations and the sweep.
    Destroyed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Launch {
    /// Registered (or about to be); the launch command has not been started.
    Pending,
    /// The launch command was started and had not reported back when this was written.
    Started,
    /// The launch command exited 0: a runner was started on the VM.
    Done,
    /// The launch command failed or timed out.
    Failed,
}

/// One ephemeral registration this cycle created (or intends to create).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// `<prefix><cycle id>-<n>-<time>` (`core::sweep::spare::registration_name`; older names lack the
    /// time): unique to this registration, so a POST whose answer was lost can be found again by
    /// exact name.
    pub name: String,
    /// `None` until Forgejo answered the POST: the registration may or may not exist.
    pub id: Option<i64>,
    pub uuid: Option<String>,
    pub job_id: i64,
    pub job_handle: String,
    pub requested_at: Timestamp,
    pub launch: Launch,
    pub launched_at: Option<Timestamp>,
    /// When its job was first seen neither waiting nor running while the runner was idle.
    pub job_gone_since: Option<Timestamp>,
    /// Forgejo has reported the runner `idle` or `active` at least once: it connected. One that
    /// stays `offline` past the grace without ever connecting is a failed start.
    #[serde(default)]
    pub connected: bool,
    /// Forgejo has reported the runner `active`: it took a job (an ephemeral runner's only one),
    /// not necessarily the one it was registered for, so it claims no job from then on
    /// (`core::claims`): its job, if still waiting, is any slot's to serve.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub busy: bool,
    /// Set when the VM was torn down because this runner sat idle while its job waited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_served: Option<NotServed>,
    /// Its runner never connected, and that failed start is counted (`start_failures`): set
    /// before its DELETE, so that a 404 seen later is not taken for a runner that ran its job.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed_start: bool,
    /// What `RUNNER_ACTION=stop` achieved before this cycle deleted the registration itself:
    /// carried to [`PreviousRunner::process`] when it is forgotten.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<ProcessState>,
    /// When the pool first saw its job waiting (any slot's `held-jobs.json`): the job's pickup
    /// time counts from it (`core::metrics::Pickups`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_first_seen: Option<Timestamp>,
}

/// Whether a runner's process on the VM is gone, as far as this cycle knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "why")]
pub enum ProcessState {
    /// Not asked yet: its registration is gone, which proves nothing about the process.
    Unchecked,
    /// `RUNNER_ACTION=check` answered 3, or `stop` answered 0.
    Gone,
    /// It may still run: `check` could not tell, or `stop` failed. The VM is never reused.
    NotGone(String),
}

/// A runner started on this VM whose registration is forgotten. The next runner starts on the
/// VM only once its process is known to be gone (a vanished registration is not an exited
/// runner).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PreviousRunner {
    pub id: i64,
    pub name: String,
    pub uuid: String,
    pub job_id: i64,
    pub job_handle: String,
    pub process: ProcessState,
}

/// The trust boundary of a VM: the repository and owner of the first job it ran.
/// `None` ids (a jobs list that did not say) match nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Boundary {
    pub repo_id: Option<i64>,
    pub owner_id: Option<i64>,
}

/// Why a connected runner was not given its waiting job, and the VM went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NotServed {
    /// Idle for `--job-pickup-timeout` while its job waited: Forgejo did not hand it out (a
    /// concurrency group holds it, most likely). The job is held (`held-jobs.json`).
    PickupTimeout,
    /// The runner declared labels that do not cover its job's `runs_on`: Forgejo never gives
    /// it that job (the launch command does not pass `RUNNER_LABELS` as `--label`).
    WrongLabels,
}

impl Registration {
    /// The intent written before the POST: its name (unique, so a lost answer can be found
    /// again), the job it is for, and when it was asked for; nothing of Forgejo's answer yet.
    pub fn intent(name: String, job_id: i64, job_handle: String, requested_at: Timestamp) -> Self {
        Registration {
            name,
            id: None,
            uuid: None,
            job_id,
            job_handle,
            requested_at,
            launch: Launch::Pending,
            launched_at: None,
            job_gone_since: None,
            connected: false,
            busy: false,
            not_served: None,
            failed_start: false,
            stopped: None,
            job_first_seen: None,
        }
    }

    /// The pickup time of its job at `now`, in milliseconds: since the pool first saw the job
    /// waiting. `None` when the registration does not record when the job was first seen.
    pub fn pickup_ms(&self, now: Timestamp) -> Option<u64> {
        self.job_first_seen
            .map(|t| u64::try_from(now.since(t).as_millis()).unwrap_or(u64::MAX))
    }

    /// The moment the registration grace counts from.
    pub fn grace_start(&self) -> Timestamp {
        self.launched_at.unwrap_or(self.requested_at)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CycleState {
    pub version: u64,
    pub cycle_id: String,
    /// The `--runner-prefix` this cycle's registrations were created with: they stay ours (and
    /// deletable) even if the configured prefix changes mid-cycle. Empty: the configured one.
    #[serde(default)]
    pub runner_prefix: String,
    pub started_at: Timestamp,
    pub phase: Phase,
    /// When `tofu apply` succeeded.
    pub vm_ready_at: Option<Timestamp>,
    /// When the VM last became free (ready, or its last registration gone).
    pub free_since: Option<Timestamp>,
    /// Runners successfully launched on this VM.
    pub jobs_started: u32,
    /// Sequence number of the next registration name.
    pub next_seq: u32,
    /// Failed attempts in a row to start a runner (POST, launch, or a runner that never connected).
    pub start_failures: u32,
    pub registrations: Vec<Registration>,
    /// Why teardown was decided, once it was.
    pub teardown_reason: Option<String>,
    /// When `tofu destroy` last succeeded.
    pub destroyed_at: Option<Timestamp>,
    /// The last failure recorded in this cycle (e.g. a failed destroy), for the next run and `status`.
    pub last_error: Option<String>,
    /// Non-sensitive tofu outputs, for `status`. Sensitive outputs are never written anywhere.
    #[serde(default)]
    pub outputs: BTreeMap<String, Value>,
    /// Set with the first registration: whose jobs this VM may run (`--reuse-within`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boundary: Option<Boundary>,
    /// Runners started on this VM whose registrations are gone, until the cycle ends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous: Vec<PreviousRunner>,
    /// The job this cycle was started for, until its first registration: the pool's other slots
    /// leave it to this one (`core::claims`). Written with the new cycle, under the claims lock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<i64>,
    /// The handle of the attempt of `claim` (a rerun is a new attempt with a new handle): the
    /// claim is on that attempt only. Without it the claim covers every attempt of the job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_handle: Option<String>,
    /// A runner of this cycle took a job: the cycle resets the pool's failure backoff.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub served: bool,
    /// The last failure of this cycle (`core::backoff`): counted when the cycle ends unserved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureReason>,
    /// Started with no job, as warm capacity (`core::warm`): until its first runner it is bound
    /// to no repository and kept up to `--warm-max-age` instead of `--idle-timeout`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub warm: bool,
    /// The VM of `check --boot` (`core::canary`): probed, never given a runner, then destroyed.
    /// One left by a canary that was killed is torn down by the next run.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub canary: bool,
}

/// How `last_error` begins once a `tofu destroy` of the cycle failed (until one succeeds).
pub const DESTROY_FAILED: &str = "tofu destroy failed";

impl CycleState {
    /// The cycle's last `tofu destroy` failed: the next one retries it.
    pub fn destroy_failed(&self) -> bool {
        self.last_error
            .as_deref()
            .is_some_and(|e| e.starts_with(DESTROY_FAILED))
    }

    /// `tofu apply` failed: the VM (whatever of it exists) goes.
    pub fn apply_failed(&mut self, error: String, teardown_reason: String) {
        self.last_error = Some(error);
        self.failure = Some(FailureReason::ApplyFailed);
        self.phase = Phase::TearingDown;
        self.teardown_reason = Some(teardown_reason);
    }

    pub fn new(cycle_id: String, now: Timestamp) -> CycleState {
        CycleState {
            version: STATE_VERSION,
            cycle_id,
            runner_prefix: String::new(),
            started_at: now,
            phase: Phase::Applying,
            vm_ready_at: None,
            free_since: None,
            jobs_started: 0,
            next_seq: 1,
            start_failures: 0,
            registrations: Vec::new(),
            teardown_reason: None,
            destroyed_at: None,
            last_error: None,
            outputs: BTreeMap::new(),
            boundary: None,
            previous: Vec::new(),
            claim: None,
            claim_handle: None,
            served: false,
            failure: None,
            warm: false,
            canary: false,
        }
    }

    /// How this cycle ends for the pool's failure backoff.
    pub fn outcome(&self) -> CycleOutcome {
        // A canary is a check, not a cycle of the pool's: it neither backs the pool off nor ends
        // a backoff.
        if self.canary {
            return CycleOutcome::Neutral;
        }
        match (self.served, self.failure) {
            (true, _) => CycleOutcome::Served,
            (false, Some(f)) => CycleOutcome::Failed(f),
            (false, None) => CycleOutcome::Neutral,
        }
    }

    pub fn registration(&self, id: i64) -> Option<&Registration> {
        self.registrations.iter().find(|r| r.id == Some(id))
    }

    pub fn registration_mut(&mut self, id: i64) -> Option<&mut Registration> {
        self.registrations.iter_mut().find(|r| r.id == Some(id))
    }
}

/// Parses cycle.json text. Any problem is an error that says what is wrong; the caller names the file.
pub fn parse_state(text: &str) -> Result<CycleState> {
    let v: Value =
        serde_json::from_str(text).context("it is not valid JSON (empty or truncated?)")?;
    let version = v
        .get("version")
        .ok_or_else(|| anyhow!("it has no \"version\" field"))?;
    match version.as_u64() {
        Some(STATE_VERSION) => {}
        _ => {
            return Err(anyhow!(
                "its version {version} is not one this build understands (expected {STATE_VERSION}); \
                 a newer ci-ephemeral-provisioner wrote it"
            ));
        }
    }
    let state: CycleState =
        serde_json::from_value(v).context("its contents do not match the cycle.json format")?;
    // The id goes into runner names and tofu's environment: only what this tool generates.
    if !is_plain_cycle_id(&state.cycle_id) {
        return Err(anyhow!(
            "its cycle_id {:?} is not one this tool writes (1 to 64 of a-z, 0-9 and -)",
            state.cycle_id
        ));
    }
    Ok(state)
}

fn is_plain_cycle_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}
