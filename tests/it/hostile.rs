//! Hostile input against the real binary: a cycle.json that is broken in every way, and Forgejo
//! answers that are wrong in every way (through the fake's fault injection). Each yields a clear
//! error or a safe skip: never a deletion on doubt, never a hang (the harness fails a run that
//! takes 90 s), never a changed cycle.json.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use crate::support::fake_forgejo::{Conn, Fault};
use crate::support::harness::{Env, Outcome};
use ci_ephemeral_provisioner::adapters::files::FileStore;
use ci_ephemeral_provisioner::adapters::files::read_state_file;
use ci_ephemeral_provisioner::core::ports::StateStore;
use ci_ephemeral_provisioner::core::state::CycleState;
use ci_ephemeral_provisioner::core::state::Launch;
use ci_ephemeral_provisioner::core::state::Registration;
use ci_ephemeral_provisioner::core::time::Timestamp;
use serde_json::json;

// ---------------------------------------------------------------------------------------------
// cycle.json
// ---------------------------------------------------------------------------------------------

/// The bytes the binary writes for a cycle in progress (with non-ASCII text, so that some cuts
/// split a character).
fn valid_cycle_json() -> Vec<u8> {
    let mut s = CycleState::new("20261129t110000z-beef".into(), Timestamp(1_764_414_000_000));
    s.runner_prefix = "ephemeral-".into();
    s.phase = ci_ephemeral_provisioner::core::state::Phase::Running;
    s.vm_ready_at = Some(Timestamp(1_764_414_060_000));
    s.registrations.push(Registration {
        name: "ephemeral-20261129t110000z-beef-1".into(),
        id: Some(7),
        uuid: Some("0b8e6c1c-6f0e-4a43-9d43-6a8f2d8d1c11".into()),
        job_id: 3,
        job_handle: "hándle-ü".into(),
        requested_at: Timestamp(1_764_414_061_000),
        launch: Launch::Done,
        launched_at: Some(Timestamp(1_764_414_062_000)),
        job_gone_since: None,
        connected: false,
        busy: false,
        not_served: None,
        failed_start: false,
        stopped: None,
        job_first_seen: None,
    });
    s.outputs
        .insert("address".into(), json!("192.0.2.7 — vm ✓"));
    let dir = tempfile::tempdir().unwrap();
    let mut store = FileStore::new(dir.path());
    store.save(&s).unwrap();
    fs::read(store.path()).unwrap()
}

/// The library's reader on every truncation of a valid file: each is an error naming the file,
/// and the file is never changed. (The only cut that still parses drops just the final newline.)
#[test]
fn every_truncation_of_cycle_json_is_refused_by_the_reader() {
    let valid = valid_cycle_json();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cycle.json");
    let full = {
        fs::write(&path, &valid).unwrap();
        read_state_file(&path).unwrap().unwrap()
    };
    let mut refused = 0;
    for cut in 0..valid.len() {
        fs::write(&path, &valid[..cut]).unwrap();
        match read_state_file(&path) {
            Ok(s) => {
                assert_eq!(cut, valid.len() - 1, "a cut at {cut} loaded: {s:?}");
                assert_eq!(s, Some(full.clone()));
            }
            Err(e) => {
                refused += 1;
                let msg = format!("{e:#}");
                assert!(
                    msg.contains(&path.display().to_string()),
                    "cut at {cut}: the error does not name the file: {msg}"
                );
            }
        }
        assert_eq!(
            fs::read(&path).unwrap(),
            &valid[..cut],
            "cut at {cut}: file changed"
        );
    }
    assert_eq!(refused, valid.len() - 1);
}

/// A world in which a run that ignored cycle.json would act: a waiting job, and a stale offline
/// registration of ours that a sweep would delete.
fn tempting_env() -> Env {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    env.fake
        .add_runner("ephemeral-stale", true, Conn::NeverConnected);
    fs::create_dir_all(&env.state).unwrap();
    env
}

