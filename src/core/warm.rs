//! Warm capacity (`--warm`): VMs a pool keeps booted with no job, so that a job which arrives is
//! launched at the next poll instead of after a VM boot.
//!
//! A warm VM is a cycle started without a job (`CycleState::warm`). While no runner was started
//! on it, it is bound to no repository (its first job sets the trust boundary, as any cycle's
//! does) and it is kept up to `--warm-max-age` instead of `--idle-timeout`. How many the pool
//! wants follows from `--warm` and `--warm-during`; which slot keeps one is decided by slot
//! number, lowest first, so that the slots agree without talking to each other.

use std::time::Duration;

use anyhow::{Result, anyhow, bail};

use crate::core::state::{CycleState, Phase};
use crate::core::time::Timestamp;

/// `--warm`, `--warm-max-age`, `--warm-during`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WarmPolicy {
    /// Unused warm VMs the pool keeps (inside `during`).
    pub count: u32,
    /// An unused warm VM older than this (since its apply) is destroyed; a later run makes a new
    /// one.
    pub max_age: Duration,
    /// When `count` applies; outside these windows the pool wants no warm VM. Empty: always.
    pub during: Windows,
}

impl WarmPolicy {
    /// How many unused warm VMs the pool wants at `now`.
    pub fn wanted(&self, now: Timestamp) -> u32 {
        if self.count > 0 && self.during.contains(now) {
            self.count
        } else {
            0
        }
    }
}

/// What a slot knows of the pool's unused warm VMs beside its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WarmElsewhere {
    /// Unused warm VMs in the pool's other slots (booting ones included).
    pub total: u32,
    /// Of those, the ones in slots numbered below this one: they are kept first.
    pub in_lower_slots: u32,
}

/// Whether `state` is a warm VM no runner was started on yet (booting or up): it serves the next
/// job of the pool, whoever's it is.
pub fn is_unused_warm(state: &CycleState) -> bool {
    state.warm
        && matches!(state.phase, Phase::Applying | Phase::Running)
        && state.jobs_started == 0
        && state.registrations.is_empty()
        && state.previous.is_empty()
        && state.boundary.is_none()
}

/// Why an unused warm VM goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarmEnd {
    /// It is older than `--warm-max-age`.
    Expired,
    /// The pool wants fewer warm VMs than it has (`--warm` lowered, outside `--warm-during`),
    /// and the slots below this one keep theirs.
    NotWanted,
}

/// Whether this slot's unused warm VM, ready since `ready_at`, stays or goes at `now`.
pub fn warm_end(
    policy: &WarmPolicy,
    ready_at: Timestamp,
    elsewhere: WarmElsewhere,
    now: Timestamp,
) -> Option<WarmEnd> {
    if elsewhere.in_lower_slots >= policy.wanted(now) {
        return Some(WarmEnd::NotWanted);
    }
    (now.since(ready_at) >= policy.max_age).then_some(WarmEnd::Expired)
}

/// Whether a slot with no cycle starts a warm VM at `now`.
pub fn wants_another(policy: &WarmPolicy, elsewhere: WarmElsewhere, now: Timestamp) -> bool {
    elsewhere.total < policy.wanted(now)
}

/// `--warm-during`: weekly windows in UTC, e.g. `Mon..Fri 07:00-19:00, Sat 09:00-13:00`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Windows(Vec<Window>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Window {
    /// Bit d set: day d (0 = Monday) is in the window.
    days: u8,
    /// Minutes since midnight, `start < end <= 24 * 60`.
    start: u32,
    end: u32,
}

const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

impl Windows {
    /// Always (no `--warm-during`).
    pub fn always() -> Windows {
        Windows(Vec::new())
    }

