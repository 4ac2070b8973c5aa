//! `run`: one provisioner cycle (or its plan, for a dry-run), its report, metrics and audit trail.

use crate::cli::RunCommand;
use crate::commands::config::{check_fixture, cycle_config, policy, pool_slot, validate_run_args};
use crate::commands::exit::Fatal;
use crate::commands::wiring;
use crate::driver::cycle;

pub fn cmd_run(RunCommand { args: a, dry }: RunCommand) -> Result<u8, Fatal> {
    check_fixture(&dry)?;
    let labels = validate_run_args(&a)?;
    let policy = policy(&a, &labels);
    let wiring::CycleRun {
        mut ports,
        mut report,
        outlet,
        forgejo_url,
    } = wiring::cycle(&a, &dry, &policy.label_names)?;
    let mut cfg = cycle_config(&a, policy, &labels, forgejo_url);
    if let Some(me) = pool_slot(&a.common.local, "")? {
        cfg.host = me.host;
    }
    let end = cycle::run(&mut ports.world(), &cfg, &mut report);
    outlet.close(report, end, &a.common)
}
