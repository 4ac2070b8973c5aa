//! The project's I/O traits implemented on the simulated world. Every call is one step: the
//! process may be killed before it or after it (its effect applied, its answer never seen), a
//! second invocation may race it, a stop signal may arrive, and the invariants are checked.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use anyhow::bail;
use ci_ephemeral_provisioner::core::backoff::{Backoff, Change, CycleOutcome, Gate};
use ci_ephemeral_provisioner::core::claims::Others;
use ci_ephemeral_provisioner::core::forgejo::Job;
use ci_ephemeral_provisioner::core::forgejo::Runner;
use ci_ephemeral_provisioner::core::forgejo::RunnerStatus;
use ci_ephemeral_provisioner::core::holds::Holds;
use ci_ephemeral_provisioner::core::holds::HoldsError;
use ci_ephemeral_provisioner::core::holds::parse_holds;
use ci_ephemeral_provisioner::core::pool::Fenced;
use ci_ephemeral_provisioner::core::ports::ApiError;
use ci_ephemeral_provisioner::core::ports::BackoffGate;
use ci_ephemeral_provisioner::core::ports::Claim;
use ci_ephemeral_provisioner::core::ports::Clock;
use ci_ephemeral_provisioner::core::ports::Deleted;
use ci_ephemeral_provisioner::core::ports::Forgejo;
use ci_ephemeral_provisioner::core::ports::LaunchRequest;
use ci_ephemeral_provisioner::core::ports::Launcher;
use ci_ephemeral_provisioner::core::ports::NewRunner;
use ci_ephemeral_provisioner::core::ports::Output;
use ci_ephemeral_provisioner::core::ports::Outputs;
use ci_ephemeral_provisioner::core::ports::ProcessCheck;
use ci_ephemeral_provisioner::core::ports::RunnerPage;
use ci_ephemeral_provisioner::core::ports::Sleep;
use ci_ephemeral_provisioner::core::ports::Start;
use ci_ephemeral_provisioner::core::ports::StateStore;
use ci_ephemeral_provisioner::core::ports::StepError;
use ci_ephemeral_provisioner::core::ports::Tofu;
use ci_ephemeral_provisioner::core::ports::record_outcome_in;
use ci_ephemeral_provisioner::core::ports::save_starting_warm_in;
use ci_ephemeral_provisioner::core::secret::Secret;
use ci_ephemeral_provisioner::core::state::CycleState;
use ci_ephemeral_provisioner::core::state::Phase;
use ci_ephemeral_provisioner::core::sweep::gate::Deletable;
use ci_ephemeral_provisioner::core::time::Timestamp;

use super::world::{ApiFault, HTTP_TIMEOUT_MS, Sim, Started};

pub type Shared = Rc<RefCell<Sim>>;

/// The panic payload of a simulated SIGKILL.
pub struct Killed;
/// The panic payload of an invocation that never ends.
pub struct Livelock(pub String);

/// Steps one invocation may take before the simulation calls it a livelock.
const MAX_STEPS_PER_INVOCATION: u64 = 20_000;

/// One port: the shared world and which invocation (process) it belongs to.
#[derive(Clone)]
pub struct Port {
    pub sim: Shared,
    pub inv: usize,
}

impl Port {
    /// The slot this invocation runs.
    fn slot(&self) -> usize {
        self.sim.borrow().slot_of(self.inv)
    }

    /// This invocation takes no time (`Invocation::instant`).
    fn instant(&self) -> bool {
        self.sim.borrow().invs[self.inv].instant
    }

    /// Time passes until `to` for this invocation (none for a run at an instant).
    fn take_until(&self, s: &mut Sim, to: i64, ours: bool) {
        if !s.invs[self.inv].instant {
            s.advance(to, ours);
        }
    }

    /// A step boundary: counts the step, maybe races a second invocation of this slot, maybe
    /// runs another slot meanwhile, maybe raises a stop, maybe kills the process here.
    fn boundary(&self, when: &'static str, point: &str) {
        // The boundaries at which this run waits anyway (a run nested there may take its time).
        let waits = matches!(
            (when, point),
            ("before", "tofu apply" | "tofu destroy" | "launch") | ("", "sleep")
        );
        let (kill, race, nest, instant) = {
            let mut s = self.sim.borrow_mut();
            s.step += 1;
            s.stats.steps += 1;
            s.invs[self.inv].steps += 1;
            if s.invs[self.inv].steps > MAX_STEPS_PER_INVOCATION {
                let msg = format!(
                    "invocation {} took {MAX_STEPS_PER_INVOCATION} steps without ending (at {when} {point})",
                    self.inv
                );
                drop(s);
                std::panic::panic_any(Livelock(msg));
            }
            let on = s.faults_on;
            let cfg = s.cfg;
            if on && !s.invs[self.inv].stop && s.rng.chance(cfg.signal) {
                s.invs[self.inv].stop = true;
                s.count_fault("stop signal (SIGTERM)");
                if s.tracing {
                    s.log(format!("SIGTERM {when} {point}"));
                }
            }
            let race = on && s.invs[self.inv].started != Started::Race && s.rng.chance(cfg.race);
            // Another slot (of any host) whose process is not running now starts a run, which
            // ends before this one goes on: it sees this slot's state exactly as it is here.
            let nest = if on && s.rng.chance(cfg.interleave) {
                let idle: Vec<usize> = (0..s.slots.len())
                    .filter(|k| !s.stack.iter().any(|i| s.invs[*i].slot == *k))
                    .filter(|k| !s.dead(s.slots[*k].host))
                    .collect();
                (!idle.is_empty()).then(|| idle[s.rng.below(idle.len() as u64) as usize])
            } else {
                None
            };
            let instant = s.invs[self.inv].instant || !waits;
            let kill = on && s.rng.chance(cfg.crash);
            if kill {
                let key = if when.is_empty() {
                    point.to_string()
                } else {
                    format!("{when} {point}")
                };
                if s.tracing {
                    s.log(format!("KILLED {key}"));
                }
                *s.stats.crashes.entry(key).or_default() += 1;
                let slot = s.slot_of(self.inv);
                s.starts_uncertain(slot);
            }
            (kill, race, nest, instant)
        };
        if race {
            let slot = self.slot();
            let instant = self.instant();
            super::driver::race(&self.sim, slot, instant);
        }
        if let Some(other) = nest {
            super::driver::nested(&self.sim, other, instant);
        }
        if kill {
            std::panic::panic_any(Killed);
        }
        self.maybe_pause(when, point);
    }

