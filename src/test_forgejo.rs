//! Test-only: the tests' one model of Forgejo's server side (the dev-only crate
//! `forgejo-model/`) in the library's unit tests, and [`ModelForgejo`], a
//! thin shell that serves the `Forgejo`, `Launcher` and `Clock` ports from it, as the HTTP fake
//! and the simulation's world serve theirs. Every rule is the model's; the shell brings the
//! clock, the order of tied rows, the launched runners' processes and a record of the requests.

use std::cell::{RefCell, RefMut};
use std::rc::Rc;
use std::time::Duration;

use crate::core::forgejo::{Job, Runner, RunnerStatus};
use crate::core::ports::{
    ApiError, Clock, Deleted, Forgejo, LaunchRequest, Launcher, NewRunner, ProcessCheck,
    RunnerPage, Sleep, StepError,
};
use crate::core::secret::Secret;
use crate::core::sweep::gate::Deletable;
use crate::core::time::Timestamp;
use forgejo_model::{JobRow, RunnerRow, Scope, rules};

/// The model's tables and what the shell adds to them.
pub struct Server {
    pub forgejo: forgejo_model::Forgejo<()>,
    /// Unix ms: the one clock of the test (each sleep of the driver moves it on).
    pub now: i64,
    /// The label names the jobs list asks for (`--labels`).
    pub labels: Vec<String>,
    /// The key of a tied row (`last_online` alike) in the n-th list request:
    /// `tie(n, id, rows_version)`. By default a hash of the id and the table's version, as in
    /// the HTTP fake: the same order while no row is added or deleted.
    pub tie: fn(u32, i64, u64) -> u64,
    /// Another client's change to the rows (at `now`), made just before the n-th list request.
    pub meanwhile: Option<(u32, Change)>,
    /// The list pages asked for, in order.
    pub asked: Vec<u32>,
    /// Every DELETE sent, by runner id, in order.
    pub deletes: Vec<i64>,
}

/// A change to Forgejo's rows by someone else, at this instant (Unix ms).
pub type Change = fn(&mut forgejo_model::Forgejo<()>, i64);

/// The admin scope's runner API on the model, and the launch command of runners that run
/// their job at once. Clones share one server.
#[derive(Clone)]
pub struct ModelForgejo(Rc<RefCell<Server>>);

/// Tied rows in the model's order: it changes whenever a row is added or deleted.
fn hashed_tie(_request: u32, id: i64, rows_version: u64) -> u64 {
    forgejo_model::tie_key(id, rows_version, 0)
}

/// A runner as the HTTP client parses it: the status string Forgejo shows, and (`GET` of one
/// runner only) its label names once it declared itself (Forgejo then shows its `version`).
fn wire(r: &RunnerRow<()>, now: i64, with_labels: bool) -> Runner {
    let declared = with_labels && !r.version.is_empty();
    Runner {
        id: r.id,
        name: Some(r.name.clone()),
        status: RunnerStatus::from_json(Some(&serde_json::json!(r.status(now)))),
        labels: declared.then(|| r.labels.clone().unwrap_or_default()),
    }
}

/// A job row as the HTTP client parses it from `GET …/actions/runners/jobs`.
fn listed(j: &JobRow) -> Job {
    Job {
        id: j.id,
        handle: j.handle.clone(),
        status: j.status.clone(),
        runs_on: j.runs_on.clone(),
        repo_id: Some(j.repo_id),
        owner_id: Some(j.owner_id),
    }
}

impl ModelForgejo {
    /// An empty Forgejo at 2025-10-09; its jobs list asks for these `--labels`' names.
    pub fn new(labels: &str) -> ModelForgejo {
        ModelForgejo(Rc::new(RefCell::new(Server {
            forgejo: forgejo_model::Forgejo::default(),
            now: 1_760_000_000_000,
            labels: rules::declared_names(labels).expect("labels forgejo-runner takes"),
            tie: hashed_tie,
            meanwhile: None,
            asked: Vec::new(),
            deletes: Vec::new(),
        })))
    }

    pub fn server(&self) -> RefMut<'_, Server> {
        self.0.borrow_mut()
    }
}

/// `POST …/actions/runners` of the admin scope: an ephemeral instance runner (id `None`: the
/// next one) that never connected, so offline; its id.
pub fn add_runner(f: &mut forgejo_model::Forgejo<()>, id: Option<i64>, name: &str) -> i64 {
    let uuid = format!("uuid-{}", id.unwrap_or(f.next_runner_id()));
    f.register(forgejo_model::NewRunner {
        id,
        uuid,
        token: "t".into(),
        name,
        description: "",
        owner_id: 0,
        repo_id: 0,
        ephemeral: true,
        extra: (),
    })
}

