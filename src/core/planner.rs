//! The pure decision core: given what cycle.json holds, what Forgejo just said and the time,
//! what is the next step? No I/O here; `driver::cycle` carries the steps out.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Serialize;

use crate::core::backoff::FailureReason;
use crate::core::claims::Claimed;
use crate::core::forgejo::{Job, Runner, RunnerStatus, job_matches, waiting_jobs};
use crate::core::holds::Holds;
use crate::core::state::{
    Boundary, CycleState, Launch, NotServed, Phase, ProcessState, Registration,
};
use crate::core::sweep::gate::{Deletable, DeleteReason, may_delete};
use crate::core::sweep::licence::SweepLicence;
use crate::core::time::{Timestamp, format_duration};
use crate::core::warm::{WarmElsewhere, WarmPolicy, wants_another};

mod after;
mod running;

use after::{decide_destroyed, decide_tearing_down};
use running::decide_running;

/// Failed attempts in a row to start a runner (POST, launch, never connected) after which the VM is presumed
/// broken and torn down.
pub const MAX_START_FAILURES: u32 = 3;

/// Failed attempts to delete (or look up) one registration in a run after which a running VM is
/// torn down instead of waiting on it.
pub const MAX_CLEANUP_FAILURES: u32 = 3;

/// After a successful destroy, how long a registration may still read `idle`/`active` (Forgejo
/// marks a runner offline 60 s after its last contact) before the run gives up and leaves it to
/// the next run.
pub const OFFLINE_AFTER_DESTROY: Duration = Duration::from_secs(120);

#[derive(Clone, Debug)]
pub struct Policy {
    pub runner_prefix: String,
    /// Label names (the part of each `--labels` entry before `:`).
    pub label_names: Vec<String>,
    pub max_jobs_per_vm: u32,
    pub idle_timeout: Duration,
    pub registration_grace: Duration,
    pub max_cycle_duration: Duration,
    pub hard_deadline: Duration,
    /// How long after its POST an unanswered registration is looked up by name: long enough
    /// that a POST still in flight (a slow answer, a run killed mid-request) has landed.
    pub intent_settle: Duration,
    /// How long our runner may sit idle while its job is still listed as waiting before we
    /// conclude that Forgejo does not give it that job now (`--job-pickup-timeout`).
    pub job_pickup_timeout: Duration,
    /// Whose jobs may follow each other on one VM (`--reuse-within`).
    pub reuse_within: ReuseWithin,
    /// How young a registration (by the time in its name) the sweep spares
    /// (`core::sweep::spare::sweep_min_age`).
    pub sweep_min_age: Duration,
    /// Warm capacity (`--warm`, `--warm-max-age`, `--warm-during`).
    pub warm: WarmPolicy,
}

/// The trust boundary within which a VM runs one job after another (`--reuse-within`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ReuseWithin {
    /// Jobs of one repository.
    Repo,
    /// Jobs of the repositories of one owner (user or organization).
    Owner,
    /// Any job the pool serves.
    Pool,
}

impl ReuseWithin {
    pub fn as_str(self) -> &'static str {
        match self {
            ReuseWithin::Repo => "repo",
            ReuseWithin::Owner => "owner",
            ReuseWithin::Pool => "pool",
        }
    }

    /// Whether `job` may run on a VM whose first job set `boundary`. An id the jobs list did
    /// not give matches nothing.
    pub fn admits(self, boundary: &Boundary, job: &Job) -> bool {
        let same = |a: Option<i64>, b: Option<i64>| a.is_some() && a == b;
        match self {
            ReuseWithin::Repo => same(boundary.repo_id, job.repo_id),
            ReuseWithin::Owner => same(boundary.owner_id, job.owner_id),
            ReuseWithin::Pool => true,
        }
    }
}

/// What the driver learned from Forgejo (and of the launch command) just before this decision.
#[derive(Clone, Debug, Default)]
pub struct Observation {
    /// Waiting and running jobs in scope; `None` when not fetched or the request failed.
    pub jobs: Option<Vec<Job>>,
    /// `GET …/runners/{id}` per registration id: `Some(runner)`, or `None` for a 404.
    /// An id without an entry could not be fetched (the request failed).
    pub runners: BTreeMap<i64, Option<Runner>>,
    /// Why the launch command cannot run now (it went away mid-cycle), when it cannot.
    pub launch_problem: Option<String>,
    /// Job attempts the pool's other slots claim or hold (`core::claims`): never registered for
    /// here.
    pub claimed_elsewhere: Claimed,
    /// The unused warm VMs of the pool's other slots (`core::warm`).
    pub warm_elsewhere: WarmElsewhere,
}

