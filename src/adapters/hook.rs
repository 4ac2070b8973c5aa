//! The webhook receiver's I/O: the connection systemd passes as fd 3, one request read from it
//! within a deadline and a size limit, the answer, the secret file, the wake files it touches,
//! and its state file under a lock.

use std::fs;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, anyhow, bail};

use crate::core::hook::request::{MAX_HEAD_BYTES, head_end, judge_head, parse_head};
use crate::core::hook::{HOOK_STATE_FILE, HookState, MAX_HOOK_STATE_BYTES, Reason, Refused};
use crate::core::secret::{MAX_TOKEN_FILE_BYTES, Secret};

/// The descriptor of the connection (`sd_listen_fds`: the first passed one is 3).
pub const LISTEN_FD: RawFd = 3;

/// The lock beside the state file: one receiver at a time reads, decides and writes it.
const STATE_LOCK_FILE: &str = "hook-state.lock";

/// The connection, a TCP or a Unix stream socket (a socket unit's `ListenStream=` may be either).
pub enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

fn sockopt(fd: RawFd, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt(2) writes at most `len` bytes into `v`, which is that large.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (&raw mut v).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(v)
    } else {
        Err(io::Error::last_os_error())
    }
}

impl Conn {
    /// Takes fd 3, which must be a connected stream socket (what `Accept=yes` passes; a
    /// listening socket means `Accept=no`). It is made close-on-exec.
    pub fn from_passed_fd() -> anyhow::Result<Conn> {
        let fd = LISTEN_FD;
        let bad = |why: String| {
            anyhow!(
                "fd {fd} is not a connection ({why}): the hook's socket unit needs ListenStream= and Accept=yes"
            )
        };
        let not_socket = |e: io::Error| bad(format!("not a socket: {e}"));
        let kind = sockopt(fd, libc::SO_TYPE).map_err(not_socket)?;
        let listening = sockopt(fd, libc::SO_ACCEPTCONN).map_err(not_socket)?;
        let domain = sockopt(fd, libc::SO_DOMAIN).map_err(not_socket)?;
        if kind != libc::SOCK_STREAM {
            return Err(bad("not a stream socket".into()));
        }
        if listening != 0 {
            return Err(bad("a listening socket".into()));
        }
        // SAFETY: F_SETFD on a descriptor we checked is open; touches no memory.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        // SAFETY: fd 3 is an open, connected stream socket that nothing else in this process owns.
        Ok(match domain {
            libc::AF_UNIX => Conn::Unix(unsafe { UnixStream::from_raw_fd(fd) }),
            _ => Conn::Tcp(unsafe { TcpStream::from_raw_fd(fd) }),
        })
    }

    /// Who is at the other end, for the log.
    pub fn peer(&self) -> String {
        match self {
            Conn::Tcp(s) => s
                .peer_addr()
                .map_or_else(|_| "an unknown peer".into(), |a| a.to_string()),
            Conn::Unix(_) => "a local socket".into(),
        }
    }

    fn set_read_timeout(&self, d: Duration) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_read_timeout(Some(d)),
            Conn::Unix(s) => s.set_read_timeout(Some(d)),
        }
    }

    fn finish(&mut self) {
        let _ = match self {
            Conn::Tcp(s) => s.shutdown(Shutdown::Write),
            Conn::Unix(s) => s.shutdown(Shutdown::Write),
        };
        // What the peer still sends is read and dropped for a moment, so that closing a
        // connection with unread bytes does not reset it before the peer read the answer.
        let until = Instant::now() + Duration::from_millis(200);
        let mut buf = [0u8; 16 * 1024];
        let mut left = 64 * 1024usize;
        while left > 0 {
            let wait = until.saturating_duration_since(Instant::now());
            if wait.is_zero() || self.set_read_timeout(wait).is_err() {
                break;
            }
            match self.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.flush(),
            Conn::Unix(s) => s.flush(),
        }
    }
}

/// Reads more of the request into `buf` (at most `max` bytes), before `deadline`.
fn read_more(
    conn: &mut Conn,
    buf: &mut Vec<u8>,
    max: usize,
    deadline: Instant,
) -> Result<(), Refused> {
    let mut chunk = [0u8; 16 * 1024];
    let want = max.clamp(1, chunk.len());
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let slow = || {
            Refused::new(
                Reason::Slow,
                "the request did not arrive in time (--read-timeout)",
            )
        };
        if left.is_zero() {
            return Err(slow());
        }
        conn.set_read_timeout(left).map_err(|e| {
            Refused::new(Reason::Malformed, format!("cannot read the request: {e}"))
        })?;
        match conn.read(&mut chunk[..want]) {
            Ok(0) => {
                return Err(Refused::new(
                    Reason::Malformed,
                    "the connection closed before the request was complete",
                ));
            }
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                return Ok(());
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(slow());
            }
            Err(e) => {
                return Err(Refused::new(
                    Reason::Malformed,
                    format!("cannot read the request: {e}"),
                ));
            }
        }
    }
}

