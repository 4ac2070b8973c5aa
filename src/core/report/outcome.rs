//! How a run ended: one value from which its exit status and its text follow.

use std::fmt;

use serde::{Serialize, Serializer};

/// How a run ended. Its text (`Display`) is what last-run.json, the report JSON and the log
/// lines say: `idle`, `cycle_finished`, `would_wait: <why>`, …
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing said how the run ended (the empty text).
    #[default]
    Unset,
    /// No waiting job to serve, nothing to do.
    Idle,
    /// The cycle ended: no VM, no registration left.
    CycleFinished,
    /// The run stopped on a failure, before the cycle could go on.
    Failed,
    /// A signal stopped the run; cycle.json is kept.
    Interrupted,
    /// A dry-run stopped where the cycle would wait on the outside world: why.
    WouldWait(String),
    /// SIGHUP ended the run at a wait.
    Reload,
    /// The pool's failure backoff kept the run from starting a VM.
    BackingOff,
    /// `tofu destroy` failed; cycle.json is kept for the retry.
    DestroyFailed,
    /// `sweep` refused: a cycle is in progress.
    Refused,
    /// `sweep` ran.
    Swept,
    /// `sweep --dry-run` ran.
    WouldSweep,
    /// A configuration problem ended the run (exit 2).
    ConfigurationError,
    /// `Swept`, with failures.
    SweepFailed,
    /// `CycleFinished`, with failures.
    CycleFinishedWithErrors,
    /// `Unset`, with failures.
    RunWithErrors,
    /// Another host adopted this run's cycle (its lease had lapsed): the run stopped before any
    /// further side effect (`--store pg`).
    Fenced,
}

impl Outcome {
    /// The exit status of a run that ended so: 2 for a configuration problem, else 1 when the
    /// run recorded any failure (`failed`), else 0.
    pub fn exit_code(&self, failed: bool) -> i32 {
        match self {
            Outcome::ConfigurationError => 2,
            _ if failed => 1,
            _ => 0,
        }
    }

    /// The outcome once the exit status is known: a sweep, a finished cycle or a run that said
    /// nothing, ended with failures, says so.
    pub fn settled(self, exit_code: i32) -> Outcome {
        match (self, exit_code) {
            (Outcome::Swept, 1) => Outcome::SweepFailed,
            (Outcome::CycleFinished, e) if e != 0 => Outcome::CycleFinishedWithErrors,
            (Outcome::Unset, e) if e != 0 => Outcome::RunWithErrors,
            (o, _) => o,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Outcome::Unset => "",
            Outcome::Idle => "idle",
            Outcome::CycleFinished => "cycle_finished",
            Outcome::Failed => "failed",
            Outcome::Interrupted => "interrupted",
            Outcome::WouldWait(_) => "would_wait",
            Outcome::Reload => "reload",
            Outcome::BackingOff => "backing_off",
            Outcome::DestroyFailed => "destroy_failed",
            Outcome::Refused => "refused",
            Outcome::Swept => "swept",
            Outcome::WouldSweep => "would_sweep",
            Outcome::ConfigurationError => "configuration_error",
            Outcome::SweepFailed => "sweep_failed",
            Outcome::CycleFinishedWithErrors => "cycle_finished_with_errors",
            Outcome::RunWithErrors => "run_with_errors",
            Outcome::Fenced => "fenced",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::WouldWait(why) => write!(f, "{}: {why}", self.name()),
            o => f.write_str(o.name()),
        }
    }
}

impl Serialize for Outcome {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// last-run.json, the report JSON and the log lines keep these texts.
    #[test]
    fn each_outcome_keeps_its_text() {
        let texts = [
            (Outcome::Unset, ""),
            (Outcome::Idle, "idle"),
            (Outcome::CycleFinished, "cycle_finished"),
            (Outcome::Failed, "failed"),
            (Outcome::Interrupted, "interrupted"),
            (
                Outcome::WouldWait("warm VM up, waiting for a job".into()),
                "would_wait: warm VM up, waiting for a job",
            ),
            (Outcome::Reload, "reload"),
            (Outcome::BackingOff, "backing_off"),
            (Outcome::DestroyFailed, "destroy_failed"),
            (Outcome::Refused, "refused"),
            (Outcome::Swept, "swept"),
            (Outcome::WouldSweep, "would_sweep"),
            (Outcome::ConfigurationError, "configuration_error"),
            (Outcome::SweepFailed, "sweep_failed"),
            (
                Outcome::CycleFinishedWithErrors,
                "cycle_finished_with_errors",
            ),
            (Outcome::RunWithErrors, "run_with_errors"),
            (Outcome::Fenced, "fenced"),
        ];
        for (o, text) in texts {
            assert_eq!(o.to_string(), text);
            assert_eq!(serde_json::to_value(&o).unwrap(), text);
        }
    }

    #[test]
    fn failures_rename_a_sweep_a_finished_cycle_and_a_silent_run_only() {
        assert_eq!(Outcome::Swept.settled(1), Outcome::SweepFailed);
        assert_eq!(Outcome::Swept.settled(0), Outcome::Swept);
        assert_eq!(
            Outcome::CycleFinished.settled(1),
            Outcome::CycleFinishedWithErrors
        );
        assert_eq!(Outcome::Unset.settled(1), Outcome::RunWithErrors);
        assert_eq!(Outcome::Unset.settled(0), Outcome::Unset);
        assert_eq!(Outcome::Idle.settled(1), Outcome::Idle);
        assert_eq!(Outcome::WouldSweep.settled(1), Outcome::WouldSweep);
        assert_eq!(Outcome::ConfigurationError.exit_code(true), 2);
        assert_eq!(Outcome::ConfigurationError.exit_code(false), 2);
        assert_eq!(Outcome::Idle.exit_code(true), 1);
        assert_eq!(Outcome::Idle.exit_code(false), 0);
    }
}
