//! The one place that picks the ports' implementations: a live run, or a dry-run against a
//! fixture or against Forgejo itself. `run` and `sweep` then drive whatever this returns the same
//! way; only where the result goes ([`Outlet`]) differs.

use std::fmt::Debug;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::adapters::clock::{RealClock, wall_now};
use crate::adapters::dry::{
    DryClock, DryForgejo, DryLauncher, DryTofu, Fixture, FixtureForgejo, MemoryStore, Plan,
    ReadErrors,
};
use crate::adapters::files::{
    FileStore, Lock, SlotDir, read_holds_file, read_state_file, take_lock,
};
use crate::adapters::forgejo_http::{HttpForgejo, Scope, load_ca_file};
use crate::adapters::launch_cmd::CommandLauncher;
use crate::adapters::logging::log_config;
use crate::adapters::pg_store::{ConnSpec, PgStore};
use crate::adapters::signals::{ReloadFlag, StopFlag};
use crate::adapters::tofu_cli::{CliTofu, TOFU_DATA_DIR};
use crate::cli::{DryRunArgs, ForgejoArgs, RunArgs, SweepArgs};
use crate::commands::config::{forgejo_target, metrics_target, pool_slot, read_token, slot_dir};
use crate::commands::exit::{EXIT_FAILED, EXIT_OK, EXIT_USAGE, Fatal, failed, usage};
use crate::commands::record::{announce_run, events_file, finish, print_plan};
use crate::core::backoff::Backoff;
use crate::core::claims::Others;
use crate::core::holds::{HOLDS_FILE, Holds};
use crate::core::ports::{Clock, Forgejo, Launcher, StateStore, Tofu};
use crate::core::report::{Outcome, Report};
use crate::core::secret::Secret;
use crate::core::state::{CycleState, STATE_FILE};
use crate::core::sweep::licence::{DestroyRecord, SweepLicence, without_cycle};
use crate::core::time::Timestamp;
use crate::driver::cycle::{End, World};

/// Where Forgejo is said to be in a fixture dry-run's plan and report.
const FIXTURE_URL: &str = "https://forgejo.invalid";

/// The ports a cycle runs on.
pub(crate) struct Ports {
    pub forgejo: Box<dyn Forgejo>,
    pub tofu: Box<dyn Tofu>,
    pub launcher: Box<dyn Launcher>,
    pub store: Box<dyn StateStore>,
    pub clock: Box<dyn Clock>,
}

impl Ports {
    pub fn world(&mut self) -> World<'_> {
        World {
            forgejo: &mut *self.forgejo,
            tofu: &mut *self.tofu,
            launcher: &mut *self.launcher,
            store: &mut *self.store,
            clock: &mut *self.clock,
        }
    }
}

/// Where a command's result goes.
pub(crate) enum Outlet {
    /// Kept in `dir` (last-run.json, the counters, the metrics file), added to the audit trail
    /// and printed. The state directory's lock is held until the outlet is dropped.
    Live { dir: PathBuf, _lock: Lock },
    /// Only the plan is printed: what a live run would do. The dry-run fails when a read of the
    /// world failed (the plan is then incomplete).
    Dry { plan: Plan, read_errors: ReadErrors },
}

impl Outlet {
    /// Ends the command with `report`: kept and printed (live), or the plan printed (dry-run).
    pub fn close(self, report: Report, end: End, common: &ForgejoArgs) -> Result<u8, Fatal> {
        match self {
            Outlet::Live { dir, _lock } => finish(
                report,
                end,
                Some(&dir),
                common.local.output,
                metrics_target(common),
            ),
            Outlet::Dry { plan, read_errors } => {
                let mut report = report;
                let actions: Vec<Value> = plan.borrow().clone();
                if let End::Config(msg) = end {
                    // Where a live run would stop with a configuration error: the plan up to
                    // there, and why (exit 2, as the live run).
                    report.fail(msg);
                    report.outcome = Outcome::ConfigurationError;
                    print_plan(&actions, &report, common.local.output);
                    return Ok(EXIT_USAGE);
                }
                print_plan(&actions, &report, common.local.output);
                // The plan's own failures (a hard-deadline teardown, say) are what the run
                // would report; the dry-run itself failed only when it could not read the world.
                Ok(if read_errors.get() == 0 {
                    EXIT_OK
                } else {
                    EXIT_FAILED
                })
            }
        }
    }
}