impl Forgejo for ModelForgejo {
    fn list_jobs(&mut self) -> Result<Vec<Job>, ApiError> {
        let s = self.server();
        let jobs = s.forgejo.list_jobs(&Scope::ADMIN, Some(&s.labels));
        Ok(jobs.into_iter().map(listed).collect())
    }

    fn get_runner(&mut self, id: i64) -> Result<Option<Runner>, ApiError> {
        let s = self.server();
        Ok(s.forgejo.live(id).map(|r| wire(r, s.now, true)))
    }

    fn delete_runner(&mut self, target: &Deletable, _reason: &str) -> Result<Deleted, ApiError> {
        let mut s = self.server();
        let (id, now) = (target.id(), s.now);
        s.deletes.push(id);
        if !s.forgejo.live(id).is_some_and(|r| Scope::ADMIN.edits(r)) {
            return Ok(Deleted::AlreadyGone);
        }
        s.forgejo.delete(id, now);
        Ok(Deleted::Now)
    }

    fn register_runner(&mut self, name: &str) -> Result<NewRunner, ApiError> {
        let mut s = self.server();
        let id = add_runner(&mut s.forgejo, None, name);
        let r = s.forgejo.live(id).expect("just registered");
        Ok(NewRunner {
            id,
            uuid: r.uuid.clone(),
            token: Secret::new(r.token.clone()),
        })
    }

    fn list_runners_page(&mut self, page: u32, limit: u32) -> Result<RunnerPage, ApiError> {
        let mut s = self.server();
        s.asked.push(page);
        let (n, now, tie) = (s.asked.len() as u32, s.now, s.tie);
        if let Some((at, change)) = s.meanwhile
            && at == n
        {
            change(&mut s.forgejo, now);
        }
        let (rows, total) = s.forgejo.list_runners(
            now,
            &Scope::ADMIN,
            false,
            i64::from(page),
            i64::from(limit),
            |id, version| tie(n, id, version),
        );
        Ok(RunnerPage {
            rows: rows.into_iter().map(|r| wire(r, now, false)).collect(),
            total: Some(total as u64),
        })
    }
}

impl Launcher for ModelForgejo {
    fn check_config(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// The runner (`one-job --handle`) declares the launch's label names and asks for its job;
    /// the model's assignment decides. A job it is given runs at once: its final UpdateTask ends
    /// it, and Forgejo deletes the ephemeral registration. Given none, it polls on.
    fn launch(&mut self, req: &LaunchRequest<'_>, _token: &Secret) -> Result<(), StepError> {
        let mut s = self.server();
        let now = s.now;
        let f = &mut s.forgejo;
        // A deleted registration cannot authenticate: its process gets nowhere.
        let Some(r) = f.live_mut(req.runner_id) else {
            return Ok(());
        };
        let labels = rules::declared_names(req.labels).expect("labels forgejo-runner takes");
        r.declare(Some(labels), now);
        if let Some(job) = f.task_for(req.runner_id, Some(req.job_handle)) {
            f.start_task(job, req.runner_id, now);
            f.final_update_task(job, now);
        }
        Ok(())
    }

    /// Its process runs while it polls.
    fn check(&mut self, req: &LaunchRequest<'_>) -> ProcessCheck {
        match self.server().forgejo.live(req.runner_id) {
            Some(r) if r.polling => ProcessCheck::Running,
            _ => ProcessCheck::Gone,
        }
    }

    /// SIGTERM: a task it runs is reported failed and Forgejo deletes it; else it stops polling
    /// (`forgejo_model::Forgejo::terminate`).
    fn stop(&mut self, req: &LaunchRequest<'_>) -> Result<(), StepError> {
        let mut s = self.server();
        let now = s.now;
        s.forgejo.terminate(req.runner_id, now);
        Ok(())
    }
}

/// Each sleep moves the clock on by the slept duration.
impl Clock for ModelForgejo {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.borrow().now)
    }

    fn sleep(&mut self, d: Duration) -> Sleep {
        let mut s = self.server();
        s.now = Timestamp(s.now).plus(d).0;
        Sleep::Slept
    }

    fn stop_requested(&self) -> bool {
        false
    }

    fn new_cycle_id(&mut self, now: Timestamp) -> String {
        now.compact()
    }
}
