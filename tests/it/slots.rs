//! Parallel slots of one pool, end to end: the built binary, one process per slot, the fake
//! Forgejo on 127.0.0.1 and the real terraform/tofu CLI on one module directory.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::fake_forgejo::Conn;
use crate::support::harness::{Env, Outcome, wait_for};

/// Slot `k` of `n` as its own process, its output in files of its own.
fn spawn_slot(env: &Env, n: u32, k: u32, extra: &[&str]) -> (Child, String) {
    let mut c: Command = env.cmd("run");
    c.args(["--slots", &n.to_string(), "--slot", &k.to_string()]);
    c.args(["--output", "json"]);
    c.args(extra);
    let tag = format!("slot-{k}-{}", std::process::id());
    c.stdout(fs::File::create(env.tmp.path().join(format!("{tag}.out"))).unwrap());
    c.stderr(fs::File::create(env.tmp.path().join(format!("{tag}.err"))).unwrap());
    c.stdin(Stdio::null());
    (c.spawn().expect("spawn the binary"), tag)
}

/// Waits for a slot's process (panics after 120 s so a hang fails the test).
fn finish(env: &Env, (mut child, tag): (Child, String)) -> Outcome {
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{tag} hung for 120 s; stderr:\n{}",
                fs::read_to_string(env.tmp.path().join(format!("{tag}.err"))).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Outcome {
        code: status.code(),
        stdout: fs::read_to_string(env.tmp.path().join(format!("{tag}.out"))).unwrap_or_default(),
        stderr: fs::read_to_string(env.tmp.path().join(format!("{tag}.err"))).unwrap_or_default(),
    }
}

fn slot_dir(env: &Env, k: u32) -> std::path::PathBuf {
    if k == 1 {
        env.state.clone()
    } else {
        env.state.join(format!("slot-{k}"))
    }
}

/// The job handle of every launch of a runner, from the launch environments on "the VMs".
fn launched_handles(vm: &Path) -> Vec<String> {
    let mut handles = Vec::new();
    for e in fs::read_dir(vm).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("launch-env.") {
            continue;
        }
        let text = fs::read_to_string(e.path()).unwrap();
        if let Some(h) = text.lines().find_map(|l| l.strip_prefix("JOB_HANDLE=")) {
            handles.push(h.to_string());
        }
    }
    handles.sort();
    handles
}

fn running_jobs(env: &Env) -> Vec<i64> {
    env.fake
        .jobs()
        .into_iter()
        .filter(|j| j.status == "running")
        .map(|j| j.id)
        .collect()
}

/// Resources still in a tofu state file (none, or no file, once its VM is destroyed).
fn resources_in(state: &Path) -> usize {
    match fs::read_to_string(state) {
        Ok(t) => {
            let v: serde_json::Value = serde_json::from_str(&t).unwrap();
            v["resources"].as_array().map_or(0, Vec::len)
        }
        Err(_) => 0,
    }
}

