//! The cycle's registrations: registered (intent first) and launched, checked and stopped before
//! the next runner, deleted through the gate and forgotten only once Forgejo says they are gone,
//! and found again by name when a POST lost its answer.

mod lost_post;

use super::persist::SaveFailed;
use super::{Driver, End, runner_request};
use crate::core::backoff::FailureReason;
use crate::core::planner;
use crate::core::ports::{Claim, Deleted, LaunchRequest, NewRunner, ProcessCheck};
use crate::core::report::{ALREADY_GONE, DELETED, PLANNED, Stopwatch};
use crate::core::state::{Boundary, Launch, Phase, PreviousRunner, ProcessState, Registration};
use crate::core::sweep::gate::Deletable;
use crate::core::sweep::gate::DeleteReason;
use crate::core::sweep::spare::registration_name;
use crate::core::time::{Timestamp, format_duration};

impl Driver<'_, '_> {
    /// Removes a registration from the state once Forgejo confirmed it gone.
    pub(super) fn forget(&mut self, id: i64, now: Timestamp) -> Option<String> {
        let s = self.state.as_mut()?;
        let reg = s.registration(id).cloned();
        let name = reg.as_ref().map(|r| r.name.clone());
        // A runner was (or may have been) started for it on the VM that still runs other jobs:
        // its process must be known gone before the next one starts there.
        if let Some(r) = reg
            && s.phase == Phase::Running
            && r.launch != Launch::Pending
            && let Some(uuid) = r.uuid
        {
            s.previous.push(PreviousRunner {
                id,
                name: r.name,
                uuid,
                job_id: r.job_id,
                job_handle: r.job_handle,
                process: r.stopped.unwrap_or(ProcessState::Unchecked),
            });
        }
        s.registrations.retain(|r| r.id != Some(id));
        if s.registrations.is_empty() {
            s.free_since = Some(now);
        }
        name
    }

    pub(super) fn delete(
        &mut self,
        target: &Deletable,
        reason: DeleteReason,
        now: Timestamp,
    ) -> Option<End> {
        let id = target.id();
        if let Some(end) = self.guard("a DELETE") {
            return Some(end);
        }
        if reason == DeleteReason::NeverConnected
            && let Some(end) = self.never_connected(id)
        {
            return Some(end);
        }
        // After a stop, Forgejo is asked again before the DELETE: the runner may have taken its
        // job while the stop ran (then it is no longer offline, and not deleted).
        if let Some(end) = self.stop_before_delete(id) {
            return end;
        }
        let name = self
            .state
            .as_ref()
            .and_then(|s| s.registration(id))
            .map(|r| r.name.clone());
        let mut intent = self.report.draft("delete_runner", "");
        intent.runner_id = Some(id);
        intent.runner_name.clone_from(&name);
        intent.reason = Some(reason.as_str().into());
        intent.status = self.seen.get(&id).cloned();
        self.report.intend_deletion(&intent);
        let sw = Stopwatch::start(&*self.w.clock);
        match self.w.forgejo.delete_runner(target, reason.as_str()) {
            Ok(outcome) => {
                crate::crash_point!("delete-answered");
                let detail = match outcome {
                    Deleted::Now => DELETED,
                    Deleted::AlreadyGone => ALREADY_GONE,
                    Deleted::Planned => PLANNED,
                };
                log::info!(
                    "registration {id} ({}) {detail}: {}",
                    name.as_deref().unwrap_or("?"),
                    reason.as_str()
                );
                self.forget(id, now);
                let e = self.report.event("delete_runner", true, detail);
                e.runner_id = Some(id);
                e.runner_name = name;
                e.reason = Some(reason.as_str().into());
                e.status = self.seen.get(&id).cloned();
                e.duration_ms = sw.ms(&*self.w.clock);
                let end = self.save().err().map(|_| End::Done);
                crate::crash_point!("delete-forgotten-written");
                end
            }
            Err(e) => {
                self.ctx.failed_deletes.insert(id);
                if let Some(n) = &name {
                    *self.ctx.cleanup_failures.entry(n.clone()).or_default() += 1;
                }
                self.report.fail(format!(
                    "deleting registration {id} ({}) failed: {e}",
                    reason.as_str()
                ));
                let ev = self.report.event("delete_runner", false, e.to_string());
                ev.runner_id = Some(id);
                ev.runner_name = name;
                ev.reason = Some(reason.as_str().into());
                ev.status = self.seen.get(&id).cloned();
                None
            }
        }
    }

