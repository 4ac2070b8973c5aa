//! End-to-end: the built binary, the fake Forgejo on 127.0.0.1, the real terraform/tofu CLI.

use std::fs;
use std::time::Duration;

use crate::support::fake_forgejo::{Conn, Fault};
use crate::support::harness::{API_TOKEN, Env, wait_for, walk};

fn posts(env: &Env) -> usize {
    env.fake
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/actions/runners"))
        .count()
}

fn deletes(env: &Env) -> Vec<i64> {
    env.fake
        .requests()
        .iter()
        .filter(|r| r.method == "DELETE")
        .filter_map(|r| r.path.rsplit('/').next()?.parse().ok())
        .collect()
}

#[test]
fn idle_tick_is_one_request_and_touches_nothing() {
    let env = Env::new();
    env.fake
        .add_runner("ephemeral-stale", true, Conn::NeverConnected);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let reqs = env.fake.requests();
    assert_eq!(
        reqs.len(),
        1,
        "the idle tick is exactly one request: {reqs:?}"
    );
    assert_eq!(reqs[0].method, "GET");
    assert_eq!(reqs[0].path, "/api/v1/admin/actions/runners/jobs");
    assert_eq!(reqs[0].query, "labels=debian");
    assert_eq!(
        reqs[0].authorization.as_deref(),
        Some(&*format!("token {API_TOKEN}"))
    );
    assert_eq!(out.json()["outcome"], "idle");
    assert!(env.cycle_json().is_none());
    assert!(env.vm_log().is_empty(), "no VM on an idle tick");
    // Without a destroy in this run there is no sweep: the stale registration stays.
    assert_eq!(env.our_runners().len(), 1);
}

#[test]
fn full_cycle_runs_every_waiting_job_and_ends_with_nothing() {
    let env = Env::new();
    let (j1, _) = env.fake.add_job(&["debian"]);
    let (j2, _) = env.fake.add_job(&["debian"]);
    let (gpu, _) = env.fake.add_job(&["gpu"]);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report = out.json();
    assert_eq!(report["outcome"], "cycle_finished");
    for j in env.fake.jobs() {
        let want = if j.id == gpu { "waiting" } else { "success" };
        assert_eq!(j.status, want, "job {} ({:?})", j.id, j.runs_on);
    }
    assert!(
        [j1, j2]
            .iter()
            .all(|j| env.fake.jobs().iter().any(|x| x.id == *j))
    );
    assert_eq!(posts(&env), 2, "one registration per waiting job");
    env.assert_at_rest();
    let log = env.vm_log();
    assert_eq!(
        log.matches("create ").count(),
        1,
        "one VM reused for both jobs: {log}"
    );
    assert_eq!(log.matches("destroy ").count(), 1, "{log}");
    // The runner got its token through the launch command's stdin (the fake checked it).
    let launched: Vec<i64> = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["step"] == "launch_runner" && e["ok"] == true)
        .map(|e| e["runner_id"].as_i64().unwrap())
        .collect();
    assert_eq!(launched.len(), 2);
    assert!(launched.iter().all(|id| env.fake.token_was_presented(*id)));
    // Names carry the prefix and the cycle id; the cycle id reached tofu.
    let cycle_id = report["cycle_id"].as_str().unwrap().to_string();
    assert!(log.contains(&format!("create {cycle_id}")), "{log}");
    let status = env.exec(env.cmd("status"));
    assert_eq!(status.code, Some(0));
    assert!(status.stdout.contains("cycle: none"), "{status:?}");
    assert!(status.stdout.contains("cycle_finished"), "{status:?}");
}

/// The incident behind this project: registrations 514, 516, 518, 424 and 106 leaked. After a
/// destroy they are swept; an idle ephemeral runner, an offline static-builder and an offline
/// my-ephemeral-1 are not. They are spread over several list pages.
fn seed_incident(env: &Env) {
    for id in [106, 424, 514, 516, 518] {
        env.fake.add_runner_with_id(
            id,
            &format!("ephemeral-old-{id}"),
            true,
            Conn::NeverConnected,
        );
    }
    env.fake
        .add_runner_with_id(600, "ephemeral-live", true, Conn::Idle);
    env.fake.add_runner_with_id(
        601,
        "static-builder",
        false,
        Conn::OfflineFor(Duration::from_secs(600)),
    );
    env.fake
        .add_runner_with_id(602, "my-ephemeral-1", true, Conn::NeverConnected);
    env.fake
        .add_runner_with_id(603, "ephemeral-busy", true, Conn::Active);
    for i in 0..140 {
        env.fake.add_runner(
            &format!("static-{i:03}"),
            false,
            Conn::OfflineFor(Duration::from_secs(600)),
        );
    }
}

#[test]
fn seed_incident_stale_registrations_are_swept_after_destroy() {
    let env = Env::new();
    seed_incident(&env);
    env.fake.add_job(&["debian"]);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let mut swept = env.fake.deleted_ids();
    swept.sort();
    assert_eq!(swept, vec![106, 424, 514, 516, 518], "{out:?}");
    for keep in [600, 601, 602, 603] {
        assert!(
            env.fake.runner(keep).is_some(),
            "runner {keep} must survive"
        );
    }
    let sweep = &out.json()["sweep"];
    assert!(sweep["pages"].as_u64().unwrap() >= 3, "{sweep}");
    assert_eq!(sweep["deleted"].as_array().unwrap().len(), 5);
    // The sweep came after the destroy.
    let log = env.vm_log();
    assert!(log.contains("destroy "), "{log}");
    let list_pages: Vec<String> = env
        .fake
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path == "/api/v1/admin/actions/runners")
        .map(|r| r.query.clone())
        .collect();
    assert!(
        list_pages
            .iter()
            .all(|q| q.contains("limit=50") && q.contains("page=")),
        "{list_pages:?}"
    );
}

#[test]
fn failed_destroy_keeps_cycle_and_sweeps_nothing_then_converges() {
    let env = Env::new();
    seed_incident(&env);
    env.fake.add_job(&["debian"]);
    env.fault("fail-destroy", true);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        env.fake.deleted_ids().is_empty(),
        "no sweep after a failed destroy"
    );
    let cycle = env.cycle_json().expect("cycle.json kept");
    assert!(
        cycle["last_error"].as_str().unwrap().contains("destroy"),
        "{cycle}"
    );
    assert_eq!(cycle["phase"], "tearing_down");
    assert_eq!(env.live_vms().len(), 1);
    assert!(
        out.stderr.contains("ERROR"),
        "failure logged at error level: {}",
        out.stderr
    );

    // Next run: the destroy is retried first, then the sweep.
    env.fault("fail-destroy", false);
    env.fake.clear_requests();
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(env.live_vms().is_empty());
    assert!(env.cycle_json().is_none());
    let mut swept = env.fake.deleted_ids();
    swept.sort();
    assert_eq!(swept, vec![106, 424, 514, 516, 518]);
    // The retried destroy came before any job was looked at: no new cycle was started.
    assert_eq!(posts(&env), 0);
}

#[test]
fn unconsumed_registration_is_deleted_before_it_is_forgotten() {
    let env = Env::new();
    env.set_launch_mode("die"); // the runner connects, then dies before taking its job
    env.fake.add_job(&["debian"]);
    let out = env.run(&["--output", "json", "--max-jobs-per-vm", "2"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report = out.json();
    let created: Vec<i64> = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["step"] == "register_runner" && e["ok"] == true)
        .map(|e| e["runner_id"].as_i64().unwrap())
        .collect();
    assert_eq!(created.len(), 2, "{report}");
    // Each unconsumed registration was deleted (while the VM existed), before the next POST.
    let reqs = env.fake.requests();
    let pos = |m: &str, pred: &dyn Fn(&str) -> bool| {
        reqs.iter()
            .position(|r| r.method == m && pred(&r.path))
            .unwrap()
    };
    let del_first = pos("DELETE", &|p| p.ends_with(&format!("/{}", created[0])));
    let post_second = reqs
        .iter()
        .enumerate()
        .filter(|(_, r)| r.method == "POST" && r.path.ends_with("/actions/runners"))
        .nth(1)
        .map(|(i, _)| i)
        .unwrap();
    assert!(
        del_first < post_second,
        "delete of the unconsumed registration comes first"
    );
    let reasons: Vec<&str> = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["step"] == "delete_runner")
        .map(|e| e["reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons, vec!["unconsumed", "unconsumed"], "{report}");
    env.assert_at_rest();
}

#[test]
fn failing_launch_three_times_tears_down_and_fails() {
    let env = Env::new();
    env.set_launch_mode("fail");
    env.fake.add_job(&["debian"]);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let report = out.json();
    let failed_launches = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["step"] == "launch_runner" && e["ok"] == false)
        .count();
    assert_eq!(failed_launches, 3, "{report}");
    assert_eq!(deletes(&env).len(), 3, "each failed registration deleted");
    env.assert_at_rest();
    assert!(out.stderr.contains("presumed broken"), "{}", out.stderr);
}

#[test]
fn launch_timeout_kills_the_command_and_counts_as_failure() {
    let env = Env::new();
    env.set_launch_mode("hang");
    env.fake.add_job(&["debian"]);
    let out = env.run(&["--output", "json", "--launch-timeout", "300ms"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stdout.contains("timed out"), "{out:?}");
    assert!(env.our_runners().is_empty());
    assert!(env.live_vms().is_empty());
}

#[test]
fn lost_post_answer_is_found_by_name_and_deleted() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fake.inject(
        "POST",
        "/api/v1/admin/actions/runners",
        Fault::ApplyThenDrop,
        1,
    );
    let out = env.run(&["--output", "json"]);
    // The lost POST is a failure of this run, but it converges: the orphan is deleted by name,
    // the job then runs on a second registration.
    assert_eq!(out.code, Some(1), "{out:?}");
    let report = out.json();
    let lost: Vec<&serde_json::Value> = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["reason"] == "lost_registration")
        .collect();
    assert_eq!(lost.len(), 1, "{report}");
    assert_eq!(env.fake.deleted_ids().len(), 1);
    assert!(env.fake.jobs().iter().all(|j| j.status == "success"));
    assert!(env.our_runners().is_empty());
    assert!(env.cycle_json().is_none());
}

