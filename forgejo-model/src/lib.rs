//! One model of Forgejo's server side for the tests: its runner and job rows, registration,
//! the runner list with its paging quirks, deletion, status, the assignment of tasks, the end
//! of a task and the clean-ups that stop tasks. A dev-only crate of the workspace, std only, that
//! knows nothing of the product: the library's unit tests (`src/test_forgejo.rs`), the HTTP fake
//! (`tests/it/support/fake_forgejo.rs`), the simulation's world (`tests/sim/world.rs`) and the
//! benchmarks' server (`benches/bench_forgejo.rs`) are shells over it: they bring the clock
//! (`now`, Unix ms, is an argument here), the wire, the runner processes, the faults, any
//! randomness (uuids, tokens and the order of tied rows are passed in) and the conversion to
//! the product's types. The rules themselves are in `rules.rs`, with the Forgejo v15.0.3 sources
//! they copy; what this file adds names its source where it is written.

use std::collections::BTreeMap;

pub mod rules;
pub mod webhook;

use rules::{JobView, RunnerView};

/// `version` a runner reports once it has connected (Declare).
pub const RUNNER_VERSION: &str = "12.8.2";

/// One `action_runner` row, and what the runner process does as Forgejo sees it (`polling`,
/// `busy`). `extra` is what a shell keeps with the row (who registered it, test state).
#[derive(Clone, Debug)]
pub struct RunnerRow<X> {
    pub id: i64,
    pub uuid: String,
    pub token: String,
    pub name: String,
    pub description: String,
    /// `owner_id`/`repo_id` of the registration (0/0: an instance runner).
    pub owner_id: i64,
    pub repo_id: i64,
    pub ephemeral: bool,
    /// "" until the runner has connected.
    pub version: String,
    /// The label names it declared (`Declare`, forgejo-runner `internal/app/cmd/daemon.go`
    /// `createRunner` sends `ls.Names()`); `None` until it connected (JSON `null`).
    pub labels: Option<Vec<String>>,
    /// Unix ms; 0 = never.
    pub last_online: i64,
    pub last_active: i64,
    /// When it declared its labels (not a Forgejo column: what the tests observe).
    pub declared_at: i64,
    /// The runner process polls: `last_online` is "now".
    pub polling: bool,
    /// The runner process runs a task and reports: `last_active` is "now".
    pub busy: bool,
    /// Soft-deleted (`DeleteRunner`): gone from list and get, its uuid rewritten.
    pub deleted: bool,
    pub extra: X,
}

impl<X> RunnerRow<X> {
    pub fn effective_last_online(&self, now: i64) -> i64 {
        if self.polling { now } else { self.last_online }
    }

    /// `ActionRunner.Status()` (`forgejo_rules::status`): `offline`, `idle` or `active`.
    pub fn status(&self, now: i64) -> &'static str {
        let last_active = if self.busy { now } else { self.last_active };
        rules::status(now, self.effective_last_online(now), last_active)
    }

    pub fn is_instance(&self) -> bool {
        self.owner_id == 0 && self.repo_id == 0
    }

    /// The runner's Declare RPC (Forgejo `routers/api/actions/runner/runner.go` `Declare`
    /// stores version and `AgentLabels`): these label names (`None`: those it had, or none),
    /// and it is online from now on.
    pub fn declare(&mut self, labels: Option<Vec<String>>, now: i64) {
        self.version = RUNNER_VERSION.to_string();
        let labels = labels.unwrap_or_else(|| self.labels.take().unwrap_or_default());
        self.labels = Some(labels);
        self.declared_at = now;
        self.polling = true;
        self.last_online = now;
    }

    /// The runner process stops sending RPCs: `last_online` (and, while it ran a task,
    /// `last_active`) stay at its last one, now.
    pub fn stops_polling(&mut self, now: i64) {
        self.polling = false;
        self.last_online = now;
        if self.busy {
            self.busy = false;
            self.last_active = now;
        }
    }
}

/// One `action_run_job` row (with its task's runner and start).
#[derive(Clone, Debug)]
pub struct JobRow {
    pub id: i64,
    pub attempt: i64,
    pub handle: String,
    pub repo_id: i64,
    pub owner_id: i64,
    pub name: String,
    pub runs_on: Vec<String>,
    /// 0 until a task was created for it.
    pub task_id: i64,
    /// `waiting`, `blocked` (its `needs`), `running`, or done (`success`, `failure`,
    /// `cancelled`, `skipped`).
    pub status: String,
    /// The runner its task was given to.
    pub runner_id: Option<i64>,
    /// Its run waits behind another of its concurrency group: listed `waiting`, given to nobody.
    pub queued_behind: bool,
    /// When its task started (Unix ms), for `stop_endless_tasks`.
    pub started: i64,
    /// When the row was last written (`Updated`, xorm's `updated` column: every `UpdateRunJob`),
    /// for `cancel_abandoned_jobs`.
    pub updated: i64,
    /// The runners that had a task of an earlier attempt (Forgejo keeps every attempt's task,
    /// so `HasTaskForRunner` still finds them after a rerun).
    pub earlier_runners: Vec<i64>,
}