    /// `--store pg`: at a boundary where a process may stand still for minutes (its poll wait,
    /// or a long child it waited on), it is stopped (SIGSTOP) past its lease; another host's
    /// timer fires meanwhile (and may adopt its cycle); then it goes on (SIGCONT).
    fn maybe_pause(&self, when: &str, point: &str) {
        let pausable = matches!(
            (when, point),
            ("", "sleep") | ("after", "tofu apply" | "tofu destroy" | "launch")
        );
        let other = {
            let mut s = self.sim.borrow_mut();
            let slot = s.slot_of(self.inv);
            let host = s.slots[slot].host;
            let p = s.cfg.pause;
            if !pausable
                || !s.faults_on
                || !s.hosts[host].pg
                || s.invs[self.inv].instant
                || s.invs[self.inv].paused
                || !s.rng.chance(p)
            {
                return;
            }
            s.count_fault("process paused past its lease (SIGSTOP)");
            s.invs[self.inv].paused = true;
            let to = s.now + super::world::LEASE_MS + s.rng.range(1_000, 120_000);
            s.log(format!(
                "SIGSTOP {when} {point}, until t+{} s",
                (to - super::world::T0) / 1000
            ));
            s.advance(to, true);
            let idle: Vec<usize> = s
                .pool_slots(slot)
                .into_iter()
                .filter(|k| {
                    s.slots[*k].host != host
                        && s.hosts[s.slots[*k].host].dead.is_none()
                        && !s.stack.iter().any(|i| s.invs[*i].slot == *k)
                })
                .collect();
            (!idle.is_empty()).then(|| idle[s.rng.below(idle.len() as u64) as usize])
        };
        if let Some(other) = other {
            super::driver::invoke(&self.sim, other, Started::Nested);
        }
        let mut s = self.sim.borrow_mut();
        s.invs[self.inv].paused = false;
        let fenced = s.invs[self.inv].fenced;
        s.log(format!(
            "SIGCONT{}",
            if fenced {
                ": its cycle was adopted meanwhile"
            } else {
                ""
            }
        ));
    }

    /// Before a side effect (a POST or DELETE, tofu apply or destroy, a launch or stop): a
    /// process whose cycle another host adopted makes none.
    fn side_effect(&self, what: &str) {
        let mut s = self.sim.borrow_mut();
        if s.invs[self.inv].fenced {
            let who = s.slot_name(s.slot_of(self.inv));
            s.violate(format!(
                "{who}'s run made a side effect ({what}) after another host had adopted its cycle"
            ));
        }
    }

    /// After a step: the invariants on what is stored.
    fn checked(&self, after: &str) {
        let mut s = self.sim.borrow_mut();
        s.check_remembered(after);
        s.check_hold_written(after);
        s.check_warm(after);
    }

    fn stop(&self) -> bool {
        self.sim.borrow().invs[self.inv].stop
    }

    /// One API request. `point` names the step boundary (coarse, for coverage); `what` is the
    /// path suffix for the trace; `late_name` the registration name of a POST.
    #[allow(clippy::too_many_arguments)]
    fn api<T>(
        &self,
        method: &str,
        point: &str,
        what: &str,
        write: bool,
        late_name: Option<&str>,
        op: impl FnOnce(&mut Sim, Option<ApiFault>) -> T,
    ) -> Result<T, ApiError> {
        let post = late_name.is_some();
        self.boundary("before", point);
        if write {
            self.side_effect(&format!("{method} {what}"));
        }
        let result = {
            let mut s = self.sim.borrow_mut();
            let fault = match s.forced_faults.iter().position(|(p, _)| p == point) {
                Some(i) => {
                    let f = s.forced_faults.remove(i).1;
                    s.count_fault(f.name());
                    Some(f)
                }
                None => s.api_fault(write, post),
            };
            let applied = fault.is_none_or(|f| f.applied());
            let latency = match fault {
                Some(ApiFault::Timeout | ApiFault::TimeoutApplied | ApiFault::LatePost) => {
                    HTTP_TIMEOUT_MS
                }
                _ => s.rng.range(5, 120),
            };
            // The request travels to Forgejo and its answer back while the runner processes on
            // our VMs go on (they connect, take their job, finish it): what one request read is
            // not what the next one finds. A GET that found a runner offline and the DELETE that
            // follows are two requests; Forgejo's DELETE checks no status.
            let sent = s.now;
            self.take_until(&mut s, sent + latency / 2, true);
            let value = if applied {
                Some(op(&mut s, fault))
            } else {
                None
            };
            if fault == Some(ApiFault::LatePost)
                && let Some(name) = late_name
            {
                let slot = s.slot_of(self.inv);
                s.schedule_late_post(slot, name, sent);
            }
            let now = s.now;
            self.take_until(&mut s, now + latency - latency / 2, true);
            if fault.is_some() {
                let now = s.now;
                s.invs[self.inv].last_fault_at = now;
            }
            let err = |status: Option<u16>, detail: &str| ApiError {
                request: format!("{method} https://forgejo.sim/api/v1/admin/actions/runners{what}"),
                detail: detail.to_string(),
                status,
            };
            let result = match fault {
                None | Some(ApiFault::OddRows) => Ok(value.expect("applied")),
                Some(f) => Err(match f {
                    ApiFault::Status5xx | ApiFault::Status5xxApplied => {
                        let code = s.rng.pick(&[500, 502, 503]);
                        err(Some(code), &format!("HTTP {code}: internal error"))
                    }
                    ApiFault::Timeout | ApiFault::TimeoutApplied | ApiFault::LatePost => err(
                        None,
                        "timed out (global); check that Forgejo is reachable or raise --http-timeout",
                    ),
                    ApiFault::Reset | ApiFault::ResetApplied => {
                        err(None, "request failed: connection reset by peer")
                    }
                    ApiFault::Html => err(
                        Some(502),
                        "HTTP 502: \"<html><body><h1>502 Bad Gateway</h1></body></html>\"",
                    ),
                    ApiFault::HtmlApplied | ApiFault::Truncated => {
                        err(None, "response is not JSON: EOF while parsing")
                    }
                    ApiFault::Rejected => {
                        let code = if post { s.rng.pick(&[403, 422]) } else { 403 };
                        err(Some(code), &format!("HTTP {code}: refused"))
                    }
                    ApiFault::Proxy404 => err(
                        None,
                        "HTTP 404 without Forgejo's JSON error body (\"<html>404</html>\"); not taken as \"gone\"",
                    ),
                    ApiFault::OddRows => unreachable!(),
                }),
            };
            if s.tracing {
                let text = match fault {
                    None => format!("{method} {what} -> ok"),
                    Some(f) => format!(
                        "{method} {what} -> {} ({})",
                        if result.is_ok() { "ok" } else { "err" },
                        f.name()
                    ),
                };
                s.log(text);
            }
            result
        };
        self.checked(point);
        self.boundary("after", point);
        result
    }
}