#[test]
fn api_failures_are_errors_not_success() {
    for fault in [
        Fault::Status(500),
        Fault::Html(502),
        Fault::Truncated,
        Fault::WrongTypes,
    ] {
        let env = Env::new();
        env.fake.add_job(&["debian"]);
        env.fake.inject("GET", "/jobs", fault.clone(), usize::MAX);
        let out = env.run(&[]);
        assert_eq!(out.code, Some(1), "{fault:?}: {out:?}");
        assert!(
            out.stderr.contains("/actions/runners/jobs"),
            "the error names the URL: {out:?}"
        );
        assert!(
            env.cycle_json().is_none(),
            "no cycle started on doubt ({fault:?})"
        );
        assert!(env.vm_log().is_empty());
    }
}

#[test]
fn slow_forgejo_times_out_instead_of_hanging() {
    let env = Env::new();
    env.fake.inject(
        "GET",
        "/jobs",
        Fault::Delay(Duration::from_secs(3)),
        usize::MAX,
    );
    let out = env.run(&["--http-timeout", "500ms"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("timed out"), "{out:?}");
}

#[test]
fn sweep_list_failure_deletes_nothing_and_fails() {
    let env = Env::new();
    seed_incident(&env);
    env.fake.add_job(&["debian"]);
    env.fake
        .inject("GET", "page=2", Fault::Status(500), usize::MAX);
    let out = env.run(&["--output", "json"]);
    assert_eq!(
        out.code,
        Some(1),
        "a failed sweep makes the run fail: {out:?}"
    );
    assert!(
        env.fake.deleted_ids().is_empty(),
        "one failed page: nothing deleted"
    );
    assert!(
        env.cycle_json().is_none(),
        "a sweep failure never blocks convergence"
    );
    assert!(env.live_vms().is_empty());
    assert!(
        out.json()["sweep"]["error"]
            .as_str()
            .unwrap()
            .contains("page 2")
    );
}

#[test]
fn sweep_cap_leaves_the_rest_for_later() {
    let env = Env::new();
    seed_incident(&env);
    let mut c = env.cmd("sweep");
    c.args(["--sweep-max-deletions", "2", "--output", "json"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    let mut swept = env.fake.deleted_ids();
    swept.sort();
    assert_eq!(swept, vec![106, 424], "lowest ids first, at most 2");
    assert_eq!(out.json()["sweep"]["left_over_cap"], 3);
}

#[test]
fn unknown_or_missing_status_is_never_deleted() {
    let env = Env::new();
    let weird = env
        .fake
        .add_runner("ephemeral-weird", true, Conn::NeverConnected);
    let missing = env
        .fake
        .add_runner("ephemeral-missing", true, Conn::NeverConnected);
    let upper = env
        .fake
        .add_runner("ephemeral-upper", true, Conn::NeverConnected);
    let plain = env
        .fake
        .add_runner("ephemeral-plain", true, Conn::NeverConnected);
    env.fake.set_status_override(weird, Some("weird"));
    env.fake.set_status_override(missing, Some(""));
    env.fake.set_status_override(upper, Some("Offline"));
    let mut c = env.cmd("sweep");
    c.args(["--output", "json"]);
    let out = env.exec(c);
    assert_eq!(
        out.code,
        Some(0),
        "doubtful rows are reported, not failures: {out:?}"
    );
    assert_eq!(env.fake.deleted_ids(), vec![plain]);
    assert_eq!(
        out.json()["sweep"]["skipped_doubtful"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
}

#[test]
fn sweep_is_refused_while_a_cycle_exists() {
    let env = Env::new();
    env.fake
        .add_runner("ephemeral-stale", true, Conn::NeverConnected);
    env.fake.add_job(&["debian"]);
    env.fault("fail-destroy", true);
    assert_eq!(env.run(&[]).code, Some(1));
    assert!(env.cycle_json().is_some());
    let out = env.exec(env.cmd("sweep"));
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("refused"), "{out:?}");
    // The summary names the cycle that is the reason, not "(no cycle)".
    let cycle_id = env.cycle_json().unwrap()["cycle_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        out.stdout
            .starts_with(&format!("sweep {cycle_id}: refused")),
        "{out:?}"
    );
    assert!(env.fake.deleted_ids().is_empty());
}

#[test]
fn held_lock_exits_75_touching_nothing() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    fs::create_dir_all(&env.state).unwrap();
    let lock = fs::File::create(env.state.join("cycle.lock")).unwrap();
    lock.lock().unwrap();
    for sub in ["run", "sweep"] {
        let out = env.exec(env.cmd(sub));
        assert_eq!(out.code, Some(75), "{sub}: {out:?}");
    }
    assert!(env.fake.requests().is_empty());
    assert!(env.cycle_json().is_none());
    // status only reads and works while the lock is held.
    assert_eq!(env.exec(env.cmd("status")).code, Some(0));
}

#[test]
fn corrupt_cycle_json_is_an_error_that_changes_nothing() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fake
        .add_runner("ephemeral-stale", true, Conn::NeverConnected);
    fs::create_dir_all(&env.state).unwrap();
    let path = env.state.join("cycle.json");
    for bad in [
        "",
        "{\"version\": 1, \"cycle_id\": \"x",
        "not json",
        "{\"version\": 99}",
    ] {
        fs::write(&path, bad).unwrap();
        let out = env.run(&[]);
        assert_eq!(out.code, Some(1), "{bad:?}: {out:?}");
        assert!(
            out.stderr.contains(path.to_str().unwrap()),
            "names the file: {out:?}"
        );
        assert_eq!(fs::read_to_string(&path).unwrap(), bad, "file unchanged");
    }
    assert!(env.fake.requests().is_empty(), "nothing else was done");
    assert!(env.vm_log().is_empty());
}

#[test]
fn configuration_errors_exit_2() {
    let env = Env::new();
    // Token file readable by others.
    fs::write(env.tmp.path().join("open-token"), API_TOKEN).unwrap();
    let open = env.tmp.path().join("open-token");
    std::os::unix::fs::PermissionsExt::set_mode(
        &mut fs::metadata(&open).unwrap().permissions(),
        0o644,
    );
    fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let mut c = env.cmd("run");
    c.args(["--token-file", open.to_str().unwrap()]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("chmod 600"), "{out:?}");

    let mut c = env.cmd("run");
    c.args(["--forgejo-url", "http://forgejo.example.org"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("https"), "{out:?}");

    let mut c = env.cmd("run");
    c.args(["--runner-prefix", ""]);
    assert_eq!(env.exec(c).code, Some(2));

    let mut c = env.cmd("run");
    c.args(["--runner-prefix", &"p".repeat(129)]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("at most 128"), "{out:?}");

    let mut c = env.cmd("run");
    c.args(["--poll-interval", "soon"]);
    assert_eq!(env.exec(c).code, Some(2));

    let mut c = env.cmd("run");
    c.args(["--hard-deadline", "1h", "--max-cycle-duration", "2h"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("--hard-deadline"), "{out:?}");

    for (flags, says) in [
        (
            &["--failure-backoff", "2m", "--failure-backoff-max", "1m"][..],
            "--failure-backoff-max",
        ),
        (&["--failure-backoff", "0s"][..], "at least 1s"),
        (&["--max-failed-cycles", "1001"][..], "at most 1000"),
    ] {
        let mut c = env.cmd("run");
        c.args(flags);
        let out = env.exec(c);
        assert_eq!(out.code, Some(2), "{flags:?}: {out:?}");
        assert!(out.stderr.contains(says), "{flags:?}: {out:?}");
    }

    // A cycle must start but no module is configured: exit 2 before anything is written.
    env.fake.add_job(&["debian"]);
    let mut c = env.cmd("run");
    c.env("CI_EPHEMERAL_PROVISIONER_TOFU_DIR", "/nonexistent/module");
    c.args(["--tofu-dir", "/nonexistent/module"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(env.cycle_json().is_none());
    assert!(env.fake.requests().iter().all(|r| r.method == "GET"));
}

#[test]
fn flags_read_environment_variables_and_the_command_line_wins() {
    let env = Env::new();
    let mut c = std::process::Command::new(crate::support::harness::BIN);
    c.env_clear();
    c.env("PATH", std::env::var_os("PATH").unwrap());
    c.arg("run");
    c.env("CI_EPHEMERAL_PROVISIONER_FORGEJO_URL", env.fake.url());
    c.env("CI_EPHEMERAL_PROVISIONER_TOKEN_FILE", &env.token_file);
    c.env("CI_EPHEMERAL_PROVISIONER_STATE_DIR", &env.state);
    c.env("CI_EPHEMERAL_PROVISIONER_LABELS", "gpu");
    c.env("CI_EPHEMERAL_PROVISIONER_OUTPUT", "json");
    c.args(["--labels", "debian:host"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.json()["outcome"], "idle");
    assert_eq!(env.fake.requests()[0].query, "labels=debian");
}

#[test]
fn hard_deadline_tears_down_a_busy_vm_and_fails() {
    let env = Env::new();
    env.set_launch_mode("take"); // the runner takes its job and keeps running
    env.fake.add_job(&["debian"]);
    let out = env.run(&[
        "--output",
        "json",
        "--hard-deadline",
        "3s",
        "--max-cycle-duration",
        "3s",
    ]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("hard-deadline"), "{}", out.stderr);
    let events = out.json()["events"].as_array().unwrap().clone();
    let launched = events
        .iter()
        .position(|e| e["step"] == "launch_runner" && e["ok"] == true);
    let teardown = events.iter().position(|e| e["step"] == "teardown");
    assert!(
        launched.is_some() && launched < teardown,
        "a runner was up when the deadline hit: {events:?}"
    );
    assert!(
        env.live_vms().is_empty(),
        "the VM is destroyed even with a runner up"
    );
    // Destroying the VM stopped the runner; once offline it was deleted, then cycle.json removed.
    assert!(env.our_runners().is_empty());
    assert!(env.cycle_json().is_none());
}

#[test]
fn apply_failure_destroys_what_was_made_and_fails() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fault("fail-apply", true);
    let out = env.run(&[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("tofu apply failed"), "{}", out.stderr);
    assert_eq!(posts(&env), 0, "no registration without a VM");
    assert!(
        env.cycle_json().is_none(),
        "torn down after the failed apply"
    );
    assert!(env.live_vms().is_empty());
}

#[test]
fn sigterm_during_apply_forwards_sigint_and_the_next_run_converges() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fault("slow-apply", true);
    let mut c = env.cmd("run");
    c.stdout(std::process::Stdio::null());
    c.stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    // Wait until terraform runs the provisioner, then stop us the way systemd would.
    wait_for("the apply to start", || env.vm.join("applying").exists());
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("sending SIGINT to"), "{stderr}");
    assert!(
        stderr.contains("stopped by a signal during tofu apply"),
        "{stderr}"
    );
    let cycle = env.cycle_json().expect("cycle.json persisted");
    assert_eq!(cycle["phase"], "applying");

    env.fault("slow-apply", false);
    let out = env.run(&[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    env.assert_at_rest();
}

// Mutation caught: the Authorization value logged at trace.
#[test]
fn secrets_never_leak_into_output_files_or_children() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fake.add_job(&["debian"]);
    let mut c = env.cmd("run");
    c.args(["--output", "json", "-v"]);
    // Everything at trace, the HTTP stack included, however specifically asked for.
    c.env(
        "RUST_LOG",
        "trace,ureq=trace,ureq_proto=trace,ureq_proto::util=trace,rustls=trace",
    );
    c.env("CREDENTIALS_DIRECTORY", env.tmp.path());
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    let mut haystacks = vec![
        ("stdout".to_string(), out.stdout.clone()),
        ("stderr".to_string(), out.stderr.clone()),
    ];
    for dir in [&env.state, &env.module] {
        for e in walk(dir) {
            haystacks.push((
                e.display().to_string(),
                String::from_utf8_lossy(&fs::read(&e).unwrap()).into_owned(),
            ));
        }
    }
    assert!(
        out.stderr.contains("TRACE") || out.stderr.contains("DEBUG"),
        "RUST_LOG took effect"
    );
    // What tofu got: the cycle id only in its environment, never on argv; nothing of ours.
    let tofu_env = fs::read_to_string(env.vm.join("tofu-env.create")).unwrap();
    let tofu_argv = fs::read_to_string(env.vm.join("tofu-argv.create")).unwrap();
    let cycle_id = out.json()["cycle_id"].as_str().unwrap().to_string();
    assert!(
        tofu_env.contains(&format!("TF_VAR_cycle_id={cycle_id}")),
        "{tofu_env}"
    );
    assert!(
        tofu_env.contains("TF_IN_AUTOMATION=1") && tofu_env.contains("TF_INPUT=0"),
        "{tofu_env}"
    );
    assert!(
        !tofu_env.contains("CREDENTIALS_DIRECTORY")
            && !tofu_env.contains("CI_EPHEMERAL_PROVISIONER_"),
        "{tofu_env}"
    );
    assert!(
        tofu_argv.contains("apply")
            && tofu_argv.contains("-input=false")
            && tofu_argv.contains("-auto-approve"),
        "{tofu_argv}"
    );
    assert!(
        !tofu_argv.contains(&cycle_id) && !tofu_argv.contains("-var"),
        "{tofu_argv}"
    );
    // What the launch command and tofu saw in their environment and argv.
    for e in fs::read_dir(&env.vm).unwrap().filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("launch-") || name.starts_with("tofu-") {
            haystacks.push((name, fs::read_to_string(e.path()).unwrap()));
        }
    }
    assert!(haystacks.len() > 5);
    for (name, text) in &haystacks {
        // Any 12 characters of it: a hex dump splits a header across lines.
        for w in API_TOKEN.as_bytes().windows(12) {
            let w = std::str::from_utf8(w).unwrap();
            assert!(!text.contains(w), "Forgejo token (…{w}…) in {name}");
        }
        // Runner tokens are 40 hex digits; nothing we write or pass on contains 16 of them in a
        // row (a hex dump shows 16 bytes per line).
        assert!(!has_hex_run(text, 16), "a runner token in {name}:\n{text}");
        // tofu keeps sensitive outputs in its own state, the module source names the value, and
        // the launch command gets every output by design (e.g. an SSH key to reach the VM).
        if !name.contains("terraform.tfstate")
            && !name.ends_with(".tf")
            && !name.starts_with("launch-env")
            && !name.starts_with("tofu-env")
        {
            assert!(
                !text.contains("MODULE-SENSITIVE-VALUE"),
                "a sensitive tofu output in {name}"
            );
        }
    }
}

fn has_hex_run(s: &str, len: usize) -> bool {
    let mut run = 0;
    for c in s.chars() {
        if c.is_ascii_hexdigit() {
            run += 1;
            if run >= len {
                return true;
            }
        } else {
            run = 0;
        }
    }
    false
}

#[test]
fn live_dry_run_only_gets_and_writes_nothing() {
    let env = Env::new();
    seed_incident(&env);
    env.fake.add_job(&["debian"]);
    // A cycle whose VM has been free long enough: the plan is destroy + sweep.
    env.fault("fail-destroy", true);
    assert_eq!(env.run(&[]).code, Some(1));
    env.fault("fail-destroy", false);
    let before = fs::read(env.state.join("cycle.json")).unwrap();
    let vm_log = env.vm_log();
    env.fake.clear_requests();
    let out = env.run(&["--dry-run", "--output", "json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let v = out.json();
    assert_eq!(v["actions"][0]["action"], "tofu_destroy", "{v}");
    let swept: Vec<i64> = v["actions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["reason"] == "sweep")
        .map(|a| a["runner_id"].as_i64().unwrap())
        .collect();
    assert_eq!(swept, vec![106, 424, 514, 516, 518]);
    assert!(
        env.fake.requests().iter().all(|r| r.method == "GET"),
        "only GETs"
    );
    assert!(env.fake.deleted_ids().is_empty());
    assert_eq!(
        fs::read(env.state.join("cycle.json")).unwrap(),
        before,
        "state untouched"
    );
    assert_eq!(env.vm_log(), vm_log, "tofu never ran");
    assert!(
        !env.state.join("last-run.json").exists() || {
            // last-run.json is from the earlier real run, not the dry one
            let r: serde_json::Value =
                serde_json::from_str(&fs::read_to_string(env.state.join("last-run.json")).unwrap())
                    .unwrap();
            r["dry_run"] == false
        }
    );
}

#[test]
fn stranded_idle_runner_is_never_deleted_alive_the_vm_goes_and_then_it_does() {
    let env = Env::new();
    env.set_launch_mode("connect"); // the runner connects but never gets its job
    let (job, _) = env.fake.add_job(&["debian"]);
    let mut c = env.cmd("run");
    c.args(["--output", "json"]);
    c.stdout(std::process::Stdio::piped());
    let child = c.spawn().unwrap();
    // Wait until the runner is up and idle, then cancel its job.
    wait_for("the runner to connect", || {
        env.fake
            .runners()
            .iter()
            .any(|r| r.name.starts_with("ephemeral-") && r.status == "idle")
    });
    let runner = env.our_runners()[0];
    env.fake.set_job_status(job, "cancelled");
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let events = report["events"].as_array().unwrap();
    let teardown = events.iter().position(|e| e["step"] == "teardown").unwrap();
    let destroy = events
        .iter()
        .position(|e| e["step"] == "tofu_destroy")
        .unwrap();
    let delete = events
        .iter()
        .position(|e| e["step"] == "delete_runner" && e["runner_id"] == runner)
        .unwrap();
    assert!(
        events[teardown]["detail"]
            .as_str()
            .unwrap()
            .contains("idle"),
        "{report}"
    );
    assert!(
        destroy < delete,
        "the idle runner was deleted only after its VM was destroyed"
    );
    assert_eq!(events[delete]["reason"], "stranded", "{report}");
    assert!(env.our_runners().is_empty());
    assert!(env.cycle_json().is_none());
}

#[test]
fn sigterm_during_destroy_persists_and_the_next_run_converges() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fake
        .add_runner("ephemeral-stale", true, Conn::NeverConnected);
    env.fault("slow-destroy", true);
    let mut c = env.cmd("run");
    c.stdout(std::process::Stdio::null());
    c.stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    wait_for("the destroy to start", || {
        env.vm.join("destroying").exists()
    });
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("stopped by a signal during tofu destroy"),
        "{stderr}"
    );
    assert_eq!(env.cycle_json().unwrap()["phase"], "tearing_down");
    assert_eq!(
        env.our_runners().len(),
        1,
        "no sweep after an interrupted destroy"
    );

    env.fault("slow-destroy", false);
    let out = env.run(&[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    env.assert_at_rest();
}

#[test]
fn a_failed_delete_keeps_the_registration_until_forgejo_confirms() {
    let env = Env::new();
    env.set_launch_mode("die");
    env.fake.add_job(&["debian"]);
    env.fake
        .inject("DELETE", "/actions/runners/", Fault::Status(500), 2);
    let out = env.run(&["--output", "json", "--max-jobs-per-vm", "1"]);
    assert_eq!(
        out.code,
        Some(1),
        "failed deletes are failures of the run: {out:?}"
    );
    let report = out.json();
    let deletes: Vec<(i64, bool, String)> = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["step"] == "delete_runner")
        .map(|e| {
            (
                e["runner_id"].as_i64().unwrap(),
                e["ok"].as_bool().unwrap(),
                e["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let id = deletes[0].0;
    assert_eq!(
        deletes,
        vec![
            (id, false, "unconsumed".into()),
            (id, false, "unconsumed".into()),
            (id, true, "unconsumed".into())
        ],
        "retried until Forgejo confirmed, never forgotten in between: {report}"
    );
    assert!(env.our_runners().is_empty());
    assert!(env.cycle_json().is_none());
}

#[test]
fn systemd_credential_is_the_default_token_and_children_never_see_it() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    let creds = env.tmp.path().join("credentials");
    fs::create_dir(&creds).unwrap();
    fs::copy(&env.token_file, creds.join("forgejo-token")).unwrap();
    let mut c = env.cmd_with("run", false);
    c.env("CREDENTIALS_DIRECTORY", &creds);
    c.env("CI_EPHEMERAL_PROVISIONER_MAX_JOBS_PER_VM", "3");
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        env.fake
            .requests()
            .iter()
            .all(
                |r| r.authorization.as_deref() == Some(&*format!("token {API_TOKEN}"))
                    || r.path.starts_with("/_fake")
            )
    );
    let launch_env = fs::read_dir(&env.vm)
        .unwrap()
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().starts_with("launch-env."))
        .map(|e| fs::read_to_string(e.path()).unwrap())
        .expect("the launch command ran");
    assert!(
        !launch_env.contains("CREDENTIALS_DIRECTORY"),
        "{launch_env}"
    );
    assert!(
        !launch_env.contains("CI_EPHEMERAL_PROVISIONER_"),
        "{launch_env}"
    );
    for var in [
        "RUNNER_ID=",
        "RUNNER_UUID=",
        "RUNNER_NAME=ephemeral-",
        "RUNNER_LABELS=debian:host",
        "JOB_HANDLE=",
        "FORGEJO_URL=http://127.0.0.1",
        "TOFU_OUTPUT_ADDRESS=127.0.0.1",
    ] {
        assert!(
            launch_env.contains(var),
            "{var} missing from the launch environment:\n{launch_env}"
        );
    }
}

#[test]
fn missing_token_is_a_configuration_error() {
    let env = Env::new();
    let out = env.exec(env.cmd_with("run", false));
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("--token-file"), "{out:?}");
}

#[test]
fn deletions_spread_over_every_list_page_are_all_found() {
    let env = Env::new();
    // Interleaved by last contact, so stale registrations sit on every page.
    let mut stale = Vec::new();
    for i in 0..160u64 {
        let conn = Conn::OfflineFor(Duration::from_secs(120 + i));
        if i % 4 == 0 {
            stale.push(
                env.fake
                    .add_runner(&format!("ephemeral-old-{i}"), true, conn),
            );
        } else {
            env.fake.add_runner(&format!("static-{i}"), false, conn);
        }
    }
    let mut c = env.cmd("sweep");
    c.args(["--output", "json", "--sweep-max-deletions", "1000"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    let mut deleted = env.fake.deleted_ids();
    deleted.sort();
    assert_eq!(deleted, stale);
    assert_eq!(out.json()["sweep"]["pages"], 4);
    // Every page was listed before the first DELETE.
    let reqs = env.fake.requests();
    let last_list = reqs.iter().rposition(|r| r.method == "GET").unwrap();
    let first_delete = reqs.iter().position(|r| r.method == "DELETE").unwrap();
    assert!(
        last_list < first_delete,
        "collect all pages first, then delete"
    );
}

#[test]
fn a_lost_registration_is_not_forgotten_on_an_incomplete_listing() {
    let env = Env::new();
    for i in 0..60 {
        env.fake.add_runner(
            &format!("static-{i}"),
            false,
            Conn::OfflineFor(Duration::from_secs(600)),
        );
    }
    env.fake.add_job(&["debian"]);
    env.fake.inject(
        "POST",
        "/api/v1/admin/actions/runners",
        Fault::ApplyThenDrop,
        1,
    );
    // The first look for it: page 2 (where the never-connected orphan sorts) comes back empty,
    // as when rows shift between pages. The listing then holds 50 of the 61 rows counted.
    env.fake
        .inject("GET", "page=2", Fault::Body("[]".into()), 1);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let report = out.json();
    let failures = report["failures"].as_array().unwrap();
    assert!(
        failures
            .iter()
            .any(|f| f.as_str().unwrap().contains("not forgetting it")),
        "{report}"
    );
    // Found on the retry and deleted as the lost registration it is (not later by the sweep).
    let lost: Vec<&serde_json::Value> = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["step"] == "delete_runner" && e["reason"] == "lost_registration")
        .collect();
    assert_eq!(lost.len(), 1, "{report}");
    assert!(env.our_runners().is_empty());
    assert!(env.cycle_json().is_none());
}

#[test]
fn a_stale_terraform_dir_is_initialised_again() {
    let env = Env::new();
    // The module gained a child module since `.terraform` was made (or an init was cut off).
    fs::create_dir_all(env.module.join(".terraform")).unwrap();
    fs::create_dir_all(env.module.join("extra")).unwrap();
    fs::write(
        env.module.join("extra/main.tf"),
        "output \"size\" {\n  value = \"small\"\n}\n",
    )
    .unwrap();
    fs::write(
        env.module.join("extra.tf"),
        "module \"extra\" {\n  source = \"./extra\"\n}\n",
    )
    .unwrap();
    env.fake.add_job(&["debian"]);
    let out = env.run(&[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(env.cycle_json().is_none());
    assert!(env.live_vms().is_empty());
}

#[test]
fn a_proxy_in_the_environment_never_carries_the_token_off_loopback() {
    let env = Env::new();
    // A "proxy" that records whatever reaches it.
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_url = format!("http://{}", proxy.local_addr().unwrap());
    proxy.set_nonblocking(true).unwrap();
    let mut c = env.cmd("run");
    for var in ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"] {
        c.env(var, &proxy_url);
    }
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        env.fake.requests().len(),
        1,
        "went straight to Forgejo on loopback"
    );
    assert!(proxy.accept().is_err(), "nothing reached the proxy");
}

#[test]
fn a_running_cycle_whose_launch_command_went_away_is_torn_down() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    // A first run does its job and then waits on a free VM; it is stopped there.
    let mut c = env.cmd("run");
    c.args(["--idle-timeout", "1h"]);
    c.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut child = c.spawn().unwrap();
    wait_for("the first job to finish", || {
        env.fake.jobs().iter().all(|j| j.status == "success")
    });
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(child.wait().unwrap().code(), Some(1));
    assert_eq!(env.cycle_json().unwrap()["phase"], "running");

    // A new job, and the launch command is no longer configured: the cycle must not live on.
    env.fake.add_job(&["debian"]);
    let mut c = std::process::Command::new(crate::support::harness::BIN);
    c.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap())
        .env("VM_DIR", &env.vm)
        .env("FAKE_FORGEJO_URL", env.fake.url());
    c.args([
        "run",
        "--forgejo-url",
        &env.fake.url(),
        "--labels",
        "debian",
    ]);
    c.args(["--tofu-bin", &env.tofu, "--poll-interval", "100ms"]);
    c.arg("--token-file").arg(&env.token_file);
    c.arg("--state-dir").arg(&env.state);
    c.arg("--tofu-dir").arg(&env.module);
    let out = env.exec(c);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("--launch-command"), "{out:?}");
    env.assert_at_rest();
    assert_eq!(posts(&env), 1, "no registration without a launch command");
}

#[test]
fn a_configuration_error_is_kept_in_last_run_json() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    let mut c = env.cmd("run");
    c.args(["--tofu-dir", "/nonexistent/module"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    let last: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(env.state.join("last-run.json")).unwrap())
            .unwrap();
    assert_eq!(last["exit_code"], 2);
    assert!(
        last["failures"][0].as_str().unwrap().contains("--tofu-dir"),
        "{last}"
    );
    let status = env.exec(env.cmd("status"));
    assert!(status.stdout.contains("--tofu-dir"), "{status:?}");
}

#[test]
fn a_post_answered_too_late_is_looked_up_after_it_landed() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    // Forgejo creates the registration 1.5 s after the request; we give up waiting after 1 s.
    env.fake.inject(
        "POST",
        "/api/v1/admin/actions/runners",
        Fault::Delay(Duration::from_millis(1500)),
        1,
    );
    let out = env.run(&["--output", "json", "--http-timeout", "1s"]);
    assert_eq!(
        out.code,
        Some(1),
        "the timed-out POST is a failure: {out:?}"
    );
    let report = out.json();
    let lost = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["step"] == "delete_runner" && e["reason"] == "lost_registration")
        .count();
    assert_eq!(
        lost, 1,
        "found by name once it had landed, not forgotten: {report}"
    );
    assert!(env.fake.jobs().iter().all(|j| j.status == "success"));
    assert!(env.our_runners().is_empty());
    assert!(env.cycle_json().is_none());
}

#[test]
fn a_404_that_is_not_forgejos_does_not_forget_a_busy_runner() {
    let env = Env::new();
    env.set_launch_mode("take");
    let (job, _) = env.fake.add_job(&["debian"]);
    let mut c = env.cmd("run");
    c.args(["--output", "json"]);
    c.stdout(std::process::Stdio::piped());
    c.stderr(std::process::Stdio::null());
    let child = c.spawn().unwrap();
    wait_for("the runner to take its job", || {
        env.fake
            .jobs()
            .iter()
            .any(|j| j.id == job && j.status == "running")
    });
    let runner = env.our_runners()[0];
    // A proxy's 404 page for the runner, twice.
    env.fake.inject(
        "GET",
        &format!("/actions/runners/{runner}"),
        Fault::Html(404),
        2,
    );
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        env.live_vms().len() == 1,
        "the VM of a working runner stays"
    );
    assert_eq!(env.cycle_json().unwrap()["registrations"][0]["id"], runner);
    // The job ends normally; Forgejo removes the registration; the cycle ends.
    let uuid = env.fake.runner(runner).unwrap().uuid;
    let token = fs::read_to_string(env.vm.join("runners").join(&uuid)).unwrap();
    ureq::post(format!("{}/_fake/finish", env.fake.url()))
        .header("X-Runner-UUID", &uuid)
        .send(token.as_bytes())
        .unwrap();
    fs::remove_file(env.vm.join("runners").join(&uuid)).unwrap();
    let out = child.wait_with_output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        report["failures"].as_array().unwrap().iter().any(|f| f
            .as_str()
            .unwrap()
            .contains("without Forgejo's JSON error body")),
        "{report}"
    );
    assert!(env.cycle_json().is_none());
    assert!(env.live_vms().is_empty());
}

#[test]
fn a_delete_answered_200_by_something_else_does_not_forget_the_registration() {
    let env = Env::new();
    env.set_launch_mode("noop"); // never consumed: must be deleted
    env.fake.add_job(&["debian"]);
    // A proxy's page with 200 instead of Forgejo's 204, once; nothing was deleted.
    env.fake
        .inject("DELETE", "/actions/runners/", Fault::Html(200), 1);
    let out = env.run(&["--output", "json", "--max-jobs-per-vm", "1"]);
    let report = out.json();
    assert_eq!(out.code, Some(1), "{report}");
    assert!(
        report["failures"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f.as_str().unwrap().contains("HTTP 200")),
        "{report}"
    );
    // Kept in cycle.json and deleted for real later in the same cycle, not left to a sweep.
    let deletes: Vec<_> = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["step"] == "delete_runner" && e["ok"] == true)
        .collect();
    assert_eq!(deletes.len(), 1, "{report}");
    assert_ne!(deletes[0]["reason"], "sweep", "{report}");
    assert_eq!(
        env.fake.deleted_ids(),
        vec![deletes[0]["runner_id"].as_i64().unwrap()]
    );
    env.assert_at_rest();
}