    /// Parses a comma-separated list of `[DAYS ]HH:MM-HH:MM`, where DAYS is a day (`Mon`), a
    /// range (`Mon..Fri`, which may wrap: `Sat..Sun`), or days joined by `+` (`Mon+Wed`). Without
    /// DAYS, every day. Times are UTC; `24:00` ends a day.
    pub fn parse(s: &str) -> Result<Windows> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim) {
            if part.is_empty() {
                bail!("{s:?}: an empty window (two commas, or one at the end)");
            }
            out.push(
                Window::parse(part)
                    .map_err(|e| anyhow!("{part:?}: {e}; expected e.g. 'Mon..Fri 07:00-19:00'"))?,
            );
        }
        Ok(Windows(out))
    }

    /// Whether `now` lies in a window (always, with none).
    pub fn contains(&self, now: Timestamp) -> bool {
        if self.0.is_empty() {
            return true;
        }
        let secs = now.0.div_euclid(1000);
        let days = secs.div_euclid(86_400);
        // 1970-01-01 was a Thursday (3, counting from Monday = 0).
        let weekday = (days + 3).rem_euclid(7) as u32;
        let minute = (secs.rem_euclid(86_400) / 60) as u32;
        self.0
            .iter()
            .any(|w| w.days & (1 << weekday) != 0 && w.start <= minute && minute < w.end)
    }
}

impl Window {
    fn parse(s: &str) -> Result<Window> {
        let (days, times) = match s.rsplit_once(char::is_whitespace) {
            Some((d, t)) => (parse_days(d.trim())?, t),
            None => (0x7f, s),
        };
        let (a, b) = times
            .split_once('-')
            .ok_or_else(|| anyhow!("no time range HH:MM-HH:MM"))?;
        let (start, end) = (parse_time(a)?, parse_time(b)?);
        if start >= end {
            bail!(
                "the window ends ({b}) before it starts ({a}); split a window across midnight in two"
            );
        }
        Ok(Window { days, start, end })
    }
}

fn parse_day(s: &str) -> Result<u32> {
    let l = s.to_ascii_lowercase();
    DAYS.iter()
        .position(|d| *d == l)
        .map(|p| p as u32)
        .ok_or_else(|| anyhow!("{s:?} is not a day (Mon, Tue, Wed, Thu, Fri, Sat, Sun)"))
}

fn parse_days(s: &str) -> Result<u8> {
    let mut bits = 0u8;
    for d in s.split('+') {
        match d.split_once("..") {
            Some((a, b)) => {
                let (a, b) = (parse_day(a)?, parse_day(b)?);
                let mut i = a;
                loop {
                    bits |= 1 << i;
                    if i == b {
                        break;
                    }
                    i = (i + 1) % 7;
                }
            }
            None => bits |= 1 << parse_day(d)?,
        }
    }
    Ok(bits)
}