/// What `run` and `sweep` must do with an unusable cycle.json: exit 1 naming the file, touch
/// nothing (no request to Forgejo, no tofu), leave the file as it was.
fn assert_refused(env: &Env, what: &str, before: &dyn Fn() -> String) {
    let path = env.state.join("cycle.json");
    let snapshot = before();
    for sub in ["run", "sweep"] {
        let out = env.exec(env.cmd(sub));
        assert_eq!(out.code, Some(1), "{what}, {sub}: {out:?}");
        assert!(
            out.stderr.contains(path.to_str().unwrap()),
            "{what}, {sub}: the error names the file: {out:?}"
        );
        // The way out runs tofu as the service's user, with its environment: under the role
        // its state and TF_DATA_DIR are not in the module directory.
        assert!(
            out.stderr
                .contains("`ci-ephemeral-provisioner-tofu POOL destroy -auto-approve`")
                && out.stderr.contains("never tofu as root"),
            "{what}, {sub}: the recovery hint: {out:?}"
        );
        assert_eq!(before(), snapshot, "{what}, {sub}: cycle.json changed");
    }
    // `status` reports it (and exits 0: it is a report, not an action).
    let status = env.exec(env.cmd("status"));
    assert!(
        status.stdout.contains("UNREADABLE") && status.stdout.contains(path.to_str().unwrap()),
        "{what}, status: {status:?}"
    );
    assert!(env.fake.requests().is_empty(), "{what}: Forgejo was asked");
    assert!(
        env.fake.deleted_ids().is_empty(),
        "{what}: something was deleted"
    );
    assert!(env.vm_log().is_empty(), "{what}: tofu ran");
}

fn file_bytes(path: &Path) -> impl Fn() -> String + '_ {
    move || format!("{:?}", fs::read(path).ok())
}

// Mutation caught: cycle.json of any version accepted.
#[test]
fn a_broken_cycle_json_is_a_clear_error_that_changes_and_deletes_nothing() {
    let valid = valid_cycle_json();
    let text = String::from_utf8(valid.clone()).unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&valid).unwrap();
    let mut cases: Vec<(String, Vec<u8>)> = vec![
        ("empty".into(), vec![]),
        ("not JSON".into(), b"hello, world\n".to_vec()),
        ("not text".into(), vec![0xff, 0xfe, 0x00, 0x7b]),
        ("an array".into(), b"[]".to_vec()),
        ("null".into(), b"null".to_vec()),
        ("no version".into(), b"{\"cycle_id\": \"x\"}".to_vec()),
        (
            "version as a string".into(),
            text.replacen("\"version\": 1", "\"version\": \"1\"", 1)
                .into_bytes(),
        ),
        (
            "unknown version".into(),
            text.replacen("\"version\": 1", "\"version\": 2", 1)
                .into_bytes(),
        ),
        ("huge".into(), {
            let mut b = vec![b' '; 2 * 1024 * 1024];
            b.extend_from_slice(&valid);
            b
        }),
    ];
    // Wrong types, one field at a time.
    for (field, bad) in [
        ("cycle_id", json!(5)),
        ("phase", json!("exploding")),
        ("registrations", json!({"a": 1})),
        ("next_seq", json!(-1)),
        ("started_at", json!("yesterday")),
    ] {
        let mut w = v.clone();
        w[field] = bad;
        cases.push((
            format!("{field} of the wrong type"),
            w.to_string().into_bytes(),
        ));
    }
    v["registrations"][0]["id"] = json!("7");
    cases.push((
        "a registration id as a string".into(),
        v.to_string().into_bytes(),
    ));
    // A sample of truncations (the library test above covers every offset).
    for cut in [
        1,
        valid.len() / 5,
        valid.len() / 2,
        valid.len() * 4 / 5,
        valid.len() - 2,
    ] {
        cases.push((format!("truncated at {cut}"), valid[..cut].to_vec()));
    }
    for (what, bytes) in cases {
        let env = tempting_env();
        let path = env.state.join("cycle.json");
        fs::write(&path, &bytes).unwrap();
        assert_refused(&env, &what, &file_bytes(&path));
    }
}