// Mutation caught: FileStore::others reads no other slot.
#[test]
fn three_slots_serve_six_jobs_three_at_a_time_each_once_and_leave_nothing() {
    let env = Env::new();
    // Each runner takes its job and keeps running until the test ends the job.
    env.set_launch_mode("take");
    let jobs: Vec<(i64, String)> = (0..6).map(|_| env.fake.add_job(&["debian"])).collect();
    let slots: Vec<_> = (1..=3).map(|k| spawn_slot(&env, 3, k, &[])).collect();

    // Two rounds: three jobs run at once, one per slot and VM; then the next three.
    let mut finished = Vec::new();
    for round in 1..=2 {
        wait_for(
            &format!("three jobs running at once (round {round})"),
            || running_jobs(&env).len() == 3,
        );
        assert_eq!(env.live_vms().len(), 3, "one VM per slot: {}", env.vm_log());
        let running = running_jobs(&env);
        for j in &running {
            assert!(!finished.contains(j), "job {j} ran twice");
        }
        for j in running {
            env.fake.set_job_status(j, "success");
            finished.push(j);
        }
    }
    let outs: Vec<Outcome> = slots.into_iter().map(|s| finish(&env, s)).collect();
    for (k, out) in outs.iter().enumerate() {
        assert_eq!(out.code, Some(0), "slot {}: {out:?}", k + 1);
        assert_eq!(out.json()["outcome"], "cycle_finished", "slot {}", k + 1);
        // Slot K >= 2's cycle ids name it: no two slots' cycles (nor names) share one.
        let id = out.json()["cycle_id"].as_str().unwrap().to_string();
        assert_eq!(
            id.ends_with(&format!("-s{}", k + 1)),
            k >= 1,
            "slot {}: {id}",
            k + 1
        );
    }

    // Each job once: six launches, one per job, and every job done.
    let mut want: Vec<String> = jobs.iter().map(|(_, h)| h.clone()).collect();
    want.sort();
    assert_eq!(launched_handles(&env.vm), want, "one runner per job");
    for j in env.fake.jobs() {
        assert_eq!(j.status, "success", "job {}", j.id);
    }
    // Three VMs, created while the others existed (three at a time), all destroyed.
    let log = env.vm_log();
    assert_eq!(log.matches("create ").count(), 3, "{log}");
    assert_eq!(log.matches("destroy ").count(), 3, "{log}");
    let at_create = fs::read_to_string(env.vm.join("vms-at-create.log")).unwrap();
    let mut slots_seen: Vec<&str> = at_create
        .lines()
        .filter_map(|l| l.split(' ').next())
        .collect();
    slots_seen.sort();
    assert_eq!(
        slots_seen,
        ["1", "2", "3"],
        "TF_VAR_slot names each VM's slot"
    );

    // Every job's pickup: each slot's in its status, all six in the pool's.
    let mut per_slot = 0;
    for k in 1..=3 {
        let mut c = env.cmd("status");
        c.args(["--slots", "3", "--slot", &k.to_string(), "--output", "json"]);
        let doc = env.exec(c).json();
        per_slot += doc["pickup"]["jobs"].as_u64().unwrap_or(0);
        assert_eq!(doc["pool_pickup"]["slots"], 3, "{doc}");
        assert_eq!(doc["pool_pickup"]["summary"]["jobs"], 6, "{doc}");
    }
    assert_eq!(per_slot, 6);
    for out in &outs {
        for e in out.json()["events"].as_array().unwrap() {
            if e["step"] == "take_job" {
                assert!(e["pickup_ms"].is_u64(), "{e}");
            }
        }
    }

    // Nothing left in any slot: no cycle.json, no VM, no registration, no tofu resource.
    env.assert_at_rest();
    for k in 1..=3 {
        assert!(
            !slot_dir(&env, k).join("cycle.json").exists(),
            "slot {k} kept its cycle.json"
        );
    }
    assert_eq!(resources_in(&env.module.join("terraform.tfstate")), 0);
    for k in 2..=3 {
        let state = env
            .module
            .join(format!("terraform.tfstate.d/slot-{k}/terraform.tfstate"));
        assert!(state.exists(), "slot {k} has a workspace of its own");
        assert_eq!(resources_in(&state), 0, "slot {k}'s VM is gone");
    }
    // Slot 1 as a pool without slots; slot K ≥ 2 in its workspace, with its own data directory.
    for action in ["create", "destroy"] {
        let env1 = fs::read_to_string(env.vm.join(format!("tofu-env.{action}.slot-1"))).unwrap();
        // Named, so that a workspace selected by hand cannot turn it onto another slot's VM.
        assert!(env1.contains("TF_WORKSPACE=default\n"), "{env1}");
        assert!(!env1.contains("TF_DATA_DIR="), "{env1}");
        assert!(env1.contains("TF_VAR_slot=1\n"), "{env1}");
        for k in 2..=3 {
            let e = fs::read_to_string(env.vm.join(format!("tofu-env.{action}.slot-{k}"))).unwrap();
            assert!(e.contains(&format!("TF_WORKSPACE=slot-{k}\n")), "{e}");
            let data = slot_dir(&env, k).join("tofu-data");
            assert!(
                e.contains(&format!("TF_DATA_DIR={}\n", data.display())),
                "{e}"
            );
            assert!(
                e.contains("TF_PLUGIN_CACHE_DIR=\n"),
                "no shared plugin cache: {e}"
            );
        }
    }
}