/// Facts about this run (not the cycle) that decisions depend on.
#[derive(Clone, Debug, Default)]
pub struct RunContext {
    /// A `tofu destroy` succeeded in this run: the only licence for a sweep.
    pub destroyed_this_run: bool,
    pub swept: bool,
    /// Registrations whose DELETE failed since the last wait: not retried before waiting.
    pub failed_deletes: BTreeSet<i64>,
    /// Registration names whose lost-POST lookup failed since the last wait.
    pub failed_intents: BTreeSet<String>,
    /// Failed deletes and lookups per registration name in this run (never cleared): after
    /// `MAX_CLEANUP_FAILURES` the VM is torn down rather than kept for a registration that
    /// cannot be cleaned up.
    pub cleanup_failures: BTreeMap<String, u32>,
    /// Jobs not registered for until their hold ends (`held-jobs.json`, read at the start).
    pub holds: Holds,
    /// Observation rounds in a row with a failed request (0 after a clean one).
    pub failed_observations: u32,
}

/// Observation rounds in a row with a failed request after which a run that would only wait
/// gives up (the next run resumes).
pub const MAX_OBSERVATION_FAILURES: u32 = 3;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
pub enum TeardownReason {
    /// No job waited for `--idle-timeout` while the VM was free.
    Idle,
    /// `--max-jobs-per-vm` runners were started on this VM.
    JobCap,
    /// The cycle is older than `--max-cycle-duration`.
    MaxCycleDuration,
    /// The cycle is older than `--hard-deadline`: torn down even with a runner up (an error).
    HardDeadline,
    /// The next job waiting is outside the VM's trust boundary (`--reuse-within`): it gets a
    /// fresh VM.
    OutsideBoundary {
        job_id: i64,
        reuse_within: ReuseWithin,
    },
    /// An earlier runner's process may still run on the VM (the launch command could not
    /// confirm it gone, or could not stop it): no other job may start next to it.
    PreviousRunnerNotGone { runner_id: i64, why: String },
    /// Three failed attempts in a row to start a runner.
    BrokenVm,
    /// A runner stayed idle while its job was gone for longer than the grace. Forgejo still
    /// counts it as alive, so it is not deleted; destroying the VM stops it.
    Stranded { runner_id: i64 },
    /// `tofu apply` (or reading its outputs) failed.
    ApplyFailed,
    /// A registration could not be deleted (or looked up) `MAX_CLEANUP_FAILURES` times; the
    /// VM goes, the registration stays in cycle.json until Forgejo confirms it gone.
    CleanupFailing { name: String },
    /// The launch command cannot be run (unset, missing, not executable) while a job waits.
    LaunchUnusable { problem: String },
    /// Our runner sat idle for `--job-pickup-timeout` while its job was listed as waiting:
    /// Forgejo does not give it that job now (a concurrency group holds it, most likely). An
    /// idle runner is alive, so it is not deleted; destroying the VM stops it. The job is held.
    PickupTimeout { runner_id: i64, job_id: i64 },
    /// Our runner connected with labels that do not cover its job's `runs_on`, so Forgejo will
    /// never give it the job: the launch command does not pass the labels (an error).
    WrongLabels {
        runner_id: i64,
        job_id: i64,
        declared: Vec<String>,
        runs_on: Vec<String>,
    },
    /// An unused warm VM is older than `--warm-max-age` (images change); a later run makes a new
    /// one.
    WarmExpired,
    /// An unused warm VM the pool no longer wants: `--warm` was lowered or `--warm-during` is
    /// outside its windows, and the slots below keep theirs.
    WarmNotWanted,
    /// The VM of a `check --boot` that did not finish (it was killed): never given a runner.
    Canary,
}

