//! `status`: reads the state directory (no lock, writes nothing) and prints what it found;
//! with `--remote` also what the pool owns outside this host (`remote`).

mod remote;

use std::fs;
use std::path::Path;

use serde_json::{Value, json};

use crate::adapters::files::{
    load_counters, read_backoff_file, read_holds_file, read_state_file, read_state_text,
    writable_by_others,
};
use crate::adapters::pg_store::PgStore;
use crate::cli::{OutputFormat, StatusArgs};
use crate::commands::config::slot_dir;
use crate::commands::exit::{EXIT_FAILED, EXIT_OK, Fatal, usage};
use crate::commands::record::LAST_RUN_FILE;
use crate::core::backoff::{BACKOFF_FILE, Backoff};
use crate::core::holds::{HOLDS_FILE, Hold};
use crate::core::metrics::Counters;
use crate::core::pool::PoolView;
use crate::core::state::{CycleState, STATE_FILE};
use crate::core::status::{EVENTS_SHOWN, Limits, MAX_LAST_RUN_BYTES, facts, warnings};
use crate::core::time::Timestamp;

pub fn cmd_status(a: StatusArgs) -> Result<u8, Fatal> {
    let slot = slot_dir(&a.local)?;
    let dir = slot.dir();
    // Read-only and often run by root: the owner is not ours to judge here, only that the
    // directory is there (a typo must not look like a host where no run happened yet).
    let unsafe_mode = match fs::metadata(&dir) {
        Ok(m) if m.is_dir() => writable_by_others(&dir, &m),
        Ok(_) => {
            return Err(usage(format!(
                "state directory {} is not a directory; point --state-dir at the pool's state directory",
                dir.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(usage(format!(
                "state directory {} does not exist: is --state-dir right? (the service creates it when it first starts; under the Ansible role it is /var/lib/ci-ephemeral-provisioner/<pool>)",
                dir.display()
            )));
        }
        Err(e) => {
            return Err(Fatal(
                EXIT_FAILED,
                format!("cannot inspect state directory {}: {e}", dir.display()),
            ));
        }
    };
    let limits = crate::core::status::Limits {
        max_success_age: a.max_success_age,
        max_cycle_duration: a.max_cycle_duration,
    };
    let mut pg = crate::commands::wiring::pg_store(&a.local, "", false)?;
    let mut doc = gather(
        &dir,
        &slot.pool,
        &limits,
        crate::adapters::clock::wall_now(),
        pg.as_mut(),
    );
    // A run refuses such a directory (exit 2): as much a warning as a failed run.
    if let Some(why) = unsafe_mode
        && let Some(w) = doc["warnings"].as_array_mut()
    {
        w.insert(0, why.into());
        doc["healthy"] = false.into();
    }
    if a.remote.remote {
        doc["remote"] = remote::gather(
            &a.remote,
            &slot,
            crate::adapters::clock::wall_now(),
            pg.as_mut(),
        )?;
    }
    match a.local.output {
        OutputFormat::Json => {
            println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        }
        OutputFormat::Text => {
            println!("{}", crate::core::status::text(&doc));
            if a.remote.remote {
                // Names and errors come from Forgejo and tofu: one line each, escaped.
                for l in crate::core::status::remote::text_lines(&doc["remote"]) {
                    println!("{}", crate::core::escape::escape_controls(&l));
                }
            }
        }
    }
    let healthy = doc["healthy"].as_bool().unwrap_or(false);
    // What could not be read outside this host is a failure, as a run's would be.
    let unread = ["forgejo", "tofu"]
        .iter()
        .any(|k| !doc["remote"][k]["error"].is_null());
    Ok(if (a.check && !healthy) || unread {
        EXIT_FAILED
    } else {
        EXIT_OK
    })
}

/// Everything `status` shows, as one JSON document (the text form is rendered from it).
/// `dir` is the slot's directory, `pool` the pool's (where `backoff.json` is).
/// With `--store pg` (`pg`), the slot's cycle, holds and the backoff come from the pool store,
/// and the pool's hosts, their leases and its recent adoptions are shown.
pub fn gather(
    dir: &Path,
    pool: &Path,
    limits: &Limits,
    now: Timestamp,
    pg: Option<&mut PgStore>,
) -> Value {
    let mut found = Found::read(dir, pool, now);
    let pool_view = pg.map(|pg| found.read_pg(pg, now));
    let Found {
        unreadable,
        cycle,
        cycle_error,
        last_run,
        last_run_error,
        counters,
        counters_error,
        held,
        backoff,
    } = found;
    let (events, events_skipped, events_error) =
        match crate::adapters::events_file::tail(dir, EVENTS_SHOWN) {
            Ok(t) => (t.records, t.skipped, None),
            Err(e) => (Vec::new(), 0, Some(format!("{e:#}"))),
        };
    let pickup = crate::core::metrics::pickup_summary(
        counters
            .iter()
            .flat_map(|c| c.pickups.recent_ms.iter().copied()),
    );
    let pool_pickup = pool_pickups(pool);
    let mut f = facts(
        counters.as_ref(),
        last_run.as_ref(),
        cycle.as_ref(),
        unreadable,
    );
    f.backoff = backoff.as_ref().and_then(|b| b.closed(now));
    let mut warnings = warnings(&f, limits, now);
    for h in pool_view.iter().flatten().flat_map(|v| &v.hosts) {
        if h.lapsed && !h.cycles.is_empty() {
            warnings.push(format!(
                "host {}'s lease lapsed (last renewed {}s ago) with {}: a live host of the pool adopts and tears it down at its next run",
                h.host_id,
                h.renewed_seconds_ago,
                h.cycles.join(", ")
            ));
        }
    }
    let secs_since = |t: Option<Timestamp>| t.map(|t| now.since(t).as_secs());
    let last_run_end = last_run
        .as_ref()
        .and_then(|r| r["finished_at"].as_str())
        .and_then(|s| Timestamp::parse_rfc3339(s).ok());
    json!({
        "state_dir": dir.display().to_string(),
        "healthy": warnings.is_empty(),
        "warnings": warnings,
        "cycle_id": cycle.as_ref().map(|c| c.cycle_id.clone()),
        "cycle": cycle,
        "cycle_age_seconds": secs_since(cycle.as_ref().map(|c| c.started_at)),
        "cycle_error": cycle_error,
        "last_run": last_run,
        "last_run_age_seconds": secs_since(last_run_end),
        "last_run_error": last_run_error,
        "last_success_at": f.last_success,
        "last_success_age_seconds": secs_since(f.last_success),
        "counters_error": counters_error,
        "held_jobs": held,
        "pickup": pickup,
        "pool_pickup": pool_pickup,
        "backoff": backoff,
        "backing_off": f.backoff,
        "events": events,
        "events_skipped": events_skipped,
        "events_error": events_error,
        "pool": pool_view,
    })
}

/// What `status` read of the slot's and the pool's state files. A file that cannot be read is
/// named in `unreadable` (a warning), in the order read, and its error kept beside its value.
struct Found {
    unreadable: Vec<String>,
    cycle: Option<CycleState>,
    cycle_error: Option<String>,
    last_run: Option<Value>,
    last_run_error: Option<String>,
    /// None when there are none yet (all zero).
    counters: Option<Counters>,
    counters_error: Option<String>,
    /// The holds in force at `now`.
    held: Vec<Hold>,
    backoff: Option<Backoff>,
}

impl Found {
    /// The slot's cycle, holds and the pool's backoff from the pool store instead of the state
    /// directory; the pool's hosts and recent events (`None` when they cannot be read: named in
    /// `unreadable`).
    fn read_pg(&mut self, pg: &mut PgStore, now: Timestamp) -> Option<PoolView> {
        match pg.read_slot() {
            Ok((cycle, holds, _, backoff)) => {
                self.cycle = cycle;
                self.cycle_error = None;
                self.held = holds.active(now).cloned().collect();
                self.backoff = Some(backoff);
            }
            Err(e) => {
                self.unreadable
                    .push(format!("the pool store is unreadable: {e:#}"));
                self.cycle_error = Some(format!("{e:#}"));
            }
        }
        match pg.inspect() {
            Ok((view, _)) => Some(view),
            Err(e) => {
                self.unreadable
                    .push(format!("the pool's hosts are unreadable: {e:#}"));
                None
            }
        }
    }

    fn read(dir: &Path, pool: &Path, now: Timestamp) -> Found {
        let mut unreadable = Vec::new();
        let (cycle, cycle_error) = match read_state_file(&dir.join(STATE_FILE)) {
            Ok(c) => (c, None),
            Err(e) => {
                unreadable.push(format!("cycle.json is unreadable: {e:#}"));
                (None, Some(format!("{e:#}")))
            }
        };
        let (last_run, last_run_error) = match read_last_run(&dir.join(LAST_RUN_FILE)) {
            Ok(v) => (v, None),
            Err(e) => {
                unreadable.push(e.clone());
                (None, Some(e))
            }
        };
        let (counters, counters_error) = match load_counters(dir) {
            Ok(c) if c == Counters::default() => (None, None),
            Ok(c) => (Some(c), None),
            Err(e) => {
                unreadable.push(format!("{e:#}"));
                (None, Some(format!("{e:#}")))
            }
        };
        let held = match read_holds_file(&dir.join(HOLDS_FILE)) {
            Ok(h) => h.active(now).cloned().collect(),
            Err(e) => {
                unreadable.push(e.to_string());
                Vec::new()
            }
        };
        let backoff = read_backoff_file(&pool.join(BACKOFF_FILE))
            .inspect_err(|e| unreadable.push(format!("{e:#}")))
            .ok();
        Found {
            unreadable,
            cycle,
            cycle_error,
            last_run,
            last_run_error,
            counters,
            counters_error,
            held,
            backoff,
        }
    }
}

/// last-run.json as JSON; none when there is no such file.
fn read_last_run(path: &Path) -> Result<Option<Value>, String> {
    match read_state_text(path, MAX_LAST_RUN_BYTES) {
        Ok(None) => Ok(None),
        Err(e) => Err(e.to_string()),
        Ok(Some(t)) => serde_json::from_str(&t)
            .map(Some)
            .map_err(|e| format!("{} is not JSON: {e}", path.display())),
    }
}

/// The pickup times of every slot of the pool together (each slot's last ones), when the pool
/// has more than one slot directory; `None` otherwise. A slot whose counters cannot be read is
/// left out (the slot's own `status` names the file).
fn pool_pickups(pool: &Path) -> Option<Value> {
    let dirs = crate::adapters::files::pool_slot_dirs(pool).ok()?;
    if dirs.len() < 2 {
        return None;
    }
    let mut ms = Vec::new();
    for (_, dir) in &dirs {
        if let Ok(c) = load_counters(dir) {
            ms.extend(c.pickups.recent_ms);
        }
    }
    let summary = crate::core::metrics::pickup_summary(ms)?;
    Some(json!({"slots": dirs.len(), "summary": summary}))
}
