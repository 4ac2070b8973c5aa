//! Where a report's timestamps come from, and the duration of a step.

use std::fmt;

use crate::core::ports::Clock;
use crate::core::time::Timestamp;

/// The report's source of timestamps: the clock port of the run (the real clock, or a
/// fixture's, which stands still); without one, the time the run started.
#[derive(Default)]
pub struct ReportClock(Option<Box<dyn Fn() -> Timestamp>>);

impl ReportClock {
    pub fn new(now: Box<dyn Fn() -> Timestamp>) -> ReportClock {
        ReportClock(Some(now))
    }

    /// The time now, or `started_at` without a clock.
    pub fn now(&self, started_at: Timestamp) -> Timestamp {
        self.0.as_ref().map_or(started_at, |now| now())
    }
}

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
