//! Dry-run implementations: the real cycle code runs against these and the side effects it
//! would have become the plan. Reads come from live Forgejo GETs or from a fixture file.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde_json::{Value, json};

use crate::core::claims::Others;
use crate::core::forgejo::{Job, Runner, RunnerStatus, job_matches};
use crate::core::holds::{Holds, HoldsError};
use crate::core::ports::{
    ApiError, Clock, Deleted, Forgejo, LaunchRequest, Launcher, NewRunner, Outputs, ProcessCheck,
    RunnerPage, Sleep, StateStore, StepError, Tofu,
};
use crate::core::secret::Secret;
use crate::core::state::{CycleState, parse_state};
use crate::core::sweep::gate::Deletable;
use crate::core::time::Timestamp;

/// The plan: every side effect the cycle would have performed, in order.
pub type Plan = Rc<RefCell<Vec<Value>>>;

/// How many reads of a dry-run's world failed.
pub type ReadErrors = Rc<Cell<u32>>;

/// A world read from a fixture file: `{"cycle", "runners", "jobs", "now"}`.
pub struct Fixture {
    pub cycle: Option<CycleState>,
    pub runners: Vec<Value>,
    pub jobs: Option<Vec<Value>>,
    pub now: Option<Timestamp>,
}

/// A well-formed fixture, read in one pass: runner rows keep only what `Runner::from_json` reads.
#[derive(serde::Deserialize)]
struct QuickFixture {
    #[serde(default)]
    cycle: Option<Value>,
    #[serde(default)]
    runners: Option<Vec<crate::core::forgejo::FixtureRunner>>,
    #[serde(default)]
    jobs: Option<Vec<Value>>,
    #[serde(default)]
    now: Option<String>,
}

impl Fixture {
    /// Reads a fixture and checks every runner and job row as a dry-run will read it: a broken
    /// fixture is refused here, whichever field is wrong (a usage error, exit 2), never found
    /// later as a failed read of the world.
    pub fn load(path: &std::path::Path) -> Result<Fixture> {
        let fx = Fixture::read(path)?;
        for (i, row) in fx.runners.iter().enumerate() {
            Runner::from_json_with_labels(row)
                .with_context(|| format!("\"runners\"[{i}] in fixture {}", path.display()))?;
        }
        for (i, row) in fx.jobs.iter().flatten().enumerate() {
            Job::from_json(row)
                .with_context(|| format!("\"jobs\"[{i}] in fixture {}", path.display()))?;
        }
        Ok(fx)
    }

    /// The fixture's keys and values, its rows unchecked.
    fn read(path: &std::path::Path) -> Result<Fixture> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read fixture {}", path.display()))?;
        check_fixture_keys(&text, path)?;
        // Anything the quick reading does not take (not JSON, wrong types) is read again by
        // `read_slowly`, which says precisely what is wrong.
        // (A derived struct would also accept an array: only an object takes the quick way.)
        let quick = text
            .trim_start()
            .starts_with('{')
            .then(|| serde_json::from_str::<QuickFixture>(&text).ok())
            .flatten();
        match quick {
            Some(q) => Ok(Fixture {
                cycle: q
                    .cycle
                    .as_ref()
                    .map(|c| fixture_cycle(c, path))
                    .transpose()?,
                runners: q
                    .runners
                    .unwrap_or_default()
                    .into_iter()
                    .map(|r| r.0)
                    .collect(),
                jobs: q.jobs,
                now: q.now.as_deref().map(|s| fixture_now(s, path)).transpose()?,
            }),
            None => Fixture::read_slowly(&text, path),
        }
    }

    /// The fixture read as a JSON value, each field's type checked with its own message.
    fn read_slowly(text: &str, path: &std::path::Path) -> Result<Fixture> {
        let v: Value = serde_json::from_str(text)
            .with_context(|| format!("fixture {} is not valid JSON", path.display()))?;
        // Owned: the runner and job arrays are moved out, not copied (10,000 runners took a
        // third of a dry-run's instructions to clone and free again).
        let Value::Object(mut obj) = v else {
            return Err(anyhow!("fixture {} is not a JSON object", path.display()));
        };
        let cycle = match obj.get("cycle") {
            None | Some(Value::Null) => None,
            Some(c) => Some(fixture_cycle(c, path)?),
        };
        let runners = match obj.remove("runners") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a,
            Some(_) => {
                return Err(anyhow!(
                    "\"runners\" in fixture {} is not an array",
                    path.display()
                ));
            }
        };
        let jobs = match obj.remove("jobs") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => Some(a),
            Some(_) => {
                return Err(anyhow!(
                    "\"jobs\" in fixture {} is not an array or null",
                    path.display()
                ));
            }
        };
        let now = match obj.get("now") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(fixture_now(s, path)?),
            Some(_) => {
                return Err(anyhow!(
                    "\"now\" in fixture {} is not a string",
                    path.display()
                ));
            }
        };
        Ok(Fixture {
            cycle,
            runners,
            jobs,
            now,
        })
    }
}

