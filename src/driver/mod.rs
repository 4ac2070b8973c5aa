//! Runs what the core decides: each step through the ports, each change persisted first.

pub mod canary;
pub mod cycle;
pub mod sweep;
