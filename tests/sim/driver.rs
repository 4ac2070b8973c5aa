//! Runs one seed: invocations of the real `cycle::run` (as the systemd timers of the seed's slots
//! would start them), killed and restarted from what their cycle.json holds, raced by a second
//! invocation, interleaved with runs of the other slots, until the faulty period ends; then the
//! world goes quiet and the runs of every slot must converge to rest.

use std::cell::RefCell;
use std::panic::{self, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::Once;
use std::time::Duration;

use ci_ephemeral_provisioner::adapters::files::{StateDirError, lock_state_dir};
use ci_ephemeral_provisioner::core::backoff::BackoffPolicy;
use ci_ephemeral_provisioner::core::planner::Policy;
use ci_ephemeral_provisioner::core::planner::ReuseWithin;
use ci_ephemeral_provisioner::core::report::Report;
use ci_ephemeral_provisioner::core::time::Timestamp;
use ci_ephemeral_provisioner::core::warm::WarmPolicy;
use ci_ephemeral_provisioner::driver::cycle;
use ci_ephemeral_provisioner::driver::cycle::CycleConfig;
use ci_ephemeral_provisioner::driver::cycle::End;
use ci_ephemeral_provisioner::driver::cycle::World;

use super::ports::{
    Killed, Livelock, Port, Shared, SimClock, SimForgejo, SimLauncher, SimStore, SimTofu,
};
use super::world::{
    HTTP_TIMEOUT_MS, Invocation, LABEL, PICKUP_MS, POLL_MS, Sim, Started, Stats, T0,
};

const MIN: i64 = 60_000;
/// Timer runs during the faulty period, at most.
const MAX_FAULTY_RUNS: u32 = 60;
/// Runs after the world went quiet before the seed counts as not converging. At least a minute
/// apart, so at least 150 minutes: a job held just before the world went quiet (a hold lasts at
/// most `holds::MAX_HOLD`, one hour, and one can still begin up to a pickup timeout into the
/// quiet period) is served by a cycle that starts once it ends; that cycle needs about 20
/// minutes (apply, launch, the job, the idle timeout, the destroy, the sweep).
pub const MAX_QUIET_RUNS: u32 = 150;
/// Consecutive runs that must end at rest.
const AT_REST_RUNS: u32 = 3;

thread_local! {
    /// The state directories whose `cycle.lock` the invocations take, one per slot (per test
    /// thread; made as seeds need them).
    static LOCK_DIRS: RefCell<Vec<tempfile::TempDir>> = const { RefCell::new(Vec::new()) };
}

/// Takes slot `slot`'s `cycle.lock`, as `run` does.
fn lock_slot(slot: usize) -> Result<impl Sized + use<>, StateDirError> {
    LOCK_DIRS.with(|d| {
        let mut d = d.borrow_mut();
        while d.len() <= slot {
            d.push(tempfile::tempdir().expect("a temporary directory"));
        }
        lock_state_dir(d[slot].path())
    })
}

/// The configuration every simulated invocation runs with (short durations keep seeds cheap;
/// the decisions are the same as with the defaults). `--max-jobs-per-vm` is the seed's: 3, or 6
/// (more than `MAX_START_FAILURES`, so that the broken-VM rule is not hidden by the job cap);
/// the prefix and `--warm` (with its max age and windows) are the host's.
pub fn config(max_jobs: u32, prefix: &str, slot: u32, warm: WarmPolicy) -> CycleConfig {
    let m = |n: u64| Duration::from_secs(60 * n);
    CycleConfig {
        policy: Policy {
            runner_prefix: prefix.into(),
            label_names: vec![LABEL.into()],
            max_jobs_per_vm: max_jobs,
            idle_timeout: m(3),
            registration_grace: m(3),
            max_cycle_duration: m(40),
            hard_deadline: m(60),
            intent_settle: Duration::from_millis(2 * HTTP_TIMEOUT_MS as u64),
            job_pickup_timeout: Duration::from_millis(PICKUP_MS as u64),
            sweep_min_age: Duration::from_secs(420),
            reuse_within: ReuseWithin::Repo,
            warm,
        },
        poll_interval: Duration::from_millis(POLL_MS as u64),
        labels: format!("{LABEL}:host"),
        forgejo_url: "https://forgejo.sim".into(),
        sweep_max_deletions: 50,
        host: String::new(),
        slot,
        backoff: BACKOFF,
        wake: Default::default(),
    }
}

/// The failure backoff of every simulated pool: `--max-failed-cycles 3`, a first backoff of 10m
/// (longer than the default 2m: the timer runs of a seed are up to 3 minutes apart, and a shorter
/// backoff would bound nothing the timer does not bound already), at most 40m (so that seeds
/// converge within `MAX_QUIET_RUNS`).
pub const BACKOFF: BackoffPolicy = BackoffPolicy {
    max_failed_cycles: 3,
    initial: Duration::from_secs(600),
    max: Duration::from_secs(2400),
};

/// Simulated SIGKILLs and livelocks unwind silently; real panics still print.
pub fn quiet_kills() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let p = info.payload();
            if p.is::<Killed>() || p.is::<Livelock>() {
                return;
            }
            previous(info)
        }));
    });
}

