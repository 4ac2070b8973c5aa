//! One pool across hosts on PostgreSQL, end to end and under faults: several host processes of
//! the real binary (each its own host id, state directory and module copy, its runs started one
//! after another as a timer would), a real PostgreSQL on loopback, the real terraform with the
//! pg backend, the fake Forgejo. Faults: SIGKILL at crash points (a host dead for good),
//! SIGSTOP past the lease and SIGCONT, `pg_ctl restart -m immediate`, `pg_terminate_backend`.
//! Invariants: at most one registration per job attempt; a dead host's cycle adopted within its
//! lease's lapse and one timer interval; a fenced process makes no side effect once its epoch is
//! stale; at rest no VM, no registration, no cycle row, no claim, no workspace.
//!
//! Needs PostgreSQL: `bash .ci/pg` starts one and runs these (ignored by a plain `cargo test`).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::store::Db;
use crate::support::fake_forgejo::Fault;
use crate::support::harness::Env;

/// The lease of every host: short, so that the tests wait seconds, not minutes.
const LEASE: &str = "6s";
/// The pause between one run of a host and its next (its timer).
const TIMER: Duration = Duration::from_millis(200);

/// The outcome of one run of a host.
#[derive(Clone, Debug)]
struct Run {
    code: Option<i32>,
    stderr: String,
}

