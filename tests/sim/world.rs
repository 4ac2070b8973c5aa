//! The simulated world: Forgejo (runners, jobs, its own clean-ups), the runner processes on our
//! VMs, other pools and persistent runners, the seed's hosts and their slots (each slot's VMs,
//! cycle.json and held-jobs.json on disk), time, the fault plan, the statistics and the trace.
//! Everything random comes from one seeded `Rng`.
//!
//! Forgejo's rows and rules are the tests' one model of Forgejo, `forgejo-model/src/lib.rs`
//! (registration, the runner list, deletion, status, the assignment of tasks, their end, the
//! clean-ups) over `forgejo-model/src/rules.rs`; this world brings the clock, the crons'
//! schedule and what the runner processes do. Each other rule names the Forgejo v15.0.3 or
//! forgejo-runner v12.8 source it copies.

use std::collections::{BTreeMap, VecDeque};

use ci_ephemeral_provisioner::core::backoff::{Backoff, BackoffPolicy};
use ci_ephemeral_provisioner::core::forgejo::Job;
use ci_ephemeral_provisioner::core::forgejo::Runner;
use ci_ephemeral_provisioner::core::forgejo::RunnerStatus;
use ci_ephemeral_provisioner::core::holds::Holds;
use ci_ephemeral_provisioner::core::holds::parse_holds;
use ci_ephemeral_provisioner::core::planner::MAX_START_FAILURES;
use ci_ephemeral_provisioner::core::planner::TeardownReason;
use ci_ephemeral_provisioner::core::state::CycleState;
use ci_ephemeral_provisioner::core::state::NotServed;
use ci_ephemeral_provisioner::core::state::Phase;
use ci_ephemeral_provisioner::core::state::parse_state;
use ci_ephemeral_provisioner::core::warm::{WarmPolicy, is_unused_warm};

use super::rng::Rng;
use super::warm::{self, WarmPlan};
use ci_ephemeral_provisioner::core::pool::{Adoption, adopted_state};
use forgejo_model::{Forgejo, JobRow, NewRunner, RunnerRow, Scope, rules};

/// The prefix of the first host's pool (and of the legacy registrations from before).
pub const PREFIX: &str = "ephemeral-a-";
pub const OTHER_PREFIX: &str = "ephemeral-b-";
/// The prefix of each host's pool: none starts with another's (docs/operating.md, "Several
/// hosts"), and none with `OTHER_PREFIX`.
pub const HOST_PREFIXES: &[&str] = &[PREFIX, "ephemeral-c-"];
pub const LABEL: &str = "debian";
/// `--lease` of a pool across hosts (`--store pg`).
pub const LEASE_MS: i64 = 2 * MIN;
pub const HTTP_TIMEOUT_MS: i64 = 30_000;
/// `--poll-interval` and `--job-pickup-timeout` of every simulated run (`driver::config`).
pub const POLL_MS: i64 = 10_000;
pub const PICKUP_MS: i64 = 10 * MIN;
/// What one clean observation round and the steps between two waits may add to a wait (see
/// `check_not_served`): a round is one GET of the jobs and one GET per registration, each
/// 5–120 ms here, and the steps that precede a teardown (MarkConnected, AdoptLaunch,
/// ClearJobGone) are one round each.
pub const NOT_SERVED_SLACK_MS: i64 = 2_000;
/// 2026-09-20T…Z: any fixed start; only differences matter.
pub const T0: i64 = 1_790_000_000_000;
const SEC: i64 = 1_000;
const MIN: i64 = 60_000;
const HOUR: i64 = 60 * MIN;
/// The label names of every persistent runner that takes jobs here.
const BUILDER_LABELS: &[&str] = &[LABEL, "docker"];
const GPU_LABELS: &[&str] = &["gpu"];
/// Another pool's label: its jobs are never in our (label-filtered) jobs list.
const OTHER_LABEL: &str = "arm64";

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

/// A runner row of the world's Forgejo, with who registered it.
pub type SRunner = RunnerRow<Owner>;

/// The product's `RunnerStatus` of a row (`ActionRunner.Status()`, `rules::status`).
pub fn status_of(r: &SRunner, now: i64) -> RunnerStatus {
    match r.status(now) {
        "offline" => RunnerStatus::Offline,
        "idle" => RunnerStatus::Idle,
        _ => RunnerStatus::Active,
    }
}

/// A job row as the product reads it from `GET …/actions/runners/jobs`.
pub fn listed(j: &JobRow) -> Job {
    Job {
        id: j.id,
        handle: j.handle.clone(),
        status: j.status.clone(),
        runs_on: j.runs_on.clone(),
        repo_id: Some(j.repo_id),
        owner_id: Some(j.owner_id),
    }
}

/// How a runner we launched behaves (`forgejo-runner one-job --handle … --wait`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    Normal,
    NeverConnects,
    /// Connects, but its task fetches fail (an idle runner that is never given its job).
    ConnectsNoJob,
    /// Takes its job and stays active forever.
    HangActive,
    /// Takes its job, then stops reporting (offline after 60 s; Forgejo's zombie clean-up ends
    /// the task and deletes the registration 10 minutes after its last update).
    HangSilent,
    /// Connects, then the process dies before taking a job.
    DiesEarly,
    /// The launch exits 0 but starts the runner without `--label` (the old default launch): it
    /// connects, declares no labels, is given nothing (`ItRunsOn`) and polls for ever.
    NoLabels,
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
            Behaviour::NoLabels => "launch without labels (runner declares none)",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Connect,
    /// Asks for its job (FetchSingleTask with its handle).
    Take,
    Finish,
    GoSilent,
    Die,
    /// `one-job --wait` given no task: asks again every `fetch_interval` for ever
    /// (forgejo-runner `internal/app/poll/single.go`: `if task == nil && s.wait { continue }`).
    /// Only a release of its queued job can change the answer, so it sleeps until then.
    Poll,
    /// Its task fetches fail (ConnectsNoJob): idle for ever while the VM lives.
    Stuck,
    /// Runs its task for ever (HangActive).
    Hang,
}

struct Proc {
    handle: String,
    vm: String,
    behaviour: Behaviour,
    stage: Stage,
    next_at: i64,
    /// The label names it declares when it connects.
    labels: Vec<String>,
    /// Woken by the release of its queued job.
    woken: bool,
}