/// A fixture's `"cycle"`: a cycle.json as the state store would read it.
fn fixture_cycle(c: &Value, path: &std::path::Path) -> Result<CycleState> {
    parse_state(&c.to_string()).with_context(|| format!("\"cycle\" in fixture {}", path.display()))
}

/// A fixture's `"now"`: an RFC 3339 time.
fn fixture_now(s: &str, path: &std::path::Path) -> Result<Timestamp> {
    Timestamp::parse_rfc3339(s).map_err(|e| anyhow!("\"now\" in fixture {}: {e}", path.display()))
}

/// The keys a fixture may have (besides `_comment`-style keys starting with `_`), and whether
/// each one must be there.
const FIXTURE_KEYS: [(&str, bool); 4] = [
    ("cycle", false),
    ("runners", true),
    ("jobs", true),
    ("now", false),
];

/// A fixture is read strictly at its top level: a misspelled or missing key is an error that
/// names it, never an empty world that plans "nothing to do".
fn check_fixture_keys(text: &str, path: &std::path::Path) -> Result<()> {
    if !text.trim_start().starts_with('{') {
        // Not an object: the reading below says what it is.
        return Ok(());
    }
    let Ok(keys) = serde_json::from_str::<BTreeMap<String, serde::de::IgnoredAny>>(text) else {
        return Ok(());
    };
    let known = || {
        FIXTURE_KEYS
            .iter()
            .map(|(k, _)| format!("{k:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for key in keys.keys() {
        if key.starts_with('_') || FIXTURE_KEYS.iter().any(|(k, _)| k == key) {
            continue;
        }
        let hint = FIXTURE_KEYS
            .iter()
            .find(|(k, _)| k.starts_with(key.as_str()) || key.starts_with(k))
            .map(|(k, _)| format!(" (did you mean {k:?}?)"))
            .unwrap_or_default();
        return Err(anyhow!(
            "fixture {} has an unknown key {key:?}{hint}; a fixture has the keys {} (and comments in keys starting with _)",
            path.display(),
            known()
        ));
    }
    for (key, required) in FIXTURE_KEYS {
        if required && !keys.contains_key(key) {
            return Err(anyhow!(
                "fixture {} has no {key:?} key; write \"{key}\": [] for none (a fixture has the keys {})",
                path.display(),
                known()
            ));
        }
    }
    Ok(())
}

/// Answers reads from the fixture the way Forgejo would.
pub struct FixtureForgejo {
    pub runners: Vec<Value>,
    pub jobs: Option<Vec<Value>>,
    pub label_names: Vec<String>,
}

fn fixture_error(what: &str, e: anyhow::Error) -> ApiError {
    ApiError {
        status: None,
        request: format!("fixture {what}"),
        detail: format!("{e:#}"),
    }
}

impl Forgejo for FixtureForgejo {
    fn list_jobs(&mut self) -> Result<Vec<Job>, ApiError> {
        let jobs: Vec<Job> = match &self.jobs {
            None => Vec::new(),
            Some(items) => items
                .iter()
                .map(Job::from_json)
                .collect::<Result<_, _>>()
                .map_err(|e| fixture_error("jobs", e))?,
        };
        Ok(jobs
            .into_iter()
            .filter(|j| j.is_live() && job_matches(j, &self.label_names))
            .collect())
    }

    fn get_runner(&mut self, id: i64) -> Result<Option<Runner>, ApiError> {
        for v in &self.runners {
            let r = Runner::from_json_with_labels(v).map_err(|e| fixture_error("runners", e))?;
            if r.id == id {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }

    fn delete_runner(&mut self, target: &Deletable, _reason: &str) -> Result<Deleted, ApiError> {
        Err(fixture_error(
            "delete",
            anyhow!("a fixture is read-only (runner {})", target.id()),
        ))
    }

    fn register_runner(&mut self, name: &str) -> Result<NewRunner, ApiError> {
        Err(fixture_error(
            "register",
            anyhow!("a fixture is read-only ({name})"),
        ))
    }

    fn list_runners_page(&mut self, page: u32, limit: u32) -> Result<RunnerPage, ApiError> {
        let limit = limit.clamp(1, 50) as usize;
        let start = (page.max(1) as usize - 1) * limit;
        let rows = self
            .runners
            .iter()
            .skip(start)
            .take(limit)
            .map(Runner::from_json)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| fixture_error("runners", e))?;
        Ok(RunnerPage {
            rows,
            total: Some(self.runners.len() as u64),
        })
    }
}

/// Passes reads through to `inner`; records writes in the plan and pretends they succeeded
/// (a new registration is `offline`, as Forgejo shows a runner that never connected).
pub struct DryForgejo {
    pub inner: Box<dyn Forgejo>,
    /// Reads that failed: then the plan is incomplete and the dry-run fails.
    read_errors: ReadErrors,
    pub plan: Plan,
    created: BTreeMap<i64, String>,
    deleted: BTreeSet<i64>,
    /// Names of the registrations read so far, for the plan's deletions.
    names: BTreeMap<i64, String>,
    next_id: i64,
}

impl DryForgejo {
    pub fn new(inner: Box<dyn Forgejo>, plan: Plan) -> DryForgejo {
        DryForgejo {
            inner,
            read_errors: ReadErrors::default(),
            plan,
            created: BTreeMap::new(),
            deleted: BTreeSet::new(),
            names: BTreeMap::new(),
            next_id: -1,
        }
    }
}

impl DryForgejo {
    /// The count of failed reads, shared: it still counts once this Forgejo is boxed away.
    pub fn read_errors(&self) -> ReadErrors {
        self.read_errors.clone()
    }

    fn count<T>(&mut self, r: Result<T, ApiError>) -> Result<T, ApiError> {
        if r.is_err() {
            self.read_errors.set(self.read_errors.get() + 1);
        }
        r
    }
}

impl Forgejo for DryForgejo {
    fn list_jobs(&mut self) -> Result<Vec<Job>, ApiError> {
        let r = self.inner.list_jobs();
        self.count(r)
    }

    fn get_runner(&mut self, id: i64) -> Result<Option<Runner>, ApiError> {
        if self.deleted.contains(&id) {
            return Ok(None);
        }
        if let Some(name) = self.created.get(&id) {
            return Ok(Some(Runner {
                id,
                name: Some(name.clone()),
                status: RunnerStatus::Offline,
                labels: None,
            }));
        }
        let r = self.inner.get_runner(id);
        if let Ok(Some(Runner { name: Some(n), .. })) = &r {
            self.names.insert(id, n.clone());
        }
        self.count(r)
    }

    fn delete_runner(&mut self, target: &Deletable, reason: &str) -> Result<Deleted, ApiError> {
        let id = target.id();
        let name = self.created.get(&id).or_else(|| self.names.get(&id));
        self.plan.borrow_mut().push(
            json!({"action": "delete_runner", "runner_id": id, "name": name, "reason": reason}),
        );
        self.deleted.insert(id);
        Ok(Deleted::Planned)
    }

    fn register_runner(&mut self, name: &str) -> Result<NewRunner, ApiError> {
        // Negative ids: they can never be mistaken for a real registration.
        let id = self.next_id;
        self.next_id -= 1;
        self.created.insert(id, name.to_string());
        self.plan
            .borrow_mut()
            .push(json!({"action": "register_runner", "name": name}));
        Ok(NewRunner {
            id,
            uuid: "00000000-0000-4000-8000-000000000000".into(),
            token: Secret::new(String::new()),
        })
    }

    fn list_runners_page(&mut self, page: u32, limit: u32) -> Result<RunnerPage, ApiError> {
        let r = self.inner.list_runners_page(page, limit);
        let mut p = self.count(r)?;
        p.rows.retain(|r| !self.deleted.contains(&r.id));
        for r in &p.rows {
            if let Some(n) = &r.name {
                self.names.insert(r.id, n.clone());
            }
        }
        // Every page must report the same count (as Forgejo does): the planned deletions of
        // existing registrations (positive ids; planned ones are negative) come off all of them.
        let gone = self.deleted.iter().filter(|id| **id > 0).count() as u64;
        if let Some(t) = p.total.as_mut() {
            *t = t.saturating_sub(gone);
        }
        Ok(p)
    }
}

pub struct DryTofu {
    pub plan: Plan,
    /// What the real tofu's `check_config` found wrong (a dry-run against Forgejo): the plan
    /// then stops where a live run would stop. None for a fixture's world.
    pub refusal: Option<String>,
}

impl Tofu for DryTofu {
    fn check_config(&self) -> anyhow::Result<()> {
        refused(&self.refusal)
    }

    fn apply(&mut self, _cycle_id: &str) -> Result<(), StepError> {
        self.plan.borrow_mut().push(json!({"action": "tofu_apply"}));
        Ok(())
    }

    fn outputs(&mut self, _cycle_id: &str) -> Result<Outputs, StepError> {
        Ok(Outputs::new())
    }

    fn destroy(&mut self, _cycle_id: &str, reason: &str) -> Result<(), StepError> {
        self.plan
            .borrow_mut()
            .push(json!({"action": "tofu_destroy", "reason": reason}));
        Ok(())
    }
}

/// Adds the job a registration would be launched for to its `register_runner` action.
pub struct DryLauncher {
    pub plan: Plan,
    /// As [`DryTofu::refusal`], of the real launch command.
    pub refusal: Option<String>,
}

/// A dry stand-in's `check_config`: what the real one found, once found.
fn refused(refusal: &Option<String>) -> anyhow::Result<()> {
    match refusal {
        Some(why) => Err(anyhow::Error::msg(why.clone())),
        None => Ok(()),
    }
}

impl Launcher for DryLauncher {
    fn check_config(&self) -> anyhow::Result<()> {
        refused(&self.refusal)
    }

    fn launch(&mut self, req: &LaunchRequest<'_>, _token: &Secret) -> Result<(), StepError> {
        let mut plan = self.plan.borrow_mut();
        if let Some(action) = plan
            .iter_mut()
            .rev()
            .find(|a| a["action"] == "register_runner" && a["name"] == req.runner_name)
        {
            action["job_id"] = json!(req.job_id);
            action["job_handle"] = json!(req.job_handle);
        }
        Ok(())
    }

    /// The plan says the previous runner would be checked; planning goes on as if it were gone.
    fn check(&mut self, req: &LaunchRequest<'_>) -> ProcessCheck {
        self.plan.borrow_mut().push(json!({
            "action": "check_runner", "runner_id": req.runner_id, "name": req.runner_name,
        }));
        ProcessCheck::Gone
    }

    fn stop(&mut self, req: &LaunchRequest<'_>) -> Result<(), StepError> {
        self.plan.borrow_mut().push(json!({
            "action": "stop_runner", "runner_id": req.runner_id, "name": req.runner_name,
        }));
        Ok(())
    }
}

/// Time stands still in a dry-run, and the plan ends where the cycle would wait.
pub struct DryClock {
    pub now: Timestamp,
}

impl Clock for DryClock {
    fn now(&self) -> Timestamp {
        self.now
    }

    fn sleep(&mut self, _d: Duration) -> Sleep {
        Sleep::Stop
    }

    fn stop_requested(&self) -> bool {
        false
    }

    fn new_cycle_id(&mut self, now: Timestamp) -> String {
        format!("{}-dryrun", now.compact())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Fixture> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.json");
        std::fs::write(&path, text).unwrap();
        Fixture::load(&path)
    }

    fn read(text: &str) -> Result<Fixture> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.json");
        std::fs::write(&path, text).unwrap();
        Fixture::read(&path)
    }

    #[test]
    fn a_row_that_does_not_read_is_refused_at_load() {
        let err = |t: &str| format!("{:#}", load(t).err().unwrap());
        let e =
            err(r#"{"runners": [{"id": 1, "status": "offline"}, {"name": "x"}], "jobs": null}"#);
        assert!(
            e.contains("\"runners\"[1] in fixture") && e.contains("no integer \"id\""),
            "{e}"
        );
        let e = err(r#"{"runners": [], "jobs": [{"id": 3, "status": 7}]}"#);
        assert!(
            e.contains("\"jobs\"[0] in fixture") && e.contains("no string \"status\""),
            "{e}"
        );
        assert!(load(r#"{"runners": [{"id": 1, "status": "Offline"}], "jobs": []}"#).is_ok());
    }

    #[test]
    fn slim_runner_rows_read_as_the_full_rows_do() {
        let rows = r#"[
            {"id": 1, "uuid": "u", "name": "ephemeral-1", "status": "offline", "labels": ["a", {"b": [1]}], "ephemeral": true},
            {"id": 2, "name": 7, "status": "Offline"},
            {"name": "no-id", "status": "idle"},
            {"id": 3, "name": "x", "status": null, "id": 4},
            5,
            [1, 2],
            "text",
            null
        ]"#;
        let fx = read(&format!(r#"{{"runners": {rows}, "jobs": null}}"#)).unwrap();
        let full: Vec<Value> = serde_json::from_str(rows).unwrap();
        assert_eq!(fx.runners.len(), full.len());
        for (slim, full) in fx.runners.iter().zip(&full) {
            match (
                Runner::from_json_with_labels(slim),
                Runner::from_json_with_labels(full),
            ) {
                (Ok(a), Ok(b)) => assert_eq!(a, b),
                (Err(_), Err(_)) => {}
                (a, b) => panic!("{slim} read as {a:?}, {full} as {b:?}"),
            }
        }
        assert!(
            fx.runners[0].get("uuid").is_none(),
            "other fields are skipped"
        );
        assert!(
            fx.runners[0].get("labels").is_some(),
            "the labels a fetched runner shows are kept"
        );
    }

    #[test]
    fn a_fixture_of_the_wrong_shape_still_says_what_is_wrong() {
        let err = |t: &str| format!("{:#}", load(t).err().unwrap());
        assert!(err("[]").contains("is not a JSON object"));
        assert!(err(r#"{"runners": {}, "jobs": []}"#).contains("\"runners\" in fixture"));
        assert!(err(r#"{"runners": [], "jobs": 3}"#).contains("\"jobs\" in fixture"));
        assert!(err(r#"{"runners": [], "jobs": [], "now": 3}"#).contains("\"now\" in fixture"));
        assert!(err("{").contains("is not valid JSON"));
    }

    #[test]
    fn fixture_keys_are_strict() {
        let err = |t: &str| format!("{:#}", load(t).err().unwrap());
        let e = err("{}");
        assert!(e.contains("has no \"runners\" key"), "{e}");
        let e = err(r#"{"runners": [], "job": []}"#);
        assert!(
            e.contains("unknown key \"job\" (did you mean \"jobs\"?)"),
            "{e}"
        );
        let e = err(r#"{"runners": []}"#);
        assert!(e.contains("has no \"jobs\" key"), "{e}");
        let e = err(r#"{"runners": [], "jobs": [], "cylce": null}"#);
        assert!(e.contains("unknown key \"cylce\""), "{e}");
        // Comments, and the optional keys left out, are fine.
        assert!(load(r#"{"_comment": "x", "runners": [], "jobs": null}"#).is_ok());
    }
}

/// A store that never touches the disk: dry-runs start from what the real files (or the
/// fixture) hold and keep every change in memory.
#[derive(Default)]
pub struct MemoryStore {
    pub state: Option<CycleState>,
    pub holds: Holds,
    /// What the pool's other slots held when the dry-run read their state (nothing for a
    /// fixture).
    pub others: Others,
    /// The pool's failure backoff as the dry-run read it (a fresh one for a fixture).
    pub backoff: crate::core::backoff::Backoff,
}

impl StateStore for MemoryStore {
    fn load_backoff(&mut self) -> Result<crate::core::backoff::Backoff> {
        Ok(self.backoff.clone())
    }

    fn save_backoff(&mut self, backoff: &crate::core::backoff::Backoff) -> Result<()> {
        self.backoff = backoff.clone();
        Ok(())
    }

    fn others(&mut self) -> Result<Others> {
        Ok(self.others.clone())
    }

    fn load(&mut self) -> Result<Option<CycleState>> {
        Ok(self.state.clone())
    }

    fn save(&mut self, state: &CycleState) -> Result<()> {
        self.state = Some(state.clone());
        Ok(())
    }

    fn remove(&mut self) -> Result<()> {
        self.state = None;
        Ok(())
    }

    fn describe(&self) -> String {
        "cycle state (in memory, dry-run)".into()
    }

    fn load_holds(&mut self) -> Result<Holds, HoldsError> {
        Ok(self.holds.clone())
    }

    fn save_holds(&mut self, holds: &Holds) -> Result<()> {
        self.holds = holds.clone();
        Ok(())
    }
}
