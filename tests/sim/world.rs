//! The simulated world: Forgejo (runners, jobs, its own clean-ups), the runner processes on our
//! VM, other pools and persistent runners, the VM module's state, cycle.json on disk, time, the
//! fault plan, the statistics and the trace. Everything random comes from one seeded `Rng`.

use std::collections::{BTreeMap, VecDeque};

use ci_ephemeral_provisioner::model::{Job, Runner, RunnerStatus, job_matches};
use ci_ephemeral_provisioner::state::{CycleState, Phase, parse_state};

use super::rng::Rng;

pub const PREFIX: &str = "ephemeral-a-";
pub const OTHER_PREFIX: &str = "ephemeral-b-";
pub const LABEL: &str = "debian";
pub const HTTP_TIMEOUT_MS: i64 = 30_000;
/// 2026-09-20T…Z: any fixed start; only differences matter.
pub const T0: i64 = 1_790_000_000_000;
/// `RunnerOfflineTime` and `RunnerIdleTime` (Forgejo `models/actions/runner.go`).
const OFFLINE_AFTER: i64 = 60_000;
const IDLE_AFTER: i64 = 10_000;
/// `[actions].ZOMBIE_TASK_TIMEOUT` and the `stop_zombie_tasks` cron interval.
const ZOMBIE_TIMEOUT: i64 = 600_000;
const ZOMBIE_CRON: i64 = 300_000;
const SEC: i64 = 1_000;
const MIN: i64 = 60_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// Registered by the provisioner under test (its POST reached Forgejo).
    Ours,
    /// Our prefix, from before this simulation (a lost cycle.json, an old installation).
    Legacy,
    /// Another pool's provisioner (`ephemeral-b-`).
    OtherPool,
    /// Hand-registered, long-lived runners (names are not unique among them).
    Persistent,
}

pub struct SRunner {
    pub id: i64,
    pub name: String,
    pub owner: Owner,
    pub ephemeral: bool,
    /// Unix ms; 0 = never connected.
    pub last_online: i64,
    pub last_active: i64,
    /// The runner process polls: `last_online` is "now".
    pub polling: bool,
    /// Running a task and reporting: `last_active` is "now".
    pub busy: bool,
    pub deleted: bool,
}

impl SRunner {
    /// `ActionRunner.Status()`.
    pub fn status(&self, now: i64) -> RunnerStatus {
        let lo = if self.polling { now } else { self.last_online };
        let la = if self.busy { now } else { self.last_active };
        if lo == 0 || now - lo > OFFLINE_AFTER {
            RunnerStatus::Offline
        } else if now - la > IDLE_AFTER {
            RunnerStatus::Idle
        } else {
            RunnerStatus::Active
        }
    }

    fn effective_last_online(&self, now: i64) -> i64 {
        if self.polling { now } else { self.last_online }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobState {
    Waiting,
    Running(i64),
    Done(&'static str),
}

pub struct SJob {
    pub id: i64,
    pub handle: String,
    pub runs_on: &'static [&'static str],
    pub state: JobState,
}

/// How a runner we launched behaves (`forgejo-runner one-job --handle … --wait`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    Normal,
    NeverConnects,
    /// Connects, never takes its job (polls forever while the VM lives).
    ConnectsNoJob,
    /// Takes its job and stays active forever.
    HangActive,
    /// Takes its job, then stops reporting (offline after 60 s; Forgejo's zombie clean-up ends
    /// the task and deletes the registration 10 minutes later).
    HangSilent,
    /// Connects, then the process dies before taking a job.
    DiesEarly,
}

impl Behaviour {
    pub fn name(self) -> &'static str {
        match self {
            Behaviour::Normal => "normal",
            Behaviour::NeverConnects => "runner never connects",
            Behaviour::ConnectsNoJob => "runner connects without taking its job",
            Behaviour::HangActive => "runner hangs active",
            Behaviour::HangSilent => "runner hangs silent",
            Behaviour::DiesEarly => "runner dies after connecting",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Connect,
    Take,
    Finish,
    GoSilent,
    Die,
    /// Polls forever (until the VM goes).
    Poll,
}

struct Proc {
    handle: String,
    vm: String,
    behaviour: Behaviour,
    stage: Stage,
    next_at: i64,
}

#[derive(Clone, Debug)]
enum Bg {
    JobArrival,
    JobCancel(i64),
    JobTakenByOther(i64),
    JobFinish(i64),
    ZombieCron,
    PersistentFlip(i64),
    OtherPoolRegister,
    OtherConnect(i64),
    OtherDone(i64),
    LegacyFinish(i64),
    /// A POST whose client gave up lands now.
    LatePost(String),
}

/// Fault rates of one seed (all zero once the world goes quiet).
#[derive(Clone, Copy, Debug, Default)]
pub struct FaultCfg {
    pub api: f64,
    pub crash: f64,
    pub tofu: f64,
    pub launch: f64,
    pub runner: f64,
    pub store: f64,
    pub race: f64,
    pub signal: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiFault {
    Status5xx,
    Status5xxApplied,
    Timeout,
    TimeoutApplied,
    Reset,
    ResetApplied,
    Html,
    HtmlApplied,
    Truncated,
    Rejected,
    Proxy404,
    LatePost,
    OddRows,
}

impl ApiFault {
    pub fn name(self) -> &'static str {
        match self {
            ApiFault::Status5xx => "api 5xx",
            ApiFault::Status5xxApplied => "api 5xx after applying",
            ApiFault::Timeout => "api timeout",
            ApiFault::TimeoutApplied => "api applied, answer lost (timeout)",
            ApiFault::Reset => "api connection reset",
            ApiFault::ResetApplied => "api applied, answer lost (reset)",
            ApiFault::Html => "api HTML error page",
            ApiFault::HtmlApplied => "api applied, HTML body",
            ApiFault::Truncated => "api applied, truncated body",
            ApiFault::Rejected => "api 4xx rejection",
            ApiFault::Proxy404 => "api proxy 404 (not Forgejo's)",
            ApiFault::LatePost => "api POST lands after the client gave up",
            ApiFault::OddRows => "api odd status/name in rows",
        }
    }

