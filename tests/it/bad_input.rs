//! Bad input gets a clear error and the right exit status: a state directory that is a file,
//! someone else's or writable by others; `status` on a directory that does not exist; https to
//! a plain-http port; credentials or a fragment in `--forgejo-url`; and a failed sweep is called
//! failed, with each error printed once. Real runs of the binary against the fake Forgejo.

use std::fs;
use std::os::unix::fs::PermissionsExt;

use crate::support::fake_forgejo::Conn;
use crate::support::harness::Env;

#[test]
fn a_state_dir_that_is_a_regular_file_is_a_configuration_error() {
    let env = Env::new();
    fs::write(&env.state, "").unwrap();
    for sub in ["run", "sweep"] {
        let out = env.exec(env.cmd(sub));
        assert_eq!(out.code, Some(2), "{sub}: {out:?}");
        assert!(out.stderr.contains("is not a directory"), "{sub}: {out:?}");
    }
    let out = env.exec(env.cmd("status"));
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("is not a directory"), "{out:?}");
    assert!(
        env.fake.requests().is_empty(),
        "nothing was asked of Forgejo"
    );
}

#[test]
fn a_state_dir_others_could_change_is_refused() {
    let env = Env::new();
    fs::create_dir(&env.state).unwrap();
    fs::set_permissions(&env.state, fs::Permissions::from_mode(0o777)).unwrap();
    let out = env.exec(env.cmd("run"));
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr
            .contains("writable by group or others (mode 0777)"),
        "{out:?}"
    );
    assert!(out.stderr.contains("chmod go-w"), "{out:?}");
    fs::set_permissions(&env.state, fs::Permissions::from_mode(0o755)).unwrap();
    let out = env.exec(env.cmd("run"));
    assert_eq!(out.code, Some(0), "0755 is fine: {out:?}");
}

// Mutation caught (#32, point 8): `status` silent about a state directory a run refuses.
#[test]
fn status_warns_about_a_state_dir_others_could_change_and_a_fresh_one_is_expected() {
    let env = Env::new();
    fs::create_dir(&env.state).unwrap();
    fs::set_permissions(&env.state, fs::Permissions::from_mode(0o700)).unwrap();
    let out = env.exec(env.cmd("status"));
    assert_eq!(out.code, Some(0), "{out:?}");
    // A new pool: said to be expected before the timer's first run, and how to see when it is.
    assert!(
        out.stdout.contains(
            "no run recorded yet: expected until the timer's first run (`systemctl list-timers"
        ),
        "{out:?}"
    );
    assert!(!out.stdout.contains("writable by group"), "{out:?}");
    fs::set_permissions(&env.state, fs::Permissions::from_mode(0o777)).unwrap();
    let mut c = env.cmd("status");
    c.arg("--check");
    let out = env.exec(c);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stdout.contains("WARNING: state directory")
            && out
                .stdout
                .contains("is writable by group or others (mode 0777)"),
        "{out:?}"
    );
    let mut c = env.cmd("status");
    c.args(["--output", "json"]);
    let doc = env.exec(c).json();
    assert_eq!(doc["healthy"], false, "{doc}");
    assert!(
        doc["warnings"][0].as_str().unwrap().contains("chmod go-w"),
        "{doc}"
    );
}

// Mutation caught (#32, point 6): `--forgejo-url …/api/v1` accepted.
#[test]
fn a_forgejo_url_with_the_api_path_is_refused_before_any_request() {
    let env = Env::new();
    let url = format!("{}/api/v1", env.fake.url());
    for sub in ["run", "sweep", "check"] {
        let mut c = env.cmd(sub);
        c.args(["--forgejo-url", &url]);
        let out = env.exec(c);
        assert_eq!(out.code, Some(2), "{sub}: {out:?}");
        let both = format!("{}{}", out.stdout, out.stderr);
        assert!(
            both.contains("ends in the API's path; give Forgejo's base URL")
                && both.contains(&format!("{:?}", env.fake.url())),
            "{sub}: {out:?}"
        );
    }
    assert!(env.fake.requests().is_empty(), "{:?}", env.fake.requests());
}

