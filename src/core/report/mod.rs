//! The run report: every side effect with its outcome, every failure, the exit status. The
//! data is here; how the run ended in `outcome`, the audit trail in `audit`, the source of its
//! timestamps in `clock`, its text in `text`.

mod audit;
mod clock;
mod outcome;
mod text;

use std::collections::BTreeMap;

use serde::Serialize;

use crate::core::ports::{AuditSink, Deleted};
use crate::core::sweep::licence::SweepLicence;
use crate::core::time::Timestamp;
use audit::{AuditTrail, audit_record};
use clock::ReportClock;
pub use clock::Stopwatch;
pub use outcome::Outcome;
pub use text::{cut, event_line, seconds};

/// The detail of a `delete_runner` event whose DELETE Forgejo answered 404: gone, but not by us.
pub const ALREADY_GONE: &str = "already gone (404)";

/// The detail of a `delete_runner` event whose DELETE Forgejo answered 204.
pub const DELETED: &str = "deleted";

/// A dry-run's deletion: in the plan, never sent.
pub const PLANNED: &str = "would be deleted (dry-run: nothing sent)";

#[derive(Clone, Debug, Serialize)]
pub struct Event {
    pub at: Timestamp,
    /// `start_cycle`, `tofu_apply`, `register_runner`, `launch_runner`, `delete_runner`, …
    pub step: String,
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runner_id: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runner_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The job a registration was made for, or the job held (`hold_job`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_id: Option<i64>,
    /// For deletions: the status Forgejo reported just before (the evidence it was deletable).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// For sweep deletions: the cycle whose `tofu destroy` succeeded before the sweep.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub destroyed_cycle_id: Option<String>,
    /// Why the deletion was allowed, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evidence: Option<String>,
    pub detail: String,
    pub duration_ms: u64,
    /// For `take_job`: the job's pickup time, from the pool's first sight of it waiting to
    /// this moment (`core::metrics::Pickups`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pickup_ms: Option<u64>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct SweptRunner {
    pub runner_id: i64,
    pub name: Option<String>,
    pub status: String,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct SweepReport {
    pub pages: u32,
    pub listed: usize,
    /// False when the listing ended short of Forgejo's count: some rows may not have been seen.
    pub listing_complete: bool,
    /// Offline registrations with our prefix that were not spared.
    pub found: usize,
    pub deleted: Vec<SweptRunner>,
    /// Answered 404: someone else deleted them first.
    pub already_gone: Vec<i64>,
    pub failed: Vec<SweptRunner>,
    /// Registrations with our prefix whose status was missing or unknown: never deleted.
    pub skipped_doubtful: Vec<SweptRunner>,
    /// Offline registrations with our prefix whose name shows they were created less than the
    /// minimum age ago (`core::sweep::spare::sweep_min_age`): their owner may still be starting them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spared_young: Vec<SweptRunner>,
    /// Offline registrations with our prefix that another slot of this pool holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spared_held: Vec<SweptRunner>,
    /// Deletable registrations left for the next sweep because of `--sweep-max-deletions`.
    pub left_over_cap: usize,
    /// Set when listing failed: then nothing at all was deleted.
    pub error: Option<String>,
}

impl SweepReport {
    /// `3 deleted, 1 already gone, 0 failed, 2 left over the cap`
    pub fn counts(&self) -> String {
        format!(
            "{} deleted, {} already gone, {} failed, {} left over the cap",
            self.deleted.len(),
            self.already_gone.len(),
            self.failed.len(),
            self.left_over_cap
        )
    }
}

/// What a run did, counted from its events (the sweep's own counts are in `SweepReport`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    pub vm_applied: u32,
    pub apply_failed: u32,
    pub vm_destroyed: u32,
    pub destroy_failed: u32,
    pub registered: u32,
    pub register_failed: u32,
    pub launched: u32,
    pub launch_failed: u32,
    /// Registrations that ran their job and were removed by Forgejo (404 on GET).
    pub consumed: u32,
    /// Registrations deleted (Forgejo answered 204), by reason.
    pub deleted: BTreeMap<String, u32>,
    /// DELETEs answered 404: someone (or the runner itself) removed them first.
    pub already_gone: u32,
    pub delete_failed: u32,
    /// Jobs held after our runner sat idle past `--job-pickup-timeout` next to them.
    pub held: u32,
}

impl Summary {
    pub fn of(events: &[Event]) -> Summary {
        let mut s = Summary::default();
        for e in events {
            let slot = match (e.step.as_str(), e.ok) {
                ("tofu_apply", true) => &mut s.vm_applied,
                ("tofu_apply", false) => &mut s.apply_failed,
                ("tofu_destroy", true) => &mut s.vm_destroyed,
                ("tofu_destroy", false) => &mut s.destroy_failed,
                ("register_runner", true) => &mut s.registered,
                ("register_runner", false) => &mut s.register_failed,
                ("launch_runner", true) => &mut s.launched,
                ("launch_runner", false) => &mut s.launch_failed,
                ("forget_runner", true) => &mut s.consumed,
                ("hold_job", true) => &mut s.held,
                ("delete_runner", false) => &mut s.delete_failed,
                ("delete_runner", true) if e.detail == ALREADY_GONE => &mut s.already_gone,
                ("delete_runner", true) => s
                    .deleted
                    .entry(e.reason.clone().unwrap_or_else(|| "unknown".into()))
                    .or_default(),
                _ => continue,
            };
            *slot += 1;
        }
        s
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub command: String,
    pub version: &'static str,
    pub dry_run: bool,
    pub cycle_id: Option<String>,
    pub started_at: Timestamp,
    pub finished_at: Option<Timestamp>,
    pub outcome: Outcome,
    pub exit_code: i32,
    pub events: Vec<Event>,
    /// Distinct failures, at most `MAX_FAILURES`; every one is also logged at error level.
    pub failures: Vec<String>,
    /// Failures not listed again: repeats of a listed one, or past `MAX_FAILURES`.
    pub failures_not_listed: u64,
    pub sweep: Option<SweepReport>,
    /// From start to end of the run.
    pub duration_ms: u64,
    /// Counted from `events` when the run ends.
    pub summary: Summary,
    /// The pool's failure backoff kept this run from starting a VM: since, until and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backoff: Option<crate::core::backoff::Closed>,
    /// `--store pg`: the pool as the run last read it, and the run's cycle at its end (for the
    /// metrics: with the pool store neither is in the state directory).
    #[serde(skip)]
    pub pool: Option<PoolReport>,
    #[serde(skip)]
    audit: AuditTrail,
    #[serde(skip)]
    clock: ReportClock,
}

/// A run that keeps failing the same way (Forgejo down for hours) must not grow its report
/// without bound.
/// What a run of a pool across hosts knew of the pool at its end.
#[derive(Clone, Debug)]
pub struct PoolReport {
    pub view: crate::core::pool::PoolView,
    pub cycle: Option<crate::core::state::CycleState>,
}

pub const MAX_FAILURES: usize = 100;

impl Report {
    pub fn new(command: &str, dry_run: bool, now: Timestamp) -> Report {
        Report {
            command: command.into(),
            version: env!("CARGO_PKG_VERSION"),
            dry_run,
            cycle_id: None,
            started_at: now,
            finished_at: None,
            outcome: Outcome::Unset,
            exit_code: 0,
            events: Vec::new(),
            failures: Vec::new(),
            failures_not_listed: 0,
            sweep: None,
            duration_ms: 0,
            summary: Summary::default(),
            backoff: None,
            pool: None,
            audit: AuditTrail::default(),
            clock: ReportClock::default(),
        }
    }