    /// The server carried the request out.
    pub fn applied(self) -> bool {
        matches!(
            self,
            ApiFault::Status5xxApplied
                | ApiFault::TimeoutApplied
                | ApiFault::ResetApplied
                | ApiFault::HtmlApplied
                | ApiFault::Truncated
                | ApiFault::OddRows
        )
    }
}

#[derive(Default, Clone)]
pub struct Stats {
    pub seeds: u64,
    pub invocations: u64,
    pub steps: u64,
    pub faults: BTreeMap<&'static str, u64>,
    pub crashes: BTreeMap<String, u64>,
    pub races_refused: u64,
    pub deletes: BTreeMap<String, u64>,
    pub vms_created: u64,
    pub jobs_served: u64,
}

impl Stats {
    pub fn merge(&mut self, o: &Stats) {
        self.seeds += o.seeds;
        self.invocations += o.invocations;
        self.steps += o.steps;
        self.races_refused += o.races_refused;
        self.vms_created += o.vms_created;
        self.jobs_served += o.jobs_served;
        for (k, v) in &o.faults {
            *self.faults.entry(k).or_default() += v;
        }
        for (k, v) in &o.crashes {
            *self.crashes.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.deletes {
            *self.deletes.entry(k.clone()).or_default() += v;
        }
    }
}

/// Per invocation (process) of the provisioner.
#[derive(Default)]
pub struct Invocation {
    pub destroy_ok: bool,
    pub stop: bool,
    pub steps: u64,
    pub nested: bool,
}

pub struct Sim {
    pub seed: u64,
    pub rng: Rng,
    pub now: i64,
    pub runners: BTreeMap<i64, SRunner>,
    next_runner_id: i64,
    pub jobs: BTreeMap<i64, SJob>,
    next_job_id: i64,
    bg: BTreeMap<(i64, u64), Bg>,
    bg_seq: u64,
    procs: BTreeMap<i64, Proc>,
    /// Bumped on every insert and delete: ties in the list order are reshuffled by it.
    rows_version: u64,
    /// `SIM_RANDOM_TIES=1`: ties in a new order on every request (a database that gives no
    /// stable order among equal keys even between identical queries).
    pub random_ties: bool,
    /// Runners listed without a name (a targeted regression test's hostile server).
    pub nameless: Vec<i64>,
    /// The VM module's resources: cycle ids of existing VMs.
    pub vms: Vec<String>,
    /// cycle.json: the bytes written and what they parse to.
    pub disk: Option<(Vec<u8>, CycleState)>,
    /// held-jobs.json: the bytes written (none: no file).
    pub holds_disk: Option<Vec<u8>>,
    pub cfg: FaultCfg,
    pub faults_on: bool,
    pub arrivals_on: bool,
    mean_arrival_ms: i64,
    pub stats: Stats,
    pub step: u64,
    pub invs: Vec<Invocation>,
    pub violation: Option<String>,
    trace: VecDeque<String>,
    trace_cap: usize,
    pub trace_hash: u64,
    pub echo: bool,
    /// Trace lines are built (replays, the determinism test, re-runs of a failing seed).
    pub tracing: bool,
    /// Ids of the registrations our POSTs created (live or not).
    ours: Vec<i64>,
}

impl Sim {
    /// `trace_cap`: trace lines kept for a failure report; `tracing`: build trace lines at all
    /// (the run is the same either way); `echo`: print them as they happen.
    pub fn new(seed: u64, trace_cap: usize, tracing: bool, echo: bool) -> Sim {
        let mut rng = Rng::new(seed);
        let levels = |rng: &mut Rng, xs: &[f64]| xs[rng.below(xs.len() as u64) as usize];
        let cfg = FaultCfg {
            api: levels(&mut rng, &[0.0, 0.02, 0.08, 0.2]),
            crash: levels(&mut rng, &[0.0, 0.003, 0.01, 0.03]),
            tofu: levels(&mut rng, &[0.0, 0.1, 0.3]),
            launch: levels(&mut rng, &[0.0, 0.1, 0.3]),
            runner: levels(&mut rng, &[0.0, 0.2, 0.5]),
            store: levels(&mut rng, &[0.0, 0.005, 0.02]),
            race: levels(&mut rng, &[0.0, 0.0, 0.01]),
            signal: levels(&mut rng, &[0.0, 0.0, 0.003]),
        };
        let mean_arrival_ms = rng.range(2 * MIN, 15 * MIN);
        let mut sim = Sim {
            seed,
            rng,
            now: T0,
            runners: BTreeMap::new(),
            next_runner_id: 1,
            jobs: BTreeMap::new(),
            next_job_id: 1,
            bg: BTreeMap::new(),
            bg_seq: 0,
            procs: BTreeMap::new(),
            rows_version: 0,
            nameless: Vec::new(),
            random_ties: std::env::var("SIM_RANDOM_TIES").is_ok_and(|v| v == "1"),
            vms: Vec::new(),
            disk: None,
            holds_disk: None,
            cfg,
            faults_on: true,
            arrivals_on: true,
            mean_arrival_ms,
            stats: Stats {
                seeds: 1,
                ..Stats::default()
            },
            step: 0,
            invs: Vec::new(),
            violation: None,
            trace: VecDeque::new(),
            trace_cap,
            trace_hash: 0xcbf2_9ce4_8422_2325,
            echo,
            tracing: tracing || echo,
            ours: Vec::new(),
        };
        sim.populate();
        sim
    }

