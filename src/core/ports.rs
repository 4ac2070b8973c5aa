//! Every port the shell implements: what the program talks to (Forgejo, tofu, the launch
//! command, the state store, the clock, the audit trail). Read this file to learn the edges.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use anyhow::Result;
use serde_json::Value;

use crate::core::backoff::{Backoff, BackoffPolicy, Change, Closed, CycleOutcome, Gate};
use crate::core::claims::Others;
use crate::core::forgejo::{Job, Runner};
use crate::core::holds::{Holds, HoldsError};
use crate::core::pool::{Adoption, PoolView};
use crate::core::secret::Secret;
use crate::core::state::CycleState;
use crate::core::sweep::gate::Deletable;
use crate::core::time::Timestamp;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Deleted {
    /// 204: Forgejo deleted it now.
    Now,
    /// 404: it was already gone.
    AlreadyGone,
    /// A dry-run: the deletion went into the plan, nothing was sent.
    Planned,
}

pub struct NewRunner {
    pub id: i64,
    pub uuid: String,
    pub token: Secret,
}

pub struct RunnerPage {
    pub rows: Vec<Runner>,
    /// `X-Total-Count`, when present and a number.
    pub total: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct ApiError {
    /// `GET https://forgejo.example/api/v1/admin/actions/runners/5`
    pub request: String,
    pub detail: String,
    /// The HTTP status when Forgejo answered with an error status.
    pub status: Option<u16>,
}

impl ApiError {
    /// An answer that cannot be used (not JSON, a field missing, the wrong row), or no answer at
    /// all: there is no HTTP error status to go by.
    pub fn unusable(request: impl Into<String>, detail: impl Into<String>) -> ApiError {
        ApiError {
            request: request.into(),
            detail: detail.into(),
            status: None,
        }
    }

    /// The request was refused outright (bad request, authentication, scope, unknown path,
    /// validation), so it did nothing. Timeouts, rate limits, 5xx and transport errors may or
    /// may not have had an effect.
    pub fn is_rejection(&self) -> bool {
        matches!(
            self.status,
            Some(400 | 401 | 403 | 404 | 405 | 413 | 415 | 422)
        )
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.request, self.detail)
    }
}

impl std::error::Error for ApiError {}

/// The runner API calls of one scope (`admin`, `user`, `org/NAME`, `repo/OWNER/NAME`).
pub trait Forgejo {
    /// Waiting and running jobs that match our labels (`null` is an empty list).
    fn list_jobs(&mut self) -> Result<Vec<Job>, ApiError>;
    /// `Ok(None)` on 404.
    fn get_runner(&mut self, id: i64) -> Result<Option<Runner>, ApiError>;
    /// 204 and 404 are both success. Only a registration that passed the gate can be named
    /// (see [`Deletable`]). `reason` is for logs and plans only.
    fn delete_runner(&mut self, target: &Deletable, reason: &str) -> Result<Deleted, ApiError>;
    /// `POST …/actions/runners {"name", "ephemeral": true}`.
    fn register_runner(&mut self, name: &str) -> Result<NewRunner, ApiError>;
    /// One page of the runner list (`page` is 1-based).
    fn list_runners_page(&mut self, page: u32, limit: u32) -> Result<RunnerPage, ApiError>;
}

/// A failed external step (tofu, the launch command).
#[derive(Clone, Debug)]
pub struct StepError {
    pub message: String,
    /// The step ended because a stop (SIGTERM/SIGINT) was requested.
    pub interrupted: bool,
}

impl StepError {
    pub fn failed(message: impl Into<String>) -> StepError {
        StepError {
            message: message.into(),
            interrupted: false,
        }
    }
}

impl std::fmt::Display for StepError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    pub sensitive: bool,
    pub value: Value,
}

pub type Outputs = BTreeMap<String, Output>;

pub trait Tofu {
    /// `Err` with a message saying what to configure when this cannot run at all.
    fn check_config(&self) -> anyhow::Result<()>;
    /// `init`, then `apply`.
    fn apply(&mut self, cycle_id: &str) -> Result<(), StepError>;
    fn outputs(&mut self, cycle_id: &str) -> Result<Outputs, StepError>;
    /// `reason` (why the VM goes) is for logs and plans only.
    fn destroy(&mut self, cycle_id: &str, reason: &str) -> Result<(), StepError>;
}

pub struct LaunchRequest<'a> {
    pub runner_id: i64,
    pub runner_uuid: &'a str,
    pub runner_name: &'a str,
    pub job_id: i64,
    pub job_handle: &'a str,
    pub labels: &'a str,
    pub forgejo_url: &'a str,
    pub outputs: &'a Outputs,
}

/// What `RUNNER_ACTION=check` said about one runner's process on the VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProcessCheck {
    /// Exit 0: it still runs.
    Running,
    /// Exit 3: it is gone.
    Gone,
    /// Anything else (a launch command that ignores RUNNER_ACTION, an unreachable VM): it may
    /// still run. `interrupted` when a stop request cut the call short.
    Unknown { why: String, interrupted: bool },
}

