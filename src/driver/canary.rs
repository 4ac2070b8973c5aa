//! The canary of `check --boot` (`core::canary`): under the slot's lock, one VM of the pool's
//! module is applied, probed by the launch command and destroyed, whatever happened in between.
//! It is a cycle of its own in cycle.json (`canary: true`), written before each side effect, so
//! that a canary killed anywhere leaves what the next run (or canary) tears down.

use std::time::Duration;

use crate::core::canary::{Before, RunnerVersion, before, judge_runner};
use crate::core::ports::{Clock, Launcher, ProbeRequest, StateStore, StepError, Tofu};
use crate::core::state::{CycleState, DESTROY_FAILED, Phase};

/// The ports the canary acts through.
pub struct CanaryWorld<'a> {
    pub tofu: &'a mut dyn Tofu,
    pub launcher: &'a mut dyn Launcher,
    pub store: &'a mut dyn StateStore,
    pub clock: &'a mut dyn Clock,
}

pub struct CanaryConfig<'a> {
    /// `--labels` as given (`RUNNER_LABELS` of the probe).
    pub labels: &'a str,
    pub forgejo_url: &'a str,
    pub runner_prefix: &'a str,
    /// `--slot`: slot K ≥ 2's cycle ids end in `-sK`, as a run's do.
    pub slot: u32,
}

/// How long a step took, and how it ended.
#[derive(Debug)]
pub struct Timed<T> {
    pub took: Duration,
    pub result: Result<T, String>,
}

/// How the canary ended.
#[derive(Debug, PartialEq, Eq)]
pub enum CanaryEnd {
    /// The VM came up, the runner is new enough, and the VM is gone.
    Passed(RunnerVersion),
    /// A step failed (the message says which and what to do).
    Failed(String),
    /// Not run: the slot has a cycle in progress (or a run holds its lock).
    Refused(String),
    /// A stop request (SIGTERM) cut it short; cycle.json keeps the canary's VM for the next run.
    Interrupted(String),
}

/// What the canary did, step by step, for its report.
#[derive(Debug)]
pub struct Canary {
    /// A canary left by a killed one, destroyed first: its cycle id and the destroy.
    pub leftover: Option<(String, Timed<()>)>,
    pub cycle_id: Option<String>,
    pub apply: Option<Timed<()>>,
    /// The line forgejo-runner's `--version` printed on the VM.
    pub probe: Option<Timed<String>>,
    pub destroy: Option<Timed<()>>,
    pub end: CanaryEnd,
}

impl Canary {
    fn new() -> Canary {
        Canary {
            leftover: None,
            cycle_id: None,
            apply: None,
            probe: None,
            destroy: None,
            end: CanaryEnd::Failed(String::new()),
        }
    }
}

fn timed<T>(
    clock: &dyn Clock,
    f: impl FnOnce() -> Result<T, StepError>,
) -> (Duration, Result<T, StepError>) {
    let start = clock.now();
    let r = f();
    (clock.now().since(start), r)
}

/// Boots, probes and destroys one canary VM. Run with the slot's lock held.
pub fn run(w: &mut CanaryWorld<'_>, cfg: &CanaryConfig<'_>) -> Canary {
    let mut c = Canary::new();
    if let Err(end) = clear_the_slot(w, &mut c) {
        c.end = end;
        return c;
    }
    let mut state = match start(w, cfg) {
        Ok(s) => s,
        Err(why) => {
            c.end = CanaryEnd::Failed(why);
            return c;
        }
    };
    let id = state.cycle_id.clone();
    c.cycle_id = Some(id.clone());
    let failed = boot_and_probe(w, cfg, &mut state, &mut c);
    // The VM goes, whatever happened.
    let t = teardown(w, &mut state, "the canary is done");
    let destroy_failed = t.failed();
    c.destroy = Some(t.timed);
    c.end = match (destroy_failed, failed) {
        (Some((e, interrupted)), _) => end_of_failed_destroy(&id, e, interrupted),
        (None, Some((why, true))) => CanaryEnd::Interrupted(why),
        (None, Some((why, false))) => CanaryEnd::Failed(why),
        (None, None) => verdict(&c),
    };
    c
}

