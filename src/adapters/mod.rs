//! The ports of `core::ports`, implemented against the world (and, in `dry`, against a plan).

pub mod clock;
pub mod dry;
pub mod events_file;
pub mod files;
pub mod forgejo_http;
pub mod hook;
pub mod launch_cmd;
pub mod logging;
pub mod pg_store;
pub mod process;
pub mod signals;
pub mod tofu_cli;
pub mod token;
