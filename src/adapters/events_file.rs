//! The audit trail: `events.jsonl` in the state directory, one JSON object per line per side
//! effect and per failure, appended as they happen. Bounded: past `--events-max-bytes` the file
//! is renamed to `events.jsonl.1` (replacing the previous one) and a new one is started, so the
//! trail never takes more than twice that.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::{fs, io};

use anyhow::anyhow;
use serde_json::Value;

use crate::core::ports::AuditSink;

pub const EVENTS_FILE: &str = "events.jsonl";

pub const EVENTS_ROTATED: &str = "events.jsonl.1";

pub const DEFAULT_MAX_BYTES: u64 = 10 * 1024 * 1024;

/// Smaller than this could not hold a few records (a record's detail is cut at 2 KiB).
pub const MIN_MAX_BYTES: u64 = 16 * 1024;

/// Appends to `<dir>/events.jsonl`, rotating past `max_bytes`. Each record is one `write(2)`
/// (in the page cache at once, so a killed process loses nothing); `sync` makes them durable
/// against a power cut, once per batch instead of once per line (a sweep of 2,000 registrations
/// appends 4,000 records).
pub struct EventsFile {
    pub dir: PathBuf,
    pub max_bytes: u64,
    /// The open file and its length, once the first record was appended.
    open: Option<(fs::File, u64)>,
    unsynced: bool,
}

/// Pure: whether a file of `current` bytes must be rotated before a line of `line` bytes.
pub fn must_rotate(current: u64, line: u64, max_bytes: u64) -> bool {
    current > 0 && current.saturating_add(line) > max_bytes
}

impl EventsFile {
    pub fn new(dir: &Path, max_bytes: u64) -> EventsFile {
        EventsFile {
            dir: dir.to_path_buf(),
            max_bytes,
            open: None,
            unsynced: false,
        }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join(EVENTS_FILE)
    }

    fn try_append(&mut self, line: &[u8]) -> io::Result<()> {
        let path = self.path();
        let current = match &self.open {
            Some((_, len)) => *len,
            // The entry itself: a symlink planted there is never followed (the open below
            // fails on it).
            None => match fs::symlink_metadata(&path) {
                Ok(m) => m.len(),
                Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
                Err(e) => return Err(e),
            },
        };
        if must_rotate(current, line.len() as u64, self.max_bytes) {
            if let Some((f, _)) = self.open.take() {
                f.sync_data()?;
            }
            fs::rename(&path, self.dir.join(EVENTS_ROTATED))?;
        }
        let (f, len) = match &mut self.open {
            Some(open) => open,
            None => {
                let f = fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .mode(0o600)
                    .custom_flags(crate::adapters::files::STATE_OPEN_FLAGS)
                    .open(&path)?;
                let len = f.metadata()?.len();
                self.open.insert((f, len))
            }
        };
        // One write of a whole line (O_APPEND): a crash leaves at most a cut last line, which
        // readers skip.
        f.write_all(line)?;
        *len += line.len() as u64;
        self.unsynced = true;
        Ok(())
    }
}

impl AuditSink for EventsFile {
    fn append(&mut self, record: &Value) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(record).map_err(|e| anyhow!("cannot encode: {e}"))?;
        line.push(b'\n');
        self.try_append(&line).map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                return anyhow!(
                    "cannot append to the audit trail: {}",
                    crate::adapters::files::open_error(&self.path(), &e)
                );
            }
            anyhow!(
                "cannot append to {} (rotated to {} past --events-max-bytes {}): {e}",
                self.path().display(),
                EVENTS_ROTATED,
                self.max_bytes
            )
        })
    }

    fn sync(&mut self) -> anyhow::Result<()> {
        if !self.unsynced {
            return Ok(());
        }
        if let Some((f, _)) = &self.open {
            f.sync_data()
                .map_err(|e| anyhow!("cannot fsync {}: {e}", self.path().display()))?;
        }
        self.unsynced = false;
        Ok(())
    }
}

/// The last records of the audit trail, and how many lines in the part read were not JSON
/// objects (a torn write, a corrupt file): skipped, and counted.
#[derive(Debug)]
pub struct Tail {
    pub records: Vec<Value>,
    pub skipped: usize,
}

/// The last `n` records of the trail (the rotated file too when the current one has fewer),
/// oldest first. Lines that are not JSON objects (a line cut by a crash) are skipped.
pub fn tail(dir: &Path, n: usize) -> anyhow::Result<Tail> {
    let mut out = tail_of(&dir.join(EVENTS_FILE), n)?;
    if out.records.len() < n {
        let mut older = tail_of(&dir.join(EVENTS_ROTATED), n - out.records.len())?;
        older.records.append(&mut out.records);
        older.skipped += out.skipped;
        out = older;
    }
    Ok(out)
}

