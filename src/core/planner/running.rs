//! The decision while the VM runs: the current registrations first, then whether the next job may
//! follow on this VM (its trust boundary, the earlier runner gone) or the VM must go.

use std::ops::ControlFlow::{self, Break, Continue};

use super::*;
use crate::core::warm::{WarmEnd, is_unused_warm, warm_end};

/// What one registration asks for: a step (`Break`), or to be waited on, and why (`Continue`).
type Wants = ControlFlow<Step, String>;

pub(super) fn decide_running(
    state: &CycleState,
    obs: &Observation,
    ctx: &RunContext,
    policy: &Policy,
    now: Timestamp,
) -> Step {
    if let Some(step) = past_its_limits(state, ctx, policy, now) {
        return step;
    }
    let mut waiting_on: Vec<String> = Vec::new();
    for reg in &state.registrations {
        match registration(reg, state, obs, ctx, policy, now) {
            Break(step) => return step,
            Continue(why) => waiting_on.push(why),
        }
    }
    if !waiting_on.is_empty() {
        return Step::Wait {
            why: format!("waiting for {}", waiting_on.join(", ")),
        };
    }
    decide_free(state, obs, ctx, policy, now)
}

/// The teardowns that come before any registration: the hard deadline, and a registration that
/// could not be cleaned up `MAX_CLEANUP_FAILURES` times.
fn past_its_limits(
    state: &CycleState,
    ctx: &RunContext,
    policy: &Policy,
    now: Timestamp,
) -> Option<Step> {
    if now.since(state.started_at) >= policy.hard_deadline {
        return Some(Step::Teardown {
            reason: TeardownReason::HardDeadline,
        });
    }
    let name = state.registrations.iter().find_map(|r| {
        ctx.cleanup_failures
            .get(&r.name)
            .is_some_and(|n| *n >= MAX_CLEANUP_FAILURES)
            .then(|| r.name.clone())
    })?;
    Some(Step::Teardown {
        reason: TeardownReason::CleanupFailing { name },
    })
}

/// The step one registration asks for, or why it is waited on.
fn registration(
    reg: &Registration,
    state: &CycleState,
    obs: &Observation,
    ctx: &RunContext,
    policy: &Policy,
    now: Timestamp,
) -> Wants {
    let Some(id) = reg.id else {
        return unanswered_post(reg, ctx, policy, now);
    };
    let runner = match obs.runners.get(&id) {
        None => return Continue(format!("{} (status unknown: request failed)", who(reg, id))),
        Some(None) => return Break(Step::Forget { id }),
        Some(Some(r)) => r,
    };
    if ctx.failed_deletes.contains(&id) {
        return Continue(format!("{} (delete failed, retrying)", who(reg, id)));
    }
    if reg.launch != Launch::Done {
        return unlaunched(reg, id, runner, state, policy);
    }
    // Seen up, or it declared itself (Forgejo shows what it declared) and went away since.
    let up = matches!(runner.status, RunnerStatus::Idle | RunnerStatus::Active);
    if !reg.connected && (up || runner.labels.is_some()) {
        return Break(Step::MarkConnected { id });
    }
    if runner.status == RunnerStatus::Active && !reg.busy {
        return Break(Step::MarkBusy { id });
    }
    match &runner.status {
        RunnerStatus::Active => Continue(format!("{} (active)", who(reg, id))),
        RunnerStatus::Idle => idle(reg, id, runner, obs, policy, now),
        RunnerStatus::Offline => offline(reg, id, runner, state, policy, now),
        other => Continue(format!(
            "{} (unknown status {}; never deleted on doubt)",
            who(reg, id),
            other.as_str()
        )),
    }
}

/// A registration whose POST has no answer (no id): looked up by its name once the POST has
/// settled, unless this run's lookup failed.
fn unanswered_post(reg: &Registration, ctx: &RunContext, policy: &Policy, now: Timestamp) -> Wants {
    if now.since(reg.requested_at) < policy.intent_settle {
        return Continue(format!(
            "{} (POST unanswered; looked up by name once it has settled)",
            reg.name
        ));
    }
    if !ctx.failed_intents.contains(&reg.name) {
        return Break(Step::ResolveIntent {
            name: reg.name.clone(),
        });
    }
    Continue(format!("{} (lookup failed, retrying)", reg.name))
}

