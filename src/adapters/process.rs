//! Running a child (tofu, the launch command): own process group, secrets only on stdin,
//! output captured, SIGINT forwarded once on a stop, SIGKILL to the group on timeout.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::adapters::signals::StopFlag;
use crate::core::secret::Secret;

/// Stdout kept from a child (tofu output -json of a large module stays well below this).
const MAX_STDOUT: usize = 8 * 1024 * 1024;

/// The tail of stderr kept for error messages.
const STDERR_TAIL: usize = 4 * 1024;

/// Closes every descriptor above 2 that this process inherited: done first in `main`, before
/// anything of ours is open, so that a child (tofu, a provider, the launch command) gets only
/// what we pass it — never a descriptor some parent left open without close-on-exec (a token
/// file's, a socket). `close_range(3, ~0, 0)`; where it fails (a kernel before 5.9, a seccomp
/// filter), each descriptor /proc/self/fd lists. The error says why the process refuses to run.
/// The descriptors below `first` (at least 3) are kept: `hook` keeps the connection its socket
/// unit passes as fd 3.
pub fn close_inherited_fds_from(first: libc::c_uint) -> anyhow::Result<()> {
    let first = first.max(3);
    // SAFETY: close_range(2) takes integers and touches no memory; nothing above fd 2 is ours
    // yet (std opens nothing before `main`).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first,
            libc::c_uint::MAX,
            0 as libc::c_uint,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let why = std::io::Error::last_os_error();
    // The listing's own descriptor is closed once `collect` returns; closing its number again
    // is an EBADF, and nothing else is opened in between.
    let fds: Vec<libc::c_int> = std::fs::read_dir("/proc/self/fd")
        .and_then(|d| d.map(|e| e.map(|e| e.file_name())).collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot close the descriptors this process inherited: close_range failed ({why}) and /proc/self/fd cannot be read ({e}); refusing to run, since a child would inherit them"
            )
        })?
        .iter()
        .filter_map(|n| n.to_str()?.parse().ok())
        .filter(|fd| *fd >= first as libc::c_int)
        .collect();
    for fd in fds {
        // SAFETY: close(2) of a descriptor number; none of them is in use by this process.
        unsafe { libc::close(fd) };
    }
    Ok(())
}

/// Variables never passed to a child: the credentials directory holds the Forgejo token, and our
/// own configuration variables are none of the child's business. The database's (`PG_CONN_STR`
/// with its password, `PG_SCHEMA_NAME`, libpq's `PGPASSWORD` and the like) only to tofu, whose
/// pg backend needs them (`database`).
pub fn scrub_env(cmd: &mut Command, database: bool) {
    for (key, _) in std::env::vars_os() {
        let k = key.to_string_lossy();
        let db = k.starts_with("PG_")
            || (k.starts_with("PG") && k[2..].starts_with(|c: char| c.is_ascii_uppercase()));
        if k == "CREDENTIALS_DIRECTORY"
            || k.starts_with("CI_EPHEMERAL_PROVISIONER_")
            || (db && !database)
        {
            cmd.env_remove(&key);
        }
    }
}

