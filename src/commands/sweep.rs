//! `sweep`: the offline registrations with our prefix, deleted when no cycle is in progress.

use crate::cli::SweepArgs;
use crate::commands::config::{check_fixture, check_metrics_file, check_prefix, sweep_min_age};
use crate::commands::exit::Fatal;
use crate::commands::wiring;
use crate::driver::cycle::End;
use crate::driver::sweep;

pub fn cmd_sweep(a: SweepArgs) -> Result<u8, Fatal> {
    let c = &a.common;
    check_prefix(&c.target.runner_prefix)?;
    check_fixture(&a.dry)?;
    check_metrics_file(c)?;
    let wiring::SweepRun {
        mut forgejo,
        mut store,
        clock,
        mut report,
        outlet,
        licence,
    } = wiring::sweep(&a)?;
    let licence = match licence {
        Ok(l) => l,
        Err(refusal) => {
            // Past the lock: kept in last-run.json, counted in the metrics, exit 1. The report
            // names the cycle in progress that is the reason.
            report.cycle_id = refusal.cycle_id;
            report.fail(refusal.message);
            report.outcome = crate::core::report::Outcome::Refused;
            return outlet.close(report, End::Done, c);
        }
    };
    sweep::sweep_into(
        &mut report,
        &mut *forgejo,
        &licence,
        &c.target.runner_prefix,
        c.target.sweep_max_deletions,
        sweep::Spare {
            now: clock.now(),
            min_age: sweep_min_age(a.grace.registration_grace, a.grace.launch_timeout, c),
            others: &mut || store.others(),
        },
    );
    report.outcome = if report.dry_run {
        // A dry sweep that could not list plans nothing: it failed, as a dry run that could not
        // read does.
        if report.sweep.as_ref().is_some_and(|s| s.error.is_some()) {
            crate::core::report::Outcome::Failed
        } else {
            crate::core::report::Outcome::WouldSweep
        }
    } else {
        crate::core::report::Outcome::Swept
    };
    outlet.close(report, End::Done, c)
}