impl JobRow {
    /// What the assignment rule reads of the job.
    pub fn view(&self) -> JobView<'_> {
        JobView {
            status: &self.status,
            task_id: self.task_id,
            handle: &self.handle,
            runs_on: &self.runs_on,
            owner_id: self.owner_id,
            repo_id: self.repo_id,
            queued_behind: self.queued_behind,
        }
    }

    /// Listed by the REST jobs search (`GetActionRunJobs`: waiting and running).
    pub fn is_listed(&self) -> bool {
        self.status == "waiting" || self.status == "running"
    }

    pub fn is_done(&self) -> bool {
        is_done(&self.status)
    }

    pub fn is_running(&self) -> bool {
        self.status == "running"
    }
}

/// A final job status (`Status.IsDone`, models/actions/status.go).
pub fn is_done(status: &str) -> bool {
    matches!(status, "success" | "failure" | "cancelled" | "skipped")
}

/// `convert.ToCorrectPageSize` (`services/convert/utils.go`): `limit` ≤ 0 is
/// `[api] DEFAULT_PAGING_NUM`, above `max` (`[api] MAX_RESPONSE_ITEMS`) it is `max`.
pub fn page_size_within(limit: i64, max: i64) -> i64 {
    match limit {
        l if l <= 0 => rules::DEFAULT_PAGING_NUM,
        l if l > max => max,
        l => l,
    }
}

/// Which rows an API route reads (`FindRunnerOptions`): the instance's (admin), an owner's (a
/// user or an organisation) or a repository's.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum ScopeKind {
    Admin,
    Owner,
    Repo,
}

/// The scope of an API route: `(owner_id, repo_id)` as in `FindRunnerOptions`.
#[derive(Clone, Copy, Debug)]
pub struct Scope {
    pub kind: ScopeKind,
    pub owner_id: i64,
    pub repo_id: i64,
    /// For a repo scope: the owner id of the repo, for `visible=true`.
    pub repo_owner_id: i64,
}

impl Scope {
    /// `/api/v1/admin/actions/runners`.
    pub const ADMIN: Scope = Scope {
        kind: ScopeKind::Admin,
        owner_id: 0,
        repo_id: 0,
        repo_owner_id: 0,
    };

    /// `FindRunnerOptions.ToConds` (`models/actions/runner.go`) for the list endpoint: the
    /// admin list without `visible` shows instance runners only.
    pub fn lists<X>(&self, r: &RunnerRow<X>, visible: bool) -> bool {
        match self.kind {
            ScopeKind::Admin => visible || r.is_instance(),
            ScopeKind::Owner => r.owner_id == self.owner_id || (visible && r.is_instance()),
            ScopeKind::Repo => {
                r.repo_id == self.repo_id
                    || (visible
                        && (r.is_instance()
                            || (r.repo_id == 0 && r.owner_id == self.repo_owner_id)))
            }
        }
    }

    /// `GetVisibleRunnerByID`.
    pub fn sees<X>(&self, r: &RunnerRow<X>) -> bool {
        match self.kind {
            ScopeKind::Admin => true,
            ScopeKind::Owner => r.owner_id == self.owner_id || r.is_instance(),
            ScopeKind::Repo => {
                r.repo_id == self.repo_id
                    || r.is_instance()
                    || (r.repo_id == 0 && r.owner_id == self.repo_owner_id)
            }
        }
    }

    /// `ActionRunner.Editable`: whether this scope may delete the runner.
    pub fn edits<X>(&self, r: &RunnerRow<X>) -> bool {
        match self.kind {
            ScopeKind::Admin => true,
            ScopeKind::Owner => r.owner_id == self.owner_id && r.repo_id == 0,
            ScopeKind::Repo => r.repo_id == self.repo_id,
        }
    }

    /// The jobs the scope's jobs search shows.
    pub fn has_job(&self, j: &JobRow) -> bool {
        match self.kind {
            ScopeKind::Admin => true,
            ScopeKind::Owner => j.owner_id == self.owner_id,
            ScopeKind::Repo => j.repo_id == self.repo_id,
        }
    }
}

