//! SIGKILL at step boundaries of a real cycle (the built binary, real terraform, the fake
//! Forgejo), the way systemd ends a unit: the process and everything it started. Then run again
//! until the cycle ends: no VM, no registration with our prefix, no cycle.json.

use std::fs;
use std::process::{Child, Stdio};
use std::time::Duration;

use crate::support::fake_forgejo::{Conn, Fault};
use crate::support::harness::{Env, kill_like_systemd, wait_for};

fn spawn_run(env: &Env, extra: &[&str]) -> Child {
    let mut c = env.cmd("run");
    c.args(extra);
    c.stdout(Stdio::null())
        .stderr(Stdio::null())
        .stdin(Stdio::null());
    c.spawn().unwrap()
}

/// Runs until the cycle has ended (at most `max` runs) and checks the end state.
fn converge(env: &Env, max: usize) {
    for i in 0..max {
        let out = env.run(&[]);
        if env.cycle_json().is_none() && out.code == Some(0) {
            break;
        }
        assert!(
            i + 1 < max,
            "no convergence after {max} runs; last: {out:?}"
        );
    }
    env.assert_at_rest();
}

#[test]
fn sigkill_during_apply() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fault("slow-apply", true);
    let mut child = spawn_run(&env, &[]);
    wait_for("apply", || env.vm.join("applying").exists());
    kill_like_systemd(&mut child);
    assert_eq!(
        env.cycle_json().unwrap()["phase"],
        "applying",
        "intent written before apply"
    );
    env.fault("slow-apply", false);
    converge(&env, 3);
    assert!(
        env.fake.jobs().iter().all(|j| j.status == "success"),
        "the job still ran"
    );
}

#[test]
fn sigkill_after_the_register_post_before_its_answer() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fake.inject(
        "POST",
        "/actions/runners",
        Fault::Delay(Duration::from_millis(1500)),
        1,
    );
    let mut child = spawn_run(&env, &[]);
    wait_for("the POST", || {
        env.fake.requests().iter().any(|r| r.method == "POST")
    });
    kill_like_systemd(&mut child);
    let cycle = env.cycle_json().unwrap();
    assert!(
        cycle["registrations"][0]["id"].is_null(),
        "intent recorded, id unknown: {cycle}"
    );
    // The server still creates it: a registration we never heard about.
    wait_for("the delayed POST to apply", || {
        !env.our_runners().is_empty()
    });
    converge(&env, 3);
    assert!(env.fake.jobs().iter().all(|j| j.status == "success"));
}

#[test]
fn sigkill_during_launch() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.set_launch_mode("hang");
    let mut child = spawn_run(&env, &[]);
    wait_for("the launch", || {
        fs::read_dir(&env.vm).unwrap().any(|e| {
            e.unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("launch-env.")
        })
    });
    kill_like_systemd(&mut child);
    let cycle = env.cycle_json().unwrap();
    assert_eq!(cycle["registrations"][0]["launch"], "started", "{cycle}");
    env.set_launch_mode("one-job");
    converge(&env, 3);
    // The cut-off registration was deleted (its token was lost), the job ran on a new one.
    assert_eq!(env.fake.deleted_ids().len(), 1);
    assert!(env.fake.jobs().iter().all(|j| j.status == "success"));
}

#[test]
fn sigkill_during_destroy() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fake
        .add_runner("ephemeral-stale", true, Conn::NeverConnected);
    env.fault("slow-destroy", true);
    let mut child = spawn_run(&env, &[]);
    wait_for("destroy", || env.vm.join("destroying").exists());
    kill_like_systemd(&mut child);
    assert_eq!(env.cycle_json().unwrap()["phase"], "tearing_down");
    assert_eq!(
        env.our_runners().len(),
        1,
        "no sweep before a successful destroy"
    );
    env.fault("slow-destroy", false);
    converge(&env, 3);
}