/// What the slot's cycle.json holds before the canary: nothing (`Ok`), a canary left by a killed
/// one (destroyed first: `Ok` once it is gone), or a cycle of the pool (`Err`: refused).
fn clear_the_slot(w: &mut CanaryWorld<'_>, c: &mut Canary) -> Result<(), CanaryEnd> {
    let found = w
        .store
        .load()
        .map_err(|e| CanaryEnd::Failed(format!("{e:#}; no canary was started")))?;
    match before(found.as_ref()) {
        Before::Run => Ok(()),
        Before::Refuse { cycle_id } => Err(CanaryEnd::Refused(format!(
            "cycle {cycle_id} is in progress in this slot, and the canary never runs beside a cycle: try again once `status` shows none"
        ))),
        Before::DestroyLeftover { cycle_id } => {
            let Some(mut leftover) = found else {
                return Ok(());
            };
            log::warn!(
                "cycle {cycle_id} is the VM of a `check --boot` that did not finish: destroying it first"
            );
            let t = teardown(w, &mut leftover, "a canary that did not finish");
            let failed = t.failed();
            c.leftover = Some((cycle_id.clone(), t.timed));
            match failed {
                Some((e, interrupted)) => Err(end_of_failed_destroy(&cycle_id, e, interrupted)),
                None => Ok(()),
            }
        }
    }
}

/// The canary's cycle, written before tofu makes its VM (slot K >= 2's ids end in `-sK`).
fn start(w: &mut CanaryWorld<'_>, cfg: &CanaryConfig<'_>) -> Result<CycleState, String> {
    let now = w.clock.now();
    let id = match cfg.slot {
        0 | 1 => format!("{}-canary", w.clock.new_cycle_id(now)),
        k => format!("{}-canary-s{k}", w.clock.new_cycle_id(now)),
    };
    let mut state = CycleState::new(id, now);
    state.canary = true;
    state.runner_prefix = cfg.runner_prefix.to_string();
    w.store
        .save(&state)
        .map_err(|e| format!("cannot write {}: {e:#}; no VM was made", w.store.describe()))?;
    Ok(state)
}

/// `tofu apply` and its outputs, then `RUNNER_ACTION=probe`, each timed into `c`. `Some((why,
/// interrupted))` when one failed.
fn boot_and_probe(
    w: &mut CanaryWorld<'_>,
    cfg: &CanaryConfig<'_>,
    state: &mut CycleState,
    c: &mut Canary,
) -> Option<(String, bool)> {
    let id = state.cycle_id.clone();
    log::info!("canary {id}: tofu apply");
    let tofu = &mut *w.tofu;
    let (took, applied) = timed(&*w.clock, || {
        tofu.apply(&id)?;
        tofu.outputs(&id)
    });
    let outputs = match applied {
        Ok(outputs) => outputs,
        Err(e) => {
            c.apply = Some(Timed {
                took,
                result: Err(e.message.clone()),
            });
            return Some((format!("tofu apply failed: {}", e.message), e.interrupted));
        }
    };
    c.apply = Some(Timed {
        took,
        result: Ok(()),
    });
    state.phase = Phase::Running;
    state.vm_ready_at = Some(w.clock.now());
    state.outputs = outputs
        .iter()
        .filter(|(_, o)| !o.sensitive)
        .map(|(k, o)| (k.clone(), o.value.clone()))
        .collect();
    // Not a reason to stop: the destroy follows whatever happens, and cycle.json already holds
    // the canary (a failed write here is the destroy's intent's to report).
    if let Err(e) = w.store.save(state) {
        log::warn!("cannot record the canary's outputs in cycle.json: {e:#}");
    }
    log::info!("canary {id}: probing the VM (RUNNER_ACTION=probe)");
    let launcher = &mut *w.launcher;
    let req = ProbeRequest {
        labels: cfg.labels,
        forgejo_url: cfg.forgejo_url,
        outputs: &outputs,
    };
    let (took, probed) = timed(&*w.clock, || launcher.probe(&req));
    let failed = probed.as_ref().err().map(|e| {
        (
            format!("the VM did not pass the probe: {}", e.message),
            e.interrupted,
        )
    });
    c.probe = Some(Timed {
        took,
        result: probed.map_err(|e| e.message),
    });
    failed
}

