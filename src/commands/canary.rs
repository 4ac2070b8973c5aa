//! `check --boot`: the canary (`driver::canary`) with the pool's own module and launch command,
//! under the slot's lock, as the `boot` line of `check`.

use std::time::Duration;

use serde_json::{Value, json};

use crate::adapters::clock::RealClock;
use crate::adapters::files::{FileStore, StateDirError, take_lock};
use crate::adapters::signals::{ReloadFlag, StopFlag};
use crate::cli::RunArgs;
use crate::commands::config::slot_dir;
use crate::commands::exit::Fatal;
use crate::commands::wiring;
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
    let mut store = FileStore::slot(slot.clone());
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