    /// From now on every event and failure is also appended to `sink` as it happens.
    pub fn set_audit(&mut self, sink: Box<dyn AuditSink>) {
        self.audit = AuditTrail::new(sink);
    }

    /// Records a failure: logged at error level, kept in the report (and the audit trail), and
    /// it makes the exit status 1.
    pub fn fail(&mut self, message: impl Into<String>) {
        let message = message.into();
        self.flush_audit();
        if self.keep_failure(message.clone()) {
            let record = audit::failure_record(self.now(), self.cycle_id.as_deref(), &message);
            self.append(&record);
        }
    }

    /// Logs and keeps a failure; false for a repeat (or past `MAX_FAILURES`), which is only
    /// counted.
    fn keep_failure(&mut self, message: String) -> bool {
        log::error!("{message}");
        if self.failures.len() >= MAX_FAILURES || self.failures.contains(&message) {
            self.failures_not_listed += 1;
            false
        } else {
            self.failures.push(message);
            true
        }
    }

    fn append(&mut self, record: &serde_json::Value) {
        if let Err(e) = self.audit.append(record) {
            // Not audited itself (that is what just failed), but logged and kept.
            self.keep_failure(format!("audit trail: {e:#}"));
        }
    }

    /// Appends the events not yet in the audit trail. Each event is complete once the next one
    /// starts; the driver also flushes before every write of cycle.json, and `finish` at the end.
    pub fn flush_audit(&mut self) {
        while let Some(e) = self.audit.next_pending(&self.events) {
            let record = audit_record(self.cycle_id.as_deref(), e);
            self.append(&record);
        }
    }

