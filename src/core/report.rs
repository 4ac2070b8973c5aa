//! The run report: every side effect with its outcome, every failure, the exit status.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;
use serde_json::{Value, json};

use crate::core::licence::SweepLicence;
use crate::core::ports::{AuditSink, Clock, Deleted};
use crate::core::time::Timestamp;

/// The detail of a `delete_runner` event whose DELETE Forgejo answered 404: gone, but not by us.
pub const ALREADY_GONE: &str = "already gone (404)";

/// The detail of a `delete_runner` event whose DELETE Forgejo answered 204.
pub const DELETED: &str = "deleted";

/// A dry-run's deletion: in the plan, never sent.
pub const PLANNED: &str = "would be deleted (dry-run: nothing sent)";

/// Details longer than this are cut in the audit trail (tofu's stderr can be long).
pub const MAX_AUDIT_DETAIL: usize = 2048;

/// The report's audit sink, if any (never serialized).
#[derive(Default)]
pub struct Audit(Option<Box<dyn AuditSink>>);

impl fmt::Debug for Audit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Audit(on)"
        } else {
            "Audit(off)"
        })
    }
}

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
    /// minimum age ago (`core::slots::sweep_min_age`): their owner may still be starting them.
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

    /// One line: `VM applied; 2 registered, 2 launched; deleted 1 unconsumed; VM destroyed`.
    pub fn line(&self) -> String {
        let mut parts: Vec<String> = Vec::new();
        let n = |count: u32, what: &str| format!("{count} {what}");
        if self.vm_applied > 0 {
            parts.push("VM applied".into());
        }
        if self.apply_failed > 0 {
            parts.push(n(self.apply_failed, "apply failed"));
        }
        let mut regs = Vec::new();
        for (count, what) in [
            (self.registered, "registered"),
            (self.register_failed, "registration failed"),
            (self.launched, "launched"),
            (self.launch_failed, "launch failed"),
            (self.consumed, "consumed"),
        ] {
            if count > 0 {
                regs.push(n(count, what));
            }
        }
        if !regs.is_empty() {
            parts.push(regs.join(", "));
        }
        if !self.deleted.is_empty() {
            let by: Vec<String> = self.deleted.iter().map(|(r, c)| n(*c, r)).collect();
            parts.push(format!("deleted {}", by.join(", ")));
        }
        if self.already_gone > 0 {
            parts.push(n(self.already_gone, "already gone"));
        }
        if self.delete_failed > 0 {
            parts.push(n(self.delete_failed, "deletion(s) failed"));
        }
        if self.held > 0 {
            parts.push(n(self.held, "job(s) held"));
        }
        if self.vm_destroyed > 0 {
            parts.push("VM destroyed".into());
        }
        if self.destroy_failed > 0 {
            parts.push(n(self.destroy_failed, "destroy failed"));
        }
        if parts.is_empty() {
            "no side effect".into()
        } else {
            parts.join("; ")
        }
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
    /// `idle`, `cycle_finished`, `failed`, `interrupted`, `would_wait`, `swept`, …
    pub outcome: String,
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
    #[serde(skip)]
    audit: Audit,
    #[serde(skip)]
    clock: ReportClock,
    /// Events already appended to the audit trail.
    #[serde(skip)]
    audited: usize,
}

/// The report's source of timestamps (see `Report::set_clock`).
#[derive(Default)]
pub struct ReportClock(Option<Box<dyn Fn() -> Timestamp>>);

impl fmt::Debug for ReportClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "ReportClock(set)"
        } else {
            "ReportClock(start)"
        })
    }
}

/// Measures a step on the clock port: the time from `start` to `ms`.
pub struct Stopwatch(Timestamp);

impl Stopwatch {
    pub fn start(clock: &dyn Clock) -> Stopwatch {
        Stopwatch(clock.now())
    }

    pub fn ms(&self, clock: &dyn Clock) -> u64 {
        u64::try_from(clock.now().0.saturating_sub(self.0.0)).unwrap_or(0)
    }
}