    // -- trace ------------------------------------------------------------------------------------

    pub fn log(&mut self, text: impl AsRef<str>) {
        if !self.tracing {
            return;
        }
        let line = format!(
            "#{} t+{}.{:03}s {}",
            self.step,
            (self.now - T0) / 1000,
            (self.now - T0) % 1000,
            text.as_ref()
        );
        for b in line.bytes().chain(std::iter::once(b'\n')) {
            self.trace_hash ^= u64::from(b);
            self.trace_hash = self.trace_hash.wrapping_mul(0x0100_0000_01b3);
        }
        if self.echo {
            println!("{line}");
        }
        if self.trace_cap > 0 {
            if self.trace.len() == self.trace_cap {
                self.trace.pop_front();
            }
            self.trace.push_back(line);
        }
    }

    pub fn trace_tail(&self) -> String {
        self.trace.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    pub fn violate(&mut self, what: String) {
        if self.violation.is_none() {
            let msg = format!(
                "seed {} step {}: {what}\n  replay: SIM_SEED={} cargo test --release --test sim -- --nocapture",
                self.seed, self.step, self.seed
            );
            self.log(format!("VIOLATION: {what}"));
            self.violation = Some(msg);
        }
    }

    pub fn count_fault(&mut self, kind: &'static str) {
        *self.stats.faults.entry(kind).or_default() += 1;
    }

    // -- set-up -----------------------------------------------------------------------------------

    fn add_runner(&mut self, name: String, owner: Owner, ephemeral: bool) -> i64 {
        let id = self.next_runner_id;
        self.next_runner_id += 1;
        self.rows_version += 1;
        self.runners.insert(
            id,
            SRunner {
                id,
                name,
                owner,
                ephemeral,
                last_online: 0,
                last_active: 0,
                polling: false,
                busy: false,
                deleted: false,
            },
        );
        id
    }

    fn schedule(&mut self, at: i64, ev: Bg) {
        self.bg_seq += 1;
        self.bg.insert((at, self.bg_seq), ev);
    }

    fn populate(&mut self) {
        let now = self.now;
        // Persistent runners: one online that takes jobs, duplicate names, near-miss names.
        let builder = self.add_runner("static-builder".into(), Owner::Persistent, false);
        let r = self.runners.get_mut(&builder).expect("just added");
        r.polling = true;
        r.last_active = now - 3_600_000;
        for (name, online) in [
            ("build-01", true),
            ("build-01", false),
            ("ephemeral-a", false),
            ("my-ephemeral-a-1", false),
            ("EPHEMERAL-A-1", false),
        ] {
            let id = self.add_runner(name.into(), Owner::Persistent, false);
            let r = self.runners.get_mut(&id).expect("just added");
            r.last_online = now - 7_200_000;
            if online {
                r.polling = true;
                r.last_active = now - 3_600_000;
                let at = now + self.rng.range(5 * MIN, 60 * MIN);
                self.schedule(at, Bg::PersistentFlip(id));
            }
        }
        // Enough old rows, sometimes, for two or three list pages.
        let filler = match self.rng.below(4) {
            0 => 0,
            1 => self.rng.range(0, 20),
            2 => self.rng.range(40, 60),
            _ => self.rng.range(60, 110),
        };
        for i in 0..filler {
            let id = self.add_runner(format!("old-runner-{}", i % 17), Owner::Persistent, false);
            self.runners.get_mut(&id).expect("just added").last_online = now - 86_400_000;
        }
        // Another pool's leftovers.
        for i in 0..self.rng.range(0, 4) {
            self.add_runner(format!("{OTHER_PREFIX}old-{i}"), Owner::OtherPool, true);
        }
        // Our prefix from before: offline leftovers (one name twice) and one still busy.
        let n = self.rng.range(0, 4);
        for i in 0..n {
            let seq = if i == 1 { 0 } else { i };
            self.add_runner(
                format!("{PREFIX}20260101t000000z-dead-{seq}"),
                Owner::Legacy,
                true,
            );
        }
        if self.rng.chance(0.3) {
            let id = self.add_runner(
                format!("{PREFIX}20260101t000000z-busy-1"),
                Owner::Legacy,
                true,
            );
            let r = self.runners.get_mut(&id).expect("just added");
            r.polling = true;
            r.busy = true;
            r.last_online = now;
            let at = now + self.rng.range(MIN, 20 * MIN);
            self.schedule(at, Bg::LegacyFinish(id));
        }
        let first = now + self.rng.range(0, self.mean_arrival_ms);
        self.schedule(first, Bg::JobArrival);
        self.schedule(now + ZOMBIE_CRON, Bg::ZombieCron);
        let at = now + self.rng.range(MIN, 20 * MIN);
        self.schedule(at, Bg::OtherPoolRegister);
    }

    /// Faults stop, no more jobs arrive except one last one, so a last cycle runs (and sweeps).
    pub fn go_quiet(&mut self) {
        self.faults_on = false;
        self.arrivals_on = false;
        self.new_job(&[LABEL]);
        self.log("QUIET: faults off, one last job, no more arrivals");
    }

    fn new_job(&mut self, runs_on: &'static [&'static str]) -> i64 {
        let id = self.next_job_id;
        self.next_job_id += 1;
        let handle = format!("{:08x}-h", self.rng.next_u64() as u32);
        self.jobs.insert(
            id,
            SJob {
                id,
                handle,
                runs_on,
                state: JobState::Waiting,
            },
        );
        id
    }