/// A second invocation of `slot` while one runs (a manual run, a second timer): it must be
/// refused by `cycle.lock`; if it were not, it would run for real against the same world.
pub fn race(sim: &Shared, slot: usize, instant: bool) {
    invoke_with(sim, slot, Started::Race, instant);
}

/// A run of `slot` (whose process is not running) while another slot's run is at a step
/// boundary: the two slots' processes at once, as their timers start them; `instant`: see
/// `Invocation::instant`.
pub fn nested(sim: &Shared, slot: usize, instant: bool) {
    invoke_with(sim, slot, Started::Nested, instant);
}

/// One process of `slot`: take the slot's lock as `run` does, then the real `cycle::run`.
pub fn invoke(sim: &Shared, slot: usize, started: Started) {
    invoke_with(sim, slot, started, false);
}

fn invoke_with(sim: &Shared, slot: usize, started: Started, instant: bool) {
    let race = started == Started::Race;
    let mut lock = lock_slot(slot);
    // A timer run is never raced in the simulation, yet once in a million seeds the kernel
    // reported the lock of the previous, closed run as still held; try again as systemd would.
    for _ in 0..50 {
        if race || lock.is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        lock = lock_slot(slot);
    }
    let lock = match lock {
        Ok(l) => l,
        Err(e) => {
            let mut s = sim.borrow_mut();
            if race && matches!(e, StateDirError::Locked(_)) {
                s.stats.races_refused += 1;
                s.log(format!("second invocation refused by cycle.lock: {e}"));
            } else if race {
                // Only another holder may refuse a racing run; anything else is a broken lock.
                s.violate(format!("a racing run could not take cycle.lock: {e}"));
            } else {
                let who = s.slot_name(slot);
                s.violate(format!(
                    "a {} run of {who} could not take its cycle.lock: {e}",
                    if started == Started::Nested {
                        "nested"
                    } else {
                        "timer"
                    }
                ));
            }
            return;
        }
    };
    let (inv, cfg) = {
        let mut s = sim.borrow_mut();
        let now = s.now;
        let warm = s.hosts[s.slots[slot].host].warm.clone();
        s.invs.push(Invocation {
            slot,
            started,
            instant,
            started_at: now,
            warm,
            ..Invocation::default()
        });
        s.stats.invocations += 1;
        let h = s.slots[slot].host;
        s.renew(h);
        if started == Started::Nested && instant {
            s.stats.slot_runs_nested += 1;
        } else if started == Started::Nested {
            s.stats.slot_runs_nested_waiting += 1;
        }
        let inv = s.invs.len() - 1;
        s.stack.push(inv);
        let who = if s.slots.len() > 1 {
            format!(" ({})", s.slot_name(slot))
        } else {
            String::new()
        };
        s.log(format!(
            "invocation {inv}{who} starts{}",
            match started {
                Started::Timer => "",
                Started::Race => " (racing the running one)",
                Started::Nested if instant => " (nested, at an instant of another slot's run)",
                Started::Nested => " (nested, while another slot's run waits)",
            }
        ));
        let host = &s.hosts[s.slots[slot].host];
        let mut cfg = config(s.max_jobs, host.prefix, s.slots[slot].k, host.warm.clone());
        if host.pg {
            cfg.host = format!("h{}", s.slots[slot].host + 1);
        }
        (inv, cfg)
    };
    let port = Port {
        sim: sim.clone(),
        inv,
    };
    let mut forgejo = SimForgejo(port.clone());
    let mut tofu = SimTofu(port.clone());
    let mut launcher = SimLauncher(port.clone());
    let mut store = SimStore(port.clone());
    let mut clock = SimClock(port);
    let mut report = Report::new("run", false, Timestamp(sim.borrow().now));
    let sim_time = Rc::clone(sim);
    report.set_clock(Box::new(move || Timestamp(sim_time.borrow().now)));
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        let mut world = World {
            forgejo: &mut forgejo,
            tofu: &mut tofu,
            launcher: &mut launcher,
            store: &mut store,
            clock: &mut clock,
        };
        cycle::run(&mut world, &cfg, &mut report)
    }));
    drop(lock);
    let mut s = sim.borrow_mut();
    s.stack.pop();
    // Its lease was renewed until it ended (or died).
    let h = s.slots[slot].host;
    if !s.invs[inv].fenced {
        s.renew(h);
    }
    if started == Started::Nested && !instant {
        // The runs it interrupted did not see Forgejo meanwhile (the invariant on waits next
        // to an unserved job counts from now for them, as after an API fault).
        let now = s.now;
        for i in s.stack.clone() {
            s.invs[i].last_fault_at = now;
        }
    }
    if let Some(sw) = &report.sweep {
        s.stats.spared_young += sw.spared_young.len() as u64;
        s.stats.spared_held += sw.spared_held.len() as u64;
    }
    match result {
        Ok(end) => {
            s.log(format!(
                "invocation {inv} ends: {} ({} failure(s))",
                report.outcome,
                report.failures.len() as u64 + report.failures_not_listed
            ));
            for f in report.failures.iter().take(4) {
                s.log(format!("  error: {f}"));
            }
            if let End::Config(m) = end {
                s.violate(format!("configuration error: {m}"));
            }
        }
        Err(p) => {
            if p.is::<Killed>() {
                s.log(format!("invocation {inv} killed"));
            } else if let Some(Livelock(m)) = p.downcast_ref::<Livelock>() {
                s.violate(m.clone());
            } else {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|m| m.to_string()))
                    .unwrap_or_default();
                s.violate(format!("the driver panicked: {msg}"));
            }
        }
    }
}

