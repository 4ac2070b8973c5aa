//! The secrets check: full cycles at the most verbose log level, then a scan of everything the
//! binary printed, every file it (or tofu, or the launch command) wrote, and the argv and
//! environment that tofu (through a recording wrapper) and the launch command were given. The
//! Forgejo token and every runner token the fake issued must appear nowhere. A control plants a
//! token and sees the scan find it, so an empty result means something.

mod support;

use std::fs;
use std::path::Path;

use support::fake_forgejo::Fault;
use support::harness::{API_TOKEN, Env, Outcome, tofu_bin, walk};

/// Where a secret was found: `(haystack name, which secret)`. Any 12 characters of a secret count
/// (a hex dump or a wrapped log line splits it).
fn scan(haystacks: &[(String, Vec<u8>)], secrets: &[(String, String)]) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for (name, bytes) in haystacks {
        let text = String::from_utf8_lossy(bytes);
        for (label, secret) in secrets {
            if secret
                .as_bytes()
                .windows(12.min(secret.len()))
                .any(|w| text.contains(std::str::from_utf8(w).unwrap()))
            {
                found.push((name.clone(), label.clone()));
            }
        }
    }
    found
}

/// Everything to scan after the runs: their output, and every file under the state, module and
/// VM directories (the VM's own token files excepted: `runners/<uuid>` is the runner's token on
/// the VM, where the launch command puts it by design; launch.sh removes it after its job).
fn haystacks(env: &Env, outs: &[Outcome]) -> Vec<(String, Vec<u8>)> {
    let mut h = Vec::new();
    for (i, o) in outs.iter().enumerate() {
        h.push((format!("run {i} stdout"), o.stdout.clone().into_bytes()));
        h.push((format!("run {i} stderr"), o.stderr.clone().into_bytes()));
    }
    for dir in [&env.state, &env.module, &env.vm] {
        for p in walk(dir) {
            if p.parent().is_some_and(|d| d.ends_with("runners")) {
                continue;
            }
            h.push((p.display().to_string(), fs::read(&p).unwrap()));
        }
    }
    h
}

fn secrets(env: &Env) -> Vec<(String, String)> {
    let mut s = vec![("the Forgejo token".to_string(), API_TOKEN.to_string())];
    for (i, t) in env.fake.issued_tokens().into_iter().enumerate() {
        s.push((format!("runner token #{i}"), t));
    }
    s
}

/// A run at the most verbose level, with tofu behind the recording wrapper and the token from a
/// systemd credentials directory as well as the flag.
fn verbose_run(env: &Env, extra: &[&str]) -> Outcome {
    let mut c = env.cmd("run");
    c.args(["-v", "--output", "json"]);
    c.args(extra);
    c.env(
        "RUST_LOG",
        "trace,ureq=trace,ureq_proto=trace,ureq_proto::util=trace,rustls=trace",
    );
    c.env("RUST_BACKTRACE", "1");
    c.env("CREDENTIALS_DIRECTORY", env.tmp.path());
    c.env("TOFU_REAL", tofu_bin());
    env.exec(c)
}

fn wrapped_env() -> Env {
    let mut env = Env::new();
    env.tofu = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/bin/tofu-wrapper.sh")
        .to_string_lossy()
        .into_owned();
    // `CREDENTIALS_DIRECTORY` (set in `verbose_run`) holds the same file as `--token-file`.
    assert_eq!(env.token_file, env.tmp.path().join("forgejo-token"));
    env
}

/// Several cycles through every path that handles a token: runners that run their job, one whose
/// POST answer is lost (found by name and deleted), one that never connects (deleted after the
/// grace), a launch command that prints its token on stdout and stderr and fails, a stale
/// registration swept.
fn run_everything(env: &Env) -> Vec<Outcome> {
    let mut outs = Vec::new();
    env.fake.add_job(&["debian"]);
    env.fake.add_job(&["debian"]);
    env.fake.add_runner(
        "ephemeral-stale",
        true,
        support::fake_forgejo::Conn::NeverConnected,
    );
    env.fake
        .inject("POST", "/actions/runners", Fault::ApplyThenDrop, 1);
    outs.push(verbose_run(env, &[]));
    env.set_launch_mode("noop");
    env.fake.add_job(&["debian"]);
    outs.push(verbose_run(env, &["--max-jobs-per-vm", "1"]));
    env.set_launch_mode("leak");
    outs.push(verbose_run(env, &[]));
    env.set_launch_mode("one-job");
    outs.push(verbose_run(env, &[]));
    outs.push(verbose_run(env, &[]));
    outs
}

