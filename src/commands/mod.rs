//! The commands, one file each (`run`, `sweep`, `status`, `check` and its `canary`, `hook`), and the rooms they share:
//! `config` reads and checks the configuration, `record` records a run's outcome, `exit` holds
//! the exit statuses, `wiring` picks the implementations for live runs and dry-runs. Every item
//! lives in its room and is imported from there; this file only lists the rooms.

pub mod canary;
pub mod check;
pub mod config;
pub mod exit;
pub mod hook;
pub mod record;
pub mod run;
pub mod status;
pub mod sweep;
pub mod wiring;