/// A provisioner cycle, ready to run.
pub(crate) struct CycleRun {
    pub ports: Ports,
    pub report: Report,
    pub outlet: Outlet,
    /// The Forgejo the cycle talks to, for its runners' configuration.
    pub forgejo_url: String,
}

/// The implementations for `run` (`label_names`: the labels the pool serves, for the HTTP client).
pub(crate) fn cycle(
    a: &RunArgs,
    dry: &DryRunArgs,
    label_names: &[String],
) -> Result<CycleRun, Fatal> {
    let c = &a.common;
    if dry.dry_run {
        log_config(&(a, dry), None, None);
        return dry_cycle(a, dry, label_names);
    }
    let Live {
        url,
        forgejo,
        slot,
        dir,
        lock,
        store,
    } = live(a, c, label_names, true)?;
    let stop = StopFlag::install().map_err(failed)?;
    let reload = ReloadFlag::install().map_err(failed)?;
    let clock = RealClock::new(stop.clone(), reload).with_wake_file(a.wake_file.clone());
    let report = live_report("run", &clock, &dir, c);
    Ok(CycleRun {
        ports: Ports {
            forgejo: Box::new(forgejo),
            tofu: Box::new(tofu(a, &slot, stop.clone())),
            launcher: Box::new(launcher(a, stop)),
            store,
            clock: Box::new(clock),
        },
        report,
        outlet: Outlet::Live { dir, _lock: lock },
        forgejo_url: url,
    })
}

/// A dry-run cycle: the world read from the fixture, or from Forgejo and the state directory;
/// every write recorded in the plan instead.
fn dry_cycle(a: &RunArgs, flags: &DryRunArgs, label_names: &[String]) -> Result<CycleRun, Fatal> {
    let c = &a.common;
    // Against Forgejo, the plan stops where a live run with these flags would: at a tofu or
    // launch command it cannot run (checked read-only, as a run checks them). A fixture's
    // world is made up: its plan needs neither.
    let (tofu_refusal, launch_refusal) = match flags.fixture {
        Some(_) => (None, None),
        None => {
            let slot = slot_dir(&c.local)?;
            let stop = StopFlag::default();
            let why = |r: anyhow::Result<()>| r.err().map(|e| format!("{e:#}"));
            (
                why(tofu(a, &slot, stop.clone()).check_config()),
                why(launcher(a, stop).check_config()),
            )
        }
    };
    let w = dry_world(c, flags, label_names, |source| match source {
        DrySource::Fixture { cycle } => Ok(MemoryStore {
            state: *cycle,
            holds: Holds::default(),
            others: Others::default(),
            backoff: Backoff::new(),
        }),
        DrySource::Slot(slot) => read_slot(slot, &c.local),
    })?;
    Ok(CycleRun {
        ports: Ports {
            forgejo: Box::new(w.forgejo),
            tofu: Box::new(DryTofu {
                plan: w.plan.clone(),
                refusal: tofu_refusal,
            }),
            launcher: Box::new(DryLauncher {
                plan: w.plan,
                refusal: launch_refusal,
            }),
            store: Box::new(w.found),
            clock: Box::new(DryClock { now: w.now }),
        },
        report: Report::new("run", true, w.now),
        outlet: w.outlet,
        forgejo_url: w.url,
    })
}

/// A slot's files (or its rows in the pool store) as a dry-run's store: read once, never
/// written.
fn read_slot(slot: &SlotDir, local: &crate::cli::LocalArgs) -> Result<MemoryStore, Fatal> {
    if let Some(mut pg) = pg_store(local, "", false)? {
        let (state, holds, others, backoff) = pg.read_slot().map_err(failed)?;
        return Ok(MemoryStore {
            state,
            holds,
            others,
            backoff,
        });
    }
    let dir = slot.dir();
    let state = read_state_file(&dir.join(STATE_FILE)).map_err(failed)?;
    let holds =
        read_holds_file(&dir.join(HOLDS_FILE)).map_err(|e| Fatal(EXIT_FAILED, format!("{e:#}")))?;
    let mut files = FileStore::slot(slot.clone());
    let others = files.others().map_err(failed)?;
    let backoff = files.load_backoff().map_err(failed)?;
    Ok(MemoryStore {
        state,
        holds,
        others,
        backoff,
    })
}

