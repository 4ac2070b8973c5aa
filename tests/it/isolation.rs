//! What the binary does with files and text it does not control, against the fake Forgejo and
//! the real terraform/tofu CLI: a symlink planted in the state directory at any file it reads or
//! writes is never followed (the step fails naming the file; the link's target is untouched),
//! and text from Forgejo (runner names, statuses, error messages) never reaches a log line or
//! `status` with its control characters: it cannot forge a line, a journald priority, or
//! drive the terminal.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::support::fake_forgejo::{Conn, Fault};
use crate::support::harness::Env;
use ci_ephemeral_provisioner::core::state::CycleState;
use ci_ephemeral_provisioner::core::time::Timestamp;

// ---------------------------------------------------------------------------------------------
// Symlinks in the state directory
// ---------------------------------------------------------------------------------------------

/// A symlink at `<state>/<name>` to a file outside the state directory holding `text` (valid
/// contents: a reader that followed the link would find nothing wrong). Returns the link and
/// the target.
fn plant(env: &Env, name: &str, text: &str) -> (PathBuf, PathBuf) {
    fs::create_dir_all(&env.state).unwrap();
    let outside = env.tmp.path().join("outside");
    fs::create_dir_all(&outside).unwrap();
    let target = outside.join(name);
    fs::write(&target, text).unwrap();
    let link = env.state.join(name);
    std::os::unix::fs::symlink(&target, &link).unwrap();
    (link, target)
}