    // -- time ---------------------------------------------------------------------------------------

    /// Moves time to `to`, running what happens meanwhile. `ours`: the runner processes on our VM
    /// act too. They act only while the driver waits (poll sleep, tofu, launch, between runs):
    /// the GET→DELETE window inside one step is treated as atomic, since Forgejo has no
    /// conditional DELETE (a race no client can close).
    pub fn advance(&mut self, to: i64, ours: bool) {
        loop {
            let bg = self
                .bg
                .first_key_value()
                .map(|(k, _)| *k)
                .filter(|(t, _)| *t <= to);
            let pr = if ours {
                self.procs
                    .iter()
                    .map(|(id, p)| (p.next_at, *id))
                    .filter(|(t, _)| *t <= to)
                    .min()
            } else {
                None
            };
            let proc_first = match (bg, pr) {
                (None, None) => break,
                (Some(k), Some((pt, _))) => pt < k.0,
                (None, Some(_)) => true,
                (Some(_), None) => false,
            };
            if proc_first {
                let (t, id) = pr.expect("some");
                self.now = self.now.max(t);
                self.run_proc(id);
            } else {
                let k = bg.expect("some");
                let ev = self.bg.remove(&k).expect("present");
                self.now = self.now.max(k.0);
                self.run_bg(ev);
            }
        }
        self.now = self.now.max(to);
    }

    fn delete_runner_server_side(&mut self, id: i64) {
        self.rows_version += 1;
        if let Some(r) = self.runners.get_mut(&id) {
            r.deleted = true;
            r.polling = false;
            r.busy = false;
        }
        self.procs.remove(&id);
    }