/// Whether `program` names an executable file: a path as it is, a bare name looked up on PATH.
pub fn find_executable(program: &std::path::Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.components().count() > 1 || program.is_absolute() {
        return executable(program).then(|| program.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| executable(candidate))
}

pub struct ChildSpec {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
    pub stdin: Option<Secret>,
    pub timeout: Option<Duration>,
    /// The child is tofu, whose pg backend gets the database's variables (`scrub_env`).
    pub database: bool,
}

#[derive(Debug)]
pub struct ChildResult {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr_tail: String,
    /// A stop was requested while it ran; it was sent SIGINT.
    pub interrupted: bool,
    /// It ran past this timeout (`ChildSpec::timeout`); its process group was killed.
    pub timed_out: Option<Duration>,
    /// False when a stop was requested before it could be started.
    pub started: bool,
}

impl ChildResult {
    pub fn success(&self) -> bool {
        self.status.success() && self.timed_out.is_none()
    }

    /// `exit status 1`, `killed by signal 9`, with the stderr tail.
    pub fn describe(&self) -> String {
        let how = self.how();
        let tail = self.stderr_tail.trim();
        if tail.is_empty() {
            how
        } else {
            format!("{how}; stderr ends with: {}", last_lines(tail, 6))
        }
    }

    /// [`describe`](Self::describe), but from the first line of stderr that starts with
    /// `heading` (tofu's `Error:`, also inside its `│` box) when there is one: up to `max`
    /// lines from there, so the heading that says what failed is never cut off.
    pub fn describe_from(&self, heading: &str, max: usize) -> String {
        let lines: Vec<&str> = self
            .stderr_tail
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect();
        let starts = |l: &&str| l.trim_start_matches(['│', ' ']).starts_with(heading);
        match lines.iter().position(starts) {
            Some(i) => format!(
                "{}; stderr from its {heading:?} on: {}",
                self.how(),
                lines[i..lines.len().min(i + max)].join(" | ")
            ),
            None => self.describe(),
        }
    }

    /// How it ended: `exited with status 1`, `killed by signal 9`, …
    fn how(&self) -> String {
        if !self.started {
            "was not started: a stop was requested".to_string()
        } else if let Some(limit) = self.timed_out {
            format!(
                "timed out after {} and was killed",
                crate::core::time::format_duration(limit)
            )
        } else if let Some(code) = self.status.code() {
            format!("exited with status {code}")
        } else if let Some(sig) = self.status.signal() {
            format!("was killed by signal {sig}")
        } else {
            "ended abnormally".to_string()
        }
    }
}

fn last_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(n);
    lines[start..].join(" | ")
}

/// How long output is still read after the child exited. A background process it left behind
/// (an ssh ControlPersist master, say) may hold the pipes open for good; the run must not wait
/// for it.
const OUTPUT_GRACE: Duration = Duration::from_secs(2);

/// Replaces every occurrence of `secret` in `bytes` with `***`.
fn redact(bytes: &[u8], secret: &str) -> Vec<u8> {
    let needle = secret.as_bytes();
    if needle.is_empty() || bytes.len() < needle.len() {
        return bytes.to_vec();
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i..].starts_with(needle) {
            out.extend_from_slice(b"***");
            i += needle.len();
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    out
}

/// What a reader thread has collected: the bytes kept, and whether some were dropped.
#[derive(Default)]
struct Captured {
    bytes: Vec<u8>,
    truncated: bool,
}

/// Reads a pipe into a shared buffer, keeping at most `cap` bytes (the first ones when
/// `keep_head`, else the last ones), and drains the rest so the child never blocks on a full
/// pipe.
fn reader(
    mut pipe: impl Read + Send + 'static,
    cap: usize,
    keep_head: bool,
) -> (Arc<Mutex<Captured>>, thread::JoinHandle<()>) {
    let buf = Arc::new(Mutex::new(Captured::default()));
    let shared = Arc::clone(&buf);
    let handle = thread::spawn(move || {
        let mut chunk = [0u8; 8192];
        loop {
            match pipe.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let Ok(mut c) = shared.lock() else { break };
                    if keep_head {
                        let room = cap.saturating_sub(c.bytes.len());
                        c.bytes.extend_from_slice(&chunk[..n.min(room)]);
                        c.truncated |= n > room;
                    } else {
                        c.bytes.extend_from_slice(&chunk[..n]);
                        if c.bytes.len() > cap {
                            let excess = c.bytes.len() - cap;
                            c.bytes.drain(..excess);
                            c.truncated = true;
                        }
                    }
                }
            }
        }
    });
    (buf, handle)
}

/// The captured bytes with `secret` replaced, and with the partial line at a cut removed (a
/// secret cut in half would no longer match, so it must not survive either).
fn finish_capture(
    buf: &Arc<Mutex<Captured>>,
    secret: Option<&Secret>,
    keep_head: bool,
    cap: usize,
) -> Vec<u8> {
    let Ok(mut c) = buf.lock() else {
        return Vec::new();
    };
    let mut bytes = std::mem::take(&mut c.bytes);
    let mut truncated = c.truncated;
    if let Some(secret) = secret {
        bytes = redact(&bytes, secret.expose());
    }
    if bytes.len() > cap {
        truncated = true;
        if keep_head {
            bytes.truncate(cap);
        } else {
            bytes.drain(..bytes.len() - cap);
        }
    }
    if truncated {
        if keep_head {
            let end = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
            bytes.truncate(end);
        } else {
            let start = bytes
                .iter()
                .position(|b| *b == b'\n')
                .map_or(bytes.len(), |i| i + 1);
            bytes.drain(..start);
        }
    }
    bytes
}

