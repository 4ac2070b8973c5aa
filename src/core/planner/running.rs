//! The decision while the VM runs: the current registrations first, then whether the next job may
//! follow on this VM (its trust boundary, the earlier runner gone) or the VM must go.

use super::*;
use crate::core::warm::{WarmEnd, is_unused_warm, warm_end};

pub(super) fn decide_running(
    state: &CycleState,
    obs: &Observation,
    ctx: &RunContext,
    policy: &Policy,
    now: Timestamp,
) -> Step {
    let age = now.since(state.started_at);
    if age >= policy.hard_deadline {
        return Step::Teardown {
            reason: TeardownReason::HardDeadline,
        };
    }
    if let Some(name) = state.registrations.iter().find_map(|r| {
        ctx.cleanup_failures
            .get(&r.name)
            .is_some_and(|n| *n >= MAX_CLEANUP_FAILURES)
            .then(|| r.name.clone())
    }) {
        return Step::Teardown {
            reason: TeardownReason::CleanupFailing { name },
        };
    }
    let grace = policy.registration_grace;
    let mut waiting_on: Vec<String> = Vec::new();
    for reg in &state.registrations {
        let Some(id) = reg.id else {
            if now.since(reg.requested_at) < policy.intent_settle {
                waiting_on.push(format!(
                    "{} (POST unanswered; looked up by name once it has settled)",
                    reg.name
                ));
                continue;
            }
            if !ctx.failed_intents.contains(&reg.name) {
                return Step::ResolveIntent {
                    name: reg.name.clone(),
                };
            }
            waiting_on.push(format!("{} (lookup failed, retrying)", reg.name));
            continue;
        };
        let runner = match obs.runners.get(&id) {
            None => {
                waiting_on.push(format!("{} (status unknown: request failed)", who(reg, id)));
                continue;
            }
            Some(None) => return Step::Forget { id },
            Some(Some(r)) => r,
        };
        if ctx.failed_deletes.contains(&id) {
            waiting_on.push(format!("{} (delete failed, retrying)", who(reg, id)));
            continue;
        }
        if reg.launch != Launch::Done {
            if let Some(target) = may_delete(runner, cycle_prefix(state, policy)) {
                let reason = if reg.launch == Launch::Failed {
                    DeleteReason::LaunchFailed
                } else {
                    DeleteReason::LaunchCutOff
                };
                return Step::Delete { target, reason };
            }
            match runner.status {
                RunnerStatus::Idle | RunnerStatus::Active => return Step::AdoptLaunch { id },
                _ => {
                    waiting_on.push(format!(
                        "{} (status {})",
                        who(reg, id),
                        runner.status.as_str()
                    ));
                    continue;
                }
            }
        }
        // Seen up, or it declared itself (Forgejo shows what it declared) and went away since.
        let up = matches!(runner.status, RunnerStatus::Idle | RunnerStatus::Active);
        if !reg.connected && (up || runner.labels.is_some()) {
            return Step::MarkConnected { id };
        }
        if runner.status == RunnerStatus::Active && !reg.busy {
            return Step::MarkBusy { id };
        }
        match &runner.status {
            RunnerStatus::Active => waiting_on.push(format!("{} (active)", who(reg, id))),
            RunnerStatus::Idle => {
                let job = obs.jobs.as_ref().map(|jobs| {
                    jobs.iter()
                        .find(|j| j.handle == reg.job_handle && j.is_live())
                });
                match (job, reg.job_gone_since) {
                    (None, _) => waiting_on.push(format!("{} (idle; jobs unknown)", who(reg, id))),
                    (Some(Some(_)), Some(_)) => return Step::ClearJobGone { id },
                    (Some(Some(job)), None) => {
                        if let Some(step) = unserved(reg, id, runner, job, policy, now) {
                            return step;
                        }
                        waiting_on.push(format!("{} (idle, its job waits)", who(reg, id)))
                    }
                    (Some(None), None) => return Step::MarkJobGone { id },
                    (Some(None), Some(since)) => {
                        if now.since(since) >= grace {
                            return Step::Teardown {
                                reason: TeardownReason::Stranded { runner_id: id },
                            };
                        }
                        waiting_on.push(format!("{} (idle, its job is gone)", who(reg, id)));
                    }
                }
            }
            RunnerStatus::Offline => {
                let offline_for = now.since(reg.grace_start());
                if offline_for >= grace
                    && let Some(target) = may_delete(runner, cycle_prefix(state, policy))
                {
                    let reason = if reg.connected {
                        DeleteReason::Unconsumed
                    } else {
                        DeleteReason::NeverConnected
                    };
                    return Step::Delete { target, reason };
                }
                waiting_on.push(format!(
                    "{} (offline; starting, within the {} grace)",
                    who(reg, id),
                    format_duration(grace)
                ));
            }
            other => waiting_on.push(format!(
                "{} (unknown status {}; never deleted on doubt)",
                who(reg, id),
                other.as_str()
            )),
        }
    }
    if !waiting_on.is_empty() {
        return Step::Wait {
            why: format!("waiting for {}", waiting_on.join(", ")),
        };
    }

    // The VM is free.
    if state.start_failures >= MAX_START_FAILURES {
        return Step::Teardown {
            reason: TeardownReason::BrokenVm,
        };
    }
    if state.jobs_started >= policy.max_jobs_per_vm {
        return Step::Teardown {
            reason: TeardownReason::JobCap,
        };
    }
    if age >= policy.max_cycle_duration {
        return Step::Teardown {
            reason: TeardownReason::MaxCycleDuration,
        };
    }
    // A runner process that may still run: nothing else starts on this VM.
    if let Some((runner_id, why)) = state.previous.iter().find_map(|p| match &p.process {
        ProcessState::NotGone(why) => Some((p.id, why.clone())),
        _ => None,
    }) {
        return Step::Teardown {
            reason: TeardownReason::PreviousRunnerNotGone { runner_id, why },
        };
    }
    if let Some(jobs) = obs.jobs.as_deref() {
        let servable = servable_jobs(jobs, obs, policy, ctx, now);
        match servable.iter().find(|j| may_follow(state, policy, j)) {
            Some(job) => {
                // No runner can start, and no earlier one be checked: the VM goes (a cycle
                // must never outlive its configuration).
                if let Some(problem) = &obs.launch_problem {
                    return Step::Teardown {
                        reason: TeardownReason::LaunchUnusable {
                            problem: problem.clone(),
                        },
                    };
                }
                // A vanished registration is not an exited runner.
                if let Some(p) = state
                    .previous
                    .iter()
                    .find(|p| p.process == ProcessState::Unchecked)
                {
                    return Step::CheckPrevious { id: p.id };
                }
                return Step::Register {
                    job_id: job.id,
                    job_handle: job.handle.clone(),
                    boundary: Boundary {
                        repo_id: job.repo_id,
                        owner_id: job.owner_id,
                    },
                };
            }
            None => {
                if let Some(job) = servable.first() {
                    return Step::Teardown {
                        reason: TeardownReason::OutsideBoundary {
                            job_id: job.id,
                            reuse_within: policy.reuse_within,
                        },
                    };
                }
            }
        }
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

/// Whether `job` may run on this cycle's VM: any job on a VM that ran none yet, else one inside
/// the boundary its first job set (`--reuse-within`). A cycle without a recorded boundary that
/// ran a job (written before boundaries were) takes no other, except with `pool`.
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
