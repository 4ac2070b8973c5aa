//! The decisions once the VM is going or gone: delete what is provably dead, destroy, and (only
//! after a destroy in this run) sweep.

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
    let mut failed: Vec<String> = Vec::new();
    let mut waiting_on: Vec<String> = Vec::new();
    // Unanswered POSTs wait out their own (finite) settle time, not the offline bound.
    let mut settling: Vec<String> = Vec::new();
    for reg in &state.registrations {
        let Some(id) = reg.id else {
            if ctx.failed_intents.contains(&reg.name) {
                failed.push(reg.name.clone());
                continue;
            }
            if now.since(reg.requested_at) < policy.intent_settle {
                settling.push(reg.name.clone());
                continue;
            }
            return Step::ResolveIntent {
                name: reg.name.clone(),
            };
        };
        match obs.runners.get(&id) {
            Some(None) => return Step::Forget { id },
            Some(Some(_)) if ctx.failed_deletes.contains(&id) => failed.push(who(reg, id)),
            Some(Some(r)) => {
                if let Some(target) = may_delete(r, cycle_prefix(state, policy)) {
                    return Step::Delete {
                        target,
                        reason: leftover_reason(reg),
                    };
                }
                waiting_on.push(format!("{} (status {})", who(reg, id), r.status.as_str()))
            }
            None => waiting_on.push(format!("{} (status unknown: request failed)", who(reg, id))),
        }
    }
    if !failed.is_empty() {
        return Step::GiveUp {
            why: format!(
                "could not delete {} after the destroy; cycle.json is kept and the next run retries",
                failed.join(", ")
            ),
        };
    }
    if !waiting_on.is_empty() {
        // Fail safe: without a recorded destroy time, count from the start of the cycle.
        let destroyed_at = state.destroyed_at.unwrap_or(state.started_at);
        if now.since(destroyed_at) >= OFFLINE_AFTER_DESTROY {
            return Step::GiveUp {
                why: format!(
                    "{} not offline {} after the VM was destroyed; cycle.json is kept and the next run retries",
                    waiting_on.join(", "),
                    format_duration(OFFLINE_AFTER_DESTROY)
                ),
            };
        }
        return Step::Wait {
            why: format!(
                "VM destroyed; waiting until {} goes offline",
                waiting_on.join(", ")
            ),
        };
    }
    if !settling.is_empty() {
        return Step::Wait {
            why: format!(
                "VM destroyed; waiting until the unanswered POST of {} has settled, then looking it up",
                settling.join(", ")
            ),
        };
    }
    if !ctx.swept {
        return Step::Sweep(SweepLicence::after_destroy(state));
    }
    Step::Finish
}
