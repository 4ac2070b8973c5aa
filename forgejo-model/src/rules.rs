//! Forgejo's own rules, once, for the model (`lib.rs`) and every shell over it: the library's
//! unit tests, the HTTP fake, the simulation's world and the benchmarks' server. Std only.
//!
//! Read from Forgejo v15.0.3 (`rohitkumarankam/forgejo`, tag `v15.0.3`, commit `f6d4219f`) and
//! forgejo-runner v12.8 (`ppaslan/runner` at `a811c1ac`):
//! - which job a runner is given: `models/actions/task.go` (`CreateTaskForRunner`,
//!   `GetAvailableJobsForRunner`, `getConcurrencyCondition`), `models/actions/run_job.go`
//!   (`ItRunsOn`, `IsRequestedByRunner`), `services/actions/task.go` (`PickTask`: an ephemeral
//!   runner that has a task is given no other);
//! - the labels a runner declares: forgejo-runner `internal/app/cmd/daemon.go` (`createRunner`
//!   sends `Declare(ls.Names())`), `internal/app/cmd/args.go` (`connectionFromArguments`: every
//!   `--label` parsed, one refused and the runner does not start), `internal/pkg/labels/labels.go`
//!   (`Parse`: the name is what comes before the first `:`; `parse_label` below);
//! - status: `models/actions/runner.go` (`RunnerOfflineTime`, `RunnerIdleTime`, `Status()`);
//! - clean-ups: `modules/setting/actions.go` (`ZOMBIE_TASK_TIMEOUT`, `ENDLESS_TASK_TIMEOUT`,
//!   `ABANDONED_JOB_TIMEOUT`, `CONCURRENCY_GROUP_QUEUE_ENABLED` true by default),
//!   `services/cron/tasks_actions.go` (`stop_zombie_tasks` `@every 5m`, `stop_endless_tasks`
//!   `@every 30m`, `cancel_abandoned_jobs` `@every 6h`, each also at start),
//!   `services/actions/task.go` `StopTask` (deletes an ephemeral runner; also on cancel,
//!   `services/actions/rerun.go` `cancelSingleJob`), `services/actions/clear_tasks.go`
//!   `CancelAbandonedJobs`;
//! - registration: `models/actions/runner.go` `CreateRunner` cuts the name with
//!   `modules/util/truncate.go` `SplitStringAtByteN(name, 255)`;
//! - paging: `modules/setting/api.go` (`DEFAULT_PAGING_NUM`, `MAX_RESPONSE_ITEMS`).

/// `RunnerOfflineTime`: offline once the last contact is older than this.
pub const OFFLINE_AFTER_MS: i64 = 60_000;
/// `RunnerIdleTime`: idle once the last task activity is older than this.
pub const IDLE_AFTER_MS: i64 = 10_000;
/// `[actions].ZOMBIE_TASK_TIMEOUT` and the `stop_zombie_tasks` cron interval.
pub const ZOMBIE_TASK_TIMEOUT_MS: i64 = 10 * 60_000;
pub const ZOMBIE_CRON_MS: i64 = 5 * 60_000;
/// `[actions].ENDLESS_TASK_TIMEOUT` and the `stop_endless_tasks` cron interval: a task running
/// longer is stopped and its ephemeral runner deleted, while the runner process may still run.
pub const ENDLESS_TASK_TIMEOUT_MS: i64 = 3 * 3_600_000;
pub const ENDLESS_CRON_MS: i64 = 30 * 60_000;
/// `[actions].ABANDONED_JOB_TIMEOUT` and the `cancel_abandoned_jobs` cron interval: a job still
/// `waiting` or `blocked` whose row was not updated for this long is cancelled (it has no task,
/// so no runner is touched).
pub const ABANDONED_JOB_TIMEOUT_MS: i64 = 24 * 3_600_000;
pub const ABANDONED_CRON_MS: i64 = 6 * 3_600_000;
/// `action_runner.name` is `VARCHAR(255)`; `CreateRunner` cuts a longer name to fit.
pub const RUNNER_NAME_MAX_BYTES: usize = 255;
/// `[api].DEFAULT_PAGING_NUM` and `[api].MAX_RESPONSE_ITEMS`.
pub const DEFAULT_PAGING_NUM: i64 = 30;
pub const MAX_RESPONSE_ITEMS: i64 = 50;
/// forgejo-runner's default `fetch_interval` (`internal/pkg/config/config.example.yaml`).
pub const FETCH_INTERVAL_MS: i64 = 2_000;

