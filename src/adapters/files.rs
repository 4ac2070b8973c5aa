//! The state directory: its checks, its slots' directories, its lock. What is in it: one
//! file read without following a symlink and written atomically ([`state_file`]), and the state
//! store of files over them ([`store`]).

mod state_file;
mod store;

use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::{fs, io};

use anyhow::{Context, Result, anyhow};

use crate::core::slots::{parse_slot_dir_name, slot_dir_name};

pub use state_file::{
    STATE_OPEN_FLAGS, StateFileError, create_private, load_counters, open_error, open_state_file,
    read_backoff_file, read_holds_file, read_state_file, read_state_text, save_counters,
    write_atomic, write_atomic_mode, write_textfile,
};
pub use store::FileStore;

pub(crate) struct Lock {
    _file: fs::File,
}

/// The lock file in the state directory: one run at a time.
pub const LOCK_FILE: &str = "cycle.lock";

/// Why the state directory cannot be used; `commands` turns each kind into its exit status.
#[derive(Debug)]
pub enum StateDirError {
    /// Unsafe or not a directory: the operator must fix it (exit 2). The message says how.
    Unsafe(String),
    /// Another run holds the lock (exit 75: try again later).
    Locked(String),
    /// The directory or its lock could not be created, opened or inspected (exit 1).
    Failed(String),
}

impl std::fmt::Display for StateDirError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateDirError::Unsafe(m) | StateDirError::Locked(m) | StateDirError::Failed(m) => {
                f.write_str(m)
            }
        }
    }
}

impl std::error::Error for StateDirError {}

/// What is at the state directory's path, and whether this user may keep its state there.
pub(crate) enum StateDir {
    Usable,
    /// Nothing there yet; `run` and `sweep` create it (0700).
    Missing,
}

/// Refuses a state directory that is not a directory, or that someone else could change under
/// us: owned by another user, or writable by group or others (exit 2, with what to fix).
pub(crate) fn inspect_state_dir(dir: &Path) -> Result<StateDir, StateDirError> {
    let meta = match fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(StateDir::Missing),
        Err(e) => {
            return Err(StateDirError::Failed(format!(
                "cannot inspect state directory {}: {e}",
                dir.display()
            )));
        }
    };
    if !meta.is_dir() {
        return Err(StateDirError::Unsafe(format!(
            "state directory {} is not a directory; point --state-dir (or $STATE_DIRECTORY) at a directory, or move what is there",
            dir.display()
        )));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(StateDirError::Unsafe(format!(
            "state directory {} is owned by uid {}, not by this user (uid {me}): another user could change the cycle state under us; `chown` it to the service's user or point --state-dir elsewhere",
            dir.display(),
            meta.uid()
        )));
    }
    if let Some(why) = writable_by_others(dir, &meta) {
        return Err(StateDirError::Unsafe(why));
    }
    Ok(StateDir::Usable)
}

/// Why a state directory with this metadata is unsafe for its mode (`status` says so too), if it is.
pub(crate) fn writable_by_others(dir: &Path, meta: &fs::Metadata) -> Option<String> {
    let mode = meta.mode() & 0o7777;
    (mode & 0o022 != 0).then(|| {
        format!(
            "state directory {} is writable by group or others (mode {mode:04o}): anyone in them could replace the cycle state; run `chmod go-w {}`",
            dir.display(),
            dir.display()
        )
    })
}

/// One slot of a pool: the pool's state directory (`--state-dir`) and the slot's number. Slot 1
/// keeps its files in the pool's directory itself (so a pool of one slot has no `slot-K/`), slot
/// K ≥ 2 in `slot-K/` inside it; the pool's claims lock is in the pool's directory.
#[derive(Clone, Debug)]
pub struct SlotDir {
    pub pool: PathBuf,
    pub k: u32,
    /// `--slots`: a slot beyond it that still has a cycle is reported.
    pub n: u32,
}