/// How the pool store names a slot's host in claims and warm VMs: `hN` in a pool across hosts,
/// empty (this host) with the files store.
fn host_id(s: &Sim, slot: usize) -> String {
    let h = s.slots[slot].host;
    if s.hosts[h].pg {
        format!("h{}", h + 1)
    } else {
        String::new()
    }
}

// -- Forgejo ---------------------------------------------------------------------------------------

pub struct SimForgejo(pub Port);

impl Forgejo for SimForgejo {
    fn list_jobs(&mut self) -> Result<Vec<Job>, ApiError> {
        self.0.api("GET", "GET jobs", "/jobs", false, None, |s, _| {
            s.srv_list_jobs()
        })
    }

    fn get_runner(&mut self, id: i64) -> Result<Option<Runner>, ApiError> {
        let inv = self.0.inv;
        self.0.api(
            "GET",
            "GET runner",
            &format!("/{id}"),
            false,
            None,
            |s, f| {
                let mut r = s.live(id).map(|r| s.wire_runner(r));
                if f == Some(ApiFault::OddRows)
                    && let Some(r) = &mut r
                {
                    odd(s, r);
                }
                if let Some(r) = &r {
                    s.saw(inv, id, r.status.clone());
                }
                r
            },
        )
    }

    fn delete_runner(&mut self, target: &Deletable, reason: &str) -> Result<Deleted, ApiError> {
        let id = target.id();
        let inv = self.0.inv;
        let point = format!("DELETE runner ({reason})");
        self.0.api(
            "DELETE",
            &point,
            &format!("/{id} ({reason})"),
            true,
            None,
            |s, _| {
                if s.srv_delete(inv, id, reason) {
                    Deleted::Now
                } else {
                    Deleted::AlreadyGone
                }
            },
        )
    }

    fn register_runner(&mut self, name: &str) -> Result<NewRunner, ApiError> {
        let inv = self.0.inv;
        self.0.sim.borrow_mut().check_before_post(inv, name);
        self.0.api(
            "POST",
            "POST runner",
            &format!(" {name}"),
            true,
            Some(name),
            |s, _| {
                let slot = s.slot_of(inv);
                let id = s.srv_register(slot, name);
                s.log(format!("forgejo: registered {name} as runner {id}"));
                NewRunner {
                    id,
                    uuid: format!("00000000-0000-4000-8000-{id:012x}"),
                    token: Secret::new(token_of(id)),
                }
            },
        )
    }

    fn list_runners_page(&mut self, page: u32, limit: u32) -> Result<RunnerPage, ApiError> {
        let inv = self.0.inv;
        self.0.api(
            "GET",
            "GET runner page",
            &format!("?page={page}&limit={limit}"),
            false,
            None,
            |s, f| {
                let (mut rows, total) = s.srv_page(page, limit);
                if f == Some(ApiFault::OddRows) && !rows.is_empty() {
                    let i = s.rng.below(rows.len() as u64) as usize;
                    odd(s, &mut rows[i]);
                }
                for r in &rows {
                    s.saw(inv, r.id, r.status.clone());
                }
                RunnerPage {
                    rows,
                    total: Some(total),
                }
            },
        )
    }
}

/// The runner token Forgejo hands out for registration `id` (checked at launch).
fn token_of(id: i64) -> String {
    format!("{:040x}", id as u128 * 0x9E37_79B9)
}

/// What a proxy or an unexpected server version might do to one row.
fn odd(s: &mut Sim, r: &mut Runner) {
    match s.rng.below(3) {
        0 => r.status = RunnerStatus::Missing,
        1 => r.status = RunnerStatus::Unknown("Offline".into()),
        _ => r.name = None,
    }
}

// -- tofu ---------------------------------------------------------------------------------------------

pub struct SimTofu(pub Port);

#[derive(Clone, Copy, PartialEq)]
enum TofuFault {
    None,
    FailBefore,
    FailAfter,
}

impl SimTofu {
    fn fault(&self, after_name: &'static str, before_name: &'static str) -> TofuFault {
        let mut s = self.0.sim.borrow_mut();
        let p = s.cfg.tofu;
        if !s.faults_on || !s.rng.chance(p) {
            return TofuFault::None;
        }
        if s.rng.chance(0.5) {
            s.count_fault(before_name);
            TofuFault::FailBefore
        } else {
            s.count_fault(after_name);
            TofuFault::FailAfter
        }
    }

    fn take(&self, lo: i64, hi: i64) {
        let mut s = self.0.sim.borrow_mut();
        let d = s.rng.range(lo, hi);
        let to = s.now + d;
        self.0.take_until(&mut s, to, true);
    }

