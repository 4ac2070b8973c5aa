//! Jobs this pool does not register for again for a while: Forgejo listed them as `waiting`, yet
//! our runner sat idle next to them for `--job-pickup-timeout` without being given them (Forgejo
//! 15 queues a run behind a running one of its concurrency group and still lists its jobs as
//! waiting), or declared labels that do not cover them. A hold outlives the teardown and the cycle (`held-jobs.json` in the state
//! directory), so the pool serves the next waiting job instead of booting VMs for the blocked
//! one; once the hold ends, a later cycle tries the job again. Pure data and decisions; the
//! store reads and writes the file.

use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};

use crate::core::forgejo::Job;
use crate::core::time::Timestamp;

pub const HOLDS_FILE: &str = "held-jobs.json";

pub const HOLDS_VERSION: u32 = 1;

/// The longest one hold lasts, however often the job was tried: a job that can run again is
/// served at most this long after it could.
pub const MAX_HOLD: Duration = Duration::from_secs(3600);

/// Holds kept at most (the oldest go first); each is a job Forgejo lists as waiting.
pub const MAX_HOLDS: usize = 1000;

/// One held job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    pub job_id: i64,
    /// The job attempt's handle: a re-run gets a new one, and is not held.
    pub handle: String,
    /// When our runner last gave up waiting for it.
    pub held_at: Timestamp,
    /// No registration for it before this.
    pub until: Timestamp,
    /// How many times a runner of ours waited for it in vain (each hold is twice the last).
    pub times: u32,
}

/// A waiting job of our labels, and when this slot first saw it waiting: the job's pickup time
/// counts from the pool's earliest sight (`first_seen`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seen {
    pub job_id: i64,
    pub handle: String,
    pub first_seen: Timestamp,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holds {
    pub version: u32,
    pub jobs: Vec<Hold>,
    /// Jobs of our labels this slot has seen waiting, while they wait. Read also from
    /// `others_shares` (the name of an older version).
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        alias = "others_shares"
    )]
    pub seen: Vec<Seen>,
}

impl Default for Holds {
    fn default() -> Holds {
        Holds {
            version: HOLDS_VERSION,
            jobs: Vec::new(),
            seen: Vec::new(),
        }
    }
}

impl Holds {
    /// Nothing held and no waiting job remembered: no file.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty() && self.seen.is_empty()
    }

    /// Remembers when each job in `waiting` (with a handle) was first seen. True when something
    /// was added.
    pub fn note_waiting(&mut self, waiting: &[&Job], now: Timestamp) -> bool {
        let mut added = false;
        for j in waiting {
            if !j.has_handle() || self.seen.iter().any(|s| s.handle == j.handle) {
                continue;
            }
            // Full: the newest wait for room (evicting the oldest would restart the pickup
            // times that are longest already).
            if self.seen.len() >= MAX_HOLDS {
                break;
            }
            self.seen.push(Seen {
                job_id: j.id,
                handle: j.handle.clone(),
                first_seen: now,
            });
            added = true;
        }
        added
    }

    /// The job attempt with this handle is held at `now`.
    pub fn is_held(&self, handle: &str, now: Timestamp) -> bool {
        self.jobs
            .iter()
            .any(|h| h.handle == handle && now < h.until)
    }

    /// Holds the job after our runner was not given it: for `pickup_timeout` the first time,
    /// twice as long each time after, at most [`MAX_HOLD`] (never shorter than
    /// `pickup_timeout`). A job held already is left as it is (a run that died between the hold
    /// and the teardown decides the same again). Returns the hold, and whether it is new.
    pub fn hold(
        &mut self,
        job_id: i64,
        handle: &str,
        pickup_timeout: Duration,
        now: Timestamp,
    ) -> (Hold, bool) {
        if let Some(h) = self
            .jobs
            .iter()
            .find(|h| h.handle == handle && now < h.until)
        {
            return (h.clone(), false);
        }
        let times = self
            .jobs
            .iter()
            .find(|h| h.handle == handle)
            .map_or(1, |h| h.times.saturating_add(1));
        let length = pickup_timeout
            .saturating_mul(1u32 << (times - 1).min(16))
            .min(MAX_HOLD)
            .max(pickup_timeout);
        let hold = Hold {
            job_id,
            handle: handle.to_string(),
            held_at: now,
            until: now.plus(length),
            times,
        };
        self.jobs.retain(|h| h.handle != handle);
        self.jobs.push(hold.clone());
        if self.jobs.len() > MAX_HOLDS {
            self.jobs.sort_by_key(|h| h.held_at);
            let extra = self.jobs.len() - MAX_HOLDS;
            self.jobs.drain(..extra);
        }
        (hold, true)
    }

    /// Forgets the holds of job attempts Forgejo no longer lists (`jobs` is a complete jobs
    /// list: done, cancelled, or re-run under a new handle). True when something changed.
    pub fn prune(&mut self, jobs: &[Job]) -> bool {
        let before = (self.jobs.len(), self.seen.len());
        self.jobs
            .retain(|h| jobs.iter().any(|j| j.handle == h.handle && j.is_live()));
        // A job is remembered while it waits (taken, done or gone: forgotten).
        self.seen
            .retain(|s| jobs.iter().any(|j| j.handle == s.handle && j.is_waiting()));
        (self.jobs.len(), self.seen.len()) != before
    }

    /// When the pool first saw the job attempt `handle` waiting: the earliest of this slot's
    /// sight and the other slots' (`others`, handle to first sight).
    pub fn first_seen(
        &self,
        handle: &str,
        others: &std::collections::BTreeMap<String, Timestamp>,
    ) -> Option<Timestamp> {
        let mine = self
            .seen
            .iter()
            .find(|s| s.handle == handle)
            .map(|s| s.first_seen);
        match (mine, others.get(handle).copied()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The holds in effect at `now`.
    pub fn active(&self, now: Timestamp) -> impl Iterator<Item = &Hold> {
        self.jobs.iter().filter(move |h| now < h.until)
    }
}

/// Why the held jobs could not be read.
#[derive(Debug)]
pub enum HoldsError {
    /// The file could not be read (an I/O error, a permission): it may be fine; left alone.
    Unreadable(String),
    /// The file was read and is not one this build writes (truncated, another version, not a
    /// regular file): it will not get better by itself.
    Unusable(String),
}

impl std::fmt::Display for HoldsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HoldsError::Unreadable(m) | HoldsError::Unusable(m) => f.write_str(m),
        }
    }
}

