//! The integration tests: one crate, so that they compile and link once. One module per suite
//! (`cargo test --test it -- cycle::` runs one); `support` is what they share. The simulation
//! (`tests/sim.rs`) and the role's end-to-end test (`tests/role_e2e.rs`) are crates of their own:
//! the one is built in release by `.ci/sim`, the other needs a booted container (`.ci/role`).
//!
//! The suites run on the threads of one process: a test changes no process-wide state (the
//! environment, the working directory); what it runs gets its environment per command.

mod support;

mod bad_input;
mod canary;
mod check;
mod crash;
mod crates;
mod cycle;
mod docs;
mod dry_run;
mod fake_forgejo_selftest;
mod hook;
mod hostile;
mod isolation;
mod layering;
mod observability;
mod pool;
mod properties;
mod remote;
mod reuse;
mod secrets;
mod slots;
mod store;
mod tls;
