//! The one reader of the Forgejo token (a file, or standard input for `--token-file -`), and
//! the switch that keeps a same-user process out of this one's memory (`PR_SET_DUMPABLE`).

use std::fs;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use anyhow::{anyhow, bail};

use crate::core::secret::{MAX_TOKEN_FILE_BYTES, Secret, judge};

/// Done first of all, before the token is read: no process of our user (tofu, a provider, a
/// module's local-exec, the launch command) may read our memory, environment or descriptors
/// through /proc, and no core dump may hold the token. The error says why the process refuses
/// to run without it.
pub fn forbid_dumping() -> anyhow::Result<()> {
    set_not_dumpable().map_err(|e| {
        anyhow!(
            "cannot make this process non-dumpable (prctl PR_SET_DUMPABLE 0): {e}; refusing to \
             run, since a process of the same user could then read the Forgejo token from its \
             memory"
        )
    })
}

fn set_not_dumpable() -> anyhow::Result<()> {
    // SAFETY: PR_SET_DUMPABLE takes an integer argument and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0) };
    if rc != 0 {
        bail!("{}", std::io::Error::last_os_error());
    }
    // SAFETY: as above; PR_GET_DUMPABLE returns the flag.
    match unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) } {
        0 => Ok(()),
        n => Err(anyhow!("the flag still reads {n} after setting it to 0")),
    }
}

/// Reads the Forgejo token from `path`, which is opened once and then judged by that handle
/// (`fstat`), so what is checked is what is read: never through a symlink (`O_NOFOLLOW`), never
/// blocking on a FIFO (`O_NONBLOCK`), not inherited by a child (`O_CLOEXEC`). The file must be a
/// regular file, owned by the effective uid, with no bits for group or others; it must hold the
/// token alone (surrounding whitespace is dropped). Errors say what to fix.
pub fn read_token_file(path: &Path) -> anyhow::Result<Secret> {
    let shown = path.display();
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            let is_link = fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
            if e.raw_os_error() == Some(libc::ELOOP) && is_link {
                anyhow!(
                    "token file {shown} is a symlink: point --token-file at the file itself \
                     (`readlink -f {shown}`)"
                )
            } else {
                anyhow!("cannot read token file {shown}: {e}")
            }
        })?;
    let meta = file
        .metadata()
        .map_err(|e| anyhow!("cannot read token file {shown}: {e}"))?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let what = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_socket() {
            "a socket"
        } else if ft.is_char_device() || ft.is_block_device() {
            "a device"
        } else {
            "not a regular file"
        };
        bail!(
            "token file {shown} is {what}: point --token-file at a regular file holding the token"
        );
    }
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != euid {
        bail!(
            "token file {shown} is owned by uid {}, not by the uid this runs as ({euid}); \
             run `chown {euid} {shown}`",
            meta.uid()
        );
    }
    let mode = meta.mode();
    if mode & 0o077 != 0 {
        bail!(
            "token file {shown} is readable by group or others (mode {:04o}); run `chmod 600 {shown}`",
            mode & 0o7777
        );
    }
    let mut bytes = Vec::new();
    file.take(MAX_TOKEN_FILE_BYTES)
        .read_to_end(&mut bytes)
        .map_err(|e| anyhow!("cannot read token file {shown}: {e}"))?;
    judge(bytes, &format!("token file {shown}"))
}

/// Reads the Forgejo token from standard input (`--token-file -`), to its end and at most
/// [`MAX_TOKEN_FILE_BYTES`], with the checks of a token file's content, then replaces fd 0 with
/// `/dev/null` at once — whether the read worked or not — so that the token's file or pipe is no
/// longer open in this process: no child can inherit it, `/proc/<pid>/fd/0` shows `/dev/null`.
/// Refused when standard input is a terminal (nothing to wait for there). Under systemd,
/// `StandardInput=file:PATH` opens PATH with the service manager's privileges, so a root-only file
/// can feed a service that could never open it itself.
pub fn read_token_stdin() -> anyhow::Result<Secret> {
    // SAFETY: isatty(3) on fd 0 touches no memory of ours.
    if unsafe { libc::isatty(0) } == 1 {
        bail!(
            "--token-file - reads the token from standard input, which is a terminal here: \
                    redirect it from the file (`--token-file - < FILE`) or a pipe, or give \
                    --token-file PATH"
        );
    }
    let read = read_fd0();
    let replaced = stdin_to_dev_null();
    let bytes = read.map_err(|e| anyhow!("cannot read the token from standard input: {e}"))?;
    replaced.map_err(|e| {
        anyhow!("cannot replace standard input with /dev/null after reading the token: {e}")
    })?;
    judge(bytes, "the token on standard input (--token-file -)")
}

/// Everything on fd 0 up to the cap and one byte more (so that too much is told from the cap),
/// into one buffer allocated up front: no reallocation leaves a copy behind in freed memory.
fn read_fd0() -> std::io::Result<Vec<u8>> {
    let cap = MAX_TOKEN_FILE_BYTES as usize;
    // SAFETY: fd 0 is only borrowed: ManuallyDrop never closes it (stdin_to_dev_null replaces it).
    let mut stdin = std::mem::ManuallyDrop::new(unsafe { fs::File::from_raw_fd(0) });
    let mut buf = vec![0u8; cap + 1];
    let mut n = 0;
    while n < buf.len() {
        match stdin.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                buf.fill(0);
                return Err(e);
            }
        }
    }
    if n > cap {
        buf.fill(0);
        return Err(std::io::Error::other(format!(
            "it holds more than {} KiB, more than a token",
            cap / 1024
        )));
    }
    buf.truncate(n);
    Ok(buf)
}