    fn run_bg(&mut self, ev: Bg) {
        let now = self.now;
        match ev {
            Bg::JobArrival => {
                if !self.arrivals_on {
                    return;
                }
                let runs_on: &'static [&'static str] = match self.rng.below(10) {
                    0..=6 => &[LABEL],
                    7 => &["gpu"],
                    _ => &[LABEL, "docker"],
                };
                let id = self.new_job(runs_on);
                if self.faults_on && self.rng.chance(0.1) {
                    let at = now + self.rng.range(10 * SEC, 20 * MIN);
                    self.schedule(at, Bg::JobCancel(id));
                }
                if self.rng.chance(0.15) {
                    let at = now + self.rng.range(5 * SEC, 5 * MIN);
                    self.schedule(at, Bg::JobTakenByOther(id));
                }
                let gap = self.rng.range(SEC, 2 * self.mean_arrival_ms);
                self.schedule(now + gap, Bg::JobArrival);
            }
            Bg::JobCancel(j) => {
                let Some(job) = self.jobs.get_mut(&j) else {
                    return;
                };
                match job.state {
                    JobState::Waiting => job.state = JobState::Done("cancelled"),
                    JobState::Running(r) => {
                        job.state = JobState::Done("cancelled");
                        // StopTask deletes an ephemeral runner.
                        if self
                            .runners
                            .get(&r)
                            .is_some_and(|r| r.ephemeral && !r.deleted)
                        {
                            self.delete_runner_server_side(r);
                        } else if let Some(r) = self.runners.get_mut(&r) {
                            r.busy = false;
                            r.last_active = now;
                        }
                    }
                    JobState::Done(_) => {}
                }
            }
            Bg::JobTakenByOther(j) => {
                let taker = self
                    .runners
                    .values()
                    .find(|r| r.owner == Owner::Persistent && r.polling && !r.busy && !r.deleted)
                    .map(|r| r.id);
                let waiting = self
                    .jobs
                    .get(&j)
                    .is_some_and(|job| job.state == JobState::Waiting);
                if let (Some(r), true) = (taker, waiting) {
                    self.jobs.get_mut(&j).expect("present").state = JobState::Running(r);
                    let run = self.runners.get_mut(&r).expect("present");
                    run.busy = true;
                    let at = now + self.rng.range(MIN, 10 * MIN);
                    self.schedule(at, Bg::JobFinish(j));
                }
            }
            Bg::JobFinish(j) => {
                if let Some(job) = self.jobs.get_mut(&j)
                    && let JobState::Running(r) = job.state
                {
                    job.state = JobState::Done("success");
                    if let Some(run) = self.runners.get_mut(&r) {
                        run.busy = false;
                        run.last_active = now;
                    }
                }
            }
            Bg::ZombieCron => {
                let zombies: Vec<(i64, i64)> = self
                    .jobs
                    .values()
                    .filter_map(|j| match j.state {
                        JobState::Running(r) => Some((j.id, r)),
                        _ => None,
                    })
                    .filter(|(_, r)| {
                        self.runners.get(r).is_none_or(|r| {
                            r.deleted || (!r.polling && now - r.last_online > ZOMBIE_TIMEOUT)
                        })
                    })
                    .collect();
                for (j, r) in zombies {
                    self.jobs.get_mut(&j).expect("present").state = JobState::Done("failure");
                    if self
                        .runners
                        .get(&r)
                        .is_some_and(|r| r.ephemeral && !r.deleted)
                    {
                        self.log(format!(
                            "forgejo: zombie task of job {j} stopped, runner {r} deleted"
                        ));
                        self.delete_runner_server_side(r);
                    }
                }
                self.schedule(now + ZOMBIE_CRON, Bg::ZombieCron);
            }
            Bg::PersistentFlip(id) => {
                if let Some(r) = self.runners.get_mut(&id)
                    && !r.busy
                {
                    if r.polling {
                        r.polling = false;
                        r.last_online = now;
                    } else {
                        r.polling = true;
                    }
                }
                if self.faults_on {
                    let at = now + self.rng.range(5 * MIN, 60 * MIN);
                    self.schedule(at, Bg::PersistentFlip(id));
                }
            }
            Bg::OtherPoolRegister => {
                if !self.arrivals_on {
                    return;
                }
                let n = self.next_runner_id;
                let id = self.add_runner(format!("{OTHER_PREFIX}{n}-1"), Owner::OtherPool, true);
                if self.rng.chance(0.8) {
                    let at = now + self.rng.range(5 * SEC, 40 * SEC);
                    self.schedule(at, Bg::OtherConnect(id));
                }
                let at = now + self.rng.range(2 * MIN, 20 * MIN);
                self.schedule(at, Bg::OtherPoolRegister);
            }
            Bg::OtherConnect(id) => {
                if let Some(r) = self.runners.get_mut(&id).filter(|r| !r.deleted) {
                    r.polling = true;
                    r.busy = true;
                    r.last_online = now;
                    let at = now + self.rng.range(10 * SEC, 10 * MIN);
                    self.schedule(at, Bg::OtherDone(id));
                }
            }
            Bg::OtherDone(id) | Bg::LegacyFinish(id) => {
                if self.runners.get(&id).is_some_and(|r| !r.deleted) {
                    self.delete_runner_server_side(id);
                }
            }
            Bg::LatePost(name) => {
                let id = self.srv_register(&name);
                self.log(format!(
                    "forgejo: the late POST of {name} lands as runner {id}"
                ));
            }
        }
    }

