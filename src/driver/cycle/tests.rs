//! The driver against the tests' model of Forgejo (`crate::test_forgejo`) and a tofu that
//! always works (the end-to-end tests use the real binary).
use super::*;
use crate::adapters::dry::MemoryStore;
use crate::core::ports::{Claim, ProcessCheck, StepError};
use crate::test_forgejo::ModelForgejo;

struct NoopTofu;

impl Tofu for NoopTofu {
    fn check_config(&self) -> anyhow::Result<()> {
        Ok(())
    }
    fn apply(&mut self, _: &str) -> Result<(), StepError> {
        Ok(())
    }
    fn outputs(&mut self, _: &str) -> Result<Outputs, StepError> {
        Ok(Outputs::new())
    }
    fn destroy(&mut self, _: &str, _: &str) -> Result<(), StepError> {
        Ok(())
    }
}

fn test_config() -> CycleConfig {
    CycleConfig {
        policy: Policy {
            runner_prefix: "ephemeral-".into(),
            label_names: vec!["debian".into()],
            max_jobs_per_vm: 100_000,
            idle_timeout: Duration::from_secs(60),
            registration_grace: Duration::from_secs(60),
            max_cycle_duration: Duration::from_secs(3600),
            hard_deadline: Duration::from_secs(7200),
            intent_settle: Duration::from_secs(10),
            job_pickup_timeout: Duration::from_secs(600),
            sweep_min_age: Duration::from_secs(420),
            reuse_within: crate::core::planner::ReuseWithin::Repo,
            warm: Default::default(),
        },
        poll_interval: Duration::from_secs(5),
        labels: "debian".into(),
        forgejo_url: "https://forgejo.invalid".into(),
        sweep_max_deletions: 50,
        host: String::new(),
        slot: 1,
        backoff: BackoffPolicy {
            max_failed_cycles: 3,
            initial: Duration::from_secs(120),
            max: Duration::from_secs(3600),
        },
        wake: WakePolicy::default(),
    }
}

/// A store whose claims are all refused although it names no other slot's claim (planner
/// and store disagree: a bug). Panics instead of looping for ever.
#[derive(Default)]
struct RefusingStore {
    inner: MemoryStore,
    refused: u32,
}

