//! A VM is reused only within its trust boundary (`--reuse-within`) and only once the previous
//! runner's process is gone: `RUNNER_ACTION=check` before the next runner starts, `stop` when
//! it still runs and for every registration the cycle deletes itself. Real runs of the binary
//! against the fake Forgejo, the real terraform/tofu CLI and the test launch command
//! (tests/bin/launch.sh, which keeps a marker per live runner process and logs every call to
//! `$VM_DIR/actions.log`).

use std::fs;
use std::process::Stdio;

use crate::support::harness::{Env, wait_for};

/// `(action, runner id)` of every call of the launch command, in order.
fn actions(env: &Env) -> Vec<(String, i64)> {
    fs::read_to_string(env.vm.join("actions.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (a, id) = l.split_once(' ')?;
            Some((a.to_string(), id.trim().parse().ok()?))
        })
        .collect()
}

fn creates(env: &Env) -> usize {
    env.vm_log().matches("create ").count()
}

fn served(env: &Env, job: i64) -> bool {
    env.fake
        .jobs()
        .iter()
        .any(|j| j.id == job && j.status == "success")
}

#[test]
fn jobs_of_one_repository_share_a_vm_once_the_previous_runner_is_gone() {
    let env = Env::new();
    let (a, _) = env.fake.add_scoped_job(&["debian"], 1, 10);
    let (b, _) = env.fake.add_scoped_job(&["debian"], 1, 10);
    let out = env.run(&[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(served(&env, a) && served(&env, b), "{:?}", env.fake.jobs());
    assert_eq!(creates(&env), 1, "one VM: {}", env.vm_log());
    let calls = actions(&env);
    let kinds: Vec<&str> = calls.iter().map(|(a, _)| a.as_str()).collect();
    assert_eq!(kinds, ["start", "check", "start"], "{calls:?}");
    assert_eq!(
        calls[1].1, calls[0].1,
        "the first runner is checked: {calls:?}"
    );
    env.assert_at_rest();
}

#[test]
fn a_job_of_another_repository_gets_a_fresh_vm() {
    let env = Env::new();
    let (a, _) = env.fake.add_scoped_job(&["debian"], 1, 10);
    let (b, _) = env.fake.add_scoped_job(&["debian"], 1, 11);
    let out = env.run(&[]);
    assert_eq!(out.code, Some(0), "not a failure: {out:?}");
    assert!(served(&env, a) && !served(&env, b));
    assert!(
        out.stderr.contains(&format!(
            "job {b} is outside this VM's trust boundary (--reuse-within repo)"
        )),
        "{out:?}"
    );
    env.assert_at_rest();
    let out = env.run(&[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(served(&env, b));
    assert_eq!(creates(&env), 2, "a VM each: {}", env.vm_log());

    // The same two repositories of one owner share a VM with `--reuse-within owner`.
    let env = Env::new();
    let (a, _) = env.fake.add_scoped_job(&["debian"], 1, 10);
    let (b, _) = env.fake.add_scoped_job(&["debian"], 1, 11);
    let out = env.run(&["--reuse-within", "owner"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(served(&env, a) && served(&env, b));
    assert_eq!(creates(&env), 1, "{}", env.vm_log());
}

/// A run in the background whose first runner takes its job and keeps running; once the job
/// runs, a second job of the repository waits and the first is cancelled, upon which Forgejo
/// deletes its registration (StopTask) while its process runs on. The run's exit status, its
/// stderr and the second job.
fn outlived_registration(env: &Env) -> (Option<i32>, String, i64) {
    fs::write(env.vm.join("launch-mode.1"), "take").unwrap();
    let (a, _) = env.fake.add_scoped_job(&["debian"], 1, 10);
    let err_file = env.tmp.path().join("bg-err");
    let mut c = env.cmd("run");
    c.stdout(Stdio::null())
        .stderr(fs::File::create(&err_file).unwrap());
    let mut child = c.spawn().unwrap();
    wait_for("the first job to run", || {
        env.fake
            .jobs()
            .iter()
            .any(|j| j.id == a && j.status == "running")
    });
    let (b, _) = env.fake.add_scoped_job(&["debian"], 1, 10);
    env.fake.set_job_status(a, "cancelled");
    let code = child.wait().unwrap().code();
    (code, fs::read_to_string(&err_file).unwrap(), b)
}

#[test]
fn a_runner_that_outlives_its_registration_is_stopped_before_the_next_job() {
    let env = Env::new();
    let (code, err, b) = outlived_registration(&env);
    assert_eq!(code, Some(0), "{err}");
    assert!(served(&env, b), "{:?}", env.fake.jobs());
    let calls = actions(&env);
    let first = calls[0].1;
    let kinds: Vec<(&str, bool)> = calls
        .iter()
        .map(|(a, id)| (a.as_str(), *id == first))
        .collect();
    assert_eq!(
        kinds,
        [
            ("start", true),
            ("check", true),
            ("stop", true),
            ("start", false)
        ],
        "{calls:?}"
    );
    assert_eq!(creates(&env), 1, "{}", env.vm_log());
    env.assert_at_rest();
}

#[test]
fn a_runner_process_that_cannot_be_stopped_costs_the_vm_and_fails_the_run() {
    let env = Env::new();
    fs::write(env.vm.join("stop-mode"), "fail").unwrap();
    let (code, err, b) = outlived_registration(&env);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("RUNNER_ACTION=stop failed"), "{err}");
    assert!(!served(&env, b), "no job started next to the process");
    assert_eq!(
        actions(&env).iter().filter(|(a, _)| a == "start").count(),
        1,
        "{:?}",
        actions(&env)
    );
    env.assert_at_rest();
}

#[test]
fn a_launch_command_that_cannot_tell_gets_a_fresh_vm_per_job() {
    // Like a launch command that ignores RUNNER_ACTION: its check answers neither 0 nor 3.
    for mode in ["unknown", "ignore"] {
        let env = Env::new();
        fs::write(env.vm.join("check-mode"), mode).unwrap();
        let (a, _) = env.fake.add_scoped_job(&["debian"], 1, 10);
        let (b, _) = env.fake.add_scoped_job(&["debian"], 1, 10);
        let out = env.run(&[]);
        assert_eq!(out.code, Some(0), "{mode}: not a failure: {out:?}");
        assert!(served(&env, a) && !served(&env, b), "{mode}");
        assert!(
            out.stderr.contains("may still run on the VM"),
            "{mode}: {out:?}"
        );
        let out = env.run(&[]);
        assert_eq!(out.code, Some(0), "{mode}: {out:?}");
        assert!(served(&env, b), "{mode}");
        assert_eq!(creates(&env), 2, "{mode}: {}", env.vm_log());
        env.assert_at_rest();
    }
}

#[test]
fn every_registration_the_cycle_deletes_while_its_vm_runs_gets_its_runner_stopped_first() {
    let env = Env::new();
    // Connects, never takes its job: idle past the pickup timeout is a teardown, not a delete;
    // a runner that never connects is deleted while the VM runs.
    fs::write(env.vm.join("launch-mode.1"), "noop").unwrap();
    env.fake.add_scoped_job(&["debian"], 1, 10);
    let out = env.run(&[]);
    assert!(out.stderr.contains("never connected"), "{out:?}");
    let deleted = env.fake.deleted_ids();
    let calls = actions(&env);
    let stopped: Vec<i64> = calls
        .iter()
        .filter(|(a, _)| a == "stop")
        .map(|(_, id)| *id)
        .collect();
    let first = calls[0].1;
    assert!(deleted.contains(&first), "{deleted:?}");
    assert!(
        stopped.contains(&first),
        "stopped before its DELETE: {calls:?}"
    );
    env.assert_at_rest();
}

#[test]
fn a_launch_command_that_cannot_stop_only_costs_the_vm_its_reuse() {
    // Like a launch command that ignores RUNNER_ACTION: its stop fails. The runner it started
    // never connects and its registration is deleted: one failure of the run (the failed
    // start), not a second one for the stop; and the VM is not reused after it.
    let env = Env::new();
    fs::write(env.vm.join("launch-mode.1"), "noop").unwrap();
    fs::write(env.vm.join("stop-mode"), "fail").unwrap();
    env.fake.add_scoped_job(&["debian"], 1, 10);
    let out = env.run(&[]);
    assert_eq!(out.code, Some(1), "the failed start: {out:?}");
    let last: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(env.state.join("last-run.json")).unwrap())
            .unwrap();
    let failures = last["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(failures[0].as_str().unwrap().contains("never connected"));
    assert!(out.stderr.contains("the VM is not reused"), "{out:?}");
    assert_eq!(
        actions(&env).iter().filter(|(a, _)| a == "start").count(),
        1,
        "no runner started next to it: {:?}",
        actions(&env)
    );
}
