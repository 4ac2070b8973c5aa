//! The imperative shell around the planner: observe, decide, act, persist; repeat until the
//! cycle ends, the run fails, or (dry-run) the cycle would wait on the outside world.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::core::backoff::BackoffPolicy;
use crate::core::forgejo::{Job, job_matches, waiting_jobs};
use crate::core::holds::{Holds, HoldsError};
use crate::core::planner;
use crate::core::planner::{Observation, Policy, RunContext, Step, TeardownReason};
use crate::core::ports::{
    Clock, Forgejo, LaunchRequest, Launcher, Outputs, Sleep, StateStore, Tofu,
};
use crate::core::report::{Outcome, Report, Stopwatch};
use crate::core::state::{CycleState, NotServed, Phase, PreviousRunner};
use crate::core::sweep::gate::DeleteReason;
use crate::core::sweep::licence::SweepLicence;
use crate::core::time::{Timestamp, format_duration};
use crate::core::wake::WakePolicy;
use crate::driver::sweep;

mod observed;
mod persist;
mod registrations;
mod vm;

pub struct CycleConfig {
    pub policy: Policy,
    pub poll_interval: Duration,
    /// `--labels` as given (for `RUNNER_LABELS`).
    pub labels: String,
    pub forgejo_url: String,
    pub sweep_max_deletions: usize,
    /// This host's id in a pool across hosts (`--host-id` with `--store pg`; empty with the
    /// files store): which warm VMs of the pool count as in lower slots.
    pub host: String,
    /// The pool's slot this run serves (`--slot`): slot K ≥ 2's cycle ids end in `-sK`, so that
    /// two slots' cycles (and their registrations' names) never share an id, whatever the clock
    /// and the random part say.
    pub slot: u32,
    /// The pool's failure backoff (`--max-failed-cycles`, `--failure-backoff`, `--failure-backoff-max`).
    pub backoff: BackoffPolicy,
    /// What a webhook delivery does to this run (`--wake-window`; none without `--wake-file`).
    pub wake: WakePolicy,
}

/// The ports this run acts through: the real adapters, or a dry-run's.
pub struct World<'a> {
    pub forgejo: &'a mut dyn Forgejo,
    pub tofu: &'a mut dyn Tofu,
    pub launcher: &'a mut dyn Launcher,
    pub store: &'a mut dyn StateStore,
    pub clock: &'a mut dyn Clock,
}

#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// Finished as far as this run goes; the report's outcome and failures give the exit
    /// status (`Outcome::exit_code`).
    Done,
    /// A configuration problem (exit 2).
    Config(String),
}

/// Why a woken run with nothing to do waits (`Step::Idle` while `WakePolicy::watch` says so).
const WATCHING: &str = "woken: looking for the delivery's jobs";

/// Steps without a wait or a change to cycle.json after which the driver assumes a bug and stops.
const MAX_STEPS_WITHOUT_WAIT: u32 = 500;

struct Driver<'w, 'a> {
    w: &'w mut World<'a>,
    cfg: &'w CycleConfig,
    report: &'w mut Report,
    state: Option<CycleState>,
    ctx: RunContext,
    outputs: Option<Outputs>,
    /// cycle.json was written since the step counter was last reset: the run is progressing.
    progressed: bool,
    /// The status each registration had when last observed (the evidence of a deletion).
    seen: BTreeMap<i64, String>,
    /// Jobs listed without a handle that this run warned about (once each).
    no_handle: BTreeSet<i64>,
    /// When the other slots first saw each waiting job (their `held-jobs.json`), as last read.
    others_first_seen: BTreeMap<String, Timestamp>,
    /// The slots beyond `--slots` with a cycle in progress were reported in this run.
    beyond_reported: bool,
    /// When this run started (a woken run watches for a bounded time, `WakePolicy::watch`).
    started: Timestamp,
    /// The delivery this run last said it watches for (said once each).
    watching: Option<Timestamp>,
}

