//! One file of the state directory: read without following a symlink or blocking on a FIFO,
//! within a size limit, and written atomically (a temporary file, fsync, rename, fsync of the
//! directory); the state files each have their reader here.

use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::{fs, io};

use anyhow::{Context, Result, anyhow};

use crate::core::backoff::{Backoff, parse_backoff};
use crate::core::holds::{Holds, HoldsError, parse_holds};
use crate::core::metrics::{COUNTERS_FILE, COUNTERS_VERSION, Counters};
use crate::core::state::{CycleState, MAX_STATE_BYTES, parse_state};

/// The flags every file of the state directory is opened with: never through a symlink planted
/// at its path (`O_NOFOLLOW`: the open fails with `ELOOP`), never inherited by a child.
pub const STATE_OPEN_FLAGS: i32 = libc::O_NOFOLLOW | libc::O_CLOEXEC;

/// Why a file of the state directory could not be read.
#[derive(Debug)]
pub enum StateFileError {
    /// The open or the read failed (a permission, an I/O error): the file may be fine.
    Unreadable(String),
    /// It is not a regular file of a size this tool writes (a symlink, a directory, a FIFO, a
    /// huge file): it is left unread.
    NotPlain(String),
}

impl std::fmt::Display for StateFileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateFileError::Unreadable(m) | StateFileError::NotPlain(m) => f.write_str(m),
        }
    }
}

/// Opens a file of the state directory for reading: never through a symlink (`O_NOFOLLOW`),
/// never blocking on a FIFO (`O_NONBLOCK`, harmless for a regular file).
pub fn open_state_file(path: &Path) -> io::Result<fs::File> {
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(STATE_OPEN_FLAGS | libc::O_NONBLOCK)
        .open(path)
}

/// The error of an open with [`STATE_OPEN_FLAGS`], saying so when `path` is a symlink.
pub fn open_error(path: &Path, e: &io::Error) -> StateFileError {
    let is_link = fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if e.raw_os_error() == Some(libc::ELOOP) && is_link {
        StateFileError::NotPlain(format!(
            "{} is not a regular file but a symlink, which is never followed in the state directory",
            path.display()
        ))
    } else {
        StateFileError::Unreadable(format!("cannot read {}: {e}", path.display()))
    }
}

/// Reads a small file of the state directory, opened once ([`open_state_file`]) and judged by
/// that handle: a regular file of at most `max` bytes. `Ok(None)` when there is none.
pub fn read_state_text(path: &Path, max: u64) -> Result<Option<String>, StateFileError> {
    let file = match open_state_file(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(open_error(path, &e)),
    };
    let unreadable =
        |e: io::Error| StateFileError::Unreadable(format!("cannot read {}: {e}", path.display()));
    let meta = file.metadata().map_err(unreadable)?;
    if !meta.file_type().is_file() {
        return Err(StateFileError::NotPlain(format!(
            "{} is not a regular file (a directory or FIFO?)",
            path.display()
        )));
    }
    if meta.len() > max {
        return Err(StateFileError::NotPlain(format!(
            "{} is {} bytes, larger than any this tool writes ({max} bytes at most)",
            path.display(),
            meta.len()
        )));
    }
    let mut text = String::new();
    file.take(max + 1)
        .read_to_string(&mut text)
        .map_err(unreadable)?;
    Ok(Some(text))
}

/// Reads cycle.json without changing it. `Ok(None)` when there is none.
pub fn read_state_file(path: &Path) -> Result<Option<CycleState>> {
    let fix = "it was left unchanged and nothing else was done. Fix or move it by hand; the VM and \
               runner registrations of that cycle may still exist: after moving the file, run \
               `tofu destroy` in the --tofu-dir as the service's user with the service's \
               environment (under the Ansible role: `ci-ephemeral-provisioner-tofu POOL destroy \
               -auto-approve`; never tofu as root in the state directory), then \
               `ci-ephemeral-provisioner sweep` (see docs/troubleshooting.md)";
    let text = match read_state_text(path, MAX_STATE_BYTES) {
        Ok(Some(t)) => t,
        Ok(None) => return Ok(None),
        Err(e) => return Err(anyhow!("{e}; {fix}")),
    };
    parse_state(&text)
        .map(Some)
        .map_err(|e| anyhow!("{} is unusable: {e:#}; {fix}", path.display()))
}