/// One host of the pool: a thread that starts its runs one after another (its timer).
struct Host {
    name: String,
    dir: PathBuf,
    stop: Arc<AtomicBool>,
    /// The run in progress (its pid).
    current: Arc<Mutex<Option<u32>>>,
    runs: Arc<Mutex<Vec<Run>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Host {
    /// `extra_env`: for every run of the host (a crash point: the host dies at its first run
    /// that gets there; the test halts it then).
    fn start(env: &Env, db: &Db, name: &str, extra: &[&str], extra_env: &[(&str, &str)]) -> Host {
        let dir = env.tmp.path().join(format!("host-{name}"));
        let module = dir.join("module");
        fs::create_dir_all(&module).unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/module");
        for f in ["main.tf", "vm.sh"] {
            fs::copy(src.join(f), module.join(f)).unwrap();
        }
        fs::write(
            module.join("backend.tf"),
            "terraform {\n  backend \"pg\" {}\n}\n",
        )
        .unwrap();
        let state = dir.join("state");
        let mut cmd = env.cmd("run");
        cmd.args([
            "--store",
            "pg",
            "--pool",
            "p",
            "--host-id",
            name,
            "--lease",
            LEASE,
        ]);
        cmd.args(["--state-dir", state.to_str().unwrap()]);
        cmd.args(["--tofu-dir", module.to_str().unwrap()]);
        cmd.args(["--output", "json"]);
        cmd.args(extra);
        cmd.env("PG_CONN_STR", &db.url);
        cmd.env("CHECKPOINT_DISABLE", "1");
        cmd.envs(extra_env.iter().copied());
        let stop = Arc::new(AtomicBool::new(false));
        let current = Arc::new(Mutex::new(None));
        let runs = Arc::new(Mutex::new(Vec::new()));
        let (s, c, r) = (stop.clone(), current.clone(), runs.clone());
        let err = dir.join("stderr");
        let thread = std::thread::spawn(move || {
            let program = cmd.get_program().to_owned();
            let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
            let envs: Vec<_> = cmd
                .get_envs()
                .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned())))
                .collect();
            while !s.load(Ordering::SeqCst) {
                let mut one = Command::new(&program);
                one.args(&args).env_clear().envs(envs.iter().cloned());
                one.stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(fs::File::create(&err).unwrap());
                let mut child = one.spawn().expect("spawn the binary");
                *c.lock().unwrap() = Some(child.id());
                let status = child.wait().unwrap();
                *c.lock().unwrap() = None;
                r.lock().unwrap().push(Run {
                    code: status.code(),
                    stderr: fs::read_to_string(&err).unwrap_or_default(),
                });
                std::thread::sleep(TIMER);
            }
        });
        Host {
            name: name.to_string(),
            dir,
            stop,
            current,
            runs,
            thread: Some(thread),
        }
    }

    /// Stops the timer; the run in progress ends as it ends.
    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }

    fn runs(&self) -> Vec<Run> {
        self.runs.lock().unwrap().clone()
    }

    /// The audit trail of every run of this host.
    fn events(&self) -> Vec<serde_json::Value> {
        fs::read_to_string(self.dir.join("state/events.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(pid) = *self.current.lock().unwrap() {
            unsafe {
                libc::kill(pid as i32, libc::SIGCONT);
            }
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A count; -1 while the table does not exist yet (no run has created it).
fn count(db: &Db, sql: &str) -> i64 {
    db.client()
        .query_one(sql, &[])
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

/// Waits until `cond` holds (panics after `secs`, naming `what` and showing `show`).
fn wait(what: &str, secs: u64, mut cond: impl FnMut() -> bool, show: impl Fn() -> String) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "timed out after {secs}s waiting for {what}\n{}",
            show()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What the pool and the world hold now, for a failure's message.
fn picture(env: &Env, db: &Db, hosts: &[&Host]) -> String {
    let rows: Vec<String> = db
        .client()
        .query(
            "SELECT host_id || ' slot ' || slot || ' epoch ' || epoch || ': ' || left(state, 300) FROM ci_ephemeral_provisioner.cycles",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut s = format!(
        "cycles: {rows:#?}\nVMs: {:?}\nour registrations: {:?}\njobs: {:?}\nvm.log:\n{}",
        env.live_vms(),
        env.our_runners(),
        env.fake
            .jobs()
            .iter()
            .map(|j| (j.id, j.status.clone()))
            .collect::<Vec<_>>(),
        env.vm_log()
    );
    for h in hosts {
        let runs = h.runs();
        s.push_str(&format!(
            "\nhost {}: {} runs, exit codes {:?}; last stderr:\n{}",
            h.name,
            runs.len(),
            runs.iter().map(|r| r.code).collect::<Vec<_>>(),
            runs.last()
                .map(|r| r
                    .stderr
                    .lines()
                    .rev()
                    .take(12)
                    .collect::<Vec<_>>()
                    .join("\n"))
                .unwrap_or_default()
        ));
    }
    s
}

/// At rest: every job done, no VM, no registration with the pool's prefix, no cycle row, no
/// claim, no tofu workspace of a cycle.
fn wait_at_rest(env: &Env, db: &Db, hosts: &[&Host], secs: u64) {
    wait(
        "the pool to come to rest",
        secs,
        || {
            env.fake.jobs().iter().all(|j| j.status == "success")
                && env.live_vms().is_empty()
                && env.our_runners().is_empty()
                && count(db, "SELECT count(*) FROM ci_ephemeral_provisioner.cycles") == 0
                && count(db, "SELECT count(*) FROM ci_ephemeral_provisioner.claims") == 0
                && count(
                    db,
                    "SELECT count(*) FROM terraform_remote_state.states WHERE name <> 'default'",
                ) == 0
        },
        || picture(env, db, hosts),
    );
}

/// Job handle of every launched runner, by runner id (the launch environments on "the VMs").
fn launches(vm: &Path) -> BTreeMap<i64, String> {
    let mut out = BTreeMap::new();
    for e in fs::read_dir(vm).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(id) = name.strip_prefix("launch-env.") else {
            continue;
        };
        let text = fs::read_to_string(e.path()).unwrap_or_default();
        if let (Ok(id), Some(h)) = (
            id.parse(),
            text.lines().find_map(|l| l.strip_prefix("JOB_HANDLE=")),
        ) {
            out.insert(id, h.to_string());
        }
    }
    out
}

/// Three hosts see six jobs at once: each job attempt is registered for once, by one host.
// Mutation caught: the claim's insert that lets a second cycle claim an attempt (CLAIM's
// `WHERE claims.cycle_id = excluded.cycle_id` dropped).
#[test]
#[ignore = "needs PostgreSQL: bash .ci/pg runs it"]
fn three_hosts_register_each_job_attempt_once() {
    let env = Env::new();
    let db = Db::new();
    let jobs: Vec<(i64, String)> = (0..6).map(|_| env.fake.add_job(&["debian"])).collect();
    let hosts: Vec<Host> = ["a", "b", "c"]
        .iter()
        .map(|h| Host::start(&env, &db, h, &[], &[]))
        .collect();
    let refs: Vec<&Host> = hosts.iter().collect();
    wait_at_rest(&env, &db, &refs, 240);
    let launched = launches(&env.vm);
    let mut handles: Vec<&String> = launched.values().collect();
    handles.sort();
    let mut want: Vec<&String> = jobs.iter().map(|(_, h)| h).collect();
    want.sort();
    assert_eq!(handles, want, "launches by handle: {launched:?}");
    assert_eq!(
        env.fake.issued_tokens().len(),
        jobs.len(),
        "registrations, one per job attempt\n{}",
        picture(&env, &db, &refs)
    );
    let served: i64 = count(
        &db,
        "SELECT count(DISTINCT host_id) FROM ci_ephemeral_provisioner.hosts",
    );
    assert_eq!(served, 3);
}

/// A host killed (SIGKILL, with its tofu or launch command) at a crash point and dead for good:
/// a live host adopts its cycle once its lease lapsed, within one timer interval of the lapse
/// (and the start of a run), tears it down, and its job is served; nothing is left.
// Mutation caught: load() that never adopts (the dead host's VM and cycle stay).
#[test]
#[ignore = "needs PostgreSQL: bash .ci/pg runs it"]
fn a_host_killed_at_a_crash_point_is_adopted_and_nothing_is_left() {
    let env = Env::new();
    let db = Db::new();
    let mut live = Host::start(&env, &db, "live", &[], &[]);
    for (n, point) in [
        "apply-running-written",
        "register-intent-written",
        "register-post-answered",
        "launch-done-written",
        "process-child-spawned:2",
    ]
    .iter()
    .enumerate()
    {
        // The live host leaves the job to the one that dies (its timer held meanwhile).
        live.halt();
        let dead_name = format!("dead{n}");
        let (job, _) = env.fake.add_job(&["debian"]);
        let mut dead = Host::start(
            &env,
            &db,
            &dead_name,
            &[],
            &[("CI_EPHEMERAL_PROVISIONER_TEST_CRASH_AT", point)],
        );
        wait(
            &format!("host {dead_name} to die at {point}"),
            120,
            || dead.runs().iter().any(|r| r.code.is_none()),
            || picture(&env, &db, &[&dead]),
        );
        dead.halt();
        live = Host::start(&env, &db, "live", &[], &[]);
        wait_at_rest(&env, &db, &[&live, &dead], 180);
        let job = env.fake.jobs().into_iter().find(|j| j.id == job).unwrap();
        assert_eq!(job.status, "success", "{point}");
        // Adopted within one timer interval (and a run's start) of the lease's lapse, on the
        // database's clock; a crash before the cycle existed leaves nothing to adopt.
        let late: Option<f64> = db
            .client()
            .query_one(
                "SELECT max(extract(epoch FROM e.at - h.lease_until))::float8
                   FROM ci_ephemeral_provisioner.events e JOIN ci_ephemeral_provisioner.hosts h
                     ON h.pool = e.pool AND h.host_id = e.other_host
                  WHERE e.kind = 'adopted' AND e.other_host = $1",
                &[&dead_name],
            )
            .unwrap()
            .get(0);
        if *point != "process-child-spawned:2" || late.is_some() {
            let late = late.unwrap_or_else(|| {
                panic!(
                    "{point}: the dead host's cycle was not adopted\n{}",
                    picture(&env, &db, &[&live])
                )
            });
            assert!(
                late < TIMER.as_secs_f64() + 20.0,
                "{point}: adopted {late:.1}s after the lease lapsed"
            );
        }
    }
    live.halt();
}

/// A host paused (SIGSTOP) past its lease with a launched runner: another host adopts its
/// cycle; continued (SIGCONT), the paused process makes no further side effect (no DELETE, no
/// stop of a runner, no tofu, no launch, no POST) and exits 1 naming the adopting host.
// Mutation caught: the guard before a DELETE removed (the woken process stops its runner first).
#[test]
#[ignore = "needs PostgreSQL: bash .ci/pg runs it"]
fn a_paused_host_that_comes_back_after_adoption_does_no_harm() {
    let env = Env::new();
    let db = Db::new();
    // The runner connects, then dies: past the grace its registration is an unconsumed one the
    // paused host would stop and delete.
    env.set_launch_mode("die");
    let grace = ["--registration-grace", "12s"];
    let mut b = Host::start(&env, &db, "b", &grace, &[]);
    let (job, _) = env.fake.add_job(&["debian"]);
    // b's cycle: its runner launched and seen up.
    wait(
        "host b's runner to connect",
        120,
        || {
            count(
                &db,
                "SELECT count(*) FROM ci_ephemeral_provisioner.cycles WHERE host_id = 'b' AND state LIKE '%\"connected\":true%'",
            ) > 0
        },
        || picture(&env, &db, &[&b]),
    );
    let pid = b.current.lock().unwrap().expect("b's run is in progress");
    unsafe {
        libc::kill(pid as i32, libc::SIGSTOP);
    }
    // The adopter cannot delete the registration while b is paused (so that b, woken, finds
    // it still there); it destroys the VM meanwhile.
    env.fake
        .inject("DELETE", "/runners/", Fault::Status(500), usize::MAX);
    env.set_launch_mode("one-job");
    let c = Host::start(&env, &db, "c", &grace, &[]);
    wait(
        "host c to adopt b's cycle",
        60,
        || {
            count(
                &db,
                "SELECT count(*) FROM ci_ephemeral_provisioner.events WHERE kind = 'adopted' AND host_id = 'c' AND other_host = 'b'",
            ) > 0
        },
        || picture(&env, &db, &[&b, &c]),
    );
    let actions_before = fs::read_to_string(env.vm.join("actions.log")).unwrap_or_default();
    let events_before = b.events().len();
    b.stop.store(true, Ordering::SeqCst);
    unsafe {
        libc::kill(pid as i32, libc::SIGCONT);
    }
    wait(
        "the paused run of b to end",
        60,
        || b.current.lock().unwrap().is_none(),
        || picture(&env, &db, &[&b, &c]),
    );
    let run = b.runs().last().cloned().unwrap();
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(
        run.stderr.contains("was adopted by host c"),
        "{}",
        run.stderr
    );
    // Nothing b did after it woke: no stop or launch on a VM (actions.log is the launch
    // command's), no side effect in its audit trail.
    let actions_after = fs::read_to_string(env.vm.join("actions.log")).unwrap_or_default();
    let new_actions: Vec<&str> = actions_after[actions_before.len()..]
        .lines()
        .filter(|l| l.starts_with("stop ") || l.starts_with("start "))
        .collect();
    let b_events = b.events();
    let done: Vec<&serde_json::Value> = b_events[events_before..]
        .iter()
        .filter(|e| e["kind"] == "side_effect" && e["ok"] == true)
        .collect();
    assert!(
        done.is_empty(),
        "b acted after it woke: {done:#?}\n{}",
        run.stderr
    );
    // c's stops, if any, are of runners it no longer has; b's stop would name b's runner while
    // its VM is up, before c's destroy: there is none from b (its run ended fenced).
    assert!(
        !run.stderr.contains("RUNNER_ACTION=stop"),
        "{new_actions:?}\n{}",
        run.stderr
    );
    b.halt();
    env.fake.clear_faults();
    wait_at_rest(&env, &db, &[&c], 180);
    let job = env.fake.jobs().into_iter().find(|j| j.id == job).unwrap();
    assert_eq!(job.status, "success");
}

/// The database restarted (`pg_ctl restart -m immediate`) and our connections terminated
/// (`pg_terminate_backend`) while cycles run: runs fail or reconnect, start no VM without a
/// cycle row, and the pool converges to rest with every job served.
#[test]
#[ignore = "needs PostgreSQL: bash .ci/pg runs it"]
fn the_pool_converges_after_a_database_restart_and_terminated_connections() {
    let env = Env::new();
    let db = Db::new();
    env.set_launch_mode("take");
    for _ in 0..3 {
        env.fake.add_job(&["debian"]);
    }
    let hosts: Vec<Host> = ["a", "b"]
        .iter()
        .map(|h| Host::start(&env, &db, h, &[], &[]))
        .collect();
    let refs: Vec<&Host> = hosts.iter().collect();
    wait(
        "two jobs running",
        180,
        || {
            env.fake
                .jobs()
                .iter()
                .filter(|j| j.status == "running")
                .count()
                >= 2
        },
        || picture(&env, &db, &refs),
    );
    let restart = std::env::var("CI_EPHEMERAL_PROVISIONER_TEST_PG_RESTART")
        .expect("CI_EPHEMERAL_PROVISIONER_TEST_PG_RESTART: a command that restarts the cluster");
    let ok = Command::new("sh").args(["-c", &restart]).status().unwrap();
    assert!(ok.success(), "restarting the cluster failed");
    std::thread::sleep(Duration::from_secs(2));
    let mut admin = db.client();
    let killed: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
              WHERE application_name LIKE 'ci-ephemeral-provisioner%' AND pid <> pg_backend_pid()",
            &[],
        )
        .unwrap()
        .get(0);
    drop(admin);
    // The jobs finish; the pool comes to rest.
    wait(
        "every job taken",
        180,
        || {
            for j in env.fake.jobs() {
                if j.status == "running" {
                    env.fake.set_job_status(j.id, "success");
                }
            }
            env.fake.jobs().iter().all(|j| j.status == "success")
        },
        || picture(&env, &db, &refs),
    );
    wait_at_rest(&env, &db, &refs, 180);
    let launched = launches(&env.vm);
    let mut per: BTreeMap<&String, usize> = BTreeMap::new();
    for h in launched.values() {
        *per.entry(h).or_default() += 1;
    }
    assert!(
        per.values().all(|n| *n == 1),
        "a job attempt launched twice: {per:?} ({killed} connections terminated)"
    );
}

/// The statements our processes sent to database `db`, as the server logged them (`.ci/pg` logs
/// every statement of the tests' role, each line after the client's application name and the
/// database; other tests' databases are others).
fn statements_logged(log: &Path, from: u64, db: &str) -> Vec<String> {
    let text = fs::read(log).unwrap_or_default();
    let ours = format!("ci-ephemeral-provisioner {db} ");
    String::from_utf8_lossy(&text[from.min(text.len() as u64) as usize..])
        .lines()
        .filter(|l| {
            l.starts_with(&ours) && (l.contains("LOG:  statement:") || l.contains("LOG:  execute "))
        })
        .map(String::from)
        .collect()
}

/// The cost of the pool store: an idle tick is one statement beside the one GET (the files
/// store's is the GET alone), and a job served costs a bounded number of statements. Prints
/// the figures of BENCHMARKS.md ("Idle tick", "One pool across hosts"), each run's wall time
/// beside the files store's.
// Mutation caught: `load` reading the holds or the other slots with statements of their own.
#[test]
#[ignore = "needs PostgreSQL: bash .ci/pg runs it"]
fn an_idle_tick_of_the_pool_store_is_one_statement_beside_its_get() {
    let log = PathBuf::from(std::env::var("CI_EPHEMERAL_PROVISIONER_TEST_PG_LOG").expect(
        "CI_EPHEMERAL_PROVISIONER_TEST_PG_LOG: the server's log, with every statement of the role",
    ));
    let env = Env::new();
    let db = Db::new();
    let pg = |c: &mut Command| {
        c.args(["--store", "pg", "--pool", "p", "--host-id", "a"]);
        c.env("PG_CONN_STR", &db.url);
    };
    // The first run creates the schema.
    let mut first = env.cmd("run");
    pg(&mut first);
    assert_eq!(env.exec(first).code, Some(0));
    let measure = |store_pg: bool| {
        let from = fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
        env.fake.clear_requests();
        let mut c = env.cmd("run");
        if store_pg {
            pg(&mut c);
        }
        let t = Instant::now();
        let out = env.exec(c);
        let wall = t.elapsed();
        assert_eq!(out.code, Some(0), "{out:?}");
        // The server writes its log lines as it executes; give it a moment to flush.
        std::thread::sleep(Duration::from_millis(200));
        (
            statements_logged(&log, from, &db.name),
            env.fake.requests().len(),
            wall,
        )
    };
    let mut walls = (Vec::new(), Vec::new());
    for _ in 0..10 {
        let (stmts, requests, wall) = measure(true);
        assert_eq!(stmts.len(), 1, "an idle tick's statements: {stmts:#?}");
        assert_eq!(requests, 1, "an idle tick's requests");
        walls.0.push(wall);
        let (stmts, requests, wall) = measure(false);
        assert!(stmts.is_empty() && requests == 1);
        walls.1.push(wall);
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1000.0
    };
    println!(
        "BENCH idle tick: pg store 1 statement + 1 GET, median {:.1} ms; files store 0 statements + 1 GET, median {:.1} ms (10 runs each)",
        median(&mut walls.0),
        median(&mut walls.1)
    );
    // One job served from start to rest, in one run: its statements and requests.
    env.fake.add_job(&["debian"]);
    let from = fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    env.fake.clear_requests();
    let mut c = env.cmd("run");
    pg(&mut c);
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    std::thread::sleep(Duration::from_millis(200));
    let stmts = statements_logged(&log, from, &db.name);
    let requests = env.fake.requests();
    let api = requests
        .iter()
        .filter(|r| !r.path.starts_with("/_fake"))
        .count();
    println!(
        "BENCH one job served in one run: {} statements, {api} Forgejo API requests",
        stmts.len()
    );
    assert!(
        (5..=60).contains(&stmts.len()),
        "a job served took {} statements: {stmts:#?}",
        stmts.len()
    );
}

/// `status --remote` on another host of a pool on PostgreSQL: the registration names the host,
/// slot and cycle that hold it (read from the pool store, not from this host's files), and the
/// tofu state is read in the workspace of every cycle of the pool, whichever host made it; GET
/// requests only, and nothing written to the store.
// Mutation caught: `status --remote` reading this host's files for a pool on PostgreSQL (the
// registration held by no cycle, no workspace read); the workspaces filtered by this host.
#[test]
#[ignore = "needs PostgreSQL: bash .ci/pg runs it"]
fn status_remote_shows_the_cycles_and_workspaces_of_every_host() {
    let env = Env::new();
    let db = Db::new();
    // The runner connects, then dies: the cycle waits out the grace with its registration.
    env.set_launch_mode("die");
    let mut b = Host::start(&env, &db, "b", &["--registration-grace", "10m"], &[]);
    env.fake.add_job(&["debian"]);
    wait(
        "host b's runner to connect",
        120,
        || {
            count(
                &db,
                "SELECT count(*) FROM ci_ephemeral_provisioner.cycles WHERE host_id = 'b' AND state LIKE '%\"connected\":true%'",
            ) > 0
        },
        || picture(&env, &db, &[&b]),
    );
    let cycle: String = db
        .client()
        .query_one("SELECT cycle_id FROM ci_ephemeral_provisioner.cycles", &[])
        .unwrap()
        .get(0);
    // Host a: its own module copy, initialised as its runs would have, and its own state.
    let a = env.tmp.path().join("host-a");
    let module = a.join("module");
    fs::create_dir_all(&module).unwrap();
    fs::create_dir_all(a.join("state")).unwrap();
    for f in ["main.tf", "vm.sh", "backend.tf"] {
        fs::copy(b.dir.join("module").join(f), module.join(f)).unwrap();
    }
    let init = Command::new(&env.tofu)
        .arg(format!("-chdir={}", module.display()))
        .args(["init", "-input=false", "-no-color"])
        .env("PG_CONN_STR", &db.url)
        .env("CHECKPOINT_DISABLE", "1")
        .output()
        .unwrap();
    assert!(init.status.success(), "{init:?}");
    let rows_before = count(
        &db,
        "SELECT count(*) FROM ci_ephemeral_provisioner.cycles WHERE host_id = 'a'",
    );
    env.fake.clear_requests();
    let mut c = env.cmd("status");
    c.args(["--state-dir", a.join("state").to_str().unwrap()]);
    c.args(["--remote", "--store", "pg", "--pool", "p", "--host-id", "a"]);
    c.args(["--forgejo-url", &env.fake.url()]);
    c.args(["--token-file", env.token_file.to_str().unwrap()]);
    c.args([
        "--tofu-bin",
        &env.tofu,
        "--tofu-dir",
        module.to_str().unwrap(),
    ]);
    c.args(["--output", "json"]);
    c.env("PG_CONN_STR", &db.url).env("CHECKPOINT_DISABLE", "1");
    let out = env.exec(c);
    let doc: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}\n{}", out.stdout, out.stderr));
    let regs = doc["remote"]["forgejo"]["registrations"]
        .as_array()
        .unwrap();
    assert_eq!(regs.len(), 1, "{doc:#}");
    assert_eq!(
        regs[0]["cycle"],
        serde_json::json!({"host": "b", "slot": 1, "cycle_id": cycle}),
        "{doc:#}"
    );
    let resources = doc["remote"]["tofu"]["resources"].as_array().unwrap();
    assert!(
        !resources.is_empty()
            && resources
                .iter()
                .all(|r| r["workspace"] == format!("p-{cycle}")),
        "{doc:#}"
    );
    let methods: Vec<String> = env
        .fake
        .requests()
        .iter()
        .map(|r| r.method.clone())
        .collect();
    assert!(methods.iter().all(|m| m == "GET"), "{methods:?}");
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM ci_ephemeral_provisioner.cycles WHERE host_id = 'a'",
        ),
        rows_before
    );
    b.halt();
    env.set_launch_mode("one-job");
}