// Mutation caught: cycle.json read through a symlink.
#[test]
fn cycle_json_that_is_not_a_plain_file_is_refused_unread() {
    let valid = valid_cycle_json();
    // A symlink to a valid cycle.json.
    let env = tempting_env();
    let target = env.tmp.path().join("elsewhere.json");
    fs::write(&target, &valid).unwrap();
    let path = env.state.join("cycle.json");
    std::os::unix::fs::symlink(&target, &path).unwrap();
    let look = || {
        format!(
            "{:?} {:?}",
            fs::read_link(&path).ok(),
            fs::read(&target).ok()
        )
    };
    assert_refused(&env, "a symlink", &look);
    // A directory.
    let env = tempting_env();
    let path = env.state.join("cycle.json");
    fs::create_dir(&path).unwrap();
    assert_refused(&env, "a directory", &|| format!("{}", path.is_dir()));
    // A FIFO: reading it would block for ever.
    let env = tempting_env();
    let path = env.state.join("cycle.json");
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    assert_refused(&env, "a FIFO", &|| {
        format!(
            "{:?}",
            fs::symlink_metadata(&path).map(|m| m.file_type()).ok()
        )
    });
}

/// Permission denied. Root reads anything, so as root the binary runs as `nobody` (setpriv).
#[test]
fn an_unreadable_cycle_json_is_a_clear_error() {
    let env = tempting_env();
    let path = env.state.join("cycle.json");
    fs::write(&path, valid_cycle_json()).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o000)).unwrap();
    let as_root = unsafe { libc::geteuid() } == 0;
    let wrap = |sub: &str| {
        let inner = env.cmd(sub);
        if !as_root {
            return inner;
        }
        let mut c = std::process::Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"]);
        c.arg(inner.get_program());
        c.args(inner.get_args());
        c.env_clear();
        for (k, v) in inner.get_envs() {
            if let Some(v) = v {
                c.env(k, v);
            }
        }
        c
    };
    if as_root {
        // nobody must reach the state directory and its own token file (0600).
        fs::set_permissions(env.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        for p in [&env.state, &env.token_file] {
            std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
        }
    }
    let before = fs::read(&path).unwrap();
    for sub in ["run", "sweep"] {
        let out = env.exec(wrap(sub));
        assert_eq!(out.code, Some(1), "{sub}: {out:?}");
        assert!(
            out.stderr.contains(path.to_str().unwrap())
                && out.stderr.to_lowercase().contains("permission denied"),
            "{sub}: {out:?}"
        );
    }
    assert_eq!(fs::read(&path).unwrap(), before);
    assert!(env.fake.requests().is_empty());
    assert!(env.fake.deleted_ids().is_empty());
}

// ---------------------------------------------------------------------------------------------
// Forgejo answers
// ---------------------------------------------------------------------------------------------

/// Runners for the sweep cases: 1 is ours and offline (the only deletable one), 2 is ours and
/// idle, 3 is someone else's and offline.
fn sweep_env() -> Env {
    let env = Env::new();
    assert_eq!(
        env.fake
            .add_runner("ephemeral-stale", true, Conn::NeverConnected),
        1
    );
    env.fake.add_runner("ephemeral-alive", true, Conn::Idle);
    env.fake
        .add_runner("static-builder", false, Conn::NeverConnected);
    env
}

