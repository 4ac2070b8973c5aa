//! `cycle.json`: what the provisioner must remember between runs, and how it is stored.
//!
//! The file exists exactly while a cycle may own a VM or a runner registration. Every change is
//! written before the side effect it announces (intent first), atomically: temp file in the same
//! directory, fsync, rename, fsync of the directory.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::holds::{HOLDS_FILE, Holds, HoldsError, parse_holds};
use crate::time::Timestamp;

pub const STATE_VERSION: u64 = 1;
pub const STATE_FILE: &str = "cycle.json";
/// cycle.json never legitimately grows past a few KiB; anything larger is refused unread.
pub const MAX_STATE_BYTES: u64 = 1024 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// cycle.json written, `tofu apply` not yet known to have succeeded.
    Applying,
    /// The VM exists; registrations are created and watched.
    Running,
    /// Teardown decided: registrations are cleaned up and `tofu destroy` runs.
    TearingDown,
    /// `tofu destroy` succeeded; what remains is forgetting registrations and the sweep.
    Destroyed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Launch {
    /// Registered (or about to be); the launch command has not been started.
    Pending,
    /// The launch command was started and had not reported back when this was written.
    Started,
    /// The launch command exited 0: a runner was started on the VM.
    Done,
    /// The launch command failed or timed out.
    Failed,
}

/// One ephemeral registration this cycle created (or intends to create).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// `<prefix><cycle id>-<n>`: unique to this registration, so a POST whose answer was lost
    /// can be found again by exact name.
    pub name: String,
    /// `None` until Forgejo answered the POST: the registration may or may not exist.
    pub id: Option<i64>,
    pub uuid: Option<String>,
    pub job_id: i64,
    pub job_handle: String,
    pub requested_at: Timestamp,
    pub launch: Launch,
    pub launched_at: Option<Timestamp>,
    /// When its job was first seen neither waiting nor running while the runner was idle.
    pub job_gone_since: Option<Timestamp>,
    /// Forgejo has reported the runner `idle` or `active` at least once: it connected. One that
    /// stays `offline` past the grace without ever connecting is a failed start.
    #[serde(default)]
    pub connected: bool,
    /// Set when the VM was torn down because this runner sat idle while its job waited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_served: Option<NotServed>,
    /// Its runner never connected, and that failed start is counted (`start_failures`): set
    /// before its DELETE, so that a 404 seen later is not taken for a runner that ran its job.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed_start: bool,
    /// What `RUNNER_ACTION=stop` achieved before this cycle deleted the registration itself:
    /// carried to [`PreviousRunner::process`] when it is forgotten.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<ProcessState>,
}

/// Whether a runner's process on the VM is gone, as far as this cycle knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "why")]
pub enum ProcessState {
    /// Not asked yet: its registration is gone, which proves nothing about the process.
    Unchecked,
    /// `RUNNER_ACTION=check` answered 3, or `stop` answered 0.
    Gone,
    /// It may still run: `check` could not tell, or `stop` failed. The VM is never reused.
    NotGone(String),
}

/// A runner started on this VM whose registration is forgotten. The next runner starts on the
/// VM only once its process is known to be gone (a vanished registration is not an exited
/// runner).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PreviousRunner {
    pub id: i64,
    pub name: String,
    pub uuid: String,
    pub job_id: i64,
    pub job_handle: String,
    pub process: ProcessState,
}

/// The trust boundary of a VM: the repository and owner of the first job it ran.
/// `None` ids (a jobs list that did not say) match nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Boundary {
    pub repo_id: Option<i64>,
    pub owner_id: Option<i64>,
}

/// Why a connected runner was not given its waiting job, and the VM went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NotServed {
    /// Idle for `--job-pickup-timeout` while its job waited: Forgejo did not hand it out (a
    /// concurrency group holds it, most likely). The job is held (`held-jobs.json`).
    PickupTimeout,
    /// The runner declared labels that do not cover its job's `runs_on`: Forgejo never gives
    /// it that job (the launch command does not pass `RUNNER_LABELS` as `--label`).
    WrongLabels,
}