pub fn run(w: &mut World<'_>, cfg: &CycleConfig, report: &mut Report) -> End {
    let state = match w.store.load() {
        Ok(s) => s,
        Err(e) => {
            report.fail(format!("{e:#}"));
            report.outcome = Outcome::Failed;
            return End::Done;
        }
    };
    report.cycle_id = state.as_ref().map(|s| s.cycle_id.clone());
    if let Some(a) = w.store.adopted() {
        log::warn!("{}", a.describe());
        report.event("adopt_cycle", true, a.describe());
    }
    // Held jobs are advice, not a safety record: a file that cannot be read is a failure of
    // this run, which goes on without holds (at worst a held job gets a runner once more); one
    // that is unusable is also removed, or every run would fail the same way.
    let holds = w.store.load_holds().unwrap_or_else(|e| {
        let empty = Holds::default();
        let what = match &e {
            HoldsError::Unreadable(_) => "going on without held jobs".to_string(),
            HoldsError::Unusable(_) => match w.store.save_holds(&empty) {
                Ok(()) => "it was removed; going on without held jobs".to_string(),
                Err(e) => format!("removing it failed too: {e:#}; going on without held jobs"),
            },
        };
        report.fail(format!("{e}; {what}"));
        empty
    });
    let started = w.clock.now();
    let mut d = Driver {
        w,
        cfg,
        report,
        state,
        ctx: RunContext {
            holds,
            ..RunContext::default()
        },
        outputs: None,
        progressed: false,
        seen: BTreeMap::new(),
        no_handle: Default::default(),
        others_first_seen: BTreeMap::new(),
        beyond_reported: false,
        started,
        watching: None,
    };
    // Nothing can be done for a cycle in progress without tofu, not even its teardown.
    if let Some(s) = &d.state
        && let Err(e) = d.w.tofu.check_config()
    {
        return End::Config(format!("cycle {} is in progress but {e:#}", s.cycle_id));
    }
    let end = d.drive();
    let cycle = d.state.clone();
    if let Some(view) = d.w.store.pool_view() {
        d.report.pool = Some(crate::core::report::PoolReport { view, cycle });
    }
    end
}

/// The request naming an earlier runner to the launch command (check, stop): its
/// registration's environment and the VM's outputs.
fn runner_request<'r>(
    cfg: &'r CycleConfig,
    p: &'r PreviousRunner,
    outputs: &'r Outputs,
) -> LaunchRequest<'r> {
    LaunchRequest {
        runner_id: p.id,
        runner_uuid: &p.uuid,
        runner_name: &p.name,
        job_id: p.job_id,
        job_handle: &p.job_handle,
        labels: &cfg.labels,
        forgejo_url: &cfg.forgejo_url,
        outputs,
    }
}

impl Driver<'_, '_> {
    /// What Forgejo and the other slots say now; true when some of it could not be read.
    fn observe(&mut self) -> (Observation, bool) {
        let mut obs = Observation::default();
        if self
            .state
            .as_ref()
            .is_some_and(|s| s.phase == Phase::Running)
        {
            obs.launch_problem = self
                .w
                .launcher
                .check_config()
                .err()
                .map(|e| format!("{e:#}"));
        }
        let (want_jobs, ids): (bool, Vec<i64>) = match &self.state {
            None => (true, vec![]),
            Some(s) => {
                let ids = s.registrations.iter().filter_map(|r| r.id).collect();
                match s.phase {
                    Phase::Applying => (false, vec![]),
                    Phase::Running => (true, ids),
                    Phase::TearingDown | Phase::Destroyed => (false, ids),
                }
            }
        };
        let mut failed = want_jobs && self.observe_jobs(&mut obs);
        for id in ids {
            match self.w.forgejo.get_runner(id) {
                Ok(r) => {
                    if let Some(r) = &r {
                        self.seen.insert(id, r.status.as_str().to_string());
                    }
                    obs.runners.insert(id, r);
                }
                Err(e) => {
                    failed = true;
                    self.report
                        .fail(format!("checking registration {id} failed: {e}"));
                }
            }
        }
        (obs, failed)
    }