    /// Appends what is pending and makes the audit trail durable.
    pub fn sync_audit(&mut self) {
        self.flush_audit();
        if let Err(e) = self.audit.sync() {
            self.keep_failure(format!("audit trail: {e:#}"));
        }
    }

    /// Appended to the audit trail (only) just before a DELETE is sent, with the evidence: a
    /// crash between the DELETE and its event still leaves the deletion findable.
    pub fn intend_deletion(&mut self, intent: &Event) {
        self.flush_audit();
        let record = audit::intent_record(self.cycle_id.as_deref(), intent);
        self.append(&record);
    }

    /// The time on the run's clock (`set_clock`); without one, the time the run started.
    pub fn now(&self) -> Timestamp {
        self.clock.now(self.started_at)
    }

    /// Where the report's timestamps come from: the clock port of the run (the real clock, or a
    /// fixture's, which stands still).
    pub fn set_clock(&mut self, now: Box<dyn Fn() -> Timestamp>) {
        self.clock = ReportClock::new(now);
    }

    /// An event not (yet) in the report, e.g. the description of a deletion about to happen.
    pub fn draft(&self, step: &str, detail: &str) -> Event {
        Event {
            at: self.now(),
            step: step.into(),
            ok: true,
            runner_id: None,
            runner_name: None,
            reason: None,
            job_id: None,
            status: None,
            destroyed_cycle_id: None,
            evidence: None,
            detail: detail.into(),
            duration_ms: 0,
            pickup_ms: None,
        }
    }

    /// One registration the sweep is about to delete (`result` `None`: its intent) or deleted
    /// (or tried to): with the evidence that made it deletable, appended to the audit trail at
    /// once.
    pub fn sweep_deletion(
        &mut self,
        r: &SweptRunner,
        result: Option<Result<Deleted, String>>,
        licence: &SweepLicence,
    ) {
        let fill = |e: &mut Event| {
            e.runner_id = Some(r.runner_id);
            e.runner_name.clone_from(&r.name);
            e.reason = Some("sweep".into());
            e.status = Some(r.status.clone());
            e.destroyed_cycle_id = licence.destroyed_cycle_id().map(str::to_string);
            e.evidence = Some(licence.evidence().to_string());
        };
        let Some(result) = result else {
            let mut intent = self.draft("delete_runner", "");
            fill(&mut intent);
            self.intend_deletion(&intent);
            return;
        };
        let (ok, detail) = match result {
            Ok(Deleted::Now) => (true, DELETED.to_string()),
            Ok(Deleted::AlreadyGone) => (true, ALREADY_GONE.to_string()),
            Ok(Deleted::Planned) => (true, PLANNED.to_string()),
            Err(e) => (false, e),
        };
        let e = self.event("delete_runner", ok, detail);
        fill(e);
        self.flush_audit();
    }

    /// Sets the exit status from the outcome and the failures (`Outcome::exit_code`), the
    /// outcome that follows from it (`Outcome::settled`), and the summary.
    pub fn settle(&mut self) {
        self.exit_code = self.outcome.exit_code(!self.failures.is_empty());
        self.outcome = std::mem::take(&mut self.outcome).settled(self.exit_code);
        self.summary = Summary::of(&self.events);
    }