    /// A run at an instant is stopped before a tofu apply or destroy (`Invocation::instant`):
    /// tofu is interrupted at its start and does nothing.
    fn cut(&self, what: &str) -> Option<StepError> {
        if !self.0.instant() {
            return None;
        }
        let mut s = self.0.sim.borrow_mut();
        s.invs[self.0.inv].stop = true;
        s.log(format!("the nested run is stopped before tofu {what}"));
        Some(StepError {
            message: format!("tofu {what} was interrupted by a stop request"),
            interrupted: true,
        })
    }
}

impl Tofu for SimTofu {
    fn check_config(&self) -> anyhow::Result<()> {
        Ok(())
    }

    fn apply(&mut self, cycle_id: &str) -> Result<(), StepError> {
        self.0.boundary("before", "tofu apply");
        self.0.side_effect("tofu apply");
        if let Some(e) = self.cut("apply") {
            return Err(e);
        }
        let stop = self.0.stop();
        let fault = self.fault(
            "tofu apply fails after creating the VM",
            "tofu apply fails before creating the VM",
        );
        self.take(20_000, 90_000);
        let create = match fault {
            TofuFault::FailBefore => false,
            _ => !stop || self.0.sim.borrow_mut().rng.chance(0.5),
        };
        if create {
            let slot = self.0.slot();
            self.0.sim.borrow_mut().create_vm(slot, cycle_id);
        }
        let result = if stop {
            Err(StepError {
                message: "tofu apply was interrupted by a stop request".into(),
                interrupted: true,
            })
        } else if fault != TofuFault::None {
            Err(StepError::failed("`tofu apply` exited with status 1"))
        } else {
            Ok(())
        };
        self.0.sim.borrow_mut().log(format!(
            "tofu apply {cycle_id} -> {}",
            if result.is_ok() { "ok" } else { "err" }
        ));
        self.0.checked("tofu apply");
        self.0.boundary("after", "tofu apply");
        result
    }

    fn outputs(&mut self, cycle_id: &str) -> Result<Outputs, StepError> {
        self.0.boundary("before", "tofu output");
        let fail = {
            let mut s = self.0.sim.borrow_mut();
            let p = s.cfg.tofu / 3.0;
            let f = s.faults_on && s.rng.chance(p);
            if f {
                s.count_fault("tofu output fails");
            }
            f
        };
        self.take(500, 2_000);
        let mut o = Outputs::new();
        o.insert(
            "address".into(),
            Output {
                sensitive: false,
                value: serde_json::Value::String(format!("10.0.0.{}", cycle_id.len())),
            },
        );
        {
            let mut s = self.0.sim.borrow_mut();
            s.log(format!(
                "tofu output {cycle_id} -> {}",
                if fail { "err" } else { "ok" }
            ));
            // After an apply, the VM is up from now (`vm_ready_at`).
            let slot = s.slot_of(self.0.inv);
            if !fail && s.disk_phase(slot) == "applying" {
                let (vm, now) = (current_vm(&s, slot), s.now);
                s.vm_ready.insert(vm, now);
            }
        }
        self.0.boundary("after", "tofu output");
        if fail {
            Err(StepError::failed(
                "`tofu output -json` exited with status 1",
            ))
        } else {
            Ok(o)
        }
    }

    fn destroy(&mut self, cycle_id: &str, _reason: &str) -> Result<(), StepError> {
        self.0.boundary("before", "tofu destroy");
        self.0.side_effect("tofu destroy");
        if let Some(e) = self.cut("destroy") {
            return Err(e);
        }
        let stop = self.0.stop();
        let fault = self.fault(
            "tofu destroy fails after the VM is gone",
            "tofu destroy fails",
        );
        self.take(10_000, 40_000);
        let gone = match fault {
            TofuFault::FailBefore => false,
            TofuFault::FailAfter => true,
            TofuFault::None => !stop || self.0.sim.borrow_mut().rng.chance(0.5),
        };
        if gone {
            let slot = self.0.slot();
            self.0.sim.borrow_mut().destroy_vms(slot);
        }
        let result = if stop {
            Err(StepError {
                message: "tofu destroy was interrupted by a stop request".into(),
                interrupted: true,
            })
        } else if fault != TofuFault::None {
            Err(StepError::failed("`tofu destroy` exited with status 1"))
        } else {
            Ok(())
        };
        {
            let mut s = self.0.sim.borrow_mut();
            if result.is_ok() {
                let inv = self.0.inv;
                s.invs[inv].destroy_ok = true;
            }
            s.log(format!(
                "tofu destroy {cycle_id} -> {}",
                if result.is_ok() { "ok" } else { "err" }
            ));
        }
        self.0.checked("tofu destroy");
        self.0.boundary("after", "tofu destroy");
        result
    }
}

// -- the launch command ---------------------------------------------------------------------------------

pub struct SimLauncher(pub Port);

impl Launcher for SimLauncher {
    fn check_config(&self) -> anyhow::Result<()> {
        Ok(())
    }

    fn launch(&mut self, req: &LaunchRequest<'_>, token: &Secret) -> Result<(), StepError> {
        self.0.boundary("before", "launch");
        self.0.side_effect("launch");
        let stop = self.0.stop();
        let result = {
            let mut s = self.0.sim.borrow_mut();
            if token.expose() != token_of(req.runner_id) {
                let id = req.runner_id;
                s.violate(format!("launch of runner {id} got the wrong token"));
            }
            let slot = s.slot_of(self.0.inv);
            let vm = current_vm(&s, slot);
            s.check_launch(self.0.inv, req.runner_id, req.job_id, req.job_handle);
            let p = s.cfg.launch;
            let fault = if s.faults_on && s.rng.chance(p) {
                let f = s
                    .rng
                    .pick(&["launch fails", "launch fails after starting the runner"]);
                s.count_fault(f);
                Some(f)
            } else {
                None
            };
            let d = s.rng.range(1_000, 15_000);
            let vm_ok = s.vm_exists(slot, &vm);
            if vm_ok && fault != Some("launch fails") {
                s.start_runner_process(req.runner_id, req.job_handle, &vm, req.labels);
            }
            let to = s.now + d;
            self.0.take_until(&mut s, to, true);
            let r = if !vm_ok {
                Err(StepError::failed(format!("launch: VM {vm} is unreachable")))
            } else if stop {
                Err(StepError {
                    message: "launch interrupted by a stop request".into(),
                    interrupted: true,
                })
            } else if fault.is_some() {
                Err(StepError::failed("launch command exited with status 1"))
            } else {
                Ok(())
            };
            if r.is_ok() {
                s.launch_exited_0(req.runner_id, &vm);
            }
            s.log(format!(
                "launch runner {} -> {}",
                req.runner_id,
                if r.is_ok() { "ok" } else { "err" }
            ));
            r
        };
        self.0.checked("launch");
        self.0.boundary("after", "launch");
        result
    }