/// A run that keeps failing the same way (Forgejo down for hours) must not grow its report
/// without bound.
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
            outcome: String::new(),
            exit_code: 0,
            events: Vec::new(),
            failures: Vec::new(),
            failures_not_listed: 0,
            sweep: None,
            duration_ms: 0,
            summary: Summary::default(),
            backoff: None,
            audit: Audit::default(),
            clock: ReportClock(None),
            audited: 0,
        }
    }

    /// From now on every event and failure is also appended to `sink` as it happens.
    pub fn set_audit(&mut self, sink: Box<dyn AuditSink>) {
        self.audit = Audit(Some(sink));
    }

    /// Records a failure: logged at error level, kept in the report (and the audit trail), and
    /// it makes the exit status 1.
    pub fn fail(&mut self, message: impl Into<String>) {
        let message = message.into();
        self.flush_audit();
        if self.keep_failure(message.clone()) {
            let record = json!({
                "at": self.now(),
                "cycle_id": self.cycle_id,
                "kind": "failure",
                "detail": cut(&message, MAX_AUDIT_DETAIL),
            });
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

    fn append(&mut self, record: &Value) {
        let Some(sink) = self.audit.0.as_mut() else {
            return;
        };
        if let Err(e) = sink.append(record) {
            // Not audited itself (that is what just failed), but logged and kept.
            self.keep_failure(format!("audit trail: {e:#}"));
        }
    }

    /// Appends the events not yet in the audit trail. Each event is complete once the next one
    /// starts; the driver also flushes before every write of cycle.json, and `finish` at the end.
    pub fn flush_audit(&mut self) {
        while self.audited < self.events.len() {
            let record = audit_record(self.cycle_id.as_deref(), &self.events[self.audited]);
            self.audited += 1;
            self.append(&record);
        }
    }

    /// Appends what is pending and makes the audit trail durable.
    pub fn sync_audit(&mut self) {
        self.flush_audit();
        let Some(sink) = self.audit.0.as_mut() else {
            return;
        };
        if let Err(e) = sink.sync() {
            self.keep_failure(format!("audit trail: {e:#}"));
        }
    }

    /// Appended to the audit trail (only) just before a DELETE is sent, with the evidence: a
    /// crash between the DELETE and its event still leaves the deletion findable.
    pub fn intend_deletion(&mut self, intent: &Event) {
        self.flush_audit();
        let mut record = audit_record(self.cycle_id.as_deref(), intent);
        if let Some(o) = record.as_object_mut() {
            o.insert("kind".into(), json!("intent"));
            for k in ["ok", "detail", "duration_ms"] {
                o.remove(k);
            }
        }
        self.append(&record);
    }

    /// The time on the run's clock (`set_clock`); without one, the time the run started.
    pub fn now(&self) -> Timestamp {
        self.clock.0.as_ref().map_or(self.started_at, |now| now())
    }

    /// Where the report's timestamps come from: the clock port of the run (the real clock, or a
    /// fixture's, which stands still).
    pub fn set_clock(&mut self, now: Box<dyn Fn() -> Timestamp>) {
        self.clock = ReportClock(Some(now));
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

    /// Sets the exit status and the outcome from the failures; `config_error` is exit 2.
    pub fn settle(&mut self, config_error: bool) {
        self.exit_code = match (config_error, self.failures.is_empty()) {
            (true, _) => 2,
            (false, true) => 0,
            (false, false) => 1,
        };
        if self.exit_code == 1 && self.outcome == "swept" {
            self.outcome = "sweep_failed".into();
        }
        if self.exit_code != 0 && (self.outcome.is_empty() || self.outcome == "cycle_finished") {
            self.outcome = format!(
                "{}_with_errors",
                if self.outcome.is_empty() {
                    "run"
                } else {
                    &self.outcome
                }
            );
        }
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

    /// A short human summary.
    pub fn text(&self) -> String {
        let mut out = format!(
            "{} {}: {} (exit {}, {})",
            self.command,
            self.cycle_id.as_deref().unwrap_or("(no cycle)"),
            self.outcome,
            self.exit_code,
            seconds(self.duration_ms)
        );
        out.push_str(&format!("\n  {}", self.summary.line()));
        // Names and errors in events come from Forgejo and tofu: escaped, one line each.
        for e in &self.events {
            out.push_str(&format!(
                "\n  {}",
                crate::core::escape::escape_controls(&event_line(e))
            ));
        }
        if let Some(s) = &self.sweep {
            out.push_str(&format!(
                "\n  sweep{}: {} listed on {} pages, {} offline with our prefix, {} deleted, {} already gone, {} failed, {} doubtful skipped, {} left over the cap",
                if s.error.is_some() {
                    " FAILED (the listing is incomplete)"
                } else {
                    ""
                },
                s.listed,
                s.pages,
                s.found,
                s.deleted.len(),
                s.already_gone.len(),
                s.failed.len(),
                s.skipped_doubtful.len(),
                s.left_over_cap,
            ));
        }
        // Each failure was logged at error level when it happened (on stderr, or the journal):
        // the summary counts them rather than printing every one a second time.
        let failures = self.failures.len() as u64 + self.failures_not_listed;
        if self.failures_not_listed > 0 {
            out.push_str(&format!(
                "\n  {failures} error(s), logged as they happened; the first {} are kept in last-run.json (`ci-ephemeral-provisioner status` shows them)",
                self.failures.len()
            ));
        } else if failures > 0 {
            out.push_str(&format!(
                "\n  {failures} error(s), logged as they happened and kept in last-run.json (`ci-ephemeral-provisioner status` shows them)"
            ));
        }
        out
    }
}

/// `1.25s`
pub fn seconds(ms: u64) -> String {
    format!("{}.{:02}s", ms / 1000, (ms % 1000) / 10)
}

/// `ok    0.10s delete_runner runner 3 ephemeral-x-1 (unconsumed, seen offline): deleted`
pub fn event_line(e: &Event) -> String {
    let mut why: Vec<String> = Vec::new();
    if let Some(r) = &e.reason {
        why.push(r.clone());
    }
    if let Some(s) = &e.status {
        why.push(format!("seen {s}"));
    }
    if let Some(c) = &e.destroyed_cycle_id {
        why.push(format!("after the destroy of {c}"));
    }
    format!(
        "{} {:>6} {}{}{}{}: {}",
        if e.ok { "ok  " } else { "FAIL" },
        seconds(e.duration_ms),
        e.step,
        e.runner_id
            .map(|i| format!(" runner {i}"))
            .unwrap_or_default(),
        e.runner_name
            .as_ref()
            .map(|n| format!(" {n}"))
            .unwrap_or_default(),
        if why.is_empty() {
            String::new()
        } else {
            format!(" ({})", why.join(", "))
        },
        // The whole detail is in the JSON form and the audit trail; the error lines repeat it.
        cut(&e.detail, 300)
    )
}

/// The audit record of an event: the event with the cycle id and `name` (the registration's).
pub fn audit_record(cycle_id: Option<&str>, e: &Event) -> Value {
    let mut v = serde_json::to_value(e).unwrap_or_else(|_| json!({}));
    if let Some(o) = v.as_object_mut() {
        o.insert("cycle_id".into(), json!(cycle_id));
        o.insert("kind".into(), json!("side_effect"));
        if let Some(name) = o.remove("runner_name") {
            o.insert("name".into(), name);
        }
        o.insert("detail".into(), json!(cut(&e.detail, MAX_AUDIT_DETAIL)));
    }
    v
}

/// At most `max` bytes of `s`, cut at a character boundary, marked when cut.
pub fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes cut)", &s[..end], s.len() - end)
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

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
        r.outcome = "cycle_finished".into();
        r.duration_ms = 12_345;
        deletion(&mut r, "sweep", DELETED, true);
        r.events[0].destroyed_cycle_id = Some("c1".into());
        r.events[0].duration_ms = 70;
        r.settle(false);
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
        r.outcome = "cycle_finished".into();
        r.settle(false);
        assert_eq!((r.exit_code, r.outcome.as_str()), (0, "cycle_finished"));
        r.fail("boom");
        r.settle(false);
        assert_eq!(
            (r.exit_code, r.outcome.as_str()),
            (1, "cycle_finished_with_errors")
        );
        r.settle(true);
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
        r.settle(false);
        assert_eq!(r.exit_code, 1);
    }

    #[test]
    fn cut_keeps_characters_whole() {
        assert_eq!(cut("abc", 3), "abc");
        assert_eq!(cut("äöü", 3), "ä… (4 bytes cut)");
    }
}
