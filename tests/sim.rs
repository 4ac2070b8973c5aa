//! Deterministic simulation of the real cycle code (`cycle::run`, the planner, the sweep)
//! against a simulated Forgejo, tofu, launch command, clock and cycle.json, all driven by one
//! seed: one to three slots on each of one or two hosts, each slot with its own cycle.json,
//! held-jobs.json, lock and VMs, racing against the one Forgejo. Same seed, same trace, byte
//! for byte.
//!
//! - `cargo test --release --test sim -- --nocapture`: `SIM_SEEDS` seeds (default 10,000 in
//!   release, 200 in debug) from `SIM_START` (default 0) on `SIM_THREADS` threads.
//! - `SIM_SEED=1234 cargo test --release --test sim -- --nocapture`: replays one seed and
//!   prints its whole trace.
//!
//! See docs/testing.md, "Deterministic simulation".

#[path = "sim/driver.rs"]
mod driver;
#[path = "sim/ports.rs"]
mod ports;
#[path = "sim/rng.rs"]
mod rng;
#[path = "sim/warm.rs"]
mod warm;
#[path = "sim/world.rs"]
mod world;

use std::time::Instant;

use driver::{quiet_kills, run_seed};
use forgejo_model::rules;
use world::Stats;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
    })
}

/// Step boundaries a large run must have killed the process at (each before and after).
const CRASH_POINTS: &[&str] = &[
    "before load",
    "before load holds",
    "before save(applying)",
    "after save(applying)",
    "before tofu apply",
    "after tofu apply",
    "before save(running)",
    "after save(running)",
    "before tofu output",
    "after tofu output",
    "before GET jobs",
    "after GET jobs",
    "before GET runner",
    "after GET runner",
    "before POST runner",
    "after POST runner",
    "before launch",
    "after launch",
    "before DELETE runner (unconsumed)",
    "after DELETE runner (unconsumed)",
    "before DELETE runner (launch_cut_off)",
    "after DELETE runner (launch_cut_off)",
    "before DELETE runner (launch_failed)",
    "after DELETE runner (launch_failed)",
    "before DELETE runner (teardown)",
    "after DELETE runner (teardown)",
    "before DELETE runner (lost_registration)",
    "after DELETE runner (lost_registration)",
    "before DELETE runner (never_connected)",
    "after DELETE runner (never_connected)",
    "before DELETE runner (pickup_timeout)",
    "after DELETE runner (pickup_timeout)",
    "before DELETE runner (wrong_labels)",
    "after DELETE runner (wrong_labels)",
    "before save(holds)",
    "after save(holds)",
    "before save(tearing_down)",
    "after save(tearing_down)",
    "before tofu destroy",
    "after tofu destroy",
    "before save(destroyed)",
    "after save(destroyed)",
    "before GET runner page",
    "after GET runner page",
    "before save(applying) starting warm",
    "after save(applying) starting warm",
    "before read others",
    "after read others",
    "before DELETE runner (sweep)",
    "after DELETE runner (sweep)",
    "before remove",
    "after remove",
    "sleep",
];

/// Fault kinds a large run must have injected.
const FAULTS: &[&str] = &[
    "api 5xx",
    "api 5xx after applying",
    "api timeout",
    "api applied, answer lost (timeout)",
    "api connection reset",
    "api applied, answer lost (reset)",
    "api HTML error page",
    "api applied, HTML body",
    "api applied, truncated body",
    "api 4xx rejection",
    "api proxy 404 (not Forgejo's)",
    "api POST lands after the client gave up",
    "api odd status/name in rows",
    "tofu apply fails before creating the VM",
    "tofu apply fails after creating the VM",
    "tofu output fails",
    "tofu destroy fails",
    "tofu destroy fails after the VM is gone",
    "launch fails",
    "launch fails after starting the runner",
    "runner never connects",
    "runner connects without taking its job",
    "runner hangs active",
    "runner hangs silent",
    "runner dies after connecting",
    "launch without labels (runner declares none)",
    "VM broken: no runner on it ever connects",
    "job queued behind its concurrency group",
    "cycle.json read fails",
    "cycle.json write fails",
    "cycle.json remove fails",
    "held-jobs.json read fails",
    "held-jobs.json write fails",
    "another slot's cycle.json read fails",
    "stop signal (SIGTERM)",
    "process paused past its lease (SIGSTOP)",
];