    /// Every registration this cycle deletes itself while its VM runs gets its runner stopped
    /// first (`RUNNER_ACTION=stop`): a deleted registration does not end a `one-job --wait`
    /// that keeps polling. What the stop achieved is written before the DELETE; one that failed
    /// keeps the VM from being reused. (At teardown the destroy ends every process.) `None`
    /// when there was nothing to stop; else how the step ends.
    pub(super) fn stop_before_delete(&mut self, id: i64) -> Option<Option<End>> {
        let s = self.state.as_ref()?;
        let r = s.registration(id)?;
        if s.phase != Phase::Running || r.launch == Launch::Pending || r.stopped.is_some() {
            return None;
        }
        let prev = PreviousRunner {
            id,
            name: r.name.clone(),
            uuid: r.uuid.clone()?,
            job_id: r.job_id,
            job_handle: r.job_handle.clone(),
            process: ProcessState::Unchecked,
        };
        let process = match self.vm_outputs() {
            Err(e) if e.interrupted => {
                return Some(Some(self.interrupted("while reading tofu outputs")));
            }
            Err(e) => ProcessState::NotGone(format!("reading tofu outputs failed: {}", e.message)),
            Ok(outputs) => {
                let req = runner_request(self.cfg, &prev, &outputs);
                match self.w.launcher.stop(&req) {
                    Ok(()) => ProcessState::Gone,
                    Err(e) if e.interrupted => {
                        return Some(Some(self.interrupted("while stopping a runner")));
                    }
                    Err(e) => {
                        ProcessState::NotGone(format!("RUNNER_ACTION=stop failed: {}", e.message))
                    }
                }
            }
        };
        // A launch command that cannot stop (one that ignores RUNNER_ACTION) only costs the
        // VM its reuse: a warning, not a failure.
        self.record_process(&prev, process.clone(), "stop_runner", false);
        if let Some(r) = self.state.as_mut()?.registration_mut(id) {
            r.stopped = Some(process);
        }
        Some(self.save().err().map(|_| End::Done))
    }

    /// Before the next runner starts on the VM: `RUNNER_ACTION=check` for an earlier one whose
    /// registration is gone; `stop` when it still runs. Anything short of "gone" tears the VM
    /// down instead of reusing it.
    pub(super) fn check_previous(&mut self, id: i64) -> Option<End> {
        if let Some(end) = self.guard("checking an earlier runner") {
            return Some(end);
        }
        let prev = self
            .state
            .as_ref()?
            .previous
            .iter()
            .find(|p| p.id == id)?
            .clone();
        let process = match self.vm_outputs() {
            Err(e) if e.interrupted => return Some(self.interrupted("while reading tofu outputs")),
            Err(e) => ProcessState::NotGone(format!("reading tofu outputs failed: {}", e.message)),
            Ok(outputs) => {
                let req = runner_request(self.cfg, &prev, &outputs);
                match self.w.launcher.check(&req) {
                    ProcessCheck::Gone => ProcessState::Gone,
                    ProcessCheck::Unknown {
                        interrupted: true, ..
                    } => return Some(self.interrupted("while checking a runner's process")),
                    ProcessCheck::Unknown { why, .. } => ProcessState::NotGone(why),
                    ProcessCheck::Running => {
                        log::warn!(
                            "runner {id} ({}): its registration is gone but its process still runs on the VM; stopping it",
                            prev.name
                        );
                        match self.w.launcher.stop(&req) {
                            Ok(()) => ProcessState::Gone,
                            Err(e) if e.interrupted => {
                                return Some(self.interrupted("while stopping a runner"));
                            }
                            Err(e) => ProcessState::NotGone(format!(
                                "it still ran, and RUNNER_ACTION=stop failed: {}",
                                e.message
                            )),
                        }
                    }
                }
            }
        };
        // A process known to run that could not be stopped is a failure; one the launch
        // command cannot tell about only costs the VM its reuse.
        let failed =
            matches!(&process, ProcessState::NotGone(why) if why.starts_with("it still ran"));
        self.record_process(&prev, process.clone(), "check_runner", failed);
        if let Some(p) = self
            .state
            .as_mut()?
            .previous
            .iter_mut()
            .find(|p| p.id == id)
        {
            p.process = process;
        }
        let end = self.save().err().map(|_| End::Done);
        crate::crash_point!("check-previous-written");
        end
    }

    /// The outcome of a check or stop, in the log and the report; `failed`: a failure of the
    /// run (else a process that may still run is a warning).
    pub(super) fn record_process(
        &mut self,
        p: &PreviousRunner,
        process: ProcessState,
        step: &str,
        failed: bool,
    ) {
        let detail = match &process {
            ProcessState::Gone => "its process is gone".to_string(),
            ProcessState::NotGone(why) => format!("its process may still run: {why}"),
            ProcessState::Unchecked => "not checked".to_string(),
        };
        match &process {
            ProcessState::NotGone(_) if failed => {
                self.report.fail(format!(
                    "runner {} ({}): {detail}; the VM is torn down instead of reused",
                    p.id, p.name
                ));
            }
            ProcessState::NotGone(_) => log::warn!(
                "runner {} ({}): {detail}; the VM is not reused",
                p.id,
                p.name
            ),
            _ => log::info!("runner {} ({}): {detail}", p.id, p.name),
        }
        let e = self
            .report
            .event(step, process == ProcessState::Gone, detail);
        e.runner_id = Some(p.id);
        e.runner_name = Some(p.name.clone());
        e.job_id = Some(p.job_id);
    }