impl Registration {
    /// The moment the registration grace counts from.
    pub fn grace_start(&self) -> Timestamp {
        self.launched_at.unwrap_or(self.requested_at)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CycleState {
    pub version: u64,
    pub cycle_id: String,
    /// The `--runner-prefix` this cycle's registrations were created with: they stay ours (and
    /// deletable) even if the configured prefix changes mid-cycle. Empty: the configured one.
    #[serde(default)]
    pub runner_prefix: String,
    pub started_at: Timestamp,
    pub phase: Phase,
    /// When `tofu apply` succeeded.
    pub vm_ready_at: Option<Timestamp>,
    /// When the VM last became free (ready, or its last registration gone).
    pub free_since: Option<Timestamp>,
    /// Runners successfully launched on this VM.
    pub jobs_started: u32,
    /// Sequence number of the next registration name.
    pub next_seq: u32,
    /// Failed attempts in a row to start a runner (POST, launch, or a runner that never connected).
    pub start_failures: u32,
    pub registrations: Vec<Registration>,
    /// Why teardown was decided, once it was.
    pub teardown_reason: Option<String>,
    /// When `tofu destroy` last succeeded.
    pub destroyed_at: Option<Timestamp>,
    /// The last failure recorded in this cycle (e.g. a failed destroy), for the next run and `status`.
    pub last_error: Option<String>,
    /// Non-sensitive tofu outputs, for `status`. Sensitive outputs are never written anywhere.
    #[serde(default)]
    pub outputs: BTreeMap<String, Value>,
    /// Set with the first registration: whose jobs this VM may run (`--reuse-within`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boundary: Option<Boundary>,
    /// Runners started on this VM whose registrations are gone, until the cycle ends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous: Vec<PreviousRunner>,
}

impl CycleState {
    pub fn new(cycle_id: String, now: Timestamp) -> CycleState {
        CycleState {
            version: STATE_VERSION,
            cycle_id,
            runner_prefix: String::new(),
            started_at: now,
            phase: Phase::Applying,
            vm_ready_at: None,
            free_since: None,
            jobs_started: 0,
            next_seq: 1,
            start_failures: 0,
            registrations: Vec::new(),
            teardown_reason: None,
            destroyed_at: None,
            last_error: None,
            outputs: BTreeMap::new(),
            boundary: None,
            previous: Vec::new(),
        }
    }

    pub fn registration(&self, id: i64) -> Option<&Registration> {
        self.registrations.iter().find(|r| r.id == Some(id))
    }

    pub fn registration_mut(&mut self, id: i64) -> Option<&mut Registration> {
        self.registrations.iter_mut().find(|r| r.id == Some(id))
    }
}

/// Parses cycle.json text. Any problem is an error that says what is wrong; the caller names the file.
pub fn parse_state(text: &str) -> Result<CycleState> {
    let v: Value =
        serde_json::from_str(text).context("it is not valid JSON (empty or truncated?)")?;
    let version = v
        .get("version")
        .ok_or_else(|| anyhow!("it has no \"version\" field"))?;
    match version.as_u64() {
        Some(STATE_VERSION) => {}
        _ => {
            return Err(anyhow!(
                "its version {version} is not one this build understands (expected {STATE_VERSION}); \
                 a newer ci-ephemeral-provisioner wrote it"
            ));
        }
    }
    let state: CycleState =
        serde_json::from_value(v).context("its contents do not match the cycle.json format")?;
    // The id goes into runner names and tofu's environment: only what this tool generates.
    if !is_plain_cycle_id(&state.cycle_id) {
        return Err(anyhow!(
            "its cycle_id {:?} is not one this tool writes (1 to 64 of a-z, 0-9 and -)",
            state.cycle_id
        ));
    }
    Ok(state)
}

fn is_plain_cycle_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Where cycle.json (and the held jobs, which outlive a cycle) live. Chosen once in `main`: a
/// directory on disk, or memory for dry-runs.
pub trait StateStore {
    fn load(&mut self) -> Result<Option<CycleState>>;
    fn save(&mut self, state: &CycleState) -> Result<()>;
    fn remove(&mut self) -> Result<()>;
    fn describe(&self) -> String;
    /// The held jobs (`held-jobs.json`); none when there is no file.
    fn load_holds(&mut self) -> Result<Holds, HoldsError>;
    fn save_holds(&mut self, holds: &Holds) -> Result<()>;
}

pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    pub fn new(dir: &Path) -> FileStore {
        FileStore {
            dir: dir.to_path_buf(),
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

impl StateStore for FileStore {
    fn load(&mut self) -> Result<Option<CycleState>> {
        read_state_file(&self.path())
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
        if holds.jobs.is_empty() {
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

/// A store that never touches the disk: dry-runs start from what the real files (or the
/// fixture) hold and keep every change in memory.
#[derive(Default)]
pub struct MemoryStore {
    pub state: Option<CycleState>,
    pub holds: Holds,
}

impl StateStore for MemoryStore {
    fn load(&mut self) -> Result<Option<CycleState>> {
        Ok(self.state.clone())
    }

    fn save(&mut self, state: &CycleState) -> Result<()> {
        self.state = Some(state.clone());
        Ok(())
    }

    fn remove(&mut self) -> Result<()> {
        self.state = None;
        Ok(())
    }

    fn describe(&self) -> String {
        "cycle state (in memory, dry-run)".into()
    }

    fn load_holds(&mut self) -> Result<Holds, HoldsError> {
        Ok(self.holds.clone())
    }

    fn save_holds(&mut self, holds: &Holds) -> Result<()> {
        self.holds = holds.clone();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
            not_served: None,
            failed_start: false,
            stopped: None,
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
        let counters = serde_json::to_string(&crate::metrics::Counters::default()).unwrap();
        let (link, _) = planted(dir.path(), crate::metrics::COUNTERS_FILE, &counters);
        let e = format!(
            "{:#}",
            crate::metrics::load(link.parent().unwrap()).unwrap_err()
        );
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