impl StateStore for RefusingStore {
    fn load(&mut self) -> anyhow::Result<Option<CycleState>> {
        self.inner.load()
    }
    fn save(&mut self, state: &CycleState) -> anyhow::Result<()> {
        self.inner.save(state)
    }
    fn remove(&mut self) -> anyhow::Result<()> {
        self.inner.remove()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn load_holds(&mut self) -> Result<crate::core::holds::Holds, HoldsError> {
        self.inner.load_holds()
    }
    fn save_holds(&mut self, holds: &crate::core::holds::Holds) -> anyhow::Result<()> {
        self.inner.save_holds(holds)
    }
    fn save_claiming(&mut self, _: &CycleState, _: i64, _: &str) -> anyhow::Result<Claim> {
        self.refused += 1;
        assert!(
            self.refused < 10 * MAX_STEPS_WITHOUT_WAIT,
            "the run never stopped refusing claims"
        );
        Ok(Claim::HeldBy("slot 2 (test)".into()))
    }
}

/// A refused claim writes nothing, so it is no progress: a planner that chooses, step after
/// step, a job the store says another slot holds is stopped by the runaway guard.
#[test]
fn a_claim_refused_again_and_again_is_a_runaway_not_progress() {
    let shared = ModelForgejo::new("debian");
    let runs_on = vec!["debian".to_string()];
    {
        let mut s = shared.server();
        let now = s.now;
        s.forgejo.add_job("h1".into(), runs_on, 1, 1, now);
    }
    let mut forgejo = shared.clone();
    let mut launcher = shared.clone();
    let mut tofu = NoopTofu;
    let mut store = RefusingStore::default();
    let mut clock = shared.clone();
    let cfg = test_config();
    let mut report = Report::new("run", false, clock.now());
    let mut world = super::World {
        forgejo: &mut forgejo,
        tofu: &mut tofu,
        launcher: &mut launcher,
        store: &mut store,
        clock: &mut clock,
    };
    assert_eq!(run(&mut world, &cfg, &mut report), End::Done);
    assert_eq!(report.outcome, Outcome::Failed);
    assert!(
        report
            .failures
            .iter()
            .any(|f| f.contains("steps without progress")),
        "{:?}",
        report.failures
    );
    assert!(store.inner.state.is_none());
}

/// The model's clock, woken by a delivery at `woken_at`; on its `job_after`-th sleep a job
/// appears (Forgejo wrote the delivery's job after sending it). Counts its sleeps.
struct WokenClock {
    inner: ModelForgejo,
    woken_at: Option<Timestamp>,
    job_after: Option<u32>,
    sleeps: Vec<Duration>,
}

impl Clock for WokenClock {
    fn now(&self) -> Timestamp {
        self.inner.now()
    }
    fn sleep(&mut self, d: Duration) -> Sleep {
        self.sleeps.push(d);
        if self.job_after == Some(self.sleeps.len() as u32) {
            let mut s = self.inner.server();
            let now = s.now;
            s.forgejo
                .add_job("h1".into(), vec!["debian".into()], 1, 1, now);
        }
        self.inner.sleep(d)
    }
    fn stop_requested(&self) -> bool {
        false
    }
    fn new_cycle_id(&mut self, now: Timestamp) -> String {
        self.inner.new_cycle_id(now)
    }
    fn woken_at(&self) -> Option<Timestamp> {
        self.woken_at
    }
}

/// A run with nothing to do, on a clock woken `woken_ago` before it starts (or never), with
/// a job appearing on the `job_after`-th sleep: its report and its sleeps.
fn woken_run(woken_ago: Option<Duration>, job_after: Option<u32>) -> (Report, Vec<Duration>) {
    let shared = ModelForgejo::new("debian");
    let start = shared.now();
    let mut clock = WokenClock {
        inner: shared.clone(),
        woken_at: woken_ago.map(|d| Timestamp(start.0 - d.as_millis() as i64)),
        job_after,
        sleeps: Vec::new(),
    };
    let (mut forgejo, mut launcher) = (shared.clone(), shared.clone());
    let mut store = MemoryStore::default();
    let mut cfg = test_config();
    cfg.wake = WakePolicy::new(Duration::from_secs(30), cfg.poll_interval);
    cfg.policy.idle_timeout = Duration::from_secs(1);
    let mut report = Report::new("run", false, start);
    let mut world = super::World {
        forgejo: &mut forgejo,
        tofu: &mut NoopTofu,
        launcher: &mut launcher,
        store: &mut store,
        clock: &mut clock,
    };
    assert_eq!(run(&mut world, &cfg, &mut report), End::Done);
    (report, clock.sleeps)
}

// Mutation caught: Step::Idle ending the run without `watch` (a woken run that finds no job
// yet exits, and the job its delivery announced waits for the timer).
#[test]
fn a_woken_run_keeps_looking_for_the_deliverys_job_within_the_window() {
    // Not woken: one look, then the run ends.
    let (report, sleeps) = woken_run(None, None);
    assert_eq!((report.outcome, sleeps.len()), (Outcome::Idle, 0));
    // Woken an hour ago: the same.
    let (report, sleeps) = woken_run(Some(Duration::from_secs(3600)), None);
    assert_eq!((report.outcome, sleeps.len()), (Outcome::Idle, 0));
    // Woken just now, no job ever: a look every second for the 30 s window, then the end.
    let (report, sleeps) = woken_run(Some(Duration::ZERO), None);
    assert_eq!(report.outcome, Outcome::Idle);
    assert_eq!(sleeps, vec![Duration::from_secs(1); 30]);
    // Woken 10 s ago: the rest of the window.
    let (_, sleeps) = woken_run(Some(Duration::from_secs(10)), None);
    assert_eq!(sleeps.len(), 20);
    // The job appears 3 s after the delivery: the run serves it.
    let (report, sleeps) = woken_run(Some(Duration::ZERO), Some(3));
    assert_eq!(
        report.outcome,
        Outcome::CycleFinished,
        "{:?}",
        report.failures
    );
    assert_eq!(&sleeps[..3], &[Duration::from_secs(1); 3]);
    assert!(
        report
            .events
            .iter()
            .any(|e| e.step == "launch_runner" && e.ok),
        "{:?}",
        report.events
    );
}

/// A backoff in force at the tests' clock.
fn closed_backoff(now: Timestamp) -> crate::core::backoff::Backoff {
    let mut b = crate::core::backoff::Backoff::new();
    b.consecutive_failed_cycles = 3;
    b.since = Some(now);
    b.until = Some(now.plus(Duration::from_secs(600)));
    b.last_reason = Some(crate::core::backoff::FailureReason::ApplyFailed);
    b
}

fn run_with_store(shared: &ModelForgejo, store: &mut MemoryStore) -> Report {
    run_with_config(shared, store, &test_config())
}

fn run_with_config(shared: &ModelForgejo, store: &mut MemoryStore, cfg: &CycleConfig) -> Report {
    let mut forgejo = shared.clone();
    let mut launcher = shared.clone();
    let mut tofu = NoopTofu;
    let mut clock = shared.clone();
    let mut report = Report::new("run", false, clock.now());
    let mut world = super::World {
        forgejo: &mut forgejo,
        tofu: &mut tofu,
        launcher: &mut launcher,
        store,
        clock: &mut clock,
    };
    assert_eq!(run(&mut world, cfg, &mut report), End::Done);
    report
}

/// The tests' Forgejo with one waiting job of ours (`h1`, job 1), and its clock's time.
fn model_with_one_job() -> (ModelForgejo, Timestamp) {
    let shared = ModelForgejo::new("debian");
    let now = {
        let mut s = shared.server();
        let now = s.now;
        s.forgejo
            .add_job("h1".into(), vec!["debian".into()], 1, 1, now);
        Timestamp(now)
    };
    (shared, now)
}

#[test]
fn a_backoff_in_force_starts_no_cycle_and_says_why() {
    let (shared, now) = model_with_one_job();
    let mut store = MemoryStore {
        backoff: closed_backoff(now),
        ..MemoryStore::default()
    };
    let report = run_with_store(&shared, &mut store);
    assert_eq!(report.outcome, Outcome::BackingOff);
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    let closed = report
        .backoff
        .expect("the report says since, until and why");
    assert_eq!(closed.failures, 3);
    assert!(store.state.is_none(), "no cycle started");
    assert!(report.events.is_empty(), "{:?}", report.events);
}

/// A pool that backs off makes no warm VM either.
#[test]
fn a_backoff_in_force_starts_no_warm_vm() {
    let shared = ModelForgejo::new("debian");
    let now = Timestamp(shared.server().now);
    let mut cfg = test_config();
    cfg.policy.warm.count = 1;
    cfg.policy.warm.max_age = Duration::from_secs(1800);
    let mut store = MemoryStore {
        backoff: closed_backoff(now),
        ..MemoryStore::default()
    };
    let report = run_with_config(&shared, &mut store, &cfg);
    assert_eq!(report.outcome, Outcome::BackingOff);
    assert!(report.backoff.is_some());
    assert!(store.state.is_none(), "no warm VM started");
    // Not backing off, the same run makes one, which waits for a job until --warm-max-age
    // (the model's clock moves on with each wait), then goes.
    let mut store = MemoryStore::default();
    let report = run_with_config(&shared, &mut store, &cfg);
    assert_eq!(
        report.outcome,
        Outcome::CycleFinished,
        "{:?}",
        report.failures
    );
    let said = |text: &str| report.events.iter().any(|e| e.detail.contains(text));
    assert!(said("(warm: no job yet)"), "{:?}", report.events);
    assert!(
        said("ran no job within --warm-max-age"),
        "{:?}",
        report.events
    );
}

/// Only a new VM is gated: a cycle in progress (here one whose teardown was decided) goes on
/// to its destroy and its end, and is counted.
#[test]
fn a_backoff_in_force_does_not_cut_a_cycle_in_progress_short() {
    let shared = ModelForgejo::new("debian");
    let now = Timestamp(shared.server().now);
    let mut state = CycleState::new("20261014t150757z-ab12".into(), now);
    state.apply_failed("tofu apply failed: x".into(), "tofu apply failed".into());
    let mut store = MemoryStore {
        state: Some(state),
        backoff: closed_backoff(now),
        ..MemoryStore::default()
    };
    let report = run_with_store(&shared, &mut store);
    assert_eq!(
        report.outcome,
        Outcome::CycleFinished,
        "{:?}",
        report.failures
    );
    assert!(store.state.is_none());
    assert_eq!(
        store.backoff.consecutive_failed_cycles, 4,
        "the cycle is counted"
    );
    assert!(report.events.iter().any(|e| e.step == "backoff"));
}

#[test]
fn a_long_busy_queue_is_progress_not_a_runaway() {
    // Each launched runner is given its job by Forgejo's rule and runs it at once: the job
    // ends and Forgejo deletes the registration, one step after another without a wait.
    let shared = ModelForgejo::new("debian");
    let jobs = MAX_STEPS_WITHOUT_WAIT as usize * 2;
    for i in 0..jobs {
        let runs_on = vec!["debian".to_string()];
        let mut s = shared.server();
        let now = s.now;
        s.forgejo.add_job(format!("h{i}"), runs_on, 1, 1, now);
    }
    let mut forgejo = shared.clone();
    let mut launcher = shared.clone();
    let mut tofu = NoopTofu;
    let mut store = MemoryStore::default();
    let mut clock = shared.clone();
    let cfg = test_config();
    let mut report = Report::new("run", false, clock.now());
    let mut world = super::World {
        forgejo: &mut forgejo,
        tofu: &mut tofu,
        launcher: &mut launcher,
        store: &mut store,
        clock: &mut clock,
    };
    assert_eq!(run(&mut world, &cfg, &mut report), End::Done);
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(report.outcome, Outcome::CycleFinished);
    let launched = report
        .events
        .iter()
        .filter(|e| e.step == "launch_runner")
        .count();
    assert_eq!(launched, jobs);
    assert!(store.state.is_none());
    let s = shared.server();
    assert!(s.forgejo.jobs.values().all(|j| j.status == "success"));
    assert!(s.forgejo.runners.values().all(|r| r.deleted));
}

/// A runner that takes its job at launch and runs it until the driver's next sleep: seen
/// `active` once (the model's own launcher runs the job at once, so its runner is never
/// seen active).
#[derive(Clone)]
struct TakesItsTime(ModelForgejo);

impl Launcher for TakesItsTime {
    fn check_config(&self) -> anyhow::Result<()> {
        Ok(())
    }
    fn launch(
        &mut self,
        req: &LaunchRequest<'_>,
        _: &crate::core::secret::Secret,
    ) -> Result<(), crate::core::ports::StepError> {
        let mut s = self.0.server();
        let now = s.now;
        let f = &mut s.forgejo;
        if let Some(r) = f.live_mut(req.runner_id) {
            r.declare(Some(vec!["debian".into()]), now);
        }
        if let Some(job) = f.task_for(req.runner_id, Some(req.job_handle)) {
            f.start_task(job, req.runner_id, now);
        }
        Ok(())
    }
    fn check(&mut self, req: &LaunchRequest<'_>) -> ProcessCheck {
        self.0.check(req)
    }
    fn stop(&mut self, req: &LaunchRequest<'_>) -> Result<(), crate::core::ports::StepError> {
        self.0.stop(req)
    }
}

impl Clock for TakesItsTime {
    fn now(&self) -> Timestamp {
        self.0.now()
    }
    fn sleep(&mut self, d: Duration) -> Sleep {
        {
            let mut s = self.0.server();
            let now = s.now;
            let running: Vec<i64> = s
                .forgejo
                .jobs
                .values()
                .filter(|j| j.is_running())
                .map(|j| j.id)
                .collect();
            for j in running {
                s.forgejo.final_update_task(j, now);
            }
        }
        self.0.sleep(d)
    }
    fn stop_requested(&self) -> bool {
        false
    }
    fn new_cycle_id(&mut self, now: Timestamp) -> String {
        self.0.new_cycle_id(now)
    }
}

fn take_jobs(report: &Report) -> Vec<&crate::core::report::Event> {
    report
        .events
        .iter()
        .filter(|e| e.step == "take_job")
        .collect()
}

/// The pickup starts at the first run that saw the job waiting (here one that backed off),
/// not at the run that served it; a runner never seen active is counted when its
/// registration is gone, as an upper bound.
#[test]
fn a_pickup_counts_from_the_first_run_that_saw_the_job_waiting() {
    let (shared, t0) = model_with_one_job();
    let mut store = MemoryStore {
        backoff: closed_backoff(t0),
        ..MemoryStore::default()
    };
    let first = run_with_store(&shared, &mut store);
    assert_eq!(first.outcome, Outcome::BackingOff);
    assert_eq!(
        store
            .holds
            .seen
            .iter()
            .map(|s| (s.handle.as_str(), s.first_seen))
            .collect::<Vec<_>>(),
        [("h1", t0)],
        "the sight is kept for the next run"
    );
    shared.server().now += 30_000;
    store.backoff = crate::core::backoff::Backoff::new();
    let report = run_with_store(&shared, &mut store);
    assert_eq!(
        report.outcome,
        Outcome::CycleFinished,
        "{:?}",
        report.failures
    );
    let took = take_jobs(&report);
    assert_eq!(took.len(), 1, "{:?}", report.events);
    let pickup = took[0].pickup_ms.expect("a pickup");
    assert!((30_000..=40_000).contains(&pickup), "{pickup}");
    assert!(took[0].detail.contains("at most"), "{}", took[0].detail);
    let mut c = crate::core::metrics::Counters::default();
    c.record(&report);
    assert_eq!((c.pickups.count, c.pickups.sum_ms), (1, pickup));
    assert!(
        store.holds.is_empty(),
        "the job is done: its sight forgotten"
    );
}

/// Seen active: counted then, once, from the earliest sight of any slot of the pool.
#[test]
fn a_runner_seen_active_counts_its_pickup_from_the_pools_first_sight() {
    let (shared, now) = model_with_one_job();
    let ago = |ms: i64| Timestamp(now.0 - ms);
    let mut store = MemoryStore::default();
    store.holds.seen.push(crate::core::holds::Seen {
        job_id: 1,
        handle: "h1".into(),
        first_seen: ago(10_000),
    });
    store.others.first_seen.insert("h1".into(), ago(20_000));
    let mut forgejo = shared.clone();
    let mut slow = TakesItsTime(shared.clone());
    let mut clock = slow.clone();
    let mut tofu = NoopTofu;
    let cfg = test_config();
    let mut report = Report::new("run", false, clock.now());
    let mut world = super::World {
        forgejo: &mut forgejo,
        tofu: &mut tofu,
        launcher: &mut slow,
        store: &mut store,
        clock: &mut clock,
    };
    assert_eq!(run(&mut world, &cfg, &mut report), End::Done);
    assert_eq!(
        report.outcome,
        Outcome::CycleFinished,
        "{:?}",
        report.failures
    );
    let took = take_jobs(&report);
    assert_eq!(
        took.len(),
        1,
        "once, not again when it is gone: {:?}",
        report.events
    );
    assert_eq!(took[0].pickup_ms, Some(20_000), "{took:?}");
    assert_eq!(took[0].job_id, Some(1));
    assert!(!took[0].detail.contains("at most"), "{}", took[0].detail);
}
