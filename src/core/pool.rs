//! One pool across hosts (`--store pg`): what the hosts of a pool agree on through PostgreSQL,
//! as data and decisions. A host renews its lease (on the database's clock); a cycle whose
//! owner's lease lapsed is adopted by a live host under a new epoch and torn down; every write of
//! a cycle is conditional on its epoch, so a process whose cycle was adopted is fenced: it makes
//! no further side effect. The store (`adapters::pg_store`) does the I/O.

use std::fmt;
use std::time::Duration;

use crate::core::state::{CycleState, Phase};

/// The shortest `--lease`: a renewal every third of it must not flood the database.
pub const MIN_LEASE: Duration = Duration::from_secs(3);

/// How often a running process renews its host's lease: a third of it, so that two renewals
/// may fail before it lapses.
pub fn renew_every(lease: Duration) -> Duration {
    lease / 3
}

/// A host id (`--host-id`, default the host name) or a pool name (`--pool`): 1 to 63 of
/// `a-z`, `A-Z`, `0-9`, `-`, `_`, `.`.
pub fn check_name(what: &str, s: &str) -> Result<(), String> {
    let ok = (1..=63).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {s:?} is not a name this tool accepts: 1 to 63 of letters, digits, '-', '_' and '.'"
        ))
    }
}

/// The tofu workspace of a cycle of a pool: derived from the pool and the cycle, not from the
/// host, so that any host of the pool can address it (adopt and destroy it).
pub fn workspace(pool: &str, cycle_id: &str) -> String {
    format!("{pool}-{cycle_id}")
}

/// The cycle whose workspace `ws` is, when it is one of `pool`'s (`status --remote`): the rest
/// after `POOL-` has a cycle id's time (`20261201t201057z`), so that pool `a` never reads pool
/// `a-b`'s workspaces as its own.
pub fn cycle_of_workspace<'a>(pool: &str, ws: &'a str) -> Option<&'a str> {
    let rest = ws.strip_prefix(pool)?.strip_prefix('-')?;
    let b = rest.as_bytes();
    let timed = b.len() > 16
        && b[..8].iter().all(u8::is_ascii_digit)
        && b[8] == b't'
        && b[9..15].iter().all(u8::is_ascii_digit)
        && b[15] == b'z';
    timed.then_some(rest)
}

/// How the slot of one host is named in messages (`slot 2 of host b`).
pub fn slot_name(host: &str, me: &str, k: u32) -> String {
    if host == me {
        format!("slot {k}")
    } else {
        format!("slot {k} of host {host}")
    }
}

/// Why a process stops: its cycle was adopted by another host (a new epoch), or its host id is
/// held by another machine. Every write of the cycle was refused; nothing further is done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fenced {
    pub cycle_id: String,
    /// The host that holds the cycle now (adopted it), if known.
    pub by: Option<String>,
    /// When, as the database says.
    pub at: Option<String>,
}

impl fmt::Display for Fenced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cycle {} was adopted by host {} {}(this host's lease had lapsed): this process makes no further change and exits; the adopting host tears the cycle down",
            self.cycle_id,
            self.by.as_deref().unwrap_or("(unknown: the cycle is gone)"),
            self.at
                .as_deref()
                .map(|a| format!("at {a} "))
                .unwrap_or_default()
        )
    }
}

impl std::error::Error for Fenced {}

/// A cycle this run adopted: whose it was, and when that host's lease lapsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adoption {
    pub cycle_id: String,
    pub from_host: String,
    pub from_slot: u32,
    pub lapsed_at: String,
}

impl Adoption {
    pub fn describe(&self) -> String {
        format!(
            "adopted cycle {} of slot {} of host {}, whose lease lapsed at {}: tearing it down",
            self.cycle_id, self.from_slot, self.from_host, self.lapsed_at
        )
    }
}

/// The state an adopted cycle continues with: whatever it was doing, it is torn down now (the
/// rules a restart follows: delete what is provably dead, destroy, sweep, forget). A cycle
/// already tearing down or destroyed goes on as it was.
pub fn adopted_state(mut state: CycleState, a: &Adoption) -> CycleState {
    if matches!(state.phase, Phase::Applying | Phase::Running) {
        state.phase = Phase::TearingDown;
        state.teardown_reason = Some(format!(
            "adopted from host {}, whose lease lapsed at {}",
            a.from_host, a.lapsed_at
        ));
    }
    state
}

/// The job attempts a cycle claims (`core::claims`): each registration's whose runner took no
/// job yet, and the job it was started for while it may still register. `None` as the handle:
/// every attempt of the job (a claim written without a handle).
pub fn claims_of(state: &CycleState) -> Vec<(i64, Option<String>)> {
    let mut out: Vec<(i64, Option<String>)> = state
        .registrations
        .iter()
        .filter(|r| !r.busy)
        .map(|r| (r.job_id, Some(r.job_handle.clone())))
        .collect();
    if let Some(job) = state.claim
        && matches!(state.phase, Phase::Applying | Phase::Running)
    {
        out.push((job, state.claim_handle.clone()));
    }
    out.sort();
    out.dedup();
    out
}

