//! Running a child (tofu, the launch command): own process group, secrets only on stdin,
//! output captured, SIGINT forwarded once on a stop, SIGKILL to the group on timeout.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::secret::Secret;
use crate::signals::StopFlag;

/// Stdout kept from a child (tofu output -json of a large module stays well below this).
const MAX_STDOUT: usize = 8 * 1024 * 1024;
/// The tail of stderr kept for error messages.
const STDERR_TAIL: usize = 4 * 1024;

/// Variables never passed to a child: the credentials directory holds the Forgejo token, and our
/// own configuration variables are none of the child's business.
pub fn scrub_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let k = key.to_string_lossy();
        if k == "CREDENTIALS_DIRECTORY" || k.starts_with("CI_EPHEMERAL_PROVISIONER_") {
            cmd.env_remove(&key);
        }
    }
}

pub struct ChildSpec {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
    pub stdin: Option<Secret>,
    pub timeout: Option<Duration>,
}

#[derive(Debug)]
pub struct ChildResult {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr_tail: String,
    /// A stop was requested while it ran; it was sent SIGINT.
    pub interrupted: bool,
    /// It ran past its timeout; its process group was killed.
    pub timed_out: bool,
}

impl ChildResult {
    pub fn success(&self) -> bool {
        self.status.success() && !self.timed_out
    }

    /// `exit status 1`, `killed by signal 9`, with the stderr tail.
    pub fn describe(&self) -> String {
        let how = if self.timed_out {
            "timed out and was killed".to_string()
        } else if let Some(code) = self.status.code() {
            format!("exited with status {code}")
        } else if let Some(sig) = self.status.signal() {
            format!("was killed by signal {sig}")
        } else {
            "ended abnormally".to_string()
        };
        let tail = self.stderr_tail.trim();
        if tail.is_empty() {
            how
        } else {
            format!("{how}; stderr ends with: {}", last_lines(tail, 6))
        }
    }
}

fn last_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(n);
    lines[start..].join(" | ")
}

pub fn run_child(spec: &ChildSpec, stop: &StopFlag) -> std::io::Result<ChildResult> {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args);
    scrub_env(&mut cmd);
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    // Own process group: a terminal's Ctrl-C reaches only us, and we forward exactly one SIGINT
    // (a second SIGINT would make tofu abandon its work).
    cmd.process_group(0);
    cmd.stdin(if spec.stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    cmd.stdout(Stdio::piped());
    cmd.stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    let pid = child.id() as libc::pid_t;

    if let (Some(secret), Some(mut stdin)) = (&spec.stdin, child.stdin.take()) {
        // One line; a child that exits without reading makes this fail with EPIPE, which its
        // exit status then explains.
        let line = format!("{}\n", secret.expose());
        if let Err(e) = stdin.write_all(line.as_bytes()) {
            log::debug!("writing to the child's stdin failed: {e}");
        }
        drop(stdin);
        drop(Secret::new(line));
    }

    let (Some(mut out), Some(mut err)) = (child.stdout.take(), child.stderr.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(std::io::Error::other(
            "the child's output pipes were not set up",
        ));
    };
    let out_thread = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = (&mut out).take(MAX_STDOUT as u64).read_to_end(&mut buf);
        // Drain the rest so the child never blocks on a full pipe.
        let _ = std::io::copy(&mut out, &mut std::io::sink());
        buf
    });
    let err_thread = thread::spawn(move || {
        let mut tail: Vec<u8> = Vec::new();
        let mut chunk = [0u8; 8192];
        loop {
            match err.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    tail.extend_from_slice(&chunk[..n]);
                    if tail.len() > STDERR_TAIL * 2 {
                        tail.drain(..tail.len() - STDERR_TAIL);
                    }
                }
            }
        }
        if tail.len() > STDERR_TAIL {
            tail.drain(..tail.len() - STDERR_TAIL);
        }
        String::from_utf8_lossy(&tail).into_owned()
    });

    let started = Instant::now();
    let mut interrupted = false;
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
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
    };
    let stdout = out_thread.join().unwrap_or_default();
    let stderr_tail = err_thread.join().unwrap_or_default();
    Ok(ChildResult {
        status,
        stdout,
        stderr_tail,
        interrupted,
        timed_out,
    })
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
        }
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
    fn timeout_kills_the_group() {
        let mut spec = sh("sleep 30 & sleep 30");
        spec.timeout = Some(Duration::from_millis(200));
        let r = run_child(&spec, &StopFlag::new()).unwrap();
        assert!(r.timed_out && !r.success());
    }

    #[test]
    fn stop_forwards_sigint() {
        let stop = StopFlag::new();
        let later = stop.clone();
        // Raised once the shell has installed its trap.
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            later.raise();
        });
        let spec = sh("trap 'echo got-int; exit 7' INT; while :; do sleep 0.05; done");
        let r = run_child(&spec, &stop).unwrap();
        assert!(r.interrupted);
        assert_eq!(r.status.code(), Some(7));
        assert_eq!(r.stdout, b"got-int\n");
    }
}