/// A sweep, ready to run with its licence, or refused (a live sweep records why).
pub(crate) struct SweepRun {
    pub forgejo: Box<dyn Forgejo>,
    /// Where the pool's other slots are read from (what they hold is spared).
    pub store: Box<dyn StateStore>,
    pub clock: Box<dyn Clock>,
    pub report: Report,
    pub outlet: Outlet,
    pub licence: Result<SweepLicence, Refusal>,
}

/// Why a sweep may not run: a cycle is in progress, or cycle.json cannot be read.
pub(crate) struct Refusal {
    pub message: String,
    /// The cycle in progress, for the report.
    pub cycle_id: Option<String>,
}

/// The implementations for `sweep`, and its licence from cycle.json (read under the lock). A
/// dry-run that has none is refused at once (exit 1), before it asks Forgejo anything.
pub(crate) fn sweep(a: &SweepArgs) -> Result<SweepRun, Fatal> {
    let c = &a.common;
    let refused = |r: Refusal| Fatal(EXIT_FAILED, r.message);
    if a.dry.dry_run {
        log_config(a, None, None);
        let w = dry_world(c, &a.dry, &[], |source| match source {
            DrySource::Fixture { cycle } => {
                let licence = sweep_licence(Ok(*cycle), "the fixture", || None);
                let store: Box<dyn StateStore> = Box::new(MemoryStore {
                    state: None,
                    holds: Holds::default(),
                    others: Others::default(),
                    backoff: Backoff::new(),
                });
                Ok((licence.map_err(refused)?, store))
            }
            DrySource::Slot(slot) => {
                if let Some(pg) = pg_store(&c.local, "", false)? {
                    let source = pg.describe();
                    let found = read_slot(slot, &c.local)?;
                    let licence = sweep_licence(Ok(found.state.clone()), &source, || None);
                    let store: Box<dyn StateStore> = Box::new(found);
                    return Ok((licence.map_err(refused)?, store));
                }
                let path = slot.dir().join(STATE_FILE);
                let cycle = read_state_file(&path);
                let licence = sweep_licence(cycle, &path.display().to_string(), || None);
                let store: Box<dyn StateStore> = Box::new(FileStore::slot(slot.clone()));
                Ok((licence.map_err(refused)?, store))
            }
        })?;
        let (licence, store) = w.found;
        return Ok(SweepRun {
            forgejo: Box::new(w.forgejo),
            store,
            clock: Box::new(DryClock { now: w.now }),
            report: Report::new("sweep", true, w.now),
            outlet: w.outlet,
            licence: Ok(licence),
        });
    }
    let Live {
        forgejo,
        dir,
        lock,
        mut store,
        ..
    } = live(a, c, &[], false)?;
    let clock = RealClock::new(StopFlag::default(), ReloadFlag::default());
    let report = live_report("sweep", &clock, &dir, c);
    let path = dir.join(STATE_FILE);
    let source = match c.local.store {
        crate::cli::StoreKind::Files => path.display().to_string(),
        crate::cli::StoreKind::Pg => store.describe(),
    };
    let licence = sweep_licence(store.load(), &source, || last_destroy(&dir));
    Ok(SweepRun {
        forgejo: Box::new(forgejo),
        store,
        clock: Box::new(clock),
        report,
        outlet: Outlet::Live { dir, _lock: lock },
        licence,
    })
}

/// The sweep's licence from what cycle.json holds (`source` names where it was read): none while
/// a cycle is in progress or the file cannot be read. The evidence names the last successful
/// destroy, read only when there is a licence.
fn sweep_licence(
    cycle: anyhow::Result<Option<CycleState>>,
    source: &str,
    last_destroy: impl FnOnce() -> Option<DestroyRecord>,
) -> Result<SweepLicence, Refusal> {
    match cycle {
        Ok(cycle) => {
            let last = cycle.is_none().then(last_destroy).flatten();
            let licence = without_cycle(cycle.as_ref(), source, last.as_ref());
            licence.map_err(|e| Refusal {
                message: format!("{e:#}"),
                cycle_id: cycle.map(|s| s.cycle_id),
            })
        }
        Err(e) => Err(Refusal {
            message: format!("{e:#}; the sweep is refused"),
            cycle_id: None,
        }),
    }
}

