//! Parallel slots of one pool: what the other slots hold (their claims on jobs and their
//! registrations' names), and when a registration is too young for a sweep to judge.
//!
//! Each slot runs the single-VM cycle with its own cycle.json. A slot claims a job attempt in its
//! cycle.json before it registers for it (the intent, or the job a new cycle is started for),
//! under the pool's claims lock; the claim is released when that registration is forgotten, and
//! a slot whose cycle.json is gone claims nothing. A claim (and a hold) names the attempt by its
//! handle: a rerun gives the job a new attempt and a new handle (Forgejo v15.0.3
//! `models/actions/run_job.go` `PrepareNextAttempt`, called by `services/actions/rerun.go` once
//! the attempt before is done), which no claim on the earlier attempt covers, and a runner
//! started for the earlier handle is never given the new one (`IsRequestedByRunner`). A sweep spares what another slot holds and any
//! registration whose name shows it was created less than [`sweep_min_age`] ago.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::core::state::{CycleState, Phase};
use crate::core::time::Timestamp;

/// Most slots one pool may have.
pub const MAX_SLOTS: u32 = 64;

/// Added to a registration's own deadlines before a sweep may judge it: Forgejo marks a runner
/// offline 60 s after its last contact, and clocks of hosts differ a little.
pub const SWEEP_AGE_MARGIN: Duration = Duration::from_secs(60);

/// The directory name of slot `k` (≥ 2) inside the pool's state directory; slot 1 keeps its files
/// in the state directory itself, as a pool without slots always did.
pub fn slot_dir_name(k: u32) -> Option<String> {
    (k >= 2).then(|| format!("slot-{k}"))
}

/// The slot number of a directory named by [`slot_dir_name`].
pub fn parse_slot_dir_name(name: &str) -> Option<u32> {
    let n = name.strip_prefix("slot-")?;
    if n.starts_with('0') || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok().filter(|k| *k >= 2)
}

/// The job attempts this slot leaves alone: claimed or held by another slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claimed {
    /// Attempts, by handle.
    pub handles: BTreeSet<String>,
    /// Every attempt of these jobs: the job a cycle was started for, recorded by a version that
    /// did not write its handle (`CycleState::claim` without `claim_handle`).
    pub jobs: BTreeSet<i64>,
}

impl Claimed {
    /// Whether the attempt `handle` of job `job_id` is claimed or held.
    pub fn covers(&self, job_id: i64, handle: &str) -> bool {
        self.handles.contains(handle) || self.jobs.contains(&job_id)
    }
}

/// What the other slots of this pool hold, read from their cycle.json files.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Others {
    /// Job attempts (handles) another slot registered for (or is about to), or started its cycle
    /// for: which slot.
    pub claimed: BTreeMap<String, String>,
    /// Jobs another slot started its cycle for, recorded without the attempt's handle (a
    /// cycle.json of an earlier version): every attempt of them is that slot's.
    pub claimed_any_attempt: BTreeMap<i64, String>,
    /// Names of every registration in another slot's cycle.json, intents included.
    pub names: BTreeSet<String>,
    /// Job attempts (handles) another slot holds in its `held-jobs.json` (Forgejo did not give
    /// them to its runner), and until when: not served here either until the hold ends.
    pub held: Vec<(String, Timestamp)>,
    /// Slots beyond `--slots` whose cycle is still in progress, each said in words: its VM and
    /// registrations stay until that slot runs again.
    pub beyond: Vec<String>,
    /// The slots (numbers) whose cycle is an unused warm VM (`core::warm::is_unused_warm`).
    pub warm: BTreeSet<u32>,
    /// When another slot first saw each waiting job attempt (by handle), the earliest of them
    /// (their `held-jobs.json`): where the pool's pickup time of a job starts.
    pub first_seen: BTreeMap<String, Timestamp>,
}

impl Others {
    /// Adds what the cycle of slot `k` (`slot`: its name, for messages) holds.
    pub fn add(&mut self, k: u32, slot: &str, state: &CycleState) {
        if crate::core::warm::is_unused_warm(state) {
            self.warm.insert(k);
        }
        for r in &state.registrations {
            // A runner that took a job claims none: the job it was registered for, if it still
            // waits, will go to another runner.
            if !r.busy {
                self.claimed.insert(r.job_handle.clone(), slot.to_string());
            }
            self.names.insert(r.name.clone());
        }
        // The job a cycle was started for, until its first registration: only while the cycle
        // may still register (a cycle being torn down starts no runner).
        if let Some(job) = state.claim
            && matches!(state.phase, Phase::Applying | Phase::Running)
        {
            match &state.claim_handle {
                Some(handle) => self.claimed.insert(handle.clone(), slot.to_string()),
                None => self.claimed_any_attempt.insert(job, slot.to_string()),
            };
        }
    }

    /// The other slots' unused warm VMs, as slot `me` counts them.
    pub fn warm_elsewhere(&self, me: u32) -> crate::core::warm::WarmElsewhere {
        crate::core::warm::WarmElsewhere {
            total: self.warm.len() as u32,
            in_lower_slots: self.warm.range(..me.max(1)).count() as u32,
        }
    }

