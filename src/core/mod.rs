//! Everything that decides, and nothing that does I/O: no files, processes, network, environment,
//! threads, signals or clock (time comes in as an argument). `tests/layering.rs` holds it to that.
//! Its one way out is the `log` facade (the report logs each failure at error level); where the
//! lines go is `adapters::logging`'s choice.

pub mod backoff;
pub mod escape;
pub mod holds;
pub mod labels;
pub mod licence;
pub mod listing;
pub mod metrics;
pub mod model;
pub mod planner;
pub mod ports;
pub mod report;
pub mod resolve;
pub mod secret;
pub mod slots;
pub mod state;
pub mod status;
pub mod time;
pub mod warm;