/// Why a `sweep` of this slot would be refused now (`status --remote`), by the sweep's own
/// licence: what cycle.json at `path` holds, or that it cannot be read.
pub(crate) fn sweep_refusal(path: &Path) -> Option<String> {
    sweep_licence(read_state_file(path), &path.display().to_string(), || None)
        .err()
        .map(|r| r.message)
}

/// The last `tofu destroy` that succeeded, from the counters, for the sweep's evidence.
fn last_destroy(dir: &Path) -> Option<DestroyRecord> {
    match crate::adapters::files::load_counters(dir) {
        Ok(k) => k.last_destroy_ok,
        Err(e) => {
            log::warn!("{e:#}; the sweep's evidence cannot name the last successful destroy");
            None
        }
    }
}

/// What every live command sets up first, in this order: where Forgejo is, the token, the
/// logged configuration, the HTTP client (then the token is dropped), the state directory's lock.
struct Live {
    url: String,
    forgejo: HttpForgejo,
    slot: SlotDir,
    /// The slot's directory.
    dir: PathBuf,
    lock: Lock,
    /// The slot's files, or its rows in the pool store (`--store pg`).
    store: Box<dyn StateStore>,
}

/// `run`: the pool store renews the host's lease while the run lasts and adopts a lapsed
/// host's cycle into a slot that has none.
fn live(
    args: &dyn Debug,
    c: &ForgejoArgs,
    label_names: &[String],
    run: bool,
) -> Result<Live, Fatal> {
    let (url, scope) = forgejo_target(c)?;
    let slot = slot_dir(&c.local)?;
    let pg = pg_store(&c.local, &url, run)?;
    let token = read_token(&c.target.token_file)?;
    let dir = slot.dir();
    log_config(args, Some(&token), Some(&dir));
    let forgejo = http_forgejo(c, &url, scope, &token, label_names)?;
    drop(token);
    let lock = take_lock(&slot)?;
    let store: Box<dyn StateStore> = match pg {
        Some(pg) => Box::new(pg),
        None => Box::new(FileStore::slot(slot.clone())),
    };
    Ok(Live {
        url,
        forgejo,
        slot,
        dir,
        lock,
        store,
    })
}

/// The pool store of this slot with `--store pg` (`PG_CONN_STR` read and checked; nothing
/// connected yet), `None` with the files store. `run`: it renews the lease and adopts.
pub(crate) fn pg_store(
    local: &crate::cli::LocalArgs,
    forgejo: &str,
    run: bool,
) -> Result<Option<PgStore>, Fatal> {
    let Some(me) = pool_slot(local, forgejo)? else {
        return Ok(None);
    };
    let spec = ConnSpec::from_env().map_err(|e| usage(format!("{e:#}")))?;
    Ok(Some(PgStore::new(spec, me, run)))
}

/// Where a dry-run reads what it finds beside Forgejo.
enum DrySource<'a> {
    /// The fixture, and the cycle it holds (boxed: a cycle is large beside a reference).
    Fixture { cycle: Box<Option<CycleState>> },
    /// The slot's directory (read, never written nor locked).
    Slot(&'a SlotDir),
}

/// A dry-run's world: its Forgejo (reads pass through to the fixture or to Forgejo itself,
/// writes go to the plan), the plan, the outlet that prints it, what the command read beside
/// Forgejo, the time, and where Forgejo is said to be.
struct DryWorld<T> {
    forgejo: DryForgejo,
    plan: Plan,
    outlet: Outlet,
    found: T,
    now: Timestamp,
    url: String,
}