pub fn run_child(spec: &ChildSpec, stop: &StopFlag) -> std::io::Result<ChildResult> {
    if stop.is_raised() {
        // Never start a child once a stop was requested.
        return Ok(ChildResult {
            status: ExitStatus::from_raw(libc::SIGINT),
            stdout: Vec::new(),
            stderr_tail: String::new(),
            interrupted: true,
            timed_out: None,
            started: false,
        });
    }
    let mut child = spawn(spec)?;
    let pid = child.id() as libc::pid_t;
    crate::crash_point!("process-child-spawned", pid);
    feed_stdin(spec, &mut child);

    let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) else {
        if let Err(e) = child.kill() {
            log::warn!("cannot kill the child whose pipes were not set up: {e}");
        }
        if let Err(e) = child.wait() {
            log::warn!("cannot reap the child whose pipes were not set up: {e}");
        }
        return Err(std::io::Error::other(
            "the child's output pipes were not set up",
        ));
    };
    // Room beyond the caps, so a secret across the cut is still whole when it is redacted.
    let slack = spec.stdin.as_ref().map_or(0, |s| s.expose().len());
    let (out_buf, out_thread) = reader(out, MAX_STDOUT + slack, true);
    let (err_buf, err_thread) = reader(err, STDERR_TAIL + slack, false);

    let ended = wait_for(spec, stop, &mut child, pid)?;
    let exited = Instant::now();
    while !(out_thread.is_finished() && err_thread.is_finished()) && exited.elapsed() < OUTPUT_GRACE
    {
        thread::sleep(Duration::from_millis(10));
    }
    if !(out_thread.is_finished() && err_thread.is_finished()) {
        log::debug!(
            "{} exited but something it started still holds its output open; not waiting for it",
            spec.program.display()
        );
    }
    // What the child echoed of its stdin never reaches our logs or reports.
    let stdout = finish_capture(&out_buf, spec.stdin.as_ref(), true, MAX_STDOUT);
    let stderr = finish_capture(&err_buf, spec.stdin.as_ref(), false, STDERR_TAIL);
    Ok(ChildResult {
        status: ended.status,
        stdout,
        stderr_tail: String::from_utf8_lossy(&stderr).into_owned(),
        interrupted: ended.interrupted,
        timed_out: spec.timeout.filter(|_| ended.timed_out),
        started: true,
    })
}

/// Starts the child with a scrubbed environment, in its own process group, its output piped.
fn spawn(spec: &ChildSpec) -> std::io::Result<std::process::Child> {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args);
    scrub_env(&mut cmd, spec.database);
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    // Own process group: a terminal's Ctrl-C reaches only us, and we forward exactly one SIGINT
    // (a second SIGINT would make tofu abandon its work).
    cmd.process_group(0);
    // SIGINT's default action, even when this process was started with it ignored (a shell's
    // background job): else the one SIGINT forwarded would reach no trap of the child's.
    // SAFETY: signal() is async-signal-safe, the only call between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    cmd.stdin(if spec.stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    cmd.stdout(Stdio::piped());
    cmd.stderr(Stdio::piped());
    cmd.spawn()
}

/// Writes the secret as one line to the child's stdin and closes it.
fn feed_stdin(spec: &ChildSpec, child: &mut std::process::Child) {
    if let (Some(secret), Some(mut stdin)) = (&spec.stdin, child.stdin.take()) {
        // A child that exits without reading makes this fail with EPIPE, which its exit status
        // then explains.
        let line = Secret::new(format!("{}\n", secret.expose()));
        if let Err(e) = stdin.write_all(line.expose().as_bytes()) {
            log::debug!("writing to the child's stdin failed: {e}");
        }
        drop(stdin);
    }
}

