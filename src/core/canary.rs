//! The canary (`check --boot`): one VM of the pool's module, booted and probed by the launch
//! command (`RUNNER_ACTION=probe`), then destroyed. Its rules, without I/O: may it run beside
//! what the slot holds, and is the runner the probe found new enough.
//!
//! A canary is a cycle of its own (`CycleState::canary`), written before its apply like any
//! cycle: a canary killed half-way leaves a cycle.json that the next `run` (the planner's
//! `TeardownReason::Canary`) or the next `check --boot` tears down.

use crate::core::state::CycleState;

/// The oldest forgejo-runner the pool can use: 12.8 has `one-job --handle`, `--url`, `--uuid` and
/// `--token-url` (the launch contract, docs/design.md "Which runner gets which job").
pub const MIN_RUNNER: (u64, u64) = (12, 8);

/// What the canary does about what the slot's cycle.json holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Before {
    /// Nothing: the canary runs.
    Run,
    /// A canary that did not finish (killed): its VM is destroyed first, then the canary runs.
    DestroyLeftover { cycle_id: String },
    /// A cycle of the pool: the canary never runs beside it.
    Refuse { cycle_id: String },
}

/// The canary's decision about the slot's cycle.json (read under the slot's lock).
pub fn before(state: Option<&CycleState>) -> Before {
    match state {
        None => Before::Run,
        Some(s) if s.canary => Before::DestroyLeftover {
            cycle_id: s.cycle_id.clone(),
        },
        Some(s) => Before::Refuse {
            cycle_id: s.cycle_id.clone(),
        },
    }
}

/// A forgejo-runner release as its `--version` line names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RunnerVersion {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
}

impl std::fmt::Display for RunnerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The version in forgejo-runner's `--version` line: `forgejo-runner version v12.8.2` (cobra's
/// version template, `{{.Name}} version {{.Version}}`, with the release's version from
/// `internal/pkg/ver`; ppaslan/runner `internal/app/cmd/cmd.go`). Its last word, without a `v`;
/// a build suffix (`12.8.2-3-gabcdef`) is ignored. A build without a release version says `dev`:
/// no version.
pub fn parse_runner_version(line: &str) -> Option<RunnerVersion> {
    let word = line.split_whitespace().last()?;
    let v = word.strip_prefix('v').unwrap_or(word);
    let core = v.split(['-', '+']).next()?;
    let mut parts = core.split('.');
    let num = |p: Option<&str>| -> Option<u64> {
        let p = p?;
        (!p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            .then(|| p.parse().ok())
            .flatten()
    };
    let major = num(parts.next())?;
    let minor = num(parts.next())?;
    let patch = match parts.next() {
        None => 0,
        p => num(p)?,
    };
    if parts.next().is_some() {
        return None;
    }
    Some(RunnerVersion {
        major,
        minor,
        patch,
    })
}

/// The runner the probe found: usable (its version), or why not.
pub fn judge_runner(line: &str) -> Result<RunnerVersion, String> {
    let v = parse_runner_version(line).ok_or_else(|| {
        format!(
            "cannot tell the version of forgejo-runner from the probe's line {line:?}: install a release of forgejo-runner {}.{} or newer in the VM image",
            MIN_RUNNER.0, MIN_RUNNER.1
        )
    })?;
    if (v.major, v.minor) < MIN_RUNNER {
        return Err(format!(
            "forgejo-runner {v} on the VM is older than {}.{}, which the launch needs (one-job --handle): install a newer one in the VM image",
            MIN_RUNNER.0, MIN_RUNNER.1
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::time::Timestamp;

    #[test]
    fn versions_as_forgejo_runner_prints_them() {
        let v = |major, minor, patch| {
            Some(RunnerVersion {
                major,
                minor,
                patch,
            })
        };
        assert_eq!(
            parse_runner_version("forgejo-runner version v12.8.2"),
            v(12, 8, 2)
        );
        assert_eq!(
            parse_runner_version("forgejo-runner version 13.0"),
            v(13, 0, 0)
        );
        assert_eq!(
            parse_runner_version("forgejo-runner version v12.8.2-7-g0a1b2c3"),
            v(12, 8, 2)
        );
        for bad in [
            "forgejo-runner version dev",
            "",
            "v12",
            "v12.x.1",
            "v1.2.3.4",
            "v.8.2",
        ] {
            assert_eq!(parse_runner_version(bad), None, "{bad:?}");
        }
    }

    // Mutation caught: judge_runner accepting every parsed version (no 12.8 floor).
    #[test]
    fn a_runner_older_than_12_8_is_refused() {
        assert!(judge_runner("forgejo-runner version v12.8.0").is_ok());
        assert!(judge_runner("forgejo-runner version v13.0.1").is_ok());
        let e = judge_runner("forgejo-runner version v12.7.3").unwrap_err();
        assert!(e.contains("older than 12.8"), "{e}");
        assert!(judge_runner("forgejo-runner version v11.9.0").is_err());
        assert!(
            judge_runner("forgejo-runner version dev")
                .unwrap_err()
                .contains("cannot tell")
        );
    }

    // Mutation caught: `before` letting the canary run beside a cycle of the pool.
    #[test]
    fn the_canary_never_runs_beside_a_cycle() {
        let now = Timestamp::parse_rfc3339("2026-01-01T00:00:00Z").unwrap();
        assert_eq!(before(None), Before::Run);
        let cycle = CycleState::new("c-1".into(), now);
        assert_eq!(
            before(Some(&cycle)),
            Before::Refuse {
                cycle_id: "c-1".into()
            }
        );
        let mut canary = CycleState::new("c-2".into(), now);
        canary.canary = true;
        assert_eq!(
            before(Some(&canary)),
            Before::DestroyLeftover {
                cycle_id: "c-2".into()
            }
        );
    }
}
