//! The pool-wide failure backoff: after `--max-failed-cycles` cycles in a row of the pool ended
//! with a failure and without serving a job, no slot starts a new VM until the backoff has
//! passed. It starts at `--failure-backoff`, doubles with each further failed cycle, and stops
//! at `--failure-backoff-max`; a cycle that served a job ends it. Once it has passed, one slot
//! may try again: that start re-arms the gate for one more backoff, so the other slots wait for
//! its outcome. Pure data and decisions; the store keeps `backoff.json` in the pool's directory,
//! read and written under the pool's claims lock.
//!
//! The bound this gives (tests/sim.rs checks it): while every start fails, a pool of S slots
//! starts at most N + S - 1 VMs before the gate first closes (each start sees fewer than N
//! failed cycles ended, and at most S cycles run at once), and after that at most one per
//! backoff period (every start after the gate closed re-arms it for at least
//! `--failure-backoff`): in any window of length T, at most N + S - 1 + ⌈T / backoff⌉ starts.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};

use crate::core::time::{Timestamp, format_duration};

pub const BACKOFF_FILE: &str = "backoff.json";

pub const BACKOFF_VERSION: u32 = 1;

/// The flags: `--max-failed-cycles` (0: no backoff), `--failure-backoff`, `--failure-backoff-max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackoffPolicy {
    pub max_failed_cycles: u32,
    pub initial: Duration,
    pub max: Duration,
}

impl BackoffPolicy {
    pub fn enabled(&self) -> bool {
        self.max_failed_cycles > 0
    }

    /// The backoff after `failures` failed cycles in a row (at least `max_failed_cycles`).
    pub fn backoff(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(self.max_failed_cycles).min(32);
        self.initial
            .checked_mul(1u32 << doublings.min(31))
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// What is wrong with these flags, if anything (a usage error).
    pub fn check(&self) -> Result<(), String> {
        if !self.enabled() {
            return Ok(());
        }
        if self.max_failed_cycles > MAX_FAILED_CYCLES {
            return Err(format!(
                "--max-failed-cycles {} is too large: at most {MAX_FAILED_CYCLES} (0 turns the backoff off)",
                self.max_failed_cycles
            ));
        }
        if self.initial < Duration::from_secs(1) {
            return Err(
                "--failure-backoff must be at least 1s (or --max-failed-cycles 0 turns the backoff off)"
                    .into(),
            );
        }
        if self.max < self.initial {
            return Err(format!(
                "--failure-backoff-max ({}) must not be shorter than --failure-backoff ({})",
                format_duration(self.max),
                format_duration(self.initial)
            ));
        }
        Ok(())
    }
}

/// The largest `--max-failed-cycles`: past it a broken pool is hardly bounded at all.
pub const MAX_FAILED_CYCLES: u32 = 1000;

/// Why a cycle failed (the last failure of a failed cycle).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureReason {
    /// `tofu apply` (or reading its outputs) failed.
    ApplyFailed,
    /// The launch command failed, or a registration could not be made.
    LaunchFailed,
    /// A launched runner never connected to Forgejo.
    NeverConnected,
    /// Failed starts in a row: the VM was presumed broken.
    BrokenVm,
    /// The runner declared labels that do not cover its job.
    WrongLabels,
    /// The launch command could not be run at all.
    LaunchUnusable,
    /// The cycle passed `--hard-deadline`.
    HardDeadline,
    /// `tofu destroy` failed.
    DestroyFailed,
}

impl FailureReason {
    pub fn describe(self) -> &'static str {
        match self {
            FailureReason::ApplyFailed => "tofu apply failed",
            FailureReason::LaunchFailed => "a runner could not be registered or launched",
            FailureReason::NeverConnected => "a launched runner never connected to Forgejo",
            FailureReason::BrokenVm => "failed runner starts in a row (the VM was presumed broken)",
            FailureReason::WrongLabels => "a runner declared labels that do not cover its job",
            FailureReason::LaunchUnusable => "the launch command could not be run",
            FailureReason::HardDeadline => "the cycle passed --hard-deadline",
            FailureReason::DestroyFailed => "tofu destroy failed",
        }
    }
}

/// How a cycle ended, as far as the backoff cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CycleOutcome {
    /// A runner of it took a job.
    Served,
    /// It failed and served no job.
    Failed(FailureReason),
    /// Neither (e.g. its job went away before a runner started): the count stays as it is.
    Neutral,
}