// Mutation caught (#32, point 7): a negative duration given to clap as a flag of its own
// (`unexpected argument '-1'`), for any duration flag.
#[test]
fn a_negative_duration_says_so_for_every_duration_flag() {
    let mut flags = std::collections::BTreeSet::new();
    for sub in ["run", "sweep", "status"] {
        let help = std::process::Command::new(crate::support::harness::BIN)
            .args([sub, "--help"])
            .output()
            .unwrap();
        for line in String::from_utf8_lossy(&help.stdout).lines() {
            let t = line.trim_start();
            if t.starts_with("--") && t.contains(" <DURATION>") {
                let flag = t.split_whitespace().next().unwrap().to_string();
                flags.insert((sub, flag));
            }
        }
    }
    assert!(flags.len() > 15, "{flags:?}");
    for (sub, flag) in &flags {
        let out = std::process::Command::new(crate::support::harness::BIN)
            .args([sub, flag.as_str(), "-1s"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{sub} {flag}: {err}");
        assert!(
            err.contains(&format!("invalid value '-1s' for '{flag} <DURATION>'"))
                && err.contains("\"-1s\" is negative; a duration is 0 or more"),
            "{sub} {flag}: {err}"
        );
    }
}

#[test]
fn a_state_dir_owned_by_another_user_is_refused() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to chown");
        return;
    }
    let env = Env::new();
    fs::create_dir(&env.state).unwrap();
    std::os::unix::fs::chown(&env.state, Some(65534), Some(65534)).unwrap();
    let out = env.exec(env.cmd("sweep"));
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("is owned by uid 65534"), "{out:?}");
    assert!(env.fake.requests().iter().all(|r| r.method == "GET"));
}

#[test]
fn status_on_a_directory_that_does_not_exist_says_so() {
    let env = Env::new();
    let out = env.exec(env.cmd("status"));
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr.contains("does not exist: is --state-dir right?"),
        "{out:?}"
    );
    assert!(!out.stdout.contains("no run recorded yet"), "{out:?}");
    // An existing, empty one is a fresh host.
    fs::create_dir(&env.state).unwrap();
    let out = env.exec(env.cmd("status"));
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("no run recorded yet"), "{out:?}");
}

/// A plain-http server as Go's net/http (Forgejo's) is one: a TLS ClientHello is no request
/// line, so it answers `400 Bad Request` in clear text and closes.
fn plain_http_port() -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = [0u8; 512];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(
                b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n400 Bad Request",
            );
        }
    });
    port
}

#[test]
fn https_to_a_plain_http_port_says_what_is_wrong() {
    let env = Env::new();
    let mut c = env.cmd("sweep");
    c.args([
        "--forgejo-url",
        &format!("https://127.0.0.1:{}", plain_http_port()),
    ]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("is this a plain-http port?"), "{out:?}");
}

#[test]
fn credentials_in_the_forgejo_url_are_refused_and_never_repeated() {
    let env = Env::new();
    let with_password = env
        .fake
        .url()
        .replacen("http://", "http://admin:hunter2@", 1);
    for sub in ["run", "sweep", "check"] {
        let mut c = env.cmd(sub);
        c.args(["--forgejo-url", &with_password]);
        let out = env.exec(c);
        assert!(
            !out.stdout.contains("hunter2") && !out.stderr.contains("hunter2"),
            "{sub}: {out:?}"
        );
        assert!(
            out.stderr.contains("user name or password")
                || out.stdout.contains("user name or password"),
            "{sub}: {out:?}"
        );
        // A flag's error: exit 2 for `check` as for `run` and `sweep`.
        assert_eq!(out.code, Some(2), "{sub}: {out:?}");
    }
    let mut c = env.cmd("run");
    c.args(["--forgejo-url", &format!("{}/#top", env.fake.url())]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("#fragment"), "{out:?}");
    assert!(
        env.fake.requests().is_empty(),
        "nothing was sent with a refused URL"
    );
}

