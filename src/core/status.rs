//! `status`: the cycle in progress, the last run, the last events, and the warnings that make
//! `status --check` fail (a health check). Read-only: takes no lock, writes nothing.

pub mod remote;

use std::time::Duration;

use serde_json::Value;

use crate::core::metrics::Counters;
use crate::core::state::CycleState;
use crate::core::time::{Timestamp, format_duration};

pub const EVENTS_SHOWN: usize = 10;

/// last-run.json is read up to this size (a sweep of thousands of registrations lists each).
pub(crate) const MAX_LAST_RUN_BYTES: u64 = 64 * 1024 * 1024;

/// Longer details are cut in the text form (the JSON form and the files have them whole).
const TEXT_DETAIL: usize = 300;

/// What the health check looks at, gathered from the state directory.
#[derive(Debug, Default)]
pub struct Facts {
    /// The first run known; `None` when no run was ever recorded.
    pub runs_began: Option<Timestamp>,
    pub last_success: Option<Timestamp>,
    /// Why the last destroy failed, when it did.
    pub destroy_failing: Option<String>,
    /// The cycle in progress: id and start.
    pub cycle: Option<(String, Timestamp)>,
    /// Files that could not be read.
    pub unreadable: Vec<String>,
    /// The pool's failure backoff, when it is in force.
    pub backoff: Option<crate::core::backoff::Closed>,
}

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_success_age: Duration,
    pub max_cycle_duration: Duration,
}

fn age(now: Timestamp, t: Timestamp) -> Duration {
    Duration::from_secs(now.since(t).as_secs())
}

/// Pure: the warnings, empty when healthy.
pub fn warnings(f: &Facts, l: &Limits, now: Timestamp) -> Vec<String> {
    let mut w: Vec<String> = f.unreadable.clone();
    match (f.runs_began, f.last_success) {
        (None, None) => w.push(
            "no run recorded yet: expected until the timer's first run (`systemctl list-timers 'ci-ephemeral-provisioner@*'` says when it is due); after it, is the timer enabled and started?"
                .into(),
        ),
        (Some(began), None) => w.push(format!(
            "no successful run since runs began ({began}, {} ago)",
            format_duration(age(now, began))
        )),
        (_, Some(ok)) if now.since(ok) > l.max_success_age => w.push(format!(
            "last success {ok} ({} ago) is older than --max-success-age {}",
            format_duration(age(now, ok)),
            format_duration(l.max_success_age)
        )),
        _ => {}
    }
    if let Some(e) = &f.destroy_failing {
        w.push(format!(
            "the last tofu destroy failed (the VM may still exist; no sweep until a destroy succeeds): {e}"
        ));
    }
    if let Some(b) = &f.backoff {
        w.push(format!("the pool is {}", b.describe()));
    }
    if let Some((id, started)) = &f.cycle
        && now.since(*started) > l.max_cycle_duration
    {
        w.push(format!(
            "cycle {id} started {started} ({} ago), longer than --max-cycle-duration {}",
            format_duration(age(now, *started)),
            format_duration(l.max_cycle_duration)
        ));
    }
    w
}

/// Pure: the facts from what the files held.
pub fn facts(
    counters: Option<&Counters>,
    last_run: Option<&Value>,
    cycle: Option<&CycleState>,
    unreadable: Vec<String>,
) -> Facts {
    let ts = |v: &Value| v.as_str().and_then(|s| Timestamp::parse_rfc3339(s).ok());
    let mut f = Facts {
        unreadable,
        ..Facts::default()
    };
    if let Some(c) = counters {
        f.runs_began = c.first_run_at;
        f.last_success = c.last_success_at;
        if c.destroy_failing {
            f.destroy_failing = Some(
                c.last_destroy_error
                    .clone()
                    .unwrap_or_else(|| "(no detail)".into()),
            );
        }
    }
    if let Some(r) = last_run {
        let started = ts(&r["started_at"]);
        f.runs_began = match (f.runs_began, started) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if r["exit_code"].as_i64() == Some(0)
            && let Some(end) = ts(&r["finished_at"])
        {
            f.last_success = Some(f.last_success.map_or(end, |s| s.max(end)));
        }
    }
    if let Some(c) = cycle {
        f.cycle = Some((c.cycle_id.clone(), c.started_at));
        if f.destroy_failing.is_none()
            && let Some(e) = c.last_error.as_ref().filter(|_| c.destroy_failed())
        {
            f.destroy_failing = Some(e.clone());
        }
    }
    f
}