#[derive(Clone, Debug)]
enum Bg {
    JobArrival,
    JobCancel(i64),
    /// A persistent runner asks for a task soon after this job arrived.
    JobTakenByOther(i64),
    JobFinish(i64),
    /// The run before it in its concurrency group ended.
    JobRelease(i64),
    /// Its `needs` finished.
    JobUnblock(i64),
    ZombieCron,
    EndlessCron,
    PersistentFlip(i64),
    OtherPoolRegister,
    OtherConnect(i64),
    OtherDone(i64),
    LegacyFinish(i64),
    /// A POST whose client gave up lands now (the slot that sent it, the name).
    LatePost(usize, String),
    /// Someone reruns the job once it is done (`RerunJob`: a new attempt, a new handle).
    JobRerun(i64),
    /// `cancel_abandoned_jobs` (`CancelAbandonedJobs`, `@every 6h`).
    AbandonedCron,
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
    /// Share of arriving jobs whose run is queued behind its concurrency group.
    pub queued: f64,
    /// Share of VMs on which no runner ever connects.
    pub broken_vm: f64,
    /// At a step boundary: a run of another slot (of any host) starts, nested, and runs while
    /// this one waits (0 with a single slot).
    pub interleave: f64,
    /// `--store pg`: at a boundary where a process may stand still (its wait, a long child), it
    /// is stopped past its lease while another host's timer fires.
    pub pause: f64,
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

/// World events (not faults) a large run must have seen.
pub const EV_ENDLESS: &str = "forgejo: stop_endless_tasks deleted an ephemeral runner";
pub const EV_ENDLESS_PERSISTENT: &str =
    "forgejo: stop_endless_tasks stopped a persistent runner's task";
pub const EV_ZOMBIE: &str = "forgejo: stop_zombie_tasks deleted an ephemeral runner";
pub const EV_CANCEL: &str = "forgejo: cancelling a running job deleted its ephemeral runner";
pub const EV_RELEASED: &str = "forgejo: a queued job was released";
pub const EV_TAKEN_BY_OTHER: &str = "forgejo: a persistent runner was given a job";
pub const EV_POLLS_ON: &str = "runner: one-job --wait was given no task and polls on";
pub const EV_WOKEN: &str = "runner: a polling runner of ours was given its released job";
pub const EV_ORPHAN: &str =
    "runner: a process polled on after its registration was deleted, until the VM went";
pub const EV_STOPPED: &str = "runner: RUNNER_ACTION=stop ended a process of ours on the VM";
pub const EV_RERUN: &str = "forgejo: a done job was rerun (a new attempt, a new handle)";
pub const EV_SIGTERM_TASK: &str =
    "runner: SIGTERM cancelled a running task of ours; Forgejo deleted the runner at once";
pub const EV_ABANDONED: &str = "forgejo: cancel_abandoned_jobs cancelled a job waiting 24 h";
pub const EV_RACED_DELETE: &str = "api: a runner came up between the read that found it offline and the DELETE (deleted while up)";
pub const EV_RACED_DELETE_ACTIVE: &str =
    "api: a runner took its job between the read that found it offline and the DELETE";

#[derive(Default, Clone)]
pub struct Stats {
    pub seeds: u64,
    /// `--store pg`: cycles adopted from a host whose lease lapsed, and runs fenced after
    /// their cycle was adopted.
    pub adoptions: u64,
    pub fenced: u64,
    pub invocations: u64,
    pub steps: u64,
    pub faults: BTreeMap<&'static str, u64>,
    pub events: BTreeMap<&'static str, u64>,
    pub crashes: BTreeMap<String, u64>,
    pub races_refused: u64,
    pub deletes: BTreeMap<String, u64>,
    pub vms_created: u64,
    pub jobs_served: u64,
    /// Waits checked by `check_not_served` in which a runner of ours sat idle next to its
    /// waiting job, and the longest such wait past the start of its bound (pickup timeout
    /// reached, or wrong labels declared), in ms.
    pub not_served_waits: u64,
    pub not_served_longest_ms: i64,
    /// The most quiet runs one seed needed before its runs came to rest.
    pub quiet_runs_max: u32,
    /// Runners whose launch exited 0 and which never connected, by the reason of their deletion.
    pub never_connected_deleted: BTreeMap<String, u64>,
    /// Seeds by their hosts and slots (`Sim::topology`).
    pub topologies: BTreeMap<String, u64>,
    /// Runs of a slot started nested at another slot's step boundary: at an instant, and while
    /// the other one waited (`Invocation::instant`).
    pub slot_runs_nested: u64,
    pub slot_runs_nested_waiting: u64,
    /// `save_claiming` answers `HeldBy`: another slot held the job.
    pub claims_refused: u64,
    /// Registrations a sweep spared: too young by their name, held by another slot.
    pub spared_young: u64,
    pub spared_held: u64,
    /// Seeds of a broken pool (every start fails), cycle starts the backoff's invariant
    /// checked in them, and new cycles refused by the backoff (in any seed).
    pub broken_pools: u64,
    pub broken_pool_starts: u64,
    /// Of those, warm VMs' (started with no job) that counted (a job was tried on them, or
    /// they failed), and those that did not (torn down unused: renewals).
    pub broken_pool_warm_starts: u64,
    pub broken_pool_warm_renewals: u64,
    pub backed_off: u64,
    /// Warm capacity: seeds with `--warm` ≥ 1, and of them those whose quiet period keeps it;
    /// warm VMs started (cycle.json written), taken by a job (their first intent), torn down
    /// unused because too old or not wanted; the most unused warm VMs one pool had at once, and
    /// left at rest (quiet period keeping `--warm`); runs ended at a wait on one (SIGHUP).
    pub warm_seeds: u64,
    pub warm_quiet_keeps: u64,
    pub warm_starts: u64,
    pub warm_used: u64,
    pub warm_expired: u64,
    pub warm_not_wanted: u64,
    pub warm_most: u32,
    pub warm_at_rest: u32,
    pub warm_reloads: u64,
}

impl Stats {
    pub fn merge(&mut self, o: &Stats) {
        self.seeds += o.seeds;
        self.adoptions += o.adoptions;
        self.fenced += o.fenced;
        self.invocations += o.invocations;
        self.steps += o.steps;
        self.races_refused += o.races_refused;
        self.vms_created += o.vms_created;
        self.jobs_served += o.jobs_served;
        self.not_served_waits += o.not_served_waits;
        self.not_served_longest_ms = self.not_served_longest_ms.max(o.not_served_longest_ms);
        self.quiet_runs_max = self.quiet_runs_max.max(o.quiet_runs_max);
        for (k, v) in &o.faults {
            *self.faults.entry(k).or_default() += v;
        }
        for (k, v) in &o.events {
            *self.events.entry(k).or_default() += v;
        }
        for (k, v) in &o.crashes {
            *self.crashes.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.deletes {
            *self.deletes.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.never_connected_deleted {
            *self.never_connected_deleted.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.topologies {
            *self.topologies.entry(k.clone()).or_default() += v;
        }
        self.slot_runs_nested += o.slot_runs_nested;
        self.slot_runs_nested_waiting += o.slot_runs_nested_waiting;
        self.claims_refused += o.claims_refused;
        self.broken_pools += o.broken_pools;
        self.broken_pool_starts += o.broken_pool_starts;
        self.broken_pool_warm_starts += o.broken_pool_warm_starts;
        self.broken_pool_warm_renewals += o.broken_pool_warm_renewals;
        self.backed_off += o.backed_off;
        self.warm_seeds += o.warm_seeds;
        self.warm_quiet_keeps += o.warm_quiet_keeps;
        self.warm_starts += o.warm_starts;
        self.warm_used += o.warm_used;
        self.warm_expired += o.warm_expired;
        self.warm_not_wanted += o.warm_not_wanted;
        self.warm_most = self.warm_most.max(o.warm_most);
        self.warm_at_rest = self.warm_at_rest.max(o.warm_at_rest);
        self.warm_reloads += o.warm_reloads;
        self.spared_young += o.spared_young;
        self.spared_held += o.spared_held;
    }
}

/// How an invocation was started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Started {
    /// By its slot's timer, with nothing else running.
    #[default]
    Timer,
    /// A second invocation of the slot of a running one (it must be refused by `cycle.lock`).
    Race,
    /// A run of another slot, at a step boundary of a running one.
    Nested,
}

/// Per invocation (process) of the provisioner.
#[derive(Default)]
pub struct Invocation {
    /// The slot it runs (an index into `Sim::slots`).
    pub slot: usize,
    pub destroy_ok: bool,
    pub stop: bool,
    pub steps: u64,
    pub started: Started,
    /// A run at an instant: nested where the run it interrupts does not wait (between two
    /// steps, at a cycle.json write, around a request), it takes no time (its requests, tofu
    /// output, launch, check and stop are instantaneous) and ends at its first wait or tofu
    /// apply or destroy, so that the interrupted run goes on as if the other slot's process had
    /// run beside it. (A run nested while the interrupted one waits — its poll sleep, tofu
    /// apply or destroy, a launch — takes its time.)
    pub instant: bool,
    pub started_at: i64,
    /// When its last API request with a fault ended (0: none yet).
    pub last_fault_at: i64,
    /// Its read of held-jobs.json failed: it runs without holds.
    pub holds_read_failed: bool,
    /// Its `--warm`, `--warm-max-age`, `--warm-during` (its host's when it started).
    pub warm: WarmPolicy,
    /// `--store pg`: the process is stopped (SIGSTOP): it renews no lease.
    pub paused: bool,
    /// `--store pg`: its cycle was adopted by another host (its epoch is stale): from now on it
    /// must make no side effect.
    pub fenced: bool,
}

/// What the world knows of the starts on one VM.
#[derive(Clone, Copy, Default)]
struct VmStarts {
    /// Runners in a row whose launch exited 0 and which were deleted without ever connecting.
    never_connected: u32,
    /// The provisioner may have lost count (killed, a cycle.json write failed): the broken-VM
    /// invariant is not checked on this VM. (A DELETE whose answer was lost is no excuse: the
    /// failed start is counted and recorded before the DELETE is sent.)
    uncertain: bool,
}

/// One host's pool (`--state-dir` and its prefix), or one host of a pool across hosts
/// (`--store pg`).
pub struct Host {
    pub prefix: &'static str,
    /// The host is one of a pool across hosts (`--store pg`): one prefix, one store.
    pub pg: bool,
    /// Its slots, in order (`--slot 1` first): indices into `Sim::slots`.
    pub slots: Vec<usize>,
    /// The pool's `backoff.json` (shared by its slots, written under its claims lock).
    pub backoff: Backoff,
    /// When each of its cycles started (by the time its gate was passed), in a broken pool.
    pub cycle_starts: Vec<i64>,
    /// `--warm` … of the runs started now (`warm::plan`; 0 in the quiet period unless the seed
    /// keeps it).
    pub warm: WarmPolicy,
    /// The pool's unused warm VMs after the last step (`Sim::check_warm`).
    pub warm_last: u32,
    /// `--store pg`: until when its lease holds (renewed by every run of its slots, and all the
    /// time while one runs and is not paused).
    pub lease_until: i64,
    /// `--store pg`: from when its timers no longer fire (the host died), and until when (none:
    /// for good).
    pub dead: Option<(i64, Option<i64>)>,
    /// Its warm VMs started in a broken pool that are still unused: when each passed the gate
    /// (`Sim::cycle_started`).
    pub warm_pending: BTreeMap<String, (i64, BackoffPolicy)>,
}

/// One slot of one host's pool: its own directory (cycle.json, held-jobs.json, cycle.lock) and
/// its own tofu workspace (its VMs).
#[derive(Default)]
pub struct Slot {
    /// An index into `Sim::hosts`.
    pub host: usize,
    /// `--slot K`, from 1.
    pub k: u32,
    /// cycle.json: the bytes written and what they parse to.
    pub disk: Option<(Vec<u8>, CycleState)>,
    /// held-jobs.json: the bytes written and what they parse to (none: no file).
    pub holds_disk: Option<(Vec<u8>, Holds)>,
    /// A hold may have been lost in this slot: a write of held-jobs.json failed, or a read failed
    /// (the run then replaces the file by none, `cycle::run`).
    pub holds_lost: bool,
    /// The VMs of its tofu workspace (`Sim::vm_key`).
    pub vms: Vec<String>,
    /// Since when its unused warm VM is one the flags of its running invocation no longer want
    /// (`Sim::check_warm`).
    pub warm_unwanted_since: Option<i64>,
}

impl Slot {
    /// Whether its cycle.json holds the registration `id` (or, POST unanswered, `name`).
    pub fn holds(&self, id: i64, name: &str) -> bool {
        self.disk.as_ref().is_some_and(|(_, s)| {
            s.registrations
                .iter()
                .any(|g| g.id == Some(id) || (g.id.is_none() && g.name == name))
        })
    }

    /// The cycle.json path its store names (`FileStore`: slot 1 in the pool's directory).
    pub fn describe(&self) -> String {
        match self.k {
            1 => "sim/cycle.json".to_string(),
            k => format!("sim/slot-{k}/cycle.json"),
        }
    }
}

pub struct Sim {
    pub seed: u64,
    pub rng: Rng,
    pub now: i64,
    /// Forgejo's runner and job rows. Done jobs stay (Forgejo keeps them; no list shows them).
    pub forgejo: Forgejo<Owner>,
    bg: BTreeMap<(i64, u64), Bg>,
    bg_seq: u64,
    procs: BTreeMap<i64, Proc>,
    /// The repository of the first job each VM ran (the trust-boundary invariant).
    vm_repos: BTreeMap<String, i64>,
    /// `SIM_RANDOM_TIES=1`: ties in a new order on every request (a database that gives no
    /// stable order among equal keys even between identical queries).
    pub random_ties: bool,
    /// Runners listed without a name (a targeted regression test's hostile server).
    pub nameless: Vec<i64>,
    /// Faults a targeted test forces on the next request at a step boundary (its point, e.g.
    /// `DELETE runner (never_connected)`), whatever the fault plan says.
    pub forced_faults: Vec<(String, ApiFault)>,
    /// The hosts, each one pool of one or more slots against the one Forgejo.
    pub hosts: Vec<Host>,
    pub slots: Vec<Slot>,
    /// The invocations running now, outermost first.
    pub stack: Vec<usize>,
    /// For each job attempt (handle): the runners our launches were for, and the slot that
    /// launched each.
    launches: BTreeMap<String, Vec<(usize, i64)>>,
    /// What each invocation last read of each runner (GET or a list row): when, and the status.
    /// A DELETE that finds the runner up is the product's error unless it read it offline.
    seen: BTreeMap<(usize, i64), (i64, RunnerStatus)>,
    /// VMs on which no runner ever connects.
    broken_vms: Vec<String>,
    vm_starts: BTreeMap<String, VmStarts>,
    /// Runners whose launch exited 0, and their VM.
    launched_ok: BTreeMap<i64, String>,
    /// Every VM is broken while faults are on, and no job is cancelled, re-run or taken by
    /// another runner: every start fails.
    pub broken_pool: bool,
    pub cfg: FaultCfg,
    /// `--max-jobs-per-vm` of this seed.
    pub max_jobs: u32,
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
    /// Ids of the registrations our POSTs created (live or not), and the slot whose POST it was.
    ours: BTreeMap<i64, usize>,
    /// The seed's warm capacity (`warm::plan`).
    pub warm: WarmPlan,
    /// When the last apply that brought each VM up ended (its `tofu output` after the apply):
    /// where an unused warm VM's age starts.
    pub vm_ready: BTreeMap<String, i64>,
}

impl Sim {
    /// `trace_cap`: trace lines kept for a failure report; `tracing`: build trace lines at all
    /// (the run is the same either way); `echo`: print them as they happen.
    pub fn new(seed: u64, trace_cap: usize, tracing: bool, echo: bool) -> Sim {
        let mut rng = Rng::new(seed);
        let levels = |rng: &mut Rng, xs: &[f64]| xs[rng.below(xs.len() as u64) as usize];
        let mut cfg = FaultCfg {
            api: levels(&mut rng, &[0.0, 0.02, 0.08, 0.2]),
            crash: levels(&mut rng, &[0.0, 0.003, 0.01, 0.03]),
            tofu: levels(&mut rng, &[0.0, 0.1, 0.3]),
            launch: levels(&mut rng, &[0.0, 0.1, 0.3]),
            runner: levels(&mut rng, &[0.0, 0.2, 0.5]),
            store: levels(&mut rng, &[0.0, 0.005, 0.02]),
            race: levels(&mut rng, &[0.0, 0.0, 0.01]),
            signal: levels(&mut rng, &[0.0, 0.0, 0.003]),
            queued: levels(&mut rng, &[0.0, 0.1, 0.3]),
            broken_vm: levels(&mut rng, &[0.0, 0.0, 0.1, 0.3]),
            interleave: 0.0,
            pause: 0.0,
        };
        // Hosts and slots: one host of one slot in two seeds of five (the single pool of
        // before), up to two hosts of up to three slots.
        let n_hosts = if rng.chance(0.2) { 2 } else { 1 };
        let pg = n_hosts > 1 && rng.chance(0.5);
        let mut hosts = Vec::new();
        let mut slots = Vec::new();
        for (h, prefix) in HOST_PREFIXES.iter().enumerate().take(n_hosts) {
            // One pool across hosts has one prefix.
            let prefix = if pg { &HOST_PREFIXES[0] } else { prefix };
            let n = if h == 0 {
                rng.pick(&[1, 1, 1, 1, 1, 2, 2, 2, 3, 3])
            } else {
                rng.pick(&[1, 2])
            };
            let mut host = Host {
                prefix,
                pg,
                lease_until: 0,
                dead: None,
                slots: Vec::new(),
                backoff: Backoff::new(),
                cycle_starts: Vec::new(),
                warm: WarmPolicy::default(),
                warm_last: 0,
                warm_pending: BTreeMap::new(),
            };
            for k in 1..=n {
                host.slots.push(slots.len());
                slots.push(Slot {
                    host: h,
                    k,
                    ..Slot::default()
                });
            }
            hosts.push(host);
        }
        if slots.len() > 1 {
            cfg.interleave = levels(&mut rng, &[0.005, 0.02, 0.05]);
        }
        if pg {
            // A pool across hosts: its processes stop now and then past their lease, and its
            // second host dies (for good, or for a while) in one seed of two.
            cfg.pause = levels(&mut rng, &[0.002, 0.01]);
            if rng.chance(0.5) {
                let from = T0 + rng.range(5 * MIN, 90 * MIN);
                let until = rng
                    .chance(0.5)
                    .then(|| from + LEASE_MS + rng.range(MIN, 40 * MIN));
                hosts[1].dead = Some((from, until));
            }
        }
        // A broken pool in one seed of ten: while faults are on, no runner on any VM ever
        // connects, and no job goes away by itself: every start fails (the backoff's invariant).
        // Half of them fail fast (every launch fails), so that a pool without the backoff would
        // start a cycle at nearly every timer run; the other half fail slowly (no runner ever
        // connects).
        let broken_pool = rng.chance(0.1);
        if broken_pool {
            cfg.broken_vm = 1.0;
            if rng.chance(0.5) {
                cfg.launch = 1.0;
            }
        }
        let max_jobs = rng.pick(&[3, 6]);
        let mean_arrival_ms = rng.range(2 * MIN, 15 * MIN);
        let mut sim = Sim {
            seed,
            rng,
            now: T0,
            forgejo: Forgejo::default(),
            bg: BTreeMap::new(),
            bg_seq: 0,
            procs: BTreeMap::new(),
            vm_repos: BTreeMap::new(),
            nameless: Vec::new(),
            forced_faults: Vec::new(),
            random_ties: std::env::var("SIM_RANDOM_TIES").is_ok_and(|v| v == "1"),
            hosts,
            slots,
            stack: Vec::new(),
            launches: BTreeMap::new(),
            seen: BTreeMap::new(),
            broken_vms: Vec::new(),
            vm_starts: BTreeMap::new(),
            launched_ok: BTreeMap::new(),
            broken_pool,
            cfg,
            max_jobs,
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
            ours: BTreeMap::new(),
            warm: WarmPlan::default(),
            vm_ready: BTreeMap::new(),
        };
        sim.stats.broken_pools = u64::from(sim.broken_pool);
        let topology = sim.topology();
        sim.stats.topologies.insert(topology, 1);
        let per_host: Vec<u32> = sim.hosts.iter().map(|h| h.slots.len() as u32).collect();
        sim.warm = warm::plan(seed, &per_host);
        if sim.hosts.iter().any(|h| h.pg) {
            // A pool across hosts keeps no warm VMs in the simulation (their count and order
            // are those of one host's slots here).
            sim.warm = WarmPlan::default();
        }
        for (h, p) in sim.warm.policies.iter().enumerate() {
            sim.hosts[h].warm = p.clone();
        }
        sim.stats.warm_seeds = u64::from(!sim.warm.policies.is_empty());
        sim.stats.warm_quiet_keeps = u64::from(sim.warm.quiet_keeps);
        sim.populate();
        sim
    }

    /// The seed's hosts and slots, e.g. `2 hosts: 3+1 slots, --store pg`.
    pub fn topology(&self) -> String {
        let slots: Vec<String> = self
            .hosts
            .iter()
            .map(|h| h.slots.len().to_string())
            .collect();
        match self.hosts.len() {
            1 => format!(
                "1 host: {} slot{}",
                slots[0],
                if slots[0] == "1" { "" } else { "s" }
            ),
            n => format!(
                "{n} hosts: {} slots{}",
                slots.join("+"),
                if self.hosts[0].pg { ", --store pg" } else { "" }
            ),
        }
    }

    /// The pool of host `h`: the hosts of a pool across hosts (`--store pg`) are one, host 0's.
    pub fn pool_of(&self, h: usize) -> usize {
        if self.hosts[h].pg { 0 } else { h }
    }

    /// The slots of `slot`'s pool (of every host of it), in order.
    pub fn pool_slots(&self, slot: usize) -> Vec<usize> {
        let pool = self.pool_of(self.slots[slot].host);
        (0..self.slots.len())
            .filter(|k| self.pool_of(self.slots[*k].host) == pool)
            .collect()
    }

    /// `--store pg`: host `h`'s lease lapsed: none of its runs is going (or each is paused) and
    /// its last renewal is older than the lease.
    pub fn lapsed(&self, h: usize) -> bool {
        self.hosts[h].pg
            && self.now > self.hosts[h].lease_until
            && !self
                .stack
                .iter()
                .any(|i| self.slots[self.invs[*i].slot].host == h && !self.invs[*i].paused)
    }

    /// `--store pg`: host `h` is dead at `now` (its timers do not fire).
    pub fn dead(&self, h: usize) -> bool {
        self.hosts[h]
            .dead
            .is_some_and(|(from, until)| self.now >= from && until.is_none_or(|u| self.now < u))
    }

    /// `--store pg`: a run of host `h` renews its lease (on the database's clock: the world's).
    pub fn renew(&mut self, h: usize) {
        if self.hosts[h].pg {
            self.hosts[h].lease_until = self.now + LEASE_MS;
        }
    }

    /// `--store pg`: slot `into` (no cycle) adopts the cycle of a slot of another host of its
    /// pool whose lease lapsed: the cycle (its state torn down from now on), its VM (its
    /// workspace is the cycle's, any host addresses it) and its registrations become `into`'s;
    /// the runs of the old slot still going (paused) are fenced. What the pool store does in one
    /// transaction.
    pub fn adopt(&mut self, into: usize) -> Option<CycleState> {
        let host = self.slots[into].host;
        let from = self.pool_slots(into).into_iter().find(|&k| {
            self.slots[k].host != host
                && self.slots[k].disk.is_some()
                && self.lapsed(self.slots[k].host)
        })?;
        let (_, state) = self.slots[from].disk.take().expect("a cycle");
        let old = self.slots[from].host;
        let a = Adoption {
            cycle_id: state.cycle_id.clone(),
            from_host: format!("h{}", old + 1),
            from_slot: self.slots[from].k,
            lapsed_at: format!("t+{} s", (self.hosts[old].lease_until - T0) / 1000),
        };
        let state = adopted_state(state, &a);
        let vms = std::mem::take(&mut self.slots[from].vms);
        self.slots[into].vms.extend(vms);
        for by in self.ours.values_mut() {
            if *by == from {
                *by = into;
            }
        }
        for l in self.launches.values_mut() {
            for (s, _) in l.iter_mut() {
                if *s == from {
                    *s = into;
                }
            }
        }
        for i in self.stack.clone() {
            if self.invs[i].slot == from {
                self.invs[i].fenced = true;
            }
        }
        self.write_disk(into, &state);
        self.stats.adoptions += 1;
        let text = format!(
            "ADOPTED by {}: {} (its lease lapsed)",
            self.slot_name(into),
            a.describe()
        );
        self.log(text);
        Some(state)
    }

    /// `slot K` or, with several hosts, `host H slot K`, for messages.
    pub fn slot_name(&self, slot: usize) -> String {
        let s = &self.slots[slot];
        if self.hosts.len() > 1 {
            format!("host {} slot {}", s.host + 1, s.k)
        } else {
            format!("slot {}", s.k)
        }
    }

    /// The slot of invocation `inv`.
    pub fn slot_of(&self, inv: usize) -> usize {
        self.invs[inv].slot
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

    /// A cycle of `slot` started at `at` (it passed the backoff's gate). Invariant, while every
    /// start fails: in any window of length T the pool of S slots starts at most
    /// N + S - 1 + ⌈T / backoff⌉ cycles (`core::backoff`; each cycle starts at most one VM).
    /// A warm VM's start (`warm`: cycle `cycle_id`) counts once a job was tried on it or it
    /// failed (`write_disk`); one torn down unused (too old, not wanted) is a renewal, which the
    /// backoff does not count (`CycleOutcome::Neutral`): a broken VM shows only when a runner
    /// is started on it.
    pub fn cycle_started(
        &mut self,
        slot: usize,
        warm: Option<&str>,
        at: i64,
        policy: &BackoffPolicy,
    ) {
        if !(self.broken_pool && self.faults_on) {
            return;
        }
        let h = self.pool_of(self.slots[slot].host);
        self.stats.broken_pool_starts += 1;
        match warm {
            Some(cycle_id) => {
                let vm = self.vm_key(slot, cycle_id);
                self.hosts[h].warm_pending.insert(vm, (at, *policy));
            }
            None => self.count_start(h, at, policy),
        }
    }

    /// The bound of `cycle_started` over every window of host `h`'s cycle starts, with one more
    /// at `at`.
    fn count_start(&mut self, h: usize, at: i64, policy: &BackoffPolicy) {
        self.hosts[h].cycle_starts.push(at);
        let mut starts = self.hosts[h].cycle_starts.clone();
        starts.sort_unstable();
        let s = self
            .hosts
            .iter()
            .enumerate()
            .filter(|(o, _)| self.pool_of(*o) == h)
            .map(|(_, x)| x.slots.len())
            .sum::<usize>() as i64;
        let n = i64::from(policy.max_failed_cycles);
        let b = policy.initial.as_millis() as i64;
        for (i, &from) in starts.iter().enumerate() {
            for (j, &to) in starts.iter().enumerate().skip(i) {
                let in_window = (j - i + 1) as i64;
                // The half-open window [from, to + 1ms).
                let t = to + 1 - from;
                let bound = n + s - 1 + (t + b - 1) / b;
                if in_window > bound {
                    self.violate(format!(
                        "while every start failed, the pool of {s} slot(s) started {in_window} cycles within {} s, more than N + S - 1 + ceil(T / backoff) = {bound}",
                        t / 1000
                    ));
                    return;
                }
            }
        }
    }

    /// The warm VM `vm` of host `h` is no longer unused, by the cycle.json `now` written: its
    /// start counts in a broken pool (`cycle_started`) unless it was torn down unused.
    fn warm_start_ends(&mut self, h: usize, vm: &str, now: &CycleState) {
        let Some((at, policy)) = self.hosts[h].warm_pending.remove(vm) else {
            return;
        };
        let reason = now.teardown_reason.as_deref().unwrap_or_default();
        if now.phase == Phase::TearingDown
            && (reason == TeardownReason::WarmExpired.describe()
                || reason == TeardownReason::WarmNotWanted.describe())
        {
            self.stats.broken_pool_warm_renewals += 1;
        } else {
            self.stats.broken_pool_warm_starts += 1;
            self.count_start(h, at, &policy);
        }
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

    fn event(&mut self, kind: &'static str) {
        *self.stats.events.entry(kind).or_default() += 1;
    }

    // -- set-up -----------------------------------------------------------------------------------

    /// A registration as Forgejo creates it: never connected, no labels.
    pub fn add_runner(&mut self, name: String, owner: Owner, ephemeral: bool) -> i64 {
        self.forgejo.register(NewRunner {
            id: None,
            uuid: String::new(),
            token: String::new(),
            name: &name,
            description: "",
            owner_id: 0,
            repo_id: 0,
            ephemeral,
            extra: owner,
        })
    }

    /// The runner's `Declare` RPC with the label names of these `--label` values (forgejo-runner
    /// `daemon.go` `createRunner` sends `ls.Names()`; Forgejo `routers/api/actions/runner/
    /// runner.go` `Declare` stores them as `AgentLabels`). The runner is online from now on.
    pub fn declare(&mut self, id: i64, labels: Vec<String>) {
        let now = self.now;
        if let Some(r) = self.forgejo.runners.get_mut(&id) {
            r.declare(Some(labels), now);
        }
    }

    fn schedule(&mut self, at: i64, ev: Bg) {
        self.bg_seq += 1;
        self.bg.insert((at, self.bg_seq), ev);
    }

    fn names(labels: &[&str]) -> Vec<String> {
        labels.iter().map(|l| l.to_string()).collect()
    }

    fn populate(&mut self) {
        let now = self.now;
        // Persistent runners: one online that takes jobs, duplicate names, near-miss names.
        let builder = self.add_runner("static-builder".into(), Owner::Persistent, false);
        self.declare(builder, Self::names(BUILDER_LABELS));
        self.forgejo
            .runners
            .get_mut(&builder)
            .expect("just added")
            .last_active = now - HOUR;
        if self.rng.chance(0.3) {
            // A task that never ends: `stop_endless_tasks` fails it (the runner is not
            // ephemeral, so it stays).
            let started = now - self.rng.range(2 * HOUR, 7 * HOUR / 2);
            let j = self.new_job(&["docker"]);
            self.start_task(j, builder);
            self.forgejo.jobs.get_mut(&j).expect("just added").started = started;
        }
        for (name, online, labels) in [
            ("build-01", true, GPU_LABELS),
            ("build-01", false, &[LABEL][..]),
            ("ephemeral-a", false, &[LABEL][..]),
            ("my-ephemeral-a-1", false, &[LABEL][..]),
            ("EPHEMERAL-A-1", false, &[LABEL][..]),
        ] {
            let id = self.add_runner(name.into(), Owner::Persistent, false);
            self.declare(id, Self::names(labels));
            let r = self.forgejo.runners.get_mut(&id).expect("just added");
            r.declared_at = now - 30 * 24 * HOUR;
            if online {
                r.last_active = now - HOUR;
                let at = now + self.rng.range(5 * MIN, 60 * MIN);
                self.schedule(at, Bg::PersistentFlip(id));
            } else {
                r.polling = false;
                r.last_online = now - 2 * HOUR;
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
            let r = self.forgejo.runners.get_mut(&id).expect("just added");
            r.labels = Some(vec![LABEL.into()]);
            r.last_online = now - 24 * HOUR;
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
            self.declare(id, vec![LABEL.into()]);
            // Its task started up to 4 h ago: past 3 h, `stop_endless_tasks` ends it first.
            let started = now - self.rng.range(0, 4 * HOUR);
            let j = self.new_job(&[LABEL]);
            self.start_task(j, id);
            self.forgejo.jobs.get_mut(&j).expect("just added").started = started;
            let at = now + self.rng.range(MIN, 20 * MIN);
            self.schedule(at, Bg::LegacyFinish(id));
        }
        let first = now + self.rng.range(0, self.mean_arrival_ms);
        self.schedule(first, Bg::JobArrival);
        // Both crons run at Forgejo's start (`RunAtStart`) and then `@every`; Forgejo started
        // at some unknown time before the simulation.
        let z = now + self.rng.range(0, rules::ZOMBIE_CRON_MS);
        self.schedule(z, Bg::ZombieCron);
        let e = now + self.rng.range(0, rules::ENDLESS_CRON_MS);
        self.schedule(e, Bg::EndlessCron);
        // No job here waits 24 h (a seed lasts a few hours): the cron runs, and finds none.
        let a = now + self.rng.range(0, rules::ABANDONED_CRON_MS);
        self.schedule(a, Bg::AbandonedCron);
        let at = now + self.rng.range(MIN, 20 * MIN);
        self.schedule(at, Bg::OtherPoolRegister);
    }

    /// Faults stop, no more jobs arrive except one last one (so a last cycle runs and sweeps),
    /// and every run queued behind its concurrency group is let go.
    pub fn go_quiet(&mut self) {
        self.faults_on = false;
        self.arrivals_on = false;
        let queued: Vec<i64> = self
            .forgejo
            .jobs
            .values()
            .filter(|j| j.queued_behind && !j.is_done())
            .map(|j| j.id)
            .collect();
        for j in queued {
            self.release(j);
        }
        self.new_job(&[LABEL]);
        self.log("QUIET: faults off, queued jobs released, one last job, no more arrivals");
        if !self.warm.quiet_keeps {
            for h in &mut self.hosts {
                h.warm.count = 0;
            }
        } else if !self.warm.policies.is_empty() {
            self.log("QUIET: --warm kept");
        }
    }

    /// A waiting job (`runs_on` as given; the jobs list shows its `repo_id` and `owner_id`, as
    /// Forgejo's `ActionRunJob` does, modules/structs/action.go): most in repository 1, one in eight in repository 2
    /// (same owner 1), one in eight in repository 3 of owner 2, so that VMs are both reused and
    /// refused across the trust boundary. By id, not by the random stream.
    pub fn new_job(&mut self, runs_on: &[&str]) -> i64 {
        let id = self.forgejo.next_job_id();
        let (repo_id, owner_id) = match id % 8 {
            3 => (2, 1),
            7 => (3, 2),
            _ => (1, 1),
        };
        let handle = format!("{:08x}-h", self.rng.next_u64() as u32);
        self.forgejo
            .add_job(handle, Self::names(runs_on), owner_id, repo_id, self.now)
    }

    // -- Forgejo's job assignment -----------------------------------------------------------------

    /// The job Forgejo gives runner `id` when it asks for a task (FetchTask; FetchSingleTask
    /// with `handle`): `rules::pick` over the jobs by id (`CreateTaskForRunner`).
    pub fn task_for(&self, id: i64, handle: Option<&str>) -> Option<i64> {
        self.forgejo.task_for(id, handle)
    }

    /// `CreateTaskForRunner`: the job runs on the runner from now.
    fn start_task(&mut self, job: i64, runner: i64) {
        self.forgejo.start_task(job, runner, self.now);
    }

    /// `StopTask` with `status`: an ephemeral runner is deleted (its process may still run);
    /// any other runner's process is told its task ended at its next report and is no longer
    /// busy.
    fn stop_task(&mut self, job: i64, runner: i64, status: &str, event: &'static str) {
        let now = self.now;
        if self.forgejo.stop_task(job, status, now).is_some() {
            self.log(format!(
                "forgejo: task of job {job} stopped, runner {runner} deleted"
            ));
            self.event(event);
        } else {
            if let Some(r) = self.forgejo.runners.get_mut(&runner) {
                r.busy = false;
                r.last_active = now;
            }
            if event == EV_ENDLESS {
                self.event(EV_ENDLESS_PERSISTENT);
            }
        }
    }

    /// The run ahead of it in its concurrency group ended: it can be given out now; a runner of
    /// ours polling for it asks again within its fetch interval.
    fn release(&mut self, job: i64) {
        if !self.forgejo.release(job) {
            return;
        }
        let handle = self.forgejo.jobs[&job].handle.clone();
        self.event(EV_RELEASED);
        let now = self.now;
        for (id, p) in self.procs.iter_mut() {
            if p.stage == Stage::Poll && p.handle == handle && self.forgejo.live(*id).is_some() {
                p.stage = Stage::Take;
                p.next_at = now + self.rng.range(0, rules::FETCH_INTERVAL_MS);
                p.woken = true;
            }
        }
        if self.tracing {
            self.log(format!(
                "forgejo: job {job} released by its concurrency group"
            ));
        }
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

    /// The runner's process exits: after the final UpdateTask of its task, if it has one (its
    /// job ends, and Forgejo deletes the ephemeral runner); a runner with none is deleted all the
    /// same (every caller's runner is ephemeral).
    fn final_update_task(&mut self, id: i64) {
        let now = self.now;
        match self.forgejo.running_job_of(id) {
            Some(j) => {
                self.forgejo.final_update_task(j, now);
            }
            None => self.forgejo.delete(id, now),
        }
    }

    fn run_bg(&mut self, ev: Bg) {
        let now = self.now;
        match ev {
            Bg::JobArrival => {
                if !self.arrivals_on {
                    return;
                }
                let runs_on: &[&str] = match self.rng.below(10) {
                    0..=6 => &[LABEL],
                    7 => &["gpu"],
                    _ => &[LABEL, "docker"],
                };
                let id = self.new_job(runs_on);
                if self.rng.chance(0.1) {
                    // `needs`: blocked, not listed, until the jobs it needs finish.
                    self.forgejo.jobs.get_mut(&id).expect("just added").status = "blocked".into();
                    let at = now + self.rng.range(30 * SEC, 5 * MIN);
                    self.schedule(at, Bg::JobUnblock(id));
                }
                if self.faults_on && self.rng.chance(self.cfg.queued) {
                    // Queued behind a run of its concurrency group (`getConcurrencyCondition`,
                    // `models/actions/task.go`): half let go before the pickup timeout, half
                    // (much) later.
                    self.forgejo
                        .jobs
                        .get_mut(&id)
                        .expect("just added")
                        .queued_behind = true;
                    self.count_fault("job queued behind its concurrency group");
                    let after = if self.rng.chance(0.5) {
                        self.rng.range(MIN, 9 * MIN)
                    } else {
                        self.rng.range(12 * MIN, 90 * MIN)
                    };
                    self.schedule(now + after, Bg::JobRelease(id));
                }
                let goes_away = !(self.broken_pool && self.faults_on);
                if self.faults_on && self.rng.chance(0.1) && goes_away {
                    let at = now + self.rng.range(10 * SEC, 20 * MIN);
                    self.schedule(at, Bg::JobCancel(id));
                }
                if self.rng.chance(0.15) && goes_away {
                    let at = now + self.rng.range(5 * SEC, 5 * MIN);
                    self.schedule(at, Bg::JobTakenByOther(id));
                }
                if self.faults_on && self.rng.chance(0.1) && goes_away {
                    let at = now + self.rng.range(2 * MIN, 40 * MIN);
                    self.schedule(at, Bg::JobRerun(id));
                }
                let gap = self.rng.range(SEC, 2 * self.mean_arrival_ms);
                self.schedule(now + gap, Bg::JobArrival);
            }
            Bg::JobCancel(j) => {
                // `cancelSingleJob` (`services/actions/rerun.go`): a job without a task just
                // ends; a running one's task is stopped, which deletes an ephemeral runner.
                let running = self.forgejo.jobs.get(&j).filter(|job| job.is_running());
                match running.and_then(|job| job.runner_id) {
                    Some(r) => self.stop_task(j, r, "cancelled", EV_CANCEL),
                    None => {
                        self.forgejo.cancel_job(j, now);
                    }
                }
            }
            Bg::JobTakenByOther(j) => {
                // A persistent runner that may take this job asks for a task and is given the
                // first job the rule admits (this one or an older one).
                let asks = self
                    .forgejo
                    .runners
                    .values()
                    .filter(|r| r.extra == Owner::Persistent && r.polling && !r.busy && !r.deleted)
                    .map(|r| r.id)
                    .find(|r| self.forgejo.may_take(*r, j, None));
                if let Some(r) = asks
                    && let Some(job) = self.task_for(r, None)
                {
                    self.start_task(job, r);
                    self.event(EV_TAKEN_BY_OTHER);
                    let at = now + self.rng.range(MIN, 10 * MIN);
                    self.schedule(at, Bg::JobFinish(job));
                }
            }
            Bg::JobFinish(j) => {
                if self.forgejo.jobs.get(&j).is_some_and(JobRow::is_running) {
                    self.forgejo.final_update_task(j, now);
                }
            }
            Bg::JobRelease(j) => self.release(j),
            Bg::JobUnblock(j) => {
                if let Some(job) = self.forgejo.jobs.get_mut(&j)
                    && job.status == "blocked"
                {
                    job.status = "waiting".into();
                }
            }
            Bg::ZombieCron => {
                // `StopZombieTasks` (`services/actions/clear_tasks.go`): running tasks not
                // updated for `ZOMBIE_TASK_TIMEOUT`.
                for j in self.forgejo.zombie_tasks(now) {
                    let r = self.forgejo.jobs[&j].runner_id.unwrap_or(0);
                    self.stop_task(j, r, "failure", EV_ZOMBIE);
                }
                self.schedule(now + rules::ZOMBIE_CRON_MS, Bg::ZombieCron);
            }
            Bg::EndlessCron => {
                // `StopEndlessTasks` (`services/actions/clear_tasks.go`): running tasks started
                // more than `ENDLESS_TASK_TIMEOUT` ago, however lively.
                for j in self
                    .forgejo
                    .endless_tasks(now, rules::ENDLESS_TASK_TIMEOUT_MS)
                {
                    let r = self.forgejo.jobs[&j].runner_id.unwrap_or(0);
                    self.stop_task(j, r, "failure", EV_ENDLESS);
                }
                self.schedule(now + rules::ENDLESS_CRON_MS, Bg::EndlessCron);
            }
            Bg::PersistentFlip(id) => {
                if let Some(r) = self.forgejo.runners.get_mut(&id)
                    && !r.busy
                {
                    if r.polling {
                        r.stops_polling(now);
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
                let n = self.forgejo.next_runner_id();
                let id = self.add_runner(format!("{OTHER_PREFIX}{n}-1"), Owner::OtherPool, true);
                if self.rng.chance(0.8) {
                    let at = now + self.rng.range(5 * SEC, 40 * SEC);
                    self.schedule(at, Bg::OtherConnect(id));
                }
                let at = now + self.rng.range(2 * MIN, 20 * MIN);
                self.schedule(at, Bg::OtherPoolRegister);
            }
            Bg::OtherConnect(id) => {
                if self.forgejo.live(id).is_some() {
                    // It connects and takes its pool's job (not in our label-filtered list).
                    self.declare(id, vec![OTHER_LABEL.into()]);
                    let j = self.new_job(&[OTHER_LABEL]);
                    if self.task_for(id, None) == Some(j) {
                        self.start_task(j, id);
                    }
                    let at = now + self.rng.range(10 * SEC, 10 * MIN);
                    self.schedule(at, Bg::OtherDone(id));
                }
            }
            Bg::OtherDone(id) | Bg::LegacyFinish(id) => {
                if self.forgejo.live(id).is_some() {
                    self.final_update_task(id);
                }
            }
            Bg::JobRerun(j) => {
                // `RerunJob` refuses a job that is not done (`ErrRerunJobStillRunning`): asked
                // again later, while jobs still arrive.
                if !self.arrivals_on {
                    return;
                }
                let handle = format!("{:08x}-h", self.rng.next_u64() as u32);
                if self.forgejo.rerun_job(j, handle.clone(), now) {
                    self.event(EV_RERUN);
                    self.log(format!("forgejo: job {j} rerun as attempt {handle}"));
                } else if self.forgejo.jobs.contains_key(&j) {
                    let at = now + self.rng.range(MIN, 20 * MIN);
                    self.schedule(at, Bg::JobRerun(j));
                }
            }
            Bg::AbandonedCron => {
                let cancelled = self
                    .forgejo
                    .cancel_abandoned_jobs(now, rules::ABANDONED_JOB_TIMEOUT_MS);
                for _ in cancelled {
                    self.event(EV_ABANDONED);
                }
                self.schedule(now + rules::ABANDONED_CRON_MS, Bg::AbandonedCron);
            }
            Bg::LatePost(slot, name) => {
                let id = self.srv_register(slot, &name);
                self.log(format!(
                    "forgejo: the late POST of {name} lands as runner {id}"
                ));
            }
        }
    }

    fn run_proc(&mut self, id: i64) {
        let now = self.now;
        let Some(p) = self.procs.get_mut(&id) else {
            return;
        };
        let (stage, behaviour, handle, woken) = (p.stage, p.behaviour, p.handle.clone(), p.woken);
        if self.forgejo.live(id).is_none() {
            match stage {
                // Declare fails (Unauthenticated "unregistered runner",
                // `routers/api/actions/runner/interceptor.go`): one-job exits. A task that was
                // running runs to its end and the process exits; a silent or dying one ends.
                Stage::Connect | Stage::Finish | Stage::GoSilent | Stage::Die => {
                    self.procs.remove(&id);
                }
                // Every fetch fails, which `single.go` takes as "no task": it polls on, to no
                // effect on Forgejo, until the VM goes.
                _ => {
                    p.stage = Stage::Poll;
                    p.next_at = i64::MAX;
                }
            }
            return;
        }
        let mut next: Option<(Stage, i64)> = None;
        match stage {
            Stage::Connect => {
                if behaviour == Behaviour::NeverConnects {
                    self.procs.remove(&id);
                    return;
                }
                let labels = std::mem::take(&mut p.labels);
                let vm = p.vm.clone();
                if self.tracing {
                    self.log(format!(
                        "runner {id}: connects, declares [{}]",
                        labels.join(", ")
                    ));
                }
                self.declare(id, labels);
                if let Some(v) = self.vm_starts.get_mut(&vm) {
                    v.never_connected = 0;
                }
                next = match behaviour {
                    Behaviour::ConnectsNoJob => Some((Stage::Stuck, i64::MAX)),
                    Behaviour::DiesEarly => {
                        Some((Stage::Die, now + self.rng.range(5 * SEC, 2 * MIN)))
                    }
                    _ => Some((
                        Stage::Take,
                        now + self.rng.range(0, rules::FETCH_INTERVAL_MS),
                    )),
                };
            }
            Stage::Take => match self.task_for(id, Some(&handle)) {
                None => {
                    // `one-job --handle … --wait`: the job is queued, went elsewhere, or the
                    // labels do not admit it; it asks again and again.
                    self.event(EV_POLLS_ON);
                    self.log(format!("runner {id}: given no task, polls on"));
                    next = Some((Stage::Poll, i64::MAX));
                }
                Some(j) => {
                    if woken {
                        self.event(EV_WOKEN);
                    }
                    self.start_task(j, id);
                    self.stats.jobs_served += 1;
                    if self.tracing {
                        self.log(format!("runner {id}: given job {j}"));
                    }
                    next = match behaviour {
                        Behaviour::HangActive => Some((Stage::Hang, i64::MAX)),
                        Behaviour::HangSilent => {
                            Some((Stage::GoSilent, now + self.rng.range(10 * SEC, 2 * MIN)))
                        }
                        _ => Some((Stage::Finish, now + self.rng.range(30 * SEC, 10 * MIN))),
                    };
                }
            },
            Stage::Finish => {
                // one-job exits after its task.
                self.final_update_task(id);
                self.procs.remove(&id);
                return;
            }
            Stage::GoSilent | Stage::Die => {
                let r = self.forgejo.runners.get_mut(&id).expect("present");
                r.stops_polling(now);
                self.procs.remove(&id);
                return;
            }
            Stage::Poll | Stage::Stuck | Stage::Hang => {}
        }
        if let (Some((stage, at)), Some(p)) = (next, self.procs.get_mut(&id)) {
            p.stage = stage;
            p.next_at = at;
        }
    }

    // -- the VM and its runner processes ----------------------------------------------------------

    /// The VM of `cycle_id` in `slot`'s tofu workspace, as the world tells VMs apart: by its
    /// cycle id, and with several slots by its slot too (each slot's workspace has a state of
    /// its own; two hosts' slots K make cycle ids of one form, which can be the same).
    pub fn vm_key(&self, slot: usize, cycle_id: &str) -> String {
        if self.hosts[self.slots[slot].host].pg {
            // A pool across hosts: a workspace per cycle, the same from any host.
            format!("{cycle_id} (pool)")
        } else if self.slots.len() == 1 {
            cycle_id.to_string()
        } else {
            format!("{cycle_id} ({})", self.slot_name(slot))
        }
    }

    /// Whether `slot`'s tofu workspace has the VM `vm` (`vm_key`).
    pub fn vm_exists(&self, slot: usize, vm: &str) -> bool {
        self.slots[slot].vms.iter().any(|v| v == vm)
    }

    /// `tofu apply` in `slot`'s workspace. Invariant: never two VMs in one slot.
    pub fn create_vm(&mut self, slot: usize, cycle_id: &str) {
        let vm = self.vm_key(slot, cycle_id);
        if self.vm_exists(slot, &vm) {
            return;
        }
        if !self.slots[slot].vms.is_empty() {
            let others = self.slots[slot].vms.join(", ");
            let name = self.slot_name(slot);
            self.violate(format!(
                "two VMs in one slot ({name}) at once: applying {cycle_id} while {others} exists"
            ));
        }
        self.stats.vms_created += 1;
        self.slots[slot].vms.push(vm.clone());
        self.vm_starts.insert(vm.clone(), VmStarts::default());
        if self.faults_on && self.rng.chance(self.cfg.broken_vm) {
            self.count_fault("VM broken: no runner on it ever connects");
            self.broken_vms.push(vm.clone());
        }
        self.log(format!("tofu: VM {vm} created"));
    }

    /// `tofu destroy` of the module in `slot`'s workspace: its VMs go, and every runner process
    /// on them stops: at once (powered off), or, half the time, by a shutdown that sends it
    /// SIGTERM first (a running task is then reported failed and Forgejo deletes the runner,
    /// `Forgejo::terminate`).
    pub fn destroy_vms(&mut self, slot: usize) {
        let now = self.now;
        for vm in std::mem::take(&mut self.slots[slot].vms) {
            let graceful = self.rng.chance(0.5);
            self.log(format!(
                "tofu: VM {vm} destroyed ({})",
                if graceful { "shut down" } else { "powered off" }
            ));
            self.vm_starts.remove(&vm);
            self.vm_ready.remove(&vm);
            self.broken_vms.retain(|v| *v != vm);
            let on_vm: Vec<i64> = self
                .procs
                .iter()
                .filter(|(_, p)| p.vm == vm)
                .map(|(id, _)| *id)
                .collect();
            for id in on_vm {
                self.procs.remove(&id);
                self.launched_ok.remove(&id);
                let Some(r) = self.forgejo.runners.get_mut(&id) else {
                    continue;
                };
                if r.deleted {
                    self.event(EV_ORPHAN);
                } else if graceful {
                    if self.forgejo.terminate(id, now).is_some() {
                        self.event(EV_SIGTERM_TASK);
                        self.log(format!("runner {id}: SIGTERM failed its task; deleted"));
                    }
                } else if r.polling {
                    r.stops_polling(now);
                }
            }
        }
    }

    /// The provisioner may have lost count of the starts on the VM `slot` has now.
    pub fn starts_uncertain(&mut self, slot: usize) {
        for vm in &self.slots[slot].vms {
            if let Some(v) = self.vm_starts.get_mut(vm) {
                v.uncertain = true;
            }
        }
    }

    /// The launch command exited 0 for this runner on this VM.
    pub fn launch_exited_0(&mut self, id: i64, vm: &str) {
        self.launched_ok.insert(id, vm.to_string());
    }

    /// Whether runner `id`'s process still runs (on any VM).
    pub fn runner_process_runs(&self, id: i64) -> bool {
        self.procs.contains_key(&id)
    }

    /// `RUNNER_ACTION=stop`: SIGTERM (then SIGKILL) ends the process of runner `id`
    /// (forgejo-runner main.go `signal.NotifyContext`; the poller returns,
    /// internal/app/poll/single.go); a task it runs is reported failed and Forgejo deletes the
    /// runner (`Forgejo::terminate`); else Forgejo sees it stop polling.
    pub fn stop_runner_process(&mut self, id: i64) {
        let now = self.now;
        if self.procs.remove(&id).is_none() {
            return;
        }
        self.event(EV_STOPPED);
        self.log(format!("runner {id}: process stopped"));
        self.launched_ok.remove(&id);
        if self.forgejo.terminate(id, now).is_some() {
            self.event(EV_SIGTERM_TASK);
            self.log(format!("runner {id}: SIGTERM failed its task; deleted"));
        }
    }

    /// The launch command starts `forgejo-runner one-job` for runner `id` with these `--label`
    /// values (RUNNER_LABELS). Invariants: no other runner process of ours still runs on that VM
    /// (a job never starts next to what an earlier job left running), and the job is inside the
    /// VM's trust boundary (`--reuse-within repo`: jobs of the repository of its first job).
    pub fn start_runner_process(&mut self, id: i64, handle: &str, vm: &str, labels: &str) {
        let others: Vec<i64> = self
            .procs
            .iter()
            .filter(|(other, p)| **other != id && p.vm == vm)
            .map(|(other, _)| *other)
            .collect();
        if !others.is_empty() {
            self.violate(format!(
                "runner {id} started on VM {vm} while the process of runner(s) {others:?} still runs there"
            ));
        }
        if let Some(repo) = self
            .forgejo
            .jobs
            .values()
            .find(|j| j.handle == handle && !j.is_done())
            .map(|j| j.repo_id)
        {
            match self.vm_repos.get(vm) {
                Some(first) if *first != repo => self.violate(format!(
                    "runner {id} for a job of repository {repo} started on VM {vm}, which ran a job of repository {first}"
                )),
                Some(_) => {}
                None => {
                    self.vm_repos.insert(vm.to_string(), repo);
                }
            }
        }
        let broken = self.broken_vms.iter().any(|v| v == vm);
        let behaviour = if broken {
            Behaviour::NeverConnects
        } else if self.faults_on && self.rng.chance(self.cfg.runner) {
            self.rng.pick(&[
                Behaviour::NeverConnects,
                Behaviour::ConnectsNoJob,
                Behaviour::HangActive,
                Behaviour::HangSilent,
                Behaviour::DiesEarly,
                Behaviour::NoLabels,
            ])
        } else {
            Behaviour::Normal
        };
        if behaviour != Behaviour::Normal && !broken {
            self.count_fault(behaviour.name());
        }
        let labels = if behaviour == Behaviour::NoLabels {
            Vec::new()
        } else {
            // The product passes only labels forgejo-runner takes (src/core/labels.rs).
            rules::declared_names(labels).expect("RUNNER_LABELS that forgejo-runner takes")
        };
        let next_at = self.now + self.rng.range(2 * SEC, 25 * SEC);
        self.log(format!(
            "runner {id}: process started ({}{})",
            behaviour.name(),
            if broken { ", broken VM" } else { "" }
        ));
        self.procs.insert(
            id,
            Proc {
                handle: handle.to_string(),
                vm: vm.to_string(),
                behaviour,
                stage: Stage::Connect,
                next_at,
                labels,
                woken: false,
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

    /// `GET /admin/actions/runners/jobs?labels=debian`: waiting and running jobs, id DESC, whose
    /// `runs_on` the labels cover (`ItRunsOn`; `routers/api/v1/shared/action.go`). A job queued
    /// behind its concurrency group is listed `waiting` all the same.
    pub fn srv_list_jobs(&self) -> Vec<Job> {
        self.forgejo
            .list_jobs(&Scope::ADMIN, Some(&[LABEL]))
            .into_iter()
            .map(listed)
            .collect()
    }

    /// `GET …/runners/{id}` as the HTTP client parses it (`Runner::from_json_with_labels`): the
    /// declared label names once the runner has declared itself (Forgejo then shows its
    /// `version`; `null` for none reads as none), unknown (`None`) before.
    pub fn wire_runner(&self, r: &SRunner) -> Runner {
        Runner {
            id: r.id,
            name: Some(r.name.clone()),
            status: status_of(r, self.now),
            labels: r.labels.clone(),
        }
    }

    /// A row of the runner list as the HTTP client parses it (list rows carry no labels).
    fn wire_row(&self, r: &SRunner) -> Runner {
        Runner {
            id: r.id,
            name: Some(r.name.clone()),
            status: status_of(r, self.now),
            labels: None,
        }
    }

    pub fn live(&self, id: i64) -> Option<&SRunner> {
        self.forgejo.live(id)
    }

    /// Invocation `inv` read runner `id` with this status (a GET, a list row), now.
    pub fn saw(&mut self, inv: usize, id: i64, status: RunnerStatus) {
        self.seen.insert((inv, id), (self.now, status));
    }

    /// `DELETE …/runners/{id}` sent by invocation `inv`, as applied by the server; checks the
    /// deletion invariants.
    pub fn srv_delete(&mut self, inv: usize, id: i64, reason: &str) -> bool {
        let Some(r) = self.live(id) else {
            return false;
        };
        let status = status_of(r, self.now);
        let (name, owner, never_connected, busy) =
            (r.name.clone(), r.extra, r.labels.is_none(), r.busy);
        let destroy_ok = self.invs[inv].destroy_ok;
        let slot = self.slot_of(inv);
        let host = self.slots[slot].host;
        let prefix = self.hosts[host].prefix;
        // Never another slot's registration while that slot's cycle.json holds it, and never
        // another host's at all.
        if let Some(&by) = self.ours.get(&id)
            && by != slot
        {
            let (me, them) = (self.slot_name(slot), self.slot_name(by));
            if self.pool_of(self.slots[by].host) != self.pool_of(host) {
                self.violate(format!(
                    "{me} deleted runner {id} ({name}), which another host's {them} registered (reason {reason})"
                ));
            } else if self.slots[by].holds(id, &name) {
                self.violate(format!(
                    "{me} deleted runner {id} ({name}) while {them}, which registered it, holds it in its cycle.json (reason {reason})"
                ));
            }
        }
        if status != RunnerStatus::Offline {
            // Forgejo's DELETE does no status check (`routers/api/v1/shared/runners.go`): a
            // runner that comes up between the read that found it offline and the DELETE is
            // deleted while up. No client can close that window; what the product must never do
            // is decide on a reading that was not `offline`, nor let it happen to a runner it
            // tried to stop: one whose stop worked cannot come up, and one whose stop failed is
            // deleted only after the destroy ended its process (`core::planner::stop_failed`).
            let read = self.seen.get(&(inv, id)).cloned();
            let stopped = self.slots[slot].disk.as_ref().is_some_and(|(_, st)| {
                st.registrations
                    .iter()
                    .any(|g| g.id == Some(id) && g.stopped.is_some())
            });
            match read {
                Some((at, RunnerStatus::Offline)) if !stopped => {
                    self.event(EV_RACED_DELETE);
                    if busy {
                        self.event(EV_RACED_DELETE_ACTIVE);
                    }
                    self.log(format!(
                        "runner {id} ({name}) came up after it was read offline at t+{} ms; deleted while {}",
                        at - T0,
                        status.as_str()
                    ));
                }
                _ => self.violate(format!(
                    "deleted runner {id} ({name}, {owner:?}) while it was {} (reason {reason}; last read by this run: {})",
                    status.as_str(),
                    match read {
                        Some((at, st)) => format!("{} at t+{} ms{}", st.as_str(), at - T0, if stopped { ", after this cycle tried to stop its process" } else { "" }),
                        None => "never".to_string(),
                    }
                )),
            }
        }
        if !name.starts_with(prefix) {
            self.violate(format!(
                "deleted runner {id} ({name}, {owner:?}) without our prefix {prefix} (reason {reason})"
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
        if never_connected && let Some(vm) = self.launched_ok.get(&id) {
            if let Some(v) = self.vm_starts.get_mut(vm) {
                v.never_connected += 1;
            }
            *self
                .stats
                .never_connected_deleted
                .entry(reason.to_string())
                .or_default() += 1;
        }
        *self.stats.deletes.entry(reason.to_string()).or_default() += 1;
        self.forgejo.delete(id, self.now);
        true
    }

    /// A POST of `slot`'s lands: the registration it creates.
    pub fn srv_register(&mut self, slot: usize, name: &str) -> i64 {
        let id = self.add_runner(name.to_string(), Owner::Ours, true);
        self.ours.insert(id, slot);
        id
    }

    /// A POST sent at `sent` whose client gives up lands later, but before twice the timeout.
    pub fn schedule_late_post(&mut self, slot: usize, name: &str, sent: i64) {
        let at = sent + HTTP_TIMEOUT_MS + self.rng.range(0, HTTP_TIMEOUT_MS - SEC);
        self.schedule(at, Bg::LatePost(slot, name.to_string()));
    }

    /// One page of `GET /admin/actions/runners` (no `visible`: every runner of the world is an
    /// instance runner), `ORDER BY last_online DESC` (`Forgejo::list_runners`). Ties (every
    /// never-connected registration has `last_online = 0`) come in an arbitrary order that
    /// changes whenever rows are added or deleted (or, with `random_ties`, on every request), so
    /// pages read across a change overlap or skip rows. `page=0` is every row.
    pub fn srv_page(&mut self, page: u32, limit: u32) -> (Vec<Runner>, u64) {
        let random = self.random_ties;
        let rng = &mut self.rng;
        let (rows, total) = self.forgejo.list_runners(
            self.now,
            &Scope::ADMIN,
            false,
            i64::from(page),
            i64::from(limit),
            |id, version| {
                if random {
                    rng.next_u64()
                } else {
                    Rng::new(id as u64 ^ version.wrapping_mul(0x9E37_79B9)).next_u64()
                }
            },
        );
        let shown = rows
            .into_iter()
            .map(|row| {
                let mut r = self.wire_row(row);
                if self.nameless.contains(&row.id) {
                    r.name = None;
                }
                r
            })
            .collect();
        (shown, total as u64)
    }

    // -- invariants ---------------------------------------------------------------------------------

    /// Never a registration forgotten while Forgejo still lists it: every live registration we
    /// created is in the cycle.json of the slot that created it, by id or (POST unanswered) by
    /// name.
    pub fn check_remembered(&mut self, after: &str) {
        let mut missing: Option<(i64, String, usize)> = None;
        for (id, &slot) in &self.ours {
            let r = &self.forgejo.runners[id];
            if r.deleted {
                continue;
            }
            if !self.slots[slot].holds(r.id, &r.name) {
                missing = Some((r.id, r.name.clone(), slot));
                break;
            }
        }
        if let Some((id, name, slot)) = missing {
            let state = match &self.slots[slot].disk {
                None => "no cycle.json".to_string(),
                Some((_, s)) => format!("cycle.json of {} ({:?})", s.cycle_id, s.phase),
            };
            let who = self.slot_name(slot);
            self.violate(format!(
                "registration {id} ({name}) forgotten while Forgejo still lists it; {who}: {state}; after {after}"
            ));
        }
    }

    /// At the launch of runner `id` for the attempt `handle` of job `job` by invocation `inv`:
    /// never two runners of one host launched for one job attempt. A registration this host
    /// launched earlier for the same attempt that Forgejo still has (not deleted: its runner may
    /// still take the job) is one too many: the host's slots claim an attempt before registering
    /// for it, and hold the claim until the registration is forgotten, which only follows its
    /// deletion. (A rerun is a new attempt with a new handle: a runner of the earlier attempt is
    /// never given it, `IsRequestedByRunner`.)
    pub fn check_launch(&mut self, inv: usize, id: i64, job: i64, handle: &str) {
        let slot = self.slot_of(inv);
        let host = self.slots[slot].host;
        let earlier = self.launches.get(handle).and_then(|l| {
            l.iter()
                .find(|(s, other)| {
                    *other != id
                        && self.pool_of(self.slots[*s].host) == self.pool_of(host)
                        && self.forgejo.live(*other).is_some()
                })
                .copied()
        });
        if let Some((by, other)) = earlier {
            let (me, them) = (self.slot_name(slot), self.slot_name(by));
            self.violate(format!(
                "two runners of one host launched for job {job} (attempt {handle}): {me} launches runner {id} while runner {other}, launched by {them} for the same attempt, is still registered"
            ));
        }
        self.launches
            .entry(handle.to_string())
            .or_default()
            .push((slot, id));
    }

    /// A job Forgejo still lists (waiting or running) under this handle.
    fn listed(&self, job_id: i64, handle: &str) -> Option<&JobRow> {
        self.forgejo
            .jobs
            .get(&job_id)
            .filter(|j| j.handle == handle && j.is_listed())
    }

    /// Hold before teardown: while cycle.json records a teardown because a runner of ours was not
    /// given its waiting job in time (`not_served: pickup_timeout`), held-jobs.json holds that
    /// job — unless Forgejo no longer lists it (the hold is then pruned) or a hold may have
    /// been lost in this seed (a failed write or read of held-jobs.json: the run goes on without).
    pub fn check_hold_written(&mut self, after: &str) {
        for slot in 0..self.slots.len() {
            let sl = &self.slots[slot];
            if self
                .pool_slots(slot)
                .iter()
                .any(|k| self.slots[*k].holds_lost)
            {
                continue;
            }
            let Some((_, st)) = &sl.disk else { continue };
            // Held by this slot, or (`--store pg`: a cycle adopted with its record) by the slot
            // of the pool that recorded it.
            let pool = self.pool_slots(slot);
            let missing = st.registrations.iter().find(|g| {
                g.not_served == Some(NotServed::PickupTimeout)
                    && self.listed(g.job_id, &g.job_handle).is_some()
                    && !pool.iter().any(|k| {
                        self.slots[*k]
                            .holds_disk
                            .as_ref()
                            .is_some_and(|(_, h)| h.jobs.iter().any(|h| h.handle == g.job_handle))
                    })
            });
            if let Some(g) = missing {
                let what = format!(
                    "{}'s cycle.json records the pickup timeout of job {} (registration {}), but its held-jobs.json does not hold it; after {after}",
                    self.slot_name(slot),
                    g.job_id,
                    g.name
                );
                self.violate(what);
                return;
            }
        }
    }

    /// Before a POST of invocation `inv` for registration `name` (its intent is in cycle.json):
    /// - never a registration for a job held-jobs.json holds (unless this run could not read
    ///   held-jobs.json and so runs without holds);
    /// - never a registration on a VM whose last `MAX_START_FAILURES` runners were launched (the
    ///   launch exited 0) and never connected, unless the provisioner may have lost count.
    pub fn check_before_post(&mut self, inv: usize, name: &str) {
        let now = self.now;
        let sl = &self.slots[self.slot_of(inv)];
        let Some((_, st)) = &sl.disk else { return };
        let Some(reg) = st.registrations.iter().find(|g| g.name == name) else {
            return;
        };
        let (job_id, handle) = (reg.job_id, reg.job_handle.clone());
        let vm = self.vm_key(self.slot_of(inv), &st.cycle_id);
        if !self.invs[inv].holds_read_failed
            && let Some((_, h)) = &sl.holds_disk
            && let Some(hold) = h
                .jobs
                .iter()
                .find(|h| h.handle == handle && now < h.until.0)
        {
            let until = hold.until;
            self.violate(format!(
                "registration {name} for job {job_id} while held-jobs.json holds it until {until}"
            ));
        }
        if let Some(v) = self.vm_starts.get(&vm)
            && !v.uncertain
            && v.never_connected >= MAX_START_FAILURES
        {
            let n = v.never_connected;
            self.violate(format!(
                "registration {name} on VM {vm} after its last {n} runners (launched, the launch exited 0) never connected: the VM is broken"
            ));
        }
    }

    /// At a wait of invocation `inv` (the run sleeps a poll interval): no runner of ours sits
    /// idle next to its waiting job past its bound while the run waits on it. The bound starts
    /// when the runner declared labels that never take the job (by `rules`: the run
    /// must tear down at once), else at the pickup timeout after its launch; it ends one poll
    /// interval plus `NOT_SERVED_SLACK_MS` later. It counts from the start of this run, or from
    /// its last API fault, whichever is later: a run that did not see Forgejo cleanly may wait.
    pub fn check_not_served(&mut self, inv: usize) {
        let now = self.now;
        let Some((_, st)) = &self.slots[self.slot_of(inv)].disk else {
            return;
        };
        if st.phase != Phase::Running {
            return;
        }
        let clean_from = self.invs[inv].started_at.max(self.invs[inv].last_fault_at);
        let mut worst: Option<(i64, String)> = None;
        let mut waits = 0;
        for reg in &st.registrations {
            let Some(id) = reg.id else { continue };
            let Some(r) = self.live(id) else { continue };
            if status_of(r, now) != RunnerStatus::Idle {
                continue;
            }
            let Some(job) = self.listed(reg.job_id, &reg.job_handle) else {
                continue;
            };
            if job.status != "waiting" {
                continue;
            }
            waits += 1;
            let (start, why) = match r.labels.as_deref() {
                Some(l) if !rules::it_runs_on(l, &job.runs_on) => (
                    r.declared_at,
                    format!(
                        "declared the labels [{}], which never take its job (runs_on [{}])",
                        l.join(", "),
                        job.runs_on.join(", ")
                    ),
                ),
                _ => (
                    reg.grace_start().0 + PICKUP_MS,
                    format!(
                        "was launched {} s ago (pickup timeout {} s)",
                        (now - reg.grace_start().0) / SEC,
                        PICKUP_MS / SEC
                    ),
                ),
            };
            let over = now - start.max(clean_from);
            if over > worst.as_ref().map_or(0, |w| w.0) {
                worst = Some((
                    over,
                    format!(
                        "runner {id} ({}) sits idle next to its waiting job {}{} and {why}",
                        reg.name,
                        job.id,
                        if job.queued_behind {
                            " (queued behind its concurrency group)"
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        self.stats.not_served_waits += waits;
        if let Some((over, what)) = worst {
            self.stats.not_served_longest_ms = self.stats.not_served_longest_ms.max(over);
            if over > POLL_MS + NOT_SERVED_SLACK_MS {
                self.violate(format!(
                    "the run waits although {what}: {} ms past its bound's start (allowed {} ms)",
                    over,
                    POLL_MS + NOT_SERVED_SLACK_MS
                ));
            }
        }
    }

    // -- cycle.json and held-jobs.json --------------------------------------------------------------

    pub fn write_disk(&mut self, slot: usize, state: &CycleState) {
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
        if self.slots[slot]
            .disk
            .as_ref()
            .is_some_and(|(_, before)| is_unused_warm(before))
            && !is_unused_warm(&parsed)
        {
            let reason = parsed.teardown_reason.as_deref().unwrap_or_default();
            if parsed.phase != Phase::TearingDown {
                self.stats.warm_used += 1;
            } else if reason == TeardownReason::WarmExpired.describe() {
                self.stats.warm_expired += 1;
            } else if reason == TeardownReason::WarmNotWanted.describe() {
                self.stats.warm_not_wanted += 1;
            }
            let (h, vm) = (
                self.pool_of(self.slots[slot].host),
                self.vm_key(slot, &parsed.cycle_id),
            );
            self.warm_start_ends(h, &vm, &parsed);
        }
        self.slots[slot].disk = Some((bytes, parsed));
    }

    /// Writes held-jobs.json (removes it when nothing is held, as `FsStore` does).
    pub fn write_holds(&mut self, slot: usize, holds: &Holds) {
        if holds.jobs.is_empty() {
            self.slots[slot].holds_disk = None;
            return;
        }
        let bytes = serde_json::to_vec_pretty(holds).expect("holds encode");
        let parsed = match parse_holds(std::str::from_utf8(&bytes).expect("utf-8")) {
            Ok(p) => p,
            Err(e) => {
                self.violate(format!("held-jobs.json written does not parse back: {e:#}"));
                holds.clone()
            }
        };
        self.slots[slot].holds_disk = Some((bytes, parsed));
    }

    pub fn disk_phase(&self, slot: usize) -> &'static str {
        match &self.slots[slot].disk {
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

    /// In the quiet period, with several hosts: when every slot is idle (no cycle.json) and no
    /// job of ours waits, but a registration with some host's prefix is left (only that host's
    /// sweep may delete it), a job arrives for that host to serve (the host that takes the one
    /// last job of `go_quiet` runs the last cycle, and only its sweep runs). Which host, if any.
    pub fn host_left_behind(&mut self) -> Option<usize> {
        if self.hosts.len() == 1
            || (0..self.slots.len())
                .any(|k| self.slots[k].disk.is_some() && !self.kept_warm_at_rest(k))
            || self.srv_list_jobs().iter().any(|j| j.is_waiting())
        {
            return None;
        }
        let h = self.hosts.iter().position(|h| {
            self.forgejo
                .runners
                .values()
                .any(|r| !r.deleted && r.name.starts_with(h.prefix))
        })?;
        let j = self.new_job(&[LABEL]);
        self.log(format!(
            "QUIET: registrations with host {}'s prefix are left; job {j} arrives, its slots' timers fire first",
            h + 1
        ));
        Some(h)
    }

    /// `None` at rest; else what is left, in any slot of any host (but up to `--warm` unused warm
    /// VMs per pool, up, each in its slot's cycle.json, when the quiet period keeps `--warm`).
    pub fn leftovers(&self) -> Option<String> {
        let mut left = Vec::new();
        let mut kept = vec![0u32; self.hosts.len()];
        for (i, sl) in self.slots.iter().enumerate() {
            // Up to `--warm` unused warm VMs per pool, when the quiet period keeps it.
            if self.warm.quiet_keeps && self.kept_warm_at_rest(i) {
                kept[sl.host] += 1;
                if kept[sl.host] <= self.hosts[sl.host].warm.count {
                    continue;
                }
            }
            if let Some((_, s)) = &sl.disk {
                left.push(format!(
                    "{}: cycle.json of {} ({:?})",
                    self.slot_name(i),
                    s.cycle_id,
                    s.phase
                ));
            }
            if !sl.vms.is_empty() {
                left.push(format!("{}: VM {}", self.slot_name(i), sl.vms.join(", ")));
            }
        }
        for r in self.forgejo.runners.values() {
            if !r.deleted && self.hosts.iter().any(|h| r.name.starts_with(h.prefix)) {
                left.push(format!(
                    "registration {} ({}, {:?}, {})",
                    r.id,
                    r.name,
                    r.extra,
                    r.status(self.now)
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
        for (i, sl) in self.slots.iter().enumerate() {
            let Some((_, h)) = &sl.holds_disk else {
                continue;
            };
            // A dead host's holds are read by no live one (its lease lapsed).
            if self.hosts[sl.host]
                .dead
                .is_some_and(|(_, until)| until.is_none())
            {
                continue;
            }
            let stale: Vec<String> = h
                .jobs
                .iter()
                .filter(|h| self.listed(h.job_id, &h.handle).is_none())
                .map(|h| h.job_id.to_string())
                .collect();
            if !stale.is_empty() {
                left.push(format!(
                    "{}: held-jobs.json holds job(s) {} that Forgejo no longer lists",
                    self.slot_name(i),
                    stale.join(", ")
                ));
            }
        }
        if left.is_empty() {
            None
        } else {
            Some(left.join("; "))
        }
    }
}