#[test]
fn a_registration_that_cannot_be_deleted_ends_the_vm_and_waits_in_cycle_json() {
    let env = Env::new();
    env.set_launch_mode("noop"); // never consumed: must be deleted
    env.fake.add_job(&["debian"]);
    env.fake.inject(
        "DELETE",
        "/actions/runners/",
        Fault::Status(500),
        usize::MAX,
    );
    let out = env.run(&["--output", "json", "--max-jobs-per-vm", "1"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let report = out.json();
    let teardown = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["step"] == "teardown")
        .unwrap();
    assert!(
        teardown["detail"]
            .as_str()
            .unwrap()
            .contains("could not be cleaned up"),
        "{report}"
    );
    assert!(
        env.live_vms().is_empty(),
        "the VM does not wait for Forgejo"
    );
    let cycle = env.cycle_json().expect("the registration is not forgotten");
    assert_eq!(cycle["phase"], "destroyed");
    assert_eq!(cycle["registrations"].as_array().unwrap().len(), 1);
    assert!(
        report["failures"].as_array().unwrap().len() < 10,
        "repeated failures are listed once: {report}"
    );

    env.fake.clear_faults();
    let out = env.run(&[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(env.cycle_json().is_none());
    assert!(env.our_runners().is_empty());
}

#[test]
fn an_idle_vm_goes_even_while_forgejo_cannot_be_asked_for_jobs() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    let mut c = env.cmd("run");
    c.args(["--output", "json", "--idle-timeout", "1s"]);
    c.stdout(std::process::Stdio::piped());
    c.stderr(std::process::Stdio::null());
    let child = c.spawn().unwrap();
    wait_for("the job to finish", || {
        env.fake.jobs().iter().all(|j| j.status == "success")
    });
    // From now on Forgejo cannot be asked for jobs.
    env.fake
        .inject("GET", "/jobs", Fault::Status(503), usize::MAX);
    let mut out = child.wait_with_output().unwrap();
    // Each run gives up after three failed rounds (the next run resumes); within a few runs the
    // idle timeout has passed and the VM goes without Forgejo's help.
    for _ in 0..20 {
        if env.cycle_json().is_none() {
            break;
        }
        assert_eq!(out.status.code(), Some(1), "failed requests are failures");
        let mut c = env.cmd("run");
        c.args(["--output", "json", "--idle-timeout", "1s"]);
        out = c.output().unwrap();
    }
    assert_eq!(out.status.code(), Some(1), "failed requests are failures");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let teardown = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["step"] == "teardown");
    assert!(
        teardown.is_some_and(|t| t["detail"].as_str().unwrap().contains("idle")),
        "{report}"
    );
    assert!(env.live_vms().is_empty());
    assert!(env.cycle_json().is_none());
}

#[test]
fn a_live_dry_run_works_while_a_run_holds_the_lock() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    fs::create_dir_all(&env.state).unwrap();
    let lock = fs::File::create(env.state.join("cycle.lock")).unwrap();
    lock.lock().unwrap();
    let out = env.run(&["--dry-run", "--output", "json"]);
    assert_eq!(out.code, Some(0), "a dry-run never takes the lock: {out:?}");
    assert_eq!(out.json()["actions"][0]["action"], "tofu_apply");
    assert!(env.fake.requests().iter().all(|r| r.method == "GET"));
}