impl TeardownReason {
    pub fn describe(&self) -> String {
        match self {
            TeardownReason::Idle => "idle timeout: no job waited while the VM was free".into(),
            TeardownReason::JobCap => "job cap reached (--max-jobs-per-vm)".into(),
            TeardownReason::MaxCycleDuration => "cycle reached --max-cycle-duration".into(),
            TeardownReason::HardDeadline => {
                "cycle passed --hard-deadline; tearing down even with a runner up".into()
            }
            TeardownReason::BrokenVm => format!(
                "{MAX_START_FAILURES} failed attempts in a row to start a runner; the VM is presumed broken"
            ),
            TeardownReason::Stranded { runner_id } => format!(
                "runner {runner_id} stays idle although its job is gone; destroying the VM stops it"
            ),
            TeardownReason::ApplyFailed => "tofu apply failed".into(),
            TeardownReason::OutsideBoundary {
                job_id,
                reuse_within,
            } => format!(
                "job {job_id} is outside this VM's trust boundary (--reuse-within {}): it gets a fresh VM",
                reuse_within.as_str()
            ),
            TeardownReason::PreviousRunnerNotGone { runner_id, why } => format!(
                "the process of runner {runner_id} may still run on the VM ({why}): no other job starts next to it, the VM goes"
            ),
            TeardownReason::LaunchUnusable { problem } => {
                format!("no runner can be started: {problem}")
            }
            TeardownReason::CleanupFailing { name } => format!(
                "registration {name} could not be cleaned up {MAX_CLEANUP_FAILURES} times; the VM goes, the registration is retried after the destroy"
            ),
            TeardownReason::PickupTimeout { runner_id, job_id } => format!(
                "runner {runner_id} sat idle past --job-pickup-timeout while job {job_id} waited: Forgejo does not give it that job now (a concurrency group holds it, most likely); the job is held and the VM goes, which stops the runner"
            ),
            TeardownReason::WrongLabels {
                runner_id,
                job_id,
                declared,
                runs_on,
            } => format!(
                "runner {runner_id} declared the labels [{}] but job {job_id} runs on [{}], so Forgejo never gives it the job: the launch command must pass every entry of RUNNER_LABELS to forgejo-runner as --label",
                declared.join(", "),
                runs_on.join(", ")
            ),
            TeardownReason::WarmExpired => {
                "the warm VM ran no job within --warm-max-age; a later run makes a new one".into()
            }
            TeardownReason::WarmNotWanted => {
                "the pool wants fewer warm VMs now (--warm, --warm-during) and the slots below keep theirs".into()
            }
            TeardownReason::Canary => {
                "the VM of a `check --boot` that did not finish: it is destroyed, never given a runner".into()
            }
        }
    }

    /// Teardowns that mean this run failed (exit status 1).
    pub fn is_failure(&self) -> bool {
        self.failure().is_some()
    }