/// One request: its head judged before the body is read (`judge_head`), then exactly its body,
/// all of it before `deadline`.
pub fn read_request(
    conn: &mut Conn,
    deadline: Instant,
) -> Result<(crate::core::hook::request::Head, Vec<u8>), Refused> {
    let mut buf = Vec::with_capacity(4096);
    let end = loop {
        if let Some(end) = head_end(&buf) {
            break end;
        }
        if buf.len() >= MAX_HEAD_BYTES {
            return Err(Refused::new(
                Reason::TooLarge,
                format!("a head of more than {MAX_HEAD_BYTES} bytes"),
            ));
        }
        let max = MAX_HEAD_BYTES - buf.len();
        read_more(conn, &mut buf, max, deadline)?;
    };
    let head = parse_head(&buf[..end])?;
    let len = judge_head(&head)?;
    let mut body = buf.split_off(end);
    while body.len() < len {
        let max = len - body.len();
        read_more(conn, &mut body, max, deadline)?;
    }
    if body.len() > len {
        return Err(Refused::new(
            Reason::Malformed,
            "more bytes than its Content-Length (one request per connection)",
        ));
    }
    Ok((head, body))
}

/// Answers with `status` and a one-line text, and ends the connection.
pub fn respond(conn: &mut Conn, status: u16, text: &str) {
    let phrase = match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        _ => "Internal Server Error",
    };
    let allow = if status == 405 { "Allow: POST\r\n" } else { "" };
    let answer = format!(
        "HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n{text}\n",
        text.len() + 1
    );
    let _ = match conn {
        Conn::Tcp(s) => s.set_write_timeout(Some(Duration::from_secs(5))),
        Conn::Unix(s) => s.set_write_timeout(Some(Duration::from_secs(5))),
    };
    if let Err(e) = conn.write_all(answer.as_bytes()) {
        log::debug!("the answer could not be sent: {e}");
    }
    conn.finish();
}

/// Reads the webhook's secret. A file systemd put in `$CREDENTIALS_DIRECTORY` (`trusted`) is
/// taken as it is (systemd makes it readable by the service's user alone, with an ACL or by its
/// owner); any other must be a regular file owned by this user with no bits for group or others.
/// Surrounding whitespace is dropped; an empty secret is an error.
pub fn read_secret(path: &Path, trusted: bool) -> anyhow::Result<Secret> {
    let shown = path.display();
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| anyhow!("cannot read the webhook secret file {shown}: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| anyhow!("cannot read the webhook secret file {shown}: {e}"))?;
    if !meta.is_file() {
        bail!("the webhook secret file {shown} is not a regular file");
    }
    if !trusted {
        // SAFETY: geteuid(2) cannot fail and touches no memory.
        let euid = unsafe { libc::geteuid() };
        if meta.uid() != euid || meta.mode() & 0o077 != 0 {
            bail!(
                "the webhook secret file {shown} must be owned by this user (uid {euid}) and private: run `chown {euid} {shown}; chmod 600 {shown}`"
            );
        }
    }
    let mut bytes = Vec::new();
    file.take(MAX_TOKEN_FILE_BYTES)
        .read_to_end(&mut bytes)
        .map_err(|e| anyhow!("cannot read the webhook secret file {shown}: {e}"))?;
    let text = Secret::new(String::from_utf8(bytes).map_err(|e| {
        let mut b = e.into_bytes();
        b.fill(0);
        anyhow!("the webhook secret file {shown} is not UTF-8 text")
    })?);
    let secret = text.expose().trim();
    if secret.is_empty() {
        bail!(
            "the webhook secret file {shown} is empty: put the webhook's secret there (the one set in Forgejo)"
        );
    }
    Ok(Secret::new(secret.to_string()))
}

/// Touches a wake file: created when missing (never through a symlink), its modification time
/// set to now, closed after a write (what a `.path` unit's `PathChanged=` sees).
pub fn touch(path: &Path) -> anyhow::Result<()> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .with_context(|| format!("cannot open wake file {}", path.display()))?;
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        bail!("wake file {} is not a regular file", path.display());
    }
    file.set_modified(SystemTime::now())
        .with_context(|| format!("cannot touch wake file {}", path.display()))
}

/// The state directory's lock, held while the state is read, decided on and written.
pub struct StateLock {
    _file: fs::File,
}

/// Takes the state lock, waiting for another receiver until `deadline`. The directory is
/// created (0700) when missing.
pub fn lock_state(dir: &Path, deadline: Instant) -> anyhow::Result<StateLock> {
    if !dir.exists() {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create state directory {}", dir.display()))?;
    }
    let path = dir.join(STATE_LOCK_FILE);
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .with_context(|| format!("cannot open lock file {}", path.display()))?;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(StateLock { _file: file }),
            Err(fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(fs::TryLockError::WouldBlock) => {
                bail!("another receiver held {} too long", path.display())
            }
            Err(fs::TryLockError::Error(e)) => bail!("cannot lock {}: {e}", path.display()),
        }
    }
}

/// Reads `hook-state.json` (none: a fresh state).
pub fn load_state(dir: &Path, _lock: &StateLock) -> anyhow::Result<HookState> {
    let path = dir.join(HOOK_STATE_FILE);
    match crate::adapters::files::read_state_text(&path, MAX_HOOK_STATE_BYTES) {
        Ok(None) => Ok(HookState::default()),
        Ok(Some(text)) => {
            HookState::parse(&text).with_context(|| format!("{} is unusable", path.display()))
        }
        Err(e) => Err(anyhow!("{e}")),
    }
}

/// Replaces `hook-state.json` atomically.
pub fn save_state(dir: &Path, state: &HookState, _lock: &StateLock) -> anyhow::Result<()> {
    let mut bytes = serde_json::to_vec(state).context("cannot encode the hook's state")?;
    bytes.push(b'\n');
    crate::adapters::files::write_atomic(&dir.join(HOOK_STATE_FILE), &bytes)
}