/// `backoff.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backoff {
    pub version: u32,
    pub consecutive_failed_cycles: u32,
    /// The last cycle each slot counted (by slot number): a slot's cycles follow each other, so
    /// an outcome recorded again (a run resumed after a crash) is counted once.
    #[serde(default)]
    pub last_counted_cycle_id: BTreeMap<u32, String>,
    /// When the gate first closed (kept while it is extended).
    pub since: Option<Timestamp>,
    /// No new VM before this.
    pub until: Option<Timestamp>,
    pub last_reason: Option<FailureReason>,
}

/// What recording an outcome changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Already counted, or a neutral cycle: nothing to write.
    Unchanged,
    /// Counted; the gate stays open.
    Counted,
    /// Counted, and the gate closes (or stays closed longer) until `until`.
    BackingOff,
    /// A served cycle reset the count; `ended` when a backoff was in force (since `N` failures).
    Reset { ended: bool },
}

/// What the gate says about starting a new VM now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Start; nothing to write.
    Open,
    /// The backoff has passed: start once, and write this (the gate re-armed for one more
    /// backoff, so the other slots wait for this try's outcome).
    Retry(Backoff),
    /// Start no VM.
    Closed(Closed),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Closed {
    pub since: Timestamp,
    pub until: Timestamp,
    pub failures: u32,
    pub reason: Option<FailureReason>,
}

impl Closed {
    /// `backing off since …, until …: 3 cycles in a row failed without serving a job, the last
    /// because tofu apply failed`.
    pub fn describe(&self) -> String {
        format!(
            "backing off since {} until {}: {} cycle(s) of the pool in a row failed without serving a job, the last because {}; no new VM starts before then (docs/operating.md, \"Failure backoff\")",
            self.since,
            self.until,
            self.failures,
            self.reason
                .map_or("of an unrecorded failure", FailureReason::describe)
        )
    }
}

impl Backoff {
    pub fn new() -> Backoff {
        Backoff {
            version: BACKOFF_VERSION,
            ..Backoff::default()
        }
    }

    /// Whether a backoff is in force at `now` (the gate is closed).
    pub fn closed(&self, now: Timestamp) -> Option<Closed> {
        match (self.since, self.until) {
            (Some(since), Some(until)) if now < until => Some(Closed {
                since,
                until,
                failures: self.consecutive_failed_cycles,
                reason: self.last_reason,
            }),
            _ => None,
        }
    }

    /// Records how cycle `cycle_id` of slot `slot` ended, at `now`.
    pub fn record(
        &self,
        policy: &BackoffPolicy,
        slot: u32,
        cycle_id: &str,
        outcome: CycleOutcome,
        now: Timestamp,
    ) -> (Backoff, Change) {
        if !policy.enabled()
            || self.last_counted_cycle_id.get(&slot).map(String::as_str) == Some(cycle_id)
        {
            return (self.clone(), Change::Unchanged);
        }
        let mut b = self.clone();
        b.version = BACKOFF_VERSION;
        match outcome {
            CycleOutcome::Neutral => (self.clone(), Change::Unchanged),
            CycleOutcome::Served => {
                let ended = self.since.is_some();
                // Remembered as counted like a failure: recorded again (a destroy retried, a
                // run resumed after a crash), it must not reset failures other slots counted
                // since.
                let mut reset = Backoff::new();
                reset.last_counted_cycle_id = b.last_counted_cycle_id;
                reset
                    .last_counted_cycle_id
                    .insert(slot, cycle_id.to_string());
                if reset == *self {
                    return (reset, Change::Unchanged);
                }
                (reset, Change::Reset { ended })
            }
            CycleOutcome::Failed(reason) => {
                b.last_counted_cycle_id.insert(slot, cycle_id.to_string());
                b.consecutive_failed_cycles = b.consecutive_failed_cycles.saturating_add(1);
                b.last_reason = Some(reason);
                if b.consecutive_failed_cycles < policy.max_failed_cycles {
                    return (b, Change::Counted);
                }
                b.since.get_or_insert(now);
                let until = now.plus(policy.backoff(b.consecutive_failed_cycles));
                // A later failure never shortens a backoff a retry armed.
                b.until = Some(b.until.map_or(until, |u| u.max(until)));
                (b, Change::BackingOff)
            }
        }
    }