/// A key for rows that tie in the runner list (`ToOrders` sorts by `last_online` alone): the
/// same while no row is added or deleted (as one database plan would give), shuffled by every
/// insert and delete (`rows_version`), so pages read across a change overlap or skip rows as they
/// can on Forgejo. `seed` varies the order between worlds (splitmix64's finalizer).
pub fn tie_key(id: i64, rows_version: u64, seed: u64) -> u64 {
    let mut x = id as u64 ^ seed ^ rows_version.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Forgejo's runner and job tables.
#[derive(Clone, Debug)]
pub struct Forgejo<X> {
    pub runners: BTreeMap<i64, RunnerRow<X>>,
    pub jobs: BTreeMap<i64, JobRow>,
    next_runner_id: i64,
    next_job_id: i64,
    next_task_id: i64,
    /// Bumped whenever a runner row is added or deleted: rows that tie on `last_online` are
    /// listed in an order that may depend on it (see `list_runners`).
    rows_version: u64,
    /// `[api] MAX_RESPONSE_ITEMS` of this instance: 50 unless its app.ini says otherwise
    /// (`modules/setting/api.go` maps the whole `[api]` section).
    pub max_response_items: i64,
    /// The users, organizations and repositories the routes of a scope name (see `Accounts`).
    pub accounts: Accounts,
}

impl<X> Default for Forgejo<X> {
    fn default() -> Self {
        Forgejo {
            runners: BTreeMap::new(),
            jobs: BTreeMap::new(),
            next_runner_id: 1,
            next_job_id: 1,
            next_task_id: 1,
            rows_version: 0,
            max_response_items: rules::MAX_RESPONSE_ITEMS,
            accounts: Accounts::default(),
        }
    }
}

/// A registration as `CreateRunner` stores it.
pub struct NewRunner<'a, X> {
    /// `None`: the next id.
    pub id: Option<i64>,
    pub uuid: String,
    pub token: String,
    pub name: &'a str,
    pub description: &'a str,
    pub owner_id: i64,
    pub repo_id: i64,
    pub ephemeral: bool,
    pub extra: X,
}

impl<X> Forgejo<X> {
    pub fn next_runner_id(&self) -> i64 {
        self.next_runner_id
    }

    pub fn next_job_id(&self) -> i64 {
        self.next_job_id
    }

    pub fn rows_version(&self) -> u64 {
        self.rows_version
    }

    /// The page size a `limit` gets here (`page_size_within` this instance's maximum).
    pub fn page_size(&self, limit: i64) -> i64 {
        page_size_within(limit, self.max_response_items)
    }

    pub fn live(&self, id: i64) -> Option<&RunnerRow<X>> {
        self.runners.get(&id).filter(|r| !r.deleted)
    }

    pub fn live_mut(&mut self, id: i64) -> Option<&mut RunnerRow<X>> {
        self.runners.get_mut(&id).filter(|r| !r.deleted)
    }

    // -- runner rows ------------------------------------------------------------------------------

    /// `RegisterRunner`/`CreateRunner`: a row that never connected (offline, no version, labels
    /// `null`), its name cut to 255 bytes (`forgejo_rules::stored_runner_name`). Returns its id.
    pub fn register(&mut self, new: NewRunner<'_, X>) -> i64 {
        let id = new.id.unwrap_or(self.next_runner_id);
        assert!(
            !self.runners.contains_key(&id),
            "forgejo model: runner id {id} already exists"
        );
        self.next_runner_id = self.next_runner_id.max(id + 1);
        self.rows_version += 1;
        self.runners.insert(
            id,
            RunnerRow {
                id,
                uuid: new.uuid,
                token: new.token,
                name: rules::stored_runner_name(new.name),
                description: new.description.to_string(),
                owner_id: new.owner_id,
                repo_id: new.repo_id,
                ephemeral: new.ephemeral,
                version: String::new(),
                labels: None,
                last_online: 0,
                last_active: 0,
                declared_at: 0,
                polling: false,
                busy: false,
                deleted: false,
                extra: new.extra,
            },
        );
        id
    }

    /// `DeleteRunner` (`models/actions/runner.go`), by the API or by Forgejo itself: a soft
    /// delete; the uuid becomes `ffffffff-ffff-ffff-` and the id's 8 little-endian bytes, so the
    /// runner can no longer authenticate. A process of it may keep running: its RPCs fail.
    pub fn delete(&mut self, id: i64, now: i64) {
        self.rows_version += 1;
        if let Some(r) = self.runners.get_mut(&id) {
            r.deleted = true;
            if r.busy {
                r.last_active = now;
            }
            r.polling = false;
            r.busy = false;
            let b = (id as u64).to_le_bytes();
            let hex: String = b.iter().map(|b| format!("{b:02x}")).collect();
            r.uuid = format!("ffffffff-ffff-ffff-{}-{}", &hex[0..4], &hex[4..16]);
        }
    }

    /// `FindRunnerOptions` + `ToOrders` + `db.FindAndCount`: the live rows the scope lists,
    /// `last_online DESC`, and their total. Rows that tie (every never-connected one has 0) come
    /// in no promised order: `tie(id, rows_version)` gives each its key, called once per row in id
    /// order. `limit` is clamped (`page_size`); `page` ≤ 0 is every row (`models/db/list.go`
    /// pages only from page 1).
    pub fn list_runners(
        &self,
        now: i64,
        scope: &Scope,
        visible: bool,
        page: i64,
        limit: i64,
        tie: impl FnMut(i64, u64) -> u64,
    ) -> (Vec<&RunnerRow<X>>, usize) {
        let order = self.runner_order(now, scope, visible, tie);
        let total = order.len();
        let shown = self
            .page_of(&order, page, limit)
            .iter()
            .filter_map(|id| self.runners.get(id))
            .collect();
        (shown, total)
    }