/// Reads at most the last 256 KiB of `path` (records are a few hundred bytes).
fn tail_of(path: &Path, n: usize) -> anyhow::Result<Tail> {
    const WINDOW: u64 = 256 * 1024;
    let mut f = match crate::adapters::files::open_state_file(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(Tail {
                records: Vec::new(),
                skipped: 0,
            });
        }
        Err(e) => return Err(anyhow!("{}", crate::adapters::files::open_error(path, &e))),
    };
    let mut text = String::new();
    let read = f
        .metadata()
        .and_then(|m| {
            if !m.file_type().is_file() {
                return Err(io::Error::other(
                    "not a regular file (a directory or FIFO?)",
                ));
            }
            let start = m.len().saturating_sub(WINDOW);
            f.seek(SeekFrom::Start(start))?;
            let mut bytes = Vec::new();
            f.read_to_end(&mut bytes)?;
            text = String::from_utf8_lossy(&bytes).into_owned();
            Ok(start)
        })
        .map_err(|e| anyhow!("cannot read {}: {e}", path.display()))?;
    let mut lines: Vec<&str> = text.lines().collect();
    if read > 0 && !lines.is_empty() {
        lines.remove(0); // began mid-line
    }
    let records: Vec<Value> = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(Value::is_object)
        .collect();
    Ok(Tail {
        skipped: lines.len() - records.len(),
        records: records[records.len().saturating_sub(n)..].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::parse_bytes;
    use serde_json::json;

    #[test]
    fn rotation_only_past_the_bound_and_never_of_an_empty_file() {
        assert!(!must_rotate(0, 10_000, 100));
        assert!(!must_rotate(90, 10, 100));
        assert!(must_rotate(91, 10, 100));
    }

    #[test]
    fn sizes_parse_with_binary_units_and_a_minimum() {
        assert_eq!(parse_bytes("10MiB").unwrap(), 10 * 1024 * 1024);
        assert_eq!(parse_bytes("64KiB").unwrap(), 64 * 1024);
        assert_eq!(parse_bytes("1G").unwrap(), 1024 * 1024 * 1024);
        assert_eq!(parse_bytes("20000").unwrap(), 20_000);
        assert!(parse_bytes("1KiB").is_err(), "below the minimum");
        assert!(parse_bytes("ten").is_err());
        assert!(parse_bytes("10 parsecs").is_err());
        assert!(parse_bytes("99999999999999999999GiB").is_err());
    }

    #[test]
    fn the_trail_is_never_appended_or_read_through_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside.jsonl");
        fs::write(&outside, "{\"i\": 1}\n").unwrap();
        let state = dir.path().join("state");
        fs::create_dir(&state).unwrap();
        std::os::unix::fs::symlink(&outside, state.join(EVENTS_FILE)).unwrap();
        let mut f = EventsFile::new(&state, MIN_MAX_BYTES);
        let e = f.append(&json!({"i": 2})).unwrap_err().to_string();
        let path = state.join(EVENTS_FILE).display().to_string();
        assert!(e.contains(&path) && e.contains("symlink"), "{e}");
        assert_eq!(fs::read_to_string(&outside).unwrap(), "{\"i\": 1}\n");
        let e = tail(&state, 10).unwrap_err().to_string();
        assert!(e.contains(&path) && e.contains("symlink"), "{e}");
        // The rotated file too.
        fs::remove_file(state.join(EVENTS_FILE)).unwrap();
        std::os::unix::fs::symlink(&outside, state.join(EVENTS_ROTATED)).unwrap();
        let e = tail(&state, 10).unwrap_err().to_string();
        assert!(e.contains(EVENTS_ROTATED) && e.contains("symlink"), "{e}");
    }

    #[test]
    fn appends_rotates_and_tails_across_both_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = EventsFile::new(dir.path(), MIN_MAX_BYTES);
        for i in 0..400 {
            f.append(&json!({"i": i, "pad": "x".repeat(60)})).unwrap();
        }
        let cur = fs::metadata(dir.path().join(EVENTS_FILE)).unwrap().len();
        let old = fs::metadata(dir.path().join(EVENTS_ROTATED)).unwrap().len();
        assert!(cur <= MIN_MAX_BYTES && old <= MIN_MAX_BYTES, "{cur} {old}");
        let last = tail(dir.path(), 10).unwrap().records;
        let ids: Vec<i64> = last.iter().map(|v| v["i"].as_i64().unwrap()).collect();
        assert_eq!(ids, (390..400).collect::<Vec<_>>());
        // Nothing lost at the rotation: the current file continues where the rotated one ends.
        let first_current = tail_of(&dir.path().join(EVENTS_FILE), 1000)
            .unwrap()
            .records[0]["i"]
            .as_i64()
            .unwrap();
        let last_rotated = tail_of(&dir.path().join(EVENTS_ROTATED), 1)
            .unwrap()
            .records[0]["i"]
            .as_i64()
            .unwrap();
        assert_eq!(last_rotated + 1, first_current);
        // A current file with fewer than n records is completed from the rotated one.
        fs::write(dir.path().join(EVENTS_FILE), "{\"i\": 1000}\n{\"i\": 10").unwrap();
        let rotated: Vec<i64> = tail_of(&dir.path().join(EVENTS_ROTATED), 2)
            .unwrap()
            .records
            .iter()
            .map(|v| v["i"].as_i64().unwrap())
            .collect();
        let last = tail(dir.path(), 3).unwrap();
        let ids: Vec<i64> = last
            .records
            .iter()
            .map(|v| v["i"].as_i64().unwrap())
            .collect();
        assert_eq!(
            ids,
            vec![rotated[0], rotated[1], 1000],
            "the cut last line is skipped"
        );
        assert_eq!(last.skipped, 1, "and counted");
    }
}