fn parse_time(s: &str) -> Result<u32> {
    let (h, m) = s
        .split_once(':')
        .ok_or_else(|| anyhow!("{s:?} is not a time HH:MM"))?;
    let num = |x: &str| {
        (x.len() == 2 && x.bytes().all(|b| b.is_ascii_digit()))
            .then(|| x.parse::<u32>().ok())
            .flatten()
            .ok_or_else(|| anyhow!("{s:?} is not a time HH:MM"))
    };
    let (h, m) = (num(h)?, num(m)?);
    if m >= 60 || h > 24 || (h == 24 && m != 0) {
        bail!("{s:?} is not a time of day (00:00 to 24:00)");
    }
    Ok(h * 60 + m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        Timestamp::parse_rfc3339(s).unwrap()
    }

    #[test]
    fn windows_follow_the_weekday_and_the_time_of_day_in_utc() {
        let w = Windows::parse("Mon..Fri 07:00-19:00").unwrap();
        // 2026-12-02 is a Wednesday.
        assert!(w.contains(at("2026-12-02T07:00:00Z")));
        assert!(w.contains(at("2026-12-02T18:59:59Z")));
        assert!(!w.contains(at("2026-12-02T19:00:00Z")));
        assert!(!w.contains(at("2026-12-02T06:59:59Z")));
        assert!(!w.contains(at("2026-12-05T12:00:00Z")), "a Saturday");
        assert!(w.contains(at("2026-12-04T12:00:00Z")), "a Friday");
        assert!(w.contains(at("2026-11-30T12:00:00Z")), "a Monday");
        let wrap = Windows::parse("Sat..Mon 00:00-24:00, Wed+Thu 12:00-13:00").unwrap();
        assert!(wrap.contains(at("2026-12-06T23:59:00Z")), "a Sunday");
        assert!(wrap.contains(at("2026-11-30T00:00:00Z")), "a Monday");
        assert!(!wrap.contains(at("2026-12-01T10:00:00Z")), "a Tuesday");
        assert!(wrap.contains(at("2026-12-03T12:30:00Z")), "a Thursday");
        assert!(!wrap.contains(at("2026-12-03T13:00:00Z")));
        let daily = Windows::parse("08:00-09:00").unwrap();
        assert!(daily.contains(at("2026-12-06T08:30:00Z")));
        assert!(Windows::always().contains(at("2026-12-06T03:00:00Z")));
    }

    #[test]
    fn a_window_that_cannot_be_read_is_refused_saying_why() {
        for (bad, says) in [
            ("Mon..Fri 19:00-07:00", "before it starts"),
            ("Mon..Fry 07:00-19:00", "is not a day"),
            ("Mon..Fri 7:00-19:00", "not a time HH:MM"),
            ("Mon..Fri 07:00-24:30", "not a time of day"),
            ("Mon..Fri", "no time range"),
            ("Mon 07:00-08:00,", "empty window"),
        ] {
            let e = format!("{:#}", Windows::parse(bad).unwrap_err());
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    fn policy(count: u32) -> WarmPolicy {
        WarmPolicy {
            count,
            max_age: Duration::from_secs(3600),
            during: Windows::parse("Mon..Fri 07:00-19:00").unwrap(),
        }
    }

    #[test]
    fn the_pool_wants_warm_vms_only_inside_its_windows() {
        let p = policy(2);
        assert_eq!(p.wanted(at("2026-12-02T12:00:00Z")), 2);
        assert_eq!(p.wanted(at("2026-12-05T12:00:00Z")), 0);
        assert_eq!(policy(0).wanted(at("2026-12-02T12:00:00Z")), 0);
        let none = WarmElsewhere::default();
        assert!(wants_another(&p, none, at("2026-12-02T12:00:00Z")));
        assert!(!wants_another(&p, none, at("2026-12-05T12:00:00Z")));
        let two = WarmElsewhere {
            total: 2,
            in_lower_slots: 0,
        };
        assert!(!wants_another(&p, two, at("2026-12-02T12:00:00Z")));
    }

    #[test]
    fn the_lowest_slots_keep_their_warm_vms_and_an_old_one_goes() {
        let p = policy(1);
        let noon = at("2026-12-02T12:00:00Z");
        let ready = at("2026-12-02T11:30:00Z");
        let lowest = WarmElsewhere {
            total: 1,
            in_lower_slots: 0,
        };
        assert_eq!(warm_end(&p, ready, lowest, noon), None);
        let above = WarmElsewhere {
            total: 1,
            in_lower_slots: 1,
        };
        assert_eq!(warm_end(&p, ready, above, noon), Some(WarmEnd::NotWanted));
        assert_eq!(
            warm_end(&p, ready, lowest, at("2026-12-02T12:30:00Z")),
            Some(WarmEnd::Expired)
        );
        // Outside the windows even the lowest slot's goes.
        assert_eq!(
            warm_end(&p, ready, lowest, at("2026-12-02T19:00:00Z")),
            Some(WarmEnd::NotWanted)
        );
    }

    #[test]
    fn a_warm_vm_is_unused_only_until_a_runner_is_registered_on_it() {
        let mut s = CycleState::new("c1".into(), at("2026-12-02T12:00:00Z"));
        assert!(!is_unused_warm(&s), "a cycle started for a job");
        s.warm = true;
        assert!(is_unused_warm(&s), "booting");
        s.phase = Phase::Running;
        assert!(is_unused_warm(&s));
        let mut with_reg = s.clone();
        with_reg
            .registrations
            .push(crate::core::state::Registration::intent(
                "r".into(),
                1,
                "h".into(),
                at("2026-12-02T12:00:00Z"),
            ));
        assert!(!is_unused_warm(&with_reg));
        let mut used = s.clone();
        used.jobs_started = 1;
        assert!(!is_unused_warm(&used));
        let mut going = s.clone();
        going.phase = Phase::TearingDown;
        assert!(!is_unused_warm(&going));
    }
}