#[test]
fn launch_command_and_tofu_binary_must_be_executable() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    let script = env.tmp.path().join("launch-not-executable.sh");
    fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
    let mut c = env.cmd("run");
    c.arg("--launch-command").arg(&script);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("chmod +x"), "{out:?}");

    let mut c = env.cmd("run");
    c.args(["--tofu-bin", "no-such-tofu-anywhere"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("--tofu-bin"), "{out:?}");
    assert!(env.cycle_json().is_none(), "nothing started");
    assert!(env.vm_log().is_empty());
}

#[test]
fn a_refused_post_is_not_looked_up_as_if_it_might_exist() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    // A token that may read but not write: every POST is refused with 403.
    let read_only = "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d";
    env.fake.set_read_only_token(read_only);
    let ro_file = env.tmp.path().join("read-only-token");
    fs::write(&ro_file, read_only).unwrap();
    fs::set_permissions(
        &ro_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let mut c = env.cmd("run");
    c.args(["--output", "json"])
        .arg("--token-file")
        .arg(&ro_file);
    let out = env.exec(c);
    assert_eq!(out.code, Some(1), "{out:?}");
    let report = out.json();
    let failures = report["failures"].as_array().unwrap();
    assert!(
        failures
            .iter()
            .any(|f| f.as_str().unwrap().contains("write:admin")),
        "the error names the missing scope: {report}"
    );
    // Refused means not created: no lookup by name (no runner list) before the next attempt.
    let lists = env
        .fake
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path == "/api/v1/admin/actions/runners")
        .count();
    let sweep_pages = report["sweep"]["pages"].as_u64().unwrap_or(0) as usize;
    assert_eq!(lists, sweep_pages, "only the sweep listed runners");
    assert!(env.cycle_json().is_none());
    assert!(env.live_vms().is_empty());
}

