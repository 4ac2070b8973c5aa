//! What the observation showed of this cycle's runners, written down: a registration Forgejo
//! removed (its job ran), a launch found done, a runner connected, busy, or next to a job that
//! went away; and the `take_job` event of a runner that took its job.

use super::{Driver, End};
use crate::core::report::seconds;
use crate::core::state::{Launch, Registration};
use crate::core::time::Timestamp;

/// A runner that took a job, for its `take_job` event.
struct Took {
    id: i64,
    name: String,
    job_id: i64,
    pickup_ms: Option<u64>,
}

impl Took {
    fn of(id: i64, r: &Registration, now: Timestamp) -> Took {
        Took {
            id,
            name: r.name.clone(),
            job_id: r.job_id,
            pickup_ms: r.pickup_ms(now),
        }
    }
}

impl Driver<'_, '_> {
    /// Forgejo answered 404 for a registration of ours: it ran its job and Forgejo removed it.
    pub(super) fn forget_consumed(&mut self, id: i64, now: Timestamp) -> Option<End> {
        // A launched runner whose registration Forgejo removed ran its job: a start that
        // worked. Never seen active, it took its job unseen: counted now.
        let mut took = None;
        if let Some(s) = &mut self.state
            && let Some(r) = s
                .registration(id)
                .filter(|r| r.launch == Launch::Done && !r.failed_start)
        {
            if !r.busy {
                took = Some(Took::of(id, r, now));
            }
            s.start_failures = 0;
            s.served = true;
        }
        let name = self.forget(id, now);
        let e = self.report.event(
            "forget_runner",
            true,
            "Forgejo answered 404: it ran its job and was removed",
        );
        e.runner_id = Some(id);
        e.runner_name = name;
        e.reason = Some("consumed".into());
        let end = self.save().err().map(|_| End::Done);
        if end.is_none()
            && let Some(t) = took
        {
            self.took_job(t, false);
        }
        crate::crash_point!("forget-written");
        end
    }

    /// A runner that is up although its launch was not recorded as done: adopted.
    pub(super) fn adopt_launch(&mut self, id: i64, now: Timestamp) -> Option<End> {
        if let Some(s) = &mut self.state {
            if let Some(r) = s.registration_mut(id) {
                r.launch = Launch::Done;
                r.launched_at.get_or_insert(now);
                r.connected = true;
            }
            s.jobs_started += 1;
            s.start_failures = 0;
        }
        log::warn!("runner {id} is up although its launch was not recorded as done; adopting it");
        self.save().err().map(|_| End::Done)
    }

    pub(super) fn mark_connected(&mut self, id: i64) -> Option<End> {
        let s = self.state.as_mut()?;
        if let Some(r) = s.registration_mut(id) {
            r.connected = true;
            log::info!("runner {id} ({}) connected", r.name);
        }
        // The start worked: only failed starts in a row mean a broken VM.
        s.start_failures = 0;
        self.save().err().map(|_| End::Done)
    }

    pub(super) fn mark_busy(&mut self, id: i64, now: Timestamp) -> Option<End> {
        let s = self.state.as_mut()?;
        s.served = true;
        let mut took = None;
        if let Some(r) = s.registration_mut(id) {
            r.busy = true;
            took = Some(Took::of(id, r, now));
        }
        let end = self.save().err().map(|_| End::Done);
        if end.is_none()
            && let Some(t) = took
        {
            self.took_job(t, true);
        }
        end
    }

    /// An idle runner whose job is neither waiting nor running since `since` (`None`: its job
    /// is back).
    pub(super) fn mark_job_gone(&mut self, id: i64, since: Option<Timestamp>) -> Option<End> {
        if let Some(r) = self.state.as_mut().and_then(|s| s.registration_mut(id)) {
            r.job_gone_since = since;
        }
        if since.is_some() {
            log::warn!("runner {id} is idle but its job is neither waiting nor running");
        }
        self.save().err().map(|_| End::Done)
    }

    /// The `take_job` event of a runner that took a job, with the job's pickup time (counted
    /// from it in `counters.json`). Made only once cycle.json says so (`busy`, or the
    /// registration forgotten), so no later run counts it again; a crash before the end of the
    /// run loses the count, as it loses every counter of that run.
    fn took_job(&mut self, t: Took, seen_active: bool) {
        let pickup = t.pickup_ms.map(seconds);
        let detail = match (seen_active, &pickup) {
            (true, Some(p)) => format!(
                "runner {} took a job; job {} was first seen waiting {p} before",
                t.id, t.job_id
            ),
            (false, Some(p)) => format!(
                "runner {} ran a job without ever being seen active (its registration is gone); job {} was first seen waiting at most {p} before it was taken",
                t.id, t.job_id
            ),
            (true, None) => format!("runner {} took a job", t.id),
            (false, None) => format!(
                "runner {} ran a job without ever being seen active (its registration is gone)",
                t.id
            ),
        };
        log::info!("{} ({detail})", t.name);
        let e = self.report.event("take_job", true, detail);
        e.runner_id = Some(t.id);
        e.runner_name = Some(t.name);
        e.job_id = Some(t.job_id);
        e.pickup_ms = t.pickup_ms;
    }
}
