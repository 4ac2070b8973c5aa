//! The webhook receiver, `hook`, run as systemd runs it: once per connection on a real socket
//! passed as fd 3 (`support::webhook::Activator`), with deliveries signed as Forgejo signs them
//! (`forgejo_model::webhook`, its own SHA-256), and sent by the fake Forgejo when a job is
//! created. And the runs it wakes: a woken run looks for a job written after its delivery, and a
//! delivery ends a warm VM's wait at once.

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::IntoRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use forgejo_model::webhook::{Delivery, delivery, push_payload};

use crate::support::harness::{BIN, Env, wait_for};
use crate::support::webhook::{Activator, Ran, deliver, exchange, request_bytes, run_on_fd3};

const SECRET: &str = "whsec-8f2c61d0b7a94e35c1";

/// A receiver on a socket of its own: its secret file, two wake files (`a`, `b`, not created
/// yet), its state directory and metrics file.
struct Hook {
    dir: tempfile::TempDir,
    act: Activator,
}

impl Hook {
    fn start(secret: &str, secret_mode: u32) -> Hook {
        let dir = tempfile::tempdir().unwrap();
        let secret_file = dir.path().join("secret");
        fs::write(&secret_file, format!("{secret}\n")).unwrap();
        fs::set_permissions(&secret_file, fs::Permissions::from_mode(secret_mode)).unwrap();
        let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
        let args = vec![
            "--secret-file".into(),
            p("secret"),
            "--wake-file".into(),
            format!("{},{}", p("a"), p("b")),
            "--state-dir".into(),
            p("state"),
            "--metrics-file".into(),
            p("hook.prom"),
            "--read-timeout".into(),
            "1s".into(),
        ];
        let act = Activator::start(BIN, args, vec![("RUST_LOG".into(), "info".into())]);
        Hook { dir, act }
    }

    fn wake(&self, n: &str) -> PathBuf {
        self.dir.path().join(n)
    }

    fn mtime(&self, n: &str) -> Option<SystemTime> {
        fs::metadata(self.wake(n)).and_then(|m| m.modified()).ok()
    }

    /// Sets both wake files' modification time an hour back (touched by "an earlier delivery").
    fn age_wake_files(&self) {
        let old = SystemTime::now() - Duration::from_secs(3600);
        for n in ["a", "b"] {
            let f = fs::OpenOptions::new()
                .write(true)
                .open(self.wake(n))
                .unwrap();
            f.set_modified(old).unwrap();
        }
    }

