//! The secrets check: full cycles at the most verbose log level, then a scan of everything the
//! binary printed, every file it (or tofu, or the launch command) wrote, and the argv and
//! environment that tofu (through a recording wrapper) and the launch command were given. The
//! Forgejo token and every runner token the fake issued must appear nowhere. A control plants a
//! token and sees the scan find it, so an empty result means something.

use std::fs;
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::fake_forgejo::Fault;
use crate::support::harness::{API_TOKEN, Env, Outcome, tofu_bin, walk};

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
        crate::support::fake_forgejo::Conn::NeverConnected,
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

// Mutation caught: the Authorization value logged at trace.
// Mutation caught: no redaction of a child's output.
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

// --- `--token-file -` and what a child of the binary can reach ------------------------------

/// The binary with `--token-file -` and `sub`'s flags, its output in files, its standard input
/// `stdin` (and `input` written to it when that is a pipe); waits at most 90 s.
fn run_with_stdin(env: &Env, mut c: Command, stdin: Stdio, input: Option<&[u8]>) -> Outcome {
    let tag = std::process::id();
    let out = env.tmp.path().join(format!("stdin-out-{tag}"));
    let err = env.tmp.path().join(format!("stdin-err-{tag}"));
    c.args(["--token-file", "-"]);
    c.stdout(fs::File::create(&out).unwrap());
    c.stderr(fs::File::create(&err).unwrap());
    c.stdin(stdin);
    let mut child = c.spawn().expect("spawn the binary");
    drop(c);
    if let Some(bytes) = input {
        let mut pipe = child.stdin.take().expect("a piped stdin");
        // A binary that refused before reading closes its end: EPIPE is its answer, not ours.
        let _ = pipe.write_all(bytes);
    }
    let status = wait_at_most(&mut child, Duration::from_secs(90), &err);
    Outcome {
        code: status.code(),
        stdout: fs::read_to_string(&out).unwrap_or_default(),
        stderr: fs::read_to_string(&err).unwrap_or_default(),
    }
}

fn wait_at_most(child: &mut Child, limit: Duration, stderr: &Path) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the binary hung; stderr:\n{}",
                fs::read_to_string(stderr).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Gives `dir` and everything below it to `uid`.
fn chown_tree(dir: &Path, uid: u32) {
    std::os::unix::fs::lchown(dir, Some(uid), Some(uid)).unwrap();
    for e in fs::read_dir(dir).unwrap().filter_map(|e| e.ok()) {
        let p = e.path();
        if e.file_type().unwrap().is_dir() {
            chown_tree(&p, uid);
        } else {
            std::os::unix::fs::lchown(&p, Some(uid), Some(uid)).unwrap();
        }
    }
}

fn script(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    fs::write(path, text).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

/// A probe report (tests/role/module/probe.sh): its `TRY` lines, whether it ran to its end, and
/// the provisioner it reached (`ANCESTOR <pid> ci-ephemeral-pr uid=U owner=O`), if any.
struct Probe {
    name: String,
    text: String,
}

impl Probe {
    fn tried(&self) -> usize {
        self.text.lines().filter(|l| l.starts_with("TRY ")).count()
    }

    fn finished(&self) -> bool {
        self.text.lines().any(|l| l.starts_with("END tried="))
    }

    /// (pid, uid, owner of /proc/pid/environ) of the provisioner among the ancestors.
    fn provisioner(&self) -> Option<(String, String, String)> {
        self.text.lines().find_map(|l| {
            let rest = l.strip_prefix("ANCESTOR ")?;
            let mut w = rest.split_whitespace();
            let pid = w.next()?.to_string();
            (w.next()? == "ci-ephemeral-pr").then_some(())?;
            let uid = w.next()?.strip_prefix("uid=")?.to_string();
            let owner = w.next()?.strip_prefix("owner=")?.to_string();
            Some((pid, uid, owner))
        })
    }

    /// The `TRY` line for `what`.
    fn line(&self, what: &str) -> Option<&str> {
        let prefix = format!("TRY {what} ");
        self.text.lines().find(|l| l.starts_with(&prefix))
    }
}

fn probes(dir: &Path) -> Vec<Probe> {
    let mut v: Vec<Probe> = walk(dir)
        .into_iter()
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            (n.starts_with("tofu.") || n.starts_with("launch."))
                && !n.ends_with(".part")
                && !n.ends_with(".data")
                && !n.ends_with(".err")
                && !n.ends_with(".list")
        })
        .map(|p| Probe {
            name: p.file_name().unwrap().to_string_lossy().into_owned(),
            text: fs::read_to_string(&p).unwrap(),
        })
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// Passed on to every child in the environment: the probes must find it.
const CANARY: &str = "c4n4ry5e1f7e5t0a9b8c";