/// Atomically replaces `path` with `bytes` (mode 0600): temp file in the same directory, fsync,
/// rename, fsync of the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_mode(path, bytes, 0o600)
}

/// [`write_atomic`] with another mode. The temporary file is named `.tmp-…` (never `*.json` or
/// `*.prom`, so no reader picks up a half-written one).
pub fn write_atomic_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    // A new file (`O_EXCL`, and never through a symlink), private until it is complete.
    let mut tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .make_in(dir, create_private)
        .with_context(|| format!("cannot create a temporary file in {}", dir.display()))?;
    tmp.write_all(bytes)
        .and_then(|_| {
            tmp.as_file()
                .set_permissions(fs::Permissions::from_mode(mode))
        })
        .and_then(|_| tmp.as_file().sync_all())
        .with_context(|| format!("cannot write a temporary file in {}", dir.display()))?;
    tmp.persist(path).map_err(|e| {
        anyhow!(
            "cannot rename a temporary file onto {}: {}",
            path.display(),
            e.error
        )
    })?;
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot fsync directory {}", dir.display()))?;
    Ok(())
}

/// Creates `path`, which must not exist (not even as a symlink): mode 0600, `O_NOFOLLOW`.
pub fn create_private(path: &Path) -> io::Result<fs::File> {
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(STATE_OPEN_FLAGS)
        .open(path)
}

/// Reads `counters.json`; missing is a fresh start. A broken file is an error naming it.
pub fn load_counters(dir: &Path) -> Result<Counters> {
    let path = dir.join(COUNTERS_FILE);
    let text =
        match crate::adapters::files::read_state_text(&path, crate::core::state::MAX_STATE_BYTES) {
            Ok(Some(t)) => t,
            Ok(None) => return Ok(Counters::default()),
            Err(e) => return Err(anyhow!("{e}")),
        };
    let c: Counters = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid counters JSON", path.display()))?;
    if c.version != COUNTERS_VERSION {
        return Err(anyhow!(
            "{} has version {}, this build knows {COUNTERS_VERSION}",
            path.display(),
            c.version
        ));
    }
    Ok(c)
}

pub fn save_counters(dir: &Path, c: &Counters) -> Result<()> {
    let mut bytes = serde_json::to_vec_pretty(c).context("cannot encode counters.json")?;
    bytes.push(b'\n');
    write_atomic(&dir.join(COUNTERS_FILE), &bytes)
}

/// Writes the text file atomically (temp file in the same directory, then rename), mode 0644 so
/// node_exporter can read it. The temp name does not end in `.prom`, so the collector never
/// reads a half-written file.
pub fn write_textfile(path: &Path, text: &str) -> Result<()> {
    crate::adapters::files::write_atomic_mode(path, text.as_bytes(), 0o644)
        .context("does the directory exist, and may this user write there?")
}

/// Reads the pool's `backoff.json`; a fresh backoff when there is none. Unreadable or unusable
/// is an error naming the file: a backoff in force is never reset silently.
pub fn read_backoff_file(path: &Path) -> Result<Backoff> {
    let text = match read_state_text(path, MAX_STATE_BYTES) {
        Ok(Some(t)) => t,
        Ok(None) => return Ok(Backoff::new()),
        Err(StateFileError::Unreadable(m) | StateFileError::NotPlain(m)) => {
            return Err(anyhow!(
                "{m}; the pool's failure backoff is unknown, so no new VM starts (docs/troubleshooting.md)"
            ));
        }
    };
    parse_backoff(&text).map_err(|e| {
        anyhow!(
            "{} is unusable: {e:#}; the pool's failure backoff is unknown, so no new VM starts: remove the file to clear it (docs/troubleshooting.md)",
            path.display()
        )
    })
}

