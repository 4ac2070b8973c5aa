//! One model of Forgejo's server side for the tests: its runner and job rows, registration,
//! the runner list with its paging quirks, deletion, status, the assignment of tasks, the end
//! of a task and the clean-ups that stop tasks. The HTTP fake (`fake_forgejo.rs`) and the
//! simulation's world (`tests/sim/world.rs`) are shells over it: they bring the clock (`now`, Unix
//! ms, is an argument here), the wire, the runner processes, the faults and any randomness (uuids,
//! tokens and the order of tied rows are passed in). The rules themselves are in
//! `forgejo_rules.rs`, with the Forgejo v15.0.3 sources they copy; what this file adds names its
//! source where it is written.
#![allow(dead_code)]

use std::collections::BTreeMap;

use super::forgejo_rules::{self as rules, JobView, RunnerView};

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
}

impl JobRow {
    /// The row as the product reads it from `GET …/actions/runners/jobs` (`Job`, the product's
    /// parsed job, is brought into scope by whoever includes this model).
    pub fn listed(&self) -> super::Job {
        super::Job {
            id: self.id,
            handle: self.handle.clone(),
            status: self.status.clone(),
            runs_on: self.runs_on.clone(),
            repo_id: Some(self.repo_id),
            owner_id: Some(self.owner_id),
        }
    }

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
    /// `null`). Returns its id.
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
                name: new.name.to_string(),
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
        mut tie: impl FnMut(i64, u64) -> u64,
    ) -> (Vec<&RunnerRow<X>>, usize) {
        let limit = self.page_size(limit) as usize;
        let mut rows: Vec<(i64, u64, &RunnerRow<X>)> = self
            .runners
            .values()
            .filter(|r| !r.deleted && scope.lists(r, visible))
            .map(|r| {
                (
                    r.effective_last_online(now),
                    tie(r.id, self.rows_version),
                    r,
                )
            })
            .collect();
        rows.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let total = rows.len();
        let (skip, take) = if page >= 1 {
            ((page as usize - 1) * limit, limit)
        } else {
            (0, usize::MAX)
        };
        let shown = rows
            .into_iter()
            .skip(skip)
            .take(take)
            .map(|t| t.2)
            .collect();
        (shown, total)
    }

    // -- job rows ---------------------------------------------------------------------------------

    /// A waiting job (attempt 1, named `job-{id}`). Returns its id.
    pub fn add_job(
        &mut self,
        handle: String,
        runs_on: Vec<String>,
        owner_id: i64,
        repo_id: i64,
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
            },
        );
        id
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
        self.jobs.values().any(|j| j.runner_id == Some(runner))
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
        let j = self.jobs.get_mut(&job)?;
        j.status = "success".to_string();
        let id = j.runner_id?;
        let r = self.runners.get_mut(&id)?;
        r.busy = false;
        r.last_active = now;
        r.last_online = now;
        let ephemeral = r.ephemeral && !r.deleted;
        if ephemeral {
            self.delete(id, now);
        }
        ephemeral.then_some(id)
    }

    /// `StopTask` (`services/actions/task.go`): the job ends with `status`, and the ephemeral
    /// runner its task was on is deleted, whether or not its process still runs (any other
    /// runner row is left as it is). Returns the deleted runner.
    pub fn stop_task(&mut self, job: i64, status: &str, now: i64) -> Option<i64> {
        let j = self.jobs.get_mut(&job)?;
        j.status = status.to_string();
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
                self.jobs.get_mut(&job)?.status = "cancelled".to_string();
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