    /// `RUNNER_ACTION=check` over SSH: 0 while the process runs, 3 once it is gone; an
    /// unreachable VM or a failing command cannot tell.
    fn check(&mut self, req: &LaunchRequest<'_>) -> ProcessCheck {
        self.0.boundary("before", "check");
        let result = {
            let mut s = self.0.sim.borrow_mut();
            let slot = s.slot_of(self.0.inv);
            let r = if !vm_call(&self.0, &mut s, slot, "check cannot tell (exit 1)", 3_000) {
                ProcessCheck::Unknown {
                    why: "check exited with status 1".into(),
                    interrupted: false,
                }
            } else if s.runner_process_runs(req.runner_id) {
                ProcessCheck::Running
            } else {
                ProcessCheck::Gone
            };
            s.log(format!("check runner {} -> {r:?}", req.runner_id));
            r
        };
        self.0.boundary("after", "check");
        result
    }

    /// `RUNNER_ACTION=stop`: ends the process (its effect may land and the answer be lost when
    /// the provisioner is killed meanwhile); fails now and then.
    fn stop(&mut self, req: &LaunchRequest<'_>) -> Result<(), StepError> {
        self.0.boundary("before", "stop");
        self.0.side_effect("RUNNER_ACTION=stop");
        let result = {
            let mut s = self.0.sim.borrow_mut();
            let slot = s.slot_of(self.0.inv);
            let r = if !vm_call(&self.0, &mut s, slot, "stop fails (exit 1)", 5_000) {
                Err(StepError::failed("stop exited with status 1"))
            } else {
                s.stop_runner_process(req.runner_id);
                Ok(())
            };
            s.log(format!(
                "stop runner {} -> {}",
                req.runner_id,
                if r.is_ok() { "ok" } else { "err" }
            ));
            r
        };
        self.0.boundary("after", "stop");
        result
    }
}

/// One check or stop over SSH: it takes a while (up to `max_ms`), fails now and then (`fault`),
/// and cannot reach a VM that is gone. Whether it reached the VM and worked.
fn vm_call(port: &Port, s: &mut Sim, slot: usize, fault: &'static str, max_ms: i64) -> bool {
    let vm = current_vm(s, slot);
    let p = s.cfg.launch;
    let failed = s.faults_on && s.rng.chance(p);
    if failed {
        s.count_fault(fault);
    }
    let to = s.now + s.rng.range(200, max_ms);
    port.take_until(s, to, true);
    s.vm_exists(slot, &vm) && !failed
}

/// The VM of the cycle on `slot`'s disk: where the launch command reaches.
fn current_vm(s: &Sim, slot: usize) -> String {
    let cycle = s.slots[slot]
        .disk
        .as_ref()
        .map(|(_, st)| st.cycle_id.clone())
        .unwrap_or_default();
    s.vm_key(slot, &cycle)
}

// -- cycle.json ---------------------------------------------------------------------------------------------

pub struct SimStore(pub Port);

fn phase_name(phase: Phase) -> &'static str {
    match phase {
        Phase::Applying => "applying",
        Phase::Running => "running",
        Phase::TearingDown => "tearing_down",
        Phase::Destroyed => "destroyed",
    }
}

impl SimStore {
    fn disk_fault(&self, what: &'static str) -> bool {
        let mut s = self.0.sim.borrow_mut();
        let p = s.cfg.store;
        let f = s.faults_on && s.rng.chance(p);
        if f {
            s.count_fault(what);
        }
        f
    }

    /// What the other slots of this slot's pool hold, as `FileStore::others` reads their
    /// cycle.json files: `Others::add` on what `parse_state` gave for the bytes last written
    /// (parsed once, when written: the same bytes parse the same); a read that fails is an
    /// error naming a slot.
    fn read_others(&self) -> anyhow::Result<Others> {
        if self.disk_fault("another slot's cycle.json read fails") {
            let mut s = self.0.sim.borrow_mut();
            // The run then lists no jobs: it did not see Forgejo cleanly (`check_not_served`).
            let now = s.now;
            s.invs[self.0.inv].last_fault_at = now;
            let me = s.slot_of(self.0.inv);
            let other = s.hosts[s.slots[me].host]
                .slots
                .iter()
                .find(|k| **k != me)
                .map_or(0, |k| s.slots[*k].k);
            bail!(
                "slot {other}'s cycle.json cannot be read, so what it holds is unknown: I/O error"
            );
        }
        let s = self.0.sim.borrow();
        let me = s.slot_of(self.0.inv);
        let mut o = Others::default();
        for k in s.pool_slots(me) {
            if k == me {
                continue;
            }
            let sl = &s.slots[k];
            let Some((_, state)) = &sl.disk else { continue };
            o.add(
                sl.k,
                &host_id(&s, k),
                &format!("{} ({})", s.slot_name(k), sl.describe()),
                state,
            );
        }
        Ok(o)
    }

    /// This slot is alone in its pool: the store's defaults (`others` holds nothing, a claim is
    /// a save), as for `FileStore` of a pool without other slot directories.
    fn alone(&self) -> bool {
        let s = self.0.sim.borrow();
        let me = s.slot_of(self.0.inv);
        s.pool_slots(me).len() == 1
    }