    /// The jobs list and the other slots' claims into `obs`, the held jobs brought up to date;
    /// true when either could not be read.
    fn observe_jobs(&mut self, obs: &mut Observation) -> bool {
        // Read before the jobs: a claim another slot writes meanwhile is caught again under
        // the claims lock, when this slot claims a job itself.
        let o = match self.w.store.others() {
            Ok(o) => o,
            Err(e) => {
                self.report.fail(format!(
                    "{e:#}; no job is served while the other slots' claims are unknown"
                ));
                return true;
            }
        };
        let jobs = match self.w.forgejo.list_jobs() {
            Ok(jobs) => jobs,
            Err(e) => {
                self.report
                    .fail(format!("asking Forgejo for jobs failed: {e}"));
                return true;
            }
        };
        // A slot beyond --slots with a cycle in progress: its VM and registrations stay until
        // that slot runs again, which no timer may do any more. Every slot says so, every run
        // that looks for jobs.
        if !std::mem::replace(&mut self.beyond_reported, true) {
            for b in &o.beyond {
                self.report.fail(b.clone());
            }
        }
        obs.claimed_elsewhere = o.claimed(self.w.clock.now());
        obs.warm_elsewhere = o.warm_elsewhere(self.cfg.slot, &self.cfg.host);
        self.others_first_seen = o.first_seen;
        // A held job that is no longer listed (done, cancelled, re-run) is forgotten; a waiting
        // job is remembered from when it was first seen (its pickup time counts from then).
        self.warn_without_handle(&jobs);
        let pruned = self.ctx.holds.prune(&jobs);
        let waiting = waiting_jobs(&jobs, &self.cfg.policy.label_names);
        let now = self.w.clock.now();
        let noted = self.ctx.holds.note_waiting(&waiting, now);
        if pruned || noted {
            self.save_holds();
        }
        obs.jobs = Some(jobs);
        false
    }

    /// A waiting job of ours listed without a handle is never served (`Job::has_handle`): said
    /// once per run, at warn level.
    fn warn_without_handle(&mut self, jobs: &[Job]) {
        let names = &self.cfg.policy.label_names;
        for j in jobs
            .iter()
            .filter(|j| j.is_waiting() && !j.has_handle() && job_matches(j, names))
        {
            if self.no_handle.insert(j.id) {
                log::warn!(
                    "job {} is listed without a handle; not serving it: a runner asked for no handle takes any job of its labels, not this one (Forgejo 15 or newer lists every job with one)",
                    j.id
                );
            }
        }
    }

    /// Observes, decides and acts, step after step, until the run ends.
    fn drive(&mut self) -> End {
        let mut steps = 0u32;
        // A long job means hours of identical waits: log each reason once at info level.
        let mut last_wait = String::new();
        loop {
            if self.w.clock.stop_requested() {
                return self.interrupted("between steps");
            }
            // A busy queue is many steps without a wait (register, consumed, register, …); only
            // steps that change nothing count towards the runaway guard.
            if std::mem::take(&mut self.progressed) {
                steps = 0;
            }
            steps += 1;
            if steps > MAX_STEPS_WITHOUT_WAIT {
                self.report.fail(format!(
                    "internal error: {MAX_STEPS_WITHOUT_WAIT} steps without progress; cycle.json is kept"
                ));
                return self.end(Outcome::Failed);
            }
            let (obs, failed) = self.observe();
            self.ctx.failed_observations = if failed {
                self.ctx.failed_observations + 1
            } else {
                0
            };
            let now = self.w.clock.now();
            let step = planner::decide(self.state.as_ref(), &obs, &self.ctx, &self.cfg.policy, now);
            log::debug!("step: {step:?}");
            let end = match step {
                Step::Idle => match self.watch(now) {
                    Some(pause) => {
                        let end = self.wait_for(pause, WATCHING.into(), &mut last_wait);
                        if end.is_none() {
                            steps = 0;
                        }
                        end
                    }
                    None => {
                        log::info!(
                            "no waiting job to serve (none matches the labels, or each is held or claimed by another slot); nothing to do"
                        );
                        Some(self.end(Outcome::Idle))
                    }
                },
                Step::GiveUp { why } => {
                    // A dry-run's failed read is its one error: what a live run would make of
                    // it (asking again at its next run) is not a second one.
                    if !(failed && self.report.dry_run) {
                        self.report.fail(why);
                    }
                    Some(self.end(Outcome::Failed))
                }
                Step::Wait { why } => {
                    let end = self.wait(why, &mut last_wait);
                    if end.is_none() {
                        steps = 0;
                    }
                    end
                }
                Step::Finish => Some(self.finish()),
                other => self.act(other, now),
            };
            if let Some(end) = end {
                return end;
            }
        }
    }

    /// The run ends so.
    fn end(&mut self, outcome: Outcome) -> End {
        self.report.outcome = outcome;
        End::Done
    }