#[test]
fn sigkill_in_the_middle_of_the_sweep() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    for i in 0..4 {
        env.fake
            .add_runner(&format!("ephemeral-stale-{i}"), true, Conn::NeverConnected);
    }
    env.fake.inject(
        "DELETE",
        "/actions/runners/",
        Fault::Delay(Duration::from_secs(3)),
        usize::MAX,
    );
    let mut child = spawn_run(&env, &[]);
    wait_for("the sweep", || {
        env.fake.requests().iter().any(|r| r.method == "DELETE")
    });
    kill_like_systemd(&mut child);
    assert_eq!(env.cycle_json().unwrap()["phase"], "destroyed");
    env.fake.clear_faults();
    converge(&env, 3);
}

#[test]
fn sigkill_while_a_runner_works() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.set_launch_mode("take");
    let mut child = spawn_run(&env, &[]);
    wait_for("the runner to take its job", || {
        env.fake.jobs().iter().any(|j| j.status == "running")
    });
    kill_like_systemd(&mut child);
    // The runner is still busy on the VM: the next run must not delete it; it waits and tears
    // down once the job is done (simulated here by the job finishing on its own).
    let runner = env.our_runners()[0];
    let mut c = env.cmd("run");
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let mut again = c.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(800));
    assert!(
        env.fake.runner(runner).is_some(),
        "a busy runner is never deleted"
    );
    assert!(env.fake.deleted_ids().is_empty());
    // The job completes: Forgejo removes the ephemeral registration.
    let uuid = env.fake.runner(runner).unwrap().uuid;
    let token = fs::read_to_string(env.vm.join("runners").join(&uuid)).unwrap();
    let status = ureq::post(format!("{}/_fake/finish", env.fake.url()))
        .header("X-Runner-UUID", &uuid)
        .send(token.as_bytes())
        .unwrap()
        .status();
    assert_eq!(status.as_u16(), 200);
    fs::remove_file(env.vm.join("runners").join(&uuid)).unwrap();
    let st = again.wait().unwrap();
    assert_eq!(st.code(), Some(0));
    converge(&env, 2);
}

// ---------------------------------------------------------------------------------------------
// The crash-point matrix: every `crash_point!` boundary of a cycle, every time a run reaches it.
// ---------------------------------------------------------------------------------------------

use ci_ephemeral_provisioner::crashpoint::{CRASH_AT_ENV, CRASH_LOG_ENV, POINTS};

/// A cycle set up to reach a group of crash points.
#[derive(Clone, Copy, Debug)]
enum Scenario {
    /// One job run to completion, stale offline registrations of ours to sweep, and runners
    /// that must survive: a foreign offline one and an idle one with our prefix.
    Full,
    /// The runner never connects: its registration is deleted after the grace.
    Unconsumed,
    /// The register POST is applied but its answer lost: looked up by name and deleted.
    LostPost,
    /// `tofu apply` fails: torn down at once.
    ApplyFails,
    /// The first register POST is refused, then every launch command fails: the VM is presumed
    /// broken and torn down.
    StartFailures,
    /// Two jobs of one repository: the second runs on the same VM once the first runner's
    /// process is checked gone.
    Reuse,
}

/// Runners that exist before the run and must still exist after it (never deleted).
struct Survivors(Vec<i64>);

impl Scenario {
    fn setup(self, env: &Env) -> Survivors {
        env.fake.add_job(&["debian"]);
        let mut keep = Vec::new();
        match self {
            Scenario::Full => {
                // Two, so that a kill after the first delete is in the middle of the sweep.
                for name in ["ephemeral-stale-1", "ephemeral-stale-2"] {
                    env.fake.add_runner(name, true, Conn::NeverConnected);
                }
                keep.push(
                    env.fake
                        .add_runner("static-builder", false, Conn::NeverConnected),
                );
                keep.push(env.fake.add_runner("ephemeral-alive", true, Conn::Idle));
            }
            Scenario::Unconsumed => env.set_launch_mode("noop"),
            Scenario::LostPost => {
                env.fake
                    .inject("POST", "/actions/runners", Fault::ApplyThenDrop, 1)
            }
            Scenario::ApplyFails => env.fault("fail-apply", true),
            Scenario::StartFailures => {
                env.fake
                    .inject("POST", "/actions/runners", Fault::Status(422), 1);
                env.set_launch_mode("fail");
            }
            Scenario::Reuse => {
                env.fake.add_job(&["debian"]);
            }
        }
        Survivors(keep)
    }

