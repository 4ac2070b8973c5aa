//! Unit tests of the pure planner: every branch of `decide`, then exhaustive loops over
//! combinations that check the three safety rules (the deletion gate, forget only on a 404,
//! sweep only after a destroy in this run) on every input, not just the hand-picked ones.

use super::*;

use crate::core::state::Registration;

// ---------------------------------------------------------------------------------------------
// Builders
// ---------------------------------------------------------------------------------------------

/// A fixed base time (2025-10-09T08:53:20Z); every timestamp is an offset from it in ms.
const BASE: i64 = 1_760_000_000_000;
const SEC: i64 = 1_000;
const MIN: i64 = 60 * SEC;
const HOUR: i64 = 60 * MIN;
const GRACE: i64 = 3 * MIN;
const IDLE: i64 = 5 * MIN;
const MAX_CYCLE: i64 = 6 * HOUR;
const HARD: i64 = 24 * HOUR;
const AFTER_DESTROY: i64 = 120 * SEC;
const PICKUP: i64 = 10 * MIN;
/// When every registration built by `reg` was requested.
const REQUESTED: i64 = 10 * SEC;
/// The job every registration built by `reg` was made for.
const JOB: i64 = 7;
const CYCLE: &str = "20261014t150757z-ab12";
const PREFIX: &str = "ephemeral-";

fn at(offset_ms: i64) -> Timestamp {
    Timestamp(BASE + offset_ms)
}

fn policy() -> Policy {
    Policy {
        runner_prefix: PREFIX.into(),
        label_names: vec!["debian".into()],
        max_jobs_per_vm: 10,
        idle_timeout: Duration::from_secs(5 * 60),
        registration_grace: Duration::from_secs(3 * 60),
        max_cycle_duration: Duration::from_secs(6 * 3600),
        hard_deadline: Duration::from_secs(24 * 3600),
        intent_settle: Duration::ZERO,
        job_pickup_timeout: Duration::from_secs(PICKUP as u64 / 1000),
        sweep_min_age: Duration::from_secs(420),
        reuse_within: ReuseWithin::Repo,
        warm: Default::default(),
    }
}

/// A cycle started at `at(0)` with no VM-ready/free timestamps and no registrations.
/// A cycle whose VM runs the jobs of repository 1 (owner 1), the repository of `job`.
fn state(phase: Phase) -> CycleState {
    let mut s = CycleState::new(CYCLE.into(), at(0));
    s.phase = phase;
    s.boundary = Some(Boundary {
        repo_id: Some(1),
        owner_id: Some(1),
    });
    s
}

fn state_with(phase: Phase, regs: Vec<Registration>) -> CycleState {
    let mut s = state(phase);
    s.registrations = regs;
    s
}

/// The name this cycle gives registration `id` (carries the prefix).
fn reg_name(id: i64) -> String {
    format!("{PREFIX}{CYCLE}-{id}")
}

fn handle(job_id: i64) -> String {
    format!("handle-{job_id}")
}

/// The step that starts a cycle for job `job_id` (its attempt `handle(job_id)`).
fn start(job_id: i64) -> Step {
    Step::StartCycle {
        job_id,
        job_handle: handle(job_id),
    }
}

/// Other slots claim the attempts `handle(id)` of these jobs.
fn claimed(ids: &[i64]) -> crate::core::claims::Claimed {
    crate::core::claims::Claimed {
        handles: ids.iter().map(|id| handle(*id)).collect(),
        jobs: Default::default(),
    }
}

/// A registration with a known id, made for job `JOB`, requested at `at(REQUESTED)`. A launched
/// one (`Launch::Done`) has been seen connected; see `never_seen` for one that has not.
fn reg(id: i64, launch: Launch, launched_at: Option<Timestamp>) -> Registration {
    Registration {
        name: reg_name(id),
        id: Some(id),
        uuid: Some(format!("uuid-{id}")),
        job_id: JOB,
        job_handle: handle(JOB),
        requested_at: at(REQUESTED),
        launch,
        launched_at,
        job_gone_since: None,
        connected: launch == Launch::Done,
        // As if seen active already (only `MarkBusy`'s test starts without).
        busy: launch == Launch::Done,
        not_served: None,
        failed_start: false,
        stopped: None,
        job_first_seen: None,
    }
}

/// A registration whose POST answer was lost: no id yet.
fn intent(name: &str) -> Registration {
    Registration::intent(name.into(), JOB, handle(JOB), at(REQUESTED))
}

/// The same registration, its runner never seen `idle` or `active`.
fn never_seen(mut r: Registration) -> Registration {
    r.connected = false;
    r
}

fn gone_since(mut r: Registration, since: Timestamp) -> Registration {
    r.job_gone_since = Some(since);
    r
}

fn runner(id: i64, name: &str, status: RunnerStatus) -> Runner {
    Runner {
        id,
        name: Some(name.into()),
        status,
        labels: None,
    }
}

/// Runner `id` under the name this cycle gave it.
fn ours(id: i64, status: RunnerStatus) -> Runner {
    runner(id, &reg_name(id), status)
}

fn job(id: i64, status: &str, runs_on: &[&str]) -> Job {
    Job {
        id,
        handle: handle(id),
        status: status.into(),
        runs_on: runs_on.iter().map(|s| s.to_string()).collect(),
        repo_id: Some(1),
        owner_id: Some(1),
    }
}

fn obs(jobs: Option<Vec<Job>>, runners: Vec<(i64, Option<Runner>)>) -> Observation {
    Observation {
        jobs,
        runners: runners.into_iter().collect(),
        launch_problem: None,
        claimed_elsewhere: Default::default(),
        warm_elsewhere: Default::default(),
    }
}

/// `GET …/runners/{id}` answered with this runner.
fn seen(r: Runner) -> (i64, Option<Runner>) {
    (r.id, Some(r))
}

/// `GET …/runners/{id}` answered 404.
fn gone(id: i64) -> (i64, Option<Runner>) {
    (id, None)
}

fn ctx() -> RunContext {
    RunContext::default()
}

/// A run whose `tofu destroy` succeeded.
fn destroyed_ctx() -> RunContext {
    RunContext {
        destroyed_this_run: true,
        ..RunContext::default()
    }
}

fn plan(st: &CycleState, o: &Observation, c: &RunContext, now: Timestamp) -> Step {
    decide(Some(st), o, c, &policy(), now)
}

fn no_state(o: &Observation) -> Step {
    decide(None, o, &ctx(), &policy(), at(0))
}

fn is_wait(s: &Step) -> bool {
    matches!(s, Step::Wait { .. })
}

fn is_give_up(s: &Step) -> bool {
    matches!(s, Step::GiveUp { .. })
}

fn is_delete(s: &Step) -> bool {
    matches!(s, Step::Delete { .. })
}

fn teardown(reason: TeardownReason) -> Step {
    Step::Teardown { reason }
}

/// The Delete step for our registration `id` (made as the planner makes it: through the gate).
fn delete(id: i64, reason: DeleteReason) -> Step {
    let target = may_delete(&ours(id, RunnerStatus::Offline), PREFIX).expect("ours and offline");
    Step::Delete { target, reason }
}

fn waiting_debian(id: i64) -> Job {
    job(id, "waiting", &["debian"])
}

const ALL_LAUNCHES: [Launch; 4] = [
    Launch::Pending,
    Launch::Started,
    Launch::Done,
    Launch::Failed,
];
const NOT_DONE: [Launch; 3] = [Launch::Pending, Launch::Started, Launch::Failed];

fn odd_statuses() -> Vec<RunnerStatus> {
    vec![
        RunnerStatus::Unknown("Offline".into()),
        RunnerStatus::Unknown("OFFLINE".into()),
        RunnerStatus::Unknown("offline ".into()),
        RunnerStatus::Unknown(String::new()),
        RunnerStatus::Missing,
    ]
}

/// Names that do not carry the prefix `ephemeral-`.
const FOREIGN_NAMES: [&str; 5] = [
    "my-ephemeral-1",
    "static-builder",
    "Ephemeral-20261014t150757z-ab12-1",
    "ephemeral",
    "",
];

#[test]
fn builders_agree_with_the_policy() {
    let p = policy();
    assert_eq!(p.registration_grace.as_millis() as i64, GRACE);
    assert_eq!(p.idle_timeout.as_millis() as i64, IDLE);
    assert_eq!(p.max_cycle_duration.as_millis() as i64, MAX_CYCLE);
    assert_eq!(p.hard_deadline.as_millis() as i64, HARD);
    assert_eq!(OFFLINE_AFTER_DESTROY.as_millis() as i64, AFTER_DESTROY);
    assert_eq!(MAX_START_FAILURES, 3);
    assert!(reg_name(1).starts_with(PREFIX));
    for n in FOREIGN_NAMES {
        assert!(!n.starts_with(PREFIX), "{n}");
    }
}

// ---------------------------------------------------------------------------------------------
// No cycle.json
// ---------------------------------------------------------------------------------------------

#[test]
fn no_state_with_a_waiting_matching_job_starts_a_cycle() {
    assert_eq!(
        no_state(&obs(Some(vec![waiting_debian(5)]), vec![])),
        start(5)
    );
    // Mixed with jobs that do not count.
    let jobs = vec![
        job(1, "running", &["debian"]),
        job(2, "waiting", &["gpu"]),
        job(3, "waiting", &[]),
        job(4, "waiting", &["debian"]),
    ];
    assert_eq!(no_state(&obs(Some(jobs), vec![])), start(4));
}

#[test]
fn no_state_without_a_waiting_matching_job_is_idle() {
    let cases: Vec<(&str, Vec<Job>)> = vec![
        ("empty list", vec![]),
        ("only running", vec![job(1, "running", &["debian"])]),
        ("other label", vec![job(2, "waiting", &["gpu"])]),
        (
            "runs_on not a subset",
            vec![job(3, "waiting", &["debian", "docker"])],
        ),
        ("empty runs_on", vec![job(4, "waiting", &[])]),
        ("label case differs", vec![job(5, "waiting", &["Debian"])]),
        ("status case differs", vec![job(6, "Waiting", &["debian"])]),
        ("finished", vec![job(7, "success", &["debian"])]),
        (
            "all of the above",
            vec![
                job(1, "running", &["debian"]),
                job(2, "waiting", &["gpu"]),
                job(4, "waiting", &[]),
            ],
        ),
    ];
    for (what, jobs) in cases {
        assert_eq!(no_state(&obs(Some(jobs), vec![])), Step::Idle, "{what}");
    }
}

#[test]
fn no_state_when_the_jobs_request_failed_gives_up() {
    let s = no_state(&obs(None, vec![]));
    assert!(is_give_up(&s), "{s:?}");
    // Runners in the observation change nothing.
    let s = no_state(&obs(
        None,
        vec![seen(ours(1, RunnerStatus::Offline)), gone(2)],
    ));
    assert!(is_give_up(&s), "{s:?}");
}

// ---------------------------------------------------------------------------------------------
// Applying
// ---------------------------------------------------------------------------------------------

