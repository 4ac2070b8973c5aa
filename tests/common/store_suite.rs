//! The state stores' conformance suite, written once: what every `StateStore` must do (the
//! files store of one host, the pool store on PostgreSQL, the simulation's model of it). Each
//! store's test calls these with a factory of its own: `make(host, k, n)` is the store of slot
//! `k` of `n` of host `host` (the files store has one host: its factory ignores `host`).
#![allow(dead_code)]

use std::time::Duration;

use ci_ephemeral_provisioner::core::backoff::{BackoffPolicy, Change, CycleOutcome, FailureReason};
use ci_ephemeral_provisioner::core::holds::Holds;
use ci_ephemeral_provisioner::core::ports::{BackoffGate, Claim, Start, StateStore};
use ci_ephemeral_provisioner::core::state::{CycleState, Phase, Registration};
use ci_ephemeral_provisioner::core::time::Timestamp;

pub type Make<'a> = &'a dyn Fn(&str, u32, u32) -> Box<dyn StateStore>;

pub const NOW: Timestamp = Timestamp(1_765_000_000_000);

pub fn gate(max_failed_cycles: u32) -> BackoffGate {
    BackoffGate {
        policy: BackoffPolicy {
            max_failed_cycles,
            initial: Duration::from_secs(600),
            max: Duration::from_secs(3600),
        },
        slot: 1,
        now: NOW,
    }
}

/// A new cycle for job `job` (attempt `h{job}`).
pub fn cycle(id: &str, job: i64) -> CycleState {
    let mut s = CycleState::new(id.into(), NOW);
    s.claim = Some(job);
    s.claim_handle = Some(format!("h{job}"));
    s
}

fn start(store: &mut dyn StateStore, s: &CycleState, job: i64) -> Start {
    store
        .save_starting(s, job, &format!("h{job}"), &gate(0))
        .unwrap()
}

/// A cycle is stored from its start on, written again as it goes, and gone once removed.
// Mutation caught: a store whose save keeps the first state it was given.
pub fn a_cycle_round_trips(make: Make<'_>) {
    let mut a = make("a", 1, 1);
    assert_eq!(a.load().unwrap(), None);
    let mut s = cycle("c1", 5);
    assert_eq!(start(&mut *a, &s, 5), Start::Claim(Claim::Saved));
    s.phase = Phase::Running;
    s.registrations
        .push(Registration::intent("p-c1-1-x".into(), 5, "h5".into(), NOW));
    a.save(&s).unwrap();
    drop(a);
    let mut a = make("a", 1, 1);
    assert_eq!(a.load().unwrap(), Some(s));
    a.remove().unwrap();
    drop(a);
    assert_eq!(make("a", 1, 1).load().unwrap(), None);
}

/// One job attempt, one claim: refused to every other slot (of this host or another) with
/// nothing written for it, another attempt of the job free, and free again once forgotten.
pub fn a_claim_is_refused_to_every_other_slot(make: Make<'_>, hosts: &[&str]) {
    let mut one = make(hosts[0], 1, 2);
    one.load().unwrap();
    let mut s1 = cycle("c1", 5);
    assert_eq!(start(&mut *one, &s1, 5), Start::Claim(Claim::Saved));
    for (host, k) in hosts.iter().map(|h| (*h, 2)).chain([(hosts[0], 2)]) {
        let mut other = make(host, k, 2);
        other.load().unwrap();
        let s2 = cycle(&format!("c2{host}"), 5);
        match start(&mut *other, &s2, 5) {
            Start::Claim(Claim::HeldBy(by)) => assert!(by.contains("slot 1"), "{by}"),
            got => panic!("slot {k} of host {host} claimed a job slot 1 holds: {got:?}"),
        }
        drop(other);
        let mut other = make(host, k, 2);
        assert_eq!(
            other.load().unwrap(),
            None,
            "nothing written for a refused claim"
        );
        // Another attempt (a rerun: a new handle) is free.
        let rerun = CycleState {
            claim_handle: Some("h5-rerun".into()),
            ..cycle(&format!("c3{host}"), 5)
        };
        assert_eq!(
            other
                .save_starting(&rerun, 5, "h5-rerun", &gate(0))
                .unwrap(),
            Start::Claim(Claim::Saved)
        );
        other.remove().unwrap();
    }
    // Slot 1's runner took a job (busy): it claims none any more.
    s1.phase = Phase::Running;
    s1.claim = None;
    s1.claim_handle = None;
    let mut r = Registration::intent("p-c1-1-x".into(), 5, "h5".into(), NOW);
    r.busy = true;
    s1.registrations.push(r);
    one.save(&s1).unwrap();
    let mut two = make(hosts[hosts.len() - 1], 2, 2);
    two.load().unwrap();
    assert_eq!(
        start(&mut *two, &cycle("c4", 5), 5),
        Start::Claim(Claim::Saved)
    );
    two.remove().unwrap();
    one.remove().unwrap();
}