/// A slot's claim (a job another slot's cycle.json holds) is respected: the job gets no runner
/// here, even though it waits. Without claims this slot would register for it.
// Mutation caught: FileStore::others reads no other slot.
// Mutation caught: the planner's filter of jobs claimed elsewhere removed.
// Mutation caught: a dry-run that does not read the other slots.
#[test]
fn a_job_another_slot_holds_gets_no_second_runner() {
    let env = Env::new();
    let (job, handle) = env.fake.add_job(&["debian"]);
    // Slot 2 has a cycle in progress whose registration (intent) is for the job: its POST's
    // answer was lost, say, and its next run resolves it.
    let dir = slot_dir(&env, 2);
    let cycle = serde_json::json!({
        "version": 1, "cycle_id": "20261201t200000z-aaaa", "runner_prefix": "ephemeral-",
        "started_at": "2026-12-01T20:00:00Z", "phase": "running",
        "vm_ready_at": "2026-12-01T20:00:30Z", "free_since": null, "jobs_started": 0,
        "next_seq": 2, "start_failures": 0,
        "registrations": [{
            "name": "ephemeral-20261201t200000z-aaaa-1-20261201t200040z", "id": null, "uuid": null,
            "job_id": job, "job_handle": handle, "requested_at": "2026-12-01T20:00:40Z",
            "launch": "pending", "launched_at": null, "job_gone_since": null
        }],
        "teardown_reason": null, "destroyed_at": null, "last_error": null
    });
    plant_cycle(&env, 2, &cycle);
    // A dry-run plans what the run does: it reads the other slots' claims too.
    let out = finish(&env, spawn_slot(&env, 2, 1, &["--dry-run"]));
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        out.json()["actions"],
        serde_json::json!([]),
        "{}",
        out.stdout
    );
    assert_eq!(out.json()["outcome"], "idle", "{}", out.stdout);
    let out = finish(&env, spawn_slot(&env, 2, 1, &[]));
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.json()["outcome"], "idle", "{}", out.stdout);
    assert!(
        env.vm_log().is_empty(),
        "no VM for a job another slot holds"
    );
    assert!(env.fake.runners().is_empty(), "no registration for it");

    // Once slot 2's cycle is gone, the claim is gone with it: slot 1 serves the job.
    fs::remove_file(dir.join("cycle.json")).unwrap();
    let out = finish(&env, spawn_slot(&env, 2, 1, &[]));
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.json()["outcome"], "cycle_finished", "{}", out.stdout);
    assert_eq!(launched_handles(&env.vm), std::slice::from_ref(&handle));

    // A claim is on one attempt: the job rerun (a new attempt, a new handle) is served here at
    // once although slot 2 claims its first attempt again; a runner of the first attempt's
    // handle would never be given the new one.
    plant_cycle(&env, 2, &cycle);
    let second = env.fake.rerun_job(job);
    let out = finish(&env, spawn_slot(&env, 2, 1, &[]));
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.json()["outcome"], "cycle_finished", "{}", out.stdout);
    let mut want = vec![handle, second];
    want.sort();
    assert_eq!(launched_handles(&env.vm), want);
    assert!(dir.join("cycle.json").exists(), "slot 2's cycle untouched");
}