#[test]
fn applying_always_applies() {
    let st = state(Phase::Applying);
    for jobs in [None, Some(vec![]), Some(vec![waiting_debian(1)])] {
        for now in [at(0), at(MAX_CYCLE), at(HARD), at(2 * HARD)] {
            for c in [ctx(), destroyed_ctx()] {
                assert_eq!(plan(&st, &obs(jobs.clone(), vec![]), &c, now), Step::Apply);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running: registrations
// ---------------------------------------------------------------------------------------------

#[test]
fn running_past_the_hard_deadline_tears_down_even_with_an_active_runner() {
    let st = state_with(Phase::Running, vec![reg(1, Launch::Done, Some(at(MIN)))]);
    let o = obs(
        Some(vec![job(JOB, "running", &["debian"])]),
        vec![seen(ours(1, RunnerStatus::Active))],
    );
    let s = plan(&st, &o, &ctx(), at(HARD));
    assert_eq!(s, teardown(TeardownReason::HardDeadline));
    assert!(TeardownReason::HardDeadline.is_failure());
    // Just before the deadline the active runner is waited for.
    assert!(is_wait(&plan(&st, &o, &ctx(), at(HARD - 1))));
    // The deadline also wins over an unresolved intent, a 404, a failed GET and a waiting job.
    let st = state_with(
        Phase::Running,
        vec![intent("ephemeral-x-1"), reg(2, Launch::Done, None)],
    );
    let o = obs(Some(vec![waiting_debian(1)]), vec![gone(2)]);
    assert_eq!(
        plan(&st, &o, &ctx(), at(HARD + HOUR)),
        teardown(TeardownReason::HardDeadline)
    );
    let st = state(Phase::Running);
    assert_eq!(
        plan(
            &st,
            &obs(Some(vec![waiting_debian(1)]), vec![]),
            &ctx(),
            at(HARD)
        ),
        teardown(TeardownReason::HardDeadline)
    );
}

#[test]
fn only_hard_deadline_broken_vm_and_apply_failed_are_failures() {
    assert!(TeardownReason::HardDeadline.is_failure());
    assert!(TeardownReason::BrokenVm.is_failure());
    assert!(TeardownReason::ApplyFailed.is_failure());
    assert!(!TeardownReason::Idle.is_failure());
    assert!(!TeardownReason::JobCap.is_failure());
    assert!(!TeardownReason::MaxCycleDuration.is_failure());
    assert!(!TeardownReason::Stranded { runner_id: 1 }.is_failure());
    assert!(
        TeardownReason::Stranded { runner_id: 514 }
            .describe()
            .contains("514")
    );
}

#[test]
fn running_intent_without_id_is_resolved() {
    let name = "ephemeral-20261014t150757z-ab12-3";
    let st = state_with(Phase::Running, vec![intent(name)]);
    let o = obs(Some(vec![waiting_debian(1)]), vec![]);
    assert_eq!(
        plan(&st, &o, &ctx(), at(MIN)),
        Step::ResolveIntent { name: name.into() }
    );
    // A failed lookup of another name does not hold this one back.
    let mut c = ctx();
    c.failed_intents.insert("ephemeral-other-1".into());
    assert_eq!(
        plan(&st, &o, &c, at(MIN)),
        Step::ResolveIntent { name: name.into() }
    );
}

#[test]
fn running_intent_whose_lookup_failed_waits() {
    let name = "ephemeral-20261014t150757z-ab12-3";
    let st = state_with(Phase::Running, vec![intent(name)]);
    let mut c = ctx();
    c.failed_intents.insert(name.into());
    // Even with a waiting job and long past the idle timeout: wait, no Register, no Teardown.
    for now in [at(MIN), at(IDLE + HOUR), at(MAX_CYCLE + 1)] {
        let s = plan(&st, &obs(Some(vec![waiting_debian(1)]), vec![]), &c, now);
        assert!(is_wait(&s), "{s:?}");
    }
    // The next intent in line is still resolved.
    let st = state_with(
        Phase::Running,
        vec![intent(name), intent("ephemeral-20261014t150757z-ab12-4")],
    );
    assert_eq!(
        plan(&st, &obs(Some(vec![]), vec![]), &c, at(MIN)),
        Step::ResolveIntent {
            name: "ephemeral-20261014t150757z-ab12-4".into()
        }
    );
}

#[test]
fn running_404_forgets_whatever_the_launch_state() {
    for launch in ALL_LAUNCHES {
        let st = state_with(Phase::Running, vec![reg(1, launch, Some(at(MIN)))]);
        for jobs in [None, Some(vec![]), Some(vec![waiting_debian(2)])] {
            assert_eq!(
                plan(&st, &obs(jobs, vec![gone(1)]), &ctx(), at(MIN + 1)),
                Step::Forget { id: 1 },
                "{launch:?}"
            );
        }
        // A 404 is proof even right after a failed DELETE of the same id.
        let mut c = ctx();
        c.failed_deletes.insert(1);
        assert_eq!(
            plan(&st, &obs(Some(vec![]), vec![gone(1)]), &c, at(MIN + 1)),
            Step::Forget { id: 1 }
        );
    }
}

#[test]
fn running_failed_get_waits_and_never_deletes() {
    for launch in ALL_LAUNCHES {
        let st = state_with(Phase::Running, vec![reg(1, launch, Some(at(MIN)))]);
        for now in [
            at(MIN + 1),
            at(MIN + GRACE),
            at(MAX_CYCLE + 1),
            at(HARD - 1),
        ] {
            // No entry for id 1 at all (the GET failed), other ids do not stand in for it.
            let o = obs(
                Some(vec![waiting_debian(2)]),
                vec![seen(ours(2, RunnerStatus::Offline))],
            );
            let s = plan(&st, &o, &ctx(), now);
            assert!(is_wait(&s), "{launch:?} at {now:?}: {s:?}");
        }
    }
}

#[test]
fn running_failed_delete_waits_until_the_next_poll() {
    for launch in ALL_LAUNCHES {
        let st = state_with(Phase::Running, vec![reg(1, launch, Some(at(MIN)))]);
        let mut c = ctx();
        c.failed_deletes.insert(1);
        let o = obs(Some(vec![]), vec![seen(ours(1, RunnerStatus::Offline))]);
        let s = plan(&st, &o, &c, at(MIN + GRACE + HOUR));
        assert!(is_wait(&s), "{launch:?}: {s:?}");
        // Without the failed delete the same input deletes: the wait is the failed delete's doing.
        assert!(is_delete(&plan(&st, &o, &ctx(), at(MIN + GRACE + HOUR))));
    }
    // A failed DELETE of another id does not protect this one.
    let st = state_with(Phase::Running, vec![reg(1, Launch::Done, Some(at(MIN)))]);
    let mut c = ctx();
    c.failed_deletes.insert(2);
    let o = obs(Some(vec![]), vec![seen(ours(1, RunnerStatus::Offline))]);
    assert_eq!(
        plan(&st, &o, &c, at(MIN + GRACE)),
        delete(1, DeleteReason::Unconsumed)
    );
}

#[test]
fn running_launch_not_done_and_offline_is_deleted_at_once() {
    for (launch, reason) in [
        (Launch::Pending, DeleteReason::LaunchCutOff),
        (Launch::Started, DeleteReason::LaunchCutOff),
        (Launch::Failed, DeleteReason::LaunchFailed),
    ] {
        for launched_at in [None, Some(at(REQUESTED + SEC))] {
            let st = state_with(Phase::Running, vec![reg(1, launch, launched_at)]);
            let o = obs(Some(vec![]), vec![seen(ours(1, RunnerStatus::Offline))]);
            // No grace for a launch that can never be completed: the token is gone.
            for now in [at(REQUESTED), at(REQUESTED + 2 * SEC), at(HOUR)] {
                assert_eq!(
                    plan(&st, &o, &ctx(), now),
                    delete(1, reason),
                    "{launch:?} at {now:?}"
                );
            }
            // Jobs unknown: still deleted (the decision does not need them).
            let o = obs(None, vec![seen(ours(1, RunnerStatus::Offline))]);
            assert_eq!(plan(&st, &o, &ctx(), at(HOUR)), delete(1, reason));
        }
    }
}

#[test]
fn running_launch_not_done_offline_without_prefix_is_not_deleted() {
    for launch in NOT_DONE {
        let st = state_with(Phase::Running, vec![reg(1, launch, None)]);
        for name in FOREIGN_NAMES {
            let o = obs(
                Some(vec![]),
                vec![seen(runner(1, name, RunnerStatus::Offline))],
            );
            let s = plan(&st, &o, &ctx(), at(HOUR));
            assert!(is_wait(&s), "{launch:?} {name:?}: {s:?}");
        }
        let nameless = Runner {
            id: 1,
            name: None,
            status: RunnerStatus::Offline,
            labels: None,
        };
        let s = plan(
            &st,
            &obs(Some(vec![]), vec![seen(nameless)]),
            &ctx(),
            at(HOUR),
        );
        assert!(is_wait(&s), "{launch:?} nameless: {s:?}");
    }
}

#[test]
fn running_launch_not_done_but_runner_up_is_adopted() {
    for launch in NOT_DONE {
        for status in [RunnerStatus::Idle, RunnerStatus::Active] {
            let st = state_with(Phase::Running, vec![reg(1, launch, None)]);
            for jobs in [None, Some(vec![]), Some(vec![waiting_debian(JOB)])] {
                let o = obs(jobs, vec![seen(ours(1, status.clone()))]);
                assert_eq!(
                    plan(&st, &o, &ctx(), at(HOUR)),
                    Step::AdoptLaunch { id: 1 },
                    "{launch:?} {status:?}"
                );
            }
        }
    }
}

#[test]
fn running_launch_not_done_with_odd_status_waits() {
    for launch in NOT_DONE {
        let st = state_with(Phase::Running, vec![reg(1, launch, None)]);
        for status in odd_statuses() {
            let o = obs(Some(vec![]), vec![seen(ours(1, status.clone()))]);
            let s = plan(&st, &o, &ctx(), at(HOUR));
            assert!(is_wait(&s), "{launch:?} {status:?}: {s:?}");
        }
    }
}

#[test]
fn running_active_runner_waits() {
    let mut st = state_with(
        Phase::Running,
        vec![gone_since(reg(1, Launch::Done, Some(at(MIN))), at(MIN))],
    );
    // Seen active for the first time: it took a job, and claims none from now on.
    st.registrations[0].busy = false;
    let o = obs(None, vec![seen(ours(1, RunnerStatus::Active))]);
    assert_eq!(plan(&st, &o, &ctx(), at(MIN + 1)), Step::MarkBusy { id: 1 });
    st.registrations[0].busy = true;
    for jobs in [
        None,
        Some(vec![]),
        Some(vec![job(JOB, "running", &["debian"])]),
        Some(vec![waiting_debian(99)]),
    ] {
        for now in [
            at(MIN + 1),
            at(MIN + GRACE),
            at(MAX_CYCLE + 1),
            at(HARD - 1),
        ] {
            let o = obs(jobs.clone(), vec![seen(ours(1, RunnerStatus::Active))]);
            let s = plan(&st, &o, &ctx(), now);
            assert!(is_wait(&s), "{now:?}: {s:?}");
        }
    }
}

#[test]
fn running_idle_runner_whose_job_is_live_waits() {
    let st = state_with(Phase::Running, vec![reg(1, Launch::Done, Some(at(MIN)))]);
    for status in ["waiting", "running"] {
        // Its job is listed live (with labels that would not even match: the handle decides).
        let jobs = vec![waiting_debian(99), job(JOB, status, &["gpu"])];
        let o = obs(Some(jobs), vec![seen(ours(1, RunnerStatus::Idle))]);
        for now in [at(MIN + 1), at(MIN + PICKUP - 1)] {
            let s = plan(&st, &o, &ctx(), now);
            assert!(is_wait(&s), "{status} at {now:?}: {s:?}");
        }
    }
    // A job that runs (elsewhere: ours is idle) is no pickup failure, however long it takes.
    let jobs = vec![job(JOB, "running", &["debian"])];
    let o = obs(Some(jobs), vec![seen(ours(1, RunnerStatus::Idle))]);
    let s = plan(&st, &o, &ctx(), at(MIN + PICKUP + HOUR));
    assert!(is_wait(&s), "{s:?}");
}

#[test]
fn running_idle_runner_whose_job_is_live_again_clears_job_gone() {
    let st = state_with(
        Phase::Running,
        vec![gone_since(reg(1, Launch::Done, Some(at(MIN))), at(2 * MIN))],
    );
    for status in ["waiting", "running"] {
        let o = obs(
            Some(vec![job(JOB, status, &["debian"])]),
            vec![seen(ours(1, RunnerStatus::Idle))],
        );
        // Even long after the grace: the job is back, so the mark is cleared, not acted on.
        for now in [at(2 * MIN + 1), at(2 * MIN + GRACE + HOUR)] {
            assert_eq!(
                plan(&st, &o, &ctx(), now),
                Step::ClearJobGone { id: 1 },
                "{status}"
            );
        }
    }
}

#[test]
fn running_idle_runner_with_jobs_unknown_waits() {
    for gone_at in [None, Some(at(2 * MIN))] {
        let mut r = reg(1, Launch::Done, Some(at(MIN)));
        r.job_gone_since = gone_at;
        let st = state_with(Phase::Running, vec![r]);
        let o = obs(None, vec![seen(ours(1, RunnerStatus::Idle))]);
        let s = plan(&st, &o, &ctx(), at(2 * MIN + GRACE + HOUR));
        assert!(is_wait(&s), "{gone_at:?}: {s:?}");
    }
}

#[test]
fn running_idle_runner_whose_job_is_gone_is_marked() {
    let st = state_with(Phase::Running, vec![reg(1, Launch::Done, Some(at(MIN)))]);
    let cases: Vec<(&str, Vec<Job>)> = vec![
        ("no jobs", vec![]),
        ("only other jobs", vec![waiting_debian(99)]),
        ("its job finished", vec![job(JOB, "success", &["debian"])]),
        (
            "its job cancelled",
            vec![job(JOB, "cancelled", &["debian"])],
        ),
    ];
    for (what, jobs) in cases {
        let o = obs(Some(jobs), vec![seen(ours(1, RunnerStatus::Idle))]);
        for now in [at(MIN + 1), at(MIN + GRACE + HOUR)] {
            assert_eq!(
                plan(&st, &o, &ctx(), now),
                Step::MarkJobGone { id: 1 },
                "{what}"
            );
        }
    }
}

#[test]
fn running_idle_runner_whose_job_stays_gone_past_the_grace_is_stranded() {
    let since = at(10 * MIN);
    let st = state_with(
        Phase::Running,
        vec![gone_since(reg(4, Launch::Done, Some(at(MIN))), since)],
    );
    let o = obs(
        Some(vec![waiting_debian(99)]),
        vec![seen(ours(4, RunnerStatus::Idle))],
    );
    // The grace counts from when the job was first seen gone, not from the launch.
    assert!(is_wait(&plan(&st, &o, &ctx(), at(10 * MIN + 1))));
    assert!(is_wait(&plan(&st, &o, &ctx(), at(10 * MIN + GRACE - 1))));
    for now in [at(10 * MIN + GRACE), at(10 * MIN + GRACE + HOUR)] {
        let s = plan(&st, &o, &ctx(), now);
        assert_eq!(s, teardown(TeardownReason::Stranded { runner_id: 4 }));
    }
    assert!(!TeardownReason::Stranded { runner_id: 4 }.is_failure());
}

#[test]
fn running_offline_runner_within_the_grace_waits_and_is_deleted_after() {
    // Grace counts from launched_at.
    let launched = 10 * MIN;
    let st = state_with(
        Phase::Running,
        vec![reg(1, Launch::Done, Some(at(launched)))],
    );
    let o = obs(Some(vec![]), vec![seen(ours(1, RunnerStatus::Offline))]);
    // Long past requested_at + grace, but within launched_at + grace: wait.
    assert!(at(launched + GRACE - 1).0 > at(REQUESTED + GRACE).0);
    for now in [at(launched), at(launched + 1), at(launched + GRACE - 1)] {
        let s = plan(&st, &o, &ctx(), now);
        assert!(is_wait(&s), "{now:?}: {s:?}");
    }
    for now in [at(launched + GRACE), at(launched + GRACE + HOUR)] {
        assert_eq!(
            plan(&st, &o, &ctx(), now),
            delete(1, DeleteReason::Unconsumed)
        );
    }
    // Jobs unknown changes nothing about an offline one.
    let o = obs(None, vec![seen(ours(1, RunnerStatus::Offline))]);
    assert_eq!(
        plan(&st, &o, &ctx(), at(launched + GRACE)),
        delete(1, DeleteReason::Unconsumed)
    );

    // Without launched_at the grace counts from requested_at.
    let st = state_with(Phase::Running, vec![reg(1, Launch::Done, None)]);
    let o = obs(Some(vec![]), vec![seen(ours(1, RunnerStatus::Offline))]);
    assert!(is_wait(&plan(&st, &o, &ctx(), at(REQUESTED + GRACE - 1))));
    assert_eq!(
        plan(&st, &o, &ctx(), at(REQUESTED + GRACE)),
        delete(1, DeleteReason::Unconsumed)
    );
}

#[test]
fn running_offline_runner_past_the_grace_without_prefix_is_not_deleted() {
    let st = state_with(Phase::Running, vec![reg(1, Launch::Done, Some(at(MIN)))]);
    let now = at(MIN + GRACE + HOUR);
    for name in FOREIGN_NAMES {
        let o = obs(
            Some(vec![]),
            vec![seen(runner(1, name, RunnerStatus::Offline))],
        );
        let s = plan(&st, &o, &ctx(), now);
        assert!(is_wait(&s), "{name:?}: {s:?}");
    }
    let nameless = Runner {
        id: 1,
        name: None,
        status: RunnerStatus::Offline,
        labels: None,
    };
    let s = plan(&st, &obs(Some(vec![]), vec![seen(nameless)]), &ctx(), now);
    assert!(is_wait(&s), "{s:?}");

    // The prefix changed between runs: our own old name no longer carries it.
    let mut p = policy();
    p.runner_prefix = "ci-".into();
    let o = obs(Some(vec![]), vec![seen(ours(1, RunnerStatus::Offline))]);
    let s = decide(Some(&st), &o, &ctx(), &p, now);
    assert!(is_wait(&s), "{s:?}");
    // An empty prefix never licenses a deletion.
    p.runner_prefix = String::new();
    let s = decide(Some(&st), &o, &ctx(), &p, now);
    assert!(is_wait(&s), "{s:?}");
}

#[test]
fn running_odd_status_past_the_grace_waits() {
    let st = state_with(Phase::Running, vec![reg(1, Launch::Done, Some(at(MIN)))]);
    for status in odd_statuses() {
        for jobs in [None, Some(vec![]), Some(vec![waiting_debian(2)])] {
            let o = obs(jobs, vec![seen(ours(1, status.clone()))]);
            let s = plan(&st, &o, &ctx(), at(MIN + GRACE + HOUR));
            assert!(is_wait(&s), "{status:?}: {s:?}");
        }
    }
}

#[test]
fn running_never_deletes_an_idle_or_active_runner() {
    for status in [RunnerStatus::Idle, RunnerStatus::Active] {
        for launch in ALL_LAUNCHES {
            for gone_at in [None, Some(at(0))] {
                let mut r = reg(1, launch, Some(at(MIN)));
                r.job_gone_since = gone_at;
                let st = state_with(Phase::Running, vec![r]);
                for jobs in [None, Some(vec![]), Some(vec![waiting_debian(JOB)])] {
                    for now in [at(MIN), at(MIN + GRACE), at(MAX_CYCLE), at(HARD - 1)] {
                        let o = obs(jobs.clone(), vec![seen(ours(1, status.clone()))]);
                        let s = plan(&st, &o, &ctx(), now);
                        assert!(!is_delete(&s), "{status:?} {launch:?}: {s:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn running_looks_at_every_registration_in_order() {
    // The first one waits (GET failed), the second answered 404: forgotten.
    let st = state_with(
        Phase::Running,
        vec![
            reg(1, Launch::Done, Some(at(MIN))),
            reg(2, Launch::Done, Some(at(MIN))),
        ],
    );
    let o = obs(Some(vec![]), vec![gone(2)]);
    assert_eq!(plan(&st, &o, &ctx(), at(HOUR)), Step::Forget { id: 2 });
    // The first one is active, the second unconsumed: deleted.
    let o = obs(
        Some(vec![]),
        vec![
            seen(ours(1, RunnerStatus::Active)),
            seen(ours(2, RunnerStatus::Offline)),
        ],
    );
    assert_eq!(
        plan(&st, &o, &ctx(), at(HOUR)),
        delete(2, DeleteReason::Unconsumed)
    );
    // A failed intent waits, the registration after it is still handled.
    let st = state_with(
        Phase::Running,
        vec![intent("ephemeral-x-1"), reg(2, Launch::Done, None)],
    );
    let mut c = ctx();
    c.failed_intents.insert("ephemeral-x-1".into());
    assert_eq!(
        plan(&st, &obs(Some(vec![]), vec![gone(2)]), &c, at(HOUR)),
        Step::Forget { id: 2 }
    );
    // Both need something: the first in order goes first.
    let st = state_with(
        Phase::Running,
        vec![
            reg(1, Launch::Done, Some(at(MIN))),
            reg(2, Launch::Done, Some(at(MIN))),
        ],
    );
    let o = obs(
        Some(vec![]),
        vec![seen(ours(1, RunnerStatus::Offline)), gone(2)],
    );
    assert_eq!(
        plan(&st, &o, &ctx(), at(HOUR)),
        delete(1, DeleteReason::Unconsumed)
    );
}

#[test]
fn running_with_any_registration_never_registers_another() {
    // One registration at a time: while one is being watched the VM is not free.
    let st = state_with(Phase::Running, vec![reg(1, Launch::Done, Some(at(MIN)))]);
    let o = obs(
        Some(vec![waiting_debian(1), waiting_debian(JOB)]),
        vec![seen(ours(1, RunnerStatus::Active))],
    );
    let s = plan(&st, &o, &ctx(), at(2 * MIN));
    assert!(is_wait(&s), "{s:?}");
}

// ---------------------------------------------------------------------------------------------
// Running: the VM is free
// ---------------------------------------------------------------------------------------------

fn free_vm() -> CycleState {
    let mut s = state(Phase::Running);
    s.vm_ready_at = Some(at(MIN));
    s.free_since = Some(at(MIN));
    s
}

#[test]
fn free_vm_after_three_failed_starts_is_broken() {
    let o = obs(Some(vec![waiting_debian(1)]), vec![]);
    let mut st = free_vm();
    st.start_failures = MAX_START_FAILURES;
    assert_eq!(
        plan(&st, &o, &ctx(), at(2 * MIN)),
        teardown(TeardownReason::BrokenVm)
    );
    st.start_failures = MAX_START_FAILURES + 4;
    assert_eq!(
        plan(&st, &o, &ctx(), at(2 * MIN)),
        teardown(TeardownReason::BrokenVm)
    );
    // Also when jobs are unknown.
    assert_eq!(
        plan(&st, &obs(None, vec![]), &ctx(), at(2 * MIN)),
        teardown(TeardownReason::BrokenVm)
    );
    assert!(TeardownReason::BrokenVm.is_failure());
    st.start_failures = MAX_START_FAILURES - 1;
    assert!(matches!(
        plan(&st, &o, &ctx(), at(2 * MIN)),
        Step::Register { .. }
    ));
}

#[test]
fn free_vm_at_the_job_cap_tears_down_even_with_a_waiting_job() {
    let o = obs(Some(vec![waiting_debian(1)]), vec![]);
    let mut st = free_vm();
    st.jobs_started = 10;
    assert_eq!(
        plan(&st, &o, &ctx(), at(2 * MIN)),
        teardown(TeardownReason::JobCap)
    );
    st.jobs_started = 11;
    assert_eq!(
        plan(&st, &o, &ctx(), at(2 * MIN)),
        teardown(TeardownReason::JobCap)
    );
    assert_eq!(
        plan(&st, &obs(None, vec![]), &ctx(), at(2 * MIN)),
        teardown(TeardownReason::JobCap)
    );
    assert!(!TeardownReason::JobCap.is_failure());
    st.jobs_started = 9;
    assert!(matches!(
        plan(&st, &o, &ctx(), at(2 * MIN)),
        Step::Register { .. }
    ));
}

#[test]
fn free_vm_past_the_max_cycle_duration_tears_down_instead_of_registering() {
    let o = obs(Some(vec![waiting_debian(1)]), vec![]);
    let st = free_vm();
    for now in [at(MAX_CYCLE), at(MAX_CYCLE + HOUR)] {
        assert_eq!(
            plan(&st, &o, &ctx(), now),
            teardown(TeardownReason::MaxCycleDuration)
        );
        assert_eq!(
            plan(&st, &obs(None, vec![]), &ctx(), now),
            teardown(TeardownReason::MaxCycleDuration)
        );
    }
    assert!(!TeardownReason::MaxCycleDuration.is_failure());
    // Just before it, the waiting job gets a runner.
    assert!(matches!(
        plan(&st, &o, &ctx(), at(MAX_CYCLE - 1)),
        Step::Register { .. }
    ));
}

#[test]
fn free_vm_teardown_reasons_have_a_fixed_precedence() {
    let o = obs(Some(vec![waiting_debian(1)]), vec![]);
    let mut st = free_vm();
    st.start_failures = MAX_START_FAILURES;
    st.jobs_started = 10;
    assert_eq!(
        plan(&st, &o, &ctx(), at(MAX_CYCLE)),
        teardown(TeardownReason::BrokenVm)
    );
    st.start_failures = 0;
    assert_eq!(
        plan(&st, &o, &ctx(), at(MAX_CYCLE)),
        teardown(TeardownReason::JobCap)
    );
}

#[test]
fn free_vm_with_jobs_unknown_waits_then_idles_out() {
    // Without Forgejo nothing can start, so the idle timeout still ends the VM: a teardown never
    // needs Forgejo.
    let st = free_vm();
    let s = plan(&st, &obs(None, vec![]), &ctx(), at(2 * MIN));
    assert!(is_wait(&s), "{s:?}");
    for now in [at(MIN + IDLE), at(MIN + IDLE + HOUR)] {
        assert_eq!(
            plan(&st, &obs(None, vec![]), &ctx(), now),
            Step::Teardown {
                reason: TeardownReason::Idle
            },
            "{now:?}"
        );
    }
}

fn settling_policy() -> Policy {
    Policy {
        intent_settle: Duration::from_secs(60),
        ..policy()
    }
}

#[test]
fn an_unanswered_post_is_looked_up_only_once_it_has_settled() {
    let name = reg_name(40);
    let st = state_with(Phase::Running, vec![intent(&name)]);
    let p = settling_policy();
    // A POST still in flight (slow answer, killed run) must land before absence means anything.
    let early = decide(
        Some(&st),
        &obs(Some(vec![]), vec![]),
        &ctx(),
        &p,
        at(REQUESTED + 59 * SEC),
    );
    assert!(is_wait(&early), "{early:?}");
    let settled = decide(
        Some(&st),
        &obs(Some(vec![]), vec![]),
        &ctx(),
        &p,
        at(REQUESTED + 60 * SEC),
    );
    assert_eq!(settled, Step::ResolveIntent { name: name.clone() });

    let mut st = st;
    st.phase = Phase::Destroyed;
    let early = decide(
        Some(&st),
        &obs(None, vec![]),
        &destroyed_ctx(),
        &p,
        at(REQUESTED + 30 * SEC),
    );
    assert!(is_wait(&early), "{early:?}");
    let settled = decide(
        Some(&st),
        &obs(None, vec![]),
        &destroyed_ctx(),
        &p,
        at(REQUESTED + 61 * SEC),
    );
    assert_eq!(settled, Step::ResolveIntent { name });
}

#[test]
fn a_registration_that_cannot_be_cleaned_up_ends_the_vm_instead_of_holding_it() {
    let r = reg(41, Launch::Done, Some(at(REQUESTED)));
    let st = state_with(Phase::Running, vec![r.clone()]);
    let o = obs(Some(vec![]), vec![seen(ours(41, RunnerStatus::Offline))]);
    let mut c = ctx();
    c.failed_deletes.insert(41);
    c.cleanup_failures
        .insert(r.name.clone(), MAX_CLEANUP_FAILURES - 1);
    assert!(is_wait(&plan(&st, &o, &c, at(HOUR))));
    c.cleanup_failures
        .insert(r.name.clone(), MAX_CLEANUP_FAILURES);
    assert_eq!(
        plan(&st, &o, &c, at(HOUR)),
        Step::Teardown {
            reason: TeardownReason::CleanupFailing { name: r.name }
        }
    );
}

#[test]
fn the_prefix_recorded_in_the_cycle_wins_over_a_changed_configuration() {
    let mut st = state_with(
        Phase::Running,
        vec![reg(42, Launch::Done, Some(at(REQUESTED)))],
    );
    st.runner_prefix = PREFIX.into();
    let changed = Policy {
        runner_prefix: "renamed-".into(),
        ..policy()
    };
    let o = obs(Some(vec![]), vec![seen(ours(42, RunnerStatus::Offline))]);
    assert_eq!(
        decide(Some(&st), &o, &ctx(), &changed, at(REQUESTED + GRACE)),
        delete(42, DeleteReason::Unconsumed)
    );
    // Not recorded (an older cycle.json): the configured prefix decides, and it does not match.
    st.runner_prefix.clear();
    assert!(is_wait(&decide(
        Some(&st),
        &o,
        &ctx(),
        &changed,
        at(REQUESTED + GRACE)
    )));
}

// Mutation caught: no give-up after three failed observation rounds.
#[test]
fn a_run_that_could_only_wait_on_failing_requests_gives_up_after_three_rounds() {
    // Offline within its grace: the step is a wait.
    let st = state_with(
        Phase::Running,
        vec![reg(42, Launch::Done, Some(at(REQUESTED)))],
    );
    let o = obs(Some(vec![]), vec![seen(ours(42, RunnerStatus::Offline))]);
    let rounds = |n: u32| RunContext {
        failed_observations: n,
        ..ctx()
    };
    let now = at(REQUESTED + 1_000);
    assert!(is_wait(&decide(Some(&st), &o, &rounds(2), &policy(), now)));
    assert!(matches!(
        decide(Some(&st), &o, &rounds(MAX_OBSERVATION_FAILURES), &policy(), now),
        Step::GiveUp { why } if why.contains("failed 3 times in a row")
    ));
    // A step that acts is taken however the requests went.
    let answered_404 = obs(Some(vec![]), vec![gone(42)]);
    assert_eq!(
        decide(Some(&st), &answered_404, &rounds(5), &policy(), now),
        Step::Forget { id: 42 }
    );
}

// Mutation caught: a launch command gone mid-cycle ignored (Observation.launch_problem).
#[test]
fn a_launch_command_gone_mid_cycle_tears_the_vm_down_instead_of_registering() {
    let st = state_with(Phase::Running, vec![]);
    let mut o = obs(Some(vec![waiting_debian(3)]), vec![]);
    assert!(matches!(
        decide(Some(&st), &o, &ctx(), &policy(), at(HOUR)),
        Step::Register { job_id: 3, .. }
    ));
    o.launch_problem = Some("--launch-command /x: no such file".into());
    assert_eq!(
        decide(Some(&st), &o, &ctx(), &policy(), at(HOUR)),
        Step::Teardown {
            reason: TeardownReason::LaunchUnusable {
                problem: "--launch-command /x: no such file".into()
            }
        }
    );
}

#[test]
fn free_vm_registers_for_the_lowest_matching_waiting_job() {
    let jobs = vec![
        waiting_debian(9),
        job(3, "waiting", &["gpu"]),
        job(1, "waiting", &[]),
        job(2, "running", &["debian"]),
        job(4, "waiting", &["debian", "docker"]),
        waiting_debian(5),
        waiting_debian(12),
    ];
    let st = free_vm();
    // Even when the VM has been free for longer than the idle timeout.
    for now in [at(2 * MIN), at(MIN + IDLE + HOUR)] {
        assert_eq!(
            plan(&st, &obs(Some(jobs.clone()), vec![]), &ctx(), now),
            Step::Register {
                job_id: 5,
                job_handle: handle(5),
                boundary: Boundary {
                    repo_id: Some(1),
                    owner_id: Some(1),
                },
            }
        );
    }
    // The handle is the job's own, not derived from its id.
    let mut odd = waiting_debian(6);
    odd.handle = "b7f3-xyz".into();
    assert_eq!(
        plan(&st, &obs(Some(vec![odd]), vec![]), &ctx(), at(2 * MIN)),
        Step::Register {
            job_id: 6,
            job_handle: "b7f3-xyz".into(),
            boundary: Boundary {
                repo_id: Some(1),
                owner_id: Some(1),
            },
        }
    );
}

#[test]
fn free_vm_without_a_waiting_job_tears_down_after_the_idle_timeout() {
    let idle_jobs = [
        vec![],
        vec![job(2, "running", &["debian"])],
        vec![job(3, "waiting", &["gpu"])],
        vec![job(4, "waiting", &[])],
    ];
    let mut st = free_vm();
    st.free_since = Some(at(HOUR));
    for jobs in &idle_jobs {
        let o = obs(Some(jobs.clone()), vec![]);
        let s = plan(&st, &o, &ctx(), at(HOUR + IDLE - 1));
        assert!(is_wait(&s), "{s:?}");
        assert_eq!(
            plan(&st, &o, &ctx(), at(HOUR + IDLE)),
            teardown(TeardownReason::Idle)
        );
    }
    assert!(!TeardownReason::Idle.is_failure());
}

#[test]
fn idle_timeout_counts_from_free_since_then_vm_ready_then_started() {
    let o = obs(Some(vec![]), vec![]);
    // free_since wins over an earlier vm_ready_at.
    let mut st = state(Phase::Running);
    st.vm_ready_at = Some(at(MIN));
    st.free_since = Some(at(30 * MIN));
    assert!(is_wait(&plan(&st, &o, &ctx(), at(30 * MIN + IDLE - 1))));
    assert_eq!(
        plan(&st, &o, &ctx(), at(30 * MIN + IDLE)),
        teardown(TeardownReason::Idle)
    );
    // No free_since: vm_ready_at (later than started_at).
    st.free_since = None;
    st.vm_ready_at = Some(at(2 * MIN));
    assert!(is_wait(&plan(&st, &o, &ctx(), at(2 * MIN + IDLE - 1))));
    assert_eq!(
        plan(&st, &o, &ctx(), at(2 * MIN + IDLE)),
        teardown(TeardownReason::Idle)
    );
    // Neither: started_at.
    st.vm_ready_at = None;
    assert!(is_wait(&plan(&st, &o, &ctx(), at(IDLE - 1))));
    assert_eq!(
        plan(&st, &o, &ctx(), at(IDLE)),
        teardown(TeardownReason::Idle)
    );
}

// ---------------------------------------------------------------------------------------------
// TearingDown
// ---------------------------------------------------------------------------------------------

#[test]
fn tearing_down_forgets_a_404() {
    for launch in ALL_LAUNCHES {
        let st = state_with(Phase::TearingDown, vec![reg(1, launch, None)]);
        assert_eq!(
            plan(&st, &obs(None, vec![gone(1)]), &ctx(), at(HOUR)),
            Step::Forget { id: 1 }
        );
        // Even when that registration's DELETE failed before: a 404 is proof.
        let mut c = ctx();
        c.failed_deletes.insert(1);
        assert_eq!(
            plan(&st, &obs(None, vec![gone(1)]), &c, at(HOUR)),
            Step::Forget { id: 1 }
        );
    }
}

#[test]
fn tearing_down_deletes_an_offline_one_with_the_prefix() {
    for launch in ALL_LAUNCHES {
        let st = state_with(Phase::TearingDown, vec![reg(1, launch, Some(at(MIN)))]);
        let o = obs(None, vec![seen(ours(1, RunnerStatus::Offline))]);
        // No grace before the VM goes; not even the hard deadline changes that.
        for now in [at(MIN + 1), at(HOUR), at(HARD + HOUR)] {
            assert_eq!(
                plan(&st, &o, &ctx(), now),
                delete(1, DeleteReason::Teardown),
                "{launch:?}"
            );
        }
    }
}

#[test]
fn a_leftover_whose_job_had_gone_is_deleted_as_stranded() {
    // Before the destroy (it went offline already) and after it: the reason says why it was
    // left, so an operator can tell a stranded runner from an ordinary teardown.
    let stranded = gone_since(reg(1, Launch::Done, Some(at(MIN))), at(2 * MIN));
    let o = obs(None, vec![seen(ours(1, RunnerStatus::Offline))]);
    let st = state_with(Phase::TearingDown, vec![stranded.clone()]);
    assert_eq!(
        plan(&st, &o, &ctx(), at(HOUR)),
        delete(1, DeleteReason::Stranded)
    );
    let st = destroyed(vec![stranded], HOUR);
    assert_eq!(
        decide(Some(&st), &o, &destroyed_ctx(), &policy(), at(HOUR + SEC)),
        delete(1, DeleteReason::Stranded)
    );
    assert_eq!(DeleteReason::Stranded.as_str(), "stranded");
}

#[test]
fn tearing_down_skips_anything_not_provably_dead_and_destroys() {
    let st = state_with(
        Phase::TearingDown,
        vec![reg(1, Launch::Done, Some(at(MIN)))],
    );
    let mut statuses = vec![RunnerStatus::Idle, RunnerStatus::Active];
    statuses.extend(odd_statuses());
    for status in statuses {
        let o = obs(None, vec![seen(ours(1, status.clone()))]);
        assert_eq!(plan(&st, &o, &ctx(), at(HOUR)), Step::Destroy, "{status:?}");
    }
    for name in FOREIGN_NAMES {
        let o = obs(None, vec![seen(runner(1, name, RunnerStatus::Offline))]);
        assert_eq!(plan(&st, &o, &ctx(), at(HOUR)), Step::Destroy, "{name:?}");
    }
    // GET failed.
    assert_eq!(
        plan(&st, &obs(None, vec![]), &ctx(), at(HOUR)),
        Step::Destroy
    );
    // DELETE failed before.
    let mut c = ctx();
    c.failed_deletes.insert(1);
    let o = obs(None, vec![seen(ours(1, RunnerStatus::Offline))]);
    assert_eq!(plan(&st, &o, &c, at(HOUR)), Step::Destroy);
    // An intent is resolved after the destroy, not before.
    let st = state_with(Phase::TearingDown, vec![intent("ephemeral-x-1")]);
    assert_eq!(
        plan(&st, &obs(None, vec![]), &ctx(), at(HOUR)),
        Step::Destroy
    );
    // Nothing at all.
    assert_eq!(
        plan(
            &state(Phase::TearingDown),
            &obs(None, vec![]),
            &ctx(),
            at(HOUR)
        ),
        Step::Destroy
    );
}

#[test]
fn tearing_down_handles_every_registration_before_destroying() {
    let st = state_with(
        Phase::TearingDown,
        vec![
            intent("ephemeral-x-1"),
            reg(2, Launch::Done, None),
            reg(3, Launch::Done, None),
        ],
    );
    let o = obs(
        None,
        vec![
            seen(ours(2, RunnerStatus::Idle)),
            seen(ours(3, RunnerStatus::Offline)),
        ],
    );
    assert_eq!(
        plan(&st, &o, &ctx(), at(HOUR)),
        delete(3, DeleteReason::Teardown)
    );
    let o = obs(None, vec![seen(ours(2, RunnerStatus::Active)), gone(3)]);
    assert_eq!(plan(&st, &o, &ctx(), at(HOUR)), Step::Forget { id: 3 });
}

#[test]
fn tearing_down_is_not_destroyed_by_the_run_context() {
    // A destroy earlier in the run does not turn TearingDown into a sweep.
    let st = state(Phase::TearingDown);
    let mut c = destroyed_ctx();
    c.swept = true;
    assert_eq!(plan(&st, &obs(None, vec![]), &c, at(HOUR)), Step::Destroy);
}

// ---------------------------------------------------------------------------------------------
// Destroyed
// ---------------------------------------------------------------------------------------------

fn destroyed(regs: Vec<Registration>, destroyed_at: i64) -> CycleState {
    let mut s = state_with(Phase::Destroyed, regs);
    s.destroyed_at = Some(at(destroyed_at));
    s
}

#[test]
fn destroyed_in_an_earlier_run_destroys_again_first() {
    let states = vec![
        destroyed(vec![], HOUR),
        destroyed(vec![intent("ephemeral-x-1")], HOUR),
        destroyed(vec![reg(1, Launch::Done, None)], HOUR),
        state(Phase::Destroyed),
    ];
    let observations = vec![
        obs(None, vec![]),
        obs(Some(vec![]), vec![gone(1)]),
        obs(None, vec![seen(ours(1, RunnerStatus::Offline))]),
        obs(None, vec![seen(ours(1, RunnerStatus::Idle))]),
    ];
    for st in &states {
        for o in &observations {
            for swept in [false, true] {
                let c = RunContext {
                    swept,
                    ..RunContext::default()
                };
                for now in [at(HOUR), at(HOUR + AFTER_DESTROY), at(2 * HARD)] {
                    assert_eq!(plan(st, o, &c, now), Step::Destroy);
                }
            }
        }
    }
}

#[test]
fn destroyed_resolves_an_intent_or_gives_up_when_its_lookup_failed() {
    let st = destroyed(vec![intent("ephemeral-x-1")], HOUR);
    assert_eq!(
        plan(&st, &obs(None, vec![]), &destroyed_ctx(), at(HOUR)),
        Step::ResolveIntent {
            name: "ephemeral-x-1".into()
        }
    );
    let mut c = destroyed_ctx();
    c.failed_intents.insert("ephemeral-x-1".into());
    let s = plan(&st, &obs(None, vec![]), &c, at(HOUR));
    assert!(is_give_up(&s), "{s:?}");
    // The failed intent is never swept away or finished.
    c.swept = true;
    assert!(is_give_up(&plan(&st, &obs(None, vec![]), &c, at(HOUR))));
}

#[test]
fn destroyed_forgets_a_404_and_deletes_an_offline_one() {
    let st = destroyed(vec![reg(1, Launch::Done, None)], HOUR);
    assert_eq!(
        plan(&st, &obs(None, vec![gone(1)]), &destroyed_ctx(), at(HOUR)),
        Step::Forget { id: 1 }
    );
    let mut c = destroyed_ctx();
    c.failed_deletes.insert(1);
    assert_eq!(
        plan(&st, &obs(None, vec![gone(1)]), &c, at(HOUR)),
        Step::Forget { id: 1 }
    );
    for launch in ALL_LAUNCHES {
        let st = destroyed(vec![reg(1, launch, None)], HOUR);
        let o = obs(None, vec![seen(ours(1, RunnerStatus::Offline))]);
        assert_eq!(
            plan(&st, &o, &destroyed_ctx(), at(HOUR)),
            delete(1, DeleteReason::Teardown)
        );
    }
}

#[test]
fn destroyed_with_a_failed_delete_gives_up() {
    let st = destroyed(vec![reg(1, Launch::Done, None)], HOUR);
    let mut c = destroyed_ctx();
    c.failed_deletes.insert(1);
    for status in [RunnerStatus::Offline, RunnerStatus::Idle] {
        let o = obs(None, vec![seen(ours(1, status))]);
        let s = plan(&st, &o, &c, at(HOUR));
        assert!(is_give_up(&s), "{s:?}");
    }
    // A failure wins over a runner still waited for.
    let st = destroyed(
        vec![reg(1, Launch::Done, None), reg(2, Launch::Done, None)],
        HOUR,
    );
    let o = obs(
        None,
        vec![
            seen(ours(1, RunnerStatus::Offline)),
            seen(ours(2, RunnerStatus::Idle)),
        ],
    );
    assert!(is_give_up(&plan(&st, &o, &c, at(HOUR))));
}

#[test]
fn destroyed_waits_for_a_runner_to_go_offline_then_gives_up() {
    let st = destroyed(vec![reg(1, Launch::Done, None)], HOUR);
    let mut statuses = vec![RunnerStatus::Idle, RunnerStatus::Active];
    statuses.extend(odd_statuses());
    for status in statuses {
        let o = obs(None, vec![seen(ours(1, status.clone()))]);
        for now in [at(HOUR), at(HOUR + AFTER_DESTROY - 1)] {
            let s = plan(&st, &o, &destroyed_ctx(), now);
            assert!(is_wait(&s), "{status:?}: {s:?}");
        }
        for now in [at(HOUR + AFTER_DESTROY), at(HOUR + AFTER_DESTROY + HOUR)] {
            let s = plan(&st, &o, &destroyed_ctx(), now);
            assert!(is_give_up(&s), "{status:?}: {s:?}");
        }
    }
    // Offline but without the prefix: never deleted, waited for, then given up on.
    for name in FOREIGN_NAMES {
        let o = obs(None, vec![seen(runner(1, name, RunnerStatus::Offline))]);
        assert!(is_wait(&plan(&st, &o, &destroyed_ctx(), at(HOUR))));
        assert!(is_give_up(&plan(
            &st,
            &o,
            &destroyed_ctx(),
            at(HOUR + AFTER_DESTROY)
        )));
    }
    // GET failed: the same.
    let o = obs(None, vec![]);
    assert!(is_wait(&plan(&st, &o, &destroyed_ctx(), at(HOUR))));
    assert!(is_give_up(&plan(
        &st,
        &o,
        &destroyed_ctx(),
        at(HOUR + AFTER_DESTROY)
    )));
}

#[test]
fn destroyed_and_empty_sweeps_once_then_finishes() {
    for st in [destroyed(vec![], HOUR), state(Phase::Destroyed)] {
        for o in [
            obs(None, vec![]),
            obs(Some(vec![waiting_debian(1)]), vec![]),
        ] {
            assert!(
                matches!(plan(&st, &o, &destroyed_ctx(), at(HOUR)), Step::Sweep(l) if l.destroyed_cycle_id() == Some(st.cycle_id.as_str())),
                "the sweep, licensed by this cycle's destroy"
            );
            let mut c = destroyed_ctx();
            c.swept = true;
            assert_eq!(plan(&st, &o, &c, at(HOUR)), Step::Finish);
        }
    }
}

#[test]
fn destroyed_handles_registrations_before_the_sweep() {
    let st = destroyed(
        vec![reg(1, Launch::Done, None), reg(2, Launch::Done, None)],
        HOUR,
    );
    let o = obs(
        None,
        vec![
            seen(ours(1, RunnerStatus::Idle)),
            seen(ours(2, RunnerStatus::Offline)),
        ],
    );
    assert_eq!(
        plan(&st, &o, &destroyed_ctx(), at(HOUR)),
        delete(2, DeleteReason::Teardown)
    );
    let o = obs(None, vec![seen(ours(1, RunnerStatus::Idle)), gone(2)]);
    assert_eq!(
        plan(&st, &o, &destroyed_ctx(), at(HOUR)),
        Step::Forget { id: 2 }
    );
}

// ---------------------------------------------------------------------------------------------
// Exhaustive checks of the safety rules
// ---------------------------------------------------------------------------------------------

/// What `GET …/runners/1` said.
#[derive(Clone, Debug)]
enum Seen {
    Status(RunnerStatus),
    NotFound,
    Failed,
}

fn seen_variants() -> Vec<Seen> {
    let mut v = vec![
        Seen::Status(RunnerStatus::Offline),
        Seen::Status(RunnerStatus::Idle),
        Seen::Status(RunnerStatus::Active),
    ];
    v.extend(odd_statuses().into_iter().map(Seen::Status));
    v.push(Seen::NotFound);
    v.push(Seen::Failed);
    v
}

fn name_variants() -> Vec<Option<String>> {
    vec![
        Some(reg_name(1)),
        Some("my-ephemeral-1".into()),
        Some("static-builder".into()),
        Some("Ephemeral-1".into()),
        None,
    ]
}

const PHASES: [Phase; 4] = [
    Phase::Applying,
    Phase::Running,
    Phase::TearingDown,
    Phase::Destroyed,
];

fn put(runners: &mut BTreeMap<i64, Option<Runner>>, id: i64, name: &Option<String>, s: &Seen) {
    match s {
        Seen::Status(status) => {
            runners.insert(
                id,
                Some(Runner {
                    id,
                    name: name.clone(),
                    status: status.clone(),
                    labels: None,
                }),
            );
        }
        Seen::NotFound => {
            runners.insert(id, None);
        }
        Seen::Failed => {}
    }
}

/// The three safety rules and the basic sanity of ids and names in a step.
fn check_rules(st: &CycleState, o: &Observation, c: &RunContext, p: &Policy, now: Timestamp) {
    let step = decide(Some(st), o, c, p, now);
    let again = decide(Some(st), o, c, p, now);
    assert_eq!(step, again, "decide is not deterministic");
    let ctx_line = || format!("phase {:?}, obs {o:?}, ctx {c:?}, now {now:?}", st.phase);
    match &step {
        Step::Delete { target, .. } => {
            let id = &target.id();
            let r = o
                .runners
                .get(id)
                .and_then(|r| r.as_ref())
                .unwrap_or_else(|| panic!("Delete {id} without an answer: {}", ctx_line()));
            assert_eq!(
                r.status,
                RunnerStatus::Offline,
                "Delete of a runner not exactly offline: {}",
                ctx_line()
            );
            assert!(
                r.name
                    .as_deref()
                    .is_some_and(|n| !p.runner_prefix.is_empty() && n.starts_with(&p.runner_prefix)),
                "Delete of a runner without the prefix: {}",
                ctx_line()
            );
            assert!(
                !c.failed_deletes.contains(id),
                "Delete retried before a wait: {}",
                ctx_line()
            );
            assert!(st.registration(*id).is_some(), "Delete of an unknown id");
            assert_ne!(st.phase, Phase::Applying);
        }
        Step::Forget { id } => {
            assert!(
                matches!(o.runners.get(id), Some(None)),
                "Forget {id} without a 404: {}",
                ctx_line()
            );
            assert!(st.registration(*id).is_some(), "Forget of an unknown id");
        }
        Step::Sweep(_) => {
            assert!(
                c.destroyed_this_run,
                "Sweep without a destroy: {}",
                ctx_line()
            );
            assert!(!c.swept, "second sweep");
            assert_eq!(st.phase, Phase::Destroyed);
            assert!(st.registrations.is_empty(), "Sweep with registrations left");
        }
        Step::Finish => {
            assert!(c.destroyed_this_run && c.swept, "Finish: {}", ctx_line());
            assert!(
                st.registrations.is_empty(),
                "Finish with registrations left"
            );
        }
        Step::ResolveIntent { name } => {
            assert!(
                st.registrations
                    .iter()
                    .any(|r| r.id.is_none() && &r.name == name),
                "ResolveIntent of a name that is not an intent"
            );
            assert!(
                !c.failed_intents.contains(name),
                "lookup retried before a wait"
            );
        }
        Step::Register { .. } => {
            assert_eq!(st.phase, Phase::Running);
            assert!(st.registrations.is_empty(), "Register while one is watched");
        }
        Step::StartCycle { .. } | Step::Idle => panic!("{step:?} with a cycle.json"),
        _ => {}
    }
}

#[test]
fn safety_rules_hold_for_every_combination_of_one_registration() {
    let p = policy();
    let nows = [
        0,
        REQUESTED + SEC,
        MIN + GRACE - 1,
        MIN + GRACE,
        MIN + IDLE,
        MAX_CYCLE,
        HARD - 1,
        HARD,
    ];
    let job_lists: Vec<Option<Vec<Job>>> = vec![
        None,
        Some(vec![]),
        Some(vec![job(JOB, "running", &["debian"])]),
        Some(vec![waiting_debian(JOB)]),
        Some(vec![waiting_debian(99)]),
    ];
    let mut checked = 0u32;
    for phase in PHASES {
        for seen in seen_variants() {
            for name in name_variants() {
                let mut runners = BTreeMap::new();
                put(&mut runners, 1, &name, &seen);
                for launch in ALL_LAUNCHES {
                    for launched_at in [None, Some(at(MIN))] {
                        for gone_at in [None, Some(at(0))] {
                            let mut r = reg(1, launch, launched_at);
                            r.job_gone_since = gone_at;
                            let mut st = state_with(phase, vec![r]);
                            st.destroyed_at = Some(at(MIN));
                            for jobs in &job_lists {
                                let o = Observation {
                                    jobs: jobs.clone(),
                                    runners: runners.clone(),
                                    launch_problem: None,
                                    claimed_elsewhere: Default::default(),
                                    warm_elsewhere: Default::default(),
                                };
                                for destroyed_this_run in [false, true] {
                                    for failed_delete in [false, true] {
                                        let mut c = RunContext {
                                            destroyed_this_run,
                                            ..RunContext::default()
                                        };
                                        if failed_delete {
                                            c.failed_deletes.insert(1);
                                        }
                                        for now in nows {
                                            check_rules(&st, &o, &c, &p, at(now));
                                            checked += 1;
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(checked, 4 * 10 * 5 * 4 * 2 * 2 * 5 * 2 * 2 * 8);
}

#[test]
fn safety_rules_hold_for_every_combination_of_two_registrations() {
    let nows = [REQUESTED + SEC, MIN + GRACE, HOUR, HARD];
    let names = [Some(reg_name(1)), Some("static-builder".into())];
    let mut prefixes = vec![policy()];
    let mut changed = policy();
    changed.runner_prefix = "ci-".into();
    prefixes.push(changed);
    for p in &prefixes {
        for phase in PHASES {
            for first_is_intent in [false, true] {
                for s1 in seen_variants() {
                    for s2 in seen_variants() {
                        for n1 in &names {
                            for n2 in &names {
                                for launch in [Launch::Started, Launch::Done] {
                                    let r1 = if first_is_intent {
                                        intent("ephemeral-x-0")
                                    } else {
                                        reg(1, launch, Some(at(MIN)))
                                    };
                                    let mut st =
                                        state_with(phase, vec![r1, reg(2, launch, Some(at(MIN)))]);
                                    st.destroyed_at = Some(at(MIN));
                                    let mut runners = BTreeMap::new();
                                    put(&mut runners, 1, n1, &s1);
                                    put(&mut runners, 2, n2, &s2);
                                    let o = Observation {
                                        jobs: Some(vec![waiting_debian(3)]),
                                        runners,
                                        launch_problem: None,
                                        claimed_elsewhere: Default::default(),
                                        warm_elsewhere: Default::default(),
                                    };
                                    for destroyed_this_run in [false, true] {
                                        for failed in [false, true] {
                                            let mut c = RunContext {
                                                destroyed_this_run,
                                                ..RunContext::default()
                                            };
                                            if failed {
                                                c.failed_deletes.insert(2);
                                                c.failed_intents.insert("ephemeral-x-0".into());
                                            }
                                            for now in nows {
                                                check_rules(&st, &o, &c, p, at(now));
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn sweep_is_never_returned_without_a_destroy_in_this_run() {
    let regs_variants: Vec<Vec<Registration>> = vec![
        vec![],
        vec![reg(1, Launch::Done, None)],
        vec![intent("ephemeral-x-1")],
    ];
    let observations = vec![
        obs(None, vec![]),
        obs(Some(vec![]), vec![]),
        obs(Some(vec![waiting_debian(1)]), vec![]),
        obs(Some(vec![]), vec![gone(1)]),
        obs(Some(vec![]), vec![seen(ours(1, RunnerStatus::Offline))]),
        obs(Some(vec![]), vec![seen(ours(1, RunnerStatus::Idle))]),
    ];
    let nows = [0, MIN, IDLE + MIN, MAX_CYCLE, HARD, 2 * HARD];
    let mut seen_destroy = false;
    for phase in PHASES {
        for regs in &regs_variants {
            for destroyed_at in [None, Some(at(MIN))] {
                for vm_ready in [None, Some(at(MIN))] {
                    let mut st = state_with(phase, regs.clone());
                    st.destroyed_at = destroyed_at;
                    st.vm_ready_at = vm_ready;
                    st.free_since = vm_ready;
                    for o in &observations {
                        for swept in [false, true] {
                            for failed in [false, true] {
                                let mut c = RunContext {
                                    swept,
                                    ..RunContext::default()
                                };
                                if failed {
                                    c.failed_deletes.insert(1);
                                    c.failed_intents.insert("ephemeral-x-1".into());
                                }
                                for now in nows {
                                    let s = plan(&st, o, &c, at(now));
                                    assert!(
                                        !matches!(s, Step::Sweep(_)),
                                        "{phase:?} {regs:?} {o:?} {c:?}"
                                    );
                                    assert_ne!(s, Step::Finish, "{phase:?} {regs:?} {o:?} {c:?}");
                                    if phase == Phase::Destroyed {
                                        assert_eq!(s, Step::Destroy);
                                        seen_destroy = true;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(seen_destroy);
    // Without a cycle.json there is nothing to sweep either.
    for o in &observations {
        assert!(!matches!(
            decide(None, o, &ctx(), &policy(), at(0)),
            Step::Sweep(_)
        ));
    }
}

#[test]
fn a_settling_post_after_the_destroy_waits_past_the_offline_bound() {
    // A long --http-timeout: the POST settles 4 minutes after it was sent, later than the
    // 2 minute bound for runners to go offline after the destroy. That is no reason to give up.
    let name = reg_name(43);
    let mut st = state_with(Phase::Destroyed, vec![intent(&name)]);
    st.destroyed_at = Some(at(REQUESTED + 5 * SEC));
    let p = Policy {
        intent_settle: Duration::from_secs(240),
        ..policy()
    };
    let now = at(REQUESTED + 5 * SEC + AFTER_DESTROY + SEC);
    let s = decide(Some(&st), &obs(None, vec![]), &destroyed_ctx(), &p, now);
    assert!(is_wait(&s), "{s:?}");
    let settled = at(REQUESTED + 240 * SEC);
    assert_eq!(
        decide(Some(&st), &obs(None, vec![]), &destroyed_ctx(), &p, settled),
        Step::ResolveIntent { name }
    );
}

// ---------------------------------------------------------------------------------------------
// Runners that never connect, runners Forgejo does not give their job, held jobs
// ---------------------------------------------------------------------------------------------

/// Runner `id` as `GET …/runners/{id}` shows it once it has declared these label names.
fn declared(id: i64, status: RunnerStatus, labels: &[&str]) -> Runner {
    Runner {
        labels: Some(labels.iter().map(|l| l.to_string()).collect()),
        ..ours(id, status)
    }
}

fn held(job_id: i64, until: i64) -> RunContext {
    let mut c = ctx();
    c.holds.jobs.push(crate::core::holds::Hold {
        job_id,
        handle: handle(job_id),
        held_at: at(0),
        until: at(until),
        times: 1,
    });
    c
}

// Mutation caught: a never-connected registration deleted as unconsumed.
#[test]
fn a_launched_runner_never_seen_up_is_deleted_as_never_connected_after_the_grace() {
    let launched = MIN;
    let st = state_with(
        Phase::Running,
        vec![never_seen(reg(1, Launch::Done, Some(at(launched))))],
    );
    let o = obs(Some(vec![]), vec![seen(ours(1, RunnerStatus::Offline))]);
    assert!(is_wait(&plan(&st, &o, &ctx(), at(launched + GRACE - 1))));
    assert_eq!(
        plan(&st, &o, &ctx(), at(launched + GRACE)),
        delete(1, DeleteReason::NeverConnected)
    );
    // One that connected and then went offline did not fail to start: it is unconsumed.
    let st = state_with(
        Phase::Running,
        vec![reg(1, Launch::Done, Some(at(launched)))],
    );
    assert_eq!(
        plan(&st, &o, &ctx(), at(launched + GRACE)),
        delete(1, DeleteReason::Unconsumed)
    );
}

#[test]
fn a_runner_seen_idle_or_active_for_the_first_time_is_marked_connected() {
    let st = state_with(
        Phase::Running,
        vec![never_seen(reg(1, Launch::Done, Some(at(MIN))))],
    );
    for status in [RunnerStatus::Idle, RunnerStatus::Active] {
        for jobs in [None, Some(vec![]), Some(vec![waiting_debian(JOB)])] {
            // Before anything else, whatever its job does and however late it is.
            let o = obs(jobs.clone(), vec![seen(ours(1, status.clone()))]);
            for now in [at(MIN + 1), at(MIN + PICKUP + HOUR)] {
                assert_eq!(
                    plan(&st, &o, &ctx(), now),
                    Step::MarkConnected { id: 1 },
                    "{status:?} {jobs:?}"
                );
            }
        }
    }
    // Offline, or unknown: nothing to mark.
    for status in [RunnerStatus::Offline, RunnerStatus::Missing] {
        let o = obs(Some(vec![]), vec![seen(ours(1, status.clone()))]);
        assert!(is_wait(&plan(&st, &o, &ctx(), at(MIN + 1))), "{status:?}");
    }
    // Offline, but Forgejo shows the labels it declared: it connected (while no run of ours
    // looked, or before this version recorded it), and is not a failed start.
    let o = obs(
        Some(vec![]),
        vec![seen(declared(1, RunnerStatus::Offline, &["debian"]))],
    );
    assert_eq!(
        plan(&st, &o, &ctx(), at(MIN + GRACE + 1)),
        Step::MarkConnected { id: 1 }
    );
}

// Mutation caught: no pickup timeout.
#[test]
fn an_idle_runner_whose_job_still_waits_past_the_pickup_timeout_takes_the_vm_down() {
    let launched = MIN;
    let st = state_with(
        Phase::Running,
        vec![reg(1, Launch::Done, Some(at(launched)))],
    );
    let o = obs(
        Some(vec![waiting_debian(JOB)]),
        vec![seen(ours(1, RunnerStatus::Idle))],
    );
    assert!(is_wait(&plan(&st, &o, &ctx(), at(launched + PICKUP - 1))));
    let s = plan(&st, &o, &ctx(), at(launched + PICKUP));
    assert_eq!(
        s,
        Step::Teardown {
            reason: TeardownReason::PickupTimeout {
                runner_id: 1,
                job_id: JOB
            }
        }
    );
    let Step::Teardown { reason } = s else {
        unreachable!()
    };
    assert!(
        !reason.is_failure(),
        "a job held back by Forgejo is no failure of ours"
    );
    // An active runner has its job: no timeout however long it runs.
    let o = obs(
        Some(vec![waiting_debian(JOB)]),
        vec![seen(ours(1, RunnerStatus::Active))],
    );
    assert!(is_wait(&plan(
        &st,
        &o,
        &ctx(),
        at(launched + PICKUP + HOUR)
    )));
}

// Mutation caught: no teardown for a runner whose declared labels do not cover its job.
#[test]
fn an_idle_runner_whose_labels_do_not_cover_its_job_takes_the_vm_down_at_once() {
    let st = state_with(Phase::Running, vec![reg(1, Launch::Done, Some(at(MIN)))]);
    let jobs = Some(vec![job(JOB, "waiting", &["debian", "docker"])]);
    for labels in [&[][..], &["debian"], &["docker", "gpu"]] {
        let o = obs(
            jobs.clone(),
            vec![seen(declared(1, RunnerStatus::Idle, labels))],
        );
        let s = plan(&st, &o, &ctx(), at(MIN + 1));
        let Step::Teardown {
            reason: reason @ TeardownReason::WrongLabels { .. },
        } = &s
        else {
            panic!("{labels:?}: {s:?}");
        };
        assert!(
            reason.is_failure(),
            "a launch without the labels is an error"
        );
        assert!(
            reason.describe().contains("--label"),
            "{}",
            reason.describe()
        );
    }
    // Labels that cover the job: wait (up to the pickup timeout).
    let o = obs(
        jobs.clone(),
        vec![seen(declared(
            1,
            RunnerStatus::Idle,
            &["docker", "debian", "x"],
        ))],
    );
    assert!(is_wait(&plan(&st, &o, &ctx(), at(MIN + 1))));
    // Labels unknown (not in the answer): nothing is concluded from them.
    let o = obs(jobs, vec![seen(ours(1, RunnerStatus::Idle))]);
    assert!(is_wait(&plan(&st, &o, &ctx(), at(MIN + 1))));
    // A job that is not waiting (running elsewhere) is not ours to judge.
    let o = obs(
        Some(vec![job(JOB, "running", &["debian"])]),
        vec![seen(declared(1, RunnerStatus::Idle, &[]))],
    );
    assert!(is_wait(&plan(&st, &o, &ctx(), at(MIN + 1))));
}

#[test]
fn a_held_job_gets_no_runner_until_its_hold_ends() {
    let jobs = obs(Some(vec![waiting_debian(5)]), vec![]);
    // No cycle: a held job starts none (the idle tick stays one request).
    assert_eq!(
        decide(None, &jobs, &held(5, HOUR), &policy(), at(0)),
        Step::Idle
    );
    assert_eq!(
        decide(None, &jobs, &held(5, HOUR), &policy(), at(HOUR)),
        start(5)
    );
    // A held job of another attempt (another handle) holds nothing here.
    assert_eq!(
        decide(None, &jobs, &held(6, HOUR), &policy(), at(0)),
        start(5)
    );
    // A free VM serves the next waiting job, not the held one, and idles out on held ones.
    let mut st = state(Phase::Running);
    st.vm_ready_at = Some(at(0));
    st.free_since = Some(at(0));
    let both = obs(Some(vec![waiting_debian(5), waiting_debian(9)]), vec![]);
    assert_eq!(
        plan(&st, &both, &held(5, HOUR), at(MIN)),
        Step::Register {
            job_id: 9,
            job_handle: handle(9),
            boundary: Boundary {
                repo_id: Some(1),
                owner_id: Some(1),
            },
        }
    );
    assert!(is_wait(&plan(&st, &jobs, &held(5, HOUR), at(MIN))));
    assert_eq!(
        plan(&st, &jobs, &held(5, HOUR), at(IDLE)),
        Step::Teardown {
            reason: TeardownReason::Idle
        }
    );
    assert_eq!(
        plan(&st, &jobs, &held(5, HOUR), at(HOUR)),
        Step::Register {
            job_id: 5,
            job_handle: handle(5),
            boundary: Boundary {
                repo_id: Some(1),
                owner_id: Some(1),
            },
        }
    );
}

#[test]
fn a_registration_not_given_its_job_is_deleted_for_that_reason_after_the_destroy() {
    for (why, reason) in [
        (NotServed::PickupTimeout, DeleteReason::PickupTimeout),
        (NotServed::WrongLabels, DeleteReason::WrongLabels),
    ] {
        let mut r = reg(1, Launch::Done, Some(at(MIN)));
        r.not_served = Some(why);
        let o = obs(None, vec![seen(ours(1, RunnerStatus::Offline))]);
        let st = state_with(Phase::TearingDown, vec![r.clone()]);
        assert_eq!(plan(&st, &o, &ctx(), at(HOUR)), delete(1, reason));
        let mut st = state_with(Phase::Destroyed, vec![r]);
        st.destroyed_at = Some(at(HOUR));
        assert_eq!(
            plan(&st, &o, &destroyed_ctx(), at(HOUR + SEC)),
            delete(1, reason)
        );
    }
}

// -- trust boundary (`--reuse-within`) and earlier runners' processes --------------------------

fn scoped(id: i64, repo: Option<i64>, owner: Option<i64>) -> Job {
    Job {
        repo_id: repo,
        owner_id: owner,
        ..waiting_debian(id)
    }
}

fn within(reuse_within: ReuseWithin) -> Policy {
    Policy {
        reuse_within,
        ..policy()
    }
}

fn previous(id: i64, process: ProcessState) -> crate::core::state::PreviousRunner {
    crate::core::state::PreviousRunner {
        id,
        name: reg_name(id),
        uuid: format!("uuid-{id}"),
        job_id: JOB,
        job_handle: handle(JOB),
        process,
    }
}

fn used_vm() -> CycleState {
    let mut st = free_vm();
    st.jobs_started = 1;
    st
}

#[test]
fn a_job_of_another_repository_gets_a_fresh_vm() {
    let st = used_vm();
    let other_repo = obs(Some(vec![scoped(5, Some(2), Some(1))]), vec![]);
    let outside = |r| Step::Teardown {
        reason: TeardownReason::OutsideBoundary {
            job_id: 5,
            reuse_within: r,
        },
    };
    let d = |p: &Policy, o: &Observation| decide(Some(&st), o, &ctx(), p, at(2 * MIN));
    assert_eq!(
        d(&within(ReuseWithin::Repo), &other_repo),
        outside(ReuseWithin::Repo)
    );
    // The same owner: shared with `owner`, and with `pool`.
    assert!(matches!(
        d(&within(ReuseWithin::Owner), &other_repo),
        Step::Register { job_id: 5, .. }
    ));
    let other_owner = obs(Some(vec![scoped(5, Some(3), Some(2))]), vec![]);
    assert_eq!(
        d(&within(ReuseWithin::Owner), &other_owner),
        outside(ReuseWithin::Owner)
    );
    assert!(matches!(
        d(&within(ReuseWithin::Pool), &other_owner),
        Step::Register { job_id: 5, .. }
    ));
    // A job whose repository the list did not give shares with nobody.
    let unknown = obs(Some(vec![scoped(5, None, None)]), vec![]);
    assert_eq!(
        d(&within(ReuseWithin::Repo), &unknown),
        outside(ReuseWithin::Repo)
    );
    // Not a failure: a fresh VM for it is the plan.
    assert!(
        !TeardownReason::OutsideBoundary {
            job_id: 5,
            reuse_within: ReuseWithin::Repo
        }
        .is_failure()
    );
}

#[test]
fn a_job_inside_the_boundary_goes_first_and_the_first_job_draws_it() {
    let st = used_vm();
    let o = obs(
        Some(vec![
            scoped(4, Some(2), Some(2)),
            scoped(6, Some(1), Some(1)),
        ]),
        vec![],
    );
    assert!(matches!(
        plan(&st, &o, &ctx(), at(2 * MIN)),
        Step::Register { job_id: 6, .. }
    ));
    // A VM that ran nothing yet takes the oldest job, whose repository becomes its boundary.
    let mut fresh = free_vm();
    fresh.boundary = None;
    assert_eq!(
        plan(&fresh, &o, &ctx(), at(2 * MIN)),
        Step::Register {
            job_id: 4,
            job_handle: handle(4),
            boundary: Boundary {
                repo_id: Some(2),
                owner_id: Some(2)
            },
        }
    );
    // One that ran a job before boundaries were recorded takes no other (but with `pool`).
    let mut legacy = used_vm();
    legacy.boundary = None;
    assert!(matches!(
        plan(&legacy, &o, &ctx(), at(2 * MIN)),
        Step::Teardown {
            reason: TeardownReason::OutsideBoundary { job_id: 4, .. }
        }
    ));
    assert!(matches!(
        decide(
            Some(&legacy),
            &o,
            &ctx(),
            &within(ReuseWithin::Pool),
            at(2 * MIN)
        ),
        Step::Register { job_id: 4, .. }
    ));
}

#[test]
fn the_next_runner_starts_only_once_the_previous_process_is_known_gone() {
    let o = obs(Some(vec![waiting_debian(5)]), vec![]);
    let mut st = used_vm();
    st.previous = vec![
        previous(40, ProcessState::Gone),
        previous(41, ProcessState::Unchecked),
    ];
    assert_eq!(
        plan(&st, &o, &ctx(), at(2 * MIN)),
        Step::CheckPrevious { id: 41 }
    );
    // Only when a runner would start: a free VM with no job does not ask.
    assert!(is_wait(&plan(
        &st,
        &obs(Some(vec![]), vec![]),
        &ctx(),
        at(2 * MIN)
    )));
    st.previous[1].process = ProcessState::Gone;
    assert!(matches!(
        plan(&st, &o, &ctx(), at(2 * MIN)),
        Step::Register { job_id: 5, .. }
    ));
    // May still run: the VM goes, with or without a job waiting.
    st.previous[1].process = ProcessState::NotGone("check exited with status 1".into());
    let not_gone = Step::Teardown {
        reason: TeardownReason::PreviousRunnerNotGone {
            runner_id: 41,
            why: "check exited with status 1".into(),
        },
    };
    assert_eq!(plan(&st, &o, &ctx(), at(2 * MIN)), not_gone);
    assert_eq!(
        plan(&st, &obs(Some(vec![]), vec![]), &ctx(), at(2 * MIN)),
        not_gone
    );
}

// ---------------------------------------------------------------------------------------------
// Parallel slots: what another slot holds is never served here
// ---------------------------------------------------------------------------------------------

#[test]
fn a_job_another_slot_holds_gets_no_cycle_and_no_runner_here() {
    let mut o = obs(Some(vec![waiting_debian(5), waiting_debian(9)]), vec![]);
    o.claimed_elsewhere = claimed(&[5]);
    // No cycle: the next job is the one this slot starts for.
    assert_eq!(no_state(&o), start(9));
    o.claimed_elsewhere = claimed(&[5, 9]);
    assert_eq!(no_state(&o), Step::Idle);
    // A free VM: the held job is not registered for, and the VM idles out on it.
    let mut st = state(Phase::Running);
    st.vm_ready_at = Some(at(0));
    st.free_since = Some(at(0));
    o.claimed_elsewhere = claimed(&[5]);
    assert_eq!(
        plan(&st, &o, &ctx(), at(MIN)),
        Step::Register {
            job_id: 9,
            job_handle: handle(9),
            boundary: Boundary {
                repo_id: Some(1),
                owner_id: Some(1),
            },
        }
    );
    o.claimed_elsewhere = claimed(&[5, 9]);
    assert!(is_wait(&plan(&st, &o, &ctx(), at(MIN))));
    assert_eq!(
        plan(&st, &o, &ctx(), at(IDLE)),
        Step::Teardown {
            reason: TeardownReason::Idle
        }
    );
}

/// A claim is on one attempt of a job: once job 5 is rerun (a new attempt with a new handle,
/// Forgejo's `PrepareNextAttempt`), another slot's claim on its first attempt no longer keeps it
/// from this slot; a start claim written without a handle still covers every attempt.
#[test]
fn a_claim_on_one_attempt_leaves_the_rerun_free() {
    let mut rerun = waiting_debian(5);
    rerun.handle = "handle-5-attempt-2".into();
    let mut o = obs(Some(vec![rerun]), vec![]);
    o.claimed_elsewhere = claimed(&[5]);
    assert_eq!(
        no_state(&o),
        Step::StartCycle {
            job_id: 5,
            job_handle: "handle-5-attempt-2".into()
        }
    );
    o.claimed_elsewhere.jobs.insert(5);
    assert_eq!(no_state(&o), Step::Idle);
}

/// A runner whose stop failed may still come up on the VM between the reading that found it
/// offline and the DELETE (which checks no status) and take a job that is then lost with it: it
/// is deleted only after the destroy. A stop that worked deletes at once.
#[test]
fn a_registration_whose_stop_failed_is_deleted_only_after_the_destroy() {
    let why = "RUNNER_ACTION=stop failed: exit status 1".to_string();
    let mut r = reg(1, Launch::Done, Some(at(MIN)));
    r.stopped = Some(ProcessState::NotGone(why.clone()));
    let o = obs(Some(vec![]), vec![seen(ours(1, RunnerStatus::Offline))]);
    let now = at(MIN + GRACE + HOUR);
    let running = state_with(Phase::Running, vec![r.clone()]);
    assert_eq!(
        plan(&running, &o, &ctx(), now),
        teardown(TeardownReason::PreviousRunnerNotGone { runner_id: 1, why })
    );
    let tearing = state_with(Phase::TearingDown, vec![r.clone()]);
    assert_eq!(plan(&tearing, &o, &ctx(), now), Step::Destroy);
    let destroyed = state_with(Phase::Destroyed, vec![r.clone()]);
    assert!(is_delete(&plan(&destroyed, &o, &destroyed_ctx(), now)));
    // The same registration with its process stopped is deleted while the VM runs.
    r.stopped = Some(ProcessState::Gone);
    for phase in [Phase::Running, Phase::TearingDown] {
        let st = state_with(phase, vec![r.clone()]);
        assert!(is_delete(&plan(&st, &o, &ctx(), now)), "{phase:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Warm VMs (`--warm`)
// ---------------------------------------------------------------------------------------------

const WARM_AGE: i64 = HOUR;

fn warm_policy(count: u32) -> Policy {
    Policy {
        warm: crate::core::warm::WarmPolicy {
            count,
            max_age: Duration::from_millis(WARM_AGE as u64),
            during: Default::default(),
        },
        ..policy()
    }
}

fn warm_obs(jobs: Vec<Job>, total: u32, in_lower_slots: u32) -> Observation {
    Observation {
        warm_elsewhere: crate::core::warm::WarmElsewhere {
            total,
            in_lower_slots,
        },
        ..obs(Some(jobs), vec![])
    }
}

/// An unused warm VM, ready at `at(0)`: bound to no repository yet.
fn warm_state() -> CycleState {
    let mut s = state(Phase::Running);
    s.warm = true;
    s.boundary = None;
    s.vm_ready_at = Some(at(0));
    s.free_since = Some(at(0));
    s
}

#[test]
fn an_idle_pool_that_wants_a_warm_vm_starts_one_and_only_while_too_few_are_up() {
    let p = warm_policy(1);
    let decide_none = |o: &Observation, p: &Policy| decide(None, o, &ctx(), p, at(0));
    assert_eq!(decide_none(&warm_obs(vec![], 0, 0), &p), Step::StartWarm);
    assert_eq!(decide_none(&warm_obs(vec![], 1, 0), &p), Step::Idle);
    assert_eq!(
        decide_none(&warm_obs(vec![], 0, 0), &warm_policy(0)),
        Step::Idle
    );
    assert_eq!(
        decide_none(&warm_obs(vec![], 1, 1), &warm_policy(2)),
        Step::StartWarm
    );
    // A job the pool's unused warm VM will take gets no VM of its own; a second one does.
    assert_eq!(
        decide_none(&warm_obs(vec![waiting_debian(5)], 1, 0), &p),
        Step::Idle
    );
    assert_eq!(
        decide_none(
            &warm_obs(vec![waiting_debian(5), waiting_debian(6)], 1, 0),
            &p
        ),
        start(6)
    );
    // Without warm VMs elsewhere a waiting job starts a cycle for itself, as ever.
    assert_eq!(
        decide_none(&warm_obs(vec![waiting_debian(5)], 0, 0), &p),
        start(5)
    );
}

#[test]
fn an_unused_warm_vm_waits_past_the_idle_timeout_and_goes_at_its_max_age() {
    let p = warm_policy(1);
    let st = warm_state();
    let o = warm_obs(vec![], 0, 0);
    let at_ = |t| decide(Some(&st), &o, &ctx(), &p, at(t));
    assert!(is_wait(&at_(IDLE + SEC)), "the idle timeout does not apply");
    assert!(is_wait(&at_(WARM_AGE - SEC)));
    assert_eq!(at_(WARM_AGE), teardown(TeardownReason::WarmExpired));
    assert!(!TeardownReason::WarmExpired.is_failure());
    assert!(!TeardownReason::WarmNotWanted.is_failure());
}

#[test]
fn a_warm_vm_the_pool_no_longer_wants_goes_unless_it_is_in_the_lowest_slots() {
    let st = warm_state();
    let now = at(MIN);
    let d = |o: &Observation, p: &Policy| decide(Some(&st), o, &ctx(), p, now);
    // --warm lowered to 0: every unused warm VM goes.
    assert_eq!(
        d(&warm_obs(vec![], 0, 0), &warm_policy(0)),
        teardown(TeardownReason::WarmNotWanted)
    );
    // --warm 1 with another in a lower slot: this one goes; in a higher slot: this one stays.
    assert_eq!(
        d(&warm_obs(vec![], 1, 1), &warm_policy(1)),
        teardown(TeardownReason::WarmNotWanted)
    );
    assert!(is_wait(&d(&warm_obs(vec![], 1, 0), &warm_policy(1))));
    // Outside --warm-during the pool wants none (the tests' clock reads 08:53 UTC).
    let mut outside = warm_policy(1);
    outside.warm.during = crate::core::warm::Windows::parse("00:00-00:01").unwrap();
    assert_eq!(
        decide(
            Some(&st),
            &warm_obs(vec![], 0, 0),
            &ctx(),
            &outside,
            at(MIN)
        ),
        teardown(TeardownReason::WarmNotWanted)
    );
}

#[test]
fn an_unused_warm_vm_takes_any_repositorys_job_and_its_first_job_sets_the_boundary() {
    let p = warm_policy(1);
    let st = warm_state();
    let mut other_repo = waiting_debian(9);
    other_repo.repo_id = Some(42);
    other_repo.owner_id = Some(43);
    assert_eq!(
        decide(
            Some(&st),
            &warm_obs(vec![other_repo.clone()], 0, 0),
            &ctx(),
            &p,
            at(MIN)
        ),
        Step::Register {
            job_id: 9,
            job_handle: handle(9),
            boundary: Boundary {
                repo_id: Some(42),
                owner_id: Some(43),
            },
        }
    );
    // Used: the idle timeout and the trust boundary apply as to any cycle.
    let mut used = st.clone();
    used.jobs_started = 1;
    used.boundary = Some(Boundary {
        repo_id: Some(1),
        owner_id: Some(1),
    });
    assert_eq!(
        decide(
            Some(&used),
            &warm_obs(vec![other_repo], 0, 0),
            &ctx(),
            &p,
            at(MIN)
        ),
        teardown(TeardownReason::OutsideBoundary {
            job_id: 9,
            reuse_within: ReuseWithin::Repo,
        })
    );
    assert_eq!(
        decide(Some(&used), &warm_obs(vec![], 0, 0), &ctx(), &p, at(IDLE)),
        teardown(TeardownReason::Idle)
    );
}

// Mutation caught: the planner treating a canary's cycle.json as a cycle of the pool (applying it
// again, or giving its VM the waiting job).
#[test]
fn a_canary_left_by_a_killed_check_is_torn_down_never_served() {
    for phase in [Phase::Applying, Phase::Running] {
        let mut st = state(phase);
        st.canary = true;
        st.boundary = None;
        let o = obs(Some(vec![waiting_debian(JOB)]), vec![]);
        assert_eq!(
            plan(&st, &o, &ctx(), at(MIN)),
            teardown(TeardownReason::Canary),
            "{phase:?}"
        );
        // It counts neither way in the pool's failure backoff.
        st.failure = Some(crate::core::backoff::FailureReason::ApplyFailed);
        assert_eq!(st.outcome(), crate::core::backoff::CycleOutcome::Neutral);
    }
}
