//! How a command ends: its exit status, and the reason to stop before doing anything.

use crate::adapters::files::StateDirError;

pub const EXIT_OK: u8 = 0;

pub const EXIT_FAILED: u8 = 1;

pub const EXIT_USAGE: u8 = 2;

pub const EXIT_LOCKED: u8 = 75;

/// A reason to stop before doing anything, with its exit status.
pub struct Fatal(pub u8, pub String);

/// A usage error (exit 2): a flag or the environment is wrong.
pub(crate) fn usage(msg: impl Into<String>) -> Fatal {
    Fatal(EXIT_USAGE, msg.into())
}

/// Any other error before the run (exit 1), with its causes.
pub(crate) fn failed(e: anyhow::Error) -> Fatal {
    Fatal(EXIT_FAILED, format!("{e:#}"))
}

impl From<StateDirError> for Fatal {
    fn from(e: StateDirError) -> Fatal {
        match e {
            StateDirError::Unsafe(m) => Fatal(EXIT_USAGE, m),
            StateDirError::Locked(m) => Fatal(EXIT_LOCKED, m),
            StateDirError::Failed(m) => Fatal(EXIT_FAILED, m),
        }
    }
}