    fn run_proc(&mut self, id: i64) {
        let now = self.now;
        let Some(p) = self.procs.get(&id) else { return };
        let (stage, behaviour, handle) = (p.stage, p.behaviour, p.handle.clone());
        // A deleted registration cannot authenticate: the process exits.
        if self.runners.get(&id).is_none_or(|r| r.deleted) {
            self.procs.remove(&id);
            return;
        }
        let mut next: Option<(Stage, i64)> = None;
        match stage {
            Stage::Connect => {
                if behaviour == Behaviour::NeverConnects {
                    self.procs.remove(&id);
                    return;
                }
                let r = self.runners.get_mut(&id).expect("present");
                r.polling = true;
                r.last_online = now;
                next = match behaviour {
                    Behaviour::ConnectsNoJob => Some((Stage::Poll, i64::MAX)),
                    Behaviour::DiesEarly => {
                        Some((Stage::Die, now + self.rng.range(5 * SEC, 2 * MIN)))
                    }
                    _ => Some((Stage::Take, now + self.rng.range(SEC, 4 * SEC))),
                };
            }
            Stage::Take => {
                let job = self
                    .jobs
                    .values()
                    .find(|j| j.handle == handle && j.state == JobState::Waiting)
                    .map(|j| j.id);
                match job {
                    // `one-job --handle … --wait`: the job went elsewhere; it polls on.
                    None => next = Some((Stage::Poll, i64::MAX)),
                    Some(j) => {
                        self.jobs.get_mut(&j).expect("present").state = JobState::Running(id);
                        self.stats.jobs_served += 1;
                        let r = self.runners.get_mut(&id).expect("present");
                        r.busy = true;
                        r.last_active = now;
                        next = match behaviour {
                            Behaviour::HangActive => Some((Stage::Poll, i64::MAX)),
                            Behaviour::HangSilent => {
                                Some((Stage::GoSilent, now + self.rng.range(10 * SEC, 2 * MIN)))
                            }
                            _ => Some((Stage::Finish, now + self.rng.range(30 * SEC, 10 * MIN))),
                        };
                    }
                }
            }
            Stage::Finish => {
                if let Some(job) = self
                    .jobs
                    .values_mut()
                    .find(|j| j.state == JobState::Running(id))
                {
                    job.state = JobState::Done("success");
                }
                // Final UpdateTask: Forgejo deletes the ephemeral runner.
                self.delete_runner_server_side(id);
                return;
            }
            Stage::GoSilent | Stage::Die => {
                let r = self.runners.get_mut(&id).expect("present");
                r.polling = false;
                r.busy = false;
                r.last_online = now;
                r.last_active = now;
                self.procs.remove(&id);
                return;
            }
            Stage::Poll => {}
        }
        if let (Some((stage, at)), Some(p)) = (next, self.procs.get_mut(&id)) {
            p.stage = stage;
            p.next_at = at;
        }
    }

    // -- the VM and its runner processes ----------------------------------------------------------

    pub fn vm_exists(&self, cycle_id: &str) -> bool {
        self.vms.iter().any(|v| v == cycle_id)
    }

    pub fn create_vm(&mut self, cycle_id: &str) {
        if self.vm_exists(cycle_id) {
            return;
        }
        if !self.vms.is_empty() {
            let others = self.vms.join(", ");
            self.violate(format!(
                "two VMs of one pool at once: applying {cycle_id} while {others} exists"
            ));
        }
        self.stats.vms_created += 1;
        self.vms.push(cycle_id.to_string());
        self.log(format!("tofu: VM {cycle_id} created"));
    }

    /// `tofu destroy` of the module: every VM goes, and every runner process on it stops.
    pub fn destroy_vms(&mut self) {
        let now = self.now;
        for vm in std::mem::take(&mut self.vms) {
            self.log(format!("tofu: VM {vm} destroyed"));
            let on_vm: Vec<i64> = self
                .procs
                .iter()
                .filter(|(_, p)| p.vm == vm)
                .map(|(id, _)| *id)
                .collect();
            for id in on_vm {
                self.procs.remove(&id);
                if let Some(r) = self.runners.get_mut(&id)
                    && r.polling
                {
                    r.polling = false;
                    r.last_online = now;
                    if r.busy {
                        r.busy = false;
                        r.last_active = now;
                    }
                }
            }
        }
    }

