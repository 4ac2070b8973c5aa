//! What an operator and their monitoring see, read from the files the built binary wrote after
//! real runs against the fake Forgejo and the real terraform/tofu CLI: the run report
//! (stdout and last-run.json), the audit trail (events.jsonl and its rotation), the Prometheus
//! text file, `status` (and `status --check`), and the logs under journald.

mod dashboard;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::fake_forgejo::{Conn, Fault};
use crate::support::harness::{API_TOKEN, Env};
use serde_json::Value;

fn metrics_path(env: &Env) -> PathBuf {
    let dir = env.tmp.path().join("textfile");
    fs::create_dir_all(&dir).unwrap();
    dir.join("ci-ephemeral-provisioner.prom")
}

/// `name{labels}` → value, for every sample of the text file.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').expect("sample line");
            (k.to_string(), v.parse::<f64>().expect("numeric value"))
        })
        .collect()
}

fn metric(m: &BTreeMap<String, f64>, key: &str) -> f64 {
    let key = format!("ci_ephemeral_provisioner_{key}");
    *m.get(&key)
        .unwrap_or_else(|| panic!("no sample {key} in {m:?}"))
}

/// `promtool check metrics` on the real file when promtool is installed (`.ci/obs` installs
/// it and also checks the copies left in `$OBS_ARTIFACTS`).
pub(crate) fn promtool_check(path: &Path, label: &str) {
    if let Some(dir) = std::env::var_os("OBS_ARTIFACTS") {
        fs::create_dir_all(&dir).unwrap();
        fs::copy(path, Path::new(&dir).join(format!("{label}.prom"))).unwrap();
    }
    let Ok(mut child) = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    else {
        eprintln!("promtool not installed: {label} checked by .ci/obs only");
        return;
    };
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&fs::read(path).unwrap())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics rejected {label}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn events(env: &Env, file: &str) -> Vec<Value> {
    fs::read_to_string(env.state.join(file))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{file}: {e}: {l}")))
        .collect()
}

fn last_run(env: &Env) -> Value {
    serde_json::from_str(&fs::read_to_string(env.state.join("last-run.json")).unwrap()).unwrap()
}

fn status(env: &Env, args: &[&str]) -> crate::support::harness::Outcome {
    let mut c = env.cmd("status");
    c.args(args);
    env.exec(c)
}

/// Every file under `dir`, for the check that nothing holds the token.
fn assert_no_token_under(dir: &Path) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            assert_no_token_under(&p);
        } else if let Ok(text) = fs::read(&p) {
            assert!(
                !String::from_utf8_lossy(&text).contains(&API_TOKEN[..12]),
                "the token is in {}",
                p.display()
            );
        }
    }
}

/// A job our runner took: one pickup in the histogram, no longer than the run; the same
/// pickup in its `take_job` event, and in `status`.
#[test]
fn a_served_job_has_its_pickup_in_the_metrics_its_event_and_status() {
    let env = Env::new();
    let (job, _) = env.fake.add_job(&["debian"]);
    let prom = metrics_path(&env);
    let out = env.run(&["--output", "json", "--metrics-file", prom.to_str().unwrap()]);
    assert_eq!(out.code, Some(0), "{out:?}");
    env.assert_at_rest();
    let report = out.json();
    assert_eq!(report["outcome"], "cycle_finished", "{report}");
    let run_ms = report["duration_ms"].as_u64().unwrap();

    promtool_check(&prom, "after-a-pickup");
    let m = samples(&fs::read_to_string(&prom).unwrap());
    assert_eq!(metric(&m, "job_pickup_seconds_count"), 1.0);
    assert_eq!(metric(&m, "job_pickup_seconds_bucket{le=\"+Inf\"}"), 1.0);
    let sum = metric(&m, "job_pickup_seconds_sum");
    assert!(
        (0.0..=run_ms as f64 / 1000.0).contains(&sum),
        "{sum} s within the run's {run_ms} ms"
    );

    let trail = events(&env, "events.jsonl");
    let took: Vec<&Value> = trail.iter().filter(|e| e["step"] == "take_job").collect();
    assert_eq!(took.len(), 1, "{trail:?}");
    assert_eq!(took[0]["job_id"], job, "{}", took[0]);
    let pickup_ms = took[0]["pickup_ms"]
        .as_u64()
        .expect("the event carries the pickup");
    assert_eq!((sum * 1000.0).round() as u64, pickup_ms);

    let doc = status(&env, &["--output", "json"]).json();
    assert_eq!(doc["pickup"]["jobs"], 1, "{doc}");
    assert_eq!(doc["pickup"]["p50_ms"], pickup_ms, "{doc}");
    assert!(doc["pool_pickup"].is_null(), "a pool of one slot: {doc}");
    let st = status(&env, &[]);
    assert!(
        st.stdout.contains("\njob pickup: the last 1 job(s): p50 "),
        "{st:?}"
    );
}