    /// `--store pg`: this run renews its host's lease; `Err` (fenced) once another host adopted
    /// its cycle: every write of the cycle is refused from then on (its epoch is stale).
    fn pool_write(&self) -> anyhow::Result<()> {
        let mut s = self.0.sim.borrow_mut();
        let slot = s.slot_of(self.0.inv);
        let h = s.slots[slot].host;
        if !s.hosts[h].pg {
            return Ok(());
        }
        if s.invs[self.0.inv].fenced {
            s.stats.fenced += 1;
            s.log("fenced: the cycle was adopted by another host");
            return Err(anyhow::Error::new(Fenced {
                cycle_id: "(adopted)".into(),
                by: None,
                at: None,
            }));
        }
        s.renew(h);
        Ok(())
    }

    /// `--store pg`: a new cycle's id must be unique in the pool (the table's key).
    fn unique_id(&self, state: &CycleState) -> anyhow::Result<()> {
        let s = self.0.sim.borrow();
        let me = s.slot_of(self.0.inv);
        let taken = s.pool_slots(me).into_iter().any(|k| {
            k != me
                && s.slots[k]
                    .disk
                    .as_ref()
                    .is_some_and(|(_, o)| o.cycle_id == state.cycle_id)
        });
        if taken && s.hosts[s.slots[me].host].pg {
            bail!(
                "starting a cycle in PostgreSQL sim failed: duplicate key value (cycle {})",
                state.cycle_id
            );
        }
        Ok(())
    }

    /// cycle.json written (after the boundary before it and a write fault were passed).
    fn write(&self, what: &str, state: &CycleState) {
        let mut s = self.0.sim.borrow_mut();
        let slot = s.slot_of(self.0.inv);
        s.write_disk(slot, state);
        if s.tracing {
            let regs: Vec<String> = state
                .registrations
                .iter()
                .map(|r| match r.id {
                    Some(id) => format!("{id}:{:?}", r.launch).to_lowercase(),
                    None => format!("?{}", r.name.rsplit('-').next().unwrap_or("")),
                })
                .collect();
            s.log(format!("{what} [{}]", regs.join(" ")));
        }
    }

    /// A write of cycle.json that fails: the run stops before recording what it did, so it may
    /// lose count of failed starts.
    fn write_failed(&self, what: &str) -> anyhow::Error {
        let mut s = self.0.sim.borrow_mut();
        let slot = s.slot_of(self.0.inv);
        s.starts_uncertain(slot);
        s.log(format!("{what} -> err"));
        let path = s.slots[slot].describe();
        anyhow::anyhow!("cannot write {path}: No space left on device")
    }
}

impl StateStore for SimStore {
    fn load(&mut self) -> anyhow::Result<Option<CycleState>> {
        self.0.boundary("before", "load");
        if self.disk_fault("cycle.json read fails") {
            self.0.sim.borrow_mut().log("load -> err");
            bail!("cannot read sim/cycle.json: I/O error");
        }
        let slot = self.0.slot();
        self.pool_write()?;
        {
            let mut s = self.0.sim.borrow_mut();
            if s.hosts[s.slots[slot].host].pg && s.slots[slot].disk.is_none() {
                s.adopt(slot);
            }
        }
        let s = self.0.sim.borrow();
        let text = s.slots[slot]
            .disk
            .as_ref()
            .map(|(b, _)| String::from_utf8(b.clone()).expect("utf-8"));
        drop(s);
        let r = match text {
            None => Ok(None),
            Some(t) => ci_ephemeral_provisioner::core::state::parse_state(&t).map(Some),
        };
        let phase = self.0.sim.borrow().disk_phase(slot);
        self.0.sim.borrow_mut().log(format!("load -> {phase}"));
        r
    }

    fn save(&mut self, state: &CycleState) -> anyhow::Result<()> {
        let what = format!("save({})", phase_name(state.phase));
        self.0.boundary("before", &what);
        self.pool_write()?;
        if self.disk_fault("cycle.json write fails") {
            return Err(self.write_failed(&what));
        }
        self.write(&what, state);
        self.0.checked(&what);
        self.0.boundary("after", &what);
        Ok(())
    }

    /// Under the pool's claims lock: read the other slots' claims and write this one, or not.
    /// Atomic here (no step boundary between the read and the write), with the boundaries and
    /// faults of `save` around it, and a read of the others that can fail as in `others`.
    fn save_claiming(
        &mut self,
        state: &CycleState,
        job_id: i64,
        handle: &str,
    ) -> anyhow::Result<Claim> {
        if self.alone() {
            return self.save(state).map(|()| Claim::Saved);
        }
        let what = format!("save({})", phase_name(state.phase));
        self.0.boundary("before", &what);
        self.pool_write()?;
        let others = self.read_others().inspect_err(|_| {
            self.0
                .sim
                .borrow_mut()
                .log(format!("{what} -> err (others)"));
        })?;
        if let Some(by) = others.claimant(job_id, handle).cloned() {
            let mut s = self.0.sim.borrow_mut();
            s.stats.claims_refused += 1;
            s.log(format!("{what} refused: job {job_id} is held by {by}"));
            drop(s);
            self.0.boundary("after", &what);
            return Ok(Claim::HeldBy(by));
        }
        if self.disk_fault("cycle.json write fails") {
            return Err(self.write_failed(&what));
        }
        self.write(&format!("{what} claiming job {job_id}"), state);
        self.0.checked(&what);
        self.0.boundary("after", &what);
        Ok(Claim::Saved)
    }

    fn load_backoff(&mut self) -> anyhow::Result<Backoff> {
        let s = self.0.sim.borrow();
        let me = s.slot_of(self.0.inv);
        Ok(s.hosts[s.pool_of(s.slots[me].host)].backoff.clone())
    }

