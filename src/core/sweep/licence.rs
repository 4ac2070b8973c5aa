//! The sweep's licence: the proof that no VM of ours can exist, without which no sweep runs.
//!
//! A registration is `offline` from birth, so "offline with our prefix" alone could be the
//! registration of a runner that is still booting. The sweep may delete such rows only when no
//! runner of ours can be behind them: this run's `tofu destroy` succeeded, or there is no cycle in
//! progress at all. [`SweepLicence`] carries that fact; `driver::sweep` requires it, and only this
//! module (through the planner and `without_cycle`) can make one.
//!
//! Mutation caught by the two doctests below: a `SweepLicence` made outside the core.
//!
//! ```compile_fail,E0451
//! // No licence out of thin air: its fields are private.
//! let forged = ci_ephemeral_provisioner::core::sweep::licence::SweepLicence {
//!     evidence: String::new(),
//!     destroyed_cycle_id: None,
//! };
//! ```
//!
//! ```compile_fail,E0624
//! // Nor from a cycle outside the core: only the planner says that this run's destroy succeeded.
//! use ci_ephemeral_provisioner::core::{sweep::licence::SweepLicence, state::CycleState, time::Timestamp};
//! let state = CycleState::new("c1".into(), Timestamp(0));
//! let forged = SweepLicence::after_destroy(&state);
//! ```
//!
//! `without_cycle` is the `sweep` command's: it states that cycle.json, read under the lock, holds
//! no cycle. It is visible to the crate only, and `tests/it/layering.rs` holds its one caller outside
//! the core to `commands::wiring`.

use anyhow::bail;
use serde::{Deserialize, Serialize};

use crate::core::state::CycleState;
use crate::core::time::Timestamp;

/// The last successful `tofu destroy` (kept in the counters): the evidence a standalone sweep
/// names.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DestroyRecord {
    pub cycle_id: Option<String>,
    pub at: Option<Timestamp>,
}

/// Why this sweep may run, and the words its deletions are recorded with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SweepLicence {
    evidence: String,
    destroyed_cycle_id: Option<String>,
}

impl SweepLicence {
    /// The planner's licence, right after this run's `tofu destroy` of `state`'s cycle
    /// succeeded (`RunContext::destroyed_this_run`): only the planner may say so.
    pub(in crate::core) fn after_destroy(state: &CycleState) -> SweepLicence {
        let at = state
            .destroyed_at
            .map(|t| t.to_string())
            .unwrap_or_default();
        SweepLicence {
            evidence: format!(
                "offline, name has our prefix, and tofu destroy of cycle {} succeeded at {at}",
                state.cycle_id
            ),
            destroyed_cycle_id: Some(state.cycle_id.clone()),
        }
    }

    /// What each deletion's event and audit line give as its evidence.
    pub fn evidence(&self) -> &str {
        &self.evidence
    }

    /// The cycle whose destroy licensed the sweep, when one did.
    pub fn destroyed_cycle_id(&self) -> Option<&str> {
        self.destroyed_cycle_id.as_deref()
    }
}

/// The `sweep` command's licence: no cycle.json (`cycle` is what it holds, read under the lock),
/// so no VM can exist. A cycle in progress refuses the sweep with the message to show; `path`
/// names the file. The last successful destroy, when known, is named in the evidence.
pub(crate) fn without_cycle(
    cycle: Option<&CycleState>,
    path: &str,
    last_destroy: Option<&DestroyRecord>,
) -> anyhow::Result<SweepLicence> {
    if let Some(s) = cycle {
        bail!(
            "cycle {} is in progress ({path}): a VM may still exist, so the sweep is refused; `run` sweeps after its destroy",
            s.cycle_id
        );
    }
    const NO_CYCLE: &str = "offline, name has our prefix, no cycle in progress (no cycle.json)";
    Ok(match last_destroy {
        Some(d) => SweepLicence {
            evidence: format!(
                "{NO_CYCLE}; last successful tofu destroy: cycle {} at {}",
                d.cycle_id.as_deref().unwrap_or("?"),
                d.at.map(|t| t.to_string()).unwrap_or_else(|| "?".into())
            ),
            destroyed_cycle_id: d.cycle_id.clone(),
        },
        None => SweepLicence {
            evidence: NO_CYCLE.into(),
            destroyed_cycle_id: None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cycle_in_progress_refuses_the_sweep() {
        let state = CycleState::new("c1".into(), Timestamp(0));
        let e = without_cycle(Some(&state), "/s/cycle.json", None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("cycle c1 is in progress (/s/cycle.json)"),
            "{e}"
        );
        let l = without_cycle(None, "/s/cycle.json", None).unwrap();
        assert_eq!(l.destroyed_cycle_id(), None);
        assert!(
            l.evidence().ends_with("(no cycle.json)"),
            "{}",
            l.evidence()
        );
    }

    #[test]
    fn the_evidence_names_the_destroy() {
        let mut state = CycleState::new("c1".into(), Timestamp(0));
        state.destroyed_at = Some(Timestamp(1_000));
        let l = SweepLicence::after_destroy(&state);
        assert_eq!(l.destroyed_cycle_id(), Some("c1"));
        assert!(
            l.evidence()
                .contains("tofu destroy of cycle c1 succeeded at 1970-01-01T00:00:01"),
            "{}",
            l.evidence()
        );
        let d = DestroyRecord {
            cycle_id: Some("c0".into()),
            at: Some(Timestamp(2_000)),
        };
        let l = without_cycle(None, "p", Some(&d)).unwrap();
        assert_eq!(l.destroyed_cycle_id(), Some("c0"));
        assert!(
            l.evidence()
                .contains("last successful tofu destroy: cycle c0 at")
        );
    }
}
