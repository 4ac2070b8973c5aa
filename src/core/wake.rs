//! How a run answers a webhook delivery (`--wake-file`, `--wake-window`): the receiver (`hook`)
//! touches the slot's wake file, whose modification time is when the slot was last woken. For
//! `--wake-window` after it, a run looks for jobs every second (or every `--poll-interval`, if
//! shorter) — a push's delivery can come before Forgejo has written its jobs (Forgejo v15.0.3
//! registers the webhook notifier before the Actions one, `routers/init.go`, and delivers from a
//! queue, `services/webhook/webhook.go`) — and a run with nothing to do keeps looking instead of
//! exiting. Pure: the modification time and the clock come in as arguments.

use std::time::Duration;

use crate::core::time::Timestamp;

/// How often a woken run looks at most.
pub const WAKE_INTERVAL: Duration = Duration::from_secs(1);

/// A run with nothing to do keeps looking for at most this many wake windows in all, however
/// many deliveries keep coming (the next delivery or timer tick starts a fresh run).
pub const MAX_WATCH_WINDOWS: u32 = 10;

/// The longest `--wake-window`.
pub const MAX_WAKE_WINDOW: Duration = Duration::from_secs(600);

/// `--wake-window` and the interval of a woken run's looks. The default (a zero window) never
/// watches: a run without `--wake-file`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WakePolicy {
    pub window: Duration,
    pub interval: Duration,
}

impl WakePolicy {
    /// The policy of `--wake-window`, with looks every [`WAKE_INTERVAL`] or every
    /// `poll_interval`, whichever is shorter.
    pub fn new(window: Duration, poll_interval: Duration) -> WakePolicy {
        WakePolicy {
            window,
            interval: WAKE_INTERVAL.min(poll_interval),
        }
    }

    /// When the slot was last woken, if that counts at `now`: no more than the window ago. A
    /// time in the future (the clock was set back since) counts only within one window of now,
    /// so that a wrong clock never makes a run watch for long.
    pub fn woken(&self, woken_at: Option<Timestamp>, now: Timestamp) -> Option<Timestamp> {
        let t = woken_at?;
        let recent = now < t.plus(self.window);
        let not_far_ahead = t <= now.plus(self.window);
        (!self.window.is_zero() && recent && not_far_ahead).then_some(t)
    }

    /// How long a run in a cycle waits before it looks again: `--poll-interval`, or this
    /// policy's interval while woken.
    pub fn pause(
        &self,
        poll_interval: Duration,
        woken_at: Option<Timestamp>,
        now: Timestamp,
    ) -> Duration {
        match self.woken(woken_at, now) {
            Some(_) => poll_interval.min(self.interval),
            None => poll_interval,
        }
    }

    /// A run (started at `started`) that has nothing to do at `now`: how long to wait before it
    /// looks again while woken, `None` to end. Bounded by [`MAX_WATCH_WINDOWS`] windows since
    /// the run started.
    pub fn watch(
        &self,
        woken_at: Option<Timestamp>,
        now: Timestamp,
        started: Timestamp,
    ) -> Option<Duration> {
        self.woken(woken_at, now)?;
        let limit = started.plus(self.window.saturating_mul(MAX_WATCH_WINDOWS));
        (now < limit).then_some(self.interval)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1000;
    fn at(secs: i64) -> Timestamp {
        Timestamp(1_000_000 * S + secs * S)
    }
    fn policy() -> WakePolicy {
        WakePolicy::new(Duration::from_secs(30), Duration::from_secs(5))
    }

    // Mutation caught: `woken` without the window (a delivery of an hour ago still wakes).
    #[test]
    fn a_delivery_counts_for_its_window_only() {
        let p = policy();
        assert_eq!(p.interval, WAKE_INTERVAL);
        assert_eq!(p.woken(None, at(0)), None);
        assert_eq!(p.woken(Some(at(0)), at(0)), Some(at(0)));
        assert_eq!(p.woken(Some(at(0)), at(29)), Some(at(0)));
        assert_eq!(p.woken(Some(at(0)), at(30)), None);
        assert_eq!(p.woken(Some(at(-3600)), at(0)), None);
        // A time ahead of the clock (set back since): within one window only.
        assert_eq!(p.woken(Some(at(20)), at(0)), Some(at(20)));
        assert_eq!(p.woken(Some(at(3600)), at(0)), None);
        // Without a window nothing wakes.
        let off = WakePolicy::default();
        assert_eq!(off.woken(Some(at(0)), at(0)), None);
    }

    #[test]
    fn a_woken_cycle_looks_every_second_and_a_quiet_one_at_its_poll_interval() {
        let p = policy();
        let poll = Duration::from_secs(5);
        assert_eq!(p.pause(poll, None, at(0)), poll);
        assert_eq!(p.pause(poll, Some(at(0)), at(10)), WAKE_INTERVAL);
        assert_eq!(p.pause(poll, Some(at(0)), at(31)), poll);
        // A poll interval shorter than a second is kept.
        let fast = WakePolicy::new(Duration::from_secs(30), Duration::from_millis(200));
        assert_eq!(fast.interval, Duration::from_millis(200));
        let short = Duration::from_millis(200);
        assert_eq!(fast.pause(short, Some(at(0)), at(1)), short);
    }

    // Mutation caught: `watch` without its bound (a run under a steady stream of deliveries never ends).
    #[test]
    fn an_idle_run_watches_while_woken_and_never_past_its_bound() {
        let p = policy();
        let started = at(0);
        assert_eq!(p.watch(None, at(0), started), None);
        assert_eq!(p.watch(Some(at(0)), at(1), started), Some(WAKE_INTERVAL));
        assert_eq!(p.watch(Some(at(0)), at(30), started), None);
        // Deliveries every 10 s keep it looking, but only for 10 windows in all.
        assert_eq!(
            p.watch(Some(at(290)), at(299), started),
            Some(WAKE_INTERVAL)
        );
        assert_eq!(p.watch(Some(at(299)), at(300), started), None);
        // A run started by the timer after the delivery watches the rest of the window.
        assert_eq!(p.watch(Some(at(0)), at(20), at(20)), Some(WAKE_INTERVAL));
    }
}