fn events<'a>(report: &'a serde_json::Value, step: &str) -> Vec<&'a serde_json::Value> {
    report["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["step"] == step)
        .collect()
}

/// The reasons of the report's `delete_runner` events, in order.
fn delete_reasons(report: &serde_json::Value) -> Vec<&str> {
    events(report, "delete_runner")
        .iter()
        .map(|e| e["reason"].as_str().unwrap())
        .collect()
}

fn job_status(env: &Env, id: i64) -> String {
    env.fake
        .jobs()
        .into_iter()
        .find(|j| j.id == id)
        .unwrap()
        .status
}

/// One run with as many waiting jobs as `modes`, the Nth launch in the Nth mode, at most that
/// many jobs per VM; the report.
fn run_launches(modes: &[&str]) -> (Env, Option<i32>, serde_json::Value) {
    let env = Env::new();
    for (n, mode) in modes.iter().enumerate() {
        env.fake.add_job(&["debian"]);
        fs::write(env.vm.join(format!("launch-mode.{}", n + 1)), mode).unwrap();
    }
    let cap = modes.len().to_string();
    let out = env.run(&["--output", "json", "--max-jobs-per-vm", &cap]);
    let report = out.json();
    (env, out.code, report)
}

/// `wait_with_output` with the harness's hang guard: a run that has not ended in 90 s fails.
fn output_of(mut child: std::process::Child) -> std::process::Output {
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            panic!("the binary hung for 90 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn held_jobs(env: &Env) -> Option<serde_json::Value> {
    fs::read_to_string(env.state.join("held-jobs.json"))
        .ok()
        .map(|t| serde_json::from_str(&t).expect("held-jobs.json is JSON"))
}

/// Rewrites the `until` of every hold (a hold that ends in the far future, or has ended).
fn set_holds_until(env: &Env, until: &str) {
    let mut h = held_jobs(env).expect("held-jobs.json");
    for j in h["jobs"].as_array_mut().unwrap() {
        j["until"] = serde_json::json!(until);
    }
    fs::write(env.state.join("held-jobs.json"), h.to_string()).unwrap();
}

// Mutation caught: a never-connected registration deleted as unconsumed.
// Mutation caught: a never-connected runner not counted as a failed start.
// Mutation caught: a launch that exits 0 resets the failed-start count (as before).
#[test]
fn runners_that_never_connect_are_failed_starts_and_three_take_the_vm_down() {
    let env = Env::new();
    env.set_launch_mode("noop"); // the launch exits 0, the runner never connects
    let (job, _) = env.fake.add_job(&["debian"]);
    let prom = env.tmp.path().join("m.prom");
    let out = env.run(&["--output", "json", "--metrics-file", prom.to_str().unwrap()]);
    assert_eq!(
        out.code,
        Some(1),
        "a launch that starts nothing is a failure: {out:?}"
    );
    let report = out.json();
    assert_eq!(delete_reasons(&report), ["never_connected"; 3], "{report}");
    assert_eq!(
        events(&report, "launch_runner").len(),
        3,
        "each launch exited 0"
    );
    let teardown = events(&report, "teardown");
    assert!(
        teardown[0]["detail"]
            .as_str()
            .unwrap()
            .contains("presumed broken"),
        "{report}"
    );
    assert!(out.stderr.contains("never connected"), "{}", out.stderr);
    assert_eq!(
        report["summary"]["deleted"]["never_connected"], 3,
        "{report}"
    );
    let metrics = fs::read_to_string(&prom).unwrap();
    assert!(
        metrics.contains(
            "ci_ephemeral_provisioner_registrations_deleted_total{reason=\"never_connected\"} 3"
        ),
        "{metrics}"
    );
    env.assert_at_rest();
    assert_eq!(job_status(&env, job), "waiting");
}

// Mutation caught: no reset when the runner is seen up / when it ran its job.
#[test]
fn a_runner_that_connected_resets_the_count_of_failed_starts() {
    // Never connects, runs its job, never connects, never connects: no three failed starts in
    // a row, so the VM stays until its job cap (without the reset: "presumed broken").
    let (env, code, report) = run_launches(&["noop", "one-job", "noop", "noop"]);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(delete_reasons(&report), ["never_connected"; 3], "{report}");
    assert_eq!(events(&report, "forget_runner").len(), 1, "{report}");
    let teardown = events(&report, "teardown");
    assert!(
        teardown[0]["detail"].as_str().unwrap().contains("job cap"),
        "{report}"
    );
    env.assert_at_rest();

    // A runner seen up (idle) resets the count too, even if it then dies without its job.
    let (env, _, report) = run_launches(&["noop", "noop", "die", "noop", "noop"]);
    assert_eq!(
        delete_reasons(&report),
        [
            "never_connected",
            "never_connected",
            "unconsumed",
            "never_connected",
            "never_connected"
        ],
        "{report}"
    );
    let teardown = events(&report, "teardown");
    assert!(
        teardown[0]["detail"].as_str().unwrap().contains("job cap"),
        "{report}"
    );
    env.assert_at_rest();
}

// Mutation caught: the fake lets a runner without labels take any job (the old fake).
#[test]
fn a_runner_without_labels_takes_the_vm_down_at_once_and_the_run_fails() {
    // The old default launch: `one-job` without `--label` declares no labels, and Forgejo's
    // ItRunsOn gives it no job, ever.
    let env = Env::new();
    env.set_launch_mode("nolabels");
    let (job, _) = env.fake.add_job(&["debian"]);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let report = out.json();
    let teardown = events(&report, "teardown");
    let detail = teardown[0]["detail"].as_str().unwrap();
    assert!(
        detail.contains("declared the labels []") && detail.contains("--label"),
        "{report}"
    );
    assert_eq!(
        events(&report, "register_runner").len(),
        1,
        "no second runner for a launch that cannot work: {report}"
    );
    let deletes = events(&report, "delete_runner");
    assert_eq!(deletes[0]["reason"], "wrong_labels", "{report}");
    // The job is held: the next timer run does not boot a VM for it again at once.
    let hold = events(&report, "hold_job");
    assert_eq!(hold[0]["reason"], "wrong_labels", "{report}");
    assert_eq!(held_jobs(&env).expect("held")["jobs"][0]["job_id"], job);
    let destroy = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .position(|e| e["step"] == "tofu_destroy")
        .unwrap();
    let delete = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .position(|e| e["step"] == "delete_runner")
        .unwrap();
    assert!(
        destroy < delete,
        "an idle runner is deleted only once its VM is gone"
    );
    env.assert_at_rest();
    assert_eq!(job_status(&env, job), "waiting");
}

// Mutation caught: held jobs not consulted / the hold not kept.
// Mutation caught: the fake hands out jobs queued behind their concurrency group.
#[test]
fn a_job_forgejo_holds_back_is_held_and_the_pool_serves_the_next_one() {
    let env = Env::new();
    // Listed as waiting, but queued behind its concurrency group: Forgejo gives it to nobody.
    let (held, held_handle) = env.fake.add_job(&["debian"]);
    env.fake.set_job_queued(held, true);
    let prom = env.tmp.path().join("m.prom");
    let out = env.run(&[
        "--output",
        "json",
        "--job-pickup-timeout",
        "1s",
        "--metrics-file",
        prom.to_str().unwrap(),
    ]);
    assert_eq!(out.code, Some(0), "a job held back is no failure: {out:?}");
    let report = out.json();
    let hold = events(&report, "hold_job");
    assert_eq!(hold.len(), 1, "{report}");
    assert_eq!(hold[0]["job_id"], held);
    assert_eq!(hold[0]["reason"], "pickup_timeout");
    assert!(
        out.stderr
            .lines()
            .any(|l| l.contains("WARN") && l.contains("not registering for it again before")),
        "logged at warn: {}",
        out.stderr
    );
    let deletes = events(&report, "delete_runner");
    assert_eq!(deletes[0]["reason"], "pickup_timeout", "{report}");
    assert_eq!(report["summary"]["held"], 1);
    env.assert_at_rest();
    let h = held_jobs(&env).expect("the hold outlives the cycle");
    assert_eq!(h["jobs"][0]["job_id"], held);
    assert_eq!(h["jobs"][0]["handle"], held_handle.as_str());
    assert_eq!(h["jobs"][0]["times"], 1);
    let metrics = fs::read_to_string(&prom).unwrap();
    assert!(
        metrics.contains("ci_ephemeral_provisioner_jobs_held_total{reason=\"pickup_timeout\"} 1"),
        "{metrics}"
    );
    // The audit trail has it too.
    let audit = fs::read_to_string(env.state.join("events.jsonl")).unwrap();
    assert!(
        audit
            .lines()
            .any(|l| l.contains("\"step\":\"hold_job\"")
                && l.contains(&format!("\"job_id\":{held}"))),
        "{audit}"
    );

    // While it is held, the next job is served and the held one gets no runner.
    set_holds_until(&env, "2099-01-01T00:00:00Z");
    let st = env.exec(env.cmd("status"));
    assert!(
        st.stdout
            .contains(&format!("held job {held}: listed as waiting")),
        "{st:?}"
    );
    let (next, _) = env.fake.add_job(&["debian"]);
    let posts_before = posts(&env);
    let out = env.run(&["--output", "json", "--job-pickup-timeout", "1s"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        posts(&env),
        posts_before + 1,
        "one runner, for the next job"
    );
    assert_eq!(job_status(&env, next), "success");
    assert_eq!(job_status(&env, held), "waiting");
    assert!(held_jobs(&env).is_some());
    // Held jobs alone start no cycle: the idle tick stays one request.
    env.fake.clear_requests();
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.json()["outcome"], "idle", "{out:?}");
    assert_eq!(env.fake.requests().len(), 1);

    // Once the run ahead of it ended and the hold is over, a later cycle serves it, and the
    // hold is forgotten with the job.
    env.fake.set_job_queued(held, false);
    set_holds_until(&env, "2000-01-01T00:00:00Z");
    let out = env.run(&["--output", "json", "--job-pickup-timeout", "1s"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(job_status(&env, held), "success");
    assert!(held_jobs(&env).is_none(), "nothing held: no file");
    env.assert_at_rest();
}

/// Writes a `held-jobs.json` that holds this attempt of the job until the far future.
fn plant_hold(env: &Env, job: i64, handle: &str) {
    use std::os::unix::fs::PermissionsExt;
    fs::create_dir_all(&env.state).unwrap();
    fs::set_permissions(&env.state, fs::Permissions::from_mode(0o700)).unwrap();
    let holds = serde_json::json!({"version": 1, "jobs": [{
        "job_id": job, "handle": handle, "held_at": "2026-12-01T20:00:00Z",
        "until": "2999-01-01T00:00:00Z", "times": 1
    }]});
    fs::write(env.state.join("held-jobs.json"), holds.to_string()).unwrap();
}

/// A hold is for the attempt Forgejo would not give out: once the job is cancelled and rerun
/// (a new attempt with a new handle, Forgejo's `PrepareNextAttempt`), that new chance is served
/// at once, and the old attempt's hold is forgotten. A job Forgejo cancels as abandoned (waiting
/// 24 h, `CancelAbandonedJobs`) takes its hold with it too.
#[test]
fn a_held_job_that_is_rerun_is_served_at_once_and_an_abandoned_ones_hold_is_forgotten() {
    let env = Env::new();
    let (job, first) = env.fake.add_job(&["debian"]);
    plant_hold(&env, job, &first);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.json()["outcome"], "idle", "held: {out:?}");
    env.fake.set_job_status(job, "cancelled");
    let second = env.fake.rerun_job(job);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let report = out.json();
    let registered = events(&report, "register_runner");
    assert_eq!(registered.len(), 1, "{report}");
    assert_eq!(job_status(&env, job), "success", "attempt 2 ran");
    let launched = fs::read_to_string(env.vm.join(format!(
        "launch-env.{}",
        registered[0]["runner_id"].as_i64().unwrap()
    )))
    .unwrap();
    assert!(
        launched.contains(&format!("JOB_HANDLE={second}\n")),
        "{launched}"
    );
    assert!(held_jobs(&env).is_none(), "the old attempt's hold is gone");
    env.assert_at_rest();

    // Abandoned: the cron cancels the waiting job; the next run forgets its hold.
    let (abandoned, handle) = env.fake.add_job(&["debian"]);
    plant_hold(&env, abandoned, &handle);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        env.fake.cancel_abandoned_jobs(Duration::from_millis(10)),
        [abandoned]
    );
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.json()["outcome"], "idle", "{out:?}");
    assert!(held_jobs(&env).is_none(), "nothing held: no file");
}

