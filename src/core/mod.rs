//! Everything that decides, and nothing that does I/O: no files, processes, network, environment,
//! threads, signals or clock (time comes in as an argument). `tests/it/layering.rs` holds it to that.
//! Its one way out is the `log` facade (the report logs each failure at error level); where the
//! lines go is `adapters::logging`'s choice.

pub mod backoff;
pub mod canary;
pub mod claims;
pub mod escape;
pub mod forgejo;
pub mod holds;
pub mod hook;
pub mod labels;
pub mod metrics;
pub mod planner;
pub mod pool;
pub mod ports;
pub mod report;
pub mod resolve;
pub mod secret;
pub mod slots;
pub mod state;
pub mod status;
pub mod sweep;
pub mod time;
pub mod wake;
pub mod warm;
