//! The imperative shell around the planner: observe, decide, act, persist; repeat until the
//! cycle ends, the run fails, or (dry-run) the cycle would wait on the outside world.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::core::backoff::{BackoffPolicy, Change};
use crate::core::forgejo::{Job, job_matches, waiting_jobs};
use crate::core::holds::{Holds, HoldsError};
use crate::core::planner;
use crate::core::planner::{Observation, Policy, RunContext, Step, TeardownReason};
use crate::core::ports::{
    BackoffGate, Claim, Clock, Forgejo, LaunchRequest, Launcher, Outputs, Sleep, StateStore, Tofu,
};
use crate::core::report::{Outcome, Report, Stopwatch};
use crate::core::state::{CycleState, NotServed, Phase, PreviousRunner};
use crate::core::sweep::gate::DeleteReason;
use crate::core::sweep::licence::SweepLicence;
use crate::core::time::{Timestamp, format_duration};
use crate::core::wake::WakePolicy;
use crate::driver::sweep;

mod observed;
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

/// Whether `e` says that another host adopted this process's cycle.
fn is_fenced(e: &anyhow::Error) -> bool {
    e.downcast_ref::<crate::core::pool::Fenced>().is_some()
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

/// cycle.json could not be written (reported): stop before the next side effect.
struct SaveFailed;

/// One write of cycle.json: what was done so far is in the audit trail (durably) before the
/// state that follows from it; a failure is reported, and the run stops.
fn write<T>(
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
    fn guard(&mut self, step: &str) -> Option<End> {
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
    fn save(&mut self) -> Result<(), SaveFailed> {
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
    fn save_claiming(
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
    fn save_before_ending(&mut self) {
        if self.save().is_err() {
            log::debug!("the run ends without its last cycle.json write (reported above)");
        }
    }

    /// Writes the held jobs; a failure is a failure of the run, not a reason to stop it.
    fn save_holds(&mut self) {
        if let Err(e) = self.w.store.save_holds(&self.ctx.holds) {
            self.report.fail(format!("{e:#}"));
        }
    }

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

    fn backoff_gate(&self, now: Timestamp) -> BackoffGate {
        BackoffGate {
            policy: self.cfg.backoff,
            slot: self.cfg.slot,
            now,
        }
    }

    /// Counts how this cycle ended in the pool's failure backoff, and says what that changed.
    /// False when backoff.json could not be read or written (reported): cycle.json must stay,
    /// so that the next run counts it.
    fn record_outcome(&mut self) -> bool {
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
mod tests {
    //! The driver against the tests' model of Forgejo (`crate::test_forgejo`) and a tofu that
    //! always works (the end-to-end tests use the real binary).
    use super::*;
    use crate::adapters::dry::MemoryStore;
    use crate::core::ports::{ProcessCheck, StepError};
    use crate::test_forgejo::ModelForgejo;

    struct NoopTofu;

    impl Tofu for NoopTofu {
        fn check_config(&self) -> anyhow::Result<()> {
            Ok(())
        }
        fn apply(&mut self, _: &str) -> Result<(), StepError> {
            Ok(())
        }
        fn outputs(&mut self, _: &str) -> Result<Outputs, StepError> {
            Ok(Outputs::new())
        }
        fn destroy(&mut self, _: &str, _: &str) -> Result<(), StepError> {
            Ok(())
        }
    }

    fn test_config() -> CycleConfig {
        CycleConfig {
            policy: Policy {
                runner_prefix: "ephemeral-".into(),
                label_names: vec!["debian".into()],
                max_jobs_per_vm: 100_000,
                idle_timeout: Duration::from_secs(60),
                registration_grace: Duration::from_secs(60),
                max_cycle_duration: Duration::from_secs(3600),
                hard_deadline: Duration::from_secs(7200),
                intent_settle: Duration::from_secs(10),
                job_pickup_timeout: Duration::from_secs(600),
                sweep_min_age: Duration::from_secs(420),
                reuse_within: crate::core::planner::ReuseWithin::Repo,
                warm: Default::default(),
            },
            poll_interval: Duration::from_secs(5),
            labels: "debian".into(),
            forgejo_url: "https://forgejo.invalid".into(),
            sweep_max_deletions: 50,
            host: String::new(),
            slot: 1,
            backoff: BackoffPolicy {
                max_failed_cycles: 3,
                initial: Duration::from_secs(120),
                max: Duration::from_secs(3600),
            },
            wake: WakePolicy::default(),
        }
    }

    /// A store whose claims are all refused although it names no other slot's claim (planner
    /// and store disagree: a bug). Panics instead of looping for ever.
    #[derive(Default)]
    struct RefusingStore {
        inner: MemoryStore,
        refused: u32,
    }

    impl StateStore for RefusingStore {
        fn load(&mut self) -> anyhow::Result<Option<CycleState>> {
            self.inner.load()
        }
        fn save(&mut self, state: &CycleState) -> anyhow::Result<()> {
            self.inner.save(state)
        }
        fn remove(&mut self) -> anyhow::Result<()> {
            self.inner.remove()
        }
        fn describe(&self) -> String {
            self.inner.describe()
        }
        fn load_holds(&mut self) -> Result<crate::core::holds::Holds, HoldsError> {
            self.inner.load_holds()
        }
        fn save_holds(&mut self, holds: &crate::core::holds::Holds) -> anyhow::Result<()> {
            self.inner.save_holds(holds)
        }
        fn save_claiming(&mut self, _: &CycleState, _: i64, _: &str) -> anyhow::Result<Claim> {
            self.refused += 1;
            assert!(
                self.refused < 10 * MAX_STEPS_WITHOUT_WAIT,
                "the run never stopped refusing claims"
            );
            Ok(Claim::HeldBy("slot 2 (test)".into()))
        }
    }

    /// A refused claim writes nothing, so it is no progress: a planner that chooses, step after
    /// step, a job the store says another slot holds is stopped by the runaway guard.
    #[test]
    fn a_claim_refused_again_and_again_is_a_runaway_not_progress() {
        let shared = ModelForgejo::new("debian");
        let runs_on = vec!["debian".to_string()];
        {
            let mut s = shared.server();
            let now = s.now;
            s.forgejo.add_job("h1".into(), runs_on, 1, 1, now);
        }
        let mut forgejo = shared.clone();
        let mut launcher = shared.clone();
        let mut tofu = NoopTofu;
        let mut store = RefusingStore::default();
        let mut clock = shared.clone();
        let cfg = test_config();
        let mut report = Report::new("run", false, clock.now());
        let mut world = super::World {
            forgejo: &mut forgejo,
            tofu: &mut tofu,
            launcher: &mut launcher,
            store: &mut store,
            clock: &mut clock,
        };
        assert_eq!(run(&mut world, &cfg, &mut report), End::Done);
        assert_eq!(report.outcome, Outcome::Failed);
        assert!(
            report
                .failures
                .iter()
                .any(|f| f.contains("steps without progress")),
            "{:?}",
            report.failures
        );
        assert!(store.inner.state.is_none());
    }

    /// The model's clock, woken by a delivery at `woken_at`; on its `job_after`-th sleep a job
    /// appears (Forgejo wrote the delivery's job after sending it). Counts its sleeps.
    struct WokenClock {
        inner: ModelForgejo,
        woken_at: Option<Timestamp>,
        job_after: Option<u32>,
        sleeps: Vec<Duration>,
    }

    impl Clock for WokenClock {
        fn now(&self) -> Timestamp {
            self.inner.now()
        }
        fn sleep(&mut self, d: Duration) -> Sleep {
            self.sleeps.push(d);
            if self.job_after == Some(self.sleeps.len() as u32) {
                let mut s = self.inner.server();
                let now = s.now;
                s.forgejo
                    .add_job("h1".into(), vec!["debian".into()], 1, 1, now);
            }
            self.inner.sleep(d)
        }
        fn stop_requested(&self) -> bool {
            false
        }
        fn new_cycle_id(&mut self, now: Timestamp) -> String {
            self.inner.new_cycle_id(now)
        }
        fn woken_at(&self) -> Option<Timestamp> {
            self.woken_at
        }
    }

    /// A run with nothing to do, on a clock woken `woken_ago` before it starts (or never), with
    /// a job appearing on the `job_after`-th sleep: its report and its sleeps.
    fn woken_run(woken_ago: Option<Duration>, job_after: Option<u32>) -> (Report, Vec<Duration>) {
        let shared = ModelForgejo::new("debian");
        let start = shared.now();
        let mut clock = WokenClock {
            inner: shared.clone(),
            woken_at: woken_ago.map(|d| Timestamp(start.0 - d.as_millis() as i64)),
            job_after,
            sleeps: Vec::new(),
        };
        let (mut forgejo, mut launcher) = (shared.clone(), shared.clone());
        let mut store = MemoryStore::default();
        let mut cfg = test_config();
        cfg.wake = WakePolicy::new(Duration::from_secs(30), cfg.poll_interval);
        cfg.policy.idle_timeout = Duration::from_secs(1);
        let mut report = Report::new("run", false, start);
        let mut world = super::World {
            forgejo: &mut forgejo,
            tofu: &mut NoopTofu,
            launcher: &mut launcher,
            store: &mut store,
            clock: &mut clock,
        };
        assert_eq!(run(&mut world, &cfg, &mut report), End::Done);
        (report, clock.sleeps)
    }

    // Mutation caught: Step::Idle ending the run without `watch` (a woken run that finds no job
    // yet exits, and the job its delivery announced waits for the timer).
    #[test]
    fn a_woken_run_keeps_looking_for_the_deliverys_job_within_the_window() {
        // Not woken: one look, then the run ends.
        let (report, sleeps) = woken_run(None, None);
        assert_eq!((report.outcome, sleeps.len()), (Outcome::Idle, 0));
        // Woken an hour ago: the same.
        let (report, sleeps) = woken_run(Some(Duration::from_secs(3600)), None);
        assert_eq!((report.outcome, sleeps.len()), (Outcome::Idle, 0));
        // Woken just now, no job ever: a look every second for the 30 s window, then the end.
        let (report, sleeps) = woken_run(Some(Duration::ZERO), None);
        assert_eq!(report.outcome, Outcome::Idle);
        assert_eq!(sleeps, vec![Duration::from_secs(1); 30]);
        // Woken 10 s ago: the rest of the window.
        let (_, sleeps) = woken_run(Some(Duration::from_secs(10)), None);
        assert_eq!(sleeps.len(), 20);
        // The job appears 3 s after the delivery: the run serves it.
        let (report, sleeps) = woken_run(Some(Duration::ZERO), Some(3));
        assert_eq!(
            report.outcome,
            Outcome::CycleFinished,
            "{:?}",
            report.failures
        );
        assert_eq!(&sleeps[..3], &[Duration::from_secs(1); 3]);
        assert!(
            report
                .events
                .iter()
                .any(|e| e.step == "launch_runner" && e.ok),
            "{:?}",
            report.events
        );
    }

    /// A backoff in force at the tests' clock.
    fn closed_backoff(now: Timestamp) -> crate::core::backoff::Backoff {
        let mut b = crate::core::backoff::Backoff::new();
        b.consecutive_failed_cycles = 3;
        b.since = Some(now);
        b.until = Some(now.plus(Duration::from_secs(600)));
        b.last_reason = Some(crate::core::backoff::FailureReason::ApplyFailed);
        b
    }

    fn run_with_store(shared: &ModelForgejo, store: &mut MemoryStore) -> Report {
        run_with_config(shared, store, &test_config())
    }

    fn run_with_config(
        shared: &ModelForgejo,
        store: &mut MemoryStore,
        cfg: &CycleConfig,
    ) -> Report {
        let mut forgejo = shared.clone();
        let mut launcher = shared.clone();
        let mut tofu = NoopTofu;
        let mut clock = shared.clone();
        let mut report = Report::new("run", false, clock.now());
        let mut world = super::World {
            forgejo: &mut forgejo,
            tofu: &mut tofu,
            launcher: &mut launcher,
            store,
            clock: &mut clock,
        };
        assert_eq!(run(&mut world, cfg, &mut report), End::Done);
        report
    }

    /// The tests' Forgejo with one waiting job of ours (`h1`, job 1), and its clock's time.
    fn model_with_one_job() -> (ModelForgejo, Timestamp) {
        let shared = ModelForgejo::new("debian");
        let now = {
            let mut s = shared.server();
            let now = s.now;
            s.forgejo
                .add_job("h1".into(), vec!["debian".into()], 1, 1, now);
            Timestamp(now)
        };
        (shared, now)
    }

    #[test]
    fn a_backoff_in_force_starts_no_cycle_and_says_why() {
        let (shared, now) = model_with_one_job();
        let mut store = MemoryStore {
            backoff: closed_backoff(now),
            ..MemoryStore::default()
        };
        let report = run_with_store(&shared, &mut store);
        assert_eq!(report.outcome, Outcome::BackingOff);
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        let closed = report
            .backoff
            .expect("the report says since, until and why");
        assert_eq!(closed.failures, 3);
        assert!(store.state.is_none(), "no cycle started");
        assert!(report.events.is_empty(), "{:?}", report.events);
    }

    /// A pool that backs off makes no warm VM either.
    #[test]
    fn a_backoff_in_force_starts_no_warm_vm() {
        let shared = ModelForgejo::new("debian");
        let now = Timestamp(shared.server().now);
        let mut cfg = test_config();
        cfg.policy.warm.count = 1;
        cfg.policy.warm.max_age = Duration::from_secs(1800);
        let mut store = MemoryStore {
            backoff: closed_backoff(now),
            ..MemoryStore::default()
        };
        let report = run_with_config(&shared, &mut store, &cfg);
        assert_eq!(report.outcome, Outcome::BackingOff);
        assert!(report.backoff.is_some());
        assert!(store.state.is_none(), "no warm VM started");
        // Not backing off, the same run makes one, which waits for a job until --warm-max-age
        // (the model's clock moves on with each wait), then goes.
        let mut store = MemoryStore::default();
        let report = run_with_config(&shared, &mut store, &cfg);
        assert_eq!(
            report.outcome,
            Outcome::CycleFinished,
            "{:?}",
            report.failures
        );
        let said = |text: &str| report.events.iter().any(|e| e.detail.contains(text));
        assert!(said("(warm: no job yet)"), "{:?}", report.events);
        assert!(
            said("ran no job within --warm-max-age"),
            "{:?}",
            report.events
        );
    }

    /// Only a new VM is gated: a cycle in progress (here one whose teardown was decided) goes on
    /// to its destroy and its end, and is counted.
    #[test]
    fn a_backoff_in_force_does_not_cut_a_cycle_in_progress_short() {
        let shared = ModelForgejo::new("debian");
        let now = Timestamp(shared.server().now);
        let mut state = CycleState::new("20261014t150757z-ab12".into(), now);
        state.apply_failed("tofu apply failed: x".into(), "tofu apply failed".into());
        let mut store = MemoryStore {
            state: Some(state),
            backoff: closed_backoff(now),
            ..MemoryStore::default()
        };
        let report = run_with_store(&shared, &mut store);
        assert_eq!(
            report.outcome,
            Outcome::CycleFinished,
            "{:?}",
            report.failures
        );
        assert!(store.state.is_none());
        assert_eq!(
            store.backoff.consecutive_failed_cycles, 4,
            "the cycle is counted"
        );
        assert!(report.events.iter().any(|e| e.step == "backoff"));
    }

    #[test]
    fn a_long_busy_queue_is_progress_not_a_runaway() {
        // Each launched runner is given its job by Forgejo's rule and runs it at once: the job
        // ends and Forgejo deletes the registration, one step after another without a wait.
        let shared = ModelForgejo::new("debian");
        let jobs = MAX_STEPS_WITHOUT_WAIT as usize * 2;
        for i in 0..jobs {
            let runs_on = vec!["debian".to_string()];
            let mut s = shared.server();
            let now = s.now;
            s.forgejo.add_job(format!("h{i}"), runs_on, 1, 1, now);
        }
        let mut forgejo = shared.clone();
        let mut launcher = shared.clone();
        let mut tofu = NoopTofu;
        let mut store = MemoryStore::default();
        let mut clock = shared.clone();
        let cfg = test_config();
        let mut report = Report::new("run", false, clock.now());
        let mut world = super::World {
            forgejo: &mut forgejo,
            tofu: &mut tofu,
            launcher: &mut launcher,
            store: &mut store,
            clock: &mut clock,
        };
        assert_eq!(run(&mut world, &cfg, &mut report), End::Done);
        assert!(report.failures.is_empty(), "{:?}", report.failures);
        assert_eq!(report.outcome, Outcome::CycleFinished);
        let launched = report
            .events
            .iter()
            .filter(|e| e.step == "launch_runner")
            .count();
        assert_eq!(launched, jobs);
        assert!(store.state.is_none());
        let s = shared.server();
        assert!(s.forgejo.jobs.values().all(|j| j.status == "success"));
        assert!(s.forgejo.runners.values().all(|r| r.deleted));
    }

    /// A runner that takes its job at launch and runs it until the driver's next sleep: seen
    /// `active` once (the model's own launcher runs the job at once, so its runner is never
    /// seen active).
    #[derive(Clone)]
    struct TakesItsTime(ModelForgejo);

    impl Launcher for TakesItsTime {
        fn check_config(&self) -> anyhow::Result<()> {
            Ok(())
        }
        fn launch(
            &mut self,
            req: &LaunchRequest<'_>,
            _: &crate::core::secret::Secret,
        ) -> Result<(), crate::core::ports::StepError> {
            let mut s = self.0.server();
            let now = s.now;
            let f = &mut s.forgejo;
            if let Some(r) = f.live_mut(req.runner_id) {
                r.declare(Some(vec!["debian".into()]), now);
            }
            if let Some(job) = f.task_for(req.runner_id, Some(req.job_handle)) {
                f.start_task(job, req.runner_id, now);
            }
            Ok(())
        }
        fn check(&mut self, req: &LaunchRequest<'_>) -> ProcessCheck {
            self.0.check(req)
        }
        fn stop(&mut self, req: &LaunchRequest<'_>) -> Result<(), crate::core::ports::StepError> {
            self.0.stop(req)
        }
    }

    impl Clock for TakesItsTime {
        fn now(&self) -> Timestamp {
            self.0.now()
        }
        fn sleep(&mut self, d: Duration) -> Sleep {
            {
                let mut s = self.0.server();
                let now = s.now;
                let running: Vec<i64> = s
                    .forgejo
                    .jobs
                    .values()
                    .filter(|j| j.is_running())
                    .map(|j| j.id)
                    .collect();
                for j in running {
                    s.forgejo.final_update_task(j, now);
                }
            }
            self.0.sleep(d)
        }
        fn stop_requested(&self) -> bool {
            false
        }
        fn new_cycle_id(&mut self, now: Timestamp) -> String {
            self.0.new_cycle_id(now)
        }
    }

    fn take_jobs(report: &Report) -> Vec<&crate::core::report::Event> {
        report
            .events
            .iter()
            .filter(|e| e.step == "take_job")
            .collect()
    }

    /// The pickup starts at the first run that saw the job waiting (here one that backed off),
    /// not at the run that served it; a runner never seen active is counted when its
    /// registration is gone, as an upper bound.
    #[test]
    fn a_pickup_counts_from_the_first_run_that_saw_the_job_waiting() {
        let (shared, t0) = model_with_one_job();
        let mut store = MemoryStore {
            backoff: closed_backoff(t0),
            ..MemoryStore::default()
        };
        let first = run_with_store(&shared, &mut store);
        assert_eq!(first.outcome, Outcome::BackingOff);
        assert_eq!(
            store
                .holds
                .seen
                .iter()
                .map(|s| (s.handle.as_str(), s.first_seen))
                .collect::<Vec<_>>(),
            [("h1", t0)],
            "the sight is kept for the next run"
        );
        shared.server().now += 30_000;
        store.backoff = crate::core::backoff::Backoff::new();
        let report = run_with_store(&shared, &mut store);
        assert_eq!(
            report.outcome,
            Outcome::CycleFinished,
            "{:?}",
            report.failures
        );
        let took = take_jobs(&report);
        assert_eq!(took.len(), 1, "{:?}", report.events);
        let pickup = took[0].pickup_ms.expect("a pickup");
        assert!((30_000..=40_000).contains(&pickup), "{pickup}");
        assert!(took[0].detail.contains("at most"), "{}", took[0].detail);
        let mut c = crate::core::metrics::Counters::default();
        c.record(&report);
        assert_eq!((c.pickups.count, c.pickups.sum_ms), (1, pickup));
        assert!(
            store.holds.is_empty(),
            "the job is done: its sight forgotten"
        );
    }

    /// Seen active: counted then, once, from the earliest sight of any slot of the pool.
    #[test]
    fn a_runner_seen_active_counts_its_pickup_from_the_pools_first_sight() {
        let (shared, now) = model_with_one_job();
        let ago = |ms: i64| Timestamp(now.0 - ms);
        let mut store = MemoryStore::default();
        store.holds.seen.push(crate::core::holds::Seen {
            job_id: 1,
            handle: "h1".into(),
            first_seen: ago(10_000),
        });
        store.others.first_seen.insert("h1".into(), ago(20_000));
        let mut forgejo = shared.clone();
        let mut slow = TakesItsTime(shared.clone());
        let mut clock = slow.clone();
        let mut tofu = NoopTofu;
        let cfg = test_config();
        let mut report = Report::new("run", false, clock.now());
        let mut world = super::World {
            forgejo: &mut forgejo,
            tofu: &mut tofu,
            launcher: &mut slow,
            store: &mut store,
            clock: &mut clock,
        };
        assert_eq!(run(&mut world, &cfg, &mut report), End::Done);
        assert_eq!(
            report.outcome,
            Outcome::CycleFinished,
            "{:?}",
            report.failures
        );
        let took = take_jobs(&report);
        assert_eq!(
            took.len(),
            1,
            "once, not again when it is gone: {:?}",
            report.events
        );
        assert_eq!(took[0].pickup_ms, Some(20_000), "{took:?}");
        assert_eq!(took[0].job_id, Some(1));
        assert!(!took[0].detail.contains("at most"), "{}", took[0].detail);
    }
}