/// The sweep spares another slot's registrations and young ones; it deletes the old and the
/// nameless-time ones of before. Without the guard it would delete all four.
// Mutation caught: the sweep's check of names another slot holds removed (SweepGuard::spares).
// Mutation caught: the sweep's age floor removed.
#[test]
fn the_sweep_spares_another_slots_and_young_registrations() {
    let env = Env::new();
    let now = std::time::SystemTime::now();
    let compact = |t: std::time::SystemTime| {
        humantime::format_rfc3339_seconds(t)
            .to_string()
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
            .to_ascii_lowercase()
    };
    let young = format!("ephemeral-c1-1-{}", compact(now - Duration::from_secs(60)));
    let old = format!(
        "ephemeral-c1-2-{}",
        compact(now - Duration::from_secs(3600))
    );
    let held = format!(
        "ephemeral-c2-1-{}",
        compact(now - Duration::from_secs(3600))
    );
    let before = "ephemeral-20261014t150000z-5c1d-3".to_string();
    let ids: BTreeMap<String, i64> = [&young, &old, &held, &before]
        .into_iter()
        .map(|n| {
            (
                n.clone(),
                env.fake.add_runner(n, true, Conn::NeverConnected),
            )
        })
        .collect();
    // Slot 3 (of a pool that has 2 slots now: a removed slot still holds its cycle) holds one.
    let cycle = serde_json::json!({
        "version": 1, "cycle_id": "c2", "runner_prefix": "ephemeral-",
        "started_at": "2026-12-01T20:00:00Z", "phase": "tearing_down",
        "vm_ready_at": null, "free_since": null, "jobs_started": 1,
        "next_seq": 2, "start_failures": 0,
        "registrations": [{
            "name": held, "id": ids[&held], "uuid": "u", "job_id": 1, "job_handle": "h",
            "requested_at": "2026-12-01T20:00:40Z", "launch": "done",
            "launched_at": null, "job_gone_since": null
        }],
        "teardown_reason": "idle", "destroyed_at": null, "last_error": null
    });
    plant_cycle(&env, 3, &cycle);

    let mut c = env.cmd("sweep");
    c.args(["--slots", "2", "--slot", "1", "--output", "json"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    let sweep = &out.json()["sweep"];
    let names = |key: &str| -> Vec<String> {
        sweep[key]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|r| r["name"].as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut deleted = names("deleted");
    deleted.sort();
    let mut want = vec![old.clone(), before.clone()];
    want.sort();
    assert_eq!(deleted, want, "{sweep}");
    assert_eq!(
        names("spared_young"),
        std::slice::from_ref(&young),
        "{sweep}"
    );
    assert_eq!(names("spared_held"), std::slice::from_ref(&held), "{sweep}");
    let left: Vec<i64> = env.fake.runners().iter().map(|r| r.id).collect();
    assert_eq!(left, [ids[&young], ids[&held]]);
}

/// `--slot` outside `--slots` is a usage error that names the range.
#[test]
fn a_slot_outside_the_pool_is_a_usage_error() {
    let env = Env::new();
    for (n, k) in [("2", "3"), ("0", "1"), ("65", "1"), ("3", "0")] {
        let mut c = env.cmd("run");
        c.args(["--slots", n, "--slot", k]);
        let out = env.exec(c);
        assert_eq!(out.code, Some(2), "--slots {n} --slot {k}: {out:?}");
        assert!(out.stderr.contains("out of range"), "{}", out.stderr);
    }
    let mut c = env.cmd("status");
    c.args(["--slots", "2", "--slot", "3"]);
    assert_eq!(env.exec(c).code, Some(2));
}

/// Writes a `cycle.json` for slot `k` of the pool (the pool's and the slot's directories 0700).
fn plant_cycle(env: &Env, k: u32, cycle: &serde_json::Value) {
    let dir = plant_dir(env, k);
    fs::write(dir.join("cycle.json"), cycle.to_string()).unwrap();
}

/// Slot `k`'s directory, made as the binary makes it (the pool's and the slot's 0700).
fn plant_dir(env: &Env, k: u32) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = slot_dir(env, k);
    fs::create_dir_all(&dir).unwrap();
    fs::set_permissions(&env.state, fs::Permissions::from_mode(0o700)).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

/// A slot beyond `--slots` that still has a cycle: every run says so (exit 1), as its VM and
/// registrations stay until that slot runs again.
// Mutation caught: a slot beyond --slots with a cycle not reported.
#[test]
fn a_slot_beyond_the_pool_with_a_cycle_in_progress_fails_every_run_until_it_is_finished() {
    let env = Env::new();
    plant_cycle(
        &env,
        3,
        &serde_json::json!({
            "version": 1, "cycle_id": "20261201t200000z-bbbb", "runner_prefix": "ephemeral-",
            "started_at": "2026-12-01T20:00:00Z", "phase": "running",
            "vm_ready_at": "2026-12-01T20:00:30Z", "free_since": null, "jobs_started": 0,
            "next_seq": 1, "start_failures": 0, "registrations": [],
            "teardown_reason": null, "destroyed_at": null, "last_error": null
        }),
    );
    let out = finish(&env, spawn_slot(&env, 2, 1, &[]));
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr.contains(
            "has cycle 20261201t200000z-bbbb in progress, but the pool has --slots 2 now"
        ),
        "{}",
        out.stderr
    );
    fs::remove_file(slot_dir(&env, 3).join("cycle.json")).unwrap();
    let out = finish(&env, spawn_slot(&env, 2, 1, &[]));
    assert_eq!(out.code, Some(0), "{out:?}");
}

/// A job another slot holds (Forgejo did not give it to that slot's runner) is not tried here
/// either until the hold ends.
// Mutation caught: another slot's holds ignored.
#[test]
fn a_job_another_slot_has_put_on_hold_gets_no_runner_here() {
    let env = Env::new();
    let (job, handle) = env.fake.add_job(&["debian"]);
    let dir = plant_dir(&env, 2);
    let holds = serde_json::json!({"version": 1, "jobs": [{
        "job_id": job, "handle": handle, "held_at": "2026-12-01T20:00:00Z",
        "until": "2999-01-01T00:00:00Z", "times": 1
    }]});
    fs::write(dir.join("held-jobs.json"), holds.to_string()).unwrap();
    let out = finish(&env, spawn_slot(&env, 2, 1, &[]));
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.json()["outcome"], "idle", "{}", out.stdout);
    assert!(
        env.vm_log().is_empty(),
        "no VM for a job held by another slot"
    );
    // The hold is on that attempt: cancelled and rerun, the job is a new chance, served here.
    env.fake.set_job_status(job, "cancelled");
    let second = env.fake.rerun_job(job);
    let out = finish(&env, spawn_slot(&env, 2, 1, &[]));
    assert_eq!(out.json()["outcome"], "cycle_finished", "{}", out.stdout);
    assert_eq!(launched_handles(&env.vm), [second]);
}

/// With `--slots` > 1 every sample carries the slot; with one slot none does (as before).
#[test]
fn the_metrics_of_a_slot_carry_its_number() {
    let env = Env::new();
    let prom = env.tmp.path().join("slot.prom");
    let p = prom.to_str().unwrap();
    let out = finish(&env, spawn_slot(&env, 3, 2, &["--metrics-file", p]));
    assert_eq!(out.code, Some(0), "{out:?}");
    let text = fs::read_to_string(&prom).unwrap();
    let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert!(!samples.is_empty());
    for l in &samples {
        assert!(l.contains("slot=\"2\""), "{l}");
    }
    let out = finish(&env, spawn_slot(&env, 1, 1, &["--metrics-file", p]));
    assert_eq!(out.code, Some(0), "{out:?}");
    let text = fs::read_to_string(&prom).unwrap();
    assert!(!text.contains("slot="), "{text}");
}

/// A job that arrives while another slot has an unused warm VM is that VM's: a slot without a
/// cycle starts no VM for it, and the warm VM serves it with no apply on its path.
#[test]
fn a_job_goes_to_the_warm_vm_of_another_slot_not_to_a_new_vm() {
    let env = Env::new();
    let creates = || {
        env.vm_log()
            .lines()
            .filter(|l| l.starts_with("create "))
            .count()
    };
    // Slot 1 keeps the warm VM, asking Forgejo only every 30 s: slot 2 runs first.
    let warm = ["--warm", "1", "--poll-interval", "30s"];
    let one = spawn_slot(&env, 2, 1, &warm);
    // Its wait begun (logged before it sleeps, after its look at the jobs): the job added now
    // is not seen by slot 1 before the SIGHUP, however slow this machine is.
    let one_err = env.tmp.path().join(format!("{}.err", one.1));
    wait_for("slot 1's warm VM to wait for a job", || {
        fs::read_to_string(&one_err).is_ok_and(|t| t.contains("warm VM up, waiting for a job"))
    });
    let (job, _) = env.fake.add_job(&["debian"]);
    let two = finish(&env, spawn_slot(&env, 2, 2, &["--warm", "1"]));
    assert_eq!(two.code, Some(0), "{two:?}");
    assert_eq!(two.json()["outcome"], "idle", "{two:?}");
    assert_eq!(creates(), 1, "slot 2 booted no VM for the warm VM's job");
    // SIGHUP ends slot 1's wait; its next run serves the job on the warm VM.
    unsafe { libc::kill(one.0.id() as i32, libc::SIGHUP) };
    let out = finish(&env, one);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.json()["outcome"], "reload", "{out:?}");
    let out = finish(&env, spawn_slot(&env, 2, 1, &["--warm", "0"]));
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.json()["summary"]["consumed"], 1, "{out:?}");
    assert!(
        env.fake
            .jobs()
            .iter()
            .all(|j| j.id != job || j.status == "success")
    );
    assert_eq!(creates(), 1, "the job ran on the warm VM");
    env.assert_at_rest();
}