    /// The ids of the rows the scope lists, in the list's order (`list_runners`, every page).
    /// The same while no row is added or deleted and no row's `last_online` changes (a polling
    /// row is "now", ahead of every other): a caller may keep it that long.
    pub fn runner_order(
        &self,
        now: i64,
        scope: &Scope,
        visible: bool,
        mut tie: impl FnMut(i64, u64) -> u64,
    ) -> Vec<i64> {
        let mut rows: Vec<(i64, u64, i64)> = self
            .runners
            .values()
            .filter(|r| !r.deleted && scope.lists(r, visible))
            .map(|r| {
                (
                    r.effective_last_online(now),
                    tie(r.id, self.rows_version),
                    r.id,
                )
            })
            .collect();
        rows.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        rows.into_iter().map(|t| t.2).collect()
    }

    /// Page `page` (from 1; ≤ 0: all of it) of `limit` (clamped, `page_size`) of a list order.
    pub fn page_of<'o>(&self, order: &'o [i64], page: i64, limit: i64) -> &'o [i64] {
        if page < 1 {
            return order;
        }
        let limit = self.page_size(limit) as usize;
        let start = ((page as usize - 1).saturating_mul(limit)).min(order.len());
        &order[start..(start + limit).min(order.len())]
    }

    // -- job rows ---------------------------------------------------------------------------------

    /// A waiting job (attempt 1, named `job-{id}`), written at `now`. Returns its id.
    pub fn add_job(
        &mut self,
        handle: String,
        runs_on: Vec<String>,
        owner_id: i64,
        repo_id: i64,
        now: i64,
    ) -> i64 {
        let id = self.next_job_id;
        self.next_job_id += 1;
        self.jobs.insert(
            id,
            JobRow {
                id,
                attempt: 1,
                handle,
                repo_id,
                owner_id,
                name: format!("job-{id}"),
                runs_on,
                task_id: 0,
                status: "waiting".to_string(),
                runner_id: None,
                queued_behind: false,
                started: 0,
                updated: now,
                earlier_runners: Vec::new(),
            },
        );
        id
    }

    /// `RerunJob` of a done job (`services/actions/rerun.go` → `rerunSingleJob` →
    /// `ActionRunJob.PrepareNextAttempt`, `models/actions/run_job.go`): `attempt + 1`, a new
    /// `handle`, `task_id` 0, `waiting` (the job that is rerun is never `blocked`, even with
    /// `needs`). A job that is not done cannot be rerun (`ErrRerunJobStillRunning`): false.
    /// The task of the attempt before stays: its runner still "had a task".
    pub fn rerun_job(&mut self, job: i64, handle: String, now: i64) -> bool {
        let Some(j) = self.jobs.get_mut(&job).filter(|j| j.is_done()) else {
            return false;
        };
        j.attempt += 1;
        j.handle = handle;
        j.task_id = 0;
        j.status = "waiting".to_string();
        if let Some(r) = j.runner_id.take() {
            j.earlier_runners.push(r);
        }
        j.started = 0;
        j.queued_behind = false;
        j.updated = now;
        true
    }

    /// `CancelAbandonedJobs` (`services/actions/clear_tasks.go`): the jobs still `waiting` or
    /// `blocked` whose row was not updated for `timeout` ms (`ABANDONED_JOB_TIMEOUT`, 24 h),
    /// however long they were listed, end `cancelled`. They have no task: no runner is touched.
    /// Returns them, id ascending.
    pub fn cancel_abandoned_jobs(&mut self, now: i64, timeout: i64) -> Vec<i64> {
        let abandoned: Vec<i64> = self
            .jobs
            .values()
            .filter(|j| matches!(j.status.as_str(), "waiting" | "blocked"))
            .filter(|j| j.updated < now - timeout)
            .map(|j| j.id)
            .collect();
        for id in &abandoned {
            if let Some(j) = self.jobs.get_mut(id) {
                j.status = "cancelled".to_string();
                j.updated = now;
            }
        }
        abandoned
    }

    /// `GetActionRunJobs` (`routers/api/v1/shared/action.go`): waiting and running jobs of the
    /// scope, id DESC; `labels` `None`: any; empty: jobs without `runs_on`; else those
    /// the names run (`ItRunsOn`). A job queued behind its concurrency group is listed all the
    /// same.
    pub fn list_jobs<L: AsRef<str>>(&self, scope: &Scope, labels: Option<&[L]>) -> Vec<&JobRow> {
        self.jobs
            .values()
            .rev()
            .filter(|j| j.is_listed() && scope.has_job(j))
            .filter(|j| match labels {
                None => true,
                Some([]) => j.runs_on.is_empty(),
                Some(ls) => rules::it_runs_on(ls, &j.runs_on),
            })
            .collect()
    }

    /// The job its concurrency group held back may be given out now (a done one stays done).
    /// False when it was not held.
    pub fn release(&mut self, job: i64) -> bool {
        match self.jobs.get_mut(&job) {
            Some(j) if j.queued_behind && !j.is_done() => {
                j.queued_behind = false;
                true
            }
            _ => false,
        }
    }

    // -- tasks ------------------------------------------------------------------------------------

    /// `HasTaskForRunner`: a task was ever created for this runner.
    pub fn has_had_task(&self, runner: i64) -> bool {
        self.jobs
            .values()
            .any(|j| j.runner_id == Some(runner) || j.earlier_runners.contains(&runner))
    }

    /// What the assignment rule reads of the runner, asking with `handle`.
    pub fn runner_view<'a>(&self, r: &'a RunnerRow<X>, handle: Option<&'a str>) -> RunnerView<'a> {
        RunnerView {
            owner_id: r.owner_id,
            repo_id: r.repo_id,
            labels: r.labels.as_deref().unwrap_or(&[]),
            ephemeral: r.ephemeral,
            has_task: self.has_had_task(r.id),
            handle,
        }
    }

    /// Whether Forgejo would give this job to this runner (`forgejo_rules::may_take`).
    pub fn may_take(&self, runner: i64, job: i64, handle: Option<&str>) -> bool {
        match (self.live(runner), self.jobs.get(&job)) {
            (Some(r), Some(j)) => rules::may_take(&self.runner_view(r, handle), &j.view()),
            _ => false,
        }
    }

    /// The job Forgejo gives this live runner when it asks for a task (FetchTask;
    /// FetchSingleTask with `handle`): `forgejo_rules::pick` over the jobs by id.
    pub fn task_for(&self, runner: i64, handle: Option<&str>) -> Option<i64> {
        let r = self.live(runner)?;
        let view = self.runner_view(r, handle);
        rules::pick(&view, self.jobs.values().map(|j| (j.id, j.view())))
    }

    /// `CreateTaskForRunner`: the job runs on the runner from now; its task id.
    pub fn start_task(&mut self, job: i64, runner: i64, now: i64) -> i64 {
        let task_id = self.next_task_id;
        self.next_task_id += 1;
        if let Some(j) = self.jobs.get_mut(&job) {
            j.status = "running".to_string();
            j.task_id = task_id;
            j.runner_id = Some(runner);
            j.started = now;
            j.updated = now;
        }
        if let Some(r) = self.runners.get_mut(&runner) {
            r.busy = true;
            r.last_active = now;
        }
        task_id
    }

    /// The running job of this runner's task.
    pub fn running_job_of(&self, runner: i64) -> Option<i64> {
        self.jobs
            .values()
            .find(|j| j.runner_id == Some(runner) && j.is_running())
            .map(|j| j.id)
    }

    /// The final UpdateTask of the job's task (`routers/api/actions/runner/runner.go`
    /// `UpdateTask`): the job succeeds, the runner is done with it, and an ephemeral runner is
    /// deleted. Returns the deleted runner.
    pub fn final_update_task(&mut self, job: i64, now: i64) -> Option<i64> {
        self.final_update_task_with(job, "success", now)
    }

    /// The final UpdateTask with this result (`success`, `failure`, `cancelled`): the job ends
    /// with it (`UpdateTaskByState`), and an ephemeral runner is deleted (`runner.go`: any
    /// result other than unspecified). A deleted runner cannot report (its RPC fails
    /// Unauthenticated): nothing changes then. Returns the deleted runner.
    pub fn final_update_task_with(&mut self, job: i64, result: &str, now: i64) -> Option<i64> {
        let id = self.jobs.get(&job)?.runner_id?;
        let r = self.runners.get_mut(&id).filter(|r| !r.deleted)?;
        r.busy = false;
        r.last_active = now;
        r.last_online = now;
        let ephemeral = r.ephemeral;
        let j = self.jobs.get_mut(&job)?;
        j.status = result.to_string();
        j.updated = now;
        if ephemeral {
            self.delete(id, now);
        }
        ephemeral.then_some(id)
    }

    /// SIGTERM (or SIGINT) to the runner's `one-job` process: its context is cancelled
    /// (forgejo-runner `main.go` `signal.NotifyContext`); the poller stops asking
    /// (`internal/app/poll/single.go`, whose task context derives from the same context), a
    /// running task is cancelled, and the reporter's `Close` still sends the final state, result
    /// `failure` (`internal/pkg/report/reporter.go`), so Forgejo ends the job and deletes the
    /// ephemeral runner at once. Then the process exits. Returns the runner Forgejo deleted.
    pub fn terminate(&mut self, runner: i64, now: i64) -> Option<i64> {
        let deleted = match self.running_job_of(runner) {
            Some(job) => self.final_update_task_with(job, "failure", now),
            None => None,
        };
        if let Some(r) = self.runners.get_mut(&runner)
            && !r.deleted
            && (r.polling || r.busy)
        {
            r.stops_polling(now);
        }
        deleted
    }

    /// `StopTask` (`services/actions/task.go`): the job ends with `status`, and the ephemeral
    /// runner its task was on is deleted, whether or not its process still runs (any other
    /// runner row is left as it is). Returns the deleted runner.
    pub fn stop_task(&mut self, job: i64, status: &str, now: i64) -> Option<i64> {
        let j = self.jobs.get_mut(&job)?;
        j.status = status.to_string();
        j.updated = now;
        let id = j.runner_id?;
        let ephemeral = self
            .runners
            .get(&id)
            .is_some_and(|r| r.ephemeral && !r.deleted);
        if ephemeral {
            self.delete(id, now);
        }
        ephemeral.then_some(id)
    }

    /// `cancelSingleJob` (`services/actions/rerun.go`): a job without a task just ends; a
    /// running one's task is stopped (`stop_task`). Returns the deleted runner.
    pub fn cancel_job(&mut self, job: i64, now: i64) -> Option<i64> {
        match self.jobs.get(&job) {
            Some(j) if j.is_running() => self.stop_task(job, "cancelled", now),
            Some(j) if !j.is_done() => {
                let j = self.jobs.get_mut(&job)?;
                j.status = "cancelled".to_string();
                j.updated = now;
                None
            }
            _ => None,
        }
    }

    /// When the job's task was last updated: now while its runner reports, else its last
    /// report (`UpdateTask`/`UpdateLog` set `last_active`,
    /// `routers/api/actions/runner/interceptor.go`).
    pub fn task_updated(&self, job: &JobRow, now: i64) -> i64 {
        match job.runner_id.and_then(|r| self.runners.get(&r)) {
            Some(r) if r.busy && !r.deleted => now,
            Some(r) => r.last_active,
            None => 0,
        }
    }

    /// `StopZombieTasks` (`services/actions/clear_tasks.go`): the running jobs whose task was not
    /// updated for `ZOMBIE_TASK_TIMEOUT`, id ascending, to stop with `failure`.
    pub fn zombie_tasks(&self, now: i64) -> Vec<i64> {
        self.jobs
            .values()
            .filter(|j| {
                j.is_running() && now - self.task_updated(j, now) > rules::ZOMBIE_TASK_TIMEOUT_MS
            })
            .map(|j| j.id)
            .collect()
    }

    /// `StopEndlessTasks` (`services/actions/clear_tasks.go`): the running jobs whose task started
    /// more than `timeout` ms ago (`ENDLESS_TASK_TIMEOUT`), however lively, id ascending, to stop
    /// with `failure`.
    pub fn endless_tasks(&self, now: i64, timeout: i64) -> Vec<i64> {
        self.jobs
            .values()
            .filter(|j| j.is_running() && now - j.started > timeout)
            .map(|j| j.id)
            .collect()
    }
}