/// What another slot holds is seen: its claims, its registrations' names (the sweep spares
/// them), its holds.
// Mutation caught: others() that reads no other slot.
pub fn another_slots_claims_names_and_holds_are_seen(make: Make<'_>, other_host: &str) {
    let mut one = make("a", 1, 2);
    one.load().unwrap();
    let mut s = cycle("c1", 7);
    assert_eq!(start(&mut *one, &s, 7), Start::Claim(Claim::Saved));
    s.phase = Phase::Running;
    s.registrations
        .push(Registration::intent("p-c1-1-y".into(), 8, "h8".into(), NOW));
    one.save(&s).unwrap();
    let mut holds = Holds::default();
    holds.hold(9, "h9", Duration::from_secs(600), NOW);
    one.save_holds(&holds).unwrap();
    assert_eq!(one.load_holds().unwrap(), holds);
    let mut two = make(other_host, 2, 2);
    two.load().unwrap();
    let o = two.others().unwrap();
    let claimed = o.claimed(NOW);
    assert!(claimed.covers(7, "h7") && claimed.covers(8, "h8"), "{o:?}");
    assert!(claimed.covers(9, "h9"), "another slot's hold: {o:?}");
    assert!(o.names.contains("p-c1-1-y"), "{o:?}");
    one.save_holds(&Holds::default()).unwrap();
    one.remove().unwrap();
    let o = two.others().unwrap();
    assert!(
        o.claimed(NOW).handles.is_empty() && o.names.is_empty(),
        "{o:?}"
    );
}

/// The pool's failure backoff: N failed cycles close the gate for every slot; a cycle counted
/// once however often its outcome is recorded; a served one resets it.
// Mutation caught: record_outcome that counts a cycle again.
pub fn the_failure_backoff_is_the_pools(make: Make<'_>, other_host: &str) {
    let g = gate(2);
    for (i, host) in ["a", other_host].iter().enumerate() {
        let mut st = make(host, 1, 1);
        st.load().unwrap();
        let s = cycle(&format!("f{i}"), 100 + i as i64);
        assert_eq!(
            st.save_starting(&s, 100 + i as i64, &format!("h{}", 100 + i), &g)
                .unwrap(),
            Start::Claim(Claim::Saved)
        );
        let failed = CycleOutcome::Failed(FailureReason::ApplyFailed);
        let (_, first) = st.record_outcome(&g, &s.cycle_id, failed).unwrap();
        assert_ne!(first, Change::Unchanged);
        let (b, again) = st.record_outcome(&g, &s.cycle_id, failed).unwrap();
        assert_eq!(again, Change::Unchanged, "counted twice");
        assert_eq!(b.consecutive_failed_cycles, i as u32 + 1);
        st.remove().unwrap();
    }
    let mut st = make("a", 1, 1);
    st.load().unwrap();
    match st
        .save_starting(&cycle("f9", 109), 109, "h109", &g)
        .unwrap()
    {
        Start::BackingOff(c) => assert_eq!(c.failures, 2),
        got => panic!("the gate is open after 2 failed cycles of the pool: {got:?}"),
    }
    assert_eq!(
        st.load().unwrap(),
        None,
        "nothing written while backing off"
    );
}

/// Slots racing for one job attempt: exactly one claims it, round after round (each thread a
/// process of its own, with its own store).
// Mutation caught: a claim that does not exclude a concurrent one.
pub fn of_slots_racing_for_one_job_exactly_one_claims_it(
    make: &(dyn Fn(&str, u32, u32) -> Box<dyn StateStore + Send> + Sync),
    hosts: &[&str],
    rounds: i64,
) {
    for round in 0..rounds {
        let barrier = std::sync::Barrier::new(4);
        let saved = std::thread::scope(|scope| {
            let handles: Vec<_> = (1..=4u32)
                .map(|k| {
                    let barrier = &barrier;
                    let host = hosts[k as usize % hosts.len()];
                    scope.spawn(move || {
                        let mut st = make(host, k, 4);
                        st.load().unwrap();
                        let s = cycle(&format!("r{round}-{host}-{k}"), 1000 + round);
                        barrier.wait();
                        let got = start(&mut *st, &s, 1000 + round);
                        (got == Start::Claim(Claim::Saved), st)
                    })
                })
                .collect();
            // Every thread done before a winner's cycle goes (its claim with it).
            let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            let mut saved = 0;
            for (won, mut st) in results {
                if won {
                    saved += 1;
                    st.remove().unwrap();
                }
            }
            saved
        });
        assert_eq!(
            saved, 1,
            "round {round}: {saved} slots claimed one job attempt"
        );
    }
}