    fn save_backoff(&mut self, backoff: &Backoff) -> anyhow::Result<()> {
        let mut s = self.0.sim.borrow_mut();
        let me = s.slot_of(self.0.inv);
        let h = s.pool_of(s.slots[me].host);
        s.hosts[h].backoff = backoff.clone();
        let text = format!(
            "save(backoff) {} failed, until {:?}",
            backoff.consecutive_failed_cycles,
            backoff.until.map(|u| u.0)
        );
        s.log(text);
        Ok(())
    }

    /// Under the pool's claims lock, as `FileStore` does it: the other slots' claims, the gate
    /// (and a retry's re-arm) and the write, with no step boundary in between.
    fn save_starting(
        &mut self,
        state: &CycleState,
        job_id: i64,
        handle: &str,
        gate: &BackoffGate,
    ) -> anyhow::Result<Start> {
        let what = format!("save({}) starting", phase_name(state.phase));
        self.0.boundary("before", &what);
        self.pool_write()?;
        self.unique_id(state)?;
        if !self.alone() {
            let others = self.read_others().inspect_err(|_| {
                self.0
                    .sim
                    .borrow_mut()
                    .log(format!("{what} -> err (others)"));
            })?;
            if let Some(by) = others.claimant(job_id, handle).cloned() {
                let mut s = self.0.sim.borrow_mut();
                s.stats.claims_refused += 1;
                s.log(format!("{what} refused: job {job_id} is held by {by}"));
                drop(s);
                self.0.boundary("after", &what);
                return Ok(Start::Claim(Claim::HeldBy(by)));
            }
        }
        if gate.policy.enabled() {
            match self.load_backoff()?.gate(&gate.policy, gate.now) {
                Gate::Closed(c) => {
                    let mut s = self.0.sim.borrow_mut();
                    s.stats.backed_off += 1;
                    s.log(format!("{what}: backing off until {}", c.until.0));
                    drop(s);
                    self.0.boundary("after", &what);
                    return Ok(Start::BackingOff(c));
                }
                Gate::Retry(armed) => self.save_backoff(&armed)?,
                Gate::Open => {}
            }
        }
        if self.disk_fault("cycle.json write fails") {
            return Err(self.write_failed(&what));
        }
        self.write(&format!("{what} claiming job {job_id}"), state);
        {
            let mut s = self.0.sim.borrow_mut();
            let slot = s.slot_of(self.0.inv);
            s.cycle_started(slot, None, gate.now.0, &gate.policy);
        }
        self.0.checked(&what);
        self.0.boundary("after", &what);
        Ok(Start::Claim(Claim::Saved))
    }

    /// Under the pool's claims lock, as `FileStore` does it: the product's
    /// `save_starting_warm_in` on the store with the lock held (`Locked`: the other slots' warm
    /// VMs, the gate, the write, with no step boundary in between).
    fn save_starting_warm(
        &mut self,
        state: &CycleState,
        wanted: u32,
        gate: &BackoffGate,
    ) -> anyhow::Result<Start> {
        let what = format!("save({}) starting warm", phase_name(state.phase));
        self.0.boundary("before", &what);
        self.pool_write()?;
        self.unique_id(state)?;
        let backoff = self.load_backoff()?;
        let r = save_starting_warm_in(&mut Locked(SimStore(self.0.clone())), state, wanted, gate);
        {
            let mut s = self.0.sim.borrow_mut();
            // A pool that backs off makes no warm VM (docs/operating.md, "Warm capacity").
            if matches!(r, Ok(Start::Claim(Claim::Saved)))
                && let Gate::Closed(c) = backoff.gate(&gate.policy, gate.now)
            {
                s.violate(format!(
                    "a warm VM was started while the pool backs off (until {})",
                    c.until.0
                ));
            }
            match &r {
                Err(_) => {
                    s.log(format!("{what} -> err"));
                    return r;
                }
                Ok(Start::Claim(Claim::Saved)) => {
                    s.stats.warm_starts += 1;
                    let slot = s.slot_of(self.0.inv);
                    s.cycle_started(slot, Some(&state.cycle_id), gate.now.0, &gate.policy);
                }
                Ok(Start::Claim(Claim::HeldBy(by))) => s.log(format!(
                    "{what} refused: {by} are all --warm {wanted} wants"
                )),
                Ok(Start::BackingOff(c)) => {
                    s.stats.backed_off += 1;
                    s.log(format!("{what}: backing off until {}", c.until.0));
                }
            }
        }
        self.0.checked(&what);
        self.0.boundary("after", &what);
        r
    }

    /// Under the claims lock; a crash after it and before cycle.json goes counts it again,
    /// once.
    fn record_outcome(
        &mut self,
        gate: &BackoffGate,
        cycle_id: &str,
        outcome: CycleOutcome,
    ) -> anyhow::Result<(Backoff, Change)> {
        self.0.boundary("before", "record outcome");
        self.pool_write()?;
        let r = record_outcome_in(self, gate, cycle_id, outcome);
        self.0
            .sim
            .borrow_mut()
            .log(format!("record outcome {cycle_id} {outcome:?}"));
        self.0.boundary("after", "record outcome");
        r
    }

    fn others(&mut self) -> anyhow::Result<Others> {
        if self.alone() {
            return Ok(Others::default());
        }
        self.0.boundary("before", "read others");
        let r = self.read_others();
        {
            let mut s = self.0.sim.borrow_mut();
            if s.tracing {
                let text = match &r {
                    Ok(o) => format!(
                        "read others -> claimed {:?} {:?}, {} name(s)",
                        o.claimed.keys().collect::<Vec<_>>(),
                        o.claimed_any_attempt.keys().collect::<Vec<_>>(),
                        o.names.len()
                    ),
                    Err(_) => "read others -> err".to_string(),
                };
                s.log(text);
            }
        }
        self.0.boundary("after", "read others");
        r
    }

    fn remove(&mut self) -> anyhow::Result<()> {
        self.0.boundary("before", "remove");
        self.pool_write()?;
        if self.disk_fault("cycle.json remove fails") {
            self.0.sim.borrow_mut().log("remove -> err");
            bail!("cannot remove sim/cycle.json: I/O error");
        }
        {
            let slot = self.0.slot();
            let mut s = self.0.sim.borrow_mut();
            s.slots[slot].disk = None;
            s.log("remove cycle.json");
        }
        self.0.checked("remove");
        self.0.boundary("after", "remove");
        Ok(())
    }