/// The token comes on a pipe (`--token-file -`), and the children a cycle starts — tofu (behind
/// a wrapper) and the launch command — each run the hostile probe of the role's end-to-end test
/// (tests/role/module/probe.sh), as the binary's user (as root, the binary runs as nobody: root's
/// children could read anything): the binary's /proc/PID/environ, mem, fd/ and every fd that is a
/// file, their own environment and fd 0, every file of the state directory. The token is in
/// none of it, the binary's /proc files are root's although it runs as another user (it is not
/// dumpable), and each probe really got to the binary and tried what it should.
#[test]
fn with_the_token_on_stdin_no_child_can_reach_it() {
    let env = Env::new();
    let root = env.tmp.path();
    // This run has no token file: the token exists only on the pipe.
    fs::remove_file(&env.token_file).unwrap();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let probe = root.join("probe.sh");
    fs::copy(manifest.join("tests/role/module/probe.sh"), &probe).unwrap();
    let launch = root.join("launch.sh");
    fs::copy(manifest.join("tests/bin/launch.sh"), &launch).unwrap();
    let probe_dir = env.vm.join("probe");
    let tofu = root.join("probe-tofu.sh");
    script(
        &tofu,
        "#!/bin/sh\n# tofu behind the probe: its fd 0 and environment are the ones tofu gets\n\
         sh \"$PROBE_SH\" \"tofu-$1\" \"$VM_DIR/probe/tofu.$$\" \"$PROBE_STATE\" > /dev/null 2>&1\n\
         exec \"$TOFU_REAL\" \"$@\"\n",
    );
    let launch_probe = root.join("probe-launch.sh");
    script(
        &launch_probe,
        "#!/bin/sh\n# the probe, then the test launch command on the runner token (our stdin)\n\
         sh \"$PROBE_SH\" launch \"$VM_DIR/probe/launch.$RUNNER_ID\" \"$PROBE_STATE\" < /dev/null > /dev/null 2>&1\n\
         exec \"$PROBE_LAUNCH\"\n",
    );
    let mut c = env.cmd_with("run", false);
    c.args(["--tofu-bin", tofu.to_str().unwrap()]);
    c.args(["--launch-command", launch_probe.to_str().unwrap()]);
    c.env("TOFU_REAL", tofu_bin());
    c.env("PROBE_SH", &probe);
    c.env("PROBE_LAUNCH", &launch);
    c.env("PROBE_STATE", &env.state);
    c.env("HOME", root);
    c.env("TMPDIR", root);
    c.env("PROBE_CANARY", CANARY);
    let uid = if is_root() {
        use std::os::unix::process::CommandExt;
        chown_tree(root, 65534);
        c.uid(65534).gid(65534);
        65534
    } else {
        // SAFETY: getuid(2) cannot fail.
        unsafe { libc::getuid() }
    };
    env.fake.add_job(&["debian"]);
    let out = run_with_stdin(
        &env,
        c,
        Stdio::piped(),
        Some(format!("{API_TOKEN}\n").as_bytes()),
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    env.assert_at_rest();

    let found = probes(&probe_dir);
    let names: Vec<&str> = found.iter().map(|p| p.name.as_str()).collect();
    assert!(
        names.iter().any(|n| n.starts_with("tofu."))
            && names.iter().any(|n| n.starts_with("launch.")),
        "a probe did not run under tofu and under the launch command: {names:?}"
    );
    for p in &found {
        assert!(
            p.finished(),
            "{}: the probe did not finish:\n{}",
            p.name,
            p.text
        );
        let (pid, binary_uid, owner) = p.provisioner().unwrap_or_else(|| {
            panic!(
                "{}: the probe never reached the binary:\n{}",
                p.name, p.text
            )
        });
        assert_eq!(binary_uid, uid.to_string(), "{}", p.name);
        // Not dumpable: its /proc files are root's (proc(5)), so its user's children are refused.
        assert_eq!(
            owner, "0",
            "{}: /proc/{pid}/environ of the binary belongs to uid {owner}: it is dumpable",
            p.name
        );
        for what in ["environ", "mem", "fd/"] {
            let what = format!("/proc/{pid}/{what}");
            let line = p
                .line(&what)
                .unwrap_or_else(|| panic!("{}: {what} not tried", p.name));
            assert!(line.contains(" error "), "{}: {line}", p.name);
        }
        let state = p
            .text
            .lines()
            .filter(|l| l.starts_with(&format!("TRY {}", env.state.display())))
            .count();
        // The directory and at least cycle.json (and the lock) in it.
        assert!(
            state >= 3,
            "{}: the state directory was not walked:\n{}",
            p.name,
            p.text
        );
        assert!(
            p.tried() >= 15,
            "{}: only {} paths tried",
            p.name,
            p.tried()
        );
        if p.name.starts_with("tofu.") {
            // What tofu inherited as fd 0: /dev/null, nothing in it.
            assert_eq!(
                p.line("own fd 0"),
                Some("TRY own fd 0 ok 0 bytes"),
                "{}",
                p.name
            );
        }
    }
    let haystacks: Vec<(String, Vec<u8>)> = found
        .iter()
        .map(|p| (p.name.clone(), p.text.clone().into_bytes()))
        .collect();
    let secret = [("the Forgejo token".to_string(), API_TOKEN.to_string())];
    assert!(
        scan(&haystacks, &secret).is_empty(),
        "a probe read the Forgejo token: {:?}",
        scan(&haystacks, &secret)
    );
    // The control: what the probes could read is in their reports — the canary of the
    // environment the binary passed on, and the memory of the shell between it and the binary
    // (dumpable, unlike the binary) — so an empty scan means something.
    let canary = [("the canary".to_string(), CANARY.to_string())];
    for p in &found {
        let one = [(p.name.clone(), p.text.clone().into_bytes())];
        assert_eq!(scan(&one, &canary).len(), 1, "{}:\n{}", p.name, p.text);
        // (Yama's ptrace_scope 1 or more keeps every process out of its ancestors' memory.)
        let unrestricted = p.text.lines().any(|l| l == "YAMA none" || l == "YAMA 0");
        assert!(
            !unrestricted
                || p.text
                    .lines()
                    .any(|l| l.starts_with("TRY /proc/") && l.contains("/mem ok ")),
            "{}: no memory was readable at all, so the binary's refusal says nothing:\n{}",
            p.name,
            p.text
        );
    }
}

/// With the token file itself on standard input (as systemd's `StandardInput=file:` gives it),
/// the binary closes it as soon as it has read it: the last close of the file shows up
/// (inotify `IN_CLOSE_NOWRITE`) while the binary still runs, held in a slow request. Without the
/// dup2 it would stay open, inheritable, in /proc/PID/fd/0, until the binary exits.
#[test]
fn a_token_file_given_as_stdin_is_closed_right_after_it_was_read() {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let env = Env::new();
    env.fake.inject(
        "GET",
        "/actions/runners",
        Fault::Delay(Duration::from_millis(1500)),
        1,
    );
    let path = std::ffi::CString::new(env.token_file.to_str().unwrap()).unwrap();
    // SAFETY: plain syscalls on a fresh descriptor and a NUL-terminated path.
    let inotify = unsafe {
        let fd = libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC);
        assert!(fd >= 0);
        OwnedFd::from_raw_fd(fd)
    };
    let wd = unsafe {
        libc::inotify_add_watch(inotify.as_raw_fd(), path.as_ptr(), libc::IN_CLOSE_NOWRITE)
    };
    assert!(wd >= 0, "{}", std::io::Error::last_os_error());
    let closed = || {
        let mut buf = [0u8; 4096];
        // SAFETY: reads into a buffer of ours.
        let n = unsafe { libc::read(inotify.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        n > 0
    };
    let err = env.tmp.path().join("closed-err");
    let mut c = env.cmd_with("sweep", false);
    c.args(["--token-file", "-"]);
    c.stdout(Stdio::null());
    c.stderr(fs::File::create(&err).unwrap());
    c.stdin(fs::File::open(&env.token_file).unwrap());
    let mut child = c.spawn().expect("spawn the binary");
    // Our own copy of the descriptor goes with the Command: only the binary's is left.
    drop(c);
    let start = Instant::now();
    let mut closed_while_running = false;
    while child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(60) {
        // A close seen now, and the binary still there after it: it closed fd 0 itself.
        if closed() && child.try_wait().unwrap().is_none() {
            closed_while_running = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = wait_at_most(&mut child, Duration::from_secs(60), &err);
    let stderr = fs::read_to_string(&err).unwrap_or_default();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(
        closed_while_running,
        "the token file stayed open on the binary's fd 0 until it exited: {stderr}"
    );
    // The token was read and used.
    assert!(
        env.fake
            .requests()
            .iter()
            .all(|r| r.authorization.as_deref() == Some(&format!("token {API_TOKEN}"))),
        "{:?}",
        env.fake.requests()
    );
}

/// What comes on standard input is judged like a token file's content (empty, more than one
/// word, more than 64 KiB: exit 2, before any request), and a terminal is refused with what to
/// do instead.
#[test]
fn a_token_on_stdin_is_judged_like_a_file_and_a_terminal_is_refused() {
    let env = Env::new();
    let big = "a".repeat(70 * 1024);
    for (input, want) in [
        ("", "the token on standard input (--token-file -) is empty"),
        (" \n\t\n", "is empty"),
        (
            "abc def\n",
            "must hold only the token (one line, no spaces)",
        ),
        (big.as_str(), "more than 64 KiB"),
    ] {
        let out = run_with_stdin(
            &env,
            env.cmd_with("sweep", false),
            Stdio::piped(),
            Some(input.as_bytes()),
        );
        assert_eq!(out.code, Some(2), "{want}: {out:?}");
        assert!(out.stderr.contains(want), "{want}: {out:?}");
    }
    // A terminal: a pseudo-terminal's other end as stdin.
    // SAFETY: the usual posix_openpt sequence on descriptors of ours.
    let (master, slave) = unsafe {
        let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
        assert!(m >= 0);
        assert_eq!(libc::grantpt(m), 0);
        assert_eq!(libc::unlockpt(m), 0);
        let name = std::ffi::CStr::from_ptr(libc::ptsname(m)).to_owned();
        let s = libc::open(name.as_ptr(), libc::O_RDWR | libc::O_NOCTTY);
        assert!(s >= 0);
        (
            <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(m),
            fs::File::from(<std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(s)),
        )
    };
    let out = run_with_stdin(&env, env.cmd_with("sweep", false), Stdio::from(slave), None);
    drop(master);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr.contains("standard input, which is a terminal")
            && out.stderr.contains("--token-file - < FILE"),
        "{out:?}"
    );
    assert!(env.fake.requests().is_empty(), "Forgejo was asked");
    // The control: the token itself on a pipe works.
    let out = run_with_stdin(
        &env,
        env.cmd_with("sweep", false),
        Stdio::piped(),
        Some(format!("{API_TOKEN}\n").as_bytes()),
    );
    assert_eq!(out.code, Some(0), "{out:?}");
}

#[test]
fn check_says_where_a_token_on_stdin_came_from() {
    // The role's units hand the token over as standard input: `check` says so, rather than
    // claiming a token file that is "readable by this user only".
    let env = Env::new();
    let out = run_with_stdin(
        &env,
        env.cmd_with("check", false),
        Stdio::piped(),
        Some(format!("{API_TOKEN}\n").as_bytes()),
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let line = out
        .stdout
        .lines()
        .find(|l| l.contains("token file:"))
        .unwrap_or_else(|| panic!("no token file line: {out:?}"));
    assert!(
        line.starts_with("ok    ") && line.contains("read from standard input"),
        "{line}"
    );
    assert!(!out.stdout.contains(API_TOKEN) && !out.stderr.contains(API_TOKEN));
}

/// A descriptor the binary inherited without close-on-exec (a parent's file on fd 9: a token
/// file, say) is closed first thing in `main`: neither tofu nor the launch command has it. The
/// control: the same wrapper started the same way as the binary does have it.
#[test]
fn an_inherited_descriptor_reaches_no_child() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let env = Env::new();
    let root = env.tmp.path();
    let inherited = root.join("inherited-file");
    fs::write(&inherited, "not for children").unwrap();
    let file = fs::File::open(&inherited).unwrap();
    let raw = file.as_raw_fd();
    // On fd 9 without close-on-exec, as a careless parent would leave it.
    let with_fd_9 = |c: &mut Command| {
        // SAFETY: dup2(2) and fcntl(2) only, between fork and exec.
        unsafe {
            c.pre_exec(move || {
                // dup2 onto itself keeps close-on-exec, so clear it explicitly: the file may
                // already be fd 9.
                if libc::dup2(raw, 9) < 0 || libc::fcntl(9, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    };
    // Each child writes where each of its descriptors leads, then does its work.
    let list = "for f in /proc/$$/fd/*; do readlink \"$f\"; done";
    let tofu = root.join("fd-tofu.sh");
    script(
        &tofu,
        &format!("#!/bin/sh\n({list}) > \"$VM_DIR/fds.tofu.$$\"\nexec \"$TOFU_REAL\" \"$@\"\n"),
    );
    let launch = root.join("fd-launch.sh");
    script(
        &launch,
        &format!(
            "#!/bin/sh\n({list}) > \"$VM_DIR/fds.launch.${{RUNNER_ID:-control}}\"\nexec \"$LAUNCH\"\n"
        ),
    );
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut c = env.cmd("run");
    c.args(["--tofu-bin", tofu.to_str().unwrap()]);
    c.args(["--launch-command", launch.to_str().unwrap()]);
    c.env("TOFU_REAL", tofu_bin());
    c.env("LAUNCH", manifest.join("tests/bin/launch.sh"));
    with_fd_9(&mut c);
    env.fake.add_job(&["debian"]);
    let out = env.exec(c);
    assert_eq!(out.code, Some(0), "{out:?}");
    env.assert_at_rest();
    let listings: Vec<(String, String)> = fs::read_dir(&env.vm)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("fds."))
        .map(|n| (n.clone(), fs::read_to_string(env.vm.join(&n)).unwrap()))
        .collect();
    assert!(
        listings.iter().any(|(n, _)| n.starts_with("fds.tofu."))
            && listings.iter().any(|(n, _)| n.starts_with("fds.launch.")),
        "{listings:?}"
    );
    let shown = inherited.display().to_string();
    for (name, text) in &listings {
        assert!(!text.contains(&shown), "{name} inherited it:\n{text}");
    }
    // The control: started with fd 9 by something that does not close it, the wrapper has it.
    let mut c = Command::new(&launch);
    c.env("VM_DIR", &env.vm).env("LAUNCH", "/bin/true");
    with_fd_9(&mut c);
    assert!(c.status().unwrap().success());
    let control = fs::read_to_string(env.vm.join("fds.launch.control")).unwrap();
    assert!(control.contains(&shown), "{control}");
    drop(file);
}

/// `--store pg`: the database's password (in `PG_CONN_STR`) appears in nothing the binary
/// printed, wrote or passed on, but for tofu's environment (its pg backend needs it; the test
/// module's `vm.sh` records it as `tofu-env.*`): not in
/// the launch command's environment, logs, reports, `status`, `check`, events or errors, also
/// when the database refuses the password (a wrong one that holds the right one) or is not there.
// Mutation caught: the launch command given PG_CONN_STR (scrub_env keeps the database's variables).
#[test]
#[ignore = "needs PostgreSQL: bash .ci/pg runs it"]
fn the_database_password_appears_nowhere_but_in_tofus_environment() {
    let db = crate::store::Db::new();
    let env = wrapped_env();
    fs::write(
        env.module.join("backend.tf"),
        "terraform {\n  backend \"pg\" {}\n}\n",
    )
    .unwrap();
    let userinfo = db
        .url
        .split_once("://")
        .unwrap()
        .1
        .split_once('@')
        .unwrap()
        .0;
    let password = userinfo.split_once(':').unwrap().1.to_string();
    assert!(password.len() >= 12, "a password the scan can find");
    let pg = |c: &mut Command, url: &str| {
        c.args(["--store", "pg", "--pool", "p", "--host-id", "h", "-v"]);
        c.env("PG_CONN_STR", url);
        c.env(
            "RUST_LOG",
            "trace,ureq=trace,ureq_proto=trace,rustls=trace,tokio_postgres=trace,postgres=trace",
        );
        c.env("TOFU_REAL", tofu_bin());
    };
    env.fake.add_job(&["debian"]);
    let mut outs = Vec::new();
    for sub in ["run", "status", "check", "sweep"] {
        let mut c = env.cmd(sub);
        pg(&mut c, &db.url);
        outs.push(env.exec(c));
    }
    assert_eq!(outs[0].code, Some(0), "{:?}", outs[0]);
    assert_eq!(outs[2].code, Some(0), "{:?}", outs[2]);
    let wrong = db.url.replacen(&password, &format!("{password}x"), 1);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (head, tail) = db.url.split_once('@').unwrap();
    let nowhere = format!(
        "{head}@127.0.0.1:{port}/{}",
        tail.split_once('/').unwrap().1
    );
    for url in [&wrong, &nowhere] {
        for sub in ["run", "status", "check"] {
            let mut c = env.cmd(sub);
            pg(&mut c, url);
            if sub == "status" {
                c.arg("--check");
            }
            let out = env.exec(c);
            assert_ne!(out.code, Some(0), "{sub} with a bad database: {out:?}");
            outs.push(out);
        }
    }
    assert!(env.live_vms().is_empty(), "{}", env.vm_log());
    let all = haystacks(&env, &outs);
    let (tofu_env, rest): (Vec<_>, Vec<_>) = all
        .into_iter()
        .partition(|(n, _)| n.contains("tofu-wrapper-env.") || n.contains("/tofu-env."));
    let secret = vec![("the database password".to_string(), password.clone())];
    assert!(
        !scan(&tofu_env, &secret).is_empty(),
        "tofu was not given PG_CONN_STR: {:?}",
        tofu_env.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    assert!(
        rest.iter().any(|(n, _)| n.contains("launch-env.")),
        "the launch command's environment was recorded"
    );
    let found = scan(&rest, &secret);
    assert!(
        found.is_empty(),
        "the database password found in: {found:?}"
    );
}