    /// The world calms down: faults stop, runners behave.
    fn calm(self, env: &Env) {
        env.fake.clear_faults();
        env.set_launch_mode("one-job");
        env.fault("fail-apply", false);
    }

    fn extra_args(self) -> &'static [&'static str] {
        match self {
            // One registration, then the VM goes: the trace stays short.
            Scenario::Unconsumed => &["--max-jobs-per-vm", "1"],
            _ => &[],
        }
    }
}

/// Runs `scenario` once without a crash and returns the crash points it reached, in order.
fn trace(scenario: Scenario) -> Vec<String> {
    let env = Env::new();
    let survivors = scenario.setup(&env);
    let log = env.tmp.path().join("crash-trace");
    let mut c = env.cmd("run");
    c.args(scenario.extra_args());
    c.env(CRASH_LOG_ENV, &log);
    let out = env.exec(c);
    assert!(out.code.is_some(), "{scenario:?}: {out:?}");
    scenario.calm(&env);
    converge_keeping(
        &env,
        &survivors,
        5,
        &format!("{scenario:?} without a crash"),
    );
    fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// `(point, nth)` for every time the trace reaches a point.
fn occurrences(trace: &[String]) -> Vec<(String, usize)> {
    let mut seen: std::collections::BTreeMap<&str, usize> = Default::default();
    trace
        .iter()
        .map(|p| {
            let n = seen.entry(p).or_default();
            *n += 1;
            (p.clone(), *n)
        })
        .collect()
}

/// Kills a run of `scenario` at the nth time it reaches `point`, then runs until the cycle ends
/// and checks the end state.
fn crash_and_converge(scenario: Scenario, point: &str, nth: usize) {
    let what = format!("{scenario:?}, SIGKILL at {point}:{nth}");
    let env = Env::new();
    let survivors = scenario.setup(&env);
    let mut c = env.cmd("run");
    c.args(scenario.extra_args());
    c.env(CRASH_AT_ENV, format!("{point}:{nth}"));
    let out = env.exec(c);
    // Killed by the hook: no exit code (signal 9). A run that ends on its own missed the point.
    assert_eq!(
        out.code, None,
        "{what}: the run was not killed there: {out:?}"
    );
    assert_intent_covers_the_world(&env, &what);
    scenario.calm(&env);
    converge_keeping(&env, &survivors, 5, &what);
}

/// Right after a kill, what exists is what cycle.json announced: a VM only with a cycle.json,
/// and every registration this tool created (named `<prefix><cycle id>-<n>`) recorded in it. (The
/// end state alone would not show a missing intent: the sweep cleans up after it.)
fn assert_intent_covers_the_world(env: &Env, what: &str) {
    let cycle = env.cycle_json();
    if !env.live_vms().is_empty() {
        assert!(
            cycle.is_some(),
            "{what}: a VM exists but no cycle.json: {}",
            env.vm_log()
        );
    }
    let recorded: Vec<String> = cycle
        .as_ref()
        .and_then(|c| c["registrations"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|r| r["name"].as_str().map(str::to_string))
        .collect();
    for r in env.fake.runners() {
        // Cycle ids start with the year: `ephemeral-20261129t…`.
        if r.name.starts_with("ephemeral-20") {
            assert!(
                recorded.contains(&r.name),
                "{what}: registration {} ({}) exists but cycle.json does not record it: {cycle:?}",
                r.id,
                r.name
            );
        }
    }
}

/// Runs until the cycle has ended and the job ran (at most `max` runs), then checks: no cycle.json, no VM, every
/// VM created was destroyed, no registration with our prefix but the survivors, the survivors
/// intact, every deletion one of ours and offline at that moment, every job done.
fn converge_keeping(env: &Env, survivors: &Survivors, max: usize, what: &str) {
    let mut last = None;
    for _ in 0..max {
        let out = env.run(&[]);
        // The cycle ended and the queue drained (a cycle torn down early leaves its job to the
        // next one).
        let done = env.cycle_json().is_none()
            && out.code == Some(0)
            && env.fake.jobs().iter().all(|j| j.status == "success");
        last = Some(out);
        if done {
            break;
        }
    }
    assert!(
        env.cycle_json().is_none(),
        "{what}: no convergence after {max} runs; last: {last:?}"
    );
    assert!(
        env.live_vms().is_empty(),
        "{what}: leaked VM: {}",
        env.vm_log()
    );
    let log = env.vm_log();
    for line in log.lines() {
        if let Some(id) = line.strip_prefix("create ") {
            assert!(
                log.contains(&format!("destroy {id}")),
                "{what}: VM {id} never destroyed: {log}"
            );
        }
    }
    let ours: Vec<_> = env
        .fake
        .runners()
        .into_iter()
        .filter(|r| r.name.starts_with("ephemeral-") && !survivors.0.contains(&r.id))
        .collect();
    assert!(ours.is_empty(), "{what}: leaked registrations: {ours:?}");
    for id in &survivors.0 {
        assert!(
            env.fake.runner(*id).is_some(),
            "{what}: runner {id} was deleted"
        );
    }
    for (id, name, status) in env.fake.deletions() {
        assert!(
            name.starts_with("ephemeral-") && status == "offline",
            "{what}: deleted runner {id} ({name}) while it was {status}"
        );
    }
    assert!(
        env.fake.jobs().iter().all(|j| j.status == "success"),
        "{what}: a job did not run: {:?}",
        env.fake.jobs()
    );
}

/// Worlds killed and converged at the same time within one matrix function: the runs mostly wait
/// (poll intervals, grace periods), so lanes cut the wall time, not the checks.
const LANES: usize = 4;

/// Every occurrence of every point the scenario reaches, each in its own fresh world. `part`/`of`
/// split a long trace over several test functions (they run in parallel too).
fn matrix(scenario: Scenario, part: usize, of: usize) -> Vec<String> {
    let t = trace(scenario);
    eprintln!("{scenario:?}: {} crash points reached: {t:?}", t.len());
    assert!(
        !t.is_empty(),
        "{scenario:?} reached no crash point: is this a debug build?"
    );
    let mine: Vec<(String, usize)> = occurrences(&t)
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % of == part)
        .map(|(_, o)| o)
        .collect();
    std::thread::scope(|s| {
        for lane in 0..LANES {
            let mine = &mine;
            s.spawn(move || {
                for (point, nth) in mine.iter().skip(lane).step_by(LANES) {
                    crash_and_converge(scenario, point, *nth);
                }
            });
        }
    });
    t
}

// Mutation caught: no cycle.json write before tofu apply.
#[test]
fn matrix_full_cycle_even() {
    matrix(Scenario::Full, 0, 2);
}

// Mutation caught: no cycle.json write of the registration intent before the POST.
#[test]
fn matrix_full_cycle_odd() {
    matrix(Scenario::Full, 1, 2);
}

#[test]
fn matrix_unconsumed_registration() {
    matrix(Scenario::Unconsumed, 0, 1);
}

// Mutation caught: a lost-POST registration forgotten without being deleted.
#[test]
fn matrix_lost_post_answer() {
    matrix(Scenario::LostPost, 0, 1);
}

#[test]
fn matrix_failed_apply() {
    matrix(Scenario::ApplyFails, 0, 1);
}

#[test]
fn matrix_failed_starts() {
    matrix(Scenario::StartFailures, 0, 1);
}

/// The reuse of the VM only (what comes before it is the full cycle's): every occurrence from
/// the first runner's forget to the second runner's launch.
#[test]
fn matrix_reuse_after_the_check() {
    let t = trace(Scenario::Reuse);
    let occ = occurrences(&t);
    let from = occ
        .iter()
        .position(|(p, _)| p == "forget-written")
        .expect("the first runner is forgotten");
    let to = occ
        .iter()
        .position(|(p, n)| p == "launch-done-written" && *n == 2)
        .expect("a second runner is launched on the VM");
    assert!(
        occ[from..to]
            .iter()
            .any(|(p, _)| p == "check-previous-written"),
        "{t:?}"
    );
    let mine = &occ[from..=to];
    std::thread::scope(|s| {
        for lane in 0..LANES {
            s.spawn(move || {
                for (point, nth) in mine.iter().skip(lane).step_by(LANES) {
                    crash_and_converge(Scenario::Reuse, point, *nth);
                }
            });
        }
    });
}

/// The scenarios together reach every crash point in the code: a point added without a
/// scenario that reaches it fails here.
// Mutation caught: a crash point added that no scenario reaches.
#[test]
fn matrix_covers_every_crash_point() {
    let mut reached: Vec<String> = [
        Scenario::Full,
        Scenario::Unconsumed,
        Scenario::LostPost,
        Scenario::ApplyFails,
        Scenario::StartFailures,
        Scenario::Reuse,
    ]
    .into_iter()
    .flat_map(trace)
    .collect();
    reached.sort();
    reached.dedup();
    let missing: Vec<&&str> = POINTS
        .iter()
        .filter(|p| !reached.iter().any(|r| r == **p))
        .collect();
    assert!(
        missing.is_empty(),
        "crash points no scenario reaches: {missing:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// SIGTERM (systemd's stop) while tofu runs: tofu gets exactly one SIGINT, the run persists and
// exits non-zero, the next run converges.
// ---------------------------------------------------------------------------------------------

/// tofu is `tests/bin/tofu-wrapper.sh`, which records each SIGINT it gets in `$VM_DIR/tofu-sigint`.
fn env_with_tofu_wrapper() -> Env {
    let mut env = Env::new();
    env.tofu = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/bin/tofu-wrapper.sh")
        .to_string_lossy()
        .into_owned();
    env
}

fn sigterm_while(env: &Env, marker: &str) -> (Option<i32>, String) {
    let mut c = env.cmd("run");
    c.env("TOFU_REAL", crate::support::harness::tofu_bin());
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    wait_for(marker, || env.vm.join(marker).exists());
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    (status.code(), stderr)
}

fn sigints(env: &Env) -> Vec<String> {
    fs::read_to_string(env.vm.join("tofu-sigint"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn converge_with_wrapper(env: &Env) {
    for _ in 0..3 {
        let mut c = env.cmd("run");
        c.env("TOFU_REAL", crate::support::harness::tofu_bin());
        let out = env.exec(c);
        if out.code == Some(0) && env.cycle_json().is_none() {
            break;
        }
    }
    env.assert_at_rest();
    assert!(env.fake.jobs().iter().all(|j| j.status == "success"));
}

// Mutation caught: no SIGINT forwarded to tofu on SIGTERM.
#[test]
fn sigterm_during_apply_reaches_tofu_as_one_sigint() {
    let env = env_with_tofu_wrapper();
    env.fake.add_job(&["debian"]);
    env.fault("slow-apply", true);
    let (code, stderr) = sigterm_while(&env, "applying");
    assert_eq!(code, Some(1), "{stderr}");
    let got = sigints(&env);
    assert_eq!(got.len(), 1, "exactly one SIGINT reached tofu: {got:?}");
    assert!(got[0].contains(" apply "), "{got:?}");
    assert!(
        stderr.contains("stopped by a signal during tofu apply"),
        "{stderr}"
    );
    assert_eq!(env.cycle_json().expect("persisted")["phase"], "applying");
    env.fault("slow-apply", false);
    converge_with_wrapper(&env);
}

// Mutation caught: no SIGINT forwarded to tofu on SIGTERM.
#[test]
fn sigterm_during_destroy_reaches_tofu_as_one_sigint() {
    let env = env_with_tofu_wrapper();
    env.fake.add_job(&["debian"]);
    env.fake
        .add_runner("ephemeral-stale", true, Conn::NeverConnected);
    env.fault("slow-destroy", true);
    let (code, stderr) = sigterm_while(&env, "destroying");
    assert_eq!(code, Some(1), "{stderr}");
    let got = sigints(&env);
    assert_eq!(got.len(), 1, "exactly one SIGINT reached tofu: {got:?}");
    assert!(got[0].contains(" destroy "), "{got:?}");
    assert!(
        stderr.contains("stopped by a signal during tofu destroy"),
        "{stderr}"
    );
    assert_eq!(
        env.cycle_json().expect("persisted")["phase"],
        "tearing_down"
    );
    assert_eq!(
        env.our_runners().len(),
        1,
        "no sweep after an interrupted destroy"
    );
    env.fault("slow-destroy", false);
    converge_with_wrapper(&env);
}