/// World events (Forgejo's clean-ups, runner processes) a large run must have seen.
const EVENTS: &[&str] = &[
    world::EV_ENDLESS,
    world::EV_ENDLESS_PERSISTENT,
    world::EV_CANCEL,
    world::EV_RELEASED,
    world::EV_TAKEN_BY_OTHER,
    world::EV_POLLS_ON,
    world::EV_WOKEN,
    world::EV_ORPHAN,
    world::EV_STOPPED,
    world::EV_RERUN,
    world::EV_SIGTERM_TASK,
];

#[test]
fn simulation() {
    quiet_kills();
    if let Some(seed) = env_u64("SIM_SEED") {
        let out = run_seed(seed, 0, true, true);
        if let Some(v) = out.violation {
            panic!("{v}");
        }
        println!(
            "seed {seed}: converged, no invariant violated (trace hash {:016x})",
            out.hash
        );
        return;
    }
    let seeds = env_u64("SIM_SEEDS").unwrap_or(if cfg!(debug_assertions) { 200 } else { 10_000 });
    let start = env_u64("SIM_START").unwrap_or(0);
    let threads = env_u64("SIM_THREADS")
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get() as u64))
        .max(1);
    let clock = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|k| {
            std::thread::spawn(move || {
                let mut stats = Stats::default();
                let mut failures = Vec::new();
                let mut seed = start + k;
                while seed < start + seeds {
                    // Without trace lines: the run is the same, and a failing seed is run
                    // again with them for its report.
                    let out = run_seed(seed, 0, false, false);
                    stats.merge(&out.stats);
                    if let Some(v) = out.violation
                        && failures.len() < 3
                    {
                        let again = run_seed(seed, 60, true, false);
                        let same = if again.violation.as_ref() == Some(&v) {
                            String::new()
                        } else {
                            format!(
                                "\n  NOT DETERMINISTIC: traced again it gave {:?}",
                                again.violation
                            )
                        };
                        failures.push(format!("{v}{same}\n  last steps:\n{}", again.tail));
                    }
                    seed += threads;
                }
                (stats, failures)
            })
        })
        .collect();
    let mut stats = Stats::default();
    let mut failures = Vec::new();
    for h in handles {
        let (s, f) = h.join().expect("a simulation thread panicked");
        stats.merge(&s);
        failures.extend(f);
    }
    let secs = clock.elapsed().as_secs_f64();
    println!(
        "simulation: {} seeds from {start} on {threads} thread(s) in {secs:.1}s = {:.0} seeds/s",
        stats.seeds,
        stats.seeds as f64 / secs
    );
    println!(
        "  {} invocations, {} steps, {} VMs created, {} jobs run by our runners, {} racing invocations refused by cycle.lock",
        stats.invocations, stats.steps, stats.vms_created, stats.jobs_served, stats.races_refused
    );
    println!("  seeds by hosts and slots:");
    for (k, v) in &stats.topologies {
        println!("    {v:>9}  {k}");
    }
    println!(
        "  runs of a slot nested in another's: {} at an instant, {} while it waited; claims refused (another slot held the job): {}; registrations a sweep spared: {} too young by their name, {} held by another slot",
        stats.slot_runs_nested,
        stats.slot_runs_nested_waiting,
        stats.claims_refused,
        stats.spared_young,
        stats.spared_held
    );
    println!(
        "  failure backoff: {} broken-pool seed(s) (every start fails), {} cycle starts (of warm VMs: {} checked against its bound once a job was tried on them or they failed, {} torn down unused, not counted); {} new cycles refused while backing off",
        stats.broken_pools,
        stats.broken_pool_starts,
        stats.broken_pool_warm_starts,
        stats.broken_pool_warm_renewals,
        stats.backed_off
    );
    println!(
        "  warm capacity: {} seed(s) with --warm >= 1 ({} keeping it while quiet); {} warm VMs started, {} taken by a job, {} torn down unused (too old), {} (not wanted); at most {} unused in one pool at once, {} left at rest; {} runs ended at a wait on one (SIGHUP)",
        stats.warm_seeds,
        stats.warm_quiet_keeps,
        stats.warm_starts,
        stats.warm_used,
        stats.warm_expired,
        stats.warm_not_wanted,
        stats.warm_most,
        stats.warm_at_rest,
        stats.warm_reloads
    );
    println!(
        "  pool across hosts (--store pg): {} cycles adopted from a host whose lease lapsed, {} runs fenced after their cycle was adopted",
        stats.adoptions, stats.fenced
    );
    println!(
        "  faults injected: {} in total",
        stats.faults.values().sum::<u64>()
    );
    for (k, v) in &stats.faults {
        println!("    {v:>9}  {k}");
    }
    println!("  world events:");
    for (k, v) in &stats.events {
        println!("    {v:>9}  {k}");
    }
    println!(
        "  waits next to an unserved job checked: {}; longest past its bound's start: {} ms (allowed {} ms)",
        stats.not_served_waits,
        stats.not_served_longest_ms,
        world::POLL_MS + world::NOT_SERVED_SLACK_MS
    );
    println!(
        "  quiet runs a seed needed to come to rest, at most: {} (of {})",
        stats.quiet_runs_max,
        driver::MAX_QUIET_RUNS
    );
    println!(
        "  process killed: {} times at {} distinct step boundaries",
        stats.crashes.values().sum::<u64>(),
        stats.crashes.len()
    );
    for (k, v) in &stats.crashes {
        println!("    {v:>9}  {k}");
    }
    println!("  deletions by reason:");
    for (k, v) in &stats.deletes {
        println!("    {v:>9}  {k}");
    }
    println!("  of which runners whose launch exited 0 and that never connected:");
    for (k, v) in &stats.never_connected_deleted {
        println!("    {v:>9}  {k}");
    }
    if !failures.is_empty() {
        for f in &failures {
            eprintln!("\n{f}");
        }
        panic!(
            "{} seed(s) shown above violated an invariant; replay one with the command it prints",
            failures.len()
        );
    }
    if stats.seeds >= 10_000 {
        let missing: Vec<&&str> = CRASH_POINTS
            .iter()
            .filter(|p| !stats.crashes.contains_key(**p))
            .collect();
        assert!(
            missing.is_empty(),
            "{} seeds never killed the process at {missing:?}",
            stats.seeds
        );
        let missing: Vec<&&str> = FAULTS
            .iter()
            .filter(|f| !stats.faults.contains_key(**f))
            .collect();
        assert!(
            missing.is_empty(),
            "{} seeds never injected {missing:?}",
            stats.seeds
        );
        let missing: Vec<&&str> = EVENTS
            .iter()
            .filter(|e| !stats.events.contains_key(**e))
            .collect();
        assert!(
            missing.is_empty(),
            "{} seeds never saw {missing:?}",
            stats.seeds
        );
        assert!(stats.races_refused > 0, "no racing invocation was tried");
        assert!(
            stats.adoptions > 0 && stats.fenced > 0,
            "no cycle of a pool across hosts was adopted ({}) or no run fenced ({})",
            stats.adoptions,
            stats.fenced
        );
        assert!(
            stats.broken_pool_starts > 0 && stats.backed_off > 0,
            "the failure backoff was never exercised ({} broken-pool starts, {} refused)",
            stats.broken_pool_starts,
            stats.backed_off
        );
        assert!(
            stats.warm_used > 0
                && stats.warm_expired > 0
                && stats.warm_not_wanted > 0
                && stats.warm_at_rest > 1
                && stats.warm_most > 1,
            "warm VMs were never taken by a job ({}), torn down too old ({}) or not wanted ({}), nor were two kept at rest ({}) or up at once in a pool ({})",
            stats.warm_used,
            stats.warm_expired,
            stats.warm_not_wanted,
            stats.warm_at_rest,
            stats.warm_most
        );
        assert!(
            stats.slot_runs_nested > 0 && stats.claims_refused > 0 && stats.spared_held > 0,
            "slots never ran nested ({}), never had a claim refused ({}) or a sweep never spared another slot's registration ({})",
            stats.slot_runs_nested,
            stats.claims_refused,
            stats.spared_held
        );
    }
}