    /// The failure this teardown is, for the pool's failure backoff (`core::backoff`).
    pub fn failure(&self) -> Option<FailureReason> {
        Some(match self {
            TeardownReason::HardDeadline => FailureReason::HardDeadline,
            TeardownReason::BrokenVm => FailureReason::BrokenVm,
            TeardownReason::ApplyFailed => FailureReason::ApplyFailed,
            TeardownReason::LaunchUnusable { .. } => FailureReason::LaunchUnusable,
            TeardownReason::WrongLabels { .. } => FailureReason::WrongLabels,
            TeardownReason::Idle
            | TeardownReason::JobCap
            | TeardownReason::MaxCycleDuration
            | TeardownReason::OutsideBoundary { .. }
            | TeardownReason::PreviousRunnerNotGone { .. }
            | TeardownReason::Stranded { .. }
            | TeardownReason::CleanupFailing { .. }
            | TeardownReason::PickupTimeout { .. }
            | TeardownReason::WarmExpired
            | TeardownReason::WarmNotWanted
            | TeardownReason::Canary => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// No cycle and no waiting job: the idle tick. Nothing to do.
    Idle,
    /// Write a new cycle.json (phase `applying`) that claims this job attempt, the oldest
    /// servable one.
    StartCycle {
        job_id: i64,
        job_handle: String,
    },
    /// Write a new cycle.json (phase `applying`) for a warm VM: no job yet, the pool wants one
    /// more (`core::warm`).
    StartWarm,
    /// `tofu init` when needed, `tofu apply`, `tofu output -json`.
    Apply,
    /// A registration whose POST answer was lost: find it by exact name, delete, forget.
    ResolveIntent {
        name: String,
    },
    /// Forgejo answered 404 for this registration: it ran its job (or is otherwise gone).
    Forget {
        id: i64,
    },
    /// Delete this registration: it passed the gate in this round's observation.
    Delete {
        target: Deletable,
        reason: DeleteReason,
    },
    /// The launch outcome was never recorded, but the runner is up: it was launched.
    AdoptLaunch {
        id: i64,
    },
    /// Forgejo reports the runner `idle` or `active` for the first time: it connected (a start
    /// that worked).
    MarkConnected {
        id: i64,
    },
    /// Forgejo reports the runner `active` for the first time: it took a job, and its claim on
    /// the job it was registered for ends.
    MarkBusy {
        id: i64,
    },
    MarkJobGone {
        id: i64,
    },
    ClearJobGone {
        id: i64,
    },
    /// Register a runner for this job and launch it on the VM. `boundary`: the job's, which
    /// becomes the VM's with its first runner.
    Register {
        job_id: i64,
        job_handle: String,
        boundary: Boundary,
    },
    /// Before the next runner starts on the VM: is the process of this earlier runner (whose
    /// registration is gone) gone too? `RUNNER_ACTION=check`, then `stop` if it still runs.
    CheckPrevious {
        id: i64,
    },
    Teardown {
        reason: TeardownReason,
    },
    Destroy,
    /// The sweep, licensed by this run's destroy.
    Sweep(SweepLicence),
    /// Everything is gone: remove cycle.json.
    Finish,
    Wait {
        why: String,
    },
    /// End this run with a failure, keeping cycle.json for the next run.
    GiveUp {
        why: String,
    },
}

/// The prefix that marks this cycle's registrations: the one they were created with (recorded in
/// cycle.json), else the configured one.
pub fn cycle_prefix<'a>(state: &'a CycleState, policy: &'a Policy) -> &'a str {
    if state.runner_prefix.is_empty() {
        &policy.runner_prefix
    } else {
        &state.runner_prefix
    }
}

/// How a registration is named in messages: its name, which is what Forgejo's UI shows.
fn who(reg: &Registration, id: i64) -> String {
    format!("runner {id} {}", reg.name)
}

/// The waiting jobs a runner of ours could take, that are not held and that no other slot of
/// the pool holds, oldest (lowest id) first.
pub fn servable_jobs<'a>(
    jobs: &'a [Job],
    obs: &Observation,
    policy: &Policy,
    ctx: &RunContext,
    now: Timestamp,
) -> Vec<&'a Job> {
    let mut w = waiting_jobs(jobs, &policy.label_names);
    w.retain(|j| {
        !ctx.holds.is_held(&j.handle, now) && !obs.claimed_elsewhere.covers(j.id, &j.handle)
    });
    w
}

/// Decides the next step. Pure: the same inputs always give the same step.
pub fn decide(
    state: Option<&CycleState>,
    obs: &Observation,
    ctx: &RunContext,
    policy: &Policy,
    now: Timestamp,
) -> Step {
    let Some(state) = state else {
        return match &obs.jobs {
            // The oldest jobs are the unused warm VMs' of the other slots, which poll for them:
            // a new VM only for a job beyond those.
            Some(jobs) => match servable_jobs(jobs, obs, policy, ctx, now)
                .get(obs.warm_elsewhere.total as usize)
            {
                Some(job) => Step::StartCycle {
                    job_id: job.id,
                    job_handle: job.handle.clone(),
                },
                None if wants_another(&policy.warm, obs.warm_elsewhere, now) => Step::StartWarm,
                None => Step::Idle,
            },
            None => Step::GiveUp {
                why: "without the jobs list no cycle can start; the next run asks again".into(),
            },
        };
    };
    let step = match state.phase {
        // A canary's VM is the check's, never the pool's: whatever phase it was left in, it goes.
        Phase::Applying | Phase::Running if state.canary => Step::Teardown {
            reason: TeardownReason::Canary,
        },
        Phase::Applying => Step::Apply,
        Phase::Running => {
            not_next_to_a_live_process(state, decide_running(state, obs, ctx, policy, now))
        }
        Phase::TearingDown => decide_tearing_down(state, obs, ctx, policy),
        Phase::Destroyed => decide_destroyed(state, obs, ctx, policy, now),
    };
    match step {
        Step::Wait { .. } if ctx.failed_observations >= MAX_OBSERVATION_FAILURES => Step::GiveUp {
            why: format!(
                "Forgejo requests failed {MAX_OBSERVATION_FAILURES} times in a row; cycle.json is kept and the next run resumes"
            ),
        },
        step => step,
    }
}

/// Why the stop of a registration's runner failed, if it did (`stopped`: not gone). Its process
/// may still run, so it may come up between the reading that found it offline and the DELETE
/// (Forgejo's DELETE checks no status, `routers/api/v1/shared/runners.go`) and take a job that
/// is then lost with it. Such a registration is deleted only once the VM is destroyed.
pub fn stop_failed(reg: &Registration) -> Option<&str> {
    match &reg.stopped {
        Some(ProcessState::NotGone(why)) => Some(why),
        _ => None,
    }
}

/// While the VM runs, a DELETE of a registration whose stop failed becomes the teardown: the
/// destroy ends its process, and the registration is deleted after it.
fn not_next_to_a_live_process(state: &CycleState, step: Step) -> Step {
    if let Step::Delete { target, .. } = &step
        && let Some(why) = state.registration(target.id()).and_then(stop_failed)
    {
        return Step::Teardown {
            reason: TeardownReason::PreviousRunnerNotGone {
                runner_id: target.id(),
                why: why.to_string(),
            },
        };
    }
    step
}

#[cfg(test)]
mod tests;