#[derive(Debug)]
enum Want {
    /// Exit 1, nothing deleted, stderr contains this.
    Error(&'static str),
    /// Nothing deleted (a doubtful row skipped), stderr contains this.
    Skip(&'static str),
    /// Exactly runner 1 deleted: the answer was odd but proves what it says.
    DeleteStaleOnly,
}

fn check_sweep(what: &str, fault: Fault, want: Want) {
    let env = sweep_env();
    env.fake
        .inject("GET", "/actions/runners?", fault, usize::MAX);
    let out = env.exec(env.cmd("sweep"));
    let deleted = env.fake.deletions();
    for (id, name, status) in &deleted {
        assert!(
            name.starts_with("ephemeral-") && status == "offline",
            "{what}: deleted {id} ({name}) while {status}"
        );
    }
    match want {
        Want::Error(text) => {
            assert_eq!(out.code, Some(1), "{what}: {out:?}");
            assert!(deleted.is_empty(), "{what}: deleted {deleted:?}");
            assert!(
                out.stderr.contains(text),
                "{what}: wanted {text:?} in {out:?}"
            );
        }
        Want::Skip(text) => {
            assert!(deleted.is_empty(), "{what}: deleted {deleted:?}");
            assert!(
                out.stderr.contains(text) || out.stdout.contains(text),
                "{what}: wanted {text:?} in {out:?}"
            );
        }
        Want::DeleteStaleOnly => {
            assert_eq!(out.code, Some(0), "{what}: {out:?}");
            assert_eq!(env.fake.deleted_ids(), vec![1], "{what}: {out:?}");
        }
    }
}

fn row(id: i64, name: &str, status: &str) -> serde_json::Value {
    json!({"id": id, "name": name, "status": status, "uuid": "u", "labels": null})
}

// Mutation caught: may_delete without the offline check.
// Mutation caught: core::sweep::listing::select ignores conflicting rows.
// Mutation caught: no response body size cap (ureq's 10 MB default).
// Mutation caught: body read errors reported raw (timeout: global).
#[test]
fn hostile_runner_lists_delete_nothing_on_doubt() {
    let html = "<!DOCTYPE html><html><body><h1>Bad Gateway</h1></body></html>".to_string();
    let cases: Vec<(&str, Fault, Want)> = vec![
        ("HTML error page", Fault::Html(502), Want::Error("HTTP 502")),
        ("HTML with status 200", Fault::Body(html), Want::Error("not JSON")),
        ("truncated JSON", Fault::Truncated, Want::Error("not JSON")),
        ("ids as strings", Fault::WrongTypes, Want::Error("no integer \"id\"")),
        ("an object, not a list", Fault::Body("{\"runners\": []}".into()), Want::Error("not a JSON array")),
        ("a row without id", Fault::Patch(json!({"id": null})), Want::Error("no integer \"id\"")),
        ("unknown status string", Fault::Patch(json!({"status": "Offline"})), Want::Skip("not exactly \"offline\"")),
        ("status of the wrong type", Fault::Patch(json!({"status": 0})), Want::Skip("not exactly \"offline\"")),
        ("missing status", Fault::Patch(json!({"status": null})), Want::Skip("not exactly \"offline\"")),
        ("missing name", Fault::Patch(json!({"name": null})), Want::Skip("0 deleted")),
        ("name of the wrong type", Fault::Patch(json!({"name": 42})), Want::Skip("0 deleted")),
        (
            "the same id twice, once offline and once idle",
            Fault::Body(json!([row(1, "ephemeral-stale", "offline"), row(1, "ephemeral-stale", "idle")]).to_string()),
            Want::Skip("not exactly \"offline\""),
        ),
        (
            "a Link header that loops back to page 1",
            Fault::Headers(vec![("Link", "<http://forgejo.invalid/api/v1/admin/actions/runners?page=1&limit=50>; rel=\"next\"".into())]),
            Want::DeleteStaleOnly,
        ),
        (
            "X-Total-Count far above the rows",
            Fault::Headers(vec![("X-Total-Count", "100000".into())]),
            Want::DeleteStaleOnly,
        ),
        ("X-Total-Count of 0", Fault::Headers(vec![("X-Total-Count", "0".into())]), Want::DeleteStaleOnly),
        ("X-Total-Count not a number", Fault::Headers(vec![("X-Total-Count", "many".into())]), Want::DeleteStaleOnly),
        (
            "a body over the size cap",
            Fault::Body(format!("[{}]", " ".repeat(5 * 1024 * 1024))),
            Want::Error("larger than"),
        ),
        (
            "a body that drips past the timeout",
            Fault::Drip { body: json!([row(1, "ephemeral-stale", "offline")]).to_string(), every: Duration::from_millis(300) },
            Want::Error("timed out"),
        ),
    ];
    for (what, fault, want) in cases {
        check_sweep(what, fault, want);
    }
}

/// A server that answers every page with the same full page and no count (a pager that loops):
/// the listing gives up at the first page that brings nothing new and deletes nothing.
// Mutation caught: list_all without its page limit.
#[test]
fn a_runner_list_that_never_ends_is_an_error() {
    let env = Env::new();
    let page: Vec<_> = (1..=50)
        .map(|i| row(i, &format!("ephemeral-{i}"), "offline"))
        .collect();
    env.fake.inject(
        "GET",
        "/actions/runners?",
        Fault::Body(serde_json::Value::Array(page).to_string()),
        usize::MAX,
    );
    let out = env.exec(env.cmd("sweep"));
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr
            .contains("page 2 of the runner list held only runners already listed"),
        "{out:?}"
    );
    assert!(env.fake.deleted_ids().is_empty());
}

/// Waiting-jobs answers that cannot be trusted: an error, and no VM, no registration.
// Mutation caught: no global HTTP timeout.
// Mutation caught: body read errors reported raw (timeout: global).
#[test]
fn hostile_job_lists_start_nothing() {
    let cases: Vec<(&str, Fault, &str)> = vec![
        ("HTML error page", Fault::Html(500), "HTTP 500"),
        ("truncated JSON", Fault::Truncated, "not JSON"),
        ("ids as strings", Fault::WrongTypes, "no integer \"id\""),
        (
            "a job without status",
            Fault::Patch(json!({"status": null})),
            "no string \"status\"",
        ),
        (
            "runs_on not a list",
            Fault::Patch(json!({"runs_on": "debian"})),
            "non-array \"runs_on\"",
        ),
        (
            "a body that drips past the timeout",
            Fault::Drip {
                body: "[]".repeat(20),
                every: Duration::from_millis(300),
            },
            "timed out",
        ),
    ];
    for (what, fault, text) in cases {
        let env = Env::new();
        env.fake.add_job(&["debian"]);
        env.fake.inject("GET", "/jobs", fault, usize::MAX);
        let out = env.run(&[]);
        assert_eq!(out.code, Some(1), "{what}: {out:?}");
        assert!(
            out.stderr.contains(text),
            "{what}: wanted {text:?} in {out:?}"
        );
        assert!(
            !env.fake.requests().iter().any(|r| r.method != "GET"),
            "{what}: it acted"
        );
        assert!(env.vm_log().is_empty(), "{what}: a VM");
        assert!(env.cycle_json().is_none(), "{what}: a cycle");
    }
}

fn converge(env: &Env, what: &str) -> Vec<Outcome> {
    let mut outs = Vec::new();
    for _ in 0..4 {
        let out = env.run(&[]);
        let done = out.code == Some(0) && env.cycle_json().is_none();
        outs.push(out);
        if done && env.fake.jobs().iter().all(|j| j.status == "success") {
            break;
        }
    }
    env.assert_at_rest();
    assert!(
        env.fake.jobs().iter().all(|j| j.status == "success"),
        "{what}: {outs:?}"
    );
    outs
}

/// The register POST answered with something unusable: whether or not it was applied, the run
/// finds out by name, deletes what was created, and the job still runs. The broken answer held
/// a runner token: it never reaches the output.
#[test]
fn hostile_register_answers_leak_nothing_and_converge() {
    let cases: Vec<(&str, Fault)> = vec![
        ("applied, answer truncated", Fault::Truncated),
        ("applied, ids as strings", Fault::WrongTypes),
        (
            "applied, token missing",
            Fault::Patch(json!({"token": null})),
        ),
        ("applied, answer a 500", Fault::ApplyThenStatus(500)),
        (
            "not applied, HTML 200",
            Fault::Body("<html>ok</html>".into()),
        ),
        ("not applied, HTML 502", Fault::Html(502)),
    ];
    for (what, fault) in cases {
        let env = Env::new();
        env.fake.add_job(&["debian"]);
        env.fake.inject("POST", "/actions/runners", fault, 1);
        let outs = converge(&env, what);
        let tokens = env.fake.issued_tokens();
        for o in &outs {
            for t in &tokens {
                for w in t.as_bytes().windows(12) {
                    let w = std::str::from_utf8(w).unwrap();
                    assert!(
                        !o.stdout.contains(w) && !o.stderr.contains(w),
                        "{what}: token in {o:?}"
                    );
                }
            }
        }
        for (id, name, status) in env.fake.deletions() {
            assert!(
                status == "offline",
                "{what}: deleted {id} ({name}) while {status}"
            );
        }
    }
}

/// Our own registration reported with a status we do not know, for as long as the fault lasts:
/// it is never deleted while in doubt; once Forgejo answers plainly again, it goes.
#[test]
fn a_registration_in_doubt_is_never_deleted_until_forgejo_answers_plainly() {
    for (what, patch) in [
        ("unknown status", json!({"status": "Offline"})),
        ("missing status", json!({"status": null})),
    ] {
        let env = Env::new();
        env.set_launch_mode("noop"); // truly offline: deletable once known
        env.fake.add_job(&["debian"]);
        // Registration 1's own GET and every list say something odd about its status.
        env.fake.inject(
            "GET",
            "/actions/runners/1",
            Fault::Patch(patch.clone()),
            usize::MAX,
        );
        env.fake
            .inject("GET", "/actions/runners?", Fault::Patch(patch), usize::MAX);
        // The run waits on it (a run lasts as long as its cycle); systemd stops it.
        let err = env.tmp.path().join("doubt.err");
        let mut c = env.cmd("run");
        c.stdout(std::process::Stdio::null());
        c.stderr(fs::File::create(&err).unwrap());
        let mut child = c.spawn().unwrap();
        let text = || fs::read_to_string(&err).unwrap_or_default();
        crate::support::harness::wait_for("the wait on doubt", || {
            text().contains("never deleted on doubt")
        });
        // Well past the 1 s registration grace of these tests: many polls, no deletion.
        let polls = env.fake.requests().len();
        crate::support::harness::wait_for("30 more requests", || {
            env.fake.requests().len() > polls + 30
        });
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(1), "{what}: {}", text());
        assert!(
            env.fake.deleted_ids().is_empty(),
            "{what}: deleted in doubt: {}",
            text()
        );
        assert!(
            env.cycle_json().is_some(),
            "{what}: the registration was forgotten"
        );
        env.fake.clear_faults();
        env.set_launch_mode("one-job");
        converge(&env, what);
        assert!(
            env.fake.deleted_ids().contains(&1),
            "{what}: removed once plain"
        );
    }
}