#[test]
fn no_token_appears_in_anything_the_binary_printed_wrote_or_passed_on() {
    let env = wrapped_env();
    let outs = run_everything(&env);
    env.assert_at_rest();
    let all = haystacks(&env, &outs);
    // The scan saw what it should: trace output, the wrapper's and launch command's records.
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    for want in [
        "tofu-wrapper-argv.",
        "tofu-wrapper-env.",
        "launch-env.",
        "launch-argv.",
        "last-run.json",
    ] {
        assert!(
            names.iter().any(|n| n.contains(want)),
            "nothing named {want}: {names:?}"
        );
    }
    assert!(
        outs.iter().any(|o| o.stderr.contains("DEBUG")),
        "the most verbose logging took effect"
    );
    let secrets = secrets(&env);
    assert!(
        secrets.len() >= 6,
        "runner tokens issued: {}",
        secrets.len() - 1
    );
    let found = scan(&all, &secrets);
    assert!(found.is_empty(), "secrets found: {found:?}");
    // The leaking launch command's output reached the report, redacted.
    assert!(
        outs.iter().any(|o| o.stdout.contains("runner token: ***")),
        "the leaking launch command's output is in a report: {:?}",
        outs[2]
    );
}

/// The control: the same scan finds a token planted where the real check looks.
#[test]
fn the_scan_finds_a_planted_token() {
    let env = wrapped_env();
    env.fake.add_job(&["debian"]);
    let out = verbose_run(&env, &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let secrets = secrets(&env);
    assert!(scan(&haystacks(&env, &[out]), &secrets).is_empty());
    let runner_token = &secrets[1].1;
    // Part of a runner token in the environment the launch command recorded.
    let launch_env = walk(&env.vm)
        .into_iter()
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("launch-env.")
        })
        .unwrap();
    let mut text = fs::read_to_string(&launch_env).unwrap();
    text.push_str(&format!("LEAK={}\n", &runner_token[5..20]));
    fs::write(&launch_env, text).unwrap();
    let found = scan(&haystacks(&env, &[]), &secrets);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].1, secrets[1].0);
    // And the Forgejo token in a stderr.
    let fake_out = Outcome {
        code: Some(0),
        stdout: String::new(),
        stderr: format!("Authorization: token {}", &API_TOKEN[..14]),
    };
    let found = scan(&haystacks(&env, &[fake_out]), &secrets);
    assert!(
        found
            .iter()
            .any(|(n, s)| n == "run 0 stderr" && s == "the Forgejo token"),
        "{found:?}"
    );
}

/// The token file is judged by the handle it is read through: a file readable by the group, a
/// symlink (even to a good file), a file of another user, a FIFO (without hanging) or a directory
/// are each refused with exit 2 and a message that says what to fix, before any request.
#[test]
fn a_token_file_that_is_not_ours_private_and_plain_is_refused_with_exit_2() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let dir = env.tmp.path();
    let file = |name: &str, mode: u32| {
        let p = dir.join(name);
        fs::write(&p, format!("{API_TOKEN}\n")).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        p
    };
    let group_readable = file("group-readable", 0o640);
    let link = dir.join("link-to-good");
    std::os::unix::fs::symlink(&env.token_file, &link).unwrap();
    let fifo = dir.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let directory = dir.join("directory");
    fs::create_dir(&directory).unwrap();
    fs::set_permissions(&directory, fs::Permissions::from_mode(0o700)).unwrap();
    let mut cases = vec![
        (group_readable, "chmod 600"),
        (link, "point --token-file at the file itself"),
        (fifo, "is a FIFO"),
        (directory, "is a directory"),
    ];
    if unsafe { libc::geteuid() } == 0 {
        let theirs = file("theirs", 0o600);
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        cases.push((theirs, "chown"));
    }
    for (path, fix) in cases {
        for sub in ["run", "sweep"] {
            let mut c = env.cmd_with(sub, false);
            c.args(["--token-file", path.to_str().unwrap()]);
            let out = env.exec(c);
            assert_eq!(out.code, Some(2), "{}, {sub}: {out:?}", path.display());
            assert!(
                out.stderr.contains(path.to_str().unwrap()) && out.stderr.contains(fix),
                "{}, {sub}: wants {fix:?}: {out:?}",
                path.display()
            );
            assert!(!out.stderr.contains(&API_TOKEN[..12]), "{out:?}");
        }
    }
    assert!(env.fake.requests().is_empty(), "Forgejo was asked");
    // The control: the good file itself is read.
    let out = env.exec(env.cmd("sweep"));
    assert_eq!(out.code, Some(0), "{out:?}");
}
