//! `check --boot`, the canary: one VM of the pool's module (the test module, real tofu), probed by
//! the launch command (`RUNNER_ACTION=probe`, tests/bin/launch.sh), destroyed whatever happened;
//! never beside a cycle; a canary killed half-way is destroyed by the next run or canary. Real
//! HTTP to the fake Forgejo, which the canary only reads (no registration).

use std::fs;
use std::process::Stdio;

use crate::support::harness::{Env, Outcome, kill_like_systemd, wait_for};

/// The `boot` line of `check`'s text output.
fn boot_line(out: &Outcome) -> &str {
    out.stdout
        .lines()
        .find(|l| l[6.min(l.len())..].starts_with("boot:"))
        .unwrap_or_else(|| panic!("no boot line in:\n{out:?}"))
}

fn check_boot(env: &Env, extra: &[&str]) -> Outcome {
    let mut c = env.cmd("check");
    c.arg("--boot").args(extra);
    env.exec(c)
}

/// Only GETs reached Forgejo: the canary registers nothing and deletes nothing.
fn only_reads(env: &Env) {
    let writes: Vec<String> = env
        .fake
        .requests()
        .iter()
        .filter(|r| r.method != "GET")
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(writes.is_empty(), "the canary wrote to Forgejo: {writes:?}");
}