    /// A launch that exited 0 whose runner never connected is a failed start: counted with failed
    /// POSTs and launches (three in a row and the VM goes), and a failure of this run. Counted
    /// once, and written before the DELETE: a DELETE whose answer is lost makes the next round
    /// see a 404, which must not pass for a runner that ran its job.
    pub(super) fn never_connected(&mut self, id: i64) -> Option<End> {
        let grace = format_duration(self.cfg.policy.registration_grace);
        let s = self.state.as_mut()?;
        let reg = s.registration_mut(id)?;
        if reg.failed_start {
            return None;
        }
        reg.failed_start = true;
        let name = reg.name.clone();
        s.failure = Some(FailureReason::NeverConnected);
        s.start_failures += 1;
        self.report.fail(format!(
            "runner {id} ({name}) never connected: its launch command exited 0, but Forgejo still showed it offline {grace} later; check forgejo-runner on the VM (installed, version 12.8 or newer, its log) and what the launch command starts"
        ));
        self.save().err().map(|_| End::Done)
    }

    /// The prefix that marks this cycle's registrations (`planner::cycle_prefix`); the
    /// configured one before a cycle.
    pub(super) fn cycle_prefix(&self) -> String {
        match &self.state {
            Some(s) => planner::cycle_prefix(s, &self.cfg.policy).to_string(),
            None => self.cfg.policy.runner_prefix.clone(),
        }
    }

    /// Registers a runner for `job_id` and launches it: the intent (claiming the job) written
    /// first, then the POST, then the launch, each step written before the next.
    pub(super) fn register(
        &mut self,
        job_id: i64,
        job_handle: &str,
        boundary: Boundary,
        now: Timestamp,
    ) -> Option<End> {
        let name = match self.write_intent(job_id, job_handle, boundary, now) {
            Err(SaveFailed) => return Some(End::Done),
            Ok(None) => return None,
            Ok(Some(name)) => name,
        };
        crate::crash_point!("register-intent-written");
        let new = match self.post_registration(&name, job_id) {
            Ok(new) => new,
            Err(end) => return end,
        };
        // The token lives only in `new` and dies with it.
        self.launch(&new, &name, job_id, job_handle)
    }

    /// Writes the intent of a registration for `job_id`, which claims the job: its name, or
    /// `None` when another slot claimed the job meanwhile (or there is no cycle).
    fn write_intent(
        &mut self,
        job_id: i64,
        job_handle: &str,
        boundary: Boundary,
        now: Timestamp,
    ) -> Result<Option<String>, SaveFailed> {
        // Intent first: the name is unique, so a lost answer can be found again.
        // The cycle's own prefix: its registrations stay deletable by it whatever is configured now.
        let prefix = self.cycle_prefix();
        let Some(mut s) = self.state.clone() else {
            return Ok(None);
        };
        // The first job draws the VM's trust boundary, written with the first intent.
        s.boundary.get_or_insert(boundary);
        let name = registration_name(&prefix, &s.cycle_id, s.next_seq, now);
        s.next_seq += 1;
        // The intent claims its job (the cycle's start claim has done its work).
        s.claim = None;
        s.claim_handle = None;
        let mut intent = Registration::intent(name.clone(), job_id, job_handle.to_string(), now);
        // Seen waiting by now at the latest (this run's jobs list): where its pickup starts.
        intent.job_first_seen = Some(
            self.ctx
                .holds
                .first_seen(job_handle, &self.others_first_seen)
                .map_or(now, |t| t.min(now)),
        );
        s.registrations.push(intent);
        match self.save_claiming(&s, job_id, job_handle)? {
            Claim::HeldBy(slot) => {
                log::info!("job {job_id} was claimed by {slot} meanwhile; not registering for it");
                Ok(None)
            }
            Claim::Saved => {
                self.state = Some(s);
                Ok(Some(name))
            }
        }
    }