/// Every step passed: the runner the probe found must be new enough.
fn verdict(c: &Canary) -> CanaryEnd {
    let line = c
        .probe
        .as_ref()
        .and_then(|p| p.result.as_ref().ok())
        .cloned()
        .unwrap_or_default();
    match judge_runner(&line) {
        Ok(v) => CanaryEnd::Passed(v),
        Err(e) => CanaryEnd::Failed(e),
    }
}

/// A failed destroy of the canary's VM (`interrupted`: by a stop request): cycle.json keeps it,
/// and the next run destroys it.
fn end_of_failed_destroy(cycle_id: &str, e: String, interrupted: bool) -> CanaryEnd {
    let what = format!(
        "tofu destroy of the canary's VM (cycle {cycle_id}) failed: {e}; cycle.json keeps it and the next run (or check --boot) destroys it"
    );
    if interrupted {
        CanaryEnd::Interrupted(what)
    } else {
        CanaryEnd::Failed(what)
    }
}

/// A teardown: the destroy, timed, and whether a stop request cut it short.
struct Teardown {
    timed: Timed<()>,
    interrupted: bool,
}

impl Teardown {
    fn done(timed: Timed<()>) -> Teardown {
        Teardown {
            timed,
            interrupted: false,
        }
    }

    /// Why the VM may still exist, and whether a stop request was the cause.
    fn failed(&self) -> Option<(String, bool)> {
        let e = self.timed.result.as_ref().err()?;
        Some((e.clone(), self.interrupted))
    }
}

/// Destroys the canary's VM, its intent written first; cycle.json goes once the destroy
/// succeeded. Failed when the VM may still exist (cycle.json then says so).
fn teardown(w: &mut CanaryWorld<'_>, state: &mut CycleState, reason: &str) -> Teardown {
    let id = state.cycle_id.clone();
    if state.phase != Phase::Destroyed {
        state.phase = Phase::TearingDown;
        state.teardown_reason = Some(format!("canary: {reason}"));
        if let Err(e) = w.store.save(state) {
            // The cycle.json on disk still names the canary: the next run destroys it.
            log::warn!(
                "cannot record the canary's teardown in {}: {e:#}",
                w.store.describe()
            );
        }
        log::info!("canary {id}: tofu destroy ({reason})");
        let tofu = &mut *w.tofu;
        let (took, destroyed) = timed(&*w.clock, || tofu.destroy(&id, reason));
        if let Err(e) = destroyed {
            state.last_error = Some(format!("{DESTROY_FAILED}: {}", e.message));
            if let Err(se) = w.store.save(state) {
                log::warn!("cannot record the failed destroy: {se:#}");
            }
            return Teardown {
                timed: Timed {
                    took,
                    result: Err(e.message),
                },
                interrupted: e.interrupted,
            };
        }
        state.phase = Phase::Destroyed;
        state.destroyed_at = Some(w.clock.now());
        state.last_error = None;
        if let Err(e) = w.store.save(state) {
            log::warn!("cannot record the canary's destroy: {e:#}");
        }
        return Teardown::done(finish(w, took));
    }
    Teardown::done(finish(w, Duration::ZERO))
}