#[test]
fn a_failed_sweep_is_called_failed_and_each_error_is_printed_once() {
    let env = Env::new();
    env.fake
        .add_runner("ephemeral-old-1", true, Conn::NeverConnected);
    let mut c = env.cmd("sweep");
    // Nothing listens there.
    c.args(["--forgejo-url", "http://127.0.0.1:9"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stdout.contains(": sweep_failed (exit 1"), "{out:?}");
    assert!(
        out.stdout
            .contains("sweep FAILED (the listing is incomplete)"),
        "{out:?}"
    );
    let both = format!("{}{}", out.stdout, out.stderr);
    assert_eq!(
        both.matches("listing runners failed").count(),
        1,
        "the error is printed exactly once: {out:?}"
    );
    assert!(
        out.stdout.contains("1 error(s), logged as they happened"),
        "{out:?}"
    );
    assert!(out.stderr.contains("is Forgejo listening"), "{out:?}");
    let last: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(env.state.join("last-run.json")).unwrap())
            .unwrap();
    assert_eq!(last["outcome"], "sweep_failed");
    assert_eq!(last["failures"].as_array().unwrap().len(), 1);
}

#[test]
fn a_verbose_dry_run_never_says_deleted() {
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/teardown-stale.json");
    for sub in ["run", "sweep"] {
        let mut c = std::process::Command::new(crate::support::harness::BIN);
        c.args([sub, "--dry-run", "-v", "--fixture"]).arg(&fixture);
        if sub == "run" {
            c.args(["--labels", "debian:host"]);
        } else {
            // The fixture has a cycle in progress, which a sweep refuses: take it out.
            let mut world: serde_json::Value =
                serde_json::from_str(&fs::read_to_string(&fixture).unwrap()).unwrap();
            world["cycle"] = serde_json::Value::Null;
            let tmp = std::env::temp_dir().join(format!("no-cycle-{}.json", std::process::id()));
            fs::write(&tmp, world.to_string()).unwrap();
            c = std::process::Command::new(crate::support::harness::BIN);
            c.args([sub, "--dry-run", "-v", "--fixture"]).arg(&tmp);
        }
        let out = c.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{sub}: {stderr}");
        assert!(
            stderr.contains("would delete offline runner 106"),
            "{sub}: {stderr}"
        );
        assert!(
            !stderr.contains("deleted offline runner"),
            "{sub}: {stderr}"
        );
        let plan = String::from_utf8_lossy(&out.stdout);
        assert!(
            plan.contains(
                "delete_runner runner_id=106 name=ephemeral-20261003t080000z-0b9e-1 reason=sweep"
            ),
            "{sub}: {plan}"
        );
    }
}

/// `tee /dev/stderr` (or `> /dev/stderr`) reopens whatever stderr is: with
/// `bash .ci/run > log 2>&1` that is the log, opened again at offset 0, and the lines written
/// before are overwritten (the log's first minutes became NUL bytes). `>&2` shares the
/// descriptor instead.
#[test]
fn ci_scripts_never_reopen_stderr_by_path() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut scripts: Vec<_> = fs::read_dir(root.join(".ci"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    scripts.extend(
        [
            "tests/role/role_e2e.sh",
            "benches/run",
            "benches/slots.sh",
            "tests/sim/mutations.sh",
        ]
        .iter()
        .map(|p| root.join(p))
        .filter(|p| p.exists()),
    );
    assert!(scripts.len() > 3, "{scripts:?}");
    for path in scripts {
        let text = fs::read_to_string(&path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split(" #").next().unwrap_or("");
            if code.trim_start().starts_with('#') {
                continue;
            }
            assert!(
                !code.contains("/dev/stderr") && !code.contains("/dev/stdout"),
                "{}:{}: writes to stderr by path (use >&2): {line}",
                path.display(),
                n + 1
            );
        }
    }
}
