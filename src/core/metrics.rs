//! What monitoring sees: counters that accumulate across runs (`counters.json` in the state
//! directory, written by every `run` and `sweep` past the lock) and the Prometheus text file for
//! node_exporter's textfile collector (`--metrics-file`), rendered from them.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::core::backoff::Backoff;
use crate::core::report::Report;
use crate::core::state::CycleState;
use crate::core::sweep::gate::DeleteReason;
pub use crate::core::sweep::licence::DestroyRecord;
use crate::core::time::Timestamp;

pub const COUNTERS_FILE: &str = "counters.json";

pub(crate) const COUNTERS_VERSION: u32 = 1;

pub const PREFIX: &str = "ci_ephemeral_provisioner";

/// Everything the metrics and `status --check` need from past runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Counters {
    pub version: u32,
    pub first_run_at: Option<Timestamp>,
    pub last_run_at: Option<Timestamp>,
    pub last_run_command: String,
    pub last_run_exit_code: i32,
    pub last_run_duration_ms: u64,
    /// The end of the last run that exited 0 (an idle tick counts).
    pub last_success_at: Option<Timestamp>,
    /// Runs by `command` then exit code.
    pub runs: BTreeMap<String, BTreeMap<String, u64>>,
    /// Registrations deleted (204), by reason.
    pub deleted: BTreeMap<String, u64>,
    pub destroy_failures: u64,
    /// The last `tofu destroy` attempted failed (cleared by a successful one).
    pub destroy_failing: bool,
    pub last_destroy_error: Option<String>,
    pub last_destroy_ok: Option<DestroyRecord>,
    pub sweep_deletions: u64,
    /// Sweeps that failed (listing error or any failed DELETE).
    pub sweep_failures: u64,
    pub sweep_left_over_cap: u64,
    /// Jobs held because our runner was not given them (`hold_job` events), by reason.
    pub jobs_held: BTreeMap<String, u64>,
    /// The pickup times of the jobs this slot's runners took (`take_job` events).
    pub pickups: Pickups,
    /// `--store pg`: cycles this slot adopted from a host whose lease lapsed (`adopt_cycle`).
    pub adoptions: u64,
    /// `--store pg`: runs that stopped because another host had adopted their cycle.
    pub fenced_runs: u64,
    /// `--store pg`: hosts of the pool whose lease had lapsed with a cycle, as the last run saw
    /// them (none with the files store).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_hosts_lapsed: Option<u32>,
}

/// Upper bounds, in seconds, of the pickup histogram's buckets (`+Inf` follows).
pub const PICKUP_BUCKETS: [u64; 14] = [1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600];

/// Pickup times kept for `status`'s percentiles.
pub const PICKUPS_KEPT: usize = 100;

/// Pickup times: a histogram across runs, and the last [`PICKUPS_KEPT`] of them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Pickups {
    /// How many fell in each bucket of [`PICKUP_BUCKETS`] (not cumulative); the last one is
    /// beyond the last bound.
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_ms: u64,
    /// The last ones, oldest first, in milliseconds.
    pub recent_ms: Vec<u64>,
}

impl Pickups {
    /// Counts one pickup of `ms` milliseconds.
    pub fn add(&mut self, ms: u64) {
        self.buckets.resize(PICKUP_BUCKETS.len() + 1, 0);
        let i = PICKUP_BUCKETS
            .iter()
            .position(|le| ms <= le * 1000)
            .unwrap_or(PICKUP_BUCKETS.len());
        self.buckets[i] += 1;
        self.count += 1;
        self.sum_ms = self.sum_ms.saturating_add(ms);
        self.recent_ms.push(ms);
        if self.recent_ms.len() > PICKUPS_KEPT {
            let extra = self.recent_ms.len() - PICKUPS_KEPT;
            self.recent_ms.drain(..extra);
        }
    }

