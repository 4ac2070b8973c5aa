//! `run --dry-run --fixture`: the real cycle code against a fixture world; the plan is exact.

use std::path::Path;
use std::process::Command;

use crate::support::harness::{BIN, Env};
use serde_json::{Value, json};

fn plan(fixture: &str, extra: &[&str]) -> (Option<i32>, Value, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(fixture);
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap())
        // Would be used if the dry-run touched the state dir: it must not.
        .env("STATE_DIRECTORY", tmp.path())
        .args(["run", "--dry-run", "--fixture"])
        .arg(&path)
        .args(["--labels", "debian:host", "--output", "json"])
        .args(extra)
        .output()
        .unwrap();
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "a dry-run writes nothing in the state dir"
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr)));
    (
        out.status.code(),
        v,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn actions(v: &Value) -> &Vec<Value> {
    v["actions"].as_array().expect("actions array")
}

#[test]
fn idle_world_plans_nothing() {
    let (code, v, stderr) = plan("idle.json", &[]);
    assert_eq!(code, Some(0));
    assert_eq!(
        v,
        json!({"actions": [], "outcome": "idle", "failures": 0, "errors": []}),
        "nothing to do is exactly this"
    );
    // One document on stdout, how the plan ends included: nothing of it on stderr.
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn an_idle_world_with_warm_capacity_plans_a_vm_and_no_registration() {
    let (code, v, _) = plan("idle.json", &["--warm", "1"]);
    assert_eq!(code, Some(0), "{v}");
    let names: Vec<&str> = actions(&v)
        .iter()
        .map(|a| a["action"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(names, ["tofu_apply"], "{v}");
    assert_eq!(
        v["outcome"], "would_wait: warm VM up, waiting for a job",
        "{v}"
    );
}

#[test]
fn fresh_cycle_applies_and_registers_for_the_matching_job() {
    let (code, v, _) = plan("fresh-cycle.json", &[]);
    assert_eq!(code, Some(0));
    let a = actions(&v);
    assert_eq!(a.len(), 2, "{v}");
    assert_eq!(a[0], json!({"action": "tofu_apply"}));
    assert_eq!(a[1]["action"], "register_runner");
    assert_eq!(a[1]["job_id"], 901, "the debian job, not the gpu one");
    let name = a[1]["name"].as_str().unwrap();
    assert!(
        name == "ephemeral-20261014t153000z-dryrun-1-20261014t153000z",
        "{name}"
    );
}

#[test]
fn fresh_cycle_with_other_labels_is_idle() {
    let (code, v, _) = plan("fresh-cycle.json", &["--labels", "arm64"]);
    assert_eq!(code, Some(0));
    assert_eq!(v["actions"], json!([]));
}

#[test]
fn reuse_deletes_the_unconsumed_registration_before_registering_again() {
    let (code, v, _) = plan("reuse-unconsumed.json", &[]);
    assert_eq!(code, Some(0));
    let a = actions(&v);
    // Its runner is stopped first: a deleted registration does not end `one-job --wait`.
    assert_eq!(
        a[0],
        json!({"action": "stop_runner", "runner_id": 514, "name": "ephemeral-20261014t150000z-5c1d-2"})
    );
    assert_eq!(
        a[1],
        json!({"action": "delete_runner", "runner_id": 514, "name": "ephemeral-20261014t150000z-5c1d-2", "reason": "unconsumed"})
    );
    // Stopped: no check of it before the next runner.
    assert_eq!(a[2]["action"], "register_runner");
    assert_eq!(a[2]["job_id"], 903);
    assert_eq!(a.len(), 3, "{v}");
}

/// A bundled fixture's world, to change for a test.
fn world_of(fixture: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures")
                .join(fixture),
        )
        .unwrap(),
    )
    .unwrap()
}

/// The JSON plan of a dry-run on `world` (labels `debian`), which must exit 0.
fn plan_of_world(world: &Value, extra: &[&str]) -> Value {
    let tmp = tempfile::tempdir().unwrap();
    let fixture = tmp.path().join("world.json");
    std::fs::write(&fixture, world.to_string()).unwrap();
    let out = Command::new(BIN)
        .args([
            "run",
            "--dry-run",
            "--output",
            "json",
            "--labels",
            "debian",
            "--fixture",
        ])
        .arg(&fixture)
        .args(extra)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_registration_whose_runner_never_connected_is_deleted_as_a_failed_start() {
    // The same world, but the runner was never seen up (and Forgejo shows no version): its
    // launch exited 0, yet nothing connected.
    let mut world = world_of("reuse-unconsumed.json");
    world["cycle"]["registrations"][0]["connected"] = json!(false);
    world["runners"][0]["version"] = json!("");
    world["runners"][0]["labels"] = Value::Null;
    let v = plan_of_world(&world, &[]);
    let a = actions(&v);
    assert_eq!(
        a[0],
        json!({"action": "stop_runner", "runner_id": 514, "name": "ephemeral-20261014t150000z-5c1d-2"})
    );
    assert_eq!(
        a[1],
        json!({"action": "delete_runner", "runner_id": 514, "name": "ephemeral-20261014t150000z-5c1d-2", "reason": "never_connected"})
    );
    // One failed start is not yet a broken VM: the next job gets a runner.
    assert_eq!(a[2]["action"], "register_runner", "{v}");
}

#[test]
fn within_the_grace_an_offline_registration_is_left_alone() {
    // The same world, five minutes after launch: with a 30 m grace it is still "starting".
    let (code, v, stderr) = plan("reuse-unconsumed.json", &["--registration-grace", "30m"]);
    assert_eq!(code, Some(0));
    assert_eq!(v["actions"], json!([]));
    let ends = v["outcome"].as_str().unwrap();
    assert!(
        ends.starts_with("would_wait") && ends.contains("514"),
        "{v}"
    );
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn reuse_after_a_consumed_registration_checks_its_runner_then_registers() {
    let (code, v, _) = plan("reuse-consumed.json", &[]);
    assert_eq!(code, Some(0));
    let a = actions(&v);
    assert_eq!(a.len(), 2, "{v}");
    // A vanished registration is not an exited runner: its process is checked first.
    assert_eq!(
        a[0],
        json!({"action": "check_runner", "runner_id": 526, "name": "ephemeral-20261014t150000z-5c1d-2"})
    );
    assert_eq!(a[1]["action"], "register_runner");
    assert_eq!(
        a[1]["name"],
        "ephemeral-20261014t150000z-5c1d-3-20261014t153000z"
    );
}

#[test]
fn a_job_of_another_repository_tears_the_vm_down_for_a_fresh_one() {
    let mut world = world_of("reuse-consumed.json");
    world["jobs"][0]["repo_id"] = json!(2);
    let run = |extra: &[&str]| plan_of_world(&world, extra);
    let v = run(&[]);
    assert_eq!(
        actions(&v)[0],
        json!({"action": "tofu_destroy", "reason": "job 903 is outside this VM's trust boundary (--reuse-within repo): it gets a fresh VM"}),
        "{v}"
    );
    // The same owner: `owner` and `pool` reuse the VM.
    for within in ["owner", "pool"] {
        let v = run(&["--reuse-within", within]);
        assert_eq!(actions(&v)[1]["action"], "register_runner", "{within}: {v}");
    }
}

#[test]
fn teardown_destroys_then_sweeps_only_stale_offline_prefixed_registrations() {
    let (code, v, _) = plan("teardown-stale.json", &[]);
    assert_eq!(code, Some(0));
    let mut want = vec![json!({
        "action": "tofu_destroy",
        "reason": "idle timeout: no job waited while the VM was free"
    })];
    for (id, name) in [
        (106, "ephemeral-20261003t080000z-0b9e-1"),
        (424, "ephemeral-20261013t090000z-77c1-4"),
        (514, "ephemeral-20261014t101500z-3f2a-1"),
        (516, "ephemeral-20261014t101500z-3f2a-2"),
        (518, "ephemeral-20261014t101500z-3f2a-3"),
    ] {
        want.push(
            json!({"action": "delete_runner", "runner_id": id, "name": name, "reason": "sweep"}),
        );
    }
    assert_eq!(actions(&v), &want);
    let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        ["actions", "errors", "failures", "outcome"],
        "the plan, how it ends, its errors"
    );
    assert_eq!(v["outcome"], "cycle_finished", "{v}");
}

#[test]
fn job_cap_and_cycle_age_force_teardown() {
    let (_, v, _) = plan("reuse-consumed.json", &["--max-jobs-per-vm", "1"]);
    assert_eq!(
        actions(&v)[0],
        json!({"action": "tofu_destroy", "reason": "job cap reached (--max-jobs-per-vm)"}),
        "{v}"
    );
    let (_, v, _) = plan("reuse-consumed.json", &["--max-cycle-duration", "10m"]);
    assert_eq!(
        actions(&v)[0],
        json!({"action": "tofu_destroy", "reason": "cycle reached --max-cycle-duration"}),
        "{v}"
    );
}

#[test]
fn a_plan_that_ends_in_a_failure_teardown_still_exits_0() {
    // The fixture's cycle is 30 minutes old: past a 20 minute hard deadline.
    let (code, v, stderr) = plan(
        "reuse-consumed.json",
        &["--hard-deadline", "20m", "--max-cycle-duration", "10m"],
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        actions(&v)[0],
        json!({"action": "tofu_destroy", "reason": "cycle passed --hard-deadline; tearing down even with a runner up"}),
        "{v}"
    );
}

#[test]
fn failed_destroy_is_retried_first() {
    let (code, v, _) = plan("failed-destroy.json", &[]);
    assert_eq!(code, Some(0));
    let a = actions(&v);
    // Said so: a plan that retries a failed destroy is not teardown-stale's first destroy.
    assert_eq!(
        a[0],
        json!({"action": "tofu_destroy", "reason": "retrying a failed destroy (idle timeout: no job waited while the VM was free)"})
    );
    assert_eq!(a.len(), 6, "{v}");
    assert!(a[1..].iter().all(|x| x["reason"] == "sweep"));
    let (_, stale, _) = plan("teardown-stale.json", &[]);
    assert_ne!(actions(&stale)[0], a[0]);
}

#[test]
fn every_bundled_fixture_plans_cleanly_in_text_too() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let out = Command::new(BIN)
            .args(["run", "--dry-run", "--fixture"])
            .arg(&path)
            .args(["--labels", "debian:host"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", path.display());
        assert!(
            String::from_utf8_lossy(&out.stdout).starts_with("plan"),
            "{}",
            path.display()
        );
        n += 1;
    }
    assert!(n >= 6);
}

#[test]
fn broken_fixture_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("broken.json");
    std::fs::write(
        &f,
        r#"{"cycle": {"version": 7}, "runners": [], "jobs": []}"#,
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["run", "--dry-run", "--fixture"])
        .arg(&f)
        .args(["--labels", "debian"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("broken.json") && err.contains("version 7"),
        "{err}"
    );
}

/// One exit status for a broken fixture, whichever field is wrong: 2, as for any usage error,
/// with the fixture and the field named, and no plan.
// Mutation caught: a fixture's rows not checked at load (a broken row exits 1).
#[test]
fn every_broken_fixture_exits_2_naming_what_is_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("broken.json");
    let runner = r#"{"id": 5, "name": "ephemeral-x-1", "status": "offline"}"#;
    for (text, says) in [
        ("{", "is not valid JSON"),
        ("[]", "is not a JSON object"),
        (r#"{"runners": {}, "jobs": []}"#, "\"runners\" in fixture"),
        (r#"{"runners": [], "jobs": 3}"#, "\"jobs\" in fixture"),
        (
            r#"{"runners": [], "jobs": [], "now": "yesterday"}"#,
            "\"now\" in fixture",
        ),
        (
            r#"{"runners": [], "jobs": [], "cycle": {"version": 7}}"#,
            "version 7",
        ),
        (
            &format!(r#"{{"runners": [{runner}, {{"name": "no-id"}}], "jobs": []}}"#),
            "\"runners\"[1] in fixture",
        ),
        (
            &format!(r#"{{"runners": [{runner}, 7], "jobs": []}}"#),
            "\"runners\"[1] in fixture",
        ),
        (
            r#"{"runners": [], "jobs": [{"id": 1, "handle": "h"}]}"#,
            "\"jobs\"[0] in fixture",
        ),
        (
            r#"{"runners": [], "jobs": [{"id": 1, "status": "waiting", "runs_on": [1]}]}"#,
            "\"jobs\"[0] in fixture",
        ),
        (
            r#"{"runners": [], "jobs": [{"status": "waiting"}]}"#,
            "\"jobs\"[0] in fixture",
        ),
    ] {
        std::fs::write(&f, text).unwrap();
        for sub in ["run", "sweep"] {
            let mut c = Command::new(BIN);
            c.args([sub, "--dry-run", "--fixture"]).arg(&f);
            if sub == "run" {
                c.args(["--labels", "debian"]);
            }
            let out = c.output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{sub} {text}: {err}");
            assert!(
                err.contains("broken.json") && err.contains(says),
                "{sub} {text}: {err}"
            );
            assert!(out.stdout.is_empty(), "{sub} {text}: no plan is printed");
        }
    }
}

#[test]
fn an_empty_or_misspelled_fixture_is_an_error_not_an_idle_world() {
    let tmp = tempfile::tempdir().unwrap();
    for (text, says) in [
        ("{}", "has no \"runners\" key"),
        (
            r#"{"job": [], "runners": []}"#,
            "unknown key \"job\" (did you mean \"jobs\"?)",
        ),
    ] {
        let f = tmp.path().join("world.json");
        std::fs::write(&f, text).unwrap();
        for sub in ["run", "sweep"] {
            let mut c = Command::new(BIN);
            c.args([sub, "--dry-run", "--fixture"]).arg(&f);
            if sub == "run" {
                c.args(["--labels", "debian"]);
            }
            let out = c.output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{sub} {text}: {err}");
            assert!(err.contains(says), "{sub} {text}: {err}");
            assert!(out.stdout.is_empty(), "no plan is printed");
        }
    }
}

#[test]
fn fixture_requires_dry_run() {
    let out = Command::new(BIN)
        .args([
            "run",
            "--fixture",
            "fixtures/idle.json",
            "--labels",
            "debian",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_changed_prefix_does_not_strand_the_cycles_own_registrations() {
    // The cycle was started (and its registrations named) with `ephemeral-`; the operator has
    // since switched to `pool2-`. The cycle still deletes its unconsumed registration and keeps
    // naming new ones with its own prefix.
    let (code, v, _) = plan("reuse-unconsumed.json", &["--runner-prefix", "pool2-"]);
    assert_eq!(code, Some(0));
    let a = actions(&v);
    assert_eq!(
        a[1],
        json!({"action": "delete_runner", "runner_id": 514, "name": "ephemeral-20261014t150000z-5c1d-2", "reason": "unconsumed"})
    );
    assert!(
        a[2]["name"].as_str().unwrap().starts_with("ephemeral-"),
        "{v}"
    );
}

#[test]
fn planned_deletions_keep_every_page_count_equal() {
    // A teardown with an unanswered POST and enough runners for two list pages: the plan deletes
    // registration 5 (page 1), then looks the lost POST up; the listing must still be complete.
    let tmp = tempfile::tempdir().unwrap();
    let fixture = tmp.path().join("two-pages.json");
    let runner = |id: i64, name: &str, status: &str| {
        json!({"id": id, "uuid": format!("u-{id}"), "owner_id": 0, "repo_id": 0, "name": name,
               "status": status, "version": "", "labels": null, "description": "", "ephemeral": true})
    };
    let mut runners = vec![runner(5, "ephemeral-20261014t150000z-5c1d-1", "offline")];
    for i in 0..59 {
        runners.push(runner(100 + i, &format!("static-{i}"), "idle"));
    }
    let reg = |id: serde_json::Value, seq: u32| {
        json!({"name": format!("ephemeral-20261014t150000z-5c1d-{seq}"), "id": id, "uuid": null,
               "job_id": 1, "job_handle": "h", "requested_at": "2026-10-14T15:10:00.000Z",
               "launch": "pending", "launched_at": null, "job_gone_since": null})
    };
    let world = json!({
        "cycle": {"version": 1, "cycle_id": "20261014t150000z-5c1d", "runner_prefix": "ephemeral-",
                  "started_at": "2026-10-14T15:00:00.000Z", "phase": "tearing_down",
                  "vm_ready_at": "2026-10-14T15:01:00.000Z", "free_since": null, "jobs_started": 1,
                  "next_seq": 3, "start_failures": 1, "registrations": [reg(json!(5), 1), reg(json!(null), 2)],
                  "teardown_reason": "idle", "destroyed_at": null, "last_error": null, "outputs": {}},
        "runners": runners,
        "jobs": null,
        "now": "2026-10-14T15:30:00Z"
    });
    std::fs::write(&fixture, world.to_string()).unwrap();
    let out = Command::new(BIN)
        .args(["run", "--dry-run", "--fixture"])
        .arg(&fixture)
        .args(["--labels", "debian"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("then: cycle_finished"), "{stdout}");
    assert!(!stdout.contains("error"), "{stdout}");
}

#[test]
fn a_dry_sweep_of_a_fixture_with_a_cycle_in_progress_is_refused() {
    // A VM may exist while a cycle is in progress: no licence, no plan, exit 1.
    let out = Command::new(BIN)
        .args([
            "sweep",
            "--dry-run",
            "--fixture",
            "fixtures/reuse-consumed.json",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "cycle 20261014t150000z-5c1d is in progress (the fixture): a VM may still exist, so the sweep is refused"
        ),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "no plan is printed");
}

#[test]
fn a_dry_sweep_is_refused_by_a_cycle_in_progress_before_forgejo_is_asked() {
    // The state directory holds a cycle in progress: the refusal comes first, before the HTTP
    // client is built (its --ca-file does not even exist) or Forgejo is asked anything.
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string("fixtures/reuse-consumed.json").unwrap())
            .unwrap();
    std::fs::write(state.join("cycle.json"), fixture["cycle"].to_string()).unwrap();
    let token = tmp.path().join("token");
    std::fs::write(&token, "t0k3n\n").unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let out = Command::new(BIN)
        .args(["sweep", "--dry-run", "--forgejo-url", "http://127.0.0.1:9"])
        .arg("--token-file")
        .arg(&token)
        .arg("--state-dir")
        .arg(&state)
        .arg("--ca-file")
        .arg(tmp.path().join("no-such-ca.pem"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cycle 20261014t150000z-5c1d is in progress")
            && err.contains("so the sweep is refused"),
        "{err}"
    );
    assert!(!err.contains("--ca-file"), "{err}");
    assert!(out.stdout.is_empty(), "no plan is printed");
}

/// A dry-run against Forgejo itself (the fake), with the harness's flags and `extra`.
fn live_dry(env: &Env, sub: &str, extra: &[&str]) -> crate::support::harness::Outcome {
    let mut c = env.cmd(sub);
    c.arg("--dry-run");
    c.args(extra);
    env.exec(c)
}

// Mutation caught (#32, point 2): a failed read counted twice (its consequence, "the next run
// asks again", as a second error), or its message left out of the JSON plan.
#[test]
fn a_forgejo_that_does_not_resolve_is_one_error_with_its_message_and_a_dns_hint() {
    let env = Env::new();
    let out = live_dry(
        &env,
        "run",
        &[
            "--forgejo-url",
            "https://forgejo.invalid",
            "--output",
            "json",
        ],
    );
    assert_eq!(out.code, Some(1), "{out:?}");
    let doc = out.json();
    assert_eq!(doc["failures"], 1, "a count, as it always was: {doc}");
    let errors = doc["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 1, "{doc}");
    let f = errors[0].as_str().unwrap();
    assert!(
        f.starts_with("asking Forgejo for jobs failed: GET https://forgejo.invalid/api/v1/")
            && f.contains("the host name of --forgejo-url does not resolve"),
        "{doc}"
    );
    assert!(!out.stderr.contains("next run"), "{out:?}");
    let out = live_dry(&env, "run", &["--forgejo-url", "https://forgejo.invalid"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stdout.starts_with("plan: none: the dry-run could not read what it plans on (failed)\n1 error(s), logged above"),
        "{out:?}"
    );
}

// Mutation caught: a dry sweep that could not list the registrations printed as "nothing to do
// (would_sweep)"; its outcome would_sweep, not failed.
#[test]
fn a_dry_sweep_that_cannot_list_says_so_and_fails() {
    let env = Env::new();
    let out = live_dry(&env, "sweep", &["--forgejo-url", "https://forgejo.invalid"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stdout.starts_with(
            "plan: none: the dry-run could not list the registrations (failed)\n1 error(s), logged above"
        ),
        "{out:?}"
    );
    let out = live_dry(
        &env,
        "sweep",
        &[
            "--forgejo-url",
            "https://forgejo.invalid",
            "--output",
            "json",
        ],
    );
    let doc = out.json();
    assert_eq!(
        (doc["outcome"].as_str(), &doc["failures"]),
        (Some("failed"), &1.into()),
        "{doc}"
    );
}

// Mutation caught (#32, point 3): a dry-run that plans tofu_apply and exits 0 where a live run
// with the same flags is refused (no tofu, no module, no launch command).
#[test]
fn a_dry_run_stops_where_a_live_run_would_refuse_its_tofu_or_launch_command() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    let nowhere = env.tmp.path().join("no-such-module");
    for (flags, says) in [
        (
            vec!["--tofu-bin", "no-such-tofu"],
            "--tofu-bin no-such-tofu is not an executable".to_string(),
        ),
        (
            vec!["--tofu-dir", nowhere.to_str().unwrap()],
            format!("--tofu-dir {} is not a directory", nowhere.display()),
        ),
        (
            vec!["--launch-command", "/no/such/launch"],
            "--launch-command /no/such/launch is not an executable file".to_string(),
        ),
    ] {
        let out = live_dry(&env, "run", &flags);
        assert_eq!(out.code, Some(2), "{flags:?}: {out:?}");
        assert!(
            out.stdout.contains(&format!(
                "a live run stops here (exit 2): a job is waiting but {says}"
            )),
            "{flags:?}: {out:?}"
        );
        assert!(!out.stdout.contains("tofu_apply"), "{flags:?}: {out:?}");
        let mut json = flags.clone();
        json.extend(["--output", "json"]);
        let doc = live_dry(&env, "run", &json).json();
        assert_eq!(doc["outcome"], "configuration_error", "{doc}");
        assert!(doc["errors"][0].as_str().unwrap().contains(&says), "{doc}");
    }
    // With every flag right, the same world plans the VM (exit 0).
    let out = live_dry(&env, "run", &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("  tofu_apply\n"), "{out:?}");
    assert!(env.fake.requests().iter().all(|r| r.method == "GET"));
    assert!(env.vm_log().is_empty(), "{}", env.vm_log());
}

// Mutation caught (#32, point 9): an empty sweep plan printed as "nothing to do (would_sweep)".
#[test]
fn a_dry_sweep_with_nothing_to_delete_says_what_it_looked_at() {
    let out = Command::new(BIN)
        .args(["sweep", "--dry-run", "--fixture", "fixtures/idle.json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert_eq!(
        stdout,
        "plan: nothing to delete (3 registration(s) listed, none of them ours, offline and old enough to sweep)\n"
    );
}