    pub fn event(&mut self, step: &str, ok: bool, detail: impl Into<String>) -> &mut Event {
        self.flush_audit();
        let mut e = self.draft(step, "");
        e.ok = ok;
        e.detail = detail.into();
        self.events.push(e);
        self.events.last_mut().expect("just pushed")
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use serde_json::Value;

    use super::audit::MAX_AUDIT_DETAIL;
    use super::*;

    /// Collects records; fails every append when `broken`.
    #[derive(Clone, Default)]
    struct Sink {
        records: Rc<RefCell<Vec<Value>>>,
        broken: bool,
    }

    impl AuditSink for Sink {
        fn append(&mut self, record: &Value) -> anyhow::Result<()> {
            if self.broken {
                return Err(anyhow::anyhow!("disk full"));
            }
            self.records.borrow_mut().push(record.clone());
            Ok(())
        }
    }

    fn deletion(r: &mut Report, reason: &str, detail: &str, ok: bool) {
        let e = r.event("delete_runner", ok, detail);
        e.runner_id = Some(514);
        e.runner_name = Some("ephemeral-c1-1".into());
        e.reason = Some(reason.into());
        e.status = Some("offline".into());
    }

    #[test]
    fn the_summary_counts_deletions_by_reason_and_a_404_apart() {
        let mut r = Report::new("run", false, Timestamp(0));
        r.event("tofu_apply", true, "VM ready");
        r.event("register_runner", true, "");
        r.event("launch_runner", false, "exit 3");
        r.event("forget_runner", true, "404");
        deletion(&mut r, "unconsumed", DELETED, true);
        deletion(&mut r, "sweep", DELETED, true);
        deletion(&mut r, "sweep", DELETED, true);
        deletion(&mut r, "sweep", ALREADY_GONE, true);
        deletion(&mut r, "teardown", "HTTP 500", false);
        r.event("tofu_destroy", true, "VM destroyed");
        let s = Summary::of(&r.events);
        assert_eq!(s.deleted.get("sweep"), Some(&2));
        assert_eq!(s.deleted.get("unconsumed"), Some(&1));
        assert_eq!(s.deleted.get("teardown"), None);
        assert_eq!((s.already_gone, s.delete_failed), (1, 1));
        assert_eq!(
            s.line(),
            "VM applied; 1 registered, 1 launch failed, 1 consumed; deleted 2 sweep, 1 unconsumed; 1 already gone; 1 deletion(s) failed; VM destroyed"
        );
        assert_eq!(Summary::default().line(), "no side effect");
    }

    #[test]
    fn text_names_the_outcome_duration_and_each_deletions_evidence() {
        let mut r = Report::new("run", false, Timestamp(0));
        r.cycle_id = Some("c1".into());
        r.outcome = Outcome::CycleFinished;
        r.duration_ms = 12_345;
        deletion(&mut r, "sweep", DELETED, true);
        r.events[0].destroyed_cycle_id = Some("c1".into());
        r.events[0].duration_ms = 70;
        r.settle();
        let text = r.text();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "run c1: cycle_finished (exit 0, 12.34s)");
        assert_eq!(lines[1], "  deleted 1 sweep");
        assert_eq!(
            lines[2],
            "  ok    0.07s delete_runner runner 514 ephemeral-c1-1 (sweep, seen offline, after the destroy of c1): deleted"
        );
    }

    #[test]
    fn settle_sets_the_exit_status_from_failures_and_configuration_errors() {
        let mut r = Report::new("run", false, Timestamp(0));
        r.outcome = Outcome::CycleFinished;
        r.settle();
        assert_eq!(
            (r.exit_code, r.outcome.to_string().as_str()),
            (0, "cycle_finished")
        );
        r.fail("boom");
        r.settle();
        assert_eq!(
            (r.exit_code, r.outcome.to_string().as_str()),
            (1, "cycle_finished_with_errors")
        );
        r.outcome = Outcome::ConfigurationError;
        r.settle();
        assert_eq!(r.exit_code, 2);
    }

    #[test]
    fn the_audit_gets_events_in_order_failures_once_and_names_not_runner_names() {
        let sink = Sink::default();
        let mut r = Report::new("run", false, Timestamp(0));
        r.set_audit(Box::new(sink.clone()));
        r.cycle_id = Some("c1".into());
        deletion(&mut r, "unconsumed", DELETED, true);
        assert!(
            sink.records.borrow().is_empty(),
            "an event is complete (and appended) only once the next one starts or on a flush"
        );
        r.fail("HTTP 500");
        r.fail("HTTP 500");
        r.event("tofu_destroy", false, "x".repeat(3 * MAX_AUDIT_DETAIL));
        r.flush_audit();
        r.flush_audit();
        let recs = sink.records.borrow();
        assert_eq!(recs.len(), 3, "{recs:?}");
        assert_eq!(recs[0]["kind"], "side_effect");
        assert_eq!(recs[0]["cycle_id"], "c1");
        assert_eq!(recs[0]["name"], "ephemeral-c1-1");
        assert_eq!(recs[0]["status"], "offline");
        assert!(recs[0].get("runner_name").is_none());
        assert_eq!(recs[1]["kind"], "failure");
        assert_eq!(recs[1]["detail"], "HTTP 500");
        assert!(recs[2]["detail"].as_str().unwrap().len() < MAX_AUDIT_DETAIL + 40);
        assert_eq!(r.failures_not_listed, 1);
    }

    #[test]
    fn an_audit_that_cannot_be_written_is_a_failure_of_the_run() {
        let mut r = Report::new("run", false, Timestamp(0));
        r.set_audit(Box::new(Sink {
            broken: true,
            ..Sink::default()
        }));
        r.event("tofu_apply", true, "VM ready");
        r.flush_audit();
        r.event("tofu_destroy", true, "VM destroyed");
        r.flush_audit();
        assert_eq!(r.failures, vec!["audit trail: disk full".to_string()]);
        r.settle();
        assert_eq!(r.exit_code, 1);
    }

    #[test]
    fn cut_keeps_characters_whole() {
        assert_eq!(cut("abc", 3), "abc");
        assert_eq!(cut("äöü", 3), "ä… (4 bytes cut)");
    }
}