/// `ActionRunner.Status()`: `last_online`/`last_active` in Unix ms, 0 = never.
pub fn status(now: i64, last_online: i64, last_active: i64) -> &'static str {
    if last_online == 0 || now - last_online > OFFLINE_AFTER_MS {
        "offline"
    } else if now - last_active > IDLE_AFTER_MS {
        "idle"
    } else {
        "active"
    }
}

/// `util.SplitStringAtByteN(name, 255)` as `CreateRunner` applies it (`models/actions/runner.go`;
/// `modules/util/truncate.go`): a name of at most 255 bytes is kept; a longer one is cut to its
/// longest prefix of whole characters of at most 252 bytes, followed by "…" (3 bytes), and the
/// registration is created (201) under that name. (For bytes that are not UTF-8 Go cuts at 252
/// and appends "..."; a name sent as JSON is always UTF-8.)
pub fn stored_runner_name(name: &str) -> String {
    let n = RUNNER_NAME_MAX_BYTES;
    if name.len() <= n {
        return name.to_string();
    }
    let mut end = 0;
    for c in name.chars() {
        if end + c.len_utf8() > n - 3 {
            break;
        }
        end += c.len_utf8();
    }
    format!("{}…", &name[..end])
}

/// forgejo-runner's `labels.Label`: what one `--label` value means to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunnerLabel {
    pub name: String,
    pub schema: String,
    pub arg: String,
}

/// forgejo-runner's `labels.Parse` (`internal/pkg/labels/labels.go`), statement by statement:
/// `SplitN(label, ":", 3)`; a name that `TrimSpace` changes is refused; no scheme means `docker`;
/// `host` takes no argument, not even an empty one; an empty argument is `//node:22-bookworm`
/// for `docker`, `//debian:bookworm` for `lxc`, refused for `k8spod` and any other (plugin)
/// scheme. (Rust's `trim` and Go's `TrimSpace` strip the same characters, Unicode White_Space.)
/// It accepts what it accepts, an empty name included: the product refuses more
/// (`src/core/labels.rs`), never less.
pub fn parse_label(label: &str) -> Result<RunnerLabel, String> {
    let splits: Vec<&str> = label.splitn(3, ':').collect();
    let mut l = RunnerLabel {
        name: splits[0].to_string(),
        schema: "docker".to_string(),
        arg: String::new(),
    };
    if l.name.trim() != l.name {
        return Err(format!(
            "invalid label {:?}: starting or ending with a space is invalid",
            l.name
        ));
    }
    if splits.len() >= 2 {
        l.schema = splits[1].to_string();
    }
    if splits.len() >= 3 {
        if l.schema == "host" {
            return Err(format!("schema: {} does not have arguments", l.schema));
        }
        l.arg = splits[2].to_string();
    }
    if l.arg.is_empty() {
        match l.schema.as_str() {
            "docker" => l.arg = "//node:22-bookworm".to_string(),
            "lxc" => l.arg = "//debian:bookworm".to_string(),
            "k8spod" => {
                return Err(
                    "schema \"k8spod\" requires a podspec file path as argument".to_string()
                );
            }
            "host" => {}
            other => {
                return Err(format!(
                    "schema {other:?} requires an argument (e.g. \"mylabel:{other}://arg\")"
                ));
            }
        }
    }
    Ok(l)
}

/// The label names a runner started with one `--label` per entry of `RUNNER_LABELS`
/// (comma-separated, each entry whole, as the launch command passes them) declares
/// (`Labels.Names()`, sent by `Declare`, `internal/app/cmd/daemon.go`), or why it refuses to
/// start: `connectionFromArguments` (`internal/app/cmd/args.go`) parses every `--label` and
/// fails on the first that `parse_label` refuses (``malformed `label` …``). No entries at all
/// (an empty list): no `--label`, no names.
pub fn declared_names(labels: &str) -> Result<Vec<String>, String> {
    if labels.is_empty() {
        return Ok(Vec::new());
    }
    labels
        .split(',')
        .map(|l| {
            parse_label(l)
                .map(|p| p.name)
                .map_err(|e| format!("malformed `label` {l:?}: {e}"))
        })
        .collect()
}