/// An `X-Total-Count` that lies low, with more rows than fit one page: a register POST whose
/// answer was lost must not be taken as never created because page 1 already "had them all".
/// The registration (on page 2) stays in cycle.json until Forgejo is seen without it.
// Mutation caught: a listing with more rows than its count taken as complete (the bug, reintroduced).
#[test]
fn a_count_that_lies_low_never_makes_a_lost_registration_forgotten() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    // Online runners come first (`last_online DESC`): the new registration, never connected,
    // is listed after all 60 of them, on page 2.
    for i in 0..60 {
        env.fake
            .add_runner(&format!("static-{i}"), false, Conn::Idle);
    }
    env.fake
        .inject("POST", "/actions/runners", Fault::ApplyThenDrop, 1);
    env.fake.inject(
        "GET",
        "/actions/runners?",
        Fault::Headers(vec![("X-Total-Count", "10".into())]),
        usize::MAX,
    );
    // A stop after a few lookups (the lie makes them inconclusive; the run would retry for long).
    let err = env.tmp.path().join("lie.err");
    let mut c = env.cmd("run");
    c.stdout(std::process::Stdio::null());
    c.stderr(fs::File::create(&err).unwrap());
    let mut child = c.spawn().unwrap();
    let lists = || {
        env.fake
            .requests()
            .iter()
            .filter(|r| r.method == "GET" && r.path.ends_with("/actions/runners"))
            .count()
    };
    crate::support::harness::wait_for("lookups by name", || {
        lists() >= 4 || child.try_wait().unwrap().is_some()
    });
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    let ours: Vec<_> = env
        .fake
        .runners()
        .into_iter()
        .filter(|r| r.name.starts_with("ephemeral-"))
        .collect();
    assert_eq!(ours.len(), 1, "the POST was applied: {ours:?}");
    let recorded = env.cycle_json().map(|c| c.to_string()).unwrap_or_default();
    assert!(
        recorded.contains(&ours[0].name),
        "registration {} is listed by Forgejo but was forgotten: {recorded}\n{}",
        ours[0].name,
        fs::read_to_string(&err).unwrap_or_default()
    );
    env.fake.clear_faults();
    converge(&env, "after the lie");
}