/// The teardown of a VM whose runner still runs its job (the hard deadline): when the VM's
/// shutdown sends the runner SIGTERM, forgejo-runner cancels its task and reports it failed, and
/// Forgejo deletes the ephemeral runner at once; the run takes that 404 as gone and ends at rest
/// without a DELETE of its own.
#[test]
fn a_teardown_whose_shutdown_cancels_a_running_task_converges() {
    let env = Env::new();
    env.set_launch_mode("take"); // the runner takes its job and keeps running
    env.fault("graceful-shutdown", true);
    let (job, _) = env.fake.add_job(&["debian"]);
    let out = env.run(&[
        "--output",
        "json",
        "--hard-deadline",
        "3s",
        "--max-cycle-duration",
        "3s",
    ]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let report = out.json();
    assert_eq!(job_status(&env, job), "failure", "{report}");
    assert!(
        env.fake.deleted_ids().is_empty(),
        "Forgejo deleted it: {report}"
    );
    let destroy = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .position(|e| e["step"] == "tofu_destroy")
        .unwrap();
    let forget = report["events"]
        .as_array()
        .unwrap()
        .iter()
        .position(|e| e["step"] == "forget_runner")
        .expect("forgotten on Forgejo's 404");
    assert!(destroy < forget, "{report}");
    env.assert_at_rest();
}

#[test]
fn a_queued_job_released_while_our_runner_waits_is_taken_by_that_runner() {
    // `one-job --wait` keeps asking: once the run ahead of it ends, Forgejo gives it the job.
    let env = Env::new();
    let (job, _) = env.fake.add_job(&["debian"]);
    env.fake.set_job_queued(job, true);
    let mut c = env.cmd("run");
    c.args(["--output", "json", "--job-pickup-timeout", "1m"]);
    c.stdout(std::process::Stdio::piped());
    let child = c.spawn().unwrap();
    wait_for("our runner to sit idle next to its queued job", || {
        env.fake
            .runners()
            .iter()
            .any(|r| r.name.starts_with("ephemeral-") && r.status == "idle")
    });
    env.fake.set_job_queued(job, false);
    let out = output_of(child);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert_eq!(
        events(&report, "forget_runner").len(),
        1,
        "consumed: {report}"
    );
    assert!(events(&report, "hold_job").is_empty(), "{report}");
    assert_eq!(job_status(&env, job), "success");
    assert!(held_jobs(&env).is_none());
    env.assert_at_rest();
}

#[test]
fn an_unusable_held_jobs_file_fails_the_run_once_and_is_replaced() {
    let env = Env::new();
    fs::create_dir_all(&env.state).unwrap();
    fs::write(env.state.join("held-jobs.json"), "{not json").unwrap();
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr.contains("held-jobs.json") && out.stderr.contains("removed"),
        "{}",
        out.stderr
    );
    assert!(held_jobs(&env).is_none());
    assert_eq!(env.run(&[]).code, Some(0), "the next run is clean");
}