/// A registration whose launch did not finish: deleted while offline (the launch failed or was
/// cut off), adopted once its runner shows up.
fn unlaunched(
    reg: &Registration,
    id: i64,
    runner: &Runner,
    state: &CycleState,
    policy: &Policy,
) -> Wants {
    if let Some(target) = may_delete(runner, cycle_prefix(state, policy)) {
        let reason = if reg.launch == Launch::Failed {
            DeleteReason::LaunchFailed
        } else {
            DeleteReason::LaunchCutOff
        };
        return Break(Step::Delete { target, reason });
    }
    match runner.status {
        RunnerStatus::Idle | RunnerStatus::Active => Break(Step::AdoptLaunch { id }),
        _ => Continue(format!(
            "{} (status {})",
            who(reg, id),
            runner.status.as_str()
        )),
    }
}

/// An idle runner: its job still waits (served, or not: `unserved`), or is gone (stranded once
/// the grace has passed).
fn idle(
    reg: &Registration,
    id: i64,
    runner: &Runner,
    obs: &Observation,
    policy: &Policy,
    now: Timestamp,
) -> Wants {
    let job = obs.jobs.as_ref().map(|jobs| {
        jobs.iter()
            .find(|j| j.handle == reg.job_handle && j.is_live())
    });
    match (job, reg.job_gone_since) {
        (None, _) => Continue(format!("{} (idle; jobs unknown)", who(reg, id))),
        (Some(Some(_)), Some(_)) => Break(Step::ClearJobGone { id }),
        (Some(Some(job)), None) => match unserved(reg, id, runner, job, policy, now) {
            Some(step) => Break(step),
            None => Continue(format!("{} (idle, its job waits)", who(reg, id))),
        },
        (Some(None), None) => Break(Step::MarkJobGone { id }),
        (Some(None), Some(since)) => {
            if now.since(since) >= policy.registration_grace {
                return Break(Step::Teardown {
                    reason: TeardownReason::Stranded { runner_id: id },
                });
            }
            Continue(format!("{} (idle, its job is gone)", who(reg, id)))
        }
    }
}

/// An offline runner: deleted once the registration grace has passed (unconsumed when it
/// connected, else never connected), else still starting.
fn offline(
    reg: &Registration,
    id: i64,
    runner: &Runner,
    state: &CycleState,
    policy: &Policy,
    now: Timestamp,
) -> Wants {
    let grace = policy.registration_grace;
    let offline_for = now.since(reg.grace_start());
    if offline_for >= grace
        && let Some(target) = may_delete(runner, cycle_prefix(state, policy))
    {
        let reason = if reg.connected {
            DeleteReason::Unconsumed
        } else {
            DeleteReason::NeverConnected
        };
        return Break(Step::Delete { target, reason });
    }
    Continue(format!(
        "{} (offline; starting, within the {} grace)",
        who(reg, id),
        format_duration(grace)
    ))
}

/// The VM is free (no registration waited on): torn down when spent, else the next job's runner,
/// else a wait (a warm VM's, or until the idle timeout).
fn decide_free(
    state: &CycleState,
    obs: &Observation,
    ctx: &RunContext,
    policy: &Policy,
    now: Timestamp,
) -> Step {
    if let Some(reason) = spent(state, policy, now) {
        return Step::Teardown { reason };
    }
    if let Some(jobs) = obs.jobs.as_deref()
        && let Some(step) = next_job(jobs, state, obs, ctx, policy, now)
    {
        return step;
    }
    // An unused warm VM waits for the pool's next job until it is too old or not wanted; the
    // idle timeout starts with its first runner.
    if is_unused_warm(state) {
        let ready_at = state.vm_ready_at.unwrap_or(state.started_at);
        return match warm_end(&policy.warm, ready_at, obs.warm_elsewhere, now) {
            Some(WarmEnd::Expired) => Step::Teardown {
                reason: TeardownReason::WarmExpired,
            },
            Some(WarmEnd::NotWanted) => Step::Teardown {
                reason: TeardownReason::WarmNotWanted,
            },
            None => Step::Wait {
                why: "warm VM up, waiting for a job".into(),
            },
        };
    }
    // Without a jobs list no runner can be started anyway (the POST needs Forgejo too), so the
    // idle timeout applies all the same: a teardown never needs Forgejo.
    let free_since = state
        .free_since
        .or(state.vm_ready_at)
        .unwrap_or(state.started_at);
    if now.since(free_since) >= policy.idle_timeout {
        return Step::Teardown {
            reason: TeardownReason::Idle,
        };
    }
    Step::Wait {
        why: if obs.jobs.is_some() {
            "VM free, waiting for a job".into()
        } else {
            "VM free, waiting for the jobs list (request failed)".into()
        },
    }
}

