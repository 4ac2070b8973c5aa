//! `check --boot`: the canary (`driver::canary`) with the pool's own module and launch command,
//! under the slot's lock, as the `boot` line of `check`.

use std::time::Duration;

use serde_json::{Value, json};

use crate::adapters::clock::RealClock;
use crate::adapters::files::{FileStore, StateDirError, take_lock};
use crate::adapters::signals::{ReloadFlag, StopFlag};
use crate::cli::RunArgs;
use crate::cli::StoreKind;
use crate::commands::config::{MetricsTarget, metrics_target, slot_dir};
use crate::commands::exit::Fatal;
use crate::commands::record::rewrite_metrics;
use crate::commands::wiring;
use crate::core::holds::{Holds, HoldsError};
use crate::core::ports::StateStore;
use crate::core::state::CycleState;
use crate::driver::canary::{Canary, CanaryConfig, CanaryEnd, CanaryWorld, Timed};

/// The canary's line of `check`, and whether it was refused (exit 75: try again later).
pub struct Boot {
    pub result: Result<String, String>,
    pub refused: bool,
    /// What the JSON output adds to the line: the steps and their durations.
    pub detail: Value,
}

/// The line of a canary that was not started; `refused`: the slot is busy (exit 75).
fn not_booted(why: impl std::fmt::Display, refused: bool) -> Boot {
    Boot {
        result: Err(format!("not booted: {why}")),
        refused,
        detail: if refused {
            json!({"refused": true})
        } else {
            json!({})
        },
    }
}

/// Boots one VM with the pool's module, probes it with its launch command and destroys it.
pub fn boot(a: &RunArgs, forgejo_url: &str) -> Boot {
    let slot = match slot_dir(&a.common.local) {
        Ok(s) => s,
        Err(Fatal(_, msg)) => return not_booted(msg, false),
    };
    // One run of a slot at a time: a cycle's run, or this canary.
    let _lock = match take_lock(&slot) {
        Ok(l) => l,
        Err(StateDirError::Locked(m)) => {
            return not_booted(format!("{m}: a run of this slot is going on"), true);
        }
        Err(e) => return not_booted(Fatal::from(e).1, false),
    };
    // SIGTERM: the running step gets SIGINT, the canary stops with cycle.json kept.
    let stop = match StopFlag::install() {
        Ok(s) => s,
        Err(e) => return not_booted(format!("{e:#}"), false),
    };
    let mut tofu = wiring::tofu(a, &slot, stop.clone());
    let mut launcher = wiring::launcher(a, stop.clone());
    // With the files store the slot's metrics file counts the canary's VM in cycle_active (the
    // pool store's metrics are a run's, from its rows: left alone).
    let mut store = Announced {
        files: FileStore::slot(slot.clone()),
        dir: slot.dir(),
        metrics: metrics_target(&a.common).filter(|_| a.common.local.store == StoreKind::Files),
    };
    let mut clock = RealClock::new(stop, ReloadFlag::default());
    let labels = a.labels.clone().unwrap_or_default();
    let c = crate::driver::canary::run(
        &mut CanaryWorld {
            tofu: &mut tofu,
            launcher: &mut launcher,
            store: &mut store,
            clock: &mut clock,
        },
        &CanaryConfig {
            labels: &labels,
            forgejo_url,
            runner_prefix: &a.common.target.runner_prefix,
            slot: slot.k,
        },
    );
    report(&c)
}

/// The slot's cycle.json, and after each change of it the slot's metrics file: the canary's VM
/// counts in `cycle_active` while it may exist, as a cycle's does.
struct Announced<'a> {
    files: FileStore,
    dir: std::path::PathBuf,
    metrics: Option<MetricsTarget<'a>>,
}

impl Announced<'_> {
    fn announce(&self) {
        if let Some(target) = &self.metrics {
            rewrite_metrics(&self.dir, target, None);
        }
    }
}

impl StateStore for Announced<'_> {
    fn load(&mut self) -> anyhow::Result<Option<CycleState>> {
        self.files.load()
    }
    fn save(&mut self, state: &CycleState) -> anyhow::Result<()> {
        self.files.save(state)?;
        self.announce();
        Ok(())
    }
    fn remove(&mut self) -> anyhow::Result<()> {
        self.files.remove()?;
        self.announce();
        Ok(())
    }
    fn describe(&self) -> String {
        self.files.describe()
    }
    fn load_holds(&mut self) -> Result<Holds, HoldsError> {
        self.files.load_holds()
    }
    fn save_holds(&mut self, holds: &Holds) -> anyhow::Result<()> {
        self.files.save_holds(holds)
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

fn step_json<T: serde::Serialize>(t: Option<&Timed<T>>) -> Value {
    match t {
        None => Value::Null,
        Some(t) => json!({
            "seconds": (t.took.as_secs_f64() * 10.0).round() / 10.0,
            "ok": t.result.is_ok(),
            "detail": match &t.result { Ok(v) => json!(v), Err(e) => json!(e) },
        }),
    }
}

/// The `boot` line: the runner's version and how long apply, readiness and destroy took.
fn report(c: &Canary) -> Boot {
    let took = |t: &Option<Timed<_>>| t.as_ref().map(|t: &Timed<_>| secs(t.took));
    let mut times = Vec::new();
    if let Some((id, t)) = &c.leftover {
        times.push(format!(
            "first destroyed leftover canary {id} in {}",
            secs(t.took)
        ));
    }
    if let Some(s) = took(&c.apply) {
        times.push(format!("apply {s}"));
    }
    if let Some(p) = &c.probe {
        times.push(format!("ready in {}", secs(p.took)));
    }
    if let Some(s) = took(&c.destroy) {
        times.push(format!("destroy {s}"));
    }
    let times = times.join(", ");
    let detail = json!({
        "cycle_id": c.cycle_id,
        "leftover": c.leftover.as_ref().map(|(id, t)| json!({"cycle_id": id, "destroy": step_json(Some(t))})),
        "apply": step_json(c.apply.as_ref()),
        "probe": step_json(c.probe.as_ref()),
        "destroy": step_json(c.destroy.as_ref()),
    });
    let cycle = c.cycle_id.as_deref().unwrap_or("-");
    let result = match &c.end {
        CanaryEnd::Passed(v) => {
            let line = c
                .probe
                .as_ref()
                .and_then(|p| p.result.as_ref().ok())
                .map(String::as_str)
                .unwrap_or_default();
            Ok(format!(
                "a VM of the module came up and answered the probe with {line:?} (forgejo-runner {v}); {times}; VM destroyed (cycle {cycle})"
            ))
        }
        CanaryEnd::Failed(why) | CanaryEnd::Interrupted(why) => {
            let mut msg = format!("{why} (cycle {cycle}");
            if !times.is_empty() {
                msg.push_str(&format!("; {times}"));
            }
            msg.push(')');
            Err(msg)
        }
        CanaryEnd::Refused(why) => return not_booted(why, true),
    };
    match &result {
        Ok(m) => log::info!("boot: {m}"),
        Err(m) => log::error!("boot: {m}"),
    }
    Boot {
        result,
        refused: false,
        detail,
    }
}
