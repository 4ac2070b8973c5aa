//! The cycle's VM: a new cycle recorded before its apply, the apply and its outputs, the destroy.

use super::persist::{SaveFailed, write};
use super::{Driver, End};
use crate::core::backoff::FailureReason;
use crate::core::planner::TeardownReason;
use crate::core::ports::{Claim, Outputs, Start, StepError};
use crate::core::report::{Outcome, Stopwatch};
use crate::core::state::{CycleState, DESTROY_FAILED, Phase};
use crate::core::time::Timestamp;

impl Driver<'_, '_> {
    /// A new cycle.json, claiming the attempt `job_handle` of `job_id` for this slot; nothing when
    /// another slot of the pool claimed it meanwhile (the next observation shows that claim).
    pub(super) fn start_cycle(
        &mut self,
        job_id: i64,
        job_handle: &str,
        now: Timestamp,
    ) -> Option<End> {
        let mut state = match self.new_cycle(now) {
            Ok(s) => s,
            Err(problem) => return Some(End::Config(format!("a job is waiting but {problem}"))),
        };
        state.claim = Some(job_id);
        state.claim_handle = Some(job_handle.to_string());
        let gate = self.backoff_gate(now);
        let mut wrote = false;
        let start = write(self.report, &mut *self.w.store, &mut wrote, |store| {
            store.save_starting(&state, job_id, job_handle, &gate)
        });
        self.started(state, start, Some(job_id))
    }

    /// A new cycle.json for a warm VM (no job), unless the other slots made enough meanwhile or
    /// the pool backs off.
    pub(super) fn start_warm(&mut self, now: Timestamp) -> Option<End> {
        let mut state = match self.new_cycle(now) {
            Ok(s) => s,
            Err(problem) => {
                return Some(End::Config(format!(
                    "the pool wants a warm VM (--warm) but {problem}"
                )));
            }
        };
        state.warm = true;
        let gate = self.backoff_gate(now);
        let wanted = self.cfg.policy.warm.wanted(now);
        let mut wrote = false;
        let start = write(self.report, &mut *self.w.store, &mut wrote, |store| {
            store.save_starting_warm(&state, wanted, &gate)
        });
        self.started(state, start, None)
    }

    /// The cycle a start writes: a fresh id (slot K >= 2's end in `-sK`), this configuration's
    /// prefix. `Err` when tofu or the launch command cannot be run (a configuration problem).
    fn new_cycle(&mut self, now: Timestamp) -> Result<CycleState, String> {
        self.w.tofu.check_config().map_err(|e| format!("{e:#}"))?;
        self.w
            .launcher
            .check_config()
            .map_err(|e| format!("{e:#}"))?;
        let id = match self.cfg.slot {
            0 | 1 => self.w.clock.new_cycle_id(now),
            k => format!("{}-s{k}", self.w.clock.new_cycle_id(now)),
        };
        let mut state = CycleState::new(id, now);
        state
            .runner_prefix
            .clone_from(&self.cfg.policy.runner_prefix);
        Ok(state)
    }

    /// After the write of a new cycle for `job` (`None`: a warm VM): this run's cycle from now
    /// on, or why there is none.
    fn started(
        &mut self,
        state: CycleState,
        start: Result<Start, SaveFailed>,
        job: Option<i64>,
    ) -> Option<End> {
        match (start, job) {
            (Err(SaveFailed), _) => return Some(End::Done),
            (Ok(Start::Claim(Claim::HeldBy(slot))), Some(job_id)) => {
                log::info!("job {job_id} was claimed by {slot} meanwhile; no cycle for it here");
                return None;
            }
            (Ok(Start::Claim(Claim::HeldBy(warm))), None) => {
                log::info!("{warm} are all the pool wants (--warm); no warm VM here");
                return None;
            }
            (Ok(Start::BackingOff(closed)), _) => {
                match job {
                    Some(job_id) => {
                        log::warn!("job {job_id} is waiting, but {}", closed.describe())
                    }
                    None => log::warn!("no warm VM (--warm): {}", closed.describe()),
                }
                self.report.backoff = Some(closed);
                return Some(self.end(Outcome::BackingOff));
            }
            (Ok(Start::Claim(Claim::Saved)), _) => self.progressed = true,
        }
        let id = state.cycle_id.clone();
        let warm = if state.warm {
            " (warm: no job yet)"
        } else {
            ""
        };
        log::info!("starting cycle {id}{warm}");
        self.state = Some(state);
        self.report.cycle_id = Some(id.clone());
        crate::crash_point!("cycle-started-written");
        self.report
            .event("start_cycle", true, format!("cycle {id}{warm}"));
        None
    }

