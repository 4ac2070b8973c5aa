//! How the driver persists: each write of the cycle's state before the side effect that follows
//! from it, the guard before an irreversible step, and the count of how a cycle ended in the
//! pool's failure backoff. A failed write is reported and stops the run.

use crate::core::backoff::Change;
use crate::core::ports::{BackoffGate, Claim, StateStore};
use crate::core::report::{Outcome, Report};
use crate::core::state::CycleState;
use crate::core::time::Timestamp;

use super::{Driver, End};

/// Whether `e` says that another host adopted this process's cycle.
pub(super) fn is_fenced(e: &anyhow::Error) -> bool {
    e.downcast_ref::<crate::core::pool::Fenced>().is_some()
}
/// cycle.json could not be written (reported): stop before the next side effect.
pub(super) struct SaveFailed;

/// One write of cycle.json: what was done so far is in the audit trail (durably) before the
/// state that follows from it; a failure is reported, and the run stops.
pub(super) fn write<T>(
    report: &mut Report,
    store: &mut dyn StateStore,
    progressed: &mut bool,
    write: impl FnOnce(&mut dyn StateStore) -> anyhow::Result<T>,
) -> Result<T, SaveFailed> {
    report.sync_audit();
    match write(&mut *store) {
        Ok(t) => {
            *progressed = true;
            Ok(t)
        }
        Err(e) => {
            report.fail(format!(
                "cannot write {}: {e:#}; stopping before any further side effect",
                store.describe()
            ));
            report.outcome = if is_fenced(&e) {
                Outcome::Fenced
            } else {
                Outcome::Failed
            };
            Err(SaveFailed)
        }
    }
}

impl Driver<'_, '_> {
    /// Before an irreversible step: the store makes sure this process still owns its cycle and
    /// that its lease outlasts the step (`StateStore::guard`). `Some(end)` when it could not
    /// (reported): the step must not happen, and the run ends.
    pub(super) fn guard(&mut self, step: &str) -> Option<End> {
        let e = self.w.store.guard(step).err()?;
        if is_fenced(&e) {
            self.report.fail(format!("{e:#}"));
            return Some(self.end(Outcome::Fenced));
        }
        self.report.fail(format!(
            "cannot make sure this host still owns its cycle before {step}: {e:#}; stopping before it"
        ));
        Some(self.end(Outcome::Failed))
    }

    /// Writes cycle.json. `Err` when that failed: the failure is in the report already, and the
    /// run must stop before any further side effect.
    pub(super) fn save(&mut self) -> Result<(), SaveFailed> {
        let Some(state) = &self.state else {
            self.report.sync_audit();
            return Ok(());
        };
        write(
            self.report,
            &mut *self.w.store,
            &mut self.progressed,
            |store| store.save(state),
        )
    }

    /// Writes `state` (not yet this driver's), which claims the attempt `handle` of `job_id`,
    /// unless another slot holds that attempt (`StateStore::save_claiming`). `Err` as for [`Self::save`]. A refused claim
    /// writes nothing, so it is no progress: were it refused again and again (the planner
    /// choosing a job the store says another slot holds), the runaway guard stops the run.
    pub(super) fn save_claiming(
        &mut self,
        state: &CycleState,
        job_id: i64,
        handle: &str,
    ) -> Result<Claim, SaveFailed> {
        let mut wrote = false;
        let claim = write(self.report, &mut *self.w.store, &mut wrote, |store| {
            store.save_claiming(state, job_id, handle)
        })?;
        if claim == Claim::Saved {
            self.progressed |= wrote;
        }
        Ok(claim)
    }

    /// Writes cycle.json on a path that ends the run either way: a failure is in the report
    /// already (`save` logged it at error level; the exit status is 1), nothing is left to stop.
    pub(super) fn save_before_ending(&mut self) {
        if self.save().is_err() {
            log::debug!("the run ends without its last cycle.json write (reported above)");
        }
    }

    /// Writes the held jobs; a failure is a failure of the run, not a reason to stop it.
    pub(super) fn save_holds(&mut self) {
        if let Err(e) = self.w.store.save_holds(&self.ctx.holds) {
            self.report.fail(format!("{e:#}"));
        }
    }

    pub(super) fn backoff_gate(&self, now: Timestamp) -> BackoffGate {
        BackoffGate {
            policy: self.cfg.backoff,
            slot: self.cfg.slot,
            now,
        }
    }

    /// Counts how this cycle ended in the pool's failure backoff, and says what that changed.
    /// False when backoff.json could not be read or written (reported): cycle.json must stay,
    /// so that the next run counts it.
    pub(super) fn record_outcome(&mut self) -> bool {
        let Some(s) = &self.state else {
            return true;
        };
        let (cycle_id, outcome) = (s.cycle_id.clone(), s.outcome());
        let gate = self.backoff_gate(self.w.clock.now());
        match self.w.store.record_outcome(&gate, &cycle_id, outcome) {
            Err(e) => {
                self.report.fail(format!(
                    "cannot count how cycle {cycle_id} ended in the pool's failure backoff: {e:#}; cycle.json is kept and the next run counts it"
                ));
                false
            }
            Ok((b, Change::BackingOff)) => {
                if let Some(closed) = b.closed(gate.now) {
                    let detail = closed.describe();
                    log::warn!("{detail}");
                    self.report.event("backoff", false, detail);
                }
                true
            }
            Ok((_, Change::Reset { ended: true })) => {
                let detail =
                    format!("cycle {cycle_id} served a job: the pool's failure backoff is over");
                log::info!("{detail}");
                self.report.event("backoff_ended", true, detail);
                true
            }
            Ok((b, Change::Counted)) => {
                log::info!(
                    "cycle {cycle_id} failed without serving a job: {} of {} in a row before the pool backs off",
                    b.consecutive_failed_cycles,
                    self.cfg.backoff.max_failed_cycles
                );
                true
            }
            Ok((_, Change::Unchanged | Change::Reset { ended: false })) => true,
        }
    }
}