    /// With nothing to do at `now`: how long to wait before looking again, while a webhook
    /// delivery woke this slot (`WakePolicy::watch`); `None`: the run ends.
    fn watch(&mut self, now: Timestamp) -> Option<Duration> {
        let woken_at = self.w.clock.woken_at();
        let pause = self.cfg.wake.watch(woken_at, now, self.started)?;
        if self.watching != woken_at {
            self.watching = woken_at;
            log::info!(
                "woken by a webhook delivery at {}: no job yet; looking every {} until {} (--wake-window)",
                woken_at.map_or_else(String::new, |t| t.rfc3339()),
                format_duration(pause),
                woken_at.map_or(now, |t| t.plus(self.cfg.wake.window))
            );
        }
        Some(pause)
    }

    /// One poll interval's sleep (`None`), shorter while a webhook delivery woke this slot,
    /// unless the run ends at this wait: a dry-run's stop, a signal, SIGHUP. `last_wait`: the
    /// reason of the last wait, logged once at info level.
    fn wait(&mut self, why: String, last_wait: &mut String) -> Option<End> {
        let now = self.w.clock.now();
        let pause = self
            .cfg
            .wake
            .pause(self.cfg.poll_interval, self.w.clock.woken_at(), now);
        self.wait_for(pause, why, last_wait)
    }

    /// A sleep of `pause` (`None`), as [`Self::wait`].
    fn wait_for(&mut self, pause: Duration, why: String, last_wait: &mut String) -> Option<End> {
        if why != *last_wait {
            log::info!("{why}");
            last_wait.clone_from(&why);
        } else {
            log::debug!("{why}");
        }
        match self.w.clock.sleep(pause) {
            Sleep::Slept => {
                self.ctx.failed_deletes.clear();
                self.ctx.failed_intents.clear();
                None
            }
            Sleep::Stop => Some(self.end(Outcome::WouldWait(why))),
            Sleep::Interrupted => Some(self.interrupted("while waiting")),
            Sleep::Reload => {
                log::info!(
                    "SIGHUP: ending this run at its wait ({why}); cycle.json is kept and the next run resumes it with the configuration it is started with"
                );
                self.save_before_ending();
                Some(self.end(Outcome::Reload))
            }
        }
    }

    /// No VM and no registration left: the cycle is counted, then cycle.json goes.
    fn finish(&mut self) -> End {
        // Counted before cycle.json goes: a crash in between counts it again, once.
        if !self.record_outcome() {
            return self.end(Outcome::Failed);
        }
        if let Err(e) = self.w.store.remove() {
            self.report.fail(format!("{e:#}"));
            return self.end(Outcome::Failed);
        }
        self.state = None;
        crate::crash_point!("finish-removed");
        self.report.event(
            "finish",
            true,
            "cycle.json removed: no VM, no registration left",
        );
        self.end(Outcome::CycleFinished)
    }

    fn interrupted(&mut self, during: &str) -> End {
        self.save_before_ending();
        self.report.fail(format!(
            "stopped by a signal {during}; cycle.json is kept and the next run resumes"
        ));
        self.end(Outcome::Interrupted)
    }

    /// Carries out one step. `Some(end)` ends the run.
    fn act(&mut self, step: Step, now: Timestamp) -> Option<End> {
        match step {
            Step::StartCycle { job_id, job_handle } => self.start_cycle(job_id, &job_handle, now),
            Step::StartWarm => self.start_warm(now),
            Step::Apply => self.apply(),
            Step::ResolveIntent { name } => self.resolve_intent(&name),
            Step::Forget { id } => self.forget_consumed(id, now),
            Step::Delete { target, reason } => self.delete(&target, reason, now),
            Step::AdoptLaunch { id } => self.adopt_launch(id, now),
            Step::MarkConnected { id } => self.mark_connected(id),
            Step::MarkBusy { id } => self.mark_busy(id, now),
            Step::MarkJobGone { id } => self.mark_job_gone(id, Some(now)),
            Step::ClearJobGone { id } => self.mark_job_gone(id, None),
            Step::CheckPrevious { id } => self.check_previous(id),
            Step::Register {
                job_id,
                job_handle,
                boundary,
            } => self.register(job_id, &job_handle, boundary, now),
            Step::Teardown { reason } => {
                self.not_served(&reason, now);
                self.teardown(reason)
            }
            Step::Destroy => self.destroy(),
            Step::Sweep(licence) => {
                self.sweep(&licence);
                None
            }
            Step::Idle | Step::Wait { .. } | Step::GiveUp { .. } | Step::Finish => None,
        }
    }