/// The lock the slots of a pool take, briefly, to claim a job (`core::claims`).
pub const CLAIMS_LOCK_FILE: &str = "claims.lock";

/// How long a claim waits for the claims lock before it fails.
pub const CLAIMS_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl SlotDir {
    /// A pool of one slot in `dir`.
    pub fn alone(dir: &Path) -> SlotDir {
        SlotDir {
            pool: dir.to_path_buf(),
            k: 1,
            n: 1,
        }
    }

    /// Where this slot's cycle.json, lock, report and audit trail are.
    pub fn dir(&self) -> PathBuf {
        match slot_dir_name(self.k) {
            Some(name) => self.pool.join(name),
            None => self.pool.clone(),
        }
    }

    /// The other slots whose directory exists, with their number and directory: slot 1 (the
    /// pool's directory) and every `slot-K/`, whatever `--slots` says now (a slot that was
    /// removed still holds what its cycle.json holds).
    fn others(&self) -> Result<Vec<(u32, PathBuf)>> {
        let mut out = Vec::new();
        if self.k != 1 {
            out.push((1, self.pool.clone()));
        }
        let entries = match fs::read_dir(&self.pool) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(anyhow!("cannot list {}: {e}", self.pool.display())),
        };
        for entry in entries {
            let entry = entry.with_context(|| format!("cannot list {}", self.pool.display()))?;
            let Some(k) = entry.file_name().to_str().and_then(parse_slot_dir_name) else {
                continue;
            };
            if k == self.k {
                continue;
            }
            let path = entry.path();
            let meta = fs::symlink_metadata(&path)
                .with_context(|| format!("cannot inspect {}", path.display()))?;
            if !meta.is_dir() {
                return Err(anyhow!(
                    "{} is not a directory: only the provisioner's slots may use that name in the state directory; move it away",
                    path.display()
                ));
            }
            out.push((k, path));
        }
        out.sort();
        Ok(out)
    }
}

/// Every slot directory of the pool in `pool` that exists, with its number: slot 1 (`pool`
/// itself) and every `slot-K/`.
pub fn pool_slot_dirs(pool: &Path) -> Result<Vec<(u32, PathBuf)>> {
    // As seen from no slot (0): no directory is left out as this slot's own.
    SlotDir {
        pool: pool.to_path_buf(),
        k: 0,
        n: 0,
    }
    .others()
}

fn ensure_dir(dir: &Path) -> Result<(), StateDirError> {
    if let StateDir::Missing = inspect_state_dir(dir)? {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| {
                StateDirError::Failed(format!(
                    "cannot create state directory {}: {e}",
                    dir.display()
                ))
            })?;
    }
    Ok(())
}

/// The slot's lock, `cycle.lock`: one run of a slot at a time. The pool's directory and the
/// slot's are created (0700) when missing, and both must be safe (`inspect_state_dir`).
pub(crate) fn take_lock(slot: &SlotDir) -> Result<Lock, StateDirError> {
    ensure_dir(&slot.pool)?;
    let dir = slot.dir();
    if slot.k != 1 {
        ensure_dir(&dir)?;
    }
    let path = dir.join(LOCK_FILE);
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| {
            StateDirError::Failed(format!("cannot open lock file {}: {e}", path.display()))
        })?;
    match file.try_lock() {
        Ok(()) => Ok(Lock { _file: file }),
        Err(fs::TryLockError::WouldBlock) => Err(StateDirError::Locked(format!(
            "another run holds {}; nothing was done",
            path.display()
        ))),
        Err(fs::TryLockError::Error(e)) => Err(StateDirError::Failed(format!(
            "cannot lock {}: {e}",
            path.display()
        ))),
    }
}

/// Takes `<dir>/cycle.lock` exactly as `run` and `sweep` do, for tests that model a second
/// invocation racing the first. `Err` says why not (`StateDirError::Locked`: another holder has it).
pub fn lock_state_dir(dir: &Path) -> Result<impl Sized + use<>, StateDirError> {
    take_lock(&SlotDir::alone(dir))
}
