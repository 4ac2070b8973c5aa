//! Recording a run's outcome: the metrics file at its start and end, the counters
//! (`counters.json`), the audit trail, `last-run.json`, and what is printed (the report, or a
//! dry-run's plan).

use std::path::Path;

use anyhow::anyhow;
use serde_json::{Value, json};

use crate::adapters::events_file::EventsFile;
use crate::adapters::files::{
    load_counters, read_backoff_file, read_state_file, save_counters, write_atomic, write_textfile,
};
use crate::cli::{ForgejoArgs, OutputFormat};
use crate::commands::config::MetricsTarget;
use crate::commands::exit::Fatal;
use crate::core::backoff::{BACKOFF_FILE, Backoff};
use crate::core::escape::escape_controls;
use crate::core::metrics::{Counters, CycleView};
use crate::core::report::PoolReport;
use crate::core::report::{Outcome, Report};
use crate::core::state::{CycleState, STATE_FILE};
use crate::core::time::Timestamp;
use crate::driver::cycle::End;

/// The report of a slot's last run, in its directory.
pub const LAST_RUN_FILE: &str = "last-run.json";

/// The audit trail of a slot (`events.jsonl` in its directory, `--events-max-bytes`).
pub(crate) fn events_file(dir: &Path, common: &ForgejoArgs) -> Box<EventsFile> {
    Box::new(EventsFile::new(dir, common.events_max_bytes))
}

/// The metrics file at the start of a run: the counters so far, and that a run is in progress.
/// A failure here is only logged: the write at the end of the run reports it.
pub(crate) fn announce_run(dir: &Path, metrics: Option<MetricsTarget<'_>>, started: Timestamp) {
    if let Some(target) = metrics {
        rewrite_metrics(dir, &target, Some(started));
    }
}

/// The metrics file rewritten with the counters so far and the cycle cycle.json holds now
/// (`running`: a run in progress since then): at a run's start, and as `check --boot`'s VM
/// comes and goes. A failure is only logged.
pub(crate) fn rewrite_metrics(dir: &Path, target: &MetricsTarget<'_>, running: Option<Timestamp>) {
    let counters = load_counters(dir).unwrap_or_else(|e| {
        log::warn!("{e:#}; the metrics file shows the counters from zero until a run rewrites it");
        Counters::default()
    });
    if let Err(e) = write_metrics(dir, target, &counters, running, None) {
        log::warn!("--metrics-file: {e:#}");
    }
}

/// Renders the metrics (`started`: a run in progress since then) and writes the file.
/// `pool`: with `--store pg`, the run's cycle and the pool's backoff (neither is in the state
/// directory).
fn write_metrics(
    dir: &Path,
    target: &MetricsTarget<'_>,
    counters: &Counters,
    started: Option<Timestamp>,
    pool: Option<&PoolReport>,
) -> anyhow::Result<()> {
    let (cycle, backoff) = match pool {
        Some(p) => (Ok(p.cycle.clone()), p.view.backoff.clone()),
        None => (
            read_state_file(&dir.join(STATE_FILE)),
            pool_backoff(&target.pool),
        ),
    };
    let text = crate::core::metrics::render(
        counters,
        &cycle_view(&cycle),
        backoff.as_ref(),
        started,
        &target.labels,
    );
    write_textfile(target.path, &text)
}

/// The pool's failure backoff for the metrics; none when it cannot be read (the run that
/// needs it reports that).
fn pool_backoff(pool: &Path) -> Option<Backoff> {
    read_backoff_file(&pool.join(BACKOFF_FILE))
        .inspect_err(|e| log::warn!("{e:#}; the metrics file shows no failure backoff"))
        .ok()
}

fn cycle_view(cycle: &anyhow::Result<Option<CycleState>>) -> CycleView<'_> {
    match cycle {
        Ok(None) => CycleView::None,
        Ok(Some(s)) => CycleView::Active(s),
        Err(_) => CycleView::Unreadable,
    }
}

/// Adds the run to counters.json and writes the metrics file. A failure to write either is a
/// failure of the run (exit 1), reported like any other.
fn record_run(dir: &Path, metrics: Option<MetricsTarget<'_>>, report: &mut Report) {
    let before = match load_counters(dir) {
        Ok(c) => c,
        Err(e) => {
            log::warn!("{e:#}; the counters start again from zero");
            Counters::default()
        }
    };
    let mut counters = before.clone();
    counters.record(report);
    if let Some(target) = metrics
        && let Err(e) = write_metrics(dir, &target, &counters, None, report.pool.as_ref())
    {
        report.fail(format!("--metrics-file: {e:#}"));
        report.settle();
        counters = before.clone();
        counters.record(report);
    }
    if let Err(e) = save_counters(dir, &counters) {
        report.fail(format!("{e:#}"));
        report.settle();
    }
}

/// Keeps the report as last-run.json in `dir`; a failure to is a failure of the run.
fn keep_last_run(dir: &Path, report: &mut Report) {
    let path = dir.join(LAST_RUN_FILE);
    let written = serde_json::to_vec_pretty(&*report)
        .map_err(|e| anyhow!("cannot encode the report: {e}"))
        .and_then(|mut b| {
            b.push(b'\n');
            write_atomic(&path, &b)
        });
    if let Err(e) = written {
        report.fail(format!("cannot write {}: {e:#}", path.display()));
        report.settle();
    }
}