/// `ActionRunJob.ItRunsOn`: false when the runner declared no labels or the job names none;
/// else every name in the job's `runs_on` must be one of the runner's label names.
pub fn it_runs_on<L: AsRef<str>, R: AsRef<str>>(runner_labels: &[L], runs_on: &[R]) -> bool {
    !runner_labels.is_empty()
        && !runs_on.is_empty()
        && runs_on
            .iter()
            .all(|r| runner_labels.iter().any(|l| l.as_ref() == r.as_ref()))
}

/// What the rule needs to know about the runner asking for a task.
#[derive(Clone, Copy, Debug)]
pub struct RunnerView<'a> {
    /// `owner_id`/`repo_id` of the registration (0/0: an instance runner).
    pub owner_id: i64,
    pub repo_id: i64,
    /// The label names it declared (none until it connected).
    pub labels: &'a [String],
    pub ephemeral: bool,
    /// It already has a task (an ephemeral runner is then given no other).
    pub has_task: bool,
    /// `one-job --handle`: only this job attempt.
    pub handle: Option<&'a str>,
}

/// What the rule needs to know about one job.
#[derive(Clone, Copy, Debug)]
pub struct JobView<'a> {
    pub status: &'a str,
    /// 0 until a task was created for it.
    pub task_id: i64,
    pub handle: &'a str,
    pub runs_on: &'a [String],
    pub owner_id: i64,
    pub repo_id: i64,
    /// Its run waits behind another run of its concurrency group
    /// (`CONCURRENCY_GROUP_QUEUE_ENABLED`): the REST jobs list still shows it `waiting`, but no
    /// runner is given it.
    pub queued_behind: bool,
}

/// `GetAvailableJobsForRunner`'s scope: a repo runner gets that repo's jobs, an owner's runner
/// the jobs of that owner's repositories, an instance runner every job.
pub fn in_scope(runner: &RunnerView<'_>, job: &JobView<'_>) -> bool {
    if runner.repo_id != 0 {
        job.repo_id == runner.repo_id
    } else if runner.owner_id != 0 {
        job.owner_id == runner.owner_id
    } else {
        true
    }
}

/// Whether Forgejo gives this job to this runner when it asks for a task (FetchTask, or
/// FetchSingleTask with a handle).
pub fn may_take(runner: &RunnerView<'_>, job: &JobView<'_>) -> bool {
    !(runner.ephemeral && runner.has_task)
        && job.status == "waiting"
        && job.task_id == 0
        && !job.queued_behind
        && in_scope(runner, job)
        && runner.handle.is_none_or(|h| h == job.handle)
        && it_runs_on(runner.labels, job.runs_on)
}

/// The job a runner is given: the first that `may_take` admits, in the order Forgejo reads
/// them (`updated, id`; the models have no `updated`, so the caller passes them by id).
pub fn pick<'a, T>(
    runner: &RunnerView<'_>,
    jobs: impl IntoIterator<Item = (T, JobView<'a>)>,
) -> Option<T> {
    jobs.into_iter()
        .find(|(_, j)| may_take(runner, j))
        .map(|(t, _)| t)
}

/// One case of the assignment rule; every model is tested against the whole table.
pub struct Case {
    pub what: &'static str,
    /// `--label` values the runner was started with (their names are declared).
    pub runner_labels: &'static [&'static str],
    /// The runner asks with the job's own handle (`Some(true)`), another job's handle
    /// (`Some(false)`), or none (`None`).
    pub with_handle: Option<bool>,
    /// The runner is registered in the job's repository (`true`) or another one (`false`);
    /// `None`: an instance runner.
    pub same_repo: Option<bool>,
    pub job_runs_on: &'static [&'static str],
    pub job_status: &'static str,
    pub queued_behind: bool,
    pub ephemeral_with_task: bool,
    pub taken: bool,
}

const fn case(
    what: &'static str,
    runner_labels: &'static [&'static str],
    job_runs_on: &'static [&'static str],
    taken: bool,
) -> Case {
    Case {
        what,
        runner_labels,
        with_handle: Some(true),
        same_repo: None,
        job_runs_on,
        job_status: "waiting",
        queued_behind: false,
        ephemeral_with_task: false,
        taken,
    }
}