    /// Adds another slot's sights of waiting jobs, keeping the earliest of each.
    pub fn add_seen(&mut self, seen: &[crate::core::holds::Seen]) {
        for s in seen {
            self.first_seen
                .entry(s.handle.clone())
                .and_modify(|t| *t = (*t).min(s.first_seen))
                .or_insert(s.first_seen);
        }
    }

    /// The slot that claims the attempt `handle` of job `job_id`, if one does.
    pub fn claimant(&self, job_id: i64, handle: &str) -> Option<&String> {
        self.claimed
            .get(handle)
            .or_else(|| self.claimed_any_attempt.get(&job_id))
    }

    /// The job attempts this slot leaves alone at `now`: claimed by another slot, or held by one.
    pub fn claimed(&self, now: Timestamp) -> Claimed {
        let held = self.held.iter().filter(|(_, until)| now < *until);
        Claimed {
            handles: self
                .claimed
                .keys()
                .cloned()
                .chain(held.map(|(handle, _)| handle.clone()))
                .collect(),
            jobs: self.claimed_any_attempt.keys().copied().collect(),
        }
    }
}

/// The name of a registration created at `at`: `<prefix><cycle id>-<n>-<compact time>`. The
/// time lets any sweep (another slot's, another host's) tell that it is too young to judge.
pub fn registration_name(prefix: &str, cycle_id: &str, seq: u32, at: Timestamp) -> String {
    format!("{prefix}{cycle_id}-{seq}-{}", at.compact())
}

/// When a registration was created, from its name: `Some(Ok(t))` for a name of
/// [`registration_name`]'s form, `None` for a name without a time (from before names carried
/// one), `Some(Err(()))` for a last part shaped like a time that is none (never judged).
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
    use crate::core::state::Registration;

    fn ts(s: &str) -> Timestamp {
        Timestamp::parse_rfc3339(s).unwrap()
    }

    #[test]
    fn a_name_carries_its_time_and_gives_it_back() {
        let at = ts("2026-12-01T20:10:57Z");
        let name = registration_name("ephemeral-", "20261201t201000z-ab12", 3, at);
        assert_eq!(name, "ephemeral-20261201t201000z-ab12-3-20261201t201057z");
        assert_eq!(registered_at(&name), Some(Ok(at)));
        // A name from before: its last part is the sequence number.
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

    fn handles(c: &Claimed) -> Vec<&str> {
        c.handles.iter().map(String::as_str).collect()
    }

    #[test]
    fn other_slots_claim_their_registrations_jobs_and_a_starting_cycles_job() {
        let now = ts("2026-12-01T21:00:00Z");
        let mut s = CycleState::new("c1".into(), now);
        s.claim = Some(7);
        s.claim_handle = Some("h7".into());
        s.registrations
            .push(Registration::intent("p-c1-1-x".into(), 5, "h5".into(), now));
        let mut o = Others::default();
        o.add(2, "slot 2", &s);
        assert_eq!(handles(&o.claimed(now)), ["h5", "h7"]);
        assert_eq!(o.names, ["p-c1-1-x".to_string()].into());
        // A claim is on the attempt: a rerun of job 5 (a new handle) is not claimed.
        assert!(o.claimed(now).covers(5, "h5"));
        assert!(!o.claimed(now).covers(5, "h5-rerun"));
        assert_eq!(o.claimant(5, "h5").map(String::as_str), Some("slot 2"));
        assert_eq!(o.claimant(5, "h5-rerun"), None);
        // A start claim of an earlier version (no handle) covers every attempt of its job.
        s.claim_handle = None;
        let mut o = Others::default();
        o.add(2, "slot 2", &s);
        assert!(o.claimed(now).covers(7, "any"));
        assert_eq!(o.claimant(7, "any").map(String::as_str), Some("slot 2"));
        // Torn down: the job it started for is free; its registration still holds its job.
        s.phase = Phase::TearingDown;
        let mut o = Others::default();
        o.add(2, "slot 2", &s);
        assert_eq!(handles(&o.claimed(now)), ["h5"]);
        assert!(o.claimed(now).jobs.is_empty());
        // A runner that took a job (any job) claims none; its name is still held.
        s.registrations[0].busy = true;
        let mut o = Others::default();
        o.add(2, "slot 2", &s);
        assert_eq!(o.claimed(now), Default::default());
        assert_eq!(o.names.len(), 1);
        // Another slot's hold counts until it ends, for that attempt.
        o.held
            .push(("h9".into(), now.plus(Duration::from_secs(60))));
        assert_eq!(handles(&o.claimed(now)), ["h9"]);
        assert!(!o.claimed(now).covers(9, "h9-rerun"));
        assert_eq!(
            o.claimed(now.plus(Duration::from_secs(60))),
            Default::default()
        );
    }

    #[test]
    fn slot_directories_round_trip() {
        assert_eq!(slot_dir_name(1), None);
        assert_eq!(slot_dir_name(2).as_deref(), Some("slot-2"));
        assert_eq!(parse_slot_dir_name("slot-12"), Some(12));
        for bad in [
            "slot-1", "slot-0", "slot-02", "slot-", "slot-x", "slots-2", "slot-2a",
        ] {
            assert_eq!(parse_slot_dir_name(bad), None, "{bad}");
        }
    }
}