/// Sets the exit status, records the run (counters, metrics file), keeps the report as
/// last-run.json, prints it.
pub(crate) fn finish(
    mut report: Report,
    end: End,
    dir: Option<&Path>,
    output: OutputFormat,
    metrics: Option<MetricsTarget<'_>>,
) -> Result<u8, Fatal> {
    if let End::Config(msg) = end {
        // Kept in last-run.json too: `status` must show why runs stopped doing anything.
        report.fail(msg);
        report.outcome = Outcome::ConfigurationError;
    }
    let end_at = report.now();
    report.finished_at = Some(end_at);
    report.duration_ms = end_at.since(report.started_at).as_millis() as u64;
    report.settle();
    report.sync_audit();
    if let Some(dir) = dir {
        record_run(dir, metrics, &mut report);
        keep_last_run(dir, &mut report);
    }
    match output {
        OutputFormat::Json => println!(
            "{}",
            serde_json::to_string_pretty(&report)
                .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
        ),
        OutputFormat::Text => println!("{}", report.text()),
    }
    Ok(report.exit_code as u8)
}

/// Prints a dry-run's plan: what a live run would do, how it would end, and the errors the
/// dry-run met (each also logged on stderr as it happened).
pub(crate) fn print_plan(actions: &[Value], report: &Report, output: OutputFormat) {
    let failures = report.failures.len() as u64 + report.failures_not_listed;
    match output {
        OutputFormat::Json => {
            let doc = plan_json(actions, report);
            println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        }
        OutputFormat::Text => {
            let outcome = escape_controls(&report.outcome.to_string());
            if actions.is_empty() {
                println!("plan: {}", nothing_to_do(report, &outcome));
            } else {
                println!("plan ({} action(s)):", actions.len());
                for a in actions {
                    println!("  {}", escape_controls(&action_line(a)));
                }
                println!("then: {outcome}");
            }
            if report.outcome == Outcome::ConfigurationError
                && let Some(why) = report.failures.last()
            {
                println!("a live run stops here (exit 2): {}", escape_controls(why));
            } else if failures > 0 {
                println!("{failures} error(s), logged above");
            }
        }
    }
}

/// A dry-run's plan as one document: the actions, how it ends, how many errors it met
/// (`failures`, those past the report's list included) and the listed ones (`errors`).
fn plan_json(actions: &[Value], report: &Report) -> Value {
    json!({
        "actions": actions,
        "outcome": report.outcome,
        "failures": report.failures.len() as u64 + report.failures_not_listed,
        "errors": report.failures,
    })
}

/// An empty plan's line: a sweep says what it found to delete (nothing, and among what);
/// a run how it would end.
fn nothing_to_do(report: &Report, outcome: &str) -> String {
    match &report.sweep {
        Some(s) if s.error.is_some() => {
            format!("none: the dry-run could not list the registrations ({outcome})")
        }
        Some(s) if s.error.is_none() && s.found == 0 => format!(
            "nothing to delete ({} registration(s) listed, none of them ours, offline and old enough to sweep)",
            s.listed
        ),
        Some(s) if s.error.is_none() => format!(
            "nothing to delete ({} to sweep, all left over the cap, --sweep-max-deletions)",
            s.found
        ),
        None if report.outcome == Outcome::Failed => {
            format!("none: the dry-run could not read what it plans on ({outcome})")
        }
        _ => format!("nothing to do ({outcome})"),
    }
}

/// One action of a plan as a line: its name, then its fields, what it acts on first and why
/// last.
fn action_line(a: &Value) -> String {
    const ORDER: [&str; 5] = ["runner_id", "name", "job_id", "job_handle", "reason"];
    let mut line = a["action"].as_str().unwrap_or("?").to_string();
    if let Some(obj) = a.as_object() {
        let rank = |k: &str| {
            ORDER
                .iter()
                .position(|o| *o == k)
                .unwrap_or(ORDER.len() - 1)
        };
        let mut fields: Vec<_> = obj.iter().filter(|(k, _)| *k != "action").collect();
        fields.sort_by_key(|(k, _)| rank(k));
        for (k, v) in fields {
            let v = v
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string());
            line.push_str(&format!(" {k}={v}"));
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    // Mutation caught: `failures` printed as the list of messages (a script reading a number
    // breaks), or counting only the listed ones (a repeat, or one past the list, left out).
    #[test]
    fn a_plan_counts_every_failure_and_lists_the_distinct_ones() {
        let mut report = Report::new("run", true, Timestamp(0));
        report.fail("asking Forgejo for jobs failed");
        report.fail("asking Forgejo for jobs failed");
        report.fail("listing runners failed");
        let doc = plan_json(&[], &report);
        assert_eq!(doc["failures"], 3, "{doc}");
        assert_eq!(
            doc["errors"],
            json!(["asking Forgejo for jobs failed", "listing runners failed"]),
            "{doc}"
        );
        let none = plan_json(&[], &Report::new("run", true, Timestamp(0)));
        assert_eq!(none["failures"], 0, "{none}");
        assert_eq!(none["errors"], json!([]), "{none}");
    }
}