/// How the wait for a child ended.
struct Ended {
    status: ExitStatus,
    interrupted: bool,
    timed_out: bool,
}

/// Waits for the child: a stop is forwarded as one SIGINT, a timeout kills its process group.
fn wait_for(
    spec: &ChildSpec,
    stop: &StopFlag,
    child: &mut std::process::Child,
    pid: libc::pid_t,
) -> std::io::Result<Ended> {
    let started = Instant::now();
    let mut interrupted = false;
    let mut timed_out = false;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Ended {
                status,
                interrupted,
                timed_out,
            });
        }
        if stop.is_raised() && !interrupted {
            interrupted = true;
            log::warn!(
                "stop requested: sending SIGINT to {} and waiting for it",
                spec.program.display()
            );
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid, libc::SIGINT) };
        }
        if let Some(limit) = spec.timeout
            && !timed_out
            && started.elapsed() > limit
        {
            timed_out = true;
            // SAFETY: kill(2) on the process group we created for this child.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> ChildSpec {
        ChildSpec {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![],
            stdin: None,
            timeout: None,
            database: false,
        }
    }

    #[test]
    fn a_description_from_a_heading_keeps_it_however_long_the_rest() {
        let r = run_child(
            &sh("printf '╷\\n│ Warning: x\\n╵\\n\\nError: Unsupported argument\\n\\n  on main.tf line 3\\na\\nb\\nc\\nd\\ne\\nf\\n' >&2; exit 1"),
            &StopFlag::new(),
        )
        .unwrap();
        assert!(!r.describe().contains("Error:"), "{}", r.describe());
        let d = r.describe_from("Error:", 8);
        assert_eq!(
            d,
            "exited with status 1; stderr from its \"Error:\" on: Error: Unsupported argument |   on main.tf line 3 | a | b | c | d | e | f"
        );
        let boxed = run_child(
            &sh("printf 'x\\n│ Error: boxed\\n│ y\\n' >&2; exit 1"),
            &StopFlag::new(),
        )
        .unwrap();
        assert!(
            boxed
                .describe_from("Error:", 1)
                .ends_with(": │ Error: boxed"),
            "{}",
            boxed.describe_from("Error:", 1)
        );
        let none = run_child(&sh("echo plain >&2; exit 2"), &StopFlag::new()).unwrap();
        assert_eq!(none.describe_from("Error:", 8), none.describe());
    }

    #[test]
    fn executables_are_found_on_path_or_by_path() {
        assert!(find_executable(std::path::Path::new("sh")).is_some());
        assert!(find_executable(std::path::Path::new("/bin/sh")).is_some());
        assert!(find_executable(std::path::Path::new("no-such-tool-ever")).is_none());
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("script");
        std::fs::write(&f, "#!/bin/sh\n").unwrap();
        assert!(find_executable(&f).is_none(), "not executable");
        assert!(find_executable(dir.path()).is_none(), "a directory");
    }

    #[test]
    fn captures_output_and_status() {
        let r = run_child(&sh("echo out; echo err >&2; exit 3"), &StopFlag::new()).unwrap();
        assert_eq!(r.status.code(), Some(3));
        assert_eq!(r.stdout, b"out\n");
        assert!(r.describe().contains("status 3") && r.describe().contains("err"));
    }

    #[test]
    fn secret_goes_to_stdin_only() {
        let mut spec = sh("read line; test \"$line\" = s3cret && test -z \"$(env | grep s3cret)\"");
        spec.stdin = Some(Secret::new("s3cret".into()));
        let r = run_child(&spec, &StopFlag::new()).unwrap();
        assert!(r.success(), "{}", r.describe());
    }

    #[test]
    fn a_background_process_holding_the_pipes_does_not_block() {
        // The child exits at once but leaves a process that keeps stdout/stderr open for 30 s.
        let started = Instant::now();
        let r = run_child(&sh("echo started; sleep 30 & exit 0"), &StopFlag::new()).unwrap();
        assert!(r.success());
        assert_eq!(r.stdout, b"started\n");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "waited for the background process"
        );
    }

    #[test]
    fn what_the_child_echoes_of_its_secret_is_redacted() {
        let mut spec = sh("read t; echo \"connecting with $t\"; echo \"token=$t\" >&2; exit 3");
        spec.stdin = Some(Secret::new(
            "0123456789abcdef0123456789abcdef01234567".into(),
        ));
        let r = run_child(&spec, &StopFlag::new()).unwrap();
        let all = format!("{} {}", String::from_utf8_lossy(&r.stdout), r.describe());
        assert!(!all.contains("0123456789abcdef"), "{all}");
        assert!(
            all.contains("connecting with ***") && all.contains("token=***"),
            "{all}"
        );
    }

    #[test]
    fn a_secret_cut_by_the_tail_limit_does_not_survive_in_part() {
        let secret = "0123456789abcdef0123456789abcdef01234567";
        // The secret, then filler so that the kept tail starts at various places in the secret.
        for filler in [
            STDERR_TAIL - 35,
            STDERR_TAIL - 5,
            STDERR_TAIL - 39,
            STDERR_TAIL,
        ] {
            let mut spec = sh(&format!(
                "read t; printf '%s' \"$t\" >&2; head -c {filler} /dev/zero | tr '\\0' x >&2; exit 3"
            ));
            spec.stdin = Some(Secret::new(secret.into()));
            let r = run_child(&spec, &StopFlag::new()).unwrap();
            let d = r.describe();
            for cut in 0..secret.len() - 8 {
                assert!(!d.contains(&secret[cut..cut + 8]), "filler {filler}: {d}");
            }
        }
    }

    #[test]
    fn nothing_is_started_once_a_stop_was_requested() {
        let stop = StopFlag::new();
        stop.raise();
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("ran");
        let r = run_child(&sh(&format!("touch {}", marker.display())), &stop).unwrap();
        assert!(r.interrupted && !r.started && !r.success());
        assert!(!marker.exists());
        assert!(r.describe().contains("not started"));
    }

    #[test]
    fn timeout_kills_the_group() {
        // A background grandchild with a command line nothing else on the machine has.
        let mut spec = sh("sleep 30.4217 & sleep 30");
        spec.timeout = Some(Duration::from_millis(200));
        let r = run_child(&spec, &StopFlag::new()).unwrap();
        assert!(r.timed_out.is_some() && !r.success());
        assert!(
            r.describe()
                .starts_with("timed out after 200ms and was killed"),
            "{}",
            r.describe()
        );
        std::thread::sleep(Duration::from_millis(100));
        let left = Command::new("pgrep")
            .args(["-f", "sleep 30.4217"])
            .output()
            .unwrap();
        assert!(left.stdout.is_empty(), "the whole process group is killed");
    }

    // Mutation caught: spawn without the reset of SIGINT (the child inherited it ignored).
    #[test]
    fn a_child_gets_sigints_default_action_even_when_this_process_ignores_it() {
        // SAFETY: swaps the process's SIGINT disposition and puts it back.
        let old = unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
        let r = run_child(&sh("grep SigIgn /proc/self/status"), &StopFlag::new());
        unsafe { libc::signal(libc::SIGINT, old) };
        let text = String::from_utf8(r.unwrap().stdout).unwrap();
        let mask = u64::from_str_radix(text.split_whitespace().last().unwrap(), 16).unwrap();
        assert_eq!(mask & (1 << (libc::SIGINT - 1)), 0, "{text}");
    }

    #[test]
    fn stop_forwards_sigint() {
        let stop = StopFlag::new();
        let later = stop.clone();
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("trapped");
        let seen = ready.clone();
        // Raised once the shell has installed its trap (it says so with a file).
        // (Raised after 60 s in any case: a shell that never says so fails the test, not hangs.)
        std::thread::spawn(move || {
            let start = Instant::now();
            while !seen.exists() && start.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(20));
            }
            later.raise();
        });
        let spec = sh(&format!(
            "trap 'echo got-int; exit 7' INT; : > '{}'; while :; do sleep 0.05; done",
            ready.display()
        ));
        let r = run_child(&spec, &stop).unwrap();
        assert!(r.interrupted);
        assert_eq!(r.status.code(), Some(7));
        assert_eq!(r.stdout, b"got-int\n");
    }
}