#[test]
fn a_vm_that_boots_with_a_usable_runner_passes_and_is_gone() {
    let env = Env::new();
    let out = check_boot(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let l = boot_line(&out);
    assert!(l.starts_with("ok    boot: "), "{l}");
    for part in [
        "forgejo-runner version v12.8.2",
        "(forgejo-runner 12.8.2)",
        "apply ",
        "ready in ",
        "destroy ",
    ] {
        assert!(l.contains(part), "{part:?} missing: {l}");
    }
    assert!(out.stdout.contains("all 9 checks passed"), "{out:?}");
    // One VM made and destroyed; nothing at rest, nothing asked of Forgejo but reads.
    let log = env.vm_log();
    assert_eq!(log.matches("create ").count(), 1, "{log}");
    assert_eq!(log.matches("destroy ").count(), 1, "{log}");
    assert!(log.contains("-canary"), "{log}");
    env.assert_at_rest();
    only_reads(&env);
    // The probe's environment: the VM's outputs, no runner, no job, no token.
    let probe = fs::read_to_string(env.vm.join("probe-env")).unwrap();
    assert!(probe.contains("RUNNER_ACTION=probe\n"), "{probe}");
    assert!(probe.contains("TOFU_OUTPUT_ADDRESS=127.0.0.1\n"), "{probe}");
    assert!(probe.contains("RUNNER_LABELS=debian:host\n"), "{probe}");
    for absent in ["RUNNER_ID=", "RUNNER_UUID=", "JOB_HANDLE=", "JOB_ID="] {
        assert!(
            !probe.contains(absent),
            "{absent} in the probe's env:\n{probe}"
        );
    }
    assert!(!probe.contains(crate::support::harness::API_TOKEN));
    // The JSON output has the steps and their durations.
    let out = check_boot(&env, &["--output", "json"]);
    let doc = out.json();
    let boot = doc["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "boot")
        .cloned()
        .unwrap();
    assert_eq!(boot["ok"], true, "{boot}");
    for step in ["apply", "probe", "destroy"] {
        assert_eq!(boot["steps"][step]["ok"], true, "{boot}");
        assert!(boot["steps"][step]["seconds"].is_number(), "{boot}");
    }
    assert_eq!(
        boot["steps"]["probe"]["detail"],
        "forgejo-runner version v12.8.2"
    );
}

// Mutation caught: judge_runner without its 12.8 floor (the canary passed v12.7.3).
#[test]
fn a_runner_older_than_12_8_fails_and_the_vm_goes() {
    let env = Env::new();
    fs::write(env.vm.join("probe-mode"), "old").unwrap();
    let out = check_boot(&env, &[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = boot_line(&out);
    assert!(l.starts_with("FAIL  boot: "), "{l}");
    assert!(l.contains("12.7.3 on the VM is older than 12.8"), "{l}");
    assert!(env.vm_log().contains("destroy "), "{}", env.vm_log());
    env.assert_at_rest();
}

// Mutation caught: the canary returning before its teardown when the probe fails (the VM was
// left running, cycle.json kept).
#[test]
fn a_vm_that_fails_the_probe_is_destroyed_all_the_same() {
    let env = Env::new();
    fs::write(env.vm.join("probe-mode"), "fail").unwrap();
    let out = check_boot(&env, &[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = boot_line(&out);
    assert!(l.contains("did not pass the probe"), "{l}");
    assert!(l.contains("sshd on the VM never answered"), "{l}");
    env.assert_at_rest();
    // And an apply that fails: destroyed too (whatever of the VM exists).
    env.fault("fail-apply", true);
    let out = check_boot(&env, &[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let l = boot_line(&out);
    assert!(l.contains("tofu apply failed"), "{l}");
    // (tofu runs no destroy provisioner of a resource whose create failed: the destroy is
    // tofu's alone here.)
    assert!(l.contains(", destroy "), "the destroy did not run: {l}");
    env.assert_at_rest();
}

#[test]
fn nothing_is_booted_when_a_check_before_it_fails() {
    let env = Env::new();
    let out = check_boot(&env, &["--launch-command", "/nonexistent/launch"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        boot_line(&out).contains("not booted: fix the failures above first"),
        "{out:?}"
    );
    assert!(env.vm_log().is_empty(), "{}", env.vm_log());
}

// Mutation caught: `core::canary::before` letting the canary run beside a cycle (it booted a
// second VM into the slot of a cycle whose destroy had failed).
#[test]
fn the_canary_never_runs_beside_a_cycle_or_a_run() {
    let env = Env::new();
    // A cycle in progress: its destroy fails, so cycle.json stays.
    env.fake.add_job(&["debian"]);
    env.fault("fail-destroy", true);
    let run = env.run(&[]);
    assert_eq!(run.code, Some(1), "{run:?}");
    let cycle = env.cycle_json().expect("a cycle in progress")["cycle_id"]
        .as_str()
        .unwrap()
        .to_string();
    let creates = env.vm_log().matches("create ").count();
    let out = check_boot(&env, &[]);
    assert_eq!(out.code, Some(75), "{out:?}");
    let l = boot_line(&out);
    assert!(
        l.contains(&format!("not booted: cycle {cycle} is in progress")),
        "{l}"
    );
    assert_eq!(env.vm_log().matches("create ").count(), creates);
    assert_eq!(env.cycle_json().unwrap()["cycle_id"], cycle.as_str());
    // The cycle converges; then a run that holds the lock keeps the canary out too.
    env.fault("fail-destroy", false);
    assert_eq!(env.run(&[]).code, Some(0));
    env.assert_at_rest();
    let _lock = ci_ephemeral_provisioner::adapters::files::lock_state_dir(&env.state)
        .unwrap_or_else(|_| panic!("lock"));
    let out = check_boot(&env, &[]);
    assert_eq!(out.code, Some(75), "{out:?}");
    assert!(
        boot_line(&out).contains("a run of this slot is going on"),
        "{out:?}"
    );
    assert_eq!(env.vm_log().matches("create ").count(), creates);
}

/// Starts `check --boot` with the probe hanging, and SIGKILLs it (and its children, as systemd
/// would) once the probe runs: the canary's VM is up and cycle.json holds it.
fn killed_canary(env: &Env) -> String {
    killed_canary_seen(env, &[], || ())
}

/// [`killed_canary`] with `extra` flags, calling `seen` while the canary's VM is up.
fn killed_canary_seen(env: &Env, extra: &[&str], seen: impl FnOnce()) -> String {
    fs::write(env.vm.join("probe-mode"), "hang").unwrap();
    let mut c = env.cmd("check");
    c.arg("--boot")
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .stdin(Stdio::null());
    let mut child = c.spawn().unwrap();
    wait_for("the canary's probe", || {
        fs::read_to_string(env.vm.join("actions.log"))
            .unwrap_or_default()
            .contains("probe")
    });
    seen();
    kill_like_systemd(&mut child);
    fs::remove_file(env.vm.join("probe-mode")).unwrap();
    let s = env.cycle_json().expect("the killed canary's cycle.json");
    assert_eq!(s["canary"], true, "{s}");
    assert_eq!(env.live_vms().len(), 1, "{}", env.vm_log());
    s["cycle_id"].as_str().unwrap().to_string()
}

// Mutation caught: the planner's canary rule removed (the next run applied the canary's
// cycle again and served a job on its VM instead of destroying it).
#[test]
fn a_canary_killed_half_way_is_destroyed_by_the_next_run() {
    let env = Env::new();
    let id = killed_canary(&env);
    env.fake.add_job(&["debian"]);
    let out = env.run(&[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stderr
            .contains("the VM of a `check --boot` that did not finish"),
        "{out:?}"
    );
    assert!(
        env.vm_log().contains(&format!("destroy {id}")),
        "{}",
        env.vm_log()
    );
    // No runner was started on the canary's VM (the job waits for a cycle of its own).
    assert!(
        !fs::read_to_string(env.vm.join("actions.log"))
            .unwrap_or_default()
            .contains("start"),
        "a runner started on the canary's VM"
    );
    // The next run serves the job on a VM of its own and the pool is at rest.
    assert_eq!(env.run(&[]).code, Some(0));
    env.assert_at_rest();
}

#[test]
fn a_canary_killed_half_way_is_destroyed_by_the_next_canary() {
    let env = Env::new();
    let id = killed_canary(&env);
    let out = check_boot(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let l = boot_line(&out);
    assert!(
        l.contains(&format!("first destroyed leftover canary {id}")),
        "{l}"
    );
    let log = env.vm_log();
    assert_eq!(log.matches("create ").count(), 2, "{log}");
    assert_eq!(log.matches("destroy ").count(), 2, "{log}");
    env.assert_at_rest();
    only_reads(&env);
}

/// The value of `ci_ephemeral_provisioner_NAME` (no labels) in a metrics file.
fn metric(path: &std::path::Path, name: &str) -> f64 {
    let text = fs::read_to_string(path).unwrap();
    let key = format!("ci_ephemeral_provisioner_{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
        .parse()
        .unwrap()
}

// Mutation caught: the canary leaving the metrics file alone (its VM not in cycle_active, the
// dashboard's "VMs up" short by one while it runs), or not rewriting it once the VM is gone.
#[test]
fn the_canarys_vm_counts_in_cycle_active_while_it_may_exist() {
    let env = Env::new();
    let prom = env.tmp.path().join("metrics.prom");
    let flag = ["--metrics-file", prom.to_str().unwrap()];
    killed_canary_seen(&env, &flag, || {
        assert_eq!(metric(&prom, "cycle_active"), 1.0, "the canary's VM is up");
        assert_eq!(metric(&prom, "cycle_warm"), 0.0);
    });
    // Killed with its VM up: still counted. The next canary destroys it, boots its own and
    // destroys that: none is left, none counted.
    assert_eq!(metric(&prom, "cycle_active"), 1.0);
    let out = check_boot(&env, &flag);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(metric(&prom, "cycle_active"), 0.0);
    env.assert_at_rest();
}