/// The VM is gone: cycle.json goes.
fn finish(w: &mut CanaryWorld<'_>, took: Duration) -> Timed<()> {
    match w.store.remove() {
        Ok(()) => Timed {
            took,
            result: Ok(()),
        },
        Err(e) => Timed {
            took,
            result: Err(format!(
                "the VM is destroyed, but {} could not be removed: {e:#}",
                w.store.describe()
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::dry::MemoryStore;
    use crate::core::ports::{LaunchRequest, Output, Outputs, ProcessCheck, Sleep};
    use crate::core::secret::Secret;
    use crate::core::time::Timestamp;

    /// A tofu that records applies and destroys, and fails where told.
    #[derive(Default)]
    struct Cloud {
        vms: Vec<String>,
        applied: Vec<String>,
        destroyed: Vec<String>,
        fail_apply: bool,
        fail_destroy: bool,
        /// The destroy fails as one a stop request cut short (its message says nothing of it).
        interrupt_destroy: bool,
    }

    impl Tofu for Cloud {
        fn check_config(&self) -> anyhow::Result<()> {
            Ok(())
        }
        fn apply(&mut self, id: &str) -> Result<(), StepError> {
            self.applied.push(id.into());
            if self.fail_apply {
                return Err(StepError::failed("simulated apply failure"));
            }
            self.vms.push(id.into());
            Ok(())
        }
        fn outputs(&mut self, _: &str) -> Result<Outputs, StepError> {
            let mut o = Outputs::new();
            o.insert(
                "address".into(),
                Output {
                    sensitive: false,
                    value: "127.0.0.1".into(),
                },
            );
            Ok(o)
        }
        fn destroy(&mut self, id: &str, _: &str) -> Result<(), StepError> {
            self.destroyed.push(id.into());
            if self.fail_destroy {
                return Err(StepError::failed("simulated destroy failure"));
            }
            if self.interrupt_destroy {
                return Err(StepError {
                    message: "simulated destroy, cut short".into(),
                    interrupted: true,
                });
            }
            self.vms.retain(|v| v != id);
            Ok(())
        }
    }

    struct Probe(Result<String, String>);

    impl Launcher for Probe {
        fn check_config(&self) -> anyhow::Result<()> {
            Ok(())
        }
        fn launch(&mut self, _: &LaunchRequest<'_>, _: &Secret) -> Result<(), StepError> {
            panic!("the canary starts no runner")
        }
        fn check(&mut self, _: &LaunchRequest<'_>) -> ProcessCheck {
            panic!("the canary checks no runner")
        }
        fn stop(&mut self, _: &LaunchRequest<'_>) -> Result<(), StepError> {
            panic!("the canary stops no runner")
        }
        fn probe(&mut self, _: &ProbeRequest<'_>) -> Result<String, StepError> {
            self.0.clone().map_err(StepError::failed)
        }
    }

    struct FixedClock(Timestamp);

    impl Clock for FixedClock {
        fn now(&self) -> Timestamp {
            self.0
        }
        fn sleep(&mut self, _: Duration) -> Sleep {
            Sleep::Slept
        }
        fn stop_requested(&self) -> bool {
            false
        }
        fn new_cycle_id(&mut self, _: Timestamp) -> String {
            "20260101t000000z-abcd".into()
        }
    }

    fn store(state: Option<CycleState>) -> MemoryStore {
        MemoryStore {
            state,
            holds: Default::default(),
            others: Default::default(),
            backoff: crate::core::backoff::Backoff::new(),
        }
    }

    fn go(cloud: &mut Cloud, probe: Result<&str, &str>, st: &mut MemoryStore) -> Canary {
        let mut launcher = Probe(probe.map(str::to_string).map_err(str::to_string));
        let mut clock = FixedClock(Timestamp::parse_rfc3339("2026-01-01T00:00:00Z").unwrap());
        let mut w = CanaryWorld {
            tofu: cloud,
            launcher: &mut launcher,
            store: st,
            clock: &mut clock,
        };
        run(
            &mut w,
            &CanaryConfig {
                labels: "debian:host",
                forgejo_url: "https://forgejo.invalid",
                runner_prefix: "ephemeral-",
                slot: 1,
            },
        )
    }

    #[test]
    fn a_good_vm_passes_and_is_gone() {
        let mut cloud = Cloud::default();
        let mut st = store(None);
        let c = go(&mut cloud, Ok("forgejo-runner version v12.8.2"), &mut st);
        assert!(matches!(c.end, CanaryEnd::Passed(_)), "{c:?}");
        assert_eq!(cloud.applied, ["20260101t000000z-abcd-canary"]);
        assert!(cloud.vms.is_empty());
        assert!(st.state.is_none());
    }

    // Mutation caught: the canary returning before its teardown when the probe (or the apply,
    // or the version) fails.
    #[test]
    fn the_vm_is_destroyed_whatever_happened() {
        for (fail_apply, probe) in [
            (true, Ok("forgejo-runner version v12.8.2")),
            (false, Err("sshd never answered")),
            (false, Ok("forgejo-runner version v12.7.3")),
        ] {
            let mut cloud = Cloud {
                fail_apply,
                ..Cloud::default()
            };
            let mut st = store(None);
            let c = go(&mut cloud, probe, &mut st);
            assert!(matches!(c.end, CanaryEnd::Failed(_)), "{c:?}");
            assert_eq!(cloud.destroyed.len(), 1, "{c:?}");
            assert!(cloud.vms.is_empty() && st.state.is_none(), "{c:?}");
        }
    }

    #[test]
    fn a_failed_destroy_keeps_the_canary_for_the_next_run() {
        let mut cloud = Cloud {
            fail_destroy: true,
            ..Cloud::default()
        };
        let mut st = store(None);
        let c = go(&mut cloud, Ok("forgejo-runner version v12.8.2"), &mut st);
        assert!(
            matches!(c.end, CanaryEnd::Failed(ref m) if m.contains("next run")),
            "{c:?}"
        );
        let kept = st.state.clone().expect("cycle.json keeps the canary");
        assert!(kept.canary && kept.destroy_failed(), "{kept:?}");
        // The next canary destroys it first, then runs.
        cloud.fail_destroy = false;
        let c = go(&mut cloud, Ok("forgejo-runner version v12.8.2"), &mut st);
        assert!(matches!(c.end, CanaryEnd::Passed(_)), "{c:?}");
        assert_eq!(
            c.leftover.as_ref().map(|l| l.0.as_str()),
            Some(kept.cycle_id.as_str())
        );
        assert!(cloud.vms.is_empty() && st.state.is_none());
    }

    // Mutation caught: the interruption of the destroy told by its message's words (a stop
    // request whose message does not say so reported as a failed canary).
    #[test]
    fn a_destroy_cut_short_by_a_stop_request_ends_the_canary_as_interrupted() {
        let mut cloud = Cloud {
            interrupt_destroy: true,
            ..Cloud::default()
        };
        let mut st = store(None);
        let c = go(&mut cloud, Ok("forgejo-runner version v12.8.2"), &mut st);
        assert!(
            matches!(c.end, CanaryEnd::Interrupted(ref m) if m.contains("next run")),
            "{c:?}"
        );
        let kept = st.state.clone().expect("cycle.json keeps the canary");
        // The next canary's destroy of the leftover, cut short too: interrupted, not failed.
        let c = go(&mut cloud, Ok("forgejo-runner version v12.8.2"), &mut st);
        assert!(matches!(c.end, CanaryEnd::Interrupted(_)), "{c:?}");
        assert_eq!(
            c.leftover.as_ref().map(|l| l.0.as_str()),
            Some(kept.cycle_id.as_str())
        );
        assert_eq!(cloud.applied.len(), 1, "no second VM: {c:?}");
    }

    #[test]
    fn a_cycle_in_progress_is_left_alone() {
        let now = Timestamp::parse_rfc3339("2026-01-01T00:00:00Z").unwrap();
        let cycle = CycleState::new("c-1".into(), now);
        let mut cloud = Cloud::default();
        let mut st = store(Some(cycle.clone()));
        let c = go(&mut cloud, Ok("forgejo-runner version v12.8.2"), &mut st);
        assert!(matches!(c.end, CanaryEnd::Refused(_)), "{c:?}");
        assert!(cloud.applied.is_empty() && cloud.destroyed.is_empty());
        assert_eq!(st.state, Some(cycle));
    }
}
