//! The decisions once the VM is going or gone: delete what is provably dead, destroy, and (only
//! after a destroy in this run) sweep.

use std::ops::ControlFlow::{self, Break, Continue};

use super::*;

/// Why a registration still there at teardown is deleted: `stranded` when its runner was seen
/// idle after its job had gone, `pickup_timeout`/`wrong_labels` when its runner was not given
/// its waiting job, else `teardown`.
fn leftover_reason(reg: &Registration) -> DeleteReason {
    match (reg.job_gone_since, reg.not_served) {
        (Some(_), _) => DeleteReason::Stranded,
        (None, Some(NotServed::PickupTimeout)) => DeleteReason::PickupTimeout,
        (None, Some(NotServed::WrongLabels)) => DeleteReason::WrongLabels,
        (None, None) => DeleteReason::Teardown,
    }
}

pub(super) fn decide_tearing_down(
    state: &CycleState,
    obs: &Observation,
    ctx: &RunContext,
    policy: &Policy,
) -> Step {
    // Delete what is provably dead before the VM goes; anything else waits until after destroy.
    for reg in &state.registrations {
        let Some(id) = reg.id else { continue };
        match obs.runners.get(&id) {
            Some(None) => return Step::Forget { id },
            // A runner whose stop failed may come up while the VM runs: after the destroy.
            Some(Some(_)) if stop_failed(reg).is_some() => {}
            Some(Some(r)) if !ctx.failed_deletes.contains(&id) => {
                if let Some(target) = may_delete(r, cycle_prefix(state, policy)) {
                    return Step::Delete {
                        target,
                        reason: leftover_reason(reg),
                    };
                }
            }
            _ => {}
        }
    }
    Step::Destroy
}

pub(super) fn decide_destroyed(
    state: &CycleState,
    obs: &Observation,
    ctx: &RunContext,
    policy: &Policy,
    now: Timestamp,
) -> Step {
    if !ctx.destroyed_this_run {
        // The destroy happened in an earlier run; only a destroy in this run licenses a sweep.
        // On empty state it is a no-op.
        return Step::Destroy;
    }
    let left = match leftovers(state, obs, ctx, policy, now) {
        Break(step) => return step,
        Continue(left) => left,
    };
    if let Some(step) = left.hold_back(state, now) {
        return step;
    }
    if !ctx.swept {
        return Step::Sweep(SweepLicence::after_destroy(state));
    }
    Step::Finish
}

/// The registrations still in cycle.json after the destroy that ask for no step of their own.
#[derive(Default)]
struct Leftovers {
    /// Their delete (or lookup) failed in this run.
    failed: Vec<String>,
    /// Not offline yet, or their status is unknown.
    waiting_on: Vec<String>,
    /// Unanswered POSTs: they wait out their own (finite) settle time, not the offline bound.
    settling: Vec<String>,
}

/// The step a registration left after the destroy asks for (forget, delete, look up), or else
/// what keeps each of them.
fn leftovers(
    state: &CycleState,
    obs: &Observation,
    ctx: &RunContext,
    policy: &Policy,
    now: Timestamp,
) -> ControlFlow<Step, Leftovers> {
    let mut left = Leftovers::default();
    for reg in &state.registrations {
        let Some(id) = reg.id else {
            if ctx.failed_intents.contains(&reg.name) {
                left.failed.push(reg.name.clone());
                continue;
            }
            if now.since(reg.requested_at) < policy.intent_settle {
                left.settling.push(reg.name.clone());
                continue;
            }
            return Break(Step::ResolveIntent {
                name: reg.name.clone(),
            });
        };
        match obs.runners.get(&id) {
            Some(None) => return Break(Step::Forget { id }),
            Some(Some(_)) if ctx.failed_deletes.contains(&id) => left.failed.push(who(reg, id)),
            Some(Some(r)) => {
                if let Some(target) = may_delete(r, cycle_prefix(state, policy)) {
                    return Break(Step::Delete {
                        target,
                        reason: leftover_reason(reg),
                    });
                }
                left.waiting_on
                    .push(format!("{} (status {})", who(reg, id), r.status.as_str()))
            }
            None => left
                .waiting_on
                .push(format!("{} (status unknown: request failed)", who(reg, id))),
        }
    }
    Continue(left)
}

impl Leftovers {
    /// What the leftovers hold the cycle back with: a give-up when a delete failed or a runner
    /// is not offline `OFFLINE_AFTER_DESTROY` after the destroy, else a wait; `None` when there
    /// are none.
    fn hold_back(&self, state: &CycleState, now: Timestamp) -> Option<Step> {
        if !self.failed.is_empty() {
            return Some(Step::GiveUp {
                why: format!(
                    "could not delete {} after the destroy; cycle.json is kept and the next run retries",
                    self.failed.join(", ")
                ),
            });
        }
        if !self.waiting_on.is_empty() {
            // Fail safe: without a recorded destroy time, count from the start of the cycle.
            let destroyed_at = state.destroyed_at.unwrap_or(state.started_at);
            if now.since(destroyed_at) >= OFFLINE_AFTER_DESTROY {
                return Some(Step::GiveUp {
                    why: format!(
                        "{} not offline {} after the VM was destroyed; cycle.json is kept and the next run retries",
                        self.waiting_on.join(", "),
                        format_duration(OFFLINE_AFTER_DESTROY)
                    ),
                });
            }
            return Some(Step::Wait {
                why: format!(
                    "VM destroyed; waiting until {} goes offline",
                    self.waiting_on.join(", ")
                ),
            });
        }
        if !self.settling.is_empty() {
            return Some(Step::Wait {
                why: format!(
                    "VM destroyed; waiting until the unanswered POST of {} has settled, then looking it up",
                    self.settling.join(", ")
                ),
            });
        }
        None
    }
}