fn ago(secs: &Value) -> String {
    secs.as_u64()
        .map(|s| format!("{} ago", format_duration(Duration::from_secs(s))))
        .unwrap_or_else(|| "?".into())
}

/// Pure: the human-readable status, one line per item (control characters escaped).
pub fn text(doc: &Value) -> String {
    let mut o: Vec<String> = Vec::new();
    health_lines(&mut o, doc);
    cycle_lines(&mut o, doc);
    job_lines(&mut o, doc);
    backoff_lines(&mut o, doc);
    pool_lines(&mut o, doc);
    last_run_lines(&mut o, doc);
    event_lines(&mut o, doc);
    // Names, statuses and errors come from Forgejo (and tofu): every line is one line, with
    // their control characters escaped, so none can forge a line or drive the terminal.
    o.iter()
        .map(|l| crate::core::escape::escape_controls(l))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `--store pg`: every host of the pool, its lease and cycles, and the recent adoptions and
/// fenced runs.
fn pool_lines(o: &mut Vec<String>, doc: &Value) {
    let p = &doc["pool"];
    if p.is_null() {
        return;
    }
    let hosts = p["hosts"].as_array().cloned().unwrap_or_default();
    o.push(format!(
        "pool {} ({} host(s)):",
        str_of(&p["pool"]),
        hosts.len()
    ));
    for h in &hosts {
        let cycles: Vec<String> = h["cycles"]
            .as_array()
            .into_iter()
            .flatten()
            .map(str_of)
            .collect();
        o.push(format!(
            "  host {}: lease renewed {}s ago{}{}",
            str_of(&h["host_id"]),
            h["renewed_seconds_ago"].as_i64().unwrap_or(-1),
            if h["lapsed"].as_bool() == Some(true) {
                ", LAPSED"
            } else {
                ""
            },
            if cycles.is_empty() {
                String::new()
            } else {
                format!("; {}", cycles.join(", "))
            }
        ));
    }
    for e in p["events"].as_array().into_iter().flatten() {
        o.push(format!("  {}", str_of(e)));
    }
}

/// A string field as it is, `?` when it is missing or not a string.
fn str_of(v: &Value) -> String {
    v.as_str().unwrap_or("?").to_string()
}

/// The state directory and the warnings.
fn health_lines(o: &mut Vec<String>, doc: &Value) {
    o.push(format!("state directory: {}", str_of(&doc["state_dir"])));
    let warnings = doc["warnings"].as_array().cloned().unwrap_or_default();
    if warnings.is_empty() {
        o.push("health: ok".into());
    } else {
        o.push(format!("health: {} WARNING(S)", warnings.len()));
        for w in &warnings {
            o.push(format!("  WARNING: {}", str_of(w)));
        }
    }
}

/// The cycle in progress: its phase, registrations, VM outputs and last error.
fn cycle_lines(o: &mut Vec<String>, doc: &Value) {
    let c = &doc["cycle"];
    if let Some(e) = doc["cycle_error"].as_str() {
        o.push(format!("cycle: UNREADABLE: {e}"));
    } else if c.is_null() {
        o.push("cycle: none (at rest: no VM, no registration)".into());
    } else {
        o.push(format!(
            "cycle: {} phase {}, started {} ({}), {} job(s) started{}",
            str_of(&c["cycle_id"]),
            str_of(&c["phase"]),
            str_of(&c["started_at"]),
            ago(&doc["cycle_age_seconds"]),
            c["jobs_started"],
            if c["warm"] == true {
                " (a warm VM: started with no job)"
            } else {
                ""
            }
        ));
        for r in c["registrations"].as_array().into_iter().flatten() {
            o.push(format!(
                "  registration {} id {} job {} launch {}",
                str_of(&r["name"]),
                if r["id"].is_null() {
                    "unknown (POST unanswered)".into()
                } else {
                    r["id"].to_string()
                },
                r["job_id"],
                str_of(&r["launch"])
            ));
        }
        if let Some(outputs) = c["outputs"].as_object().filter(|o| !o.is_empty()) {
            let kv: Vec<String> = outputs
                .iter()
                .map(|(k, v)| {
                    format!(
                        "{k}={}",
                        v.as_str().map_or_else(|| v.to_string(), str::to_string)
                    )
                })
                .collect();
            o.push(format!("  VM outputs: {}", kv.join(" ")));
        }
        if let Some(reason) = c["teardown_reason"].as_str() {
            o.push(format!("  teardown: {reason}"));
        }
        if let Some(e) = c["last_error"].as_str() {
            o.push(format!("  last error: {e}"));
        }
    }
}

/// The held jobs and the pickup times (this slot's and the pool's).
fn job_lines(o: &mut Vec<String>, doc: &Value) {
    for h in doc["held_jobs"].as_array().into_iter().flatten() {
        o.push(format!(
            "held job {}: listed as waiting, but not given to our runner within --job-pickup-timeout; no runner for it before {} (hold {})",
            h["job_id"],
            str_of(&h["until"]),
            h["times"]
        ));
    }
    if let Some(line) = pickup_text(&doc["pickup"]) {
        o.push(format!("job pickup: {line}"));
    }
    if let Some(line) = pickup_text(&doc["pool_pickup"]["summary"]) {
        o.push(format!(
            "job pickup of the pool ({} slots): {line}",
            doc["pool_pickup"]["slots"]
        ));
    }
}

/// The failure backoff, when in force or counting.
fn backoff_lines(o: &mut Vec<String>, doc: &Value) {
    let b = &doc["backoff"];
    if !doc["backing_off"].is_null() {
        o.push(format!(
            "failure backoff: backing off since {} until {}, after {} failed cycle(s) in a row (the last: {})",
            str_of(&doc["backing_off"]["since"]),
            str_of(&doc["backing_off"]["until"]),
            doc["backing_off"]["failures"],
            str_of(&doc["backing_off"]["reason"])
        ));
    } else if b["consecutive_failed_cycles"]
        .as_u64()
        .is_some_and(|n| n > 0)
    {
        o.push(format!(
            "failure backoff: not in force; {} failed cycle(s) in a row (the last: {})",
            b["consecutive_failed_cycles"],
            str_of(&b["last_reason"])
        ));
    }
}

/// The last run, its first failures, and the last success.
fn last_run_lines(o: &mut Vec<String>, doc: &Value) {
    let r = &doc["last_run"];
    if let Some(e) = doc["last_run_error"].as_str() {
        o.push(format!("last run: UNREADABLE: {e}"));
    } else if r.is_null() {
        o.push("last run: none recorded".into());
    } else {
        o.push(format!(
            "last run: {} {} at {} ({}): {} (exit {})",
            str_of(&r["command"]),
            r["cycle_id"].as_str().unwrap_or("(no cycle)"),
            str_of(&r["finished_at"]),
            ago(&doc["last_run_age_seconds"]),
            str_of(&r["outcome"]),
            r["exit_code"]
        ));
        if let Some(line) = r["summary"]
            .is_object()
            .then(|| summary_line(&r["summary"]))
        {
            o.push(format!("  {line}"));
        }
        let failures = r["failures"].as_array().cloned().unwrap_or_default();
        for f in failures.iter().take(3) {
            o.push(format!("  error: {}", str_of(f)));
        }
        if failures.len() > 3 {
            o.push(format!("  … {} more in last-run.json", failures.len() - 3));
        }
    }
    match doc["last_success_at"].as_str() {
        Some(t) => o.push(format!(
            "last success: {t} ({})",
            ago(&doc["last_success_age_seconds"])
        )),
        None => o.push("last success: none recorded".into()),
    }
}

/// The audit trail's recent events, and what could not be read of it.
fn event_lines(o: &mut Vec<String>, doc: &Value) {
    if let Some(e) = doc["events_error"].as_str() {
        o.push(format!("events: UNREADABLE: {e}"));
    }
    if let Some(n) = doc["events_skipped"].as_u64().filter(|n| *n > 0) {
        o.push(format!(
            "events: {n} line(s) of the audit trail are not JSON objects (a torn or corrupt write): skipped"
        ));
    }
    let events = doc["events"].as_array().cloned().unwrap_or_default();
    if events.is_empty() {
        o.push("recent events: none".into());
    } else {
        o.push(format!("recent events (last {}):", events.len()));
        for e in &events {
            o.push(format!("  {}", event_text(e)));
        }
    }
}

/// `the last 12 job(s): p50 3.20s, p95 41.00s` from a `PickupSummary` as JSON.
fn pickup_text(v: &Value) -> Option<String> {
    let ms = |k: &str| v[k].as_u64().map(crate::core::report::seconds);
    Some(format!(
        "the last {} job(s): p50 {}, p95 {} (from the first sight of the job waiting to its runner active)",
        v["jobs"].as_u64()?,
        ms("p50_ms")?,
        ms("p95_ms")?
    ))
}

fn summary_line(v: &Value) -> String {
    match serde_json::from_value::<SummaryView>(v.clone()) {
        Ok(s) => s.line(),
        Err(_) => v.to_string(),
    }
}

/// The summary as last-run.json holds it.
#[derive(serde::Deserialize)]
struct SummaryView {
    #[serde(default)]
    vm_applied: u32,
    #[serde(default)]
    apply_failed: u32,
    #[serde(default)]
    vm_destroyed: u32,
    #[serde(default)]
    destroy_failed: u32,
    #[serde(default)]
    registered: u32,
    #[serde(default)]
    register_failed: u32,
    #[serde(default)]
    launched: u32,
    #[serde(default)]
    launch_failed: u32,
    #[serde(default)]
    consumed: u32,
    #[serde(default)]
    deleted: std::collections::BTreeMap<String, u32>,
    #[serde(default)]
    already_gone: u32,
    #[serde(default)]
    delete_failed: u32,
    #[serde(default)]
    held: u32,
}

impl SummaryView {
    fn line(self) -> String {
        crate::core::report::Summary {
            vm_applied: self.vm_applied,
            apply_failed: self.apply_failed,
            vm_destroyed: self.vm_destroyed,
            destroy_failed: self.destroy_failed,
            registered: self.registered,
            register_failed: self.register_failed,
            launched: self.launched,
            launch_failed: self.launch_failed,
            consumed: self.consumed,
            deleted: self.deleted,
            already_gone: self.already_gone,
            delete_failed: self.delete_failed,
            held: self.held,
        }
        .line()
    }
}

/// One audit record on one line.
pub fn event_text(e: &Value) -> String {
    let s = |k: &str| e[k].as_str().map(str::to_string);
    let mut line = format!(
        "{} {}",
        s("at").unwrap_or_else(|| "?".into()),
        s("cycle_id").unwrap_or_else(|| "-".into())
    );
    if s("kind").as_deref() == Some("failure") {
        line.push_str(&format!(
            " FAIL {}",
            crate::core::report::cut(&s("detail").unwrap_or_default(), TEXT_DETAIL)
        ));
        return line;
    }
    line.push_str(match (s("kind").as_deref(), e["ok"].as_bool()) {
        (Some("intent"), _) => " about to ",
        (_, Some(true)) => " ok   ",
        _ => " FAIL ",
    });
    line.push_str(&s("step").unwrap_or_else(|| "?".into()));
    if let Some(id) = e["runner_id"].as_i64() {
        line.push_str(&format!(" runner {id}"));
    }
    if let Some(n) = s("name") {
        line.push_str(&format!(" {n}"));
    }
    let why: Vec<String> = [
        s("reason"),
        s("status").map(|st| format!("seen {st}")),
        s("destroyed_cycle_id").map(|c| format!("after the destroy of {c}")),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !why.is_empty() {
        line.push_str(&format!(" ({})", why.join(", ")));
    }
    if let Some(d) = s("detail").filter(|d| !d.is_empty()) {
        line.push_str(&format!(": {}", crate::core::report::cut(&d, TEXT_DETAIL)));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const H: u64 = 3600;
    fn limits() -> Limits {
        Limits {
            max_success_age: Duration::from_secs(H),
            max_cycle_duration: Duration::from_secs(6 * H),
        }
    }
    fn t(secs: i64) -> Timestamp {
        Timestamp(secs * 1000)
    }

    #[test]
    fn healthy_when_a_recent_success_and_no_old_cycle() {
        let f = Facts {
            runs_began: Some(t(0)),
            last_success: Some(t(10_000)),
            cycle: Some(("c".into(), t(10_000))),
            ..Facts::default()
        };
        assert!(warnings(&f, &limits(), t(10_000 + H as i64)).is_empty());
    }

    #[test]
    fn each_condition_warns() {
        let now = t(100_000);
        let w = warnings(&Facts::default(), &limits(), now);
        assert!(w[0].contains("no run recorded"), "{w:?}");
        let f = Facts {
            runs_began: Some(t(1)),
            ..Facts::default()
        };
        assert!(warnings(&f, &limits(), now)[0].contains("no successful run since"));
        let f = Facts {
            runs_began: Some(t(1)),
            last_success: Some(t(100_000 - H as i64 - 1)),
            ..Facts::default()
        };
        assert!(warnings(&f, &limits(), now)[0].contains("--max-success-age 1h"));
        let f = Facts {
            runs_began: Some(t(1)),
            last_success: Some(now),
            destroy_failing: Some("tofu exited 1".into()),
            cycle: Some(("c7".into(), t(100_000 - 6 * H as i64 - 1))),
            unreadable: vec!["cycle.json is unreadable".into()],
            backoff: Some(crate::core::backoff::Closed {
                since: t(1),
                until: t(200_000),
                failures: 3,
                reason: Some(crate::core::backoff::FailureReason::ApplyFailed),
            }),
        };
        let w = warnings(&f, &limits(), now);
        assert_eq!(w.len(), 4, "{w:?}");
        assert!(w[1].contains("destroy failed") && w[1].contains("tofu exited 1"));
        assert!(w[2].contains("backing off since") && w[2].contains("tofu apply failed"));
        assert!(w[3].contains("cycle c7") && w[3].contains("--max-cycle-duration 6h"));
    }

    #[test]
    fn the_text_form_escapes_what_forgejo_said() {
        let forged = "ephemeral-x\n<3>forged\u{1b}[2J\r";
        let doc = json!({
            "state_dir": "/s",
            "warnings": [format!("w {forged}")],
            "last_run": {"command": "sweep", "failures": [format!("HTTP 500: {forged}")]},
            "events": [{"at": "t", "kind": "intent", "step": "delete_runner", "name": forged,
                        "status": forged}],
        });
        let t = text(&doc);
        assert!(!t.contains(['\x1b', '\r']), "{t:?}");
        assert!(t.lines().all(|l| !l.starts_with("<3>")), "{t}");
        assert!(t.contains("ephemeral-x\\n<3>forged\\u{1b}[2J\\r"), "{t}");
    }

    #[test]
    fn the_text_form_shows_the_pickup_percentiles() {
        let doc = json!({"state_dir": "/s", "events": [],
            "pickup": {"jobs": 3, "p50_ms": 2_500, "p95_ms": 40_000},
            "pool_pickup": {"slots": 2, "summary": {"jobs": 5, "p50_ms": 1_000, "p95_ms": 60_000}}});
        let t = text(&doc);
        assert!(
            t.contains("\njob pickup: the last 3 job(s): p50 2.50s, p95 40.00s ("),
            "{t}"
        );
        assert!(
            t.contains(
                "\njob pickup of the pool (2 slots): the last 5 job(s): p50 1.00s, p95 60.00s"
            ),
            "{t}"
        );
        let none =
            text(&json!({"state_dir": "/s", "events": [], "pickup": null, "pool_pickup": null}));
        assert!(!none.contains("job pickup"), "{none}");
    }

    #[test]
    fn the_text_form_counts_skipped_event_lines() {
        let doc = json!({"state_dir": "/s", "events": [], "events_skipped": 2});
        assert!(text(&doc).contains("events: 2 line(s) of the audit trail are not JSON objects"));
        let none = json!({"state_dir": "/s", "events": [], "events_skipped": 0});
        assert!(!text(&none).contains("not JSON objects"));
    }

    #[test]
    fn facts_fall_back_to_last_run_and_cycle_json() {
        let last = json!({"started_at": "2026-11-29T10:00:00Z", "finished_at": "2026-11-29T10:00:05Z", "exit_code": 0});
        let mut cycle = CycleState::new("c1".into(), t(5));
        cycle.last_error = Some("tofu destroy failed: boom".into());
        let f = facts(None, Some(&last), Some(&cycle), vec![]);
        assert_eq!(
            f.last_success,
            Some(Timestamp::parse_rfc3339("2026-11-29T10:00:05Z").unwrap())
        );
        assert!(f.runs_began.is_some());
        assert_eq!(
            f.destroy_failing.as_deref(),
            Some("tofu destroy failed: boom")
        );
        // counters.json alone says the last destroy failed (cycle.json gone or unreadable).
        let counters = Counters {
            first_run_at: Some(t(1)),
            destroy_failing: true,
            last_destroy_error: Some("tofu exited 1".into()),
            ..Counters::default()
        };
        let f = facts(Some(&counters), None, None, vec![]);
        assert_eq!(f.destroy_failing.as_deref(), Some("tofu exited 1"));
        assert_eq!(f.runs_began, Some(t(1)));
        let failed = json!({"started_at": "2026-11-29T10:00:00Z", "finished_at": "2026-11-29T10:00:05Z", "exit_code": 1});
        assert_eq!(facts(None, Some(&failed), None, vec![]).last_success, None);
    }

    /// `--store pg`: every host, its lease and cycles, a lapsed one marked, and the events.
    #[test]
    fn the_pool_is_shown_host_by_host() {
        let view = crate::core::pool::PoolView {
            pool: "debian".into(),
            hosts: vec![
                crate::core::pool::HostView {
                    host_id: "a".into(),
                    renewed_seconds_ago: 3,
                    lapsed: false,
                    cycles: vec!["slot 1: cycle c1".into()],
                },
                crate::core::pool::HostView {
                    host_id: "b".into(),
                    renewed_seconds_ago: 400,
                    lapsed: true,
                    cycles: vec![],
                },
            ],
            events: vec!["t host a adopted cycle c0 of host b".into()],
            backoff: None,
        };
        let doc = json!({"state_dir": "/s", "warnings": [], "cycle": null, "pool": view});
        let text = text(&doc);
        for want in [
            "pool debian (2 host(s)):",
            "  host a: lease renewed 3s ago; slot 1: cycle c1",
            "  host b: lease renewed 400s ago, LAPSED",
            "  t host a adopted cycle c0 of host b",
        ] {
            assert!(text.lines().any(|l| l == want), "{want:?} in:\n{text}");
        }
        assert_eq!(view_lapsed(&view), 0);
    }

    fn view_lapsed(v: &crate::core::pool::PoolView) -> u32 {
        v.lapsed_with_cycles()
    }
}