/// Reads `held-jobs.json` without changing it; none when it does not exist.
pub fn read_holds_file(path: &Path) -> Result<Holds, HoldsError> {
    let text = match read_state_text(path, MAX_STATE_BYTES) {
        Ok(Some(t)) => t,
        Ok(None) => return Ok(Holds::default()),
        Err(StateFileError::Unreadable(m)) => return Err(HoldsError::Unreadable(m)),
        Err(StateFileError::NotPlain(m)) => return Err(HoldsError::Unusable(m)),
    };
    parse_holds(&text)
        .map_err(|e| HoldsError::Unusable(format!("{} is unusable: {e:#}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::files::FileStore;
    use crate::core::holds::HOLDS_FILE;
    use crate::core::ports::StateStore;
    use crate::core::state::{Launch, Registration, STATE_FILE};
    use crate::core::time::Timestamp;
    use std::path::PathBuf;

    fn sample() -> CycleState {
        let mut s = CycleState::new("20261014t150757z-ab12".into(), Timestamp(1_760_000_000_000));
        s.registrations.push(Registration {
            name: "ephemeral-20261014t150757z-ab12-1".into(),
            id: Some(514),
            uuid: Some("u".into()),
            job_id: 7,
            job_handle: "h".into(),
            requested_at: Timestamp(1_760_000_001_000),
            launch: Launch::Done,
            launched_at: Some(Timestamp(1_760_000_002_000)),
            job_gone_since: None,
            connected: false,
            busy: false,
            not_served: None,
            failed_start: false,
            stopped: None,
            job_first_seen: None,
        });
        s
    }

    #[test]
    fn save_load_round_trip_with_private_mode() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::new(dir.path());
        assert_eq!(store.load().unwrap(), None);
        store.save(&sample()).unwrap();
        assert_eq!(store.load().unwrap(), Some(sample()));
        let mode = fs::metadata(store.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "cycle.json must not be readable by others");
        store.remove().unwrap();
        assert_eq!(store.load().unwrap(), None);
        store.remove().unwrap();
    }

    #[test]
    fn every_truncation_is_a_clear_error() {
        let text = serde_json::to_string_pretty(&sample()).unwrap();
        for cut in 0..text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let err = parse_state(&text[..cut]).expect_err("a truncated cycle.json must not load");
            assert!(!format!("{err:#}").is_empty());
        }
    }

    #[test]
    fn unknown_version_and_wrong_types_are_refused() {
        let mut v = serde_json::to_value(sample()).unwrap();
        v["version"] = serde_json::json!(2);
        let e = parse_state(&v.to_string()).unwrap_err();
        assert!(format!("{e:#}").contains("version 2"), "{e:#}");
        let mut v = serde_json::to_value(sample()).unwrap();
        v["jobs_started"] = serde_json::json!("three");
        assert!(parse_state(&v.to_string()).is_err());
        assert!(parse_state("[]").is_err());
    }

    #[test]
    fn a_cycle_id_this_tool_would_not_write_is_refused() {
        for bad in ["", "x y", "../etc", "a;b", "ABC", "$(id)", &"a".repeat(65)] {
            let mut v = serde_json::to_value(sample()).unwrap();
            v["cycle_id"] = serde_json::json!(bad);
            let e = parse_state(&v.to_string()).unwrap_err();
            assert!(format!("{e:#}").contains("cycle_id"), "{bad:?}: {e:#}");
        }
        let mut v = serde_json::to_value(sample()).unwrap();
        v["cycle_id"] = serde_json::json!("20261014t150757z-dryrun");
        assert!(parse_state(&v.to_string()).is_ok());
    }

    /// A file outside the state directory, and a symlink to it at `name` inside.
    fn planted(dir: &Path, name: &str, text: &str) -> (PathBuf, PathBuf) {
        let outside = dir.join("outside");
        fs::create_dir_all(&outside).unwrap();
        let target = outside.join(format!("{name}.target"));
        fs::write(&target, text).unwrap();
        let state = dir.join("state");
        fs::create_dir_all(&state).unwrap();
        let link = state.join(name);
        std::os::unix::fs::symlink(&target, &link).unwrap();
        (link, target)
    }

    #[test]
    fn no_reader_follows_a_symlink_in_the_state_directory() {
        let dir = tempfile::tempdir().unwrap();
        let cycle = serde_json::to_string(&sample()).unwrap();
        let (link, target) = planted(dir.path(), STATE_FILE, &cycle);
        let e = format!("{:#}", read_state_file(&link).unwrap_err());
        assert!(
            e.contains(&link.display().to_string()) && e.contains("symlink"),
            "{e}"
        );
        let (link, _) = planted(dir.path(), HOLDS_FILE, "{\"version\": 1, \"jobs\": []}");
        match read_holds_file(&link) {
            Err(HoldsError::Unusable(m)) => {
                assert!(
                    m.contains(&link.display().to_string()) && m.contains("symlink"),
                    "{m}"
                )
            }
            other => panic!("{other:?}"),
        }
        let counters = serde_json::to_string(&crate::core::metrics::Counters::default()).unwrap();
        let (link, _) = planted(dir.path(), crate::core::metrics::COUNTERS_FILE, &counters);
        let e = format!("{:#}", load_counters(link.parent().unwrap()).unwrap_err());
        assert!(
            e.contains(&link.display().to_string()) && e.contains("symlink"),
            "{e}"
        );
        let (link, _) = planted(dir.path(), "last-run.json", "{}");
        let e = read_state_text(&link, MAX_STATE_BYTES)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&link.display().to_string()) && e.contains("symlink"),
            "{e}"
        );
        assert_eq!(
            fs::read_to_string(&target).unwrap(),
            cycle,
            "target untouched"
        );
    }

    #[test]
    fn a_fifo_in_the_state_directory_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join(STATE_FILE);
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let p = fifo.clone();
        std::thread::spawn(move || tx.send(read_state_text(&p, MAX_STATE_BYTES).map(|_| ())));
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("reading a FIFO blocked");
        assert!(matches!(got, Err(StateFileError::NotPlain(_))), "{got:?}");
    }

    #[test]
    fn atomic_writes_never_write_through_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        // At the destination: the rename replaces the link itself.
        let (link, target) = planted(dir.path(), "last-run.json", "outside");
        write_atomic(&link, b"{}\n").unwrap();
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_file());
        assert_eq!(fs::read(&link).unwrap(), b"{}\n");
        assert_eq!(fs::read_to_string(&target).unwrap(), "outside");
        // At a temporary file's name: its creation fails, and the target is left alone.
        let (link, target) = planted(dir.path(), ".tmp-planted", "outside");
        let e = create_private(&link).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        assert_eq!(fs::read_to_string(&target).unwrap(), "outside");
        let dangling = dir.path().join("state/.tmp-dangling");
        let nowhere = dir.path().join("outside/never-created");
        std::os::unix::fs::symlink(&nowhere, &dangling).unwrap();
        assert!(create_private(&dangling).is_err());
        assert!(!nowhere.exists(), "created through a dangling symlink");
        // No temporary file is left behind.
        let left: Vec<_> = fs::read_dir(dir.path().join("state"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp-") && n != ".tmp-planted" && n != ".tmp-dangling")
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn bad_files_are_named_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(STATE_FILE);
        fs::write(&path, b"{\"version\": 1, \"cycle_").unwrap();
        let e = read_state_file(&path).unwrap_err();
        assert!(format!("{e:#}").contains(&path.display().to_string()));
        assert_eq!(fs::read(&path).unwrap(), b"{\"version\": 1, \"cycle_");
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(
            format!("{:#}", read_state_file(&link).unwrap_err()).contains("not a regular file")
        );
    }
}