// -- users, organizations and repositories: the scope a route names --------------------------------

/// A user or an organization (Forgejo keeps both in `user`, models/user/user.go).
#[derive(Clone, Debug)]
pub struct Account {
    pub id: i64,
    pub name: String,
    pub is_org: bool,
}

/// A repository and whether its Actions unit is enabled.
#[derive(Clone, Debug)]
pub struct RepoRow {
    pub id: i64,
    pub owner_id: i64,
    pub name: String,
    pub actions: bool,
}

/// The `user`, `user_redirect` and `repository` rows the scoped routes look up. Nothing exists
/// until a test creates it: an organization or repository that nobody created is one Forgejo
/// does not know.
#[derive(Clone, Debug, Default)]
pub struct Accounts {
    pub accounts: BTreeMap<i64, Account>,
    /// `user_redirect` (models/user/redirect.go): an old lower-case name and the account it
    /// now names.
    pub redirects: BTreeMap<String, i64>,
    pub repos: BTreeMap<i64, RepoRow>,
    next_id: i64,
}

/// What a scoped route's assignment middleware (`orgAssignment`, `repoAssignment` and
/// `reqOwner(unit.TypeActions)` in routers/api/v1/api.go) makes of the path's names.
#[derive(Clone, Debug)]
pub enum Assigned {
    /// Found: the rows the handler reads.
    Scope(Scope),
    /// A renamed user or organization (`RedirectToUser`, services/context/context_response.go):
    /// 307 to the same path with the new name in place of the old one.
    Renamed { old: String, new: String },
    /// `ctx.NotFound(objs...)` (services/context/api.go): the body `APINotFound` with this
    /// `message` and `errors`; the handler never runs.
    NotFound {
        message: String,
        errors: Vec<String>,
    },
}

