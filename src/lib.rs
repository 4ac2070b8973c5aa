//! ci-ephemeral-provisioner: one provisioner cycle of VM-isolated, ephemeral Forgejo Actions
//! runners per start.
//!
//! - `core`: everything that decides, and nothing that does I/O (a test holds it to that): the
//!   domain types, the deletion gate, the planner, the sweep's selection, reports, metrics and
//!   status as data, and every port the shell implements (`core::ports`).
//! - `adapters`: the ports' implementations: HTTP Forgejo, the tofu CLI, the launch command,
//!   processes and signals, files and the lock, the clock, logging, and the dry-run stand-ins.
//! - `driver`: runs the planner's steps through the ports and persists each (the cycle, the sweep).
//! - `commands`: one file per command, and the rooms they share: the configuration
//!   (`commands::config`), the recording of a run's outcome (`commands::record`), the exit
//!   statuses (`commands::exit`), and the one place that picks the implementations
//!   (`commands::wiring`).

/// A test-only crash point (see `crashpoint`); nothing at all in release builds.
#[macro_export]
macro_rules! crash_point {
    ($name:literal) => {
        #[cfg(debug_assertions)]
        $crate::crashpoint::hit($name, None);
    };
    ($name:literal, $group:expr) => {
        #[cfg(debug_assertions)]
        $crate::crashpoint::hit($name, Some($group));
    };
}

pub mod adapters;
pub mod cli;
pub mod commands;
pub mod core;
#[cfg(debug_assertions)]
pub mod crashpoint;
pub mod driver;
#[cfg(test)]
mod test_forgejo;
