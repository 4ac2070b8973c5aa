//! `sweep`: the offline registrations with our prefix, deleted when no cycle is in progress.

use std::path::Path;

use serde_json::Value;

use crate::adapters::clock::{RealClock, wall_now};
use crate::adapters::dry::{DryForgejo, Fixture, FixtureForgejo, Plan};
use crate::adapters::files::{read_state_file, take_lock};
use crate::adapters::logging::log_config;
use crate::adapters::signals::StopFlag;
use crate::cli::SweepArgs;
use crate::commands::{
    EXIT_FAILED, EXIT_OK, Fatal, check_fixture, check_metrics_file, check_prefix, forgejo_target,
    http_forgejo, read_token, state_dir, usage,
};
use crate::commands::{announce_run, events_file, finish, metrics_target, print_plan};
use crate::core::licence::{SweepLicence, without_cycle};
use crate::core::metrics::DestroyRecord;
use crate::core::ports::Clock;
use crate::core::ports::Forgejo;
use crate::core::report::Report;
use crate::driver::cycle::End;
use crate::driver::sweep;

pub fn cmd_sweep(a: SweepArgs) -> Result<u8, Fatal> {
    let c = &a.common;
    check_prefix(&c.runner_prefix)?;
    check_fixture(c)?;
    check_metrics_file(c)?;
    if c.dry_run {
        log_config(&a, None, None);
        let plan: Plan = Plan::default();
        let (inner, licence): (Box<dyn Forgejo>, _) = match &c.fixture {
            Some(path) => {
                let fx = Fixture::load(path).map_err(|e| usage(format!("{e:#}")))?;
                let licence = without_cycle(fx.cycle.as_ref(), "fixture", None).map_err(|_| {
                    Fatal(
                        EXIT_FAILED,
                        "the fixture has a cycle in progress: a sweep is refused while a VM may exist".into(),
                    )
                })?;
                let inner = FixtureForgejo {
                    runners: fx.runners,
                    jobs: fx.jobs,
                    label_names: vec![],
                };
                (Box::new(inner), licence)
            }
            None => {
                let (url, scope) = forgejo_target(c)?;
                let token = read_token(&c.token_file)?;
                let licence = licence(&state_dir(&c.local.state_dir), None)?;
                (
                    Box::new(http_forgejo(c, &url, scope, &token, &[])?),
                    licence,
                )
            }
        };
        let mut f = DryForgejo::new(inner, plan.clone());
        let mut report = Report::new("sweep", true, wall_now());
        let sw = sweep::sweep(&mut f, &licence, &c.runner_prefix, c.sweep_max_deletions);
        for failure in crate::core::listing::sweep_failures(&sw) {
            report.fail(failure);
        }
        report.outcome = "would_sweep".into();
        report.sweep = Some(sw);
        let actions: Vec<Value> = plan.borrow().clone();
        print_plan(&actions, &report, c.local.output);
        return Ok(if f.read_errors == 0 {
            EXIT_OK
        } else {
            EXIT_FAILED
        });
    }
    let (url, scope) = forgejo_target(c)?;
    let token = read_token(&c.token_file)?;
    let dir = state_dir(&c.local.state_dir);
    log_config(&a, Some(&token), Some(&dir));
    let mut forgejo = http_forgejo(c, &url, scope, &token, &[])?;
    drop(token);
    let _lock = take_lock(&dir)?;
    let clock = RealClock::new(StopFlag::default());
    let mut report = Report::new("sweep", false, clock.now());
    report.set_clock(Box::new(move || clock.now()));
    report.set_audit(events_file(&dir, c));
    announce_run(&dir, metrics_target(c), report.started_at);
    // No cycle.json: no VM can exist. The last destroy that succeeded is named as well.
    let last_destroy = match crate::adapters::files::load_counters(&dir) {
        Ok(k) => k.last_destroy_ok,
        Err(e) => {
            log::warn!("{e:#}; the sweep's evidence cannot name the last successful destroy");
            None
        }
    };
    let licence = match licence(&dir, last_destroy.as_ref()) {
        Ok(l) => l,
        Err(Fatal(_, msg)) => {
            // Past the lock: kept in last-run.json, counted in the metrics, exit 1. The report
            // names the cycle in progress that is the reason.
            if let Ok(Some(s)) = read_state_file(&dir.join(crate::core::state::STATE_FILE)) {
                report.cycle_id = Some(s.cycle_id);
            }
            report.fail(msg);
            report.outcome = "refused".into();
            return finish(
                report,
                End::Done,
                Some(&dir),
                c.local.output,
                metrics_target(c),
            );
        }
    };
    let sw = sweep::sweep_with(
        &mut forgejo,
        &licence,
        &c.runner_prefix,
        c.sweep_max_deletions,
        &mut |r, result| report.sweep_deletion(r, result, &licence),
    );
    for failure in crate::core::listing::sweep_failures(&sw) {
        report.fail(failure);
    }
    report.outcome = "swept".into();
    report.sweep = Some(sw);
    finish(
        report,
        End::Done,
        Some(&dir),
        c.local.output,
        metrics_target(c),
    )
}

/// The sweep's licence from `dir`'s cycle.json: none may exist (`core::licence::without_cycle`).
fn licence(dir: &Path, last_destroy: Option<&DestroyRecord>) -> Result<SweepLicence, Fatal> {
    let path = dir.join(crate::core::state::STATE_FILE);
    match read_state_file(&path) {
        Ok(cycle) => without_cycle(cycle.as_ref(), &path.display().to_string(), last_destroy)
            .map_err(|msg| Fatal(EXIT_FAILED, msg)),
        Err(e) => Err(Fatal(EXIT_FAILED, format!("{e:#}; the sweep is refused"))),
    }
}