/// `error.not_found` of the default locale (options/locale/locale_en-US.ini): the message of
/// a `ctx.NotFound()` without a string.
pub const NOT_FOUND_MESSAGE: &str = "The target couldn't be found.";

impl Accounts {
    fn next(&mut self) -> i64 {
        self.next_id = self.next_id.max(99) + 1;
        self.next_id
    }

    /// A user or organization with this id (the token's user has a fixed one).
    pub fn add_account(&mut self, id: Option<i64>, name: &str, is_org: bool) -> i64 {
        let id = id.unwrap_or_else(|| self.next());
        assert!(
            self.by_name(name).is_none(),
            "forgejo model: {name} exists already"
        );
        self.accounts.insert(
            id,
            Account {
                id,
                name: name.to_string(),
                is_org,
            },
        );
        id
    }

    /// A repository `owner/name` (its owner must exist), Actions enabled.
    pub fn add_repo(&mut self, owner: &str, name: &str) -> i64 {
        let owner_id = self
            .by_name(owner)
            .unwrap_or_else(|| panic!("forgejo model: no user or organization {owner}"))
            .id;
        let id = self.next();
        self.repos.insert(
            id,
            RepoRow {
                id,
                owner_id,
                name: name.to_string(),
                actions: true,
            },
        );
        id
    }

