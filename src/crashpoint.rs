//! Test-only crash points, compiled into debug builds only: a `crash_point!` call at every step
//! boundary of a cycle. When `CI_EPHEMERAL_PROVISIONER_TEST_CRASH_AT=name[:nth]` names it, the
//! process SIGKILLs itself at the nth time it gets there (and, for a point given a child's pid, the
//! child's process group first, the way systemd kills a unit's cgroup). With
//! `CI_EPHEMERAL_PROVISIONER_TEST_CRASH_LOG=path`, every point reached is appended to `path`, so a
//! test can list the boundaries of a run and then kill it at each one.
//!
//! In a release build the macro expands to nothing: neither this module nor the names of its
//! variables or points are in the binary (`.ci/crash` checks the static release binary).

use std::io::Write;
use std::sync::atomic::{AtomicU32, Ordering};

pub const CRASH_AT_ENV: &str = "CI_EPHEMERAL_PROVISIONER_TEST_CRASH_AT";
pub const CRASH_LOG_ENV: &str = "CI_EPHEMERAL_PROVISIONER_TEST_CRASH_LOG";

/// Every crash point in the code, in the order a cycle reaches them. A unit test checks this list
/// against the `crash_point!` calls in `src/`, and the crash-point matrix (`tests/it/crash.rs`)
/// fails when one of them is never reached by its scenarios.
pub const POINTS: &[&str] = &[
    "process-child-spawned",
    "cycle-started-written",
    "apply-done-unsaved",
    "apply-running-written",
    "apply-failed-written",
    "register-intent-written",
    "register-failed-written",
    "register-post-answered",
    "register-id-written",
    "launch-started-written",
    "launch-returned",
    "launch-done-written",
    "launch-failed-written",
    "forget-written",
    "check-previous-written",
    "delete-answered",
    "delete-forgotten-written",
    "resolve-listed",
    "resolve-deleted",
    "resolve-forgotten-written",
    "teardown-written",
    "destroy-done-unsaved",
    "destroy-written",
    "sweep-listed",
    "sweep-deleted-one",
    "sweep-done",
    "finish-removed",
];

static HITS: AtomicU32 = AtomicU32::new(0);

/// Called by `crash_point!`; `group`: a child's process group to kill along with us.
pub fn hit(name: &str, group: Option<i32>) {
    debug_assert!(
        POINTS.contains(&name),
        "crash point {name} is not in POINTS"
    );
    if let Some(log) = std::env::var_os(CRASH_LOG_ENV)
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
    {
        let _ = writeln!(f, "{name}");
    }
    let Ok(spec) = std::env::var(CRASH_AT_ENV) else {
        return;
    };
    let (want, nth) = match spec.rsplit_once(':') {
        Some((n, k)) => (n, k.parse::<u32>().unwrap_or(1)),
        None => (spec.as_str(), 1),
    };
    if want != name || HITS.fetch_add(1, Ordering::SeqCst) + 1 != nth {
        return;
    }
    // SAFETY: kill(2) on a process group we created and on ourselves.
    unsafe {
        if let Some(g) = group {
            libc::kill(-g, libc::SIGKILL);
        }
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The list and the code agree: every `crash_point!` call names a listed point, exactly once,
    /// and every listed point is called somewhere.
    // Mutation caught: a crash_point! call missing from POINTS.
    #[test]
    fn points_list_matches_the_calls_in_the_source() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut called: Vec<String> = Vec::new();
        let mut stack = vec![src];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    let text = std::fs::read_to_string(&p).unwrap();
                    for part in text.split("crash_point!(\"").skip(1) {
                        called.push(part.split('"').next().unwrap().to_string());
                    }
                }
            }
        }
        let mut sorted = called.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            called.len(),
            "a point is called twice: {called:?}"
        );
        let mut listed: Vec<String> = POINTS.iter().map(|s| s.to_string()).collect();
        listed.sort();
        assert_eq!(sorted, listed, "crash_point! calls vs crashpoint::POINTS");
    }
}