    pub fn start_runner_process(&mut self, id: i64, handle: &str, vm: &str) {
        let behaviour = if self.faults_on && self.rng.chance(self.cfg.runner) {
            self.rng.pick(&[
                Behaviour::NeverConnects,
                Behaviour::ConnectsNoJob,
                Behaviour::HangActive,
                Behaviour::HangSilent,
                Behaviour::DiesEarly,
            ])
        } else {
            Behaviour::Normal
        };
        if behaviour != Behaviour::Normal {
            self.count_fault(behaviour.name());
        }
        let next_at = self.now + self.rng.range(2 * SEC, 25 * SEC);
        self.log(format!(
            "runner {id}: process started ({})",
            behaviour.name()
        ));
        self.procs.insert(
            id,
            Proc {
                handle: handle.to_string(),
                vm: vm.to_string(),
                behaviour,
                stage: Stage::Connect,
                next_at,
            },
        );
    }

    // -- Forgejo's API, server side -----------------------------------------------------------------

    pub fn api_fault(&mut self, write: bool, post: bool) -> Option<ApiFault> {
        if !self.faults_on || !self.rng.chance(self.cfg.api) {
            return None;
        }
        use ApiFault::*;
        let f = if post {
            self.rng.pick(&[
                Status5xx,
                Status5xxApplied,
                Timeout,
                TimeoutApplied,
                Reset,
                ResetApplied,
                Html,
                HtmlApplied,
                Truncated,
                Rejected,
                LatePost,
            ])
        } else if write {
            self.rng.pick(&[
                Status5xx,
                Status5xxApplied,
                Timeout,
                TimeoutApplied,
                Reset,
                ResetApplied,
                Html,
                HtmlApplied,
                Rejected,
                Proxy404,
            ])
        } else {
            self.rng.pick(&[
                Status5xx, Timeout, Reset, Html, Truncated, Rejected, Proxy404, OddRows,
            ])
        };
        self.count_fault(f.name());
        Some(f)
    }

    pub fn srv_list_jobs(&self) -> Vec<Job> {
        let names = vec![LABEL.to_string()];
        self.jobs
            .values()
            .rev()
            .filter_map(|j| {
                let status = match j.state {
                    JobState::Waiting => "waiting",
                    JobState::Running(_) => "running",
                    JobState::Done(_) => return None,
                };
                let job = Job {
                    id: j.id,
                    handle: j.handle.clone(),
                    status: status.into(),
                    runs_on: j.runs_on.iter().map(|s| s.to_string()).collect(),
                };
                job_matches(&job, &names).then_some(job)
            })
            .collect()
    }

    pub fn wire_runner(&self, r: &SRunner) -> Runner {
        Runner {
            id: r.id,
            name: Some(r.name.clone()),
            status: r.status(self.now),
            labels: None,
        }
    }

    pub fn live(&self, id: i64) -> Option<&SRunner> {
        self.runners.get(&id).filter(|r| !r.deleted)
    }

    /// `DELETE …/runners/{id}` as applied by the server; checks the deletion invariants.
    pub fn srv_delete(&mut self, id: i64, reason: &str, destroy_ok: bool) -> bool {
        let Some(r) = self.live(id) else {
            return false;
        };
        let status = r.status(self.now);
        let (name, owner) = (r.name.clone(), r.owner);
        if status != RunnerStatus::Offline {
            self.violate(format!(
                "deleted runner {id} ({name}, {owner:?}) while it was {} (reason {reason})",
                status.as_str()
            ));
        }
        if !name.starts_with(PREFIX) {
            self.violate(format!(
                "deleted runner {id} ({name}, {owner:?}) without our prefix (reason {reason})"
            ));
        }
        if !matches!(owner, Owner::Ours | Owner::Legacy) {
            self.violate(format!(
                "deleted runner {id} ({name}) of another pool or a person: {owner:?} (reason {reason})"
            ));
        }
        if reason == "sweep" && !destroy_ok {
            self.violate(format!(
                "sweep deleted runner {id} ({name}) in a run whose tofu destroy did not succeed"
            ));
        }
        *self.stats.deletes.entry(reason.to_string()).or_default() += 1;
        self.delete_runner_server_side(id);
        true
    }

    pub fn srv_register(&mut self, name: &str) -> i64 {
        let id = self.add_runner(name.to_string(), Owner::Ours, true);
        self.ours.push(id);
        id
    }