/// Same seed, same trace: the whole run is a function of the seed.
#[test]
fn same_seed_same_trace() {
    quiet_kills();
    let mut hashes = Vec::new();
    for seed in 0..12u64 {
        let a = run_seed(seed, 0, true, false);
        let b = run_seed(seed, 0, true, false);
        assert_eq!(a.hash, b.hash, "seed {seed} ran differently twice");
        assert_eq!(a.stats.steps, b.stats.steps, "seed {seed}");
        let untraced = run_seed(seed, 0, false, false);
        assert_eq!(
            untraced.stats.steps, a.stats.steps,
            "seed {seed}: tracing changed the run"
        );
        assert_eq!(untraced.violation, a.violation, "seed {seed}");
        hashes.push(a.hash);
    }
    hashes.sort_unstable();
    hashes.dedup();
    assert_eq!(
        hashes.len(),
        12,
        "different seeds must explore different runs"
    );
}

/// A world for a targeted regression test: seed 1, traced, no faults, no job arrivals.
fn quiet_world() -> std::rc::Rc<std::cell::RefCell<world::Sim>> {
    quiet_kills();
    let mut sim = world::Sim::new(1, 200, true, false);
    sim.faults_on = false;
    sim.arrivals_on = false;
    std::rc::Rc::new(std::cell::RefCell::new(sim))
}