/// `check` answers 3 for a runner's process that is gone.
pub const CHECK_GONE: i32 = 3;

pub trait Launcher {
    fn check_config(&self) -> anyhow::Result<()>;
    /// `RUNNER_ACTION=start`: starts the runner on the VM, the token on stdin.
    fn launch(&mut self, req: &LaunchRequest<'_>, token: &Secret) -> Result<(), StepError>;
    /// `RUNNER_ACTION=check`: whether that runner's process still runs on the VM.
    fn check(&mut self, req: &LaunchRequest<'_>) -> ProcessCheck;
    /// `RUNNER_ACTION=stop`: ends that runner's process; `Ok` once it is gone.
    fn stop(&mut self, req: &LaunchRequest<'_>) -> Result<(), StepError>;
    /// `RUNNER_ACTION=probe` (the canary, `core::canary`): the VM is reachable and ready, and
    /// `Ok` holds the line forgejo-runner's `--version` printed there. No registration.
    fn probe(&mut self, req: &ProbeRequest<'_>) -> Result<String, StepError> {
        let _ = req;
        Err(StepError::failed(
            "this launcher cannot probe a VM (RUNNER_ACTION=probe)",
        ))
    }
}

/// What the launch command gets for `RUNNER_ACTION=probe`: no runner, no job, no token.
pub struct ProbeRequest<'a> {
    pub labels: &'a str,
    pub forgejo_url: &'a str,
    pub outputs: &'a Outputs,
}

/// Where cycle.json (and the held jobs, which outlive a cycle) live. Chosen once in `commands`: a
/// directory on disk, PostgreSQL for a pool across hosts (`--store pg`), or memory for dry-runs.
pub trait StateStore {
    fn load(&mut self) -> Result<Option<CycleState>>;
    fn save(&mut self, state: &CycleState) -> Result<()>;
    fn remove(&mut self) -> Result<()>;
    fn describe(&self) -> String;
    /// The held jobs (`held-jobs.json`); none when there is no file.
    fn load_holds(&mut self) -> Result<Holds, HoldsError>;
    fn save_holds(&mut self, holds: &Holds) -> Result<()>;
    /// What the pool's other slots hold (`core::claims`). A store of a slot that is alone holds
    /// nothing beside it.
    fn others(&mut self) -> Result<Others> {
        Ok(Others::default())
    }
    /// Writes `state`, which claims the attempt `handle` of job `job_id` (a new registration's
    /// intent, or a new cycle), unless another slot of the pool holds that attempt: then nothing
    /// is written and the answer names it. Atomic against the other slots' claims (the pool's
    /// claims lock).
    fn save_claiming(&mut self, state: &CycleState, _job_id: i64, _handle: &str) -> Result<Claim> {
        self.save(state).map(|()| Claim::Saved)
    }
    /// The pool's failure backoff (`backoff.json`); a fresh one when there is no file, an error
    /// naming the file when it cannot be read or used (a real backoff is never reset silently).
    fn load_backoff(&mut self) -> Result<Backoff> {
        Ok(Backoff::new())
    }
    fn save_backoff(&mut self, _backoff: &Backoff) -> Result<()> {
        Ok(())
    }
    /// [`Self::save_claiming`] for a new cycle, unless the pool's failure backoff is in force
    /// (`Start::BackingOff`, nothing written); a retry once it has passed re-arms it first. Atomic
    /// against the other slots (the pool's claims lock).
    fn save_starting(
        &mut self,
        state: &CycleState,
        job_id: i64,
        handle: &str,
        gate: &BackoffGate,
    ) -> Result<Start> {
        save_starting_in(self, state, job_id, handle, gate)
    }
    /// Writes `state`, a new warm VM's cycle (`core::warm`), unless the pool's failure backoff
    /// is in force or the other slots' unused warm VMs already number `wanted`
    /// (`Start::Claim(Claim::HeldBy)` naming them; nothing written). Atomic against the other
    /// slots (the pool's claims lock), so that two slots never both make the last one.
    fn save_starting_warm(
        &mut self,
        state: &CycleState,
        wanted: u32,
        gate: &BackoffGate,
    ) -> Result<Start> {
        save_starting_warm_in(self, state, wanted, gate)
    }
    /// Counts how cycle `cycle_id` ended in the pool's failure backoff (once per cycle), under
    /// the pool's claims lock; what it is now, and what changed.
    fn record_outcome(
        &mut self,
        gate: &BackoffGate,
        cycle_id: &str,
        outcome: CycleOutcome,
    ) -> Result<(Backoff, Change)> {
        record_outcome_in(self, gate, cycle_id, outcome)
    }
    /// Before an irreversible step (`step`: a tofu apply or destroy, a DELETE, a stop, the
    /// sweep's deletions): this process still owns its cycle, and its lease outlasts the step
    /// (renewed first). `Err` (a [`crate::core::pool::Fenced`] when another host adopted the
    /// cycle): the step must not happen. A store of one host has nothing to check.
    fn guard(&mut self, _step: &str) -> Result<()> {
        Ok(())
    }
    /// The cycle `load` adopted from a host whose lease lapsed, told once.
    fn adopted(&mut self) -> Option<Adoption> {
        None
    }
    /// The pool across hosts as last read (`--store pg`), for the report and the metrics.
    fn pool_view(&mut self) -> Option<PoolView> {
        None
    }
}

/// What the backoff of a run goes by: the flags, the slot, the time.
#[derive(Clone, Copy, Debug)]
pub struct BackoffGate {
    pub policy: BackoffPolicy,
    pub slot: u32,
    pub now: Timestamp,
}

/// [`StateStore::save_starting`] with the store's own `load_backoff`, `save_backoff` and
/// `save_claiming` (a store that locks calls it with the claims lock held, and its claim then
/// must not lock again).
pub fn save_starting_in<S: StateStore + ?Sized>(
    store: &mut S,
    state: &CycleState,
    job_id: i64,
    handle: &str,
    gate: &BackoffGate,
) -> Result<Start> {
    if !gate.policy.enabled() {
        return store.save_claiming(state, job_id, handle).map(Start::Claim);
    }
    match store.load_backoff()?.gate(&gate.policy, gate.now) {
        Gate::Closed(c) => Ok(Start::BackingOff(c)),
        Gate::Open => store.save_claiming(state, job_id, handle).map(Start::Claim),
        // Re-armed before the start: a crash between the two costs one backoff, never an
        // extra VM.
        Gate::Retry(armed) => {
            store.save_backoff(&armed)?;
            store.save_claiming(state, job_id, handle).map(Start::Claim)
        }
    }
}

/// [`StateStore::save_starting_warm`] with the store's own `others`, `load_backoff`,
/// `save_backoff` and `save` (called with the claims lock held by a store that locks).
pub fn save_starting_warm_in<S: StateStore + ?Sized>(
    store: &mut S,
    state: &CycleState,
    wanted: u32,
    gate: &BackoffGate,
) -> Result<Start> {
    let warm = store.others()?.warm;
    if warm.len() as u32 >= wanted {
        let slots: Vec<String> = warm
            .iter()
            .map(|(k, host)| match host.as_str() {
                "" => format!("slot {k}"),
                h => format!("slot {k} of host {h}"),
            })
            .collect();
        return Ok(Start::Claim(Claim::HeldBy(format!(
            "the warm VMs of {}",
            slots.join(", ")
        ))));
    }
    if gate.policy.enabled() {
        match store.load_backoff()?.gate(&gate.policy, gate.now) {
            Gate::Closed(c) => return Ok(Start::BackingOff(c)),
            Gate::Open => {}
            Gate::Retry(armed) => store.save_backoff(&armed)?,
        }
    }
    store.save(state)?;
    Ok(Start::Claim(Claim::Saved))
}

/// [`StateStore::record_outcome`] with the store's own `load_backoff` and `save_backoff`.
pub fn record_outcome_in<S: StateStore + ?Sized>(
    store: &mut S,
    gate: &BackoffGate,
    cycle_id: &str,
    outcome: CycleOutcome,
) -> Result<(Backoff, Change)> {
    if !gate.policy.enabled() {
        return Ok((Backoff::new(), Change::Unchanged));
    }
    let (b, change) =
        store
            .load_backoff()?
            .record(&gate.policy, gate.slot, cycle_id, outcome, gate.now);
    if change != Change::Unchanged {
        store.save_backoff(&b)?;
    }
    Ok((b, change))
}

/// The answer of [`StateStore::save_claiming`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    Saved,
    /// Another slot holds the job attempt (its name); nothing was written.
    HeldBy(String),
}

/// The answer of [`StateStore::save_starting`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Start {
    Claim(Claim),
    /// The pool's failure backoff is in force: no new cycle; nothing was written.
    BackingOff(Closed),
}