/// Parses `held-jobs.json`; the caller names the file.
pub fn parse_holds(text: &str) -> Result<Holds> {
    let holds: Holds = serde_json::from_str(text)
        .context("it is not a held-jobs file this build writes (empty or truncated?)")?;
    if holds.version != HOLDS_VERSION {
        return Err(anyhow!(
            "its version {} is not one this build understands (expected {HOLDS_VERSION})",
            holds.version
        ));
    }
    Ok(holds)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: u64 = 60;

    fn job(id: i64, status: &str) -> Job {
        Job {
            id,
            handle: format!("h{id}"),
            status: status.into(),
            runs_on: vec!["debian".into()],
            repo_id: Some(1),
            owner_id: Some(1),
        }
    }

    fn t(min: i64) -> Timestamp {
        Timestamp(1_760_000_000_000 + min * 60_000)
    }

    #[test]
    fn a_hold_doubles_each_time_up_to_an_hour_and_ends() {
        let pickup = Duration::from_secs(10 * MIN);
        let mut h = Holds::default();
        let j = job(7, "waiting");
        let mut now = t(0);
        let mut lengths = Vec::new();
        for _ in 0..5 {
            let (hold, new) = h.hold(j.id, &j.handle, pickup, now);
            assert!(new);
            assert!(h.is_held("h7", now));
            lengths.push(hold.until.since(now).as_secs() / MIN);
            now = hold.until;
            assert!(!h.is_held("h7", now), "a hold ends at its `until`");
        }
        assert_eq!(lengths, vec![10, 20, 40, 60, 60]);
        assert_eq!(h.jobs.len(), 1);
        assert_eq!(h.jobs[0].times, 5);
        // A pickup timeout longer than the cap still holds that long.
        let mut long = Holds::default();
        let (hold, _) = long.hold(j.id, &j.handle, Duration::from_secs(120 * MIN), t(0));
        assert_eq!(hold.until, t(120));
    }

    #[test]
    fn holding_a_held_job_again_changes_nothing() {
        let pickup = Duration::from_secs(10 * MIN);
        let mut h = Holds::default();
        let (first, new) = h.hold(7, "h7", pickup, t(0));
        assert!(new);
        let (again, new) = h.hold(7, "h7", pickup, t(3));
        assert!(!new, "not held anew");
        assert_eq!(first, again);
        assert_eq!(h.jobs.len(), 1);
        assert!(!h.is_held("h8", t(3)), "only that job attempt");
    }

    #[test]
    fn holds_of_jobs_no_longer_listed_are_forgotten() {
        let pickup = Duration::from_secs(10 * MIN);
        let mut h = Holds::default();
        h.hold(7, "h7", pickup, t(0));
        h.hold(8, "h8", pickup, t(0));
        assert!(!h.prune(&[job(7, "waiting"), job(8, "running")]));
        assert!(h.prune(&[job(8, "running")]));
        assert_eq!(h.jobs.iter().map(|j| j.job_id).collect::<Vec<_>>(), [8]);
        assert!(h.prune(&[]));
        assert!(h.jobs.is_empty());
    }

    #[test]
    fn the_file_round_trips_and_refuses_what_it_does_not_know() {
        let mut h = Holds::default();
        h.hold(7, "h7", Duration::from_secs(600), t(0));
        let text = serde_json::to_string(&h).unwrap();
        assert_eq!(parse_holds(&text).unwrap(), h);
        assert!(parse_holds("").is_err());
        assert!(parse_holds(r#"{"version": 2, "jobs": []}"#).is_err());
        assert!(parse_holds(r#"{"version": 1}"#).is_err());
    }

    #[test]
    fn a_waiting_job_is_remembered_from_when_it_was_first_seen_until_it_is_taken() {
        let (mine, other) = (job(4, "waiting"), job(5, "waiting"));
        let mut h = Holds::default();
        assert!(h.note_waiting(&[&mine, &other], t(0)));
        assert!(!h.note_waiting(&[&other], t(1)), "first seen stays");
        assert_eq!(h.seen.len(), 2);
        // Taken (running) or gone: forgotten.
        assert!(h.prune(&[job(5, "running")]));
        assert!(h.is_empty());
    }

    #[test]
    fn a_full_list_of_sightings_keeps_its_oldest() {
        let jobs: Vec<Job> = (0..(MAX_HOLDS as i64 + 10))
            .map(|i| job(2 * i + 1, "waiting"))
            .collect();
        let waiting: Vec<&Job> = jobs.iter().collect();
        let mut h = Holds::default();
        assert!(h.note_waiting(&waiting, t(0)));
        assert_eq!(h.seen.len(), MAX_HOLDS);
        assert!(!h.note_waiting(&waiting, t(1)));
        assert!(h.seen.iter().all(|s| s.first_seen == t(0)));
    }

    #[test]
    fn the_number_of_holds_is_bounded() {
        let mut h = Holds::default();
        for i in 0..(MAX_HOLDS as i64 + 5) {
            h.hold(i, &format!("h{i}"), Duration::from_secs(600), t(i));
        }
        assert_eq!(h.jobs.len(), MAX_HOLDS);
        assert!(
            !h.jobs.iter().any(|j| j.job_id < 5),
            "the oldest went first"
        );
    }

    #[test]
    fn the_pools_first_sight_is_the_earliest_of_every_slots() {
        let mut h = Holds::default();
        let (a, b) = (job(1, "waiting"), job(2, "waiting"));
        let mut no_handle = job(3, "waiting");
        no_handle.handle.clear();
        assert!(h.note_waiting(&[&a, &no_handle], t(5)));
        assert_eq!(h.seen.len(), 1, "a job without a handle is not remembered");
        assert!(h.note_waiting(&[&a, &b], t(7)));
        let mut others = std::collections::BTreeMap::new();
        assert_eq!(h.first_seen("h1", &others), Some(t(5)));
        others.insert("h1".to_string(), t(3));
        others.insert("h2".to_string(), t(9));
        others.insert("h4".to_string(), t(1));
        assert_eq!(
            h.first_seen("h1", &others),
            Some(t(3)),
            "another slot saw it first"
        );
        assert_eq!(h.first_seen("h2", &others), Some(t(7)));
        assert_eq!(h.first_seen("h4", &others), Some(t(1)));
        assert_eq!(h.first_seen("h9", &others), None);
        // A file of an earlier version keeps its sights.
        let old = r#"{"version": 1, "jobs": [], "others_shares": [{"job_id": 1, "handle": "h1", "first_seen": "2026-01-01T00:00:00Z"}]}"#;
        assert_eq!(parse_holds(old).unwrap().seen.len(), 1);
    }
}
