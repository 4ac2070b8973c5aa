//! What a sweep spares although the gate lets it go: a registration another slot of the pool
//! holds, and one whose name shows it was created less than [`sweep_min_age`] ago (its owner,
//! on this host or another, may still be starting it).

use std::collections::BTreeSet;
use std::time::Duration;

use crate::core::time::Timestamp;

/// Added to a registration's own deadlines before a sweep may judge it: Forgejo marks a runner
/// offline 60 s after its last contact, and clocks of hosts differ a little.
pub const SWEEP_AGE_MARGIN: Duration = Duration::from_secs(60);

/// The name of a registration created at `at`: `<prefix><cycle id>-<n>-<compact time>`. The
/// time lets any sweep (another slot's, another host's) tell that it is too young to judge.
pub fn registration_name(prefix: &str, cycle_id: &str, seq: u32, at: Timestamp) -> String {
    format!("{prefix}{cycle_id}-{seq}-{}", at.compact())
}

/// When a registration was created, from its name: `Some(Ok(t))` for a name of
/// [`registration_name`]'s form, `None` for a name without a time (its age is not judged),
/// `Some(Err(()))` for a last part shaped like a time that is none (never judged).
pub fn registered_at(name: &str) -> Option<Result<Timestamp, ()>> {
    let last = name.rsplit('-').next()?;
    let b = last.as_bytes();
    let shaped = b.len() == 16
        && b[8] == b't'
        && b[15] == b'z'
        && b[..8].iter().chain(&b[9..15]).all(u8::is_ascii_digit);
    if !shaped {
        return None;
    }
    let rfc = format!(
        "{}-{}-{}T{}:{}:{}Z",
        &last[0..4],
        &last[4..6],
        &last[6..8],
        &last[9..11],
        &last[11..13],
        &last[13..15]
    );
    Some(Timestamp::parse_rfc3339(&rfc).map_err(|_| ()))
}

/// How old a registration must be before a sweep may delete it: its owner may still be starting
/// it until the POST has settled (`intent_settle`), the launch command has had its time and the
/// runner its registration grace to connect; plus [`SWEEP_AGE_MARGIN`].
pub fn sweep_min_age(
    registration_grace: Duration,
    launch_timeout: Duration,
    intent_settle: Duration,
) -> Duration {
    registration_grace
        .saturating_add(launch_timeout)
        .saturating_add(intent_settle)
        .saturating_add(SWEEP_AGE_MARGIN)
}

/// Why the sweep leaves a registration alone although it passed the deletion gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spared {
    /// Its name shows it was created less than the minimum age ago (or a little in the future:
    /// clocks differ): its owner may still be starting it.
    TooYoung,
    /// Another slot of this pool holds it in its cycle.json.
    HeldByAnotherSlot,
    /// The time in its name cannot be read, or lies further in the future than clocks differ
    /// ([`SWEEP_AGE_MARGIN`]): doubt, reported as such.
    DoubtfulTime,
}

/// What a sweep must spare, and when it runs.
#[derive(Clone, Debug)]
pub struct SweepGuard {
    pub now: Timestamp,
    pub min_age: Duration,
    /// Names held by the other slots, read after the listing.
    pub held: BTreeSet<String>,
}

impl SweepGuard {
    /// Pure: whether (and why) the sweep spares the registration called `name`.
    pub fn spares(&self, name: &str) -> Option<Spared> {
        if self.held.contains(name) {
            return Some(Spared::HeldByAnotherSlot);
        }
        match registered_at(name) {
            None => None,
            Some(Err(())) => Some(Spared::DoubtfulTime),
            Some(Ok(t)) if t > self.now.plus(SWEEP_AGE_MARGIN) => Some(Spared::DoubtfulTime),
            Some(Ok(t)) if self.now.since(t) < self.min_age => Some(Spared::TooYoung),
            Some(Ok(_)) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: &str) -> Timestamp {
        Timestamp::parse_rfc3339(s).unwrap()
    }

    #[test]
    fn a_name_carries_its_time_and_gives_it_back() {
        let at = ts("2026-12-01T20:10:57Z");
        let name = registration_name("ephemeral-", "20261201t201000z-ab12", 3, at);
        assert_eq!(name, "ephemeral-20261201t201000z-ab12-3-20261201t201057z");
        assert_eq!(registered_at(&name), Some(Ok(at)));
        // A name without a time: its last part is the sequence number.
        assert_eq!(registered_at("ephemeral-20261201t201000z-ab12-3"), None);
        assert_eq!(registered_at("ephemeral-20261301t201057z"), Some(Err(())));
    }

    #[test]
    fn the_guard_spares_the_young_and_the_held_and_no_one_else() {
        let now = ts("2026-12-01T21:00:00Z");
        let g = SweepGuard {
            now,
            min_age: Duration::from_secs(420),
            held: ["ephemeral-held-1".to_string()].into(),
        };
        let at = |secs_ago: u64| {
            registration_name(
                "ephemeral-",
                "c",
                1,
                Timestamp(now.0 - secs_ago as i64 * 1000),
            )
        };
        assert_eq!(g.spares(&at(419)), Some(Spared::TooYoung));
        assert_eq!(g.spares(&at(0)), Some(Spared::TooYoung));
        assert_eq!(
            g.spares(&registration_name(
                "e-",
                "c",
                1,
                now.plus(Duration::from_secs(5))
            )),
            Some(Spared::TooYoung)
        );
        assert_eq!(g.spares(&at(420)), None);
        assert_eq!(
            g.spares("ephemeral-held-1"),
            Some(Spared::HeldByAnotherSlot)
        );
        assert_eq!(g.spares("ephemeral-20261201t201000z-ab12-3"), None);
        assert_eq!(
            g.spares("ephemeral-c-1-20269999t999999z"),
            Some(Spared::DoubtfulTime)
        );
        // Further ahead than clocks differ: doubt, not youth.
        let ahead = |secs| registration_name("e-", "c", 1, now.plus(Duration::from_secs(secs)));
        assert_eq!(g.spares(&ahead(60)), Some(Spared::TooYoung));
        assert_eq!(g.spares(&ahead(61)), Some(Spared::DoubtfulTime));
        assert_eq!(g.spares(&ahead(86_400)), Some(Spared::DoubtfulTime));
    }
}
