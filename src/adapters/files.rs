//! The state directory's files: cycle.json and the other state files (opened without following
//! a symlink, written atomically), the lock, the directory's own checks, the metrics files.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::{fs, io};

use anyhow::{Context, Result, anyhow};

use crate::core::backoff::{BACKOFF_FILE, Backoff, Change, CycleOutcome, parse_backoff};
use crate::core::claims::Others;
use crate::core::holds::{HOLDS_FILE, Holds, HoldsError, parse_holds};
use crate::core::metrics::{COUNTERS_FILE, COUNTERS_VERSION, Counters};
use crate::core::ports::{
    BackoffGate, Claim, Start, StateStore, record_outcome_in, save_starting_in,
    save_starting_warm_in,
};
use crate::core::slots::{parse_slot_dir_name, slot_dir_name};
use crate::core::state::{CycleState, MAX_STATE_BYTES, STATE_FILE, parse_state};

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

pub struct FileStore {
    dir: PathBuf,
    slot: SlotDir,
}

impl FileStore {
    /// The store of a pool of one slot in `dir`.
    pub fn new(dir: &Path) -> FileStore {
        FileStore::slot(SlotDir::alone(dir))
    }

    /// The store of one slot of a pool.
    pub fn slot(slot: SlotDir) -> FileStore {
        FileStore {
            dir: slot.dir(),
            slot,
        }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join(STATE_FILE)
    }
}

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

impl FileStore {
    /// The pool's claims lock, held until the answer is dropped: only to read the other slots'
    /// claims and the backoff and write this slot's, never for long. A holder that keeps it past
    /// CLAIMS_LOCK_WAIT is stuck: this fails (and the run with it) rather than wait without end.
    fn claims_lock(&self) -> Result<fs::File> {
        let path = self.slot.pool.join(CLAIMS_LOCK_FILE);
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(STATE_OPEN_FLAGS)
            .open(&path)
            .with_context(|| format!("cannot open the claims lock {}", path.display()))?;
        let started = std::time::Instant::now();
        loop {
            match lock.try_lock() {
                Ok(()) => return Ok(lock),
                Err(fs::TryLockError::WouldBlock) if started.elapsed() < CLAIMS_LOCK_WAIT => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(fs::TryLockError::WouldBlock) => {
                    return Err(anyhow!(
                        "another slot has held {} for {}s; is a run of this pool stuck? (`fuser {}` names it)",
                        path.display(),
                        CLAIMS_LOCK_WAIT.as_secs(),
                        path.display()
                    ));
                }
                Err(fs::TryLockError::Error(e)) => {
                    return Err(anyhow!("cannot lock {}: {e}", path.display()));
                }
            }
        }
    }

    /// The other slot that claims the attempt `handle` of `job_id`, if one does (with the
    /// claims lock held).
    fn claimant(&mut self, job_id: i64, handle: &str) -> Result<Option<String>> {
        let others = self
            .others()
            .with_context(|| format!("claiming job {job_id} needs the other slots' claims"))?;
        Ok(others.claimant(job_id, handle).cloned())
    }

    /// `save_claiming` with the claims lock held.
    fn claim_locked(&mut self, state: &CycleState, job_id: i64, handle: &str) -> Result<Claim> {
        if let Some(slot) = self.claimant(job_id, handle)? {
            return Ok(Claim::HeldBy(slot));
        }
        self.save(state)?;
        Ok(Claim::Saved)
    }
}

/// A [`FileStore`] whose claims lock is held: its claim does not take it again.
struct Locked<'a>(&'a mut FileStore);