    /// The count of `reason` in the metrics file.
    fn count(&self, reason: &str) -> u64 {
        let text = fs::read_to_string(self.wake("hook.prom")).unwrap_or_default();
        text.lines()
            .find(|l| {
                l.starts_with("ci_ephemeral_provisioner_hook_deliveries_total{")
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    }

    fn send(&self, bytes: &[u8]) -> (u16, String) {
        exchange(&self.act.addr, bytes).expect("an answer")
    }
}

fn signed(uuid: &str, event_type: &str) -> Delivery {
    delivery(
        SECRET,
        uuid,
        "push",
        event_type,
        &push_payload(1, 1, &"a".repeat(40)),
    )
}

fn bytes(d: &Delivery) -> Vec<u8> {
    request_bytes("127.0.0.1", "/hook", d)
}

// Mutation caught: the hook not remembering a delivery's id (`state.remember`): its replay
// touched the wake files again; `seen` by id alone: the relabelled body woke.
#[test]
fn a_signed_delivery_wakes_every_file_and_its_replay_wakes_nothing() {
    let hook = Hook::start(SECRET, 0o600);
    // The fake Forgejo delivers the push that created a job, signed as Forgejo signs it.
    let env = Env::new();
    env.fake.set_webhook(&hook.act.url(), SECRET);
    let (job, _) = env.fake.add_job(&["debian"]);
    wait_for("the fake's delivery", || env.fake.deliveries().len() == 1);
    let sent = &env.fake.deliveries()[0];
    assert_eq!(sent.job_id, Some(job));
    assert_eq!(
        sent.answer.as_ref().unwrap(),
        &(200, "woke a, b".to_string()),
        "{sent:?}"
    );
    assert!(hook.mtime("a").is_some() && hook.mtime("b").is_some());
    let ran = hook.act.wait_ran(1);
    assert_eq!(ran[0].code, Some(0), "{}", ran[0].stderr);
    assert!(
        ran[0].stderr.contains(&format!(
            "delivery \"{}\" (\"push\") from 127.0.0.1:",
            sent.uuid
        )) && ran[0].stderr.contains(": woke a, b"),
        "{}",
        ran[0].stderr
    );
    // A delivery of our own, then its replay byte for byte: seen before, nothing touched.
    hook.age_wake_files();
    let d = signed("6f1d2c3b-0000-4000-8000-000000000001", "push");
    assert_eq!(hook.send(&bytes(&d)), (200, "woke a, b".into()));
    hook.age_wake_files();
    let aged = hook.mtime("a");
    assert_eq!(
        hook.send(&bytes(&d)),
        (200, "a delivery seen before: nothing woken".into())
    );
    assert_eq!(hook.mtime("a"), aged, "the replay touched a wake file");
    // Its body under a new id and another event header (neither is signed): seen before too.
    let relabelled = signed("6f1d2c3b-0000-4000-8000-000000000002", "create");
    assert_eq!(
        hook.send(&bytes(&relabelled)),
        (200, "a delivery seen before: nothing woken".into())
    );
    assert_eq!(
        hook.mtime("a"),
        aged,
        "the relabelled replay touched a wake file"
    );
    let ran = hook.act.wait_ran(4);
    assert!(
        ran[2].stderr.contains("seen before, nothing woken"),
        "{}",
        ran[2].stderr
    );
    assert_eq!((hook.count("woke"), hook.count("repeated")), (2, 2));
    crate::observability::promtool_check(&hook.wake("hook.prom"), "hook");
    // The secret is in none of what the receiver wrote or said.
    let state = fs::read_to_string(hook.wake("state/hook-state.json")).unwrap();
    let metrics = fs::read_to_string(hook.wake("hook.prom")).unwrap();
    for (what, text) in [
        ("state", &state),
        ("metrics", &metrics),
        ("log", &ran[2].stderr),
    ] {
        assert!(
            !text.contains(SECRET),
            "the secret is in the receiver's {what}"
        );
    }
}

/// Sends `bytes` one at a time every 50 ms until the hook answers; how many were sent by then.
fn drip(addr: &str, bytes: &[u8]) -> (usize, (u16, String)) {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut reader = s.try_clone().unwrap();
    let answered = std::thread::spawn(move || {
        let mut a = Vec::new();
        let _ = reader.read_to_end(&mut a);
        a
    });
    let mut sent = 0;
    for b in bytes {
        if answered.is_finished() || s.write_all(&[*b]).is_err() {
            break;
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    let answer = String::from_utf8_lossy(&answered.join().unwrap()).into_owned();
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (sent, (status, answer))
}

// Mutation caught: the deadline replaced by a per-read timeout of --read-timeout (a client
// dripping a byte every 50 ms held the hook until it had sent its whole request).
// Mutation caught: the size check removed (a 2 MiB body was read, not refused at its head).
#[test]
fn unsigned_forged_oversized_slow_and_malformed_requests_wake_nothing_and_say_why() {
    let hook = Hook::start(SECRET, 0o600);
    let good = signed("0a9b8c7d-0000-4000-8000-000000000002", "push");
    let unsigned = delivery("", "u-1", "push", "push", &good.body);
    let forged = delivery("not-the-secret", "u-2", "push", "push", &good.body);
    let mut tampered = good.clone();
    tampered.body = good.body.replace("refs/heads/main", "refs/heads/evil");
    let as_text = |d: &Delivery, from: &str, to: &str| {
        String::from_utf8(bytes(d))
            .unwrap()
            .replacen(from, to, 1)
            .into_bytes()
    };
    let head_only = |len: usize| {
        let full = String::from_utf8(bytes(&good)).unwrap();
        let head = full.split_once("\r\n\r\n").unwrap().0;
        format!(
            "{}\r\n\r\n",
            head.replace(
                &format!("Content-Length: {}", good.body.len()),
                &format!("Content-Length: {len}")
            )
        )
        .into_bytes()
    };
    let mut huge_header = bytes(&good);
    let line_end = huge_header.windows(2).position(|w| w == b"\r\n").unwrap() + 2;
    huge_header.splice(
        line_end..line_end,
        format!("X-Padding: {}\r\n", "p".repeat(20_000)).into_bytes(),
    );
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("unsigned", bytes(&unsigned), 403),
        ("bad_signature", bytes(&forged), 403),
        ("bad_signature", bytes(&tampered), 403),
        ("too_large", head_only(2 * 1024 * 1024), 413),
        ("too_large", huge_header, 413),
        ("malformed", b"hello\r\n\r\n".to_vec(), 400),
        ("method", as_text(&good, "POST /hook", "GET /hook"), 405),
        (
            "content_type",
            as_text(
                &good,
                "application/json",
                "application/x-www-form-urlencoded",
            ),
            415,
        ),
    ];
    let mut want = std::collections::BTreeMap::new();
    for (i, (reason, req, status)) in cases.iter().enumerate() {
        let (got, body) = hook.send(req);
        assert_eq!(got, *status, "{reason}: {body}");
        assert!(body.starts_with(&format!("refused ({reason}): ")), "{body}");
        let ran = hook.act.wait_ran(i + 1);
        let log = &ran[i].stderr;
        assert_eq!(ran[i].code, Some(0), "{log}");
        assert!(
            log.contains("refused a request from 127.0.0.1:")
                && log.contains(&format!("({reason})")),
            "{reason}: {log}"
        );
        *want.entry(*reason).or_insert(0u64) += 1;
    }
    // Slow: half of the body, then nothing; and a drip of one byte every 50 ms. Each is cut
    // off at --read-timeout (1 s), the drip long before its last byte.
    let full = bytes(&good);
    let mut s = TcpStream::connect(&hook.act.addr).unwrap();
    s.write_all(&full[..full.len() - good.body.len() / 2])
        .unwrap();
    let (status, body) = crate::support::webhook::read_answer(&mut s).unwrap();
    assert_eq!(
        (status, body.starts_with("refused (slow): ")),
        (408, true),
        "{body}"
    );
    let (sent, (status, answer)) = drip(&hook.act.addr, &full);
    assert_eq!(status, 408, "{answer}");
    assert!(
        sent < full.len(),
        "the hook waited for all {sent} bytes of a dripping client"
    );
    *want.entry("slow").or_insert(0) += 2;
    // A signed delivery of an event after which no job waits: accepted, nothing woken.
    let ended = signed("7e6d5c4b-0000-4000-8000-000000000003", "action_run_success");
    assert_eq!(
        hook.send(&bytes(&ended)),
        (
            200,
            "an event after which no job waits: nothing woken".into()
        )
    );
    want.insert("no_jobs_event", 1);
    for n in ["a", "b"] {
        assert!(
            !hook.wake(n).exists(),
            "a refused request touched wake file {n}"
        );
    }
    hook.act.wait_ran(cases.len() + 3);
    for (reason, n) in want {
        assert_eq!(hook.count(reason), n, "{reason}");
    }
    assert_eq!(hook.count("woke"), 0);
}

// Mutation caught: the hook touching every wake file for every delivery (`touches` always
// true): each of a burst's deliveries woke the slots again.
#[test]
fn a_burst_of_deliveries_touches_each_wake_file_once_a_second() {
    let hook = Hook::start(SECRET, 0o600);
    let n = 12;
    let senders: Vec<_> = (0..n)
        .map(|i| {
            // Bodies of their own (one body sent twice is a replay).
            let d = delivery(
                SECRET,
                &format!("b0b0b0b0-0000-4000-8000-{i:012}"),
                "push",
                "push",
                &push_payload(1, 1, &format!("{i:040x}")),
            );
            let addr = hook.act.addr.clone();
            std::thread::spawn(move || exchange(&addr, &bytes(&d)).unwrap())
        })
        .collect();
    for s in senders {
        assert_eq!(s.join().unwrap().0, 200);
    }
    hook.act.wait_ran(n);
    let (woke, coalesced) = (hook.count("woke"), hook.count("coalesced"));
    assert_eq!(woke + coalesced, n as u64);
    assert!(
        woke >= 1 && woke < n as u64,
        "woke {woke}, coalesced {coalesced}"
    );
}

/// `hook` with `fd` as fd 3 (none: not started by a socket unit), its secret file holding
/// `secret` with `mode`: how it ended.
fn hook_with(fd: Option<i32>, secret: &str, mode: u32) -> Ran {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    fs::write(&secret_file, secret).unwrap();
    fs::set_permissions(&secret_file, fs::Permissions::from_mode(mode)).unwrap();
    let args = vec![
        "--secret-file".to_string(),
        secret_file.to_str().unwrap().into(),
        "--wake-file".into(),
        dir.path().join("a").to_str().unwrap().into(),
        "--state-dir".into(),
        dir.path().join("state").to_str().unwrap().into(),
    ];
    match fd {
        Some(fd) => run_on_fd3(&PathBuf::from(BIN), &args, &[], fd),
        None => {
            let out = std::process::Command::new(BIN)
                .arg("hook")
                .args(&args)
                .env_clear()
                .output()
                .unwrap();
            Ran {
                code: out.status.code(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            }
        }
    }
}

#[test]
fn a_missing_socket_or_secret_is_a_configuration_error_that_says_what_to_fix() {
    // Not started by a socket unit.
    let ran = hook_with(None, SECRET, 0o600);
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(
        ran.stderr.contains(
            "hook answers one connection passed by systemd's socket activation (a .socket unit with Accept=yes)"
        ),
        "{}",
        ran.stderr
    );
    // A listening socket (Accept=no).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ran = hook_with(Some(listener.into_raw_fd()), SECRET, 0o600);
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(
        ran.stderr.contains(
            "fd 3 is not a connection (a listening socket): the hook's socket unit needs ListenStream= and Accept=yes"
        ),
        "{}",
        ran.stderr
    );
    // An empty secret, and one others may read: the sender is told 500, the log says why.
    for (secret, mode, says) in [
        ("\n", 0o600, "is empty: put the webhook's secret there"),
        (SECRET, 0o644, "must be owned by this user"),
    ] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let d = signed("c0c0c0c0-0000-4000-8000-000000000004", "push");
            exchange(&addr.to_string(), &bytes(&d))
        });
        let (conn, _) = listener.accept().unwrap();
        let ran = hook_with(Some(conn.into_raw_fd()), secret, mode);
        assert_eq!(ran.code, Some(2), "{}", ran.stderr);
        assert!(ran.stderr.contains(says), "{}", ran.stderr);
        let (status, body) = client.join().unwrap().unwrap();
        assert_eq!(status, 500, "{body}");
    }
}

/// A run of `env` with `--wake-file wake` and these flags, started now: its stdout and stderr
/// go to files (read by [`finish`]).
fn spawn_run(env: &Env, wake: &Path, extra: &[&str]) -> std::process::Child {
    let mut c = env.cmd("run");
    c.args(["--wake-file", wake.to_str().unwrap(), "--output", "json"]);
    c.args(extra);
    c.stdin(std::process::Stdio::null())
        .stdout(fs::File::create(env.tmp.path().join("run.out")).unwrap())
        .stderr(fs::File::create(env.tmp.path().join("run.err")).unwrap());
    c.spawn().unwrap()
}

/// Waits for the run (killed after 90 s: a hang guard): its exit status, report and stderr.
fn finish(env: &Env, mut child: std::process::Child) -> (Option<i32>, serde_json::Value, String) {
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the run hung for 90 s; stderr:\n{}",
                fs::read_to_string(env.tmp.path().join("run.err")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = fs::read_to_string(env.tmp.path().join("run.err")).unwrap_or_default();
    let stdout = fs::read_to_string(env.tmp.path().join("run.out")).unwrap_or_default();
    let report = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("not a JSON report ({e}):\n{stderr}"));
    (status.code(), report, stderr)
}

fn jobs_lists(env: &Env) -> usize {
    env.fake
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path.ends_with("/runners/jobs"))
        .count()
}

