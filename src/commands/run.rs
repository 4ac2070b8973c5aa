//! `run`: one provisioner cycle (or its plan, for a dry-run), its report, metrics and audit trail.

use serde_json::Value;

use crate::adapters::clock::{RealClock, wall_now};

use crate::adapters::dry::{
    DryClock, DryForgejo, DryLauncher, DryTofu, Fixture, FixtureForgejo, MemoryStore, Plan,
};

use crate::adapters::files::{FileStore, read_state_file, take_lock};

use crate::adapters::launch_cmd::CommandLauncher;

use crate::adapters::logging::log_config;

use crate::adapters::signals::StopFlag;

use crate::adapters::tofu_cli::CliTofu;

use crate::cli::RunArgs;

use crate::commands::{
    EXIT_FAILED, EXIT_OK, Fatal, check_fixture, cycle_config, forgejo_target, http_forgejo, policy,
    read_token, state_dir, usage, validate_run_args,
};

use crate::core::ports::Clock;

use crate::core::planner::Policy;

use crate::core::ports::Forgejo;

use crate::core::report::Report;

use crate::driver::cycle;

use crate::commands::{announce_run, events_file, finish, metrics_target, print_plan};
use crate::driver::cycle::{End, World};

pub fn cmd_run(a: RunArgs) -> Result<u8, Fatal> {
    check_fixture(&a.common)?;
    let labels = validate_run_args(&a)?;
    let policy = policy(&a, &labels);

    if a.common.dry_run {
        log_config(&a, None, None);
        return dry_run(&a, policy, labels);
    }

    let (url, scope) = forgejo_target(&a.common)?;
    let token = read_token(&a.common.token_file)?;
    let dir = state_dir(&a.common.local.state_dir);
    log_config(&a, Some(&token), Some(&dir));
    let mut forgejo = http_forgejo(&a.common, &url, scope, &token, &policy.label_names)?;
    drop(token);
    let _lock = take_lock(&dir)?;
    let stop = StopFlag::install().map_err(|e| Fatal(EXIT_FAILED, format!("{e:#}")))?;

    let mut tofu = CliTofu {
        bin: a.tofu_bin.clone(),
        dir: a.tofu_dir.clone(),
        stop: stop.clone(),
    };
    let mut launcher = CommandLauncher {
        command: a.launch_command.clone(),
        timeout: a.launch_timeout,
        stop: stop.clone(),
    };
    let mut store = FileStore::new(&dir);
    let mut clock = RealClock::new(stop);
    let cfg = cycle_config(&a, policy, labels, url);
    let mut report = Report::new("run", false, clock.now());
    let report_clock = clock.clone();
    report.set_clock(Box::new(move || report_clock.now()));
    report.set_audit(events_file(&dir, &a.common));
    announce_run(&dir, metrics_target(&a.common), report.started_at);
    let mut world = World {
        forgejo: &mut forgejo,
        tofu: &mut tofu,
        launcher: &mut launcher,
        store: &mut store,
        clock: &mut clock,
    };
    let end = cycle::run(&mut world, &cfg, &mut report);
    finish(
        report,
        end,
        Some(&dir),
        a.common.local.output,
        metrics_target(&a.common),
    )
}

fn dry_run(a: &RunArgs, policy: Policy, labels: String) -> Result<u8, Fatal> {
    let plan: Plan = Plan::default();
    let mut tofu = DryTofu { plan: plan.clone() };
    let mut launcher = DryLauncher { plan: plan.clone() };
    let (inner, cycle, holds, now, url): (Box<dyn Forgejo>, _, _, _, String) =
        match &a.common.fixture {
            Some(path) => {
                let fx = Fixture::load(path).map_err(|e| usage(format!("{e:#}")))?;
                let inner = FixtureForgejo {
                    runners: fx.runners,
                    jobs: fx.jobs,
                    label_names: policy.label_names.clone(),
                };
                (
                    Box::new(inner),
                    fx.cycle,
                    crate::core::holds::Holds::default(),
                    fx.now.unwrap_or_else(wall_now),
                    "https://forgejo.invalid".into(),
                )
            }
            None => {
                let (url, scope) = forgejo_target(&a.common)?;
                let token = read_token(&a.common.token_file)?;
                let dir = state_dir(&a.common.local.state_dir);
                let cycle = read_state_file(&dir.join(crate::core::state::STATE_FILE))
                    .map_err(|e| Fatal(EXIT_FAILED, format!("{e:#}")))?;
                let holds = crate::adapters::files::read_holds_file(
                    &dir.join(crate::core::holds::HOLDS_FILE),
                )
                .map_err(|e| Fatal(EXIT_FAILED, format!("{e:#}")))?;
                let inner = http_forgejo(&a.common, &url, scope, &token, &policy.label_names)?;
                (Box::new(inner), cycle, holds, wall_now(), url)
            }
        };
    let mut forgejo = DryForgejo::new(inner, plan.clone());
    let mut store = MemoryStore {
        state: cycle,
        holds,
    };
    let mut clock = DryClock { now };
    let cfg = cycle_config(a, policy, labels, url);
    let mut report = Report::new("run", true, now);
    let mut world = World {
        forgejo: &mut forgejo,
        tofu: &mut tofu,
        launcher: &mut launcher,
        store: &mut store,
        clock: &mut clock,
    };
    let end = cycle::run(&mut world, &cfg, &mut report);
    if let End::Config(msg) = end {
        return Err(usage(msg));
    }
    let actions: Vec<Value> = plan.borrow().clone();
    print_plan(&actions, &report, a.common.local.output);
    // The plan's own failures (a hard-deadline teardown, say) are what the run would report;
    // the dry-run itself failed only when it could not read the world.
    Ok(if forgejo.read_errors == 0 {
        EXIT_OK
    } else {
        EXIT_FAILED
    })
}
