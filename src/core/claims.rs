//! What the other slots of a pool hold: their claims on job attempts, their holds, their
//! registrations' names and their unused warm VMs, read from their cycle.json files.
//!
//! A slot claims a job attempt in its cycle.json before it registers for it (the intent, or the
//! job a new cycle is started for), under the pool's claims lock; the claim is released when
//! that registration is forgotten, and a slot whose cycle.json is gone claims nothing. A claim
//! (and a hold) names the attempt by its handle: a rerun gives the job a new attempt and a new
//! handle (Forgejo v15.0.3 `models/actions/run_job.go` `PrepareNextAttempt`, called by
//! `services/actions/rerun.go` once the attempt before is done), which no claim on the earlier
//! attempt covers, and a runner started for the earlier handle is never given the new one
//! (`IsRequestedByRunner`).

use std::collections::{BTreeMap, BTreeSet};

use crate::core::state::CycleState;
use crate::core::time::Timestamp;

/// The job attempts this slot leaves alone: claimed or held by another slot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claimed {
    /// Attempts, by handle.
    pub handles: BTreeSet<String>,
    /// Every attempt of these jobs: the job a cycle was started for, recorded without its handle
    /// (`CycleState::claim` without `claim_handle`).
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
    /// Jobs another slot started its cycle for, recorded without the attempt's handle: every
    /// attempt of them is that slot's.
    pub claimed_any_attempt: BTreeMap<i64, String>,
    /// Names of every registration in another slot's cycle.json, intents included.
    pub names: BTreeSet<String>,
    /// Job attempts (handles) another slot holds in its `held-jobs.json` (Forgejo did not give
    /// them to its runner), and until when: not served here either until the hold ends.
    pub held: Vec<(String, Timestamp)>,
    /// Slots beyond `--slots` whose cycle is still in progress, each said in words: its VM and
    /// registrations stay until that slot runs again.
    pub beyond: Vec<String>,
    /// The slots (number, host; `""` for this host with the files store) whose cycle is an
    /// unused warm VM (`core::warm::is_unused_warm`).
    pub warm: BTreeSet<(u32, String)>,
    /// When another slot first saw each waiting job attempt (by handle), the earliest of them
    /// (their `held-jobs.json`): where the pool's pickup time of a job starts.
    pub first_seen: BTreeMap<String, Timestamp>,
}

impl Others {
    /// Adds what the cycle of slot `k` of host `host` (`""`: this host, with the files store;
    /// `slot`: its name, for messages) holds.
    pub fn add(&mut self, k: u32, host: &str, slot: &str, state: &CycleState) {
        if crate::core::warm::is_unused_warm(state) {
            self.warm.insert((k, host.to_string()));
        }
        for r in &state.registrations {
            self.names.insert(r.name.clone());
        }
        // A runner that took a job claims none (its job, if it still waits, goes to another
        // runner); the job a cycle was started for is claimed only while it may still register.
        for (job, handle) in crate::core::pool::claims_of(state) {
            match handle {
                Some(h) => self.claimed.insert(h, slot.to_string()),
                None => self.claimed_any_attempt.insert(job, slot.to_string()),
            };
        }
    }

    /// The other slots' unused warm VMs, as slot `me` of host `host` counts them: the slots
    /// below it are those of a lower number, or of the same number on a host that sorts first.
    pub fn warm_elsewhere(&self, me: u32, host: &str) -> crate::core::warm::WarmElsewhere {
        crate::core::warm::WarmElsewhere {
            total: self.warm.len() as u32,
            in_lower_slots: self.warm.range(..(me.max(1), host.to_string())).count() as u32,
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::core::state::{Phase, Registration};

    fn ts(s: &str) -> Timestamp {
        Timestamp::parse_rfc3339(s).unwrap()
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
        o.add(2, "", "slot 2", &s);
        assert_eq!(handles(&o.claimed(now)), ["h5", "h7"]);
        assert_eq!(o.names, ["p-c1-1-x".to_string()].into());
        // A claim is on the attempt: a rerun of job 5 (a new handle) is not claimed.
        assert!(o.claimed(now).covers(5, "h5"));
        assert!(!o.claimed(now).covers(5, "h5-rerun"));
        assert_eq!(o.claimant(5, "h5").map(String::as_str), Some("slot 2"));
        assert_eq!(o.claimant(5, "h5-rerun"), None);
        // A start claim without a handle covers every attempt of its job.
        s.claim_handle = None;
        let mut o = Others::default();
        o.add(2, "", "slot 2", &s);
        assert!(o.claimed(now).covers(7, "any"));
        assert_eq!(o.claimant(7, "any").map(String::as_str), Some("slot 2"));
        // Torn down: the job it started for is free; its registration still holds its job.
        s.phase = Phase::TearingDown;
        let mut o = Others::default();
        o.add(2, "", "slot 2", &s);
        assert_eq!(handles(&o.claimed(now)), ["h5"]);
        assert!(o.claimed(now).jobs.is_empty());
        // A runner that took a job (any job) claims none; its name is still held.
        s.registrations[0].busy = true;
        let mut o = Others::default();
        o.add(2, "", "slot 2", &s);
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
}
