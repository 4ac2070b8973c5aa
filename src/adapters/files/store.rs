//! The state store of files ([`StateStore`]): each slot's cycle.json and held jobs, the pool's
//! backoff, and the claims lock that makes a claim atomic against the other slots.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::{fs, io};

use anyhow::{Context, Result, anyhow};

use super::state_file::{
    STATE_OPEN_FLAGS, read_backoff_file, read_holds_file, read_state_file, write_atomic,
};
use super::{CLAIMS_LOCK_FILE, CLAIMS_LOCK_WAIT, SlotDir};
use crate::core::backoff::{BACKOFF_FILE, Backoff, Change, CycleOutcome};
use crate::core::claims::Others;
use crate::core::holds::{HOLDS_FILE, Holds, HoldsError};
use crate::core::ports::{
    BackoffGate, Claim, Start, StateStore, record_outcome_in, save_starting_in,
    save_starting_warm_in,
};
use crate::core::state::{CycleState, STATE_FILE};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::files::take_lock;
    use crate::core::state::Registration;
    use crate::core::time::Timestamp;
    use std::os::unix::fs::PermissionsExt;

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