    /// `GetUserByName`: case-insensitive.
    pub fn by_name(&self, name: &str) -> Option<&Account> {
        self.accounts
            .values()
            .find(|a| a.name.eq_ignore_ascii_case(name))
    }

    /// `repo_model.GetRepositoryByName`: case-insensitive.
    pub fn repo(&self, owner: &str, name: &str) -> Option<&RepoRow> {
        let owner = self.by_name(owner)?;
        self.repos
            .values()
            .find(|r| r.owner_id == owner.id && r.name.eq_ignore_ascii_case(name))
    }

    /// `renameUser` (services/user/user.go): the account takes the new name, and
    /// `NewUserRedirect` points the old one at it, unless `redirect` is false: the old name's
    /// redirect is gone (`LimitUserRedirects` keeps only `[service] MAX_USER_REDIRECTS` of them).
    pub fn rename(&mut self, old: &str, new: &str, redirect: bool) {
        let id = self
            .by_name(old)
            .unwrap_or_else(|| panic!("forgejo model: no user or organization {old}"))
            .id;
        self.redirects.remove(&new.to_lowercase());
        self.redirects.remove(&old.to_lowercase());
        if redirect {
            self.redirects.insert(old.to_lowercase(), id);
        }
        if let Some(a) = self.accounts.get_mut(&id) {
            a.name = new.to_string();
        }
    }

    /// `LookupUserRedirect` (services/redirect/user.go): the account an old name now names,
    /// or `ErrUserRedirectNotExist` (models/user/redirect.go), whose text the 404 carries.
    fn lookup_redirect(&self, name: &str) -> Result<&Account, String> {
        let lower = name.to_lowercase();
        self.redirects
            .get(&lower)
            .and_then(|id| self.accounts.get(id))
            .ok_or_else(|| format!("user redirect does not exist [name: {lower}]"))
    }

    /// `orgAssignment(true)`: `GetOrgByName`, else the old name's redirect, else
    /// `ctx.NotFound("GetOrgByName", err)` with the redirect's error.
    pub fn assign_org(&self, name: &str) -> Assigned {
        match self.by_name(name).filter(|a| a.is_org) {
            Some(org) => Assigned::Scope(Scope {
                kind: ScopeKind::Owner,
                owner_id: org.id,
                repo_id: 0,
                repo_owner_id: 0,
            }),
            None => self.renamed_or("GetOrgByName", name),
        }
    }

    /// `repoAssignment()` then `reqOwner(unit.TypeActions)`: the owner (the token's user, `doer`,
    /// by its own name; else `GetUserByName`, else its redirect, else `ctx.NotFound
    /// ("GetUserByName", err)`), then the repository (else, without a repository redirect,
    /// `ctx.NotFound()`), then its Actions unit (else `ctx.NotFound()`).
    pub fn assign_repo(&self, owner: &str, name: &str, doer: i64) -> Assigned {
        let found = self
            .accounts
            .get(&doer)
            .filter(|d| d.name.eq_ignore_ascii_case(owner))
            .or_else(|| self.by_name(owner));
        if found.is_none() {
            return self.renamed_or("GetUserByName", owner);
        }
        match self.repo(owner, name) {
            Some(r) if r.actions => Assigned::Scope(Scope {
                kind: ScopeKind::Repo,
                owner_id: 0,
                repo_id: r.id,
                repo_owner_id: r.owner_id,
            }),
            _ => Assigned::NotFound {
                message: NOT_FOUND_MESSAGE.to_string(),
                errors: Vec::new(),
            },
        }
    }

    fn renamed_or(&self, message: &str, name: &str) -> Assigned {
        match self.lookup_redirect(name) {
            Ok(a) => Assigned::Renamed {
                old: name.to_string(),
                new: a.name.clone(),
            },
            Err(e) => Assigned::NotFound {
                message: message.to_string(),
                errors: vec![e],
            },
        }
    }
}

impl<X> Forgejo<X> {
    /// `DeleteOrganization` / `DeleteUser` (models/organization/org.go, services/user/delete.go:
    /// `DeleteBeans(..., &ActionRunner{OwnerID})`): the account goes, and its runners with it.
    pub fn delete_account(&mut self, name: &str, now: i64) {
        let Some(id) = self.accounts.by_name(name).map(|a| a.id) else {
            panic!("forgejo model: no user or organization {name}");
        };
        self.accounts.accounts.remove(&id);
        self.accounts.redirects.retain(|_, to| *to != id);
        let runners: Vec<i64> = self
            .runners
            .values()
            .filter(|r| !r.deleted && r.owner_id == id && r.repo_id == 0)
            .map(|r| r.id)
            .collect();
        for r in runners {
            self.delete(r, now);
        }
    }
}

// -- the wire ---------------------------------------------------------------------------------------