    /// The sweep after this cycle's destroy (or with no cycle at all), with its `sweep` event.
    fn sweep(&mut self, licence: &SweepLicence) {
        let sw = Stopwatch::start(&*self.w.clock);
        let store = &mut *self.w.store;
        let spare = sweep::Spare {
            now: self.w.clock.now(),
            min_age: self.cfg.policy.sweep_min_age,
            // Read once the listing is complete, after the guard: a process whose cycle was
            // adopted deletes nothing.
            others: &mut || {
                store.guard("the sweep's deletions")?;
                store.others()
            },
        };
        let ok = sweep::sweep_into(
            self.report,
            self.w.forgejo,
            licence,
            &self.cfg.policy.runner_prefix,
            self.cfg.sweep_max_deletions,
            spare,
        );
        let counts = self
            .report
            .sweep
            .as_ref()
            .map(|s| s.counts())
            .unwrap_or_default();
        self.report.event("sweep", ok, counts).duration_ms = sw.ms(&*self.w.clock);
        self.ctx.swept = true;
        crate::crash_point!("sweep-done");
    }

    /// Before a teardown because our runner was not given its waiting job: the registration
    /// says why (its deletion reason later), and the job is held first, so that neither this
    /// nor the next cycle registers for it again until the hold ends (after wrong labels too:
    /// every new VM would end the same way until the launch command is fixed).
    fn not_served(&mut self, reason: &TeardownReason, now: Timestamp) {
        let (runner_id, why) = match reason {
            TeardownReason::PickupTimeout { runner_id, .. } => {
                (*runner_id, NotServed::PickupTimeout)
            }
            TeardownReason::WrongLabels { runner_id, .. } => (*runner_id, NotServed::WrongLabels),
            _ => return,
        };
        let Some(reg) = self
            .state
            .as_mut()
            .and_then(|s| s.registration_mut(runner_id))
        else {
            return;
        };
        reg.not_served = Some(why);
        let (job_id, handle, name) = (reg.job_id, reg.job_handle.clone(), reg.name.clone());
        let pickup = self.cfg.policy.job_pickup_timeout;
        let (hold, new) = self.ctx.holds.hold(job_id, &handle, pickup, now);
        if !new {
            // Held already by a run that died before its teardown was written.
            return;
        }
        let (cause, reason) = match why {
            NotServed::PickupTimeout => (
                format!(
                    "Forgejo did not give it to runner {runner_id} ({name}) within {} (a concurrency group holds it, most likely)",
                    format_duration(pickup)
                ),
                DeleteReason::PickupTimeout,
            ),
            NotServed::WrongLabels => (
                format!(
                    "runner {runner_id} ({name}) declared labels that do not cover it, so Forgejo never gives it the job"
                ),
                DeleteReason::WrongLabels,
            ),
        };
        let detail = format!(
            "job {job_id} is listed as waiting, but {cause}; not registering for it again before {} (hold {})",
            hold.until, hold.times
        );
        log::warn!("{detail}");
        self.save_holds();
        let e = self.report.event("hold_job", true, detail);
        e.runner_id = Some(runner_id);
        e.runner_name = Some(name);
        e.reason = Some(reason.as_str().into());
        e.job_id = Some(job_id);
    }

    fn teardown(&mut self, reason: TeardownReason) -> Option<End> {
        let text = reason.describe();
        if reason.is_failure() {
            self.report.fail(format!("tearing down: {text}"));
        } else {
            log::info!("tearing down: {text}");
        }
        if let Some(s) = &mut self.state {
            s.phase = Phase::TearingDown;
            s.teardown_reason = Some(text.clone());
            if let Some(f) = reason.failure() {
                s.failure = Some(f);
            }
        }
        self.report.event("teardown", !reason.is_failure(), text);
        let end = self.save().err().map(|_| End::Done);
        crate::crash_point!("teardown-written");
        end
    }
}

#[cfg(test)]
mod tests;