    /// The cumulative count at each bound, `+Inf` last: `(le, count)`.
    pub fn cumulative(&self) -> Vec<(String, u64)> {
        let mut total = 0;
        let mut out = Vec::new();
        for (i, le) in PICKUP_BUCKETS.iter().enumerate() {
            total += self.buckets.get(i).copied().unwrap_or(0);
            out.push((le.to_string(), total));
        }
        out.push(("+Inf".into(), self.count));
        out
    }
}

/// The median and 95th percentile of some pickup times (nearest rank), in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PickupSummary {
    pub jobs: usize,
    pub p50_ms: u64,
    pub p95_ms: u64,
}

/// Pure: the summary of `ms`, `None` when there is none.
pub fn pickup_summary(ms: impl IntoIterator<Item = u64>) -> Option<PickupSummary> {
    let mut v: Vec<u64> = ms.into_iter().collect();
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let rank = |p: usize| v[(v.len() * p).div_ceil(100).max(1) - 1];
    Some(PickupSummary {
        jobs: v.len(),
        p50_ms: rank(50),
        p95_ms: rank(95),
    })
}

impl Default for Counters {
    fn default() -> Counters {
        Counters {
            version: COUNTERS_VERSION,
            first_run_at: None,
            last_run_at: None,
            last_run_command: String::new(),
            last_run_exit_code: 0,
            last_run_duration_ms: 0,
            last_success_at: None,
            runs: BTreeMap::new(),
            deleted: BTreeMap::new(),
            destroy_failures: 0,
            destroy_failing: false,
            last_destroy_error: None,
            last_destroy_ok: None,
            sweep_deletions: 0,
            sweep_failures: 0,
            sweep_left_over_cap: 0,
            jobs_held: BTreeMap::new(),
            pickups: Pickups::default(),
            adoptions: 0,
            fenced_runs: 0,
            pool_hosts_lapsed: None,
        }
    }
}

impl Counters {
    /// Pure: adds a finished run (its exit code set) to the counters.
    pub fn record(&mut self, report: &Report) {
        let end = report.finished_at.unwrap_or(report.started_at);
        self.first_run_at.get_or_insert(report.started_at);
        self.last_run_at = Some(end);
        self.last_run_command.clone_from(&report.command);
        self.last_run_exit_code = report.exit_code;
        self.last_run_duration_ms = report.duration_ms;
        if report.exit_code == 0 {
            self.last_success_at = Some(end);
        }
        *self
            .runs
            .entry(report.command.clone())
            .or_default()
            .entry(report.exit_code.to_string())
            .or_default() += 1;
        for (reason, n) in &report.summary.deleted {
            *self.deleted.entry(reason.clone()).or_default() += u64::from(*n);
        }
        for e in report
            .events
            .iter()
            .filter(|e| e.step == "hold_job" && e.ok)
        {
            let reason = e.reason.clone().unwrap_or_else(|| "unknown".into());
            *self.jobs_held.entry(reason).or_default() += 1;
        }
        for ms in report
            .events
            .iter()
            .filter(|e| e.step == "take_job" && e.ok)
            .filter_map(|e| e.pickup_ms)
        {
            self.pickups.add(ms);
        }
        self.adoptions += report
            .events
            .iter()
            .filter(|e| e.step == "adopt_cycle" && e.ok)
            .count() as u64;
        if report.outcome == crate::core::report::Outcome::Fenced {
            self.fenced_runs += 1;
        }
        if let Some(p) = &report.pool {
            self.pool_hosts_lapsed = Some(p.view.lapsed_with_cycles());
        }
        // The last destroy of the run decides whether destroys are failing.
        for e in report.events.iter().filter(|e| e.step == "tofu_destroy") {
            if e.ok {
                self.destroy_failing = false;
                self.last_destroy_error = None;
                self.last_destroy_ok = Some(DestroyRecord {
                    cycle_id: report.cycle_id.clone(),
                    at: Some(e.at),
                });
            } else {
                self.destroy_failures += 1;
                self.destroy_failing = true;
                self.last_destroy_error = Some(e.detail.clone());
            }
        }
        if let Some(s) = &report.sweep {
            self.sweep_deletions += s.deleted.len() as u64;
            self.sweep_left_over_cap = s.left_over_cap as u64;
            if s.error.is_some() || !s.failed.is_empty() {
                self.sweep_failures += 1;
            }
        }
    }
}