/// fd 0 becomes `/dev/null` (dup2), which closes what it was.
fn stdin_to_dev_null() -> std::io::Result<()> {
    let null = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/null")?;
    let fd = null.as_raw_fd();
    if fd == 0 {
        // fd 0 was closed: /dev/null is there now; keep it open.
        std::mem::forget(null);
        return Ok(());
    }
    // SAFETY: both descriptors are open; dup2(2) replaces fd 0 atomically.
    if unsafe { libc::dup2(fd, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::os::unix::fs::PermissionsExt;

    fn token_file(dir: &Path, name: &str, text: &str, mode: u32) -> std::path::PathBuf {
        let p = dir.join(name);
        fs::write(&p, text).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn a_private_regular_file_of_ours_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = token_file(dir.path(), "t", "  cac45fa0123\n", 0o600);
        assert_eq!(read_token_file(&p).unwrap().expose(), "cac45fa0123");
        let p = token_file(dir.path(), "r", "cac45fa0123", 0o400);
        assert_eq!(read_token_file(&p).unwrap().expose(), "cac45fa0123");
    }

    #[test]
    fn any_bit_for_group_or_others_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for mode in [0o640, 0o620, 0o610, 0o604, 0o602, 0o601, 0o644, 0o660] {
            let p = token_file(dir.path(), &format!("t{mode:o}"), "cac45fa0123", mode);
            let e = read_token_file(&p)
                .expect_err(&format!("mode {mode:o} must be refused"))
                .to_string();
            assert!(
                e.contains(&format!("mode {mode:04o}")) && e.contains("chmod 600"),
                "{mode:o}: {e}"
            );
            assert!(!e.contains("cac45fa"), "{e}");
        }
    }

    #[test]
    fn a_symlink_is_refused_even_to_a_good_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = token_file(dir.path(), "real", "cac45fa0123", 0o600);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = read_token_file(&link).unwrap_err().to_string();
        assert!(
            e.contains("is a symlink") && e.contains("point --token-file at the file itself"),
            "{e}"
        );
    }

    #[test]
    fn a_file_owned_by_another_uid_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: geteuid(2) cannot fail.
        let p = if unsafe { libc::geteuid() } == 0 {
            let p = token_file(dir.path(), "t", "cac45fa0123", 0o600);
            std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
            p
        } else {
            // Not root: a file of root's that anyone may open.
            std::path::PathBuf::from("/etc/passwd")
        };
        let e = read_token_file(&p).unwrap_err().to_string();
        assert!(e.contains("is owned by uid") && e.contains("chown"), "{e}");
    }

    #[test]
    fn a_directory_or_a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("d");
        fs::create_dir(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o700)).unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for (p, what) in [(d, "a directory"), (fifo, "a FIFO")] {
            // In a thread: a reader that blocks on the FIFO must fail the test, not hang it.
            let (tx, rx) = std::sync::mpsc::channel();
            let q = p.clone();
            std::thread::spawn(move || tx.send(read_token_file(&q).map(|_| ())));
            let got = rx
                .recv_timeout(std::time::Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("reading {what} blocked"));
            let e = got.expect_err(what).to_string();
            assert!(e.contains(what), "{what}: {e}");
        }
    }

    #[test]
    fn empty_or_more_than_the_token_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = token_file(dir.path(), "e", " \n\t", 0o600);
        assert!(
            read_token_file(&p)
                .unwrap_err()
                .to_string()
                .contains("is empty")
        );
        let p = token_file(dir.path(), "two", "abc def\n", 0o600);
        assert!(
            read_token_file(&p)
                .unwrap_err()
                .to_string()
                .contains("only the token")
        );
        let missing = dir.path().join("missing");
        assert!(
            read_token_file(&missing)
                .unwrap_err()
                .to_string()
                .contains("cannot read token file")
        );
    }

    #[test]
    fn the_content_is_judged_the_same_wherever_it_came_from() {
        let ok = |b: &str| judge(b.as_bytes().to_vec(), "x").map(|s| s.expose().to_string());
        assert_eq!(ok(" cac45fa0123\n").unwrap(), "cac45fa0123");
        assert_eq!(ok("cac45fa0123").unwrap(), "cac45fa0123");
        assert_eq!(ok("\n \t").unwrap_err().to_string(), "x is empty");
        for two in ["abc def", "abc\ndef\n", "abc\u{7}def"] {
            let e = ok(two).unwrap_err().to_string();
            assert_eq!(e, "x must hold only the token (one line, no spaces)");
        }
        let e = judge(vec![0xff, 0xfe, b'a'], "x").unwrap_err().to_string();
        assert_eq!(e, "x is not UTF-8 text");
    }

    #[test]
    fn never_formats_itself() {
        let s = Secret::new("cac45fa0123".into());
        assert!(!format!("{s:?} {s}").contains("cac45fa"));
        assert_eq!(s.expose(), "cac45fa0123");
    }
}
