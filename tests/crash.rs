//! SIGKILL at step boundaries of a real cycle (the built binary, real terraform, the fake
//! Forgejo), the way systemd ends a unit: the process and everything it started. Then run again
//! until the cycle ends: no VM, no registration with our prefix, no cycle.json.

mod support;

use std::fs;
use std::process::{Child, Stdio};
use std::time::Duration;

use support::fake_forgejo::{Conn, Fault};
use support::harness::{Env, wait_for};

/// Direct children of `pid` (each leads its own process group).
fn children(pid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in fs::read_dir("/proc").unwrap().filter_map(|e| e.ok()) {
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some(rest) = stat.rsplit_once(") ") else {
            continue;
        };
        let fields: Vec<&str> = rest.1.split_whitespace().collect();
        if fields.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(pid)
            && let Ok(child) = e.file_name().to_string_lossy().parse::<i32>()
        {
            out.push(child);
        }
    }
    out
}

/// SIGKILL the provisioner and the process groups of its children (tofu, the launch command).
fn kill_like_systemd(child: &mut Child) {
    let kids = children(child.id());
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    for k in kids {
        unsafe { libc::kill(-k, libc::SIGKILL) };
    }
    let _ = child.wait();
}

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