fn is_symlink(p: &Path) -> bool {
    fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

fn assert_names(out: &crate::support::harness::Outcome, path: &Path, what: &str) {
    assert!(
        out.stderr.contains(path.to_str().unwrap()) && out.stderr.contains("symlink"),
        "{what}: the error names the file and says it is a symlink: {out:?}"
    );
}

#[test]
fn a_symlinked_lock_file_stops_the_run_and_nothing_is_written_through_it() {
    let env = Env::new();
    env.fake.add_job(&["debian"]);
    let (link, target) = plant(&env, "cycle.lock", "not a lock\n");
    for sub in ["run", "sweep"] {
        let out = env.exec(env.cmd(sub));
        assert_eq!(out.code, Some(1), "{sub}: {out:?}");
        assert!(
            out.stderr.contains(link.to_str().unwrap()),
            "{sub}: names the lock file: {out:?}"
        );
        assert_eq!(fs::read_to_string(&target).unwrap(), "not a lock\n");
        assert!(is_symlink(&link));
    }
    // A dangling link: following it would create the file it names.
    fs::remove_file(&link).unwrap();
    let nowhere = env.tmp.path().join("outside/created-through-the-link");
    std::os::unix::fs::symlink(&nowhere, &link).unwrap();
    let out = env.run(&[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(!nowhere.exists(), "the lock was created through the link");
    assert!(env.vm_log().is_empty(), "tofu ran: {}", env.vm_log());
    assert!(
        env.fake.requests().iter().all(|r| r.method == "GET"),
        "{:?}",
        env.fake.requests()
    );
}

#[test]
fn a_symlinked_cycle_or_held_jobs_file_fails_the_run_and_is_never_read() {
    // cycle.json: a valid cycle in progress, outside.
    let env = Env::new();
    let mut s = CycleState::new("20261129t110000z-beef".into(), Timestamp(1_764_414_000_000));
    s.runner_prefix = "ephemeral-".into();
    let cycle = serde_json::to_string(&s).unwrap();
    let (link, target) = plant(&env, "cycle.json", &cycle);
    let out = env.run(&[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert_names(&out, &link, "cycle.json");
    assert_eq!(fs::read_to_string(&target).unwrap(), cycle);
    assert!(env.vm_log().is_empty(), "tofu ran");

    // held-jobs.json: valid (no job held), outside. The run fails and removes the link.
    let env = Env::new();
    let holds = "{\"version\": 1, \"jobs\": []}\n";
    let (link, target) = plant(&env, "held-jobs.json", holds);
    let out = env.run(&[]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert_names(&out, &link, "held-jobs.json");
    assert_eq!(fs::read_to_string(&target).unwrap(), holds);
}

#[test]
fn symlinked_counters_and_last_run_are_reported_and_replaced_never_written_through() {
    let env = Env::new();
    let counters = serde_json::to_string(&ci_ephemeral_provisioner::core::metrics::Counters {
        first_run_at: Some(ci_ephemeral_provisioner::adapters::clock::wall_now()),
        last_success_at: Some(ci_ephemeral_provisioner::adapters::clock::wall_now()),
        ..Default::default()
    })
    .unwrap();
    let now = ci_ephemeral_provisioner::adapters::clock::wall_now().to_string();
    let last_run = format!(
        "{{\"command\": \"run\", \"exit_code\": 0, \"outcome\": \"idle\", \"started_at\": \"{now}\", \"finished_at\": \"{now}\"}}"
    );
    let (counters_link, counters_target) = plant(&env, "counters.json", &counters);
    let (last_link, last_target) = plant(&env, "last-run.json", &last_run);
    // `status` reports both (it does not crash, and does not read their targets).
    let mut c = env.cmd("status");
    c.arg("--check");
    let out = env.exec(c);
    assert_eq!(out.code, Some(1), "{out:?}");
    for link in [&counters_link, &last_link] {
        assert!(
            out.stdout.contains(link.to_str().unwrap()) && out.stdout.contains("symlink"),
            "status names {}: {out:?}",
            link.display()
        );
    }
    assert!(out.stdout.contains("last run: UNREADABLE"), "{out:?}");
    // A run is told the counters are unreadable, and writes both files anew (the rename
    // replaces the link itself): the targets are untouched.
    let out = env.run(&[]);
    assert_names(&out, &counters_link, "counters.json");
    for (link, target, text) in [
        (&counters_link, &counters_target, &counters),
        (&last_link, &last_target, &last_run),
    ] {
        assert_eq!(&fs::read_to_string(target).unwrap(), text);
        assert!(
            fs::symlink_metadata(link).unwrap().file_type().is_file(),
            "{} replaced by a file",
            link.display()
        );
    }
}

#[test]
fn a_symlinked_audit_trail_fails_the_run_and_is_never_appended_to() {
    let env = Env::new();
    let stale = env
        .fake
        .add_runner("ephemeral-stale", true, Conn::NeverConnected);
    let line =
        "{\"at\": \"2026-11-29T10:00:00Z\", \"kind\": \"failure\", \"detail\": \"outside\"}\n";
    let (link, target) = plant(&env, "events.jsonl", line);
    let out = env.exec(env.cmd("sweep"));
    assert_eq!(out.code, Some(1), "{out:?}");
    assert_names(&out, &link, "events.jsonl");
    assert_eq!(fs::read_to_string(&target).unwrap(), line);
    assert!(is_symlink(&link));
    // The sweep itself went on (the trail is a record, not a gate): the stale one is gone.
    assert_eq!(env.fake.deleted_ids(), vec![stale]);
    // `status` reports the trail unreadable rather than showing the target's records.
    let out = env.exec(env.cmd("status"));
    assert!(
        out.stdout.contains("events: UNREADABLE") && out.stdout.contains(link.to_str().unwrap()),
        "{out:?}"
    );
    assert!(!out.stdout.contains("outside"), "{out:?}");
}

// ---------------------------------------------------------------------------------------------
// Forgejo's text in logs and status
// ---------------------------------------------------------------------------------------------

const FORGED: &str = "\n<3>forged line\x1b[2J";

/// Three registrations of ours whose text would forge lines: an offline one named with a line
/// break, a journald priority and an ESC sequence (deleted by the sweep, its name logged); one
/// whose status is such a string (skipped as doubtful, its status logged); one whose DELETE
/// fails with such an error message (logged and reported).
fn hostile_world(env: &Env) {
    env.fake.add_runner(
        &format!("ephemeral-x{FORGED}\r\u{9b}31m\u{202e}"),
        true,
        Conn::NeverConnected,
    );
    let odd = env
        .fake
        .add_runner("ephemeral-odd", true, Conn::NeverConnected);
    env.fake
        .set_status_override(odd, Some(&format!("offline{FORGED}")));
    let failing = env
        .fake
        .add_runner("ephemeral-failing", true, Conn::NeverConnected);
    let body = serde_json::json!({ "message": format!("boom{FORGED}"), "url": "x" }).to_string();
    env.fake.inject(
        "DELETE",
        &format!("/actions/runners/{failing}"),
        Fault::StatusBody(500, body),
        100,
    );
}

/// Every line is one the binary meant: none starts with the forged text, no raw ESC, CR or C1
/// control reaches the output, and the escaped form shows the text was there.
fn assert_clean(what: &str, text: &str) {
    for l in text.lines() {
        assert!(
            !l.starts_with("<3>forged") && !l.starts_with("forged"),
            "{what}: a forged line: {l:?}\n{text}"
        );
    }
    assert!(
        !text.contains(['\x1b', '\r', '\u{9b}', '\u{202e}']),
        "{what}: a raw control character:\n{text:?}"
    );
    assert!(
        text.contains("\\n<3>forged line\\u{1b}[2J"),
        "{what}: the name is shown, escaped:\n{text}"
    );
}

/// Runs the binary with stderr in a file of our own; with `journal`, `JOURNAL_STREAM` names it
/// (the logger then writes `<N>` priority prefixes).
fn stderr_of(env: &Env, mut c: Command, journal: bool) -> (Option<i32>, String) {
    let err = env.tmp.path().join(format!("stderr-{journal}"));
    let file = fs::File::create(&err).unwrap();
    if journal {
        let m = file.metadata().unwrap();
        c.env("JOURNAL_STREAM", format!("{}:{}", m.dev(), m.ino()));
    }
    c.stdout(Stdio::null()).stderr(file).stdin(Stdio::null());
    let status = c.status().unwrap();
    (status.code(), fs::read_to_string(&err).unwrap())
}

#[test]
fn forgejo_text_cannot_forge_a_log_line_or_drive_the_terminal() {
    for journal in [false, true] {
        let env = Env::new();
        hostile_world(&env);
        let (code, err) = stderr_of(&env, env.cmd("sweep"), journal);
        assert_eq!(code, Some(1), "the failed DELETE fails the sweep: {err}");
        assert_clean(&format!("sweep stderr (journal: {journal})"), &err);
        assert!(
            err.contains("offline\\n<3>forged line"),
            "the status: {err}"
        );
        assert!(err.contains("boom\\n<3>forged line"), "the error: {err}");
        if journal {
            assert!(
                err.lines()
                    .all(|l| l.starts_with("<") && l.as_bytes().get(2) == Some(&b'>')),
                "every line carries our priority:\n{err}"
            );
        } else {
            assert!(err.lines().all(|l| l.starts_with("[20")), "{err}");
        }
        // `status` shows the last run's failures and the trail's records, with the same text.
        let out = env.exec(env.cmd("status"));
        assert_clean("status stdout", &out.stdout);
        assert!(
            !out.stderr.contains('\x1b'),
            "status stderr: {:?}",
            out.stderr
        );
        // The JSON form keeps the text whole (JSON escapes it).
        let mut c = env.cmd("status");
        c.args(["--output", "json"]);
        let doc = env.exec(c).json();
        assert!(
            doc.to_string().contains("\\n<3>forged line\\u001b[2J"),
            "{doc}"
        );
    }
}

/// The text report and the plan on stdout carry the same names: escaped there too.
#[test]
fn forgejo_text_is_escaped_in_the_report_and_the_plan() {
    let env = Env::new();
    hostile_world(&env);
    let mut c = env.cmd("sweep");
    c.arg("--dry-run");
    let plan = env.exec(c);
    assert_eq!(plan.code, Some(0), "{plan:?}");
    assert_clean("the plan", &plan.stdout);
    let out = env.exec(env.cmd("sweep"));
    assert_eq!(out.code, Some(1), "{out:?}");
    assert_clean("the report", &out.stdout);
}