    /// The POST of the registration `name`, its id and uuid written at once. `Err`: how the step
    /// ends (a failed POST is counted and reported, the run goes on).
    fn post_registration(&mut self, name: &str, job_id: i64) -> Result<NewRunner, Option<End>> {
        let sw = Stopwatch::start(&*self.w.clock);
        let new = match self.w.forgejo.register_runner(name) {
            Ok(n) => n,
            Err(e) => {
                let s = self.state.as_mut().ok_or(None)?;
                s.start_failures += 1;
                s.failure = Some(FailureReason::LaunchFailed);
                if e.is_rejection() {
                    // Forgejo answered and refused: nothing was created, nothing to look up.
                    s.registrations.retain(|r| r.name != name);
                }
                if self.save().is_err() {
                    return Err(Some(End::Done));
                }
                crate::crash_point!("register-failed-written");
                self.report
                    .fail(format!("registering runner {name} failed: {e}"));
                let ev = self.report.event("register_runner", false, e.to_string());
                ev.runner_name = Some(name.to_string());
                return Err(None);
            }
        };
        crate::crash_point!("register-post-answered");
        let s = self.state.as_mut().ok_or(None)?;
        if let Some(r) = s
            .registrations
            .iter_mut()
            .find(|r| r.name == name && r.id.is_none())
        {
            r.id = Some(new.id);
            r.uuid = Some(new.uuid.clone());
        }
        if self.save().is_err() {
            return Err(Some(End::Done));
        }
        crate::crash_point!("register-id-written");
        let ev = self
            .report
            .event("register_runner", true, format!("for job {job_id}"));
        ev.runner_id = Some(new.id);
        ev.runner_name = Some(name.to_string());
        ev.job_id = Some(job_id);
        ev.duration_ms = sw.ms(&*self.w.clock);
        Ok(new)
    }

    /// Launches the runner just registered (`new`, with its token) on the VM: `started` written
    /// before the launch command runs, `done` after it returned.
    fn launch(
        &mut self,
        new: &NewRunner,
        name: &str,
        job_id: i64,
        job_handle: &str,
    ) -> Option<End> {
        if self.outputs.is_none() {
            let cycle_id = self.state.as_ref()?.cycle_id.clone();
            match self.w.tofu.outputs(&cycle_id) {
                Ok(o) => self.outputs = Some(o),
                Err(e) => {
                    return self.launch_failed(
                        new.id,
                        name,
                        format!("reading tofu outputs failed: {}", e.message),
                        e.interrupted,
                    );
                }
            }
        }
        if let Some(r) = self.state.as_mut()?.registration_mut(new.id) {
            r.launch = Launch::Started;
            r.launched_at = Some(self.w.clock.now());
        }
        if self.save().is_err() {
            return Some(End::Done);
        }
        crate::crash_point!("launch-started-written");
        let outputs = self.outputs.clone().unwrap_or_default();
        let req = LaunchRequest {
            runner_id: new.id,
            runner_uuid: &new.uuid,
            runner_name: name,
            job_id,
            job_handle,
            labels: &self.cfg.labels,
            forgejo_url: &self.cfg.forgejo_url,
            outputs: &outputs,
        };
        let sw = Stopwatch::start(&*self.w.clock);
        match self.w.launcher.launch(&req, &new.token) {
            Ok(()) => {
                crate::crash_point!("launch-returned");
                let launched_at = self.w.clock.now();
                let s = self.state.as_mut()?;
                if let Some(r) = s.registration_mut(new.id) {
                    r.launch = Launch::Done;
                    r.launched_at = Some(launched_at);
                }
                // Not a start that worked yet: that is the runner connecting (or running its job).
                s.jobs_started += 1;
                if self.save().is_err() {
                    return Some(End::Done);
                }
                crate::crash_point!("launch-done-written");
                let ev = self
                    .report
                    .event("launch_runner", true, format!("for job {job_id}"));
                ev.runner_id = Some(new.id);
                ev.runner_name = Some(name.to_string());
                ev.job_id = Some(job_id);
                ev.duration_ms = sw.ms(&*self.w.clock);
                None
            }
            Err(e) => self.launch_failed(new.id, name, e.message, e.interrupted),
        }
    }

    pub(super) fn launch_failed(
        &mut self,
        id: i64,
        name: &str,
        message: String,
        interrupted: bool,
    ) -> Option<End> {
        let ev = self.report.event("launch_runner", false, message.clone());
        ev.runner_id = Some(id);
        ev.runner_name = Some(name.to_string());
        if interrupted {
            // The launch may or may not have started the runner: leave it `started`; the next
            // run adopts it if it is up and deletes it if it is offline.
            return Some(self.interrupted("while launching a runner"));
        }
        let s = self.state.as_mut()?;
        s.start_failures += 1;
        s.failure = Some(FailureReason::LaunchFailed);
        if let Some(r) = s.registration_mut(id) {
            r.launch = Launch::Failed;
        }
        self.report
            .fail(format!("starting runner {id} ({name}) failed: {message}"));
        let end = self.save().err().map(|_| End::Done);
        crate::crash_point!("launch-failed-written");
        end
    }
}