/// One host of the pool as `status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct HostView {
    pub host_id: String,
    /// Seconds since its last renewal, on the database's clock.
    pub renewed_seconds_ago: i64,
    /// Its lease has lapsed: its cycles are any live host's to adopt.
    pub lapsed: bool,
    /// Its cycles: `slot K: cycle C (phase)`.
    pub cycles: Vec<String>,
}

/// What a run or `status` learned of the pool: its hosts and its recent adoptions and fenced runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolView {
    pub pool: String,
    pub hosts: Vec<HostView>,
    /// Recent events, newest first: `adopted`, `fenced`.
    pub events: Vec<String>,
    /// The pool's failure backoff, as read.
    #[serde(skip)]
    pub backoff: Option<crate::core::backoff::Backoff>,
}

impl PoolView {
    /// Hosts whose lease has lapsed while they still own a cycle: an alert.
    pub fn lapsed_with_cycles(&self) -> u32 {
        self.hosts
            .iter()
            .filter(|h| h.lapsed && !h.cycles.is_empty())
            .count() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::state::Registration;
    use crate::core::time::Timestamp;

    // Mutation caught: a plain prefix match, which reads pool `a-b`'s VMs as pool `a`'s.
    #[test]
    fn a_workspace_is_a_pools_only_with_a_cycle_id_after_its_name() {
        let ws = workspace("a", "20261201t201057z-1a2b");
        assert_eq!(cycle_of_workspace("a", &ws), Some("20261201t201057z-1a2b"));
        assert_eq!(
            cycle_of_workspace("a-b", &workspace("a-b", "20261201t201057z-1a2b-s2")),
            Some("20261201t201057z-1a2b-s2")
        );
        for (pool, ws) in [
            ("a", "a-b-20261201t201057z-1a2b"),
            ("a", "default"),
            ("a", "a-"),
            ("a", "ab-20261201t201057z-1a2b"),
            ("a", "a-20261201x201057z-1a2b"),
        ] {
            assert_eq!(cycle_of_workspace(pool, ws), None, "{pool} {ws}");
        }
    }

    #[test]
    fn names_and_workspaces() {
        assert!(check_name("--pool", "debian").is_ok());
        assert!(check_name("--host-id", "runner-host.1").is_ok());
        for bad in ["", "a b", "x/y", &"a".repeat(64), "é"] {
            assert!(check_name("--pool", bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            workspace("debian", "20261201t201057z-1a2b"),
            "debian-20261201t201057z-1a2b"
        );
        assert_eq!(
            renew_every(Duration::from_secs(120)),
            Duration::from_secs(40)
        );
    }

    /// An adopted cycle is torn down whatever it was doing; one tearing down goes on.
    // Mutation caught: adopted_state keeps the phase of a running cycle.
    #[test]
    fn an_adopted_cycle_is_torn_down() {
        let a = Adoption {
            cycle_id: "c".into(),
            from_host: "a".into(),
            from_slot: 1,
            lapsed_at: "2026-12-01 20:00:00+00".into(),
        };
        let mut s = CycleState::new("c".into(), Timestamp(0));
        s.phase = Phase::Running;
        let t = adopted_state(s.clone(), &a);
        assert_eq!(t.phase, Phase::TearingDown);
        assert!(t.teardown_reason.unwrap().contains("adopted from host a"));
        s.phase = Phase::Destroyed;
        assert_eq!(adopted_state(s, &a).phase, Phase::Destroyed);
    }

    #[test]
    fn a_cycle_claims_its_registrations_jobs_and_its_start_job() {
        let mut s = CycleState::new("c".into(), Timestamp(0));
        s.claim = Some(7);
        s.claim_handle = Some("h7".into());
        s.registrations.push(Registration::intent(
            "p-c-1".into(),
            5,
            "h5".into(),
            Timestamp(0),
        ));
        assert_eq!(
            claims_of(&s),
            [(5, Some("h5".into())), (7, Some("h7".into()))]
        );
        s.registrations[0].busy = true;
        s.phase = Phase::TearingDown;
        assert!(claims_of(&s).is_empty());
    }

    #[test]
    fn fenced_names_the_adopting_host() {
        let f = Fenced {
            cycle_id: "c1".into(),
            by: Some("b".into()),
            at: Some("t".into()),
        };
        let m = f.to_string();
        assert!(
            m.contains("adopted by host b") && m.contains("no further change"),
            "{m}"
        );
    }
}