pub const CASES: &[Case] = &[
    case("labels cover runs_on", &["debian:host"], &["debian"], true),
    case(
        "names only: the scheme does not count",
        &["debian:docker://node:22", "docker"],
        &["debian", "docker"],
        true,
    ),
    case(
        "more labels than needed",
        &["debian:host", "gpu:host"],
        &["debian"],
        true,
    ),
    case("no labels: no job at all", &[], &["debian"], false),
    case(
        "a label missing",
        &["debian:host"],
        &["debian", "docker"],
        false,
    ),
    case("other labels", &["gpu:host"], &["debian"], false),
    case(
        "a job without runs_on runs nowhere",
        &["debian:host"],
        &[],
        false,
    ),
    case(
        "the scheme is not a name",
        &["debian:host"],
        &["host"],
        false,
    ),
    Case {
        what: "another job's handle",
        with_handle: Some(false),
        ..case("", &["debian:host"], &["debian"], false)
    },
    Case {
        what: "no handle: any job it runs on",
        with_handle: None,
        ..case("", &["debian:host"], &["debian"], true)
    },
    Case {
        what: "queued behind its concurrency group: listed waiting, given to nobody",
        queued_behind: true,
        ..case("", &["debian:host"], &["debian"], false)
    },
    Case {
        what: "not waiting",
        job_status: "running",
        ..case("", &["debian:host"], &["debian"], false)
    },
    Case {
        what: "blocked (needs)",
        job_status: "blocked",
        ..case("", &["debian:host"], &["debian"], false)
    },
    Case {
        what: "an ephemeral runner that has a task gets no other",
        ephemeral_with_task: true,
        with_handle: None,
        ..case("", &["debian:host"], &["debian"], false)
    },
    Case {
        what: "a repo runner gets its repo's jobs",
        same_repo: Some(true),
        ..case("", &["debian:host"], &["debian"], true)
    },
    Case {
        what: "a repo runner gets no other repo's job",
        same_repo: Some(false),
        ..case("", &["debian:host"], &["debian"], false)
    },
];

/// Label names of a runner's `--label` values (each one `parse_label` takes).
pub fn names(labels: &[&str]) -> Vec<String> {
    declared_names(&labels.join(",")).unwrap_or_else(|e| panic!("{labels:?}: {e}"))
}

/// Checks `stored_runner_name` against Forgejo's `TestSplitStringAtByteN`-style cases: kept up
/// to 255 bytes, else whole characters up to 252 bytes and "…".
pub fn check_stored_runner_name() {
    let a255 = "a".repeat(255);
    assert_eq!(stored_runner_name(&a255), a255);
    let cut = stored_runner_name(&"a".repeat(256));
    assert_eq!(cut, format!("{}…", "a".repeat(252)));
    assert_eq!(cut.len(), 255);
    // A 2-byte character across byte 252 is dropped whole: 251 bytes and "…".
    let mixed = format!("{}é{}", "a".repeat(251), "b".repeat(10));
    assert_eq!(stored_runner_name(&mixed), format!("{}…", "a".repeat(251)));
}

/// Checks `may_take` itself against the table (each model runs the table through its own API).
pub fn check_rule_against_the_table() {
    for c in CASES {
        let labels = names(c.runner_labels);
        let runs_on: Vec<String> = c.job_runs_on.iter().map(|s| s.to_string()).collect();
        let runner = RunnerView {
            owner_id: 0,
            repo_id: match c.same_repo {
                None => 0,
                Some(true) => 7,
                Some(false) => 8,
            },
            labels: &labels,
            ephemeral: true,
            has_task: c.ephemeral_with_task,
            handle: match c.with_handle {
                None => None,
                Some(true) => Some("h-job"),
                Some(false) => Some("h-other"),
            },
        };
        let job = JobView {
            status: c.job_status,
            task_id: 0,
            handle: "h-job",
            runs_on: &runs_on,
            owner_id: 1,
            repo_id: 7,
            queued_behind: c.queued_behind,
        };
        assert_eq!(may_take(&runner, &job), c.taken, "{}", c.what);
    }
}
