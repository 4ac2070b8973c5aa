//! SIGTERM/SIGINT: the first one asks for a stop (forwarded once to the running child as SIGINT,
//! then the run persists and exits non-zero); a second one ends the process at once.
//! SIGHUP asks the run to end at its next wait (`ReloadFlag`), so that the next run, started
//! with the configuration of then, resumes the cycle.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};

#[derive(Clone, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    /// A flag that nothing but `raise` sets (tests, dry-runs).
    pub fn new() -> StopFlag {
        StopFlag::default()
    }

    /// Installs SIGTERM and SIGINT handlers that set the flag; a second signal exits with 1.
    pub fn install() -> Result<StopFlag> {
        let flag = StopFlag::new();
        for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
            signal_hook::flag::register_conditional_shutdown(sig, 1, Arc::clone(&flag.0))
                .context("cannot install a signal handler")?;
            signal_hook::flag::register(sig, Arc::clone(&flag.0))
                .context("cannot install a signal handler")?;
        }
        Ok(flag)
    }

    pub fn is_raised(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    pub fn raise(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Raised by SIGHUP: end the run at its next wait, cycle.json kept, exit 0. Nothing is cut short
/// and no child is signalled; the next run resumes the cycle with its own configuration.
#[derive(Clone, Default)]
pub struct ReloadFlag(Arc<AtomicBool>);

impl ReloadFlag {
    /// Installs the SIGHUP handler (without it, SIGHUP would end the process wherever it is).
    pub fn install() -> Result<ReloadFlag> {
        let flag = ReloadFlag::default();
        signal_hook::flag::register(signal_hook::consts::SIGHUP, Arc::clone(&flag.0))
            .context("cannot install the SIGHUP handler")?;
        Ok(flag)
    }

    pub fn is_raised(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}