    pub(super) fn apply(&mut self) -> Option<End> {
        let cycle_id = self.state.as_ref()?.cycle_id.clone();
        if let Some(end) = self.guard("tofu apply") {
            return Some(end);
        }
        let sw = Stopwatch::start(&*self.w.clock);
        let result = self
            .w
            .tofu
            .apply(&cycle_id)
            .and_then(|()| self.w.tofu.outputs(&cycle_id));
        match result {
            Ok(outputs) => {
                crate::crash_point!("apply-done-unsaved");
                let s = self.state.as_mut()?;
                let ready = self.w.clock.now();
                s.phase = Phase::Running;
                s.vm_ready_at = Some(ready);
                s.free_since = Some(ready);
                s.outputs = outputs
                    .iter()
                    .filter(|(_, o)| !o.sensitive)
                    .map(|(k, o)| (k.clone(), o.value.clone()))
                    .collect();
                self.outputs = Some(outputs);
                if self.save().is_err() {
                    return Some(End::Done);
                }
                crate::crash_point!("apply-running-written");
                self.report
                    .event("tofu_apply", true, "VM ready")
                    .duration_ms = sw.ms(&*self.w.clock);
                None
            }
            Err(e) if e.interrupted => {
                self.report
                    .event("tofu_apply", false, e.message.clone())
                    .duration_ms = sw.ms(&*self.w.clock);
                Some(self.interrupted("during tofu apply"))
            }
            Err(e) => {
                self.report
                    .event("tofu_apply", false, e.message.clone())
                    .duration_ms = sw.ms(&*self.w.clock);
                self.report
                    .fail(format!("tofu apply failed: {}", e.message));
                self.state.as_mut()?.apply_failed(
                    format!("tofu apply failed: {}", e.message),
                    TeardownReason::ApplyFailed.describe(),
                );
                if self.save().is_err() {
                    return Some(End::Done);
                }
                crate::crash_point!("apply-failed-written");
                None
            }
        }
    }

    /// The VM's tofu outputs, read once per run.
    pub(super) fn vm_outputs(&mut self) -> Result<Outputs, StepError> {
        if let Some(o) = &self.outputs {
            return Ok(o.clone());
        }
        let cycle_id = self
            .state
            .as_ref()
            .map(|s| s.cycle_id.clone())
            .unwrap_or_default();
        let o = self.w.tofu.outputs(&cycle_id)?;
        self.outputs = Some(o.clone());
        Ok(o)
    }

    pub(super) fn destroy(&mut self) -> Option<End> {
        let s = self.state.as_ref()?;
        let cycle_id = s.cycle_id.clone();
        let mut reason = s
            .teardown_reason
            .clone()
            .unwrap_or_else(|| "teardown".to_string());
        if s.destroy_failed() {
            reason = format!("retrying a failed destroy ({reason})");
        }
        if let Some(end) = self.guard("tofu destroy") {
            return Some(end);
        }
        let sw = Stopwatch::start(&*self.w.clock);
        match self.w.tofu.destroy(&cycle_id, &reason) {
            Ok(()) => {
                crate::crash_point!("destroy-done-unsaved");
                let s = self.state.as_mut()?;
                s.phase = Phase::Destroyed;
                // The wait for registrations to go offline counts from the end of the destroy.
                s.destroyed_at = Some(self.w.clock.now());
                s.last_error = None;
                self.ctx.destroyed_this_run = true;
                // What failed before the destroy gets one more try after it, in this run.
                self.ctx.failed_deletes.clear();
                self.ctx.failed_intents.clear();
                if self.save().is_err() {
                    return Some(End::Done);
                }
                crate::crash_point!("destroy-written");
                self.report
                    .event("tofu_destroy", true, "VM destroyed")
                    .duration_ms = sw.ms(&*self.w.clock);
                None
            }
            Err(e) => {
                self.report
                    .event("tofu_destroy", false, e.message.clone())
                    .duration_ms = sw.ms(&*self.w.clock);
                if e.interrupted {
                    return Some(self.interrupted("during tofu destroy"));
                }
                let s = self.state.as_mut()?;
                s.last_error = Some(format!("{DESTROY_FAILED}: {}", e.message));
                s.failure = Some(FailureReason::DestroyFailed);
                self.save_before_ending();
                // Counted now, not when the retried destroy works: a pool whose destroys fail
                // must back off too (the cycle is counted once either way).
                self.record_outcome();
                self.report.fail(format!(
                    "tofu destroy failed: {}; no sweep; cycle.json is kept and the next run retries the destroy first",
                    e.message
                ));
                Some(self.end(Outcome::DestroyFailed))
            }
        }
    }
}