    /// Whether a new VM may start at `now`.
    pub fn gate(&self, policy: &BackoffPolicy, now: Timestamp) -> Gate {
        if !policy.enabled() || self.since.is_none() {
            return Gate::Open;
        }
        if let Some(c) = self.closed(now) {
            return Gate::Closed(c);
        }
        let mut b = self.clone();
        b.until = Some(now.plus(policy.backoff(self.consecutive_failed_cycles)));
        Gate::Retry(b)
    }
}

pub fn parse_backoff(text: &str) -> Result<Backoff> {
    let b: Backoff = serde_json::from_str(text)
        .context("it is not a backoff file this build writes (empty or truncated?)")?;
    if b.version != BACKOFF_VERSION {
        return Err(anyhow!(
            "its version {} is not one this build understands (expected {BACKOFF_VERSION})",
            b.version
        ));
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: BackoffPolicy = BackoffPolicy {
        max_failed_cycles: 3,
        initial: Duration::from_secs(120),
        max: Duration::from_secs(3600),
    };

    fn t(s: i64) -> Timestamp {
        Timestamp(s * 1000)
    }

    fn fail(b: &Backoff, slot: u32, id: &str, at: i64) -> (Backoff, Change) {
        b.record(
            &P,
            slot,
            id,
            CycleOutcome::Failed(FailureReason::ApplyFailed),
            t(at),
        )
    }

    #[test]
    fn n_failed_cycles_close_the_gate_for_the_first_backoff() {
        let b = Backoff::new();
        let (b, c) = fail(&b, 1, "c1", 10);
        assert_eq!(c, Change::Counted);
        let (b, c) = fail(&b, 1, "c2", 20);
        assert_eq!(c, Change::Counted);
        assert_eq!(b.gate(&P, t(21)), Gate::Open);
        let (b, c) = fail(&b, 1, "c3", 30);
        assert_eq!(c, Change::BackingOff);
        assert_eq!(b.since, Some(t(30)));
        assert_eq!(b.until, Some(t(150)));
        let Gate::Closed(closed) = b.gate(&P, t(149)) else {
            panic!("open before until")
        };
        assert_eq!(closed.failures, 3);
        assert_eq!(closed.reason, Some(FailureReason::ApplyFailed));
        assert!(closed.describe().contains("tofu apply failed"));
    }

    #[test]
    fn past_until_one_retry_re_arms_the_gate_and_each_failure_doubles_up_to_the_max() {
        let mut b = Backoff::new();
        for (i, at) in [10, 20, 30].iter().enumerate() {
            b = fail(&b, 1, &format!("c{i}"), *at).0;
        }
        let Gate::Retry(armed) = b.gate(&P, t(150)) else {
            panic!("closed at until")
        };
        assert_eq!(armed.until, Some(t(270)));
        // The other slots wait for the retry.
        assert!(matches!(armed.gate(&P, t(151)), Gate::Closed(_)));
        let (b, c) = fail(&armed, 2, "d1", 200);
        assert_eq!(c, Change::BackingOff);
        assert_eq!(b.until, Some(t(200 + 240)));
        assert_eq!(b.since, Some(t(30)), "since stays while extended");
        let (b, _) = fail(&b, 2, "d2", 500);
        assert_eq!(b.until, Some(t(500 + 480)));
        let mut b = b;
        for i in 0..10 {
            b = fail(&b, 1, &format!("e{i}"), 1000 + i).0;
        }
        assert_eq!(b.until, Some(t(1009 + 3600)), "capped at the max");
        assert_eq!(P.backoff(u32::MAX), P.max);
    }

    #[test]
    fn a_later_failure_never_shortens_a_re_armed_backoff() {
        let mut b = Backoff::new();
        b.since = Some(t(0));
        b.until = Some(t(10_000));
        b.consecutive_failed_cycles = 3;
        let (b, _) = fail(&b, 1, "x", 100);
        assert_eq!(b.until, Some(t(10_000)));
    }

    #[test]
    fn a_cycle_is_counted_once_per_slot_even_when_recorded_again() {
        let (b, _) = fail(&Backoff::new(), 1, "c1", 10);
        let (b2, c) = fail(&b, 1, "c1", 11);
        assert_eq!(c, Change::Unchanged);
        assert_eq!(b2, b);
        // Another slot's cycle in between does not make slot 1's count twice.
        let (b, _) = fail(&b, 2, "d1", 12);
        let (b, c) = fail(&b, 1, "c1", 13);
        assert_eq!(c, Change::Unchanged);
        assert_eq!(b.consecutive_failed_cycles, 2);
    }

    #[test]
    fn a_served_cycle_resets_and_says_whether_a_backoff_ended() {
        let (b, _) = fail(&Backoff::new(), 1, "c1", 10);
        let (r, c) = b.record(&P, 1, "c2", CycleOutcome::Served, t(20));
        assert_eq!(c, Change::Reset { ended: false });
        assert_eq!(r.consecutive_failed_cycles, 0);
        let mut b = r;
        for i in 0..3 {
            b = fail(&b, 1, &format!("f{i}"), 30 + i).0;
        }
        let (r, c) = b.record(&P, 2, "g", CycleOutcome::Served, t(40));
        assert_eq!(c, Change::Reset { ended: true });
        assert_eq!((r.since, r.until, r.last_reason), (None, None, None));
        assert_eq!(r.gate(&P, t(41)), Gate::Open);
        // The same cycle recorded again: nothing to write.
        let (_, c) = r.record(&P, 2, "g", CycleOutcome::Served, t(50));
        assert_eq!(c, Change::Unchanged);
    }

    /// A served cycle whose destroy keeps failing is recorded by every run that retries it: it
    /// must not wipe the failures the other slots counted in between, or a pool of failing
    /// slots never backs off.
    #[test]
    fn a_served_cycle_recorded_again_does_not_reset_later_failures() {
        let (b, _) = b_served(&Backoff::new());
        let mut b = b;
        for i in 0..2 {
            b = fail(&b, 2, &format!("f{i}"), 30 + i).0;
        }
        let (b, c) = b.record(&P, 1, "s1", CycleOutcome::Served, t(40));
        assert_eq!(c, Change::Unchanged);
        assert_eq!(b.consecutive_failed_cycles, 2);
        let (b, c) = fail(&b, 2, "f2", 50);
        assert_eq!(c, Change::BackingOff);
        assert!(matches!(b.gate(&P, t(51)), Gate::Closed(_)));
    }

    fn b_served(b: &Backoff) -> (Backoff, Change) {
        b.record(&P, 1, "s1", CycleOutcome::Served, t(20))
    }

    #[test]
    fn a_neutral_cycle_changes_nothing() {
        let (b, _) = fail(&Backoff::new(), 1, "c1", 10);
        let (n, c) = b.record(&P, 1, "c2", CycleOutcome::Neutral, t(20));
        assert_eq!(c, Change::Unchanged);
        assert_eq!(n, b);
    }

    #[test]
    fn max_failed_cycles_zero_turns_it_off() {
        let off = BackoffPolicy {
            max_failed_cycles: 0,
            ..P
        };
        let mut b = Backoff::new();
        for i in 0..10 {
            let (n, c) = b.record(
                &off,
                1,
                &format!("c{i}"),
                CycleOutcome::Failed(FailureReason::BrokenVm),
                t(i),
            );
            assert_eq!(c, Change::Unchanged);
            b = n;
        }
        assert_eq!(b.gate(&off, t(11)), Gate::Open);
        assert!(off.check().is_ok());
    }

    #[test]
    fn nonsense_flags_are_refused() {
        assert!(P.check().is_ok());
        let short_max = BackoffPolicy {
            max: Duration::from_secs(60),
            ..P
        };
        assert!(short_max.check().is_err());
        let zero = BackoffPolicy {
            initial: Duration::ZERO,
            ..P
        };
        assert!(zero.check().is_err());
        let huge = BackoffPolicy {
            max_failed_cycles: MAX_FAILED_CYCLES + 1,
            ..P
        };
        assert!(huge.check().is_err());
    }

    #[test]
    fn the_file_round_trips_and_a_foreign_one_is_refused() {
        let (b, _) = fail(&Backoff::new(), 3, "c1", 10);
        let text = serde_json::to_string(&b).unwrap();
        assert_eq!(parse_backoff(&text).unwrap(), b);
        assert!(parse_backoff("").is_err());
        assert!(parse_backoff(r#"{"version": 2}"#).is_err());
    }
}