#[test]
fn a_cycle_leaves_a_report_an_audit_trail_metrics_and_a_status() {
    let env = Env::new();
    for id in [514, 516] {
        env.fake.add_runner_with_id(
            id,
            &format!("ephemeral-old-{id}"),
            true,
            Conn::NeverConnected,
        );
    }
    env.fake.add_runner_with_id(
        601,
        "static-builder",
        false,
        Conn::OfflineFor(Duration::from_secs(600)),
    );
    // The runner connects, then dies before taking its job: its registration is deleted as
    // unconsumed; one job per VM.
    env.set_launch_mode("die");
    env.fake.add_job(&["debian"]);
    // An audit trail just under its bound: this run's first record rotates it.
    fs::create_dir_all(&env.state).unwrap();
    let filler = format!("{{\"filler\": \"{}\"}}\n", "x".repeat(200));
    let old = filler.repeat(16 * 1024 / filler.len());
    fs::write(env.state.join("events.jsonl"), &old).unwrap();
    let prom = metrics_path(&env);

    let out = env.run(&[
        "--output",
        "json",
        "--max-jobs-per-vm",
        "1",
        "--events-max-bytes",
        "16KiB",
        "--metrics-file",
        prom.to_str().unwrap(),
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    env.assert_at_rest();

    // The report: one JSON document on stdout, the same as last-run.json.
    let report = out.json();
    assert_eq!(
        report,
        last_run(&env),
        "last-run.json is the printed report"
    );
    let cycle_id = report["cycle_id"].as_str().unwrap().to_string();
    assert_eq!(report["outcome"], "cycle_finished");
    assert_eq!(report["exit_code"], 0);
    let s = &report["summary"];
    assert_eq!(
        (
            &s["vm_applied"],
            &s["vm_destroyed"],
            &s["registered"],
            &s["launched"]
        ),
        (&1.into(), &1.into(), &1.into(), &1.into()),
        "{report}"
    );
    assert_eq!(s["deleted"]["unconsumed"], 1, "{report}");
    assert_eq!(s["deleted"]["sweep"], 2, "{report}");
    assert_eq!(report["sweep"]["deleted"].as_array().unwrap().len(), 2);
    assert_eq!(report["sweep"]["left_over_cap"], 0);
    assert!(report["finished_at"].is_string() && report["duration_ms"].is_u64());
    for e in report["events"].as_array().unwrap() {
        assert!(
            e["duration_ms"].is_u64(),
            "every step has its duration: {e}"
        );
    }

    // The audit trail: the filler moved to events.jsonl.1, this run's records in events.jsonl,
    // neither over the bound.
    assert_eq!(
        fs::read_to_string(env.state.join("events.jsonl.1")).unwrap(),
        old
    );
    assert!(fs::metadata(env.state.join("events.jsonl")).unwrap().len() <= 16 * 1024);
    let trail = events(&env, "events.jsonl");
    assert!(
        trail
            .iter()
            .all(|e| e["cycle_id"] == cycle_id.as_str() && e["at"].is_string())
    );
    for step in [
        "start_cycle",
        "tofu_apply",
        "register_runner",
        "launch_runner",
        "tofu_destroy",
    ] {
        assert!(
            trail.iter().any(|e| e["step"] == step && e["ok"] == true),
            "{step} in {trail:?}"
        );
    }
    // Every registration Forgejo lost can be found with the evidence that made it deletable.
    let deleted = env.fake.deleted_ids();
    assert_eq!(deleted.len(), 3, "one unconsumed, two swept: {deleted:?}");
    for id in deleted {
        let find = |kind: &str| {
            trail
                .iter()
                .position(|e| {
                    e["step"] == "delete_runner" && e["runner_id"] == id && e["kind"] == kind
                })
                .unwrap_or_else(|| panic!("no {kind} of deleting {id} in the trail: {trail:?}"))
        };
        // The intent (with the same evidence) is written before the DELETE is sent, so a crash
        // right after it still leaves the deletion in the trail.
        let (intent, done) = (find("intent"), find("side_effect"));
        assert!(intent < done);
        let rec = &trail[done];
        for k in ["name", "status", "reason", "destroyed_cycle_id", "evidence"] {
            assert_eq!(trail[intent][k], rec[k], "{k}");
        }
        assert_eq!(rec["ok"], true);
        assert_eq!(rec["status"], "offline", "{rec}");
        assert!(
            rec["name"].as_str().unwrap().starts_with("ephemeral-"),
            "{rec}"
        );
        if [514, 516].contains(&id) {
            assert_eq!(rec["reason"], "sweep", "{rec}");
            assert_eq!(rec["destroyed_cycle_id"], cycle_id.as_str(), "{rec}");
            assert!(
                rec["evidence"].as_str().unwrap().contains("destroy"),
                "{rec}"
            );
            // The sweep deleted after the destroy, and the trail says so in order.
            let pos = |pred: &dyn Fn(&Value) -> bool| trail.iter().position(pred).unwrap();
            assert!(
                pos(&|e| e["step"] == "tofu_destroy")
                    < pos(&|e| e["step"] == "delete_runner" && e["runner_id"] == id)
            );
        } else {
            assert_eq!(rec["reason"], "unconsumed", "{rec}");
        }
    }

    // The metrics file, accepted by promtool, readable by node_exporter, nothing half-written.
    let text = fs::read_to_string(&prom).unwrap();
    promtool_check(&prom, "after-a-cycle");
    assert_eq!(fs::metadata(&prom).unwrap().mode() & 0o777, 0o644);
    assert_eq!(fs::read_dir(prom.parent().unwrap()).unwrap().count(), 1);
    let m = samples(&text);
    let last = metric(&m, "last_run_timestamp_seconds");
    assert!(last > 1.7e9, "{text}");
    assert_eq!(metric(&m, "last_success_timestamp_seconds"), last);
    assert_eq!(metric(&m, "last_run_exit_code"), 0.0);
    assert_eq!(metric(&m, "cycle_active"), 0.0);
    assert_eq!(
        metric(&m, "registrations_deleted_total{reason=\"unconsumed\"}"),
        1.0
    );
    assert_eq!(
        metric(&m, "registrations_deleted_total{reason=\"sweep\"}"),
        2.0
    );
    assert_eq!(metric(&m, "sweep_deletions_total"), 2.0);
    assert_eq!(metric(&m, "destroy_failures_total"), 0.0);
    assert_eq!(
        metric(&m, "runs_total{command=\"run\",exit_code=\"0\"}"),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            &format!("build_info{{version=\"{}\"}}", env!("CARGO_PKG_VERSION"))
        ),
        1.0
    );

    // status: healthy, the last run, the last 10 events (some from before the rotation were
    // filler without a step; the newest ten are this run's).
    let st = status(&env, &["--output", "json", "--check"]);
    assert_eq!(st.code, Some(0), "{st:?}");
    let doc = st.json();
    assert_eq!(doc["healthy"], true, "{doc}");
    assert_eq!(doc["last_run"]["outcome"], "cycle_finished");
    assert!(doc["last_run_age_seconds"].is_u64());
    let shown = doc["events"].as_array().unwrap();
    assert_eq!(shown.len(), 10);
    assert_eq!(shown.last().unwrap(), trail.last().unwrap());
    let st = status(&env, &[]);
    assert_eq!(st.code, Some(0), "{st:?}");
    for want in [
        "health: ok",
        "cycle: none",
        "cycle_finished (exit 0)",
        "deleted 2 sweep, 1 unconsumed",
        "recent events (last 10):",
        "(sweep, seen offline, after the destroy of",
    ] {
        assert!(st.stdout.contains(want), "{want:?} in {st:?}");
    }

    // The text report is a short summary of the same (the job the runner never took is gone).
    env.fake.set_job_status(env.fake.jobs()[0].id, "cancelled");
    let mut c = env.cmd("run");
    c.args(["--metrics-file", prom.to_str().unwrap()]);
    let text_out = env.exec(c);
    assert_eq!(text_out.code, Some(0), "{text_out:?}");
    assert!(
        text_out
            .stdout
            .starts_with("run (no cycle): idle (exit 0, "),
        "{text_out:?}"
    );
    let m = samples(&fs::read_to_string(&prom).unwrap());
    assert_eq!(
        metric(&m, "runs_total{command=\"run\",exit_code=\"0\"}"),
        2.0
    );
    assert_eq!(
        metric(&m, "registrations_deleted_total{reason=\"sweep\"}"),
        2.0,
        "counters accumulate across runs"
    );
    assert_no_token_under(&env.state);
    assert_no_token_under(prom.parent().unwrap());
}

#[test]
fn a_failed_destroy_is_counted_warned_about_and_cleared_by_the_next_success() {
    let env = Env::new();
    env.fake
        .add_runner_with_id(514, "ephemeral-old-514", true, Conn::NeverConnected);
    env.fake.add_job(&["debian"]);
    env.fault("fail-destroy", true);
    let prom = metrics_path(&env);
    let prom_arg = prom.to_str().unwrap();
    let out = env.run(&["--metrics-file", prom_arg]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stdout.contains("destroy_failed (exit 1"), "{out:?}");
    assert!(out.stdout.contains("FAIL"), "{out:?}");

    let text = fs::read_to_string(&prom).unwrap();
    promtool_check(&prom, "after-a-failed-destroy");
    let m = samples(&text);
    assert_eq!(metric(&m, "last_run_exit_code"), 1.0);
    assert_eq!(metric(&m, "last_success_timestamp_seconds"), 0.0);
    assert_eq!(metric(&m, "destroy_failures_total"), 1.0);
    assert_eq!(metric(&m, "destroy_failing"), 1.0);
    assert_eq!(metric(&m, "cycle_active"), 1.0);
    assert_eq!(metric(&m, "cycle_jobs_started"), 1.0);
    assert!(metric(&m, "cycle_start_timestamp_seconds") > 1.7e9);
    assert_eq!(
        metric(&m, "registrations_deleted_total{reason=\"sweep\"}"),
        0.0
    );

    // The trail holds the failed step and the failure itself.
    let trail = events(&env, "events.jsonl");
    assert!(
        trail
            .iter()
            .any(|e| e["step"] == "tofu_destroy" && e["ok"] == false)
    );
    assert!(trail.iter().any(|e| {
        e["kind"] == "failure"
            && e["detail"]
                .as_str()
                .unwrap()
                .contains("tofu destroy failed")
    }));

    // status --check fails: no success yet, the destroy failed; with a short
    // --max-cycle-duration, the cycle is too old as well.
    let st = status(&env, &["--check", "--max-cycle-duration", "1ms"]);
    assert_eq!(st.code, Some(1), "{st:?}");
    for want in [
        "no successful run since runs began",
        "the last tofu destroy failed",
        "longer than --max-cycle-duration 1ms",
        "phase tearing_down",
    ] {
        assert!(st.stdout.contains(want), "{want:?} in {st:?}");
    }
    assert_eq!(
        status(&env, &[]).code,
        Some(0),
        "warnings fail only with --check"
    );

    // A sweep past the lock while the cycle exists is refused, and that is a recorded run.
    let mut c = env.cmd("sweep");
    c.args(["--metrics-file", prom_arg, "--output", "json"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert_eq!(last_run(&env)["outcome"], "refused");
    let m = samples(&fs::read_to_string(&prom).unwrap());
    assert_eq!(
        metric(&m, "runs_total{command=\"sweep\",exit_code=\"1\"}"),
        1.0
    );

    // The next run retries the destroy, sweeps, and is a success.
    env.fault("fail-destroy", false);
    let out = env.run(&["--metrics-file", prom_arg]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let m = samples(&fs::read_to_string(&prom).unwrap());
    promtool_check(&prom, "after-recovery");
    assert_eq!(metric(&m, "destroy_failing"), 0.0);
    assert_eq!(metric(&m, "destroy_failures_total"), 1.0);
    assert_eq!(
        metric(&m, "runs_total{command=\"run\",exit_code=\"1\"}"),
        1.0
    );
    assert_eq!(
        metric(&m, "runs_total{command=\"run\",exit_code=\"0\"}"),
        1.0
    );
    assert!(metric(&m, "last_success_timestamp_seconds") > 1.7e9);
    assert_eq!(metric(&m, "cycle_active"), 0.0);
    let st = status(&env, &["--check"]);
    assert_eq!(st.code, Some(0), "{st:?}");

    // A success older than --max-success-age is a warning (the counters file is what says when).
    let counters_path = env.state.join("counters.json");
    let mut counters: Value =
        serde_json::from_str(&fs::read_to_string(&counters_path).unwrap()).unwrap();
    counters["last_success_at"] = "2026-01-01T00:00:00Z".into();
    fs::write(&counters_path, counters.to_string()).unwrap();
    fs::remove_file(env.state.join("last-run.json")).unwrap();
    let st = status(&env, &["--check", "--max-success-age", "2h"]);
    assert_eq!(st.code, Some(1), "{st:?}");
    assert!(
        st.stdout.contains("older than --max-success-age 2h"),
        "{st:?}"
    );

    // A standalone sweep names the cycle whose destroy last succeeded as its evidence.
    let stale = env
        .fake
        .add_runner("ephemeral-stale-later", true, Conn::NeverConnected);
    let mut c = env.cmd("sweep");
    c.args(["--metrics-file", prom_arg]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    let rec = events(&env, "events.jsonl")
        .into_iter()
        .find(|e| e["runner_id"] == stale && e["kind"] == "side_effect")
        .expect("the sweep's deletion is in the trail");
    assert_eq!(rec["reason"], "sweep");
    assert_eq!(rec["status"], "offline");
    assert!(rec["destroyed_cycle_id"].is_string(), "{rec}");
    assert!(
        rec["evidence"]
            .as_str()
            .unwrap()
            .contains("no cycle in progress"),
        "{rec}"
    );
    let m = samples(&fs::read_to_string(&prom).unwrap());
    assert_eq!(
        metric(&m, "runs_total{command=\"sweep\",exit_code=\"0\"}"),
        1.0
    );
    assert_eq!(metric(&m, "sweep_deletions_total"), 2.0);
}

#[test]
fn only_runs_past_the_lock_write_metrics() {
    let env = Env::new();
    let prom = metrics_path(&env);
    let prom_arg = prom.to_str().unwrap();

    // Before anything ran (the service made its state directory), status --check says so.
    fs::create_dir_all(&env.state).unwrap();
    let st = status(&env, &["--check"]);
    assert_eq!(st.code, Some(1), "{st:?}");
    assert!(st.stdout.contains("no run recorded yet"), "{st:?}");

    // A usage error (before the lock) writes nothing.
    let mut c = env.cmd("run");
    c.args(["--metrics-file", prom_arg, "--runner-prefix", ""]);
    assert_eq!(env.exec(c).code, Some(2));
    let mut c = env.cmd("run");
    c.args(["--metrics-file", &prom_arg.replace(".prom", ".txt")]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("must end in .prom"), "{out:?}");
    assert!(!prom.exists());

    // A held lock: exit 75, nothing written.
    fs::create_dir_all(&env.state).unwrap();
    let lock = fs::File::create(env.state.join("cycle.lock")).unwrap();
    lock.lock().unwrap();
    let mut c = env.cmd("run");
    c.args(["--metrics-file", prom_arg]);
    assert_eq!(env.exec(c).code, Some(75));
    drop(lock);
    assert!(!prom.exists());

    // A dry-run (live, against the fake) writes nothing at all.
    env.fake.add_job(&["debian"]);
    let mut c = env.cmd("run");
    c.args(["--metrics-file", prom_arg, "--dry-run"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(!prom.exists());
    let names: Vec<String> = fs::read_dir(&env.state)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["cycle.lock"], "a dry-run writes nothing");

    // A configuration error found past the lock is a recorded run: exit 2, no success.
    let mut c = env.cmd("run");
    c.args([
        "--metrics-file",
        prom_arg,
        "--tofu-dir",
        "/nonexistent/module",
    ]);
    assert_eq!(env.exec(c).code, Some(2));
    let m = samples(&fs::read_to_string(&prom).unwrap());
    assert_eq!(metric(&m, "last_run_exit_code"), 2.0);
    assert_eq!(metric(&m, "last_success_timestamp_seconds"), 0.0);

    // An idle tick is a success; status does not write the file.
    env.fake.set_job_status(env.fake.jobs()[0].id, "success");
    let mut c = env.cmd("run");
    c.args(["--metrics-file", prom_arg]);
    assert_eq!(env.exec(c).code, Some(0));
    let text = fs::read_to_string(&prom).unwrap();
    promtool_check(&prom, "after-an-idle-tick");
    let m = samples(&text);
    assert_eq!(metric(&m, "last_run_exit_code"), 0.0);
    assert_eq!(
        metric(&m, "last_success_timestamp_seconds"),
        metric(&m, "last_run_timestamp_seconds")
    );
    assert!(
        !env.state.join("events.jsonl").exists()
            || events(&env, "events.jsonl")
                .iter()
                .all(|e| e["kind"] == "failure"),
        "an idle tick has no side effect to record"
    );
    fs::remove_file(&prom).unwrap();
    assert_eq!(status(&env, &["--check"]).code, Some(0));
    assert!(!prom.exists(), "status never writes the metrics");

    // With --metrics-pool every sample carries the pool's label (several pools, one directory).
    let mut c = env.cmd("run");
    c.args(["--metrics-file", prom_arg, "--metrics-pool", "gpu-1"]);
    assert_eq!(env.exec(c).code, Some(0));
    let text = fs::read_to_string(&prom).unwrap();
    promtool_check(&prom, "with-a-pool-label");
    let sample_lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert!(
        sample_lines.iter().all(|l| l.contains("pool=\"gpu-1\"")),
        "{text}"
    );
    assert!(
        text.contains("ci_ephemeral_provisioner_last_success_timestamp_seconds{pool=\"gpu-1\"} ")
    );
    fs::remove_file(&prom).unwrap();
    let mut c = env.cmd("run");
    c.args(["--metrics-file", prom_arg, "--metrics-pool", "a b"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("not a pool name"), "{out:?}");

    // A metrics file that cannot be written is a failure of the run, named in its report.
    let mut c = env.cmd("run");
    let missing = env.tmp.path().join("no-such-dir/ci.prom");
    c.args(["--metrics-file", missing.to_str().unwrap()]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(1), "{out:?}");
    let last = last_run(&env);
    assert_eq!(last["exit_code"], 1);
    assert!(
        last["failures"][0]
            .as_str()
            .unwrap()
            .contains("--metrics-file"),
        "{last}"
    );
}

// Mutation caught: keep_last_run's settle() after the failure dropped (exit 0, outcome unchanged).
#[test]
fn a_last_run_json_that_cannot_be_written_fails_the_run_and_says_so() {
    let env = Env::new();
    assert_eq!(env.run(&[]).code, Some(0));
    // A directory where last-run.json goes: the rename onto it fails.
    let path = env.state.join("last-run.json");
    fs::remove_file(&path).unwrap();
    fs::create_dir(&path).unwrap();
    env.fake.add_job(&["debian"]);
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    let printed: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(printed["exit_code"], 1, "{printed}");
    assert_eq!(
        printed["outcome"], "cycle_finished_with_errors",
        "{printed}"
    );
    let failures = printed["failures"].to_string();
    assert!(
        failures.contains("cannot write") && failures.contains("last-run.json"),
        "{printed}"
    );
    env.assert_at_rest();
}

/// Runs the binary with stderr in a file of our own, so a test can say whether
/// `JOURNAL_STREAM` names it.
fn run_with_stderr(env: &Env, mut c: Command, journal: bool) -> (Option<i32>, String) {
    let err = env.tmp.path().join(format!("stderr-{journal}"));
    let file = fs::File::create(&err).unwrap();
    if journal {
        let m = file.metadata().unwrap();
        c.env("JOURNAL_STREAM", format!("{}:{}", m.dev(), m.ino()));
    } else {
        // Set but naming another file: not journald.
        c.env("JOURNAL_STREAM", "1:1");
    }
    c.stdout(Stdio::null()).stderr(file).stdin(Stdio::null());
    let status = c.status().unwrap();
    (status.code(), fs::read_to_string(&err).unwrap())
}

#[test]
fn journald_gets_priorities_and_no_timestamps_and_debug_starts_with_the_redacted_config() {
    let env = Env::new();
    env.fake
        .inject("GET", "/actions/runners/jobs", Fault::Status(500), 100);
    let mut c = env.cmd("run");
    c.arg("-v");
    let (code, err) = run_with_stderr(&env, c, true);
    assert_eq!(code, Some(1), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines.iter().all(|l| l.len() > 3
            && l.starts_with('<')
            && l.as_bytes()[2] == b'>'
            && (b'3'..=b'7').contains(&l.as_bytes()[1])),
        "every line carries a priority prefix:\n{err}"
    );
    assert!(!err.contains("[20"), "no timestamp of our own:\n{err}");
    assert!(
        lines[0].starts_with(&format!(
            "<7>ci-ephemeral-provisioner {}",
            env!("CARGO_PKG_VERSION")
        )),
        "{err}"
    );
    assert!(
        lines[1].starts_with("<7>effective configuration: "),
        "{err}"
    );
    assert!(lines[1].contains("forgejo_url: Some(") && lines[1].contains("labels: Some("));
    assert!(
        lines[2].contains("Forgejo token: Secret(***) (redacted)"),
        "{err}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("<3>") && l.contains("500")),
        "failures at priority 3 (journalctl -p err):\n{err}"
    );
    assert!(
        !err.contains(&API_TOKEN[..12]),
        "the token in a log line:\n{err}"
    );

    // Interactive runs (or JOURNAL_STREAM naming another file) keep the normal format.
    let mut c = env.cmd("run");
    c.arg("-v");
    let (code, err) = run_with_stderr(&env, c, false);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.lines().all(|l| l.starts_with("[20")), "{err}");
    assert!(err.contains(" ERROR "), "{err}");
    assert!(!err.contains(&API_TOKEN[..12]), "{err}");
}

#[test]
fn a_run_in_progress_shows_in_the_metrics_file_until_it_ends() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fault("slow-apply", true);
    let prom = metrics_path(&env);
    let mut c = env.cmd("run");
    c.args(["--metrics-file", prom.to_str().unwrap()]);
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let mut child = c.spawn().unwrap();
    crate::support::harness::wait_for("the apply to start", || env.vm.join("applying").exists());
    // A cycle can keep one run going for hours: the file says so from the start.
    let m = samples(&fs::read_to_string(&prom).unwrap());
    assert_eq!(metric(&m, "run_in_progress"), 1.0);
    assert!(metric(&m, "run_start_timestamp_seconds") > 1.7e9);
    assert_eq!(
        metric(&m, "last_run_timestamp_seconds"),
        0.0,
        "no run ended yet"
    );
    promtool_check(&prom, "during-a-run");
    // Stopped the way systemd stops it: the run ends, and the file says how.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert_eq!(child.wait().unwrap().code(), Some(1));
    let m = samples(&fs::read_to_string(&prom).unwrap());
    assert_eq!(metric(&m, "run_in_progress"), 0.0);
    assert_eq!(metric(&m, "last_run_exit_code"), 1.0);
    assert_eq!(metric(&m, "cycle_active"), 1.0, "cycle.json is kept");
    assert_eq!(last_run(&env)["outcome"], "interrupted");
}

#[test]
fn what_cycle_json_remembers_is_already_in_the_audit_trail_when_killed() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.set_launch_mode("hang");
    let mut c = env.cmd("run");
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let mut child = c.spawn().unwrap();
    // The launch command runs (and hangs): the registration is in cycle.json.
    crate::support::harness::wait_for("the launch", || {
        fs::read_dir(&env.vm).unwrap().any(|e| {
            e.unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("launch-env.")
        })
    });
    crate::support::harness::kill_like_systemd(&mut child);
    let cycle = env.cycle_json().expect("cycle.json kept");
    let id = cycle["registrations"][0]["id"]
        .as_i64()
        .expect("registered");
    let trail = events(&env, "events.jsonl");
    for step in ["start_cycle", "tofu_apply", "register_runner"] {
        assert!(
            trail.iter().any(|e| e["step"] == step
                && e["cycle_id"] == cycle["cycle_id"]
                && (step != "register_runner" || e["runner_id"] == id)),
            "{step} not in the trail after SIGKILL: {trail:?}"
        );
    }
    // The next run converges; the report and the trail say what it cleaned up.
    env.set_launch_mode("one-job");
    let out = env.run(&["--output", "json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    env.assert_at_rest();
    let trail = events(&env, "events.jsonl");
    assert!(
        trail.iter().any(|e| e["kind"] == "side_effect"
            && e["step"] == "delete_runner"
            && e["runner_id"] == id
            && e["reason"] == "launch_cut_off"),
        "{trail:?}"
    );
}