    pub fn schedule_late_post(&mut self, name: &str) {
        let at = self.now + HTTP_TIMEOUT_MS + self.rng.range(0, HTTP_TIMEOUT_MS - SEC);
        self.schedule(at, Bg::LatePost(name.to_string()));
    }

    /// One page, `ORDER BY last_online DESC`. Ties (every never-connected registration has
    /// `last_online = 0`) come in an arbitrary order that changes whenever rows are added or
    /// deleted, so pages read across a change overlap or skip rows.
    pub fn srv_page(&mut self, page: u32, limit: u32) -> (Vec<Runner>, u64) {
        let limit = match limit {
            0 => 30,
            l if l > 50 => 50,
            l => l,
        } as usize;
        let now = self.now;
        let mut rows: Vec<(i64, u64, i64)> = Vec::new();
        let ids: Vec<i64> = self
            .runners
            .values()
            .filter(|r| !r.deleted)
            .map(|r| r.id)
            .collect();
        for id in ids {
            let lo = self.runners[&id].effective_last_online(now);
            let tie = if self.random_ties {
                self.rng.next_u64()
            } else {
                super::rng::Rng::new(id as u64 ^ self.rows_version.wrapping_mul(0x9E37_79B9))
                    .next_u64()
            };
            rows.push((lo, tie, id));
        }
        rows.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let total = rows.len() as u64;
        let shown = rows
            .iter()
            .skip((page.max(1) as usize - 1) * limit)
            .take(limit)
            .map(|(_, _, id)| {
                let mut r = self.wire_runner(&self.runners[id]);
                if self.nameless.contains(id) {
                    r.name = None;
                }
                r
            })
            .collect();
        (shown, total)
    }

    // -- invariants ---------------------------------------------------------------------------------

    /// Never a registration forgotten while Forgejo still lists it: every live registration we
    /// created is in cycle.json on disk, by id or (POST unanswered) by name.
    pub fn check_remembered(&mut self, after: &str) {
        let mut missing: Option<(i64, String)> = None;
        for id in &self.ours {
            let r = &self.runners[id];
            if r.deleted {
                continue;
            }
            let known = self.disk.as_ref().is_some_and(|(_, s)| {
                s.registrations
                    .iter()
                    .any(|g| g.id == Some(r.id) || (g.id.is_none() && g.name == r.name))
            });
            if !known {
                missing = Some((r.id, r.name.clone()));
                break;
            }
        }
        if let Some((id, name)) = missing {
            let state = match &self.disk {
                None => "no cycle.json".to_string(),
                Some((_, s)) => format!("cycle.json of {} ({:?})", s.cycle_id, s.phase),
            };
            self.violate(format!(
                "registration {id} ({name}) forgotten while Forgejo still lists it; {state}; after {after}"
            ));
        }
    }

    // -- cycle.json -----------------------------------------------------------------------------------

    pub fn write_disk(&mut self, state: &CycleState) {
        let mut bytes = serde_json::to_vec_pretty(state).expect("cycle state encodes");
        bytes.push(b'\n');
        let text = std::str::from_utf8(&bytes).expect("utf-8");
        let parsed = match parse_state(text) {
            Ok(p) => p,
            Err(e) => {
                self.violate(format!("cycle.json written does not parse back: {e:#}"));
                state.clone()
            }
        };
        self.disk = Some((bytes, parsed));
    }

    pub fn disk_phase(&self) -> &'static str {
        match &self.disk {
            None => "none",
            Some((_, s)) => match s.phase {
                Phase::Applying => "applying",
                Phase::Running => "running",
                Phase::TearingDown => "tearing_down",
                Phase::Destroyed => "destroyed",
            },
        }
    }

    // -- quiescence -----------------------------------------------------------------------------------

    /// `None` at rest; else what is left.
    pub fn leftovers(&self) -> Option<String> {
        let mut left = Vec::new();
        if let Some((_, s)) = &self.disk {
            left.push(format!("cycle.json of {} ({:?})", s.cycle_id, s.phase));
        }
        if !self.vms.is_empty() {
            left.push(format!("VM {}", self.vms.join(", ")));
        }
        for r in self.runners.values() {
            if !r.deleted && r.name.starts_with(PREFIX) {
                left.push(format!(
                    "registration {} ({}, {:?}, {})",
                    r.id,
                    r.name,
                    r.owner,
                    r.status(self.now).as_str()
                ));
            }
        }
        let waiting = self
            .srv_list_jobs()
            .iter()
            .filter(|j| j.is_waiting())
            .count();
        if waiting > 0 {
            left.push(format!("{waiting} waiting job(s) of ours"));
        }
        if left.is_empty() {
            None
        } else {
            Some(left.join("; "))
        }
    }
}