// Mutation caught: a run with nothing to do ending at once although a delivery woke it (the
// job written after the delivery waited for the next timer tick).
#[test]
fn a_woken_run_serves_the_job_its_push_created_after_the_delivery() {
    let env = Env::new();
    let hook = Hook::start(SECRET, 0o600);
    // The push's delivery comes first (Forgejo's webhook notifier runs before its Actions one).
    let d = signed("d0d0d0d0-0000-4000-8000-000000000005", "push");
    assert_eq!(deliver(&hook.act.url(), &d).unwrap().0, 200);
    // The slot's .path unit starts a run; it finds no job yet and keeps looking.
    let child = spawn_run(&env, &hook.wake("a"), &["--wake-window", "30s"]);
    wait_for("the woken run's second look", || jobs_lists(&env) >= 2);
    let (job, _) = env.fake.add_job(&["debian"]);
    let (code, report, stderr) = finish(&env, child);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(report["outcome"], "cycle_finished", "{stderr}");
    assert!(
        stderr.contains("woken by a webhook delivery at "),
        "{stderr}"
    );
    assert!(
        env.fake
            .jobs()
            .iter()
            .any(|j| j.id == job && j.status == "success")
    );
    env.assert_at_rest();
}

// Mutation caught: a wait not ended by a change of the wake file (the warm VM's run slept its
// 10-minute poll interval through the delivery, and the test's 90 s guard failed).
#[test]
fn a_delivery_ends_a_warm_vms_wait_at_once() {
    let env = Env::new();
    let hook = Hook::start(SECRET, 0o600);
    env.fake.set_webhook(&hook.act.url(), SECRET);
    let child = spawn_run(
        &env,
        &hook.wake("a"),
        &[
            "--warm",
            "1",
            "--poll-interval",
            "10m",
            "--warm-max-age",
            "2h",
            "--wake-window",
            "2s",
        ],
    );
    wait_for("the warm VM to be up and waiting", || {
        env.cycle_json()
            .is_some_and(|c| c["warm"] == true && c["phase"] == "running")
            && jobs_lists(&env) >= 2
    });
    let (job, _) = env.fake.add_job(&["debian"]);
    let (code, report, stderr) = finish(&env, child);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(report["outcome"], "cycle_finished", "{stderr}");
    assert!(
        env.fake
            .jobs()
            .iter()
            .any(|j| j.id == job && j.status == "success"),
        "{stderr}"
    );
    assert_eq!(env.fake.deliveries().len(), 1);
    env.assert_at_rest();
}