/// Regression (found by seed 6209): a lost POST was forgotten because the runner list that
/// should have shown it had its row without a name. A nameless row may be it: keep the intent.
#[test]
fn a_lost_post_is_not_forgotten_when_a_listed_row_has_no_name() {
    use ci_ephemeral_provisioner::core::state::CycleState;
    use ci_ephemeral_provisioner::core::state::Phase;
    use ci_ephemeral_provisioner::core::state::Registration;
    use ci_ephemeral_provisioner::core::time::Timestamp;

    let sim = quiet_world();
    let name = format!("{}c1-1", world::PREFIX);
    {
        let mut s = sim.borrow_mut();
        let now = s.now;
        let mut st = CycleState::new("c1".into(), Timestamp(now - 600_000));
        st.runner_prefix = world::PREFIX.into();
        st.phase = Phase::Running;
        st.vm_ready_at = Some(Timestamp(now - 500_000));
        st.registrations.push(Registration::intent(
            name.clone(),
            1,
            "h".into(),
            Timestamp(now - 300_000),
        ));
        s.write_disk(0, &st);
        s.create_vm(0, "c1");
        let id = s.srv_register(0, &name);
        s.nameless.push(id);
    }
    driver::invoke(&sim, 0, world::Started::Timer);
    let s = sim.borrow();
    assert!(
        s.violation.is_none(),
        "{:?}\n{}",
        s.violation,
        s.trace_tail()
    );
    let kept = s.slots[0]
        .disk
        .as_ref()
        .is_some_and(|(_, st)| st.registrations.iter().any(|r| r.name == name));
    assert!(
        kept,
        "the unanswered registration was forgotten:\n{}",
        s.trace_tail()
    );
}

/// Regression (found with `SIM_RANDOM_TIES=1`, seeds 7, 9, 34, 36, 60, 63 of the first 400):
/// with ties in a new order on every request, two pages overlapped and skipped rows on every
/// read, so a lost POST's lookup never had a complete list, the cycle stayed in `destroyed` for
/// good and no job was served again. The list is now read again when the pages overlapped while
/// the count held.
#[test]
fn pages_in_no_stable_order_still_converge() {
    quiet_kills();
    for seed in [7, 9, 34, 36, 60, 63] {
        let out = driver::run_seed_with(seed, 60, true, false, |s| s.random_ties = true);
        assert!(out.violation.is_none(), "{:?}\n{}", out.violation, out.tail);
    }
}

/// The world gives jobs out by Forgejo's rule: every case of `rules::CASES`, run through
/// the world's own runners, jobs and `task_for` (and the rule itself against the table).
#[test]
fn the_world_assigns_jobs_by_forgejos_rule() {
    use world::Owner;

    rules::check_rule_against_the_table();
    for c in rules::CASES {
        let mut s = world::Sim::new(1, 0, false, false);
        s.faults_on = false;
        s.arrivals_on = false;
        let job = s.new_job(c.job_runs_on);
        let other = s.new_job(&[world::LABEL]);
        let runner = s.add_runner(format!("{}t-1", world::PREFIX), Owner::Ours, true);
        // The launch's RUNNER_LABELS, as the world's runner processes declare them.
        s.declare(runner, rules::names(c.runner_labels));
        s.forgejo.runners.get_mut(&runner).expect("added").repo_id = match c.same_repo {
            None => 0,
            Some(true) => 7,
            Some(false) => 8,
        };
        let other_handle = s.forgejo.jobs[&other].handle.clone();
        if c.ephemeral_with_task {
            // Its task ran the other job (`HasTaskForRunner`).
            let o = s.forgejo.jobs.get_mut(&other).expect("added");
            o.status = "success".into();
            o.runner_id = Some(runner);
        } else {
            s.forgejo.jobs.remove(&other);
        }
        let j = s.forgejo.jobs.get_mut(&job).expect("added");
        j.repo_id = 7;
        j.queued_behind = c.queued_behind;
        j.status = c.job_status.to_string();
        if c.job_status == "running" {
            j.task_id = 1;
            j.runner_id = Some(1);
        }
        let handle = j.handle.clone();
        let asks = match c.with_handle {
            None => None,
            Some(true) => Some(handle.as_str()),
            Some(false) => Some(other_handle.as_str()),
        };
        let given = s.task_for(runner, asks);
        assert!(
            given.is_none() || given == Some(job),
            "{}: given job {given:?}, not the case's",
            c.what
        );
        assert_eq!(given == Some(job), c.taken, "{}", c.what);
    }
}