/// A JSON string literal (Go's `encoding/json` also escapes `<`, `>` and `&`; no reader here
/// depends on that).
pub fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_strs(items: &[String]) -> String {
    let items: Vec<String> = items.iter().map(|s| json_str(s)).collect();
    format!("[{}]", items.join(","))
}

impl<X> RunnerRow<X> {
    /// The runner as the REST API shows it (`structs.ActionRunner`,
    /// `modules/structs/repo_actions.go`, in its field order): the status computed now; `labels`
    /// `null` before Declare, and after a Declare of none (a nil list).
    pub fn json(&self, now: i64) -> String {
        let labels = match &self.labels {
            Some(l) if !l.is_empty() => json_strs(l),
            _ => "null".to_string(),
        };
        format!(
            "{{\"id\":{},\"uuid\":{},\"owner_id\":{},\"repo_id\":{},\"name\":{},\"status\":\"{}\",\"version\":{},\"labels\":{labels},\"description\":{},\"ephemeral\":{}}}",
            self.id,
            json_str(&self.uuid),
            self.owner_id,
            self.repo_id,
            json_str(&self.name),
            self.status(now),
            json_str(&self.version),
            json_str(&self.description),
            self.ephemeral
        )
    }
}

impl JobRow {
    /// The job as the REST jobs search shows it (`structs.ActionRunJob`,
    /// `modules/structs/action.go`, in its field order; `needs` is not modelled: `null`).
    pub fn json(&self) -> String {
        format!(
            "{{\"id\":{},\"attempt\":{},\"handle\":{},\"repo_id\":{},\"owner_id\":{},\"name\":{},\"needs\":null,\"runs_on\":{},\"task_id\":{},\"status\":{}}}",
            self.id,
            self.attempt,
            json_str(&self.handle),
            self.repo_id,
            self.owner_id,
            json_str(&self.name),
            json_strs(&self.runs_on),
            self.task_id,
            json_str(&self.status)
        )
    }
}

/// The body of the jobs search: a JSON array, `null` for none (a nil Go slice).
pub fn jobs_json(jobs: &[&JobRow]) -> String {
    if jobs.is_empty() {
        return "null".to_string();
    }
    let items: Vec<String> = jobs.iter().map(|j| j.json()).collect();
    format!("[{}]", items.join(","))
}

/// Go `url.QueryEscape`.
pub fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            b' ' => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Go `url.Values.Encode` of the request query with `page` replaced: keys sorted.
fn query_with_page(q: &[(String, String)], page: i64) -> String {
    let mut by_key: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (k, v) in q {
        by_key.entry(k.as_str()).or_default().push(v.as_str());
    }
    let page = page.to_string();
    by_key.insert("page", vec![page.as_str()]);
    by_key
        .iter()
        .flat_map(|(k, vs)| {
            vs.iter()
                .map(move |v| format!("{}={}", query_escape(k), query_escape(v)))
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// `genAPILinks` (`services/context/api.go`) with Gitea's paginator: `next`, `last`, `first`,
/// `prev`, using `ROOT_URL`; `q` is the request's query, decoded.
pub fn api_links(
    root_url: &str,
    raw_path: &str,
    q: &[(String, String)],
    total: i64,
    page_size: i64,
    cur_page: i64,
) -> Vec<String> {
    let paging_num = page_size.max(1);
    let total_pages = if total == 0 {
        1
    } else {
        (total + paging_num - 1) / paging_num
    };
    let current = cur_page.max(1).min(total_pages);
    let has_next = total > current * paging_num;
    let is_last = total == 0 || (total > (current - 1) * paging_num && !has_next);
    let path = raw_path.trim_start_matches('/');
    let link = |page: i64, rel: &str| {
        format!(
            "<{root_url}{path}?{}>; rel=\"{rel}\"",
            query_with_page(q, page)
        )
    };
    let mut links = Vec::new();
    if has_next {
        links.push(link(current + 1, "next"));
    }
    if !is_last {
        links.push(link(total_pages, "last"));
    }
    if current != 1 {
        links.push(link(1, "first"));
    }
    if current > 1 {
        links.push(link(current - 1, "prev"));
    }
    links
}

/// The headers of a runner list page (`ListRunners` → `ctx.SetLinkHeader`,
/// `ctx.SetTotalCountHeader`): `Link` when there is one, then `X-Total-Count`, and the CORS
/// header naming them.
pub fn list_headers(
    root_url: &str,
    raw_path: &str,
    q: &[(String, String)],
    total: i64,
    page_size: i64,
    page: i64,
) -> Vec<(&'static str, String)> {
    let links = api_links(root_url, raw_path, q, total, page_size, page);
    let mut h = Vec::new();
    if links.is_empty() {
        h.push(("X-Total-Count", total.to_string()));
        h.push(("Access-Control-Expose-Headers", "X-Total-Count".to_string()));
    } else {
        h.push(("Link", links.join(",")));
        h.push(("X-Total-Count", total.to_string()));
        h.push((
            "Access-Control-Expose-Headers",
            "Link, X-Total-Count".to_string(),
        ));
    }
    h
}