pub struct SeedOutcome {
    pub violation: Option<String>,
    pub tail: String,
    pub hash: u64,
    pub stats: Stats,
}

fn gap(sim: &Shared, lo: i64, hi: i64) {
    let mut s = sim.borrow_mut();
    let to = s.now + s.rng.range(lo, hi);
    s.advance(to, true);
}

pub fn run_seed(seed: u64, trace_cap: usize, tracing: bool, echo: bool) -> SeedOutcome {
    run_seed_with(seed, trace_cap, tracing, echo, |_| {})
}

/// `run_seed` with the world adjusted before the first run.
pub fn run_seed_with(
    seed: u64,
    trace_cap: usize,
    tracing: bool,
    echo: bool,
    adjust: impl FnOnce(&mut Sim),
) -> SeedOutcome {
    let sim: Shared = Rc::new(RefCell::new(Sim::new(seed, trace_cap, tracing, echo)));
    adjust(&mut sim.borrow_mut());
    let fault_end = {
        let mut s = sim.borrow_mut();
        let cfg = s.cfg;
        let topology = s.topology();
        s.log(format!("seed {seed}: {topology}; {cfg:?}"));
        if !s.warm.policies.is_empty() {
            let plan = format!("{:?}", s.warm);
            s.log(format!("warm capacity: {plan}"));
        }
        T0 + s.rng.range(20 * MIN, 120 * MIN)
    };
    let n_slots = sim.borrow().slots.len();
    let mut runs = 0;
    while sim.borrow().violation.is_none() && sim.borrow().now < fault_end && runs < MAX_FAULTY_RUNS
    {
        // The timer of some slot fires (with nothing else running: other slots' runs start
        // nested, at this run's step boundaries).
        {
            // The pool's --warm changes (the role's SIGHUP: runs started from now have it).
            let mut s = sim.borrow_mut();
            if let Some((at, count)) = s.warm.change
                && s.now >= at
            {
                s.warm.change = None;
                s.hosts[0].warm.count = count;
                s.log(format!("host 1's --warm is {count} from now"));
            }
        }
        let slot = if n_slots == 1 {
            0
        } else {
            sim.borrow_mut().rng.below(n_slots as u64) as usize
        };
        // A dead host's timers do not fire (`--store pg`: its lease lapses).
        let dead = {
            let s = sim.borrow();
            s.dead(s.slots[slot].host)
        };
        if !dead {
            invoke(&sim, slot, Started::Timer);
        }
        runs += 1;
        gap(&sim, 30_000, 3 * MIN);
    }
    sim.borrow_mut().go_quiet();
    let mut at_rest = 0;
    let mut quiet_runs = 0;
    // The host whose slots' timers fire first in a round.
    let mut first = 0;
    while sim.borrow().violation.is_none() && at_rest < AT_REST_RUNS && quiet_runs < MAX_QUIET_RUNS
    {
        // Every slot's timer fires once a minute.
        let order: Vec<usize> = {
            let s = sim.borrow();
            let n = s.hosts.len();
            // A host dead for good stays so; one dead for a while is back.
            (0..n)
                .map(|h| (first + h) % n)
                .filter(|h| s.hosts[*h].dead.is_none_or(|(_, until)| until.is_some()))
                .flat_map(|h| s.hosts[h].slots.clone())
                .collect()
        };
        for slot in order {
            invoke(&sim, slot, Started::Timer);
        }
        quiet_runs += 1;
        gap(&sim, MIN, MIN + 1);
        let left = sim.borrow().leftovers();
        match left {
            None => at_rest += 1,
            Some(_) => at_rest = 0,
        }
        // A host that has not swept since its registrations leaked (another host took the one
        // last job) gets a job of its own: its slots' timers fire first next round.
        if let Some(h) = sim.borrow_mut().host_left_behind() {
            first = h;
        }
    }
    let mut s = sim.borrow_mut();
    s.stats.quiet_runs_max = quiet_runs.saturating_sub(AT_REST_RUNS);
    let kept = (0..n_slots).filter(|&k| s.kept_warm_at_rest(k)).count() as u32;
    s.stats.warm_at_rest = kept;
    if s.violation.is_none()
        && let Some(left) = s.leftovers()
    {
        s.violate(format!("not at rest after {quiet_runs} quiet runs: {left}"));
    }
    s.log("end");
    SeedOutcome {
        violation: s.violation.clone(),
        tail: s.trace_tail(),
        hash: s.trace_hash,
        stats: s.stats.clone(),
    }
}
