//! Webhooks in the tests: a raw HTTP client that sends a delivery as Forgejo does (or any
//! request a test wants, byte by byte), and [`Activator`], systemd's `Accept=yes` socket
//! activation in small: a listener on 127.0.0.1 that runs the built binary's `hook` once per
//! connection, the connection as fd 3, `LISTEN_FDS=1` and `LISTEN_PID` its own pid.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::IntoRawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use forgejo_model::webhook::Delivery;

/// The bytes of Forgejo's POST of `d` to `path` (`services/webhook/default.go` `NewRequest`:
/// `Content-Type: application/json`, the body as stored; Go adds Host, User-Agent and the length).
pub fn request_bytes(host: &str, path: &str, d: &Delivery) -> Vec<u8> {
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: Go-http-client/1.1\r\nContent-Length: {}\r\nContent-Type: application/json\r\n",
        d.body.len()
    );
    for (k, v) in &d.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("Accept-Encoding: gzip\r\n\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(d.body.as_bytes());
    bytes
}

/// Sends `bytes` to `addr` (`host:port`) and reads the answer to its end: its status and body.
pub fn exchange(addr: &str, bytes: &[u8]) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    s.write_all(bytes)?;
    read_answer(&mut s)
}

/// The status and body of an HTTP answer read to the end of the connection.
pub fn read_answer(s: &mut TcpStream) -> std::io::Result<(u16, String)> {
    let mut answer = Vec::new();
    s.read_to_end(&mut answer)?;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {text:?}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .trim()
        .to_string();
    Ok((status, body))
}

/// Forgejo's delivery of `d` to `url` (`http://host:port/path`): its status and body.
pub fn deliver(url: &str, d: &Delivery) -> std::io::Result<(u16, String)> {
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (addr, path) = match rest.split_once('/') {
        Some((a, p)) => (a, format!("/{p}")),
        None => (rest, "/".to_string()),
    };
    exchange(addr, &request_bytes(addr, &path, d))
}

/// One `hook` process the activator ran: its exit status and its stderr.
#[derive(Clone, Debug)]
pub struct Ran {
    pub code: Option<i32>,
    pub stderr: String,
}

/// A listener that runs `BIN hook ARGS…` for each connection, as a socket unit with
/// `Accept=yes` does. Dropping it stops accepting (the processes it ran have ended by then).
pub struct Activator {
    pub addr: String,
    ran: Arc<Mutex<Vec<Ran>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Activator {
    pub fn start(bin: &str, args: Vec<String>, env: Vec<(String, String)>) -> Activator {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the hook's socket");
        let addr = listener.local_addr().unwrap().to_string();
        listener.set_nonblocking(true).unwrap();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ran2, stop2, bin) = (ran.clone(), stop.clone(), PathBuf::from(bin));
        thread::spawn(move || {
            while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        conn.set_nonblocking(false).unwrap();
                        let ran = ran2.clone();
                        let (bin, args, env) = (bin.clone(), args.clone(), env.clone());
                        thread::spawn(move || {
                            let r = run_one(&bin, &args, &env, conn);
                            ran.lock().unwrap().push(r);
                        });
                    }
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Activator { addr, ran, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    /// The processes that ended so far.
    pub fn ran(&self) -> Vec<Ran> {
        self.ran.lock().unwrap().clone()
    }

    /// Waits until `n` processes have ended (a hang guard, not a timing assertion).
    pub fn wait_ran(&self, n: usize) -> Vec<Ran> {
        for _ in 0..6000 {
            let r = self.ran();
            if r.len() >= n {
                return r;
            }
            thread::sleep(Duration::from_millis(10));
        }
        panic!("{n} hook processes did not end in 60 s: {:?}", self.ran());
    }
}

impl Drop for Activator {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

fn run_one(bin: &PathBuf, args: &[String], env: &[(String, String)], conn: TcpStream) -> Ran {
    run_on_fd3(bin, args, env, conn.into_raw_fd())
}

/// `bin hook args…` with `fd` as fd 3 (and nothing else open above 2), `LISTEN_FDS=1` and
/// `LISTEN_PID` its own pid: a shell sets it to `$$` and execs the binary in its place. `fd` is
/// closed here.
pub fn run_on_fd3(bin: &PathBuf, args: &[String], env: &[(String, String)], fd: i32) -> Ran {
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg("LISTEN_PID=$$ exec \"$0\" hook \"$@\"")
        .arg(bin)
        .args(args)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LISTEN_FDS", "1")
        .env("LISTEN_FDNAMES", "connection")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: dup2 is async-signal-safe; the child gets the connection as fd 3 (without
    // close-on-exec, as systemd passes it).
    unsafe {
        cmd.pre_exec(move || {
            let rc = if fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, 3)
            };
            if rc < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().expect("run the hook");
    // SAFETY: the parent's copy of the connection, ours alone.
    unsafe { libc::close(fd) };
    Ran {
        code: out.status.code(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}