#[test]
fn a_never_connected_runner_whose_delete_answer_is_lost_is_still_a_failed_start() {
    // Forgejo applies the first DELETE but its answer never arrives; the next round sees a 404,
    // which must not pass for a runner that ran its job: still three starts, then the VM goes.
    let env = Env::new();
    env.set_launch_mode("noop");
    env.fake.add_job(&["debian"]);
    env.fake
        .inject("DELETE", "/actions/runners/", Fault::ApplyThenDrop, 1);
    let out = env.run(&["--output", "json"]);
    let report = out.json();
    assert_eq!(out.code, Some(1), "{report}");
    assert_eq!(events(&report, "launch_runner").len(), 3, "{report}");
    let teardown = events(&report, "teardown");
    assert!(
        teardown[0]["detail"]
            .as_str()
            .unwrap()
            .contains("presumed broken"),
        "{report}"
    );
    env.assert_at_rest();
}

#[test]
fn a_failed_registration_whose_body_holds_a_token_never_shows_it() {
    // RegisterRunner after a failed insert: `ctx.Error(500, …)` and then, without a return, the
    // answer it would have given (routers/api/v1/shared/runners.go) — runner token and all.
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    let token = "5d1c0ffee5d1c0ffee5d1c0ffee5d1c0ffee5d1c";
    let body = format!(
        "{{\"message\":\"CreateRunner: pq: value too long for type character varying(255)\",\"url\":\"https://forgejo.invalid/api/swagger\"}}\n{{\"id\":0,\"uuid\":\"00000000-0000-4000-8000-000000000000\",\"token\":\"{token}\"}}"
    );
    env.fake
        .inject("POST", "/actions/runners", Fault::StatusBody(500, body), 1);
    // And something in between that echoes an answer without any message.
    let echo = format!("{{\"id\":7,\"token\":\"{token}\"}}");
    env.fake
        .inject("POST", "/actions/runners", Fault::StatusBody(502, echo), 1);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(1), "a failed POST is a failure: {out:?}");
    assert!(
        out.stdout.contains("value too long"),
        "Forgejo's message is kept: {out:?}"
    );
    for text in [&out.stdout, &out.stderr] {
        assert!(!text.contains(&token[..12]), "the token leaked: {text}");
    }
    for f in walk(&env.state) {
        let content = fs::read_to_string(&f).unwrap_or_default();
        assert!(
            !content.contains(&token[..12]),
            "{} holds the token",
            f.display()
        );
    }
    env.assert_at_rest();
}