/// Why a free VM takes no further job: broken, at its job cap, too old, or an earlier runner's
/// process may still run on it.
fn spent(state: &CycleState, policy: &Policy, now: Timestamp) -> Option<TeardownReason> {
    if state.start_failures >= MAX_START_FAILURES {
        return Some(TeardownReason::BrokenVm);
    }
    if state.jobs_started >= policy.max_jobs_per_vm {
        return Some(TeardownReason::JobCap);
    }
    if now.since(state.started_at) >= policy.max_cycle_duration {
        return Some(TeardownReason::MaxCycleDuration);
    }
    // A runner process that may still run: nothing else starts on this VM.
    state.previous.iter().find_map(|p| match &p.process {
        ProcessState::NotGone(why) => Some(TeardownReason::PreviousRunnerNotGone {
            runner_id: p.id,
            why: why.clone(),
        }),
        _ => None,
    })
}

/// The step for the oldest servable job: its runner (once the launch command is usable and the
/// earlier runner checked), or a teardown when only jobs outside the VM's boundary wait.
fn next_job(
    jobs: &[Job],
    state: &CycleState,
    obs: &Observation,
    ctx: &RunContext,
    policy: &Policy,
    now: Timestamp,
) -> Option<Step> {
    let servable = servable_jobs(jobs, obs, policy, ctx, now);
    let Some(job) = servable.iter().find(|j| may_follow(state, policy, j)) else {
        return servable.first().map(|job| Step::Teardown {
            reason: TeardownReason::OutsideBoundary {
                job_id: job.id,
                reuse_within: policy.reuse_within,
            },
        });
    };
    // No runner can start, and no earlier one be checked: the VM goes (a cycle must never
    // outlive its configuration).
    if let Some(problem) = &obs.launch_problem {
        return Some(Step::Teardown {
            reason: TeardownReason::LaunchUnusable {
                problem: problem.clone(),
            },
        });
    }
    // A vanished registration is not an exited runner.
    if let Some(p) = state
        .previous
        .iter()
        .find(|p| p.process == ProcessState::Unchecked)
    {
        return Some(Step::CheckPrevious { id: p.id });
    }
    Some(Step::Register {
        job_id: job.id,
        job_handle: job.handle.clone(),
        boundary: Boundary {
            repo_id: job.repo_id,
            owner_id: job.owner_id,
        },
    })
}

/// Whether `job` may run on this cycle's VM: any job on a VM that ran none yet, else one inside
/// the boundary its first job set (`--reuse-within`). A cycle without a recorded boundary that
/// ran a job takes no other, except with `pool`.
fn may_follow(state: &CycleState, policy: &Policy, job: &Job) -> bool {
    match &state.boundary {
        Some(b) => policy.reuse_within.admits(b, job),
        None => {
            policy.reuse_within == ReuseWithin::Pool
                || (state.jobs_started == 0 && state.previous.is_empty())
        }
    }
}

/// Our runner is idle and its job is still listed: when the job waits and Forgejo will not (or
/// did not in time) give it to the runner, the VM goes. Labels first: a runner whose declared
/// labels do not cover the job's `runs_on` is never given it (`ItRunsOn`), so there is nothing
/// to wait for; else `--job-pickup-timeout` after the launch.
fn unserved(
    reg: &Registration,
    id: i64,
    runner: &Runner,
    job: &Job,
    policy: &Policy,
    now: Timestamp,
) -> Option<Step> {
    if !job.is_waiting() {
        return None;
    }
    if let Some(declared) = &runner.labels
        && !job_matches(job, declared)
    {
        return Some(Step::Teardown {
            reason: TeardownReason::WrongLabels {
                runner_id: id,
                job_id: job.id,
                declared: declared.clone(),
                runs_on: job.runs_on.clone(),
            },
        });
    }
    (now.since(reg.grace_start()) >= policy.job_pickup_timeout).then_some(Step::Teardown {
        reason: TeardownReason::PickupTimeout {
            runner_id: id,
            job_id: job.id,
        },
    })
}