    fn describe(&self) -> String {
        let s = self.0.sim.borrow();
        s.slots[s.slot_of(self.0.inv)].describe()
    }

    fn guard(&mut self, _step: &str) -> anyhow::Result<()> {
        self.pool_write()
    }

    fn load_holds(&mut self) -> Result<Holds, HoldsError> {
        self.0.boundary("before", "load holds");
        let slot = self.0.slot();
        if self.disk_fault("held-jobs.json read fails") {
            let mut s = self.0.sim.borrow_mut();
            let inv = self.0.inv;
            s.invs[inv].holds_read_failed = true;
            s.slots[slot].holds_lost = true;
            s.log("load holds -> err");
            return Err(HoldsError::Unreadable(
                "cannot read sim/held-jobs.json: I/O error".into(),
            ));
        }
        let s = self.0.sim.borrow();
        let text = s.slots[slot]
            .holds_disk
            .as_ref()
            .map(|(b, _)| String::from_utf8(b.clone()).expect("utf-8"));
        drop(s);
        match text {
            None => Ok(Holds::default()),
            Some(t) => parse_holds(&t).map_err(|e| HoldsError::Unusable(format!("{e:#}"))),
        }
    }

    fn save_holds(&mut self, holds: &Holds) -> anyhow::Result<()> {
        self.0.boundary("before", "save(holds)");
        let slot = self.0.slot();
        if self.disk_fault("held-jobs.json write fails") {
            let mut s = self.0.sim.borrow_mut();
            s.slots[slot].holds_lost = true;
            s.log("save(holds) -> err");
            bail!("cannot write sim/held-jobs.json: No space left on device");
        }
        {
            let mut s = self.0.sim.borrow_mut();
            s.write_holds(slot, holds);
            if s.tracing {
                let held: Vec<String> = holds
                    .jobs
                    .iter()
                    .map(|h| format!("{}x{}<{}", h.job_id, h.times, h.until))
                    .collect();
                s.log(format!("save(holds) [{}]", held.join(" ")));
            }
        }
        self.0.checked("save(holds)");
        self.0.boundary("after", "save(holds)");
        Ok(())
    }
}

/// The store with the pool's claims lock held (`FileStore`'s `Locked`): the reads and the write
/// of `save_starting_warm_in` are no steps of their own; the faults of `others` and `save` stay.
struct Locked(SimStore);

impl StateStore for Locked {
    fn load(&mut self) -> anyhow::Result<Option<CycleState>> {
        self.0.load()
    }

    fn save(&mut self, state: &CycleState) -> anyhow::Result<()> {
        let what = format!("save({}) starting warm", phase_name(state.phase));
        if self.0.disk_fault("cycle.json write fails") {
            return Err(self.0.write_failed(&what));
        }
        self.0.write(&what, state);
        Ok(())
    }

    fn remove(&mut self) -> anyhow::Result<()> {
        self.0.remove()
    }

    fn describe(&self) -> String {
        self.0.describe()
    }

    fn load_holds(&mut self) -> Result<Holds, HoldsError> {
        self.0.load_holds()
    }

    fn save_holds(&mut self, holds: &Holds) -> anyhow::Result<()> {
        self.0.save_holds(holds)
    }

    fn others(&mut self) -> anyhow::Result<Others> {
        if self.0.alone() {
            return Ok(Others::default());
        }
        self.0.read_others()
    }

    fn load_backoff(&mut self) -> anyhow::Result<Backoff> {
        self.0.load_backoff()
    }

    fn save_backoff(&mut self, backoff: &Backoff) -> anyhow::Result<()> {
        self.0.save_backoff(backoff)
    }
}

// -- the clock -------------------------------------------------------------------------------------------------

pub struct SimClock(pub Port);

impl Clock for SimClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.sim.borrow().now)
    }

    fn sleep(&mut self, d: Duration) -> Sleep {
        // The run waits a poll interval: the invariant on waits next to an unserved job.
        let inv = self.0.inv;
        self.0.sim.borrow_mut().check_not_served(inv);
        self.0.sim.borrow_mut().check_warm_wait(inv);
        self.0.boundary("", "sleep");
        if self.0.stop() {
            return Sleep::Interrupted;
        }
        {
            // A quiet period that keeps `--warm`: a run that waits on an unused warm VM ends at
            // its wait, as at a SIGHUP (cycle.json kept, the next run resumes), so that the
            // slots' runs, which take turns here, each keep theirs as if they ran side by side.
            let mut s = self.0.sim.borrow_mut();
            let slot = s.slot_of(inv);
            if !s.faults_on
                && s.warm.quiet_keeps
                && super::warm::unused_warm_up(s.slots[slot].disk.as_ref().map(|(_, st)| st))
            {
                s.stats.warm_reloads += 1;
                s.log("SIGHUP: the run ends at its wait on the unused warm VM");
                return Sleep::Reload;
            }
        }
        {
            // A nested run of another slot ends at its first wait if it runs at an instant, at
            // one of its waits if not (it is asked to stop), so that the run it interrupted
            // goes on soon; its next run resumes.
            let mut s = self.0.sim.borrow_mut();
            let i = &s.invs[inv];
            if i.started == Started::Nested && (i.instant || s.rng.chance(0.5)) {
                s.log("the nested run is stopped at its wait");
                return Sleep::Interrupted;
            }
        }
        {
            let mut s = self.0.sim.borrow_mut();
            let to = s.now + d.as_millis() as i64;
            s.advance(to, true);
        }
        self.0.checked("sleep");
        Sleep::Slept
    }

    fn stop_requested(&self) -> bool {
        self.0.stop()
    }

    fn new_cycle_id(&mut self, now: Timestamp) -> String {
        let r = self.0.sim.borrow_mut().rng.next_u64() as u16;
        format!("{}-{r:04x}", now.compact())
    }
}