impl StateStore for Locked<'_> {
    fn load(&mut self) -> Result<Option<CycleState>> {
        self.0.load()
    }
    fn save(&mut self, state: &CycleState) -> Result<()> {
        self.0.save(state)
    }
    fn remove(&mut self) -> Result<()> {
        self.0.remove()
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn load_holds(&mut self) -> Result<Holds, HoldsError> {
        self.0.load_holds()
    }
    fn save_holds(&mut self, holds: &Holds) -> Result<()> {
        self.0.save_holds(holds)
    }
    fn others(&mut self) -> Result<Others> {
        self.0.others()
    }
    fn save_claiming(&mut self, state: &CycleState, job_id: i64, handle: &str) -> Result<Claim> {
        self.0.claim_locked(state, job_id, handle)
    }
    fn load_backoff(&mut self) -> Result<Backoff> {
        self.0.load_backoff()
    }
    fn save_backoff(&mut self, backoff: &Backoff) -> Result<()> {
        self.0.save_backoff(backoff)
    }
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

impl StateStore for FileStore {
    fn load(&mut self) -> Result<Option<CycleState>> {
        read_state_file(&self.path())
    }

    fn others(&mut self) -> Result<Others> {
        let mut o = Others::default();
        for (k, dir) in self.slot.others()? {
            let path = dir.join(STATE_FILE);
            let state = read_state_file(&path).with_context(|| {
                format!("slot {k}'s cycle.json cannot be read, so what it holds is unknown")
            })?;
            if let Some(state) = state {
                let name = format!("slot {k} ({})", path.display());
                if k > self.slot.n {
                    o.beyond.push(format!(
                        "{name} has cycle {} in progress, but the pool has --slots {} now: its VM and registrations stay until it finishes; run that slot (--slots {k} --slot {k}) until it does, or raise --slots again",
                        state.cycle_id, self.slot.n
                    ));
                }
                o.add(k, "", &name, &state);
                // No run of a slot beyond --slots polls for a job: its warm VM serves none.
                if k > self.slot.n {
                    o.warm.remove(&(k, String::new()));
                }
            }
            // Another slot's holds are advice like this slot's own: a file that cannot be read
            // is that slot's failure to report, not a reason to stop here.
            match read_holds_file(&dir.join(HOLDS_FILE)) {
                Ok(h) => {
                    o.held
                        .extend(h.jobs.iter().map(|h| (h.handle.clone(), h.until)));
                    o.add_seen(&h.seen);
                }
                Err(e) => log::warn!("{e}; slot {k}'s held jobs are not known here"),
            }
        }
        Ok(o)
    }

    fn save_claiming(&mut self, state: &CycleState, job_id: i64, handle: &str) -> Result<Claim> {
        let _lock = self.claims_lock()?;
        self.claim_locked(state, job_id, handle)
    }

    fn load_backoff(&mut self) -> Result<Backoff> {
        read_backoff_file(&self.slot.pool.join(BACKOFF_FILE))
    }

    fn save_backoff(&mut self, backoff: &Backoff) -> Result<()> {
        let mut bytes =
            serde_json::to_vec_pretty(backoff).context("cannot encode the failure backoff")?;
        bytes.push(b'\n');
        write_atomic(&self.slot.pool.join(BACKOFF_FILE), &bytes)
    }

    fn save_starting(
        &mut self,
        state: &CycleState,
        job_id: i64,
        handle: &str,
        gate: &BackoffGate,
    ) -> Result<Start> {
        let _lock = self.claims_lock()?;
        // The claim is checked before the backoff is re-armed for a retry: a job another slot
        // holds costs no backoff.
        if let Some(slot) = self.claimant(job_id, handle)? {
            return Ok(Start::Claim(Claim::HeldBy(slot)));
        }
        save_starting_in(&mut Locked(self), state, job_id, handle, gate)
    }

    fn save_starting_warm(
        &mut self,
        state: &CycleState,
        wanted: u32,
        gate: &BackoffGate,
    ) -> Result<Start> {
        let _lock = self.claims_lock()?;
        save_starting_warm_in(&mut Locked(self), state, wanted, gate)
    }

    fn record_outcome(
        &mut self,
        gate: &BackoffGate,
        cycle_id: &str,
        outcome: CycleOutcome,
    ) -> Result<(Backoff, Change)> {
        let _lock = self.claims_lock()?;
        record_outcome_in(self, gate, cycle_id, outcome)
    }

    fn save(&mut self, state: &CycleState) -> Result<()> {
        let mut bytes = serde_json::to_vec_pretty(state).context("cannot encode cycle.json")?;
        bytes.push(b'\n');
        write_atomic(&self.path(), &bytes)
    }

    fn remove(&mut self) -> Result<()> {
        let path = self.path();
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(anyhow!("cannot remove {}: {e}", path.display())),
        }
        fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("cannot fsync directory {}", self.dir.display()))
    }

    fn describe(&self) -> String {
        self.path().display().to_string()
    }

    fn load_holds(&mut self) -> Result<Holds, HoldsError> {
        read_holds_file(&self.dir.join(HOLDS_FILE))
    }

    fn save_holds(&mut self, holds: &Holds) -> Result<()> {
        let path = self.dir.join(HOLDS_FILE);
        if holds.is_empty() {
            // Nothing held: no file (at rest the state directory holds only what must stay).
            return match fs::remove_file(&path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(anyhow!("cannot remove {}: {e}", path.display())),
            };
        }
        let mut bytes = serde_json::to_vec_pretty(holds).context("cannot encode the held jobs")?;
        bytes.push(b'\n');
        write_atomic(&path, &bytes)
    }
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
    use crate::core::state::{Launch, Registration};
    use crate::core::time::Timestamp;
    use std::os::unix::fs::PermissionsExt;

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

    /// Two slots of one pool: a job claimed by one is refused to the other, and nothing of the
    /// refused slot is written; once the claim is forgotten the job is free again.
    #[test]
    fn a_claim_of_one_slot_is_refused_to_another() {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("pool");
        let slot = |k| SlotDir {
            pool: pool.clone(),
            k,
            n: 2,
        };
        let _l1 = take_lock(&slot(1)).unwrap();
        let _l2 = take_lock(&slot(2)).unwrap();
        let mut one = FileStore::slot(slot(1));
        let mut two = FileStore::slot(slot(2));
        let now = Timestamp(1_760_000_000_000);
        let mut s2 = CycleState::new("c2".into(), now);
        s2.registrations
            .push(Registration::intent("p-c2-1-t".into(), 5, "h5".into(), now));
        assert_eq!(two.save_claiming(&s2, 5, "h5").unwrap(), Claim::Saved);

        let mut s1 = CycleState::new("c1".into(), now);
        s1.claim = Some(5);
        s1.claim_handle = Some("h5".into());
        match one.save_claiming(&s1, 5, "h5").unwrap() {
            Claim::HeldBy(by) => assert!(by.starts_with("slot 2 ("), "{by}"),
            Claim::Saved => panic!("slot 1 claimed a job slot 2 holds"),
        }
        assert!(
            one.load().unwrap().is_none(),
            "nothing written for the refused claim"
        );
        let handles = |o: Others| o.claimed(now).handles.into_iter().collect::<Vec<_>>();
        assert_eq!(handles(one.others().unwrap()), ["h5"]);
        assert!(handles(two.others().unwrap()).is_empty());
        // Another job is free, and so is another attempt of job 5 (a rerun: a new handle); once
        // slot 2 forgot its registration, so is its attempt.
        s1.claim = Some(6);
        s1.claim_handle = Some("h6".into());
        assert_eq!(one.save_claiming(&s1, 6, "h6").unwrap(), Claim::Saved);
        assert_eq!(handles(two.others().unwrap()), ["h6"]);
        s1.claim = Some(5);
        s1.claim_handle = Some("h5-rerun".into());
        assert_eq!(one.save_claiming(&s1, 5, "h5-rerun").unwrap(), Claim::Saved);
        two.remove().unwrap();
        s1.claim_handle = Some("h5".into());
        assert_eq!(one.save_claiming(&s1, 5, "h5").unwrap(), Claim::Saved);
        // Slot 2's directory was made for it, 0700, in the pool's.
        let mode = fs::metadata(pool.join("slot-2"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    /// A file where a slot's directory belongs is doubt: what that slot holds is unknown.
    #[test]
    fn a_slot_name_that_is_not_a_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("slot-4"), "x").unwrap();
        let mut one = FileStore::new(dir.path());
        let e = one.others().unwrap_err().to_string();
        assert!(e.contains("slot-4 is not a directory"), "{e}");
    }

    /// Slots racing for one job: the claims lock lets exactly one have it, round after round.
    // Mutation caught: save_claiming without the claims lock.
    #[test]
    fn of_slots_racing_for_one_job_exactly_one_claims_it() {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().to_path_buf();
        for k in 1..=4 {
            take_lock(&SlotDir {
                pool: pool.clone(),
                k,
                n: 4,
            })
            .map(drop)
            .unwrap();
        }
        for round in 0..40i64 {
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
            let handles: Vec<_> = (1..=4u32)
                .map(|k| {
                    let (pool, barrier) = (pool.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        let mut store = FileStore::slot(SlotDir { pool, k, n: 4 });
                        let now = Timestamp(1_760_000_000_000);
                        let mut s = CycleState::new(format!("c{k}"), now);
                        s.registrations.push(Registration::intent(
                            format!("p-c{k}-{round}"),
                            round,
                            format!("h{round}"),
                            now,
                        ));
                        barrier.wait();
                        store
                            .save_claiming(&s, round, &format!("h{round}"))
                            .unwrap()
                    })
                })
                .collect();
            let saved = handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|c| *c == Claim::Saved)
                .count();
            assert_eq!(saved, 1, "round {round}: {saved} slots claimed one job");
            for k in 1..=4 {
                FileStore::slot(SlotDir {
                    pool: pool.clone(),
                    k,
                    n: 4,
                })
                .remove()
                .unwrap();
            }
        }
    }

    /// Slots racing to make the pool's last warm VM: the claims lock lets exactly `wanted` of
    /// them write one, round after round, and the lowest slots count first.
    #[test]
    fn of_slots_racing_for_warm_vms_exactly_the_wanted_number_make_one() {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().to_path_buf();
        let slot = |k| SlotDir {
            pool: pool.clone(),
            k,
            n: 4,
        };
        for k in 1..=4 {
            take_lock(&slot(k)).map(drop).unwrap();
        }
        let gate = BackoffGate {
            policy: crate::core::backoff::BackoffPolicy {
                max_failed_cycles: 0,
                initial: std::time::Duration::from_secs(1),
                max: std::time::Duration::from_secs(1),
            },
            slot: 1,
            now: Timestamp(1_760_000_000_000),
        };
        for wanted in [1u32, 2, 1, 3] {
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
            let handles: Vec<_> = (1..=4u32)
                .map(|k| {
                    let (pool, barrier) = (pool.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        let mut store = FileStore::slot(SlotDir { pool, k, n: 4 });
                        let mut s = CycleState::new(format!("c{k}"), gate.now);
                        s.warm = true;
                        barrier.wait();
                        store.save_starting_warm(&s, wanted, &gate).unwrap()
                    })
                })
                .collect();
            let saved = handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|c| *c == Start::Claim(Claim::Saved))
                .count();
            assert_eq!(saved, wanted as usize, "--warm {wanted}: {saved} warm VMs");
            let seen = FileStore::slot(slot(1)).others().unwrap();
            let mine = FileStore::slot(slot(1)).load().unwrap().is_some();
            assert_eq!(seen.warm.len() + usize::from(mine), wanted as usize);
            for k in 1..=4 {
                FileStore::slot(slot(k)).remove().unwrap();
            }
        }
        // Slot 3 and slot 1 warm: slot 4 sees both, two of them below it.
        for k in [1, 3] {
            let mut s = CycleState::new(format!("c{k}"), gate.now);
            s.warm = true;
            FileStore::slot(slot(k)).save(&s).unwrap();
        }
        let w = FileStore::slot(slot(4))
            .others()
            .unwrap()
            .warm_elsewhere(4, "");
        assert_eq!((w.total, w.in_lower_slots), (2, 2));
        let w = FileStore::slot(slot(2))
            .others()
            .unwrap()
            .warm_elsewhere(2, "");
        assert_eq!((w.total, w.in_lower_slots), (2, 1));
        // A slot beyond --slots runs no more: its warm VM is no one's to count on.
        let mut s = CycleState::new("c5".into(), gate.now);
        s.warm = true;
        let five = SlotDir {
            pool: pool.clone(),
            k: 5,
            n: 5,
        };
        take_lock(&five).map(drop).unwrap();
        FileStore::slot(five).save(&s).unwrap();
        let o = FileStore::slot(slot(2)).others().unwrap();
        assert_eq!(o.warm.iter().map(|w| w.0).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(o.beyond.len(), 1);
    }
}
