//! The entry point: close what was inherited, refuse to be dumpable, parse the command line,
//! log, run one command.

use std::process::ExitCode;

use ci_ephemeral_provisioner::adapters::{logging, process, token};
use ci_ephemeral_provisioner::cli::{Cli, Command};
use ci_ephemeral_provisioner::commands;
use ci_ephemeral_provisioner::commands::exit::{EXIT_FAILED, Fatal};
use clap::Parser;

fn main() -> ExitCode {
    // First of all, before anything is opened: no child gets a descriptor we did not pass it.
    // (`hook` keeps the connection systemd passes it as fd 3, and starts no child.)
    if let Err(e) = process::close_inherited_fds_from(commands::hook::first_fd_to_close()) {
        eprintln!("error: {e:#}");
        return ExitCode::from(EXIT_FAILED);
    }
    // Before the token is read (see `forbid_dumping`).
    if let Err(e) = token::forbid_dumping() {
        eprintln!("error: {e:#}");
        return ExitCode::from(EXIT_FAILED);
    }
    let cli = Cli::parse();
    let (verbose, dry_run, sub) = cli.command.logging();
    logging::init_logging(verbose, dry_run);
    log::debug!(
        "ci-ephemeral-provisioner {} ({sub})",
        ci_ephemeral_provisioner::cli::VERSION
    );
    let result = match cli.command {
        Command::Run(a) => commands::run::cmd_run(a),
        Command::Sweep(a) => commands::sweep::cmd_sweep(a),
        Command::Status(a) => commands::status::cmd_status(a),
        Command::Check(a) => commands::check::cmd_check(a),
        Command::Hook(a) => commands::hook::cmd_hook(a),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(Fatal(code, msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(code)
        }
    }
}