/// The dry world of `run` and `sweep`: from the fixture (`--fixture`), or from Forgejo itself:
/// where it is, the token, then `read` of the state directory, then the HTTP client.
fn dry_world<T>(
    c: &ForgejoArgs,
    flags: &DryRunArgs,
    label_names: &[String],
    read: impl FnOnce(DrySource<'_>) -> Result<T, Fatal>,
) -> Result<DryWorld<T>, Fatal> {
    let (world, found, now, url): (Box<dyn Forgejo>, _, _, _) = match &flags.fixture {
        Some(path) => {
            let fx = load_fixture(path, label_names)?;
            let found = read(DrySource::Fixture {
                cycle: Box::new(fx.cycle),
            })?;
            let now = fx.now.unwrap_or_else(wall_now);
            (fx.forgejo, found, now, FIXTURE_URL.to_string())
        }
        None => {
            let (url, scope) = forgejo_target(c)?;
            let slot = slot_dir(&c.local)?;
            let token = read_token(&c.target.token_file)?;
            let found = read(DrySource::Slot(&slot))?;
            let forgejo = http_forgejo(c, &url, scope, &token, label_names)?;
            (Box::new(forgejo), found, wall_now(), url)
        }
    };
    let plan = Plan::default();
    let forgejo = DryForgejo::new(world, plan.clone());
    let outlet = Outlet::Dry {
        plan: plan.clone(),
        read_errors: forgejo.read_errors(),
    };
    Ok(DryWorld {
        forgejo,
        plan,
        outlet,
        found,
        now,
        url,
    })
}

/// The Forgejo client of a live run or a live dry-run.
pub(crate) fn http_forgejo(
    common: &ForgejoArgs,
    url: &str,
    scope: Scope,
    token: &Secret,
    label_names: &[String],
) -> Result<HttpForgejo, Fatal> {
    let ca = match &common.target.ca_file {
        Some(path) => Some(load_ca_file(path).map_err(|e| usage(format!("--ca-file: {e:#}")))?),
        None => None,
    };
    Ok(HttpForgejo::new(
        url,
        scope,
        token,
        label_names,
        common.target.http_timeout,
        ca.as_deref(),
    ))
}

/// The tofu CLI of a live run (and of `check`'s probe of it).
pub(crate) fn tofu(a: &RunArgs, slot: &SlotDir, stop: StopFlag) -> CliTofu {
    let pool = (a.common.local.store == crate::cli::StoreKind::Pg)
        .then(|| a.common.local.pool.clone())
        .flatten();
    slot_tofu(
        &a.module.tofu_bin,
        a.module.tofu_dir.as_deref(),
        slot,
        pool,
        stop,
    )
}

/// The tofu CLI of a slot: `bin` on the module in `dir`; `pool` with `--store pg` (also
/// `status --remote`'s).
pub(crate) fn slot_tofu(
    bin: &Path,
    dir: Option<&Path>,
    slot: &SlotDir,
    pool: Option<String>,
    stop: StopFlag,
) -> CliTofu {
    CliTofu {
        bin: bin.to_path_buf(),
        dir: dir.map(Path::to_path_buf),
        slot: slot.k,
        pinned: slot.n > 1,
        pool,
        timeout: None,
        // Absolute: tofu runs with -chdir into the module directory.
        data_dir: (slot.k != 1).then(|| {
            let d = slot.dir().join(TOFU_DATA_DIR);
            std::path::absolute(&d).unwrap_or(d)
        }),
        stop,
    }
}

/// The launch command of a live run (and of `check`'s probe of it).
pub(crate) fn launcher(a: &RunArgs, stop: StopFlag) -> CommandLauncher {
    CommandLauncher {
        command: a.launch_command.clone(),
        timeout: a.grace.launch_timeout,
        stop,
    }
}

/// A live run's report: on the run's clock, written to the audit trail as it goes, and announced
/// in the metrics file.
fn live_report(command: &str, clock: &RealClock, dir: &Path, c: &ForgejoArgs) -> Report {
    let mut report = Report::new(command, false, clock.now());
    let report_clock = clock.clone();
    report.set_clock(Box::new(move || report_clock.now()));
    report.set_audit(events_file(dir, c));
    announce_run(dir, metrics_target(c), report.started_at);
    report
}

/// A fixture's world as a read-only Forgejo, its cycle and its `now`.
struct FixtureWorld {
    forgejo: Box<dyn Forgejo>,
    cycle: Option<CycleState>,
    now: Option<crate::core::time::Timestamp>,
}

fn load_fixture(path: &Path, label_names: &[String]) -> Result<FixtureWorld, Fatal> {
    let fx = Fixture::load(path).map_err(|e| usage(format!("{e:#}")))?;
    Ok(FixtureWorld {
        forgejo: Box::new(FixtureForgejo {
            runners: fx.runners,
            jobs: fx.jobs,
            label_names: label_names.to_vec(),
        }),
        cycle: fx.cycle,
        now: fx.now,
    })
}