pub enum Sleep {
    Slept,
    /// A stop was requested (SIGTERM/SIGINT).
    Interrupted,
    /// Dry-run: the plan ends where the cycle would wait.
    Stop,
    /// SIGHUP: the run ends here, cycle.json kept, and the next run resumes the cycle with the
    /// configuration it is started with.
    Reload,
}

pub trait Clock {
    fn now(&self) -> Timestamp;
    fn sleep(&mut self, d: Duration) -> Sleep;
    /// A stop (SIGTERM/SIGINT) was requested: end the run before the next step.
    fn stop_requested(&self) -> bool;
    /// A fresh cycle id, unique and usable in runner names and tofu variables.
    fn new_cycle_id(&mut self, now: Timestamp) -> String;
    /// When a webhook delivery last woke this slot (the modification time of its `--wake-file`);
    /// `None` without one. `core::wake` decides what that means.
    fn woken_at(&self) -> Option<Timestamp> {
        None
    }
}

/// Where side effects and failures are appended as they happen (the audit trail). Chosen once in
/// `commands`: a file for real runs, none for dry-runs.
pub trait AuditSink {
    /// Appends one record; the error names the file and what failed.
    fn append(&mut self, record: &Value) -> anyhow::Result<()>;
    /// Makes what was appended durable (fsync); called at the points that matter (before each
    /// cycle.json write, at the end of the run), not after every record.
    fn sync(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
}