/// An organization renamed mid-cycle, its old name's redirect gone: every route of
/// `--scope org/acme` answers Forgejo's 404 `GetOrgByName` (`orgAssignment`), which is not the
/// runner's own 404 and proves nothing about it. The registration stays in cycle.json, the run
/// fails naming the scope, `check` says the scope does not exist; with `--scope` set to the new
/// name, the next run ends the cycle as usual.
#[test]
fn a_renamed_org_mid_cycle_never_makes_a_registration_be_forgotten() {
    let env = Env::new();
    let org = env.fake.add_org("acme");
    let repo = env.fake.add_repo("acme/app");
    env.set_launch_mode("take");
    let (job, _) = env.fake.add_scoped_job(&["debian"], org, repo);
    let mut c = env.cmd("run");
    c.args(["--scope", "org/acme", "--output", "json"]);
    c.stdout(std::process::Stdio::piped());
    c.stderr(std::process::Stdio::null());
    let child = c.spawn().unwrap();
    wait_for("the runner to take its job", || {
        job_status(&env, job) == "running"
    });
    let runner = env.our_runners()[0];
    env.fake.rename_owner("acme", "acme-corp", false);
    let out = output_of(child);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{report}");
    let named =
        "Forgejo says organization acme does not exist (404 GetOrgByName): --scope org/acme";
    assert!(
        report["failures"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f.as_str().unwrap().contains(named)),
        "{report}"
    );
    assert!(events(&report, "forget_runner").is_empty(), "{report}");
    assert_eq!(env.cycle_json().unwrap()["registrations"][0]["id"], runner);
    assert!(env.fake.runner(runner).is_some(), "it still exists");
    assert_eq!(env.live_vms().len(), 1, "its VM still runs it");

    let mut c = env.cmd("check");
    c.args(["--scope", "org/acme", "--tofu-bin", "/nonexistent/tofu"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(1), "{out:?}");
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("FAIL  token scope: "))
        .unwrap_or_else(|| panic!("{out:?}"));
    assert!(line.contains(named), "{line}");

    // The job ends; Forgejo removes the registration; under the new name the cycle ends.
    let uuid = env.fake.runner(runner).unwrap().uuid;
    let token = fs::read_to_string(env.vm.join("runners").join(&uuid)).unwrap();
    ureq::post(format!("{}/_fake/finish", env.fake.url()))
        .header("X-Runner-UUID", &uuid)
        .send(token.as_bytes())
        .unwrap();
    fs::remove_file(env.vm.join("runners").join(&uuid)).unwrap();
    let out = env.run(&["--scope", "org/acme-corp"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    env.assert_at_rest();
}

/// A DELETE answered with the scope's 404 (`GetOrgByName`: the organization was not found for
/// that request) did not delete anything, and is not the runner's "already gone": the
/// registration is kept and deleted for real next time.
#[test]
fn a_delete_answered_with_the_scopes_404_is_not_already_gone() {
    let env = Env::new();
    let org = env.fake.add_org("acme");
    let repo = env.fake.add_repo("acme/app");
    env.set_launch_mode("noop"); // never connects: deleted after the grace
    env.fake.add_scoped_job(&["debian"], org, repo);
    let body = serde_json::json!({
        "message": "GetOrgByName",
        "url": crate::support::fake_forgejo::SWAGGER_URL,
        "errors": ["user redirect does not exist [name: acme]"],
    });
    env.fake.inject(
        "DELETE",
        "/actions/runners/",
        Fault::StatusBody(404, body.to_string()),
        1,
    );
    let out = env.run(&[
        "--scope",
        "org/acme",
        "--output",
        "json",
        "--max-jobs-per-vm",
        "1",
    ]);
    let report = out.json();
    assert_eq!(out.code, Some(1), "{report}");
    assert!(
        report["failures"].as_array().unwrap().iter().any(|f| f
            .as_str()
            .unwrap()
            .contains("Forgejo says organization acme does not exist")),
        "{report}"
    );
    let deletes: Vec<(bool, &str)> = events(&report, "delete_runner")
        .iter()
        .map(|e| (e["ok"] == true, e["detail"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(deletes.len(), 2, "{report}");
    assert!(!deletes[0].0, "{report}");
    assert_eq!(deletes[1], (true, "deleted"), "{report}");
    env.assert_at_rest();
}

/// A waiting job listed without a handle (missing, `null` or empty) is never served: a runner
/// started with `one-job --handle ""` would take any job of its labels (forgejo-runner
/// `internal/app/cmd/job.go`, `internal/app/poll/single.go`). No registration, no VM; a
/// warning names it. The control: the same job with its handle gets its runner.
#[test]
fn a_job_without_a_handle_is_never_served() {
    let env = Env::new();
    let (job, handle) = env.fake.add_job(&["debian"]);
    let listed = |handle: Option<serde_json::Value>| {
        let mut j = serde_json::json!({"id": job, "attempt": 1, "repo_id": 1, "owner_id": 1,
            "name": "build", "needs": null, "runs_on": ["debian"], "task_id": 0,
            "status": "waiting"});
        if let Some(h) = handle {
            j["handle"] = h;
        }
        format!("[{j}]")
    };
    for (what, body) in [
        ("missing", listed(None)),
        ("null", listed(Some(serde_json::Value::Null))),
        ("empty", listed(Some(serde_json::json!("")))),
    ] {
        env.fake
            .inject("GET", "/actions/runners/jobs", Fault::Body(body), 1);
        let out = env.run(&["--output", "json"]);
        assert_eq!(out.code, Some(0), "{what}: {out:?}");
        assert_eq!(out.json()["outcome"], "idle", "{what}: {out:?}");
        assert!(
            out.stderr.contains(&format!(
                "job {job} is listed without a handle; not serving it"
            )),
            "{what}: {out:?}"
        );
        assert_eq!(posts(&env), 0, "{what}");
        assert!(env.vm_log().is_empty(), "{what}: {}", env.vm_log());
    }
    assert!(!handle.is_empty());
    let out = env.run(&[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(posts(&env), 1);
    assert_eq!(job_status(&env, job), "success");
}

/// The tests' launch command refuses to start a runner for an empty `JOB_HANDLE`, as every
/// launch command must; the control starts one.
#[test]
fn the_test_launch_command_refuses_an_empty_job_handle() {
    let env = Env::new();
    fs::write(env.vm.join("launch-mode"), "noop").unwrap();
    let launch = |handle: &str| {
        let mut c = std::process::Command::new(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bin/launch.sh"),
        );
        c.env("VM_DIR", &env.vm)
            .env("RUNNER_ID", "7")
            .env("RUNNER_UUID", "00000000-0000-4000-8000-000000000007")
            .env("RUNNER_LABELS", "debian:host")
            .env("FORGEJO_URL", env.fake.url())
            .env("JOB_HANDLE", handle)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = c.spawn().unwrap();
        use std::io::Write;
        // One that refuses exits before it reads: EPIPE is its answer, not ours.
        let _ = child.stdin.take().unwrap().write_all(b"runner-token\n");
        output_of(child)
    };
    let out = launch("");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("JOB_HANDLE is empty"),
        "{out:?}"
    );
    assert!(!env.vm.join("launch-env.7").exists(), "it started");
    let out = launch("h-7");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(env.vm.join("launch-env.7").exists());
}

/// `create` lines in the VM log: VMs started.
fn vm_starts(env: &Env) -> usize {
    env.vm_log()
        .lines()
        .filter(|l| l.starts_with("create "))
        .count()
}

fn backoff_json(env: &Env) -> serde_json::Value {
    let text = fs::read_to_string(env.state.join("backoff.json")).expect("backoff.json");
    serde_json::from_str(&text).expect("backoff.json is JSON")
}

/// The done-when of the failure backoff: a pool whose every launch fails starts a bounded
/// number of VMs, says why and until when, and serves again by itself once fixed.
#[test]
fn a_pool_whose_launches_all_fail_backs_off_says_until_when_and_serves_again_once_fixed() {
    let env = Env::new();
    env.set_launch_mode("fail");
    env.fake.add_job(&["debian"]);
    // 5s: far longer than the gap between two runs here, short enough to wait out.
    let flags = [
        "--output",
        "json",
        "--max-failed-cycles",
        "2",
        "--failure-backoff",
        "5s",
        "--failure-backoff-max",
        "10s",
    ];
    for n in 1..=2 {
        let out = env.run(&flags);
        assert_eq!(out.code, Some(1), "{out:?}");
        assert_eq!(vm_starts(&env), n);
    }
    let b = backoff_json(&env);
    assert_eq!(b["consecutive_failed_cycles"], 2, "{b}");
    assert_eq!(b["last_reason"], "broken_vm", "{b}");
    let events = fs::read_to_string(env.state.join("events.jsonl")).unwrap();
    assert!(events.contains("\"step\":\"backoff\""), "{events}");

    // Backing off: nothing applied, nothing registered, exit 0, and it says why and until when.
    let posts_before = posts(&env);
    let out = env.run(&flags);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(vm_starts(&env), 2, "no VM while backing off");
    assert_eq!(
        posts(&env),
        posts_before,
        "no registration while backing off"
    );
    let report = out.json();
    assert_eq!(report["outcome"], "backing_off", "{report}");
    assert_eq!(report["backoff"]["until"], b["until"], "{report}");
    assert_eq!(report["backoff"]["reason"], "broken_vm", "{report}");
    assert!(out.stderr.contains("backing off since"), "{}", out.stderr);
    let last: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(env.state.join("last-run.json")).unwrap())
            .unwrap();
    assert_eq!(last["outcome"], "backing_off");
    let status = env.exec(env.cmd("status"));
    assert!(status.stdout.contains("backing off"), "{status:?}");

    // Fixed; once the backoff has passed, the next run serves the job and ends the backoff.
    env.set_launch_mode("one-job");
    let until = ci_ephemeral_provisioner::core::time::Timestamp::parse_rfc3339(
        b["until"].as_str().unwrap(),
    )
    .unwrap()
    .to_system();
    wait_for("the backoff to pass", || {
        std::time::SystemTime::now() > until
    });
    let out = env.run(&flags);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(vm_starts(&env), 3);
    assert_eq!(out.json()["summary"]["consumed"], 1, "{out:?}");
    let b = backoff_json(&env);
    assert_eq!(b["consecutive_failed_cycles"], 0, "{b}");
    assert!(b["until"].is_null(), "{b}");
    let events = fs::read_to_string(env.state.join("events.jsonl")).unwrap();
    assert!(events.contains("\"step\":\"backoff_ended\""), "{events}");
    env.assert_at_rest();
}

#[test]
fn an_unusable_backoff_file_starts_no_vm_and_fails_naming_it() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    fs::create_dir_all(&env.state).unwrap();
    fs::write(env.state.join("backoff.json"), "{\"version\": 1, \"consecu").unwrap();
    let out = env.run(&[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr.contains("backoff.json is unusable"),
        "{}",
        out.stderr
    );
    assert_eq!(vm_starts(&env), 0);
    assert_eq!(posts(&env), 0);
    assert!(env.cycle_json().is_none());
}

fn spawn_run(env: &Env, extra: &[&str]) -> (std::process::Child, std::path::PathBuf) {
    let err = env
        .tmp
        .path()
        .join(format!("warm-{}.stderr", extra.join("_")));
    let mut c = env.cmd("run");
    c.args(extra);
    c.stdin(std::process::Stdio::null());
    c.stdout(std::process::Stdio::null());
    c.stderr(fs::File::create(&err).unwrap());
    (c.spawn().expect("spawn the binary"), err)
}

/// The child's exit status (panics after 60 s: a run that should end but hangs fails the test).
fn exited(child: &mut std::process::Child) -> std::process::ExitStatus {
    let mut status = None;
    wait_for("the run to end", || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    status.unwrap()
}

/// The done-when of warm capacity: with `--warm 1` a job arriving at an idle pool is launched on
/// a VM booted before it arrived (no apply on its path), and at `--warm 0` nothing is left.
#[test]
fn a_warm_vm_serves_the_next_job_with_no_apply_on_its_path_and_goes_at_warm_0() {
    let env = Env::new();
    let warm = ["--warm", "1", "--warm-max-age", "1h"];
    let (child, err) = spawn_run(&env, &warm);
    wait_for("the warm VM to be up", || {
        env.cycle_json()
            .is_some_and(|c| c["phase"] == "running" && c["warm"] == true)
    });
    assert_eq!(vm_starts(&env), 1);
    assert_eq!(posts(&env), 0, "a warm VM registers no runner");
    let status = env.exec(env.cmd("status"));
    assert!(status.stdout.contains("(a warm VM"), "{status:?}");
    let (job, _) = env.fake.add_job(&["debian"]);
    wait_for("the job to be served", || {
        env.fake
            .jobs()
            .iter()
            .any(|j| j.id == job && j.status == "success")
    });
    assert_eq!(
        vm_starts(&env),
        1,
        "no VM boot between the job and its launch"
    );
    assert_eq!(posts(&env), 1);
    // Used, the VM follows --idle-timeout (300ms here): the run tears it down and ends.
    let mut child = child;
    let status = exited(&mut child);
    let stderr = fs::read_to_string(&err).unwrap();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("(warm: no job yet)"), "{stderr}");
    env.assert_at_rest();

    // SIGHUP ends a run at its wait, the warm VM kept; the next run, with --warm 0, ends it.
    let (mut child, err) = spawn_run(&env, &warm);
    wait_for("a new warm VM to be up", || {
        env.cycle_json().is_some_and(|c| c["phase"] == "running")
    });
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    let status = exited(&mut child);
    let stderr = fs::read_to_string(&err).unwrap();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("SIGHUP: ending this run at its wait"),
        "{stderr}"
    );
    let last: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(env.state.join("last-run.json")).unwrap())
            .unwrap();
    assert_eq!(last["outcome"], "reload");
    assert_eq!(env.live_vms().len(), 1, "{}", env.vm_log());
    assert_eq!(env.cycle_json().unwrap()["warm"], true);
    let out = env.run(&["--warm", "0", "--output", "json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stderr.contains("the pool wants fewer warm VMs"),
        "{}",
        out.stderr
    );
    env.assert_at_rest();
    assert_eq!(vm_starts(&env), 2);
}

#[test]
fn warm_vms_are_bounded_by_the_slots_and_their_age() {
    let env = Env::new();
    let out = env.run(&["--warm", "2"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr.contains("--warm 2 is more than --slots 1"),
        "{}",
        out.stderr
    );
    let out = env.run(&["--warm", "1", "--warm-max-age", "999ms"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr
            .contains("--warm-max-age (999ms) must be at least 10 times --poll-interval (100ms)"),
        "{}",
        out.stderr
    );
    let out = env.run(&["--warm-during", "Mon..Fri 19:00-07:00"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("before it starts"), "{}", out.stderr);
    // An unused warm VM past --warm-max-age goes, and the run ends; the next one makes another.
    let out = env.run(&["--warm", "1", "--warm-max-age", "1s", "--output", "json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stderr.contains("ran no job within --warm-max-age"),
        "{}",
        out.stderr
    );
    env.assert_at_rest();
    assert_eq!(vm_starts(&env), 1);
}
