//! The run report: every side effect with its outcome, every failure, the exit status.

use std::time::Instant;

use serde::Serialize;

use crate::time::Timestamp;

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
    pub detail: String,
    pub duration_ms: u64,
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
    /// Offline registrations with our prefix.
    pub found: usize,
    pub deleted: Vec<SweptRunner>,
    /// Answered 404: someone else deleted them first.
    pub already_gone: Vec<i64>,
    pub failed: Vec<SweptRunner>,
    /// Registrations with our prefix whose status was missing or unknown: never deleted.
    pub skipped_doubtful: Vec<SweptRunner>,
    /// Deletable registrations left for the next sweep because of `--sweep-max-deletions`.
    pub left_over_cap: usize,
    /// Set when listing failed: then nothing at all was deleted.
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
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
        }
    }

    /// Records a failure: logged at error level, kept in the report, and it makes the exit
    /// status 1.
    pub fn fail(&mut self, message: impl Into<String>) {
        let message = message.into();
        log::error!("{message}");
        if self.failures.len() >= MAX_FAILURES || self.failures.contains(&message) {
            self.failures_not_listed += 1;
        } else {
            self.failures.push(message);
        }
    }

    pub fn event(&mut self, step: &str, ok: bool, detail: impl Into<String>) -> &mut Event {
        self.events.push(Event {
            at: Timestamp::now(),
            step: step.into(),
            ok,
            runner_id: None,
            runner_name: None,
            reason: None,
            detail: detail.into(),
            duration_ms: 0,
        });
        self.events.last_mut().expect("just pushed")
    }

    /// A short human summary.
    pub fn text(&self) -> String {
        let mut out = format!(
            "{} {}: {} (exit {})",
            self.command,
            self.cycle_id.as_deref().unwrap_or("(no cycle)"),
            self.outcome,
            self.exit_code
        );
        for e in &self.events {
            out.push_str(&format!(
                "\n  {} {}{}{} {}",
                if e.ok { "ok  " } else { "FAIL" },
                e.step,
                e.runner_id
                    .map(|i| format!(" runner {i}"))
                    .unwrap_or_default(),
                e.reason
                    .as_ref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default(),
                e.detail
            ));
        }
        if let Some(s) = &self.sweep {
            out.push_str(&format!(
                "\n  sweep: {} listed on {} pages, {} offline with our prefix, {} deleted, {} already gone, {} failed, {} doubtful skipped, {} left over the cap{}",
                s.listed,
                s.pages,
                s.found,
                s.deleted.len(),
                s.already_gone.len(),
                s.failed.len(),
                s.skipped_doubtful.len(),
                s.left_over_cap,
                s.error.as_ref().map(|e| format!("; ERROR: {e}")).unwrap_or_default()
            ));
        }
        for f in &self.failures {
            out.push_str(&format!("\n  error: {f}"));
        }
        if self.failures_not_listed > 0 {
            out.push_str(&format!(
                "\n  ({} more failures: repeats or past the first {MAX_FAILURES}; all are in the log)",
                self.failures_not_listed
            ));
        }
        out
    }
}

/// Measures a step for its event.
pub struct Stopwatch(Instant);

impl Stopwatch {
    pub fn start() -> Stopwatch {
        Stopwatch(Instant::now())
    }

    pub fn ms(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}