/// Found by the simulation (seed 447, once the broken-VM invariant stopped excusing a DELETE
/// whose answer was lost), fixed: a runner whose launch exited 0 never connects; past the grace
/// its registration is deleted (`never_connected`, a failed start). When Forgejo applied that
/// DELETE but its answer was lost (a reset, a 5xx after applying, a timeout; or the run was
/// killed before it recorded the deletion), the next round read the registration's 404 as "it
/// ran its job" (`Step::Forget` reset `start_failures` for a launched registration), so the
/// failed start counted as a success and a broken VM got up to `--max-jobs-per-vm` starts. Now
/// the failed start is counted and recorded (`failed_start`) before the DELETE is sent.
#[test]
fn a_never_connected_runner_whose_delete_answer_was_lost_is_still_a_failed_start() {
    use ci_ephemeral_provisioner::core::planner::MAX_START_FAILURES;
    use ci_ephemeral_provisioner::core::state::CycleState;
    use ci_ephemeral_provisioner::core::state::Launch;
    use ci_ephemeral_provisioner::core::state::Phase;
    use ci_ephemeral_provisioner::core::state::Registration;
    use ci_ephemeral_provisioner::core::time::Timestamp;

    let sim = quiet_world();
    let name = format!("{}c1-3", world::PREFIX);
    {
        let mut s = sim.borrow_mut();
        s.max_jobs = 6;
        let now = s.now;
        let job = s.new_job(&[world::LABEL]);
        // Another waiting job: a VM taken for sound would register a runner for it.
        s.new_job(&[world::LABEL]);
        let handle = s.forgejo.jobs[&job].handle.clone();
        s.create_vm(0, "c1");
        let id = s.srv_register(0, &name);
        let mut st = CycleState::new("c1".into(), Timestamp(now - 20 * 60_000));
        st.runner_prefix = world::PREFIX.into();
        st.phase = Phase::Running;
        st.vm_ready_at = Some(Timestamp(now - 18 * 60_000));
        st.free_since = st.vm_ready_at;
        st.next_seq = 4;
        // Two runners before it never connected; it is the third.
        st.jobs_started = 3;
        st.start_failures = MAX_START_FAILURES - 1;
        st.registrations.push(Registration {
            name: name.clone(),
            id: Some(id),
            uuid: None,
            job_id: job,
            job_handle: handle,
            requested_at: Timestamp(now - 4 * 60_000),
            launch: Launch::Done,
            launched_at: Some(Timestamp(now - 4 * 60_000)),
            job_gone_since: None,
            connected: false,
            busy: false,
            not_served: None,
            failed_start: false,
            stopped: None,
            job_first_seen: None,
        });
        s.write_disk(0, &st);
        s.forced_faults.push((
            "DELETE runner (never_connected)".into(),
            world::ApiFault::ResetApplied,
        ));
    }
    driver::invoke(&sim, 0, world::Started::Timer);
    let s = sim.borrow();
    assert!(
        s.violation.is_none(),
        "{:?}\n{}",
        s.violation,
        s.trace_tail()
    );
    let ours = s
        .forgejo
        .runners
        .values()
        .filter(|r| r.extra == world::Owner::Ours)
        .count();
    assert_eq!(
        ours,
        1,
        "the third never-connected start was counted as a success: another runner was registered on the broken VM\n{}",
        s.trace_tail()
    );
}