/// What the metrics say about the cycle in progress.
pub enum CycleView<'a> {
    None,
    Active(&'a CycleState),
    /// cycle.json exists but cannot be read: a cycle may be in progress.
    Unreadable,
}

fn secs(t: Timestamp) -> String {
    format!("{}.{:03}", t.0.div_euclid(1000), t.0.rem_euclid(1000))
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The text being written, and the labels every sample carries (the pool's).
struct Out(String, Vec<(&'static str, String)>);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {PREFIX}_{name} {help}");
        let _ = writeln!(self.0, "# TYPE {PREFIX}_{name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        let l: Vec<String> = self
            .1
            .iter()
            .map(|(k, v)| (*k, v.as_str()))
            .chain(labels.iter().copied())
            .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
            .collect();
        let l = if l.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", l.join(","))
        };
        let _ = writeln!(self.0, "{PREFIX}_{name}{l} {value}");
    }

    fn one(&mut self, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }
}

/// Pure: the Prometheus text exposition of the counters and the cycle in progress. `running`:
/// the start of the run that is writing the file at its beginning (a cycle can keep one run
/// going for hours; without this the file would look stale all that time). `labels`: carried by
/// every sample: `pool="…"`, so the files of several pools on one host can sit in one textfile
/// directory without colliding, and `slot="…"` for a pool of several slots.
pub fn render(
    c: &Counters,
    cycle: &CycleView<'_>,
    backoff: Option<&Backoff>,
    running: Option<Timestamp>,
    labels: &[(&'static str, String)],
) -> String {
    let mut o = Out(String::new(), labels.to_vec());
    render_runs(&mut o, c, running);
    render_cycle(&mut o, cycle, backoff);
    render_deletions(&mut o, c);
    render_pickups(&mut o, c);
    render_pool(&mut o, c);
    o.0
}

/// `--store pg`: adoptions, fenced runs and hosts whose lease lapsed (nothing with files).
fn render_pool(o: &mut Out, c: &Counters) {
    let Some(lapsed) = c.pool_hosts_lapsed else {
        return;
    };
    o.one(
        "pool_hosts_lapsed",
        "gauge",
        "Hosts of the pool whose lease had lapsed with a cycle in progress, as the last run saw them (a live host adopts and tears those cycles down).",
        lapsed,
    );
    o.one(
        "adoptions_total",
        "counter",
        "Cycles this slot adopted from a host of the pool whose lease had lapsed (and tore down).",
        c.adoptions,
    );
    o.one(
        "fenced_runs_total",
        "counter",
        "Runs that stopped before any further side effect because another host had adopted their cycle.",
        c.fenced_runs,
    );
}

/// The binary, the last run and the run in progress, and the runs by command and exit status.
fn render_runs(o: &mut Out, c: &Counters, running: Option<Timestamp>) {
    o.family(
        "build_info",
        "gauge",
        "Version of the binary that wrote this file (always 1).",
    );
    o.sample("build_info", &[("version", env!("CARGO_PKG_VERSION"))], 1);
    o.one(
        "last_run_timestamp_seconds",
        "gauge",
        "Unix time the last run or sweep ended.",
        c.last_run_at.map(secs).unwrap_or_else(|| "0".into()),
    );
    o.one(
        "last_success_timestamp_seconds",
        "gauge",
        "Unix time the last run or sweep that exited 0 ended (an idle tick counts); 0 if none did.",
        c.last_success_at.map(secs).unwrap_or_else(|| "0".into()),
    );
    o.one(
        "last_run_exit_code",
        "gauge",
        "Exit status of the last run or sweep (0 ok, 1 a step failed, 2 configuration error).",
        c.last_run_exit_code,
    );
    o.one(
        "last_run_duration_seconds",
        "gauge",
        "How long the last run or sweep took.",
        format!(
            "{}.{:03}",
            c.last_run_duration_ms / 1000,
            c.last_run_duration_ms % 1000
        ),
    );
    o.one(
        "run_in_progress",
        "gauge",
        "1 from the start of a run or sweep until it ends (a cycle keeps its run going for hours).",
        u8::from(running.is_some()),
    );
    o.family(
        "run_start_timestamp_seconds",
        "gauge",
        "Unix time the run in progress started (no sample when none is).",
    );
    if let Some(t) = running {
        o.sample("run_start_timestamp_seconds", &[], secs(t));
    }
    o.family(
        "runs_total",
        "counter",
        "Runs and sweeps that got past the lock, by command and exit status.",
    );
    for (command, by_code) in &c.runs {
        for (code, n) in by_code {
            o.sample(
                "runs_total",
                &[("command", command), ("exit_code", code)],
                n,
            );
        }
    }
}

/// The cycle in progress and the pool's failure backoff.
fn render_cycle(o: &mut Out, cycle: &CycleView<'_>, backoff: Option<&Backoff>) {
    let (active, started, jobs, warm) = match cycle {
        CycleView::None => (0, None, 0, false),
        CycleView::Active(s) => (
            1,
            Some(s.started_at),
            s.jobs_started,
            crate::core::warm::is_unused_warm(s),
        ),
        CycleView::Unreadable => (1, None, 0, false),
    };
    o.one(
        "cycle_active",
        "gauge",
        "1 while a cycle is in progress (cycle.json exists: a VM or registration may exist), check --boot's too.",
        active,
    );
    o.family(
        "cycle_start_timestamp_seconds",
        "gauge",
        "Unix time the cycle in progress started (no sample when none is).",
    );
    if let Some(t) = started {
        o.sample("cycle_start_timestamp_seconds", &[], secs(t));
    }
    o.one(
        "cycle_warm",
        "gauge",
        "1 while the cycle in progress is a warm VM no job has used yet (--warm).",
        u8::from(warm),
    );
    o.one(
        "cycle_jobs_started",
        "gauge",
        "Runners started in the cycle in progress (0 when none is).",
        jobs,
    );
    o.one(
        "failed_cycles_in_a_row",
        "gauge",
        "Cycles of the pool in a row that failed without serving a job (the failure backoff's count).",
        backoff.map_or(0, |b| b.consecutive_failed_cycles),
    );
    o.one(
        "backoff_until_timestamp_seconds",
        "gauge",
        "Unix time until which the pool starts no new VM (its failure backoff); 0 when none was set.",
        backoff
            .and_then(|b| b.until)
            .map(secs)
            .unwrap_or_else(|| "0".into()),
    );
}

/// Registrations deleted and jobs held, by reason (every reason has a sample), and the destroys
/// and sweeps that failed.
fn render_deletions(o: &mut Out, c: &Counters) {
    o.family(
        "registrations_deleted_total",
        "counter",
        "Runner registrations deleted (Forgejo answered 204), by reason.",
    );
    let mut reasons: BTreeMap<&str, u64> =
        DeleteReason::ALL.iter().map(|r| (r.as_str(), 0)).collect();
    for (r, n) in &c.deleted {
        reasons.insert(r, *n);
    }
    for (r, n) in reasons {
        o.sample("registrations_deleted_total", &[("reason", r)], n);
    }
    o.family(
        "jobs_held_total",
        "counter",
        "Jobs held (no runner for them for a while) because Forgejo did not give our idle runner its waiting job, by reason: pickup_timeout (--job-pickup-timeout passed), wrong_labels.",
    );
    let mut held: BTreeMap<&str, u64> = [DeleteReason::PickupTimeout, DeleteReason::WrongLabels]
        .iter()
        .map(|r| (r.as_str(), 0))
        .collect();
    for (r, n) in &c.jobs_held {
        held.insert(r, *n);
    }
    for (r, n) in held {
        o.sample("jobs_held_total", &[("reason", r)], n);
    }
    o.one(
        "destroy_failures_total",
        "counter",
        "tofu destroy runs that failed.",
        c.destroy_failures,
    );
    o.one(
        "destroy_failing",
        "gauge",
        "1 when the last tofu destroy failed (the VM may still exist; no sweep until one succeeds).",
        u8::from(c.destroy_failing),
    );
    o.one(
        "sweep_deletions_total",
        "counter",
        "Offline registrations with our prefix deleted by sweeps.",
        c.sweep_deletions,
    );
    o.one(
        "sweep_failures_total",
        "counter",
        "Sweeps that failed: the listing failed or a DELETE failed.",
        c.sweep_failures,
    );
    o.one(
        "sweep_left_over_cap",
        "gauge",
        "Deletable registrations the last sweep left for the next because of --sweep-max-deletions.",
        c.sweep_left_over_cap,
    );
}

/// The histogram of the pickup times.
fn render_pickups(o: &mut Out, c: &Counters) {
    let p = "job_pickup_seconds";
    o.family(
        p,
        "histogram",
        "Time from the first run of the pool that saw a job waiting until its runner was first seen active (at most: until its registration was gone, when never seen active), per job our runners took.",
    );
    for (le, n) in c.pickups.cumulative() {
        o.sample(&format!("{p}_bucket"), &[("le", &le)], n);
    }
    o.sample(
        &format!("{p}_sum"),
        &[],
        format!("{}.{:03}", c.pickups.sum_ms / 1000, c.pickups.sum_ms % 1000),
    );
    o.sample(&format!("{p}_count"), &[], c.pickups.count);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::report::SweepReport;

    fn report(exit: i32, at_ms: i64) -> Report {
        let mut r = Report::new("run", false, Timestamp(at_ms));
        r.exit_code = exit;
        r.finished_at = Some(Timestamp(at_ms + 1500));
        r.duration_ms = 1500;
        r
    }

    // Mutation caught: a warm VM's cycle not told from a cycle serving jobs (the dashboard's
    // "warm" count would be a guess).
    #[test]
    fn a_warm_unused_vm_is_counted_as_warm_and_one_serving_jobs_is_not() {
        let mut s = CycleState::new("c1".into(), Timestamp(1_000));
        s.warm = true;
        let text =
            |s: &CycleState| render(&Counters::default(), &CycleView::Active(s), None, None, &[]);
        assert!(text(&s).contains("\nci_ephemeral_provisioner_cycle_warm 1\n"));
        s.jobs_started = 1;
        assert!(text(&s).contains("\nci_ephemeral_provisioner_cycle_warm 0\n"));
        let none = render(&Counters::default(), &CycleView::None, None, None, &[]);
        assert!(none.contains("\nci_ephemeral_provisioner_cycle_warm 0\n"));
    }

    #[test]
    fn success_is_exit_zero_and_counters_accumulate() {
        let mut c = Counters::default();
        c.record(&report(0, 1_000_000));
        assert_eq!(c.last_success_at, Some(Timestamp(1_001_500)));
        c.record(&report(1, 2_000_000));
        assert_eq!(
            c.last_success_at,
            Some(Timestamp(1_001_500)),
            "a failure keeps it"
        );
        assert_eq!(c.last_run_at, Some(Timestamp(2_001_500)));
        assert_eq!(c.last_run_exit_code, 1);
        assert_eq!(c.first_run_at, Some(Timestamp(1_000_000)));
        assert_eq!(c.runs["run"]["0"], 1);
        assert_eq!(c.runs["run"]["1"], 1);
    }

    #[test]
    fn destroys_and_sweeps_are_counted() {
        let mut c = Counters::default();
        let mut r = report(1, 1_000);
        r.event("tofu_destroy", false, "boom");
        r.sweep = Some(SweepReport {
            error: Some("listing failed".into()),
            ..SweepReport::default()
        });
        r.settle();
        c.record(&r);
        assert!(c.destroy_failing);
        assert_eq!((c.destroy_failures, c.sweep_failures), (1, 1));
        let mut r = report(0, 2_000);
        r.cycle_id = Some("c1".into());
        r.event("tofu_destroy", true, "VM destroyed");
        let e = r.event("delete_runner", true, crate::core::report::DELETED);
        e.reason = Some("sweep".into());
        let e = r.event("delete_runner", true, crate::core::report::ALREADY_GONE);
        e.reason = Some("sweep".into());
        r.settle();
        c.record(&r);
        assert!(!c.destroy_failing, "a successful destroy clears it");
        assert_eq!(c.destroy_failures, 1);
        assert_eq!(c.deleted["sweep"], 1, "a 404 is not a deletion");
        assert_eq!(
            c.last_destroy_ok
                .as_ref()
                .and_then(|d| d.cycle_id.as_deref()),
            Some("c1")
        );
    }

    #[test]
    fn render_follows_the_exposition_format() {
        let mut c = Counters::default();
        c.record(&report(0, 1_764_414_300_123));
        let text = render(&c, &CycleView::None, None, None, &[]);
        assert!(text.contains(
            "\nci_ephemeral_provisioner_last_success_timestamp_seconds 1764414301.623\n"
        ));
        assert!(
            text.contains("\nci_ephemeral_provisioner_last_run_timestamp_seconds 1764414301.623\n")
        );
        assert!(text.contains(
            "ci_ephemeral_provisioner_registrations_deleted_total{reason=\"unconsumed\"} 0"
        ));
        assert!(text.contains("ci_ephemeral_provisioner_cycle_active 0"));
        assert!(!text.contains("\nci_ephemeral_provisioner_cycle_start_timestamp_seconds "));
        assert!(text.contains("\nci_ephemeral_provisioner_run_in_progress 0\n"));
        let running = render(&c, &CycleView::None, None, Some(Timestamp(2_000)), &[]);
        assert!(running.contains("\nci_ephemeral_provisioner_run_in_progress 1\n"));
        assert!(running.contains("\nci_ephemeral_provisioner_run_start_timestamp_seconds 2.000\n"));
        // Every sample belongs to a family declared (HELP then TYPE) before it; counters end in
        // _total; nothing is declared twice.
        let mut declared: Vec<String> = Vec::new();
        let mut histograms: Vec<String> = Vec::new();
        let mut lines = text.lines().peekable();
        while let Some(l) = lines.next() {
            if let Some(rest) = l.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap().to_string();
                let ty = lines.next().unwrap();
                assert!(ty.starts_with(&format!("# TYPE {name} ")), "{ty}");
                if ty.ends_with(" counter") {
                    assert!(name.ends_with("_total"), "{name}");
                }
                if ty.ends_with(" histogram") {
                    histograms.push(name.clone());
                }
                assert!(!declared.contains(&name), "{name} twice");
                declared.push(name);
            } else {
                let name = l.split(['{', ' ']).next().unwrap();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|x| name.strip_suffix(x))
                    .filter(|f| histograms.iter().any(|h| h == f))
                    .unwrap_or(name);
                assert_eq!(declared.last().map(String::as_str), Some(family), "{l}");
            }
        }
    }

    #[test]
    fn a_pool_and_slot_label_every_sample() {
        let mut c = Counters::default();
        c.record(&report(0, 1_764_414_300_123));
        let mut b = Backoff::new();
        b.consecutive_failed_cycles = 4;
        b.until = Some(Timestamp(9_000));
        let text = render(
            &c,
            &CycleView::None,
            Some(&b),
            Some(Timestamp(2_000)),
            &[("pool", "gpu".into()), ("slot", "2".into())],
        );
        assert!(text.contains(
            "\nci_ephemeral_provisioner_backoff_until_timestamp_seconds{pool=\"gpu\",slot=\"2\"} 9.000\n"
        ));
        assert!(text.contains(
            "\nci_ephemeral_provisioner_failed_cycles_in_a_row{pool=\"gpu\",slot=\"2\"} 4\n"
        ));
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert!(samples.len() > 10);
        for l in &samples {
            assert!(l.contains("{pool=\"gpu\",slot=\"2\""), "{l}");
        }
        assert!(text.contains(
            "ci_ephemeral_provisioner_registrations_deleted_total{pool=\"gpu\",slot=\"2\",reason=\"sweep\"} 0"
        ));
        assert!(
            text.contains(
                "\nci_ephemeral_provisioner_run_in_progress{pool=\"gpu\",slot=\"2\"} 1\n"
            )
        );
    }

    #[test]
    fn negative_and_zero_timestamps_render_as_numbers() {
        assert_eq!(secs(Timestamp(0)), "0.000");
        assert_eq!(secs(Timestamp(1_500)), "1.500");
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn pickups_fill_a_cumulative_histogram_and_keep_the_last_ones() {
        let mut c = Counters::default();
        let mut r = report(0, 1_000);
        for (step, ms) in [
            ("take_job", Some(900)),
            ("take_job", Some(1_000)),
            ("take_job", Some(1_001)),
            ("take_job", Some(700_000)),
            ("take_job", None),
            ("launch_runner", Some(5)),
        ] {
            r.event(step, true, "").pickup_ms = ms;
        }
        r.event("take_job", false, "").pickup_ms = Some(3);
        c.record(&r);
        let p = &c.pickups;
        assert_eq!((p.count, p.sum_ms), (4, 702_901));
        let cum: BTreeMap<String, u64> = p.cumulative().into_iter().collect();
        assert_eq!((cum["1"], cum["2"], cum["600"], cum["+Inf"]), (2, 3, 3, 4));
        assert_eq!(p.recent_ms, [900, 1_000, 1_001, 700_000]);
        // Across runs, and through counters.json.
        let text = serde_json::to_string(&c).unwrap();
        let mut again: Counters = serde_json::from_str(&text).unwrap();
        again.record(&r);
        assert_eq!(again.pickups.count, 8);
        let out = render(
            &again,
            &CycleView::None,
            None,
            None,
            &[("slot", "2".into())],
        );
        let pre = "ci_ephemeral_provisioner_job_pickup_seconds";
        assert!(
            out.contains(&format!("\n{pre}_bucket{{slot=\"2\",le=\"1\"}} 4\n")),
            "{out}"
        );
        assert!(out.contains(&format!("\n{pre}_bucket{{slot=\"2\",le=\"+Inf\"}} 8\n")));
        assert!(out.contains(&format!("\n{pre}_sum{{slot=\"2\"}} 1405.802\n")));
        assert!(out.contains(&format!("\n{pre}_count{{slot=\"2\"}} 8\n")));
        // A counters.json of an earlier version has none.
        let old: Counters = serde_json::from_str(r#"{"version": 1}"#).unwrap();
        assert_eq!(old.pickups, Pickups::default());
        assert!(
            render(&old, &CycleView::None, None, None, &[]).contains(&format!("\n{pre}_count 0\n"))
        );
        // Only the last ones are kept.
        let mut many = Pickups::default();
        for ms in 0..(PICKUPS_KEPT as u64 + 7) {
            many.add(ms);
        }
        assert_eq!(many.recent_ms.len(), PICKUPS_KEPT);
        assert_eq!(many.recent_ms[0], 7);
    }

    #[test]
    fn pickup_percentiles_are_nearest_rank() {
        assert_eq!(pickup_summary([]), None);
        let one = pickup_summary([4_000]).unwrap();
        assert_eq!((one.jobs, one.p50_ms, one.p95_ms), (1, 4_000, 4_000));
        let s = pickup_summary((1..=100).rev().map(|i| i * 1000)).unwrap();
        assert_eq!((s.jobs, s.p50_ms, s.p95_ms), (100, 50_000, 95_000));
        let s = pickup_summary([3, 1, 2]).unwrap();
        assert_eq!((s.p50_ms, s.p95_ms), (2, 3));
    }
}
