//! The real clock: wall time for timestamps, monotonic time for durations and waits.

use std::fs;
use std::io::Read;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use crate::adapters::signals::{ReloadFlag, StopFlag};
use crate::core::ports::{Clock, Sleep};
use crate::core::time::Timestamp;

/// The system's wall clock, read once: what a clock of its own starts from.
pub fn wall_now() -> Timestamp {
    Timestamp::from_system(SystemTime::now())
}

/// Wall time for timestamps, read once at the start and carried on by the monotonic clock (so
/// the durations between timestamps are never negative); waits that a stop request cuts short,
/// and that a webhook delivery ends early (a change of the wake file).
#[derive(Clone)]
pub struct RealClock {
    stop: StopFlag,
    reload: ReloadFlag,
    origin: Instant,
    origin_at: Timestamp,
    wake_file: Option<PathBuf>,
    /// The wake file's modification time when the driver last asked (`woken_at`): a sleep ends
    /// at any change since, so that no delivery between that question and the sleep is missed.
    woken_seen: std::cell::Cell<Option<SystemTime>>,
}

impl RealClock {
    pub fn new(stop: StopFlag, reload: ReloadFlag) -> RealClock {
        RealClock {
            stop,
            reload,
            origin: Instant::now(),
            origin_at: wall_now(),
            wake_file: None,
            woken_seen: std::cell::Cell::new(None),
        }
    }

    /// The same clock, woken by changes of `path` (`--wake-file`).
    pub fn with_wake_file(self, path: Option<PathBuf>) -> RealClock {
        RealClock {
            wake_file: path,
            ..self
        }
    }

    /// The wake file's modification time, exactly (none: no file, or it cannot be read).
    fn wake_mtime(&self) -> Option<SystemTime> {
        let path = self.wake_file.as_ref()?;
        fs::metadata(path).and_then(|m| m.modified()).ok()
    }
}

impl Clock for RealClock {
    fn now(&self) -> Timestamp {
        self.origin_at.plus(self.origin.elapsed())
    }

    fn sleep(&mut self, d: Duration) -> Sleep {
        let end = std::time::Instant::now() + d;
        let woken = self.woken_seen.get().or_else(|| self.wake_mtime());
        loop {
            if self.stop.is_raised() {
                return Sleep::Interrupted;
            }
            if self.reload.is_raised() {
                return Sleep::Reload;
            }
            let left = end.saturating_duration_since(std::time::Instant::now());
            // A delivery during the wait: look at once (a stat every 100 ms).
            if left.is_zero() || (self.wake_file.is_some() && self.wake_mtime() != woken) {
                return Sleep::Slept;
            }
            std::thread::sleep(left.min(Duration::from_millis(100)));
        }
    }

    fn stop_requested(&self) -> bool {
        self.stop.is_raised()
    }

    fn woken_at(&self) -> Option<Timestamp> {
        let t = self.wake_mtime();
        self.woken_seen.set(t);
        t.map(Timestamp::from_system)
    }

    fn new_cycle_id(&mut self, now: Timestamp) -> String {
        let mut buf = [0u8; 2];
        let random = fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut buf))
            .map(|()| u16::from_be_bytes(buf))
            .unwrap_or_else(|_| (std::process::id() as u16) ^ (now.0 as u16));
        format!("{}-{random:04x}", now.compact())
    }
}
