//! Forgejo's domain: what it tells us about runners and jobs, parsed defensively, and its rule
//! for which job runs on which runner. What may be deleted is `core::sweep::gate`'s.

use anyhow::anyhow;
use serde::Serialize;
use serde_json::Value;

/// A runner registration's `status` as Forgejo reported it. Only `Offline` can ever be deleted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum RunnerStatus {
    Offline,
    Idle,
    Active,
    /// A `status` we do not know (including other casings such as `"Offline"`): never deleted.
    Unknown(String),
    /// No `status` field at all: never deleted.
    Missing,
}

impl RunnerStatus {
    pub fn from_json(v: Option<&Value>) -> RunnerStatus {
        match v {
            None | Some(Value::Null) => RunnerStatus::Missing,
            Some(Value::String(s)) => match s.as_str() {
                "offline" => RunnerStatus::Offline,
                "idle" => RunnerStatus::Idle,
                "active" => RunnerStatus::Active,
                other => RunnerStatus::Unknown(other.to_string()),
            },
            Some(other) => RunnerStatus::Unknown(other.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            RunnerStatus::Offline => "offline",
            RunnerStatus::Idle => "idle",
            RunnerStatus::Active => "active",
            RunnerStatus::Unknown(s) => s,
            RunnerStatus::Missing => "(missing)",
        }
    }
}

/// One runner registration as listed or fetched. `name` is `None` when the field is missing or
/// not a string.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Runner {
    pub id: i64,
    pub name: Option<String>,
    pub status: RunnerStatus,
    /// The label names the runner declared when it connected (`GET …/runners/{id}` only; list
    /// rows leave it `None`). `Some` only once Forgejo shows the runner's `version`: Declare
    /// stores both at once, while any earlier request of the runner already makes it `idle` with
    /// no labels yet. `None` also when the field is missing or not a list of strings: unknown,
    /// so nothing is concluded from it. `Some` is also the proof that the runner connected.
    pub labels: Option<Vec<String>>,
}

impl Runner {
    /// Parses one runner object. A row without an integer `id` cannot be addressed, so it is an
    /// error; every other oddity (missing name, odd status) is kept and later refused by the gate.
    pub fn from_json(v: &Value) -> anyhow::Result<Runner> {
        let obj = v
            .as_object()
            .ok_or_else(|| anyhow!("runner entry is not a JSON object: {}", short(v)))?;
        let id = obj
            .get("id")
            .and_then(Value::as_i64)
            .ok_or_else(|| anyhow!("runner entry has no integer \"id\": {}", short(v)))?;
        let name = obj.get("name").and_then(Value::as_str).map(str::to_string);
        Ok(Runner {
            id,
            name,
            status: RunnerStatus::from_json(obj.get("status")),
            labels: None,
        })
    }

    /// [`Runner::from_json`] of one fetched runner, with the labels it declared — once it has
    /// declared itself: Forgejo shows a `version` (forgejo-runner always sends one, `dev` at
    /// least) from the same Declare that stores its labels (routers/api/actions/runner/runner.go).
    pub fn from_json_with_labels(v: &Value) -> anyhow::Result<Runner> {
        let mut r = Runner::from_json(v)?;
        let declared = v
            .get("version")
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty());
        if declared {
            r.labels = v.get("labels").and_then(declared_labels);
        }
        Ok(r)
    }
}

/// A runner's `labels`: the names it declared (Forgejo encodes "none" as `null`). Anything but
/// `null` or a list of strings is unknown (`None`).
fn declared_labels(v: &Value) -> Option<Vec<String>> {
    match v {
        Value::Null => Some(Vec::new()),
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().map(str::to_string))
            .collect(),
        _ => None,
    }
}

/// A job from `GET …/actions/runners/jobs`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Job {
    pub id: i64,
    pub handle: String,
    pub status: String,
    pub runs_on: Vec<String>,
    /// The job's repository and its owner (`repo_id`, `owner_id` of Forgejo's `ActionRunJob`):
    /// the trust boundary of `--reuse-within`. `None` when the list did not say (then the job
    /// shares a VM with no other).
    pub repo_id: Option<i64>,
    pub owner_id: Option<i64>,
}

impl Job {
    pub fn is_waiting(&self) -> bool {
        self.status == "waiting"
    }

    /// Waiting or running: the job still needs (or has) a runner.
    pub fn is_live(&self) -> bool {
        self.status == "waiting" || self.status == "running"
    }

    /// Whether a runner can ask for this job alone. An empty `--handle` is none at all:
    /// forgejo-runner's `one-job` then falls back to FetchTask and takes any job of its labels
    /// (`GetHandle` in internal/app/cmd/job.go, `Poll` in internal/app/poll/single.go), so a job
    /// listed without a handle (missing, `null` or empty) is never served.
    pub fn has_handle(&self) -> bool {
        !self.handle.is_empty()
    }

    pub fn from_json(v: &Value) -> anyhow::Result<Job> {
        let obj = v
            .as_object()
            .ok_or_else(|| anyhow!("job entry is not a JSON object: {}", short(v)))?;
        let id = obj
            .get("id")
            .and_then(Value::as_i64)
            .ok_or_else(|| anyhow!("job entry has no integer \"id\": {}", short(v)))?;
        let handle = match obj.get("handle") {
            Some(Value::String(s)) => s.clone(),
            None | Some(Value::Null) => String::new(),
            Some(other) => return Err(anyhow!("job {id} has a non-string \"handle\": {other}")),
        };
        let status = obj
            .get("status")
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow!("job {id} has no string \"status\""))?
            .to_string();
        let runs_on = match obj.get("runs_on") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| {
                    i.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| anyhow!("job {id} has a non-string entry in \"runs_on\""))
                })
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(anyhow!("job {id} has a non-array \"runs_on\": {other}")),
        };
        // Only a positive id names a repository or owner; anything else proves nothing.
        let positive = |key: &str| obj.get(key).and_then(Value::as_i64).filter(|n| *n > 0);
        Ok(Job {
            id,
            handle,
            status,
            runs_on,
            repo_id: positive("repo_id"),
            owner_id: positive("owner_id"),
        })
    }
}

/// Parses a jobs response: a JSON array, or `null` (Forgejo's encoding of "no jobs").
pub fn parse_jobs(body: &str) -> anyhow::Result<Vec<Job>> {
    let v: Value = serde_json::from_str(body).map_err(|e| anyhow!("jobs list is not JSON: {e}"))?;
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items.iter().map(Job::from_json).collect(),
        other => Err(anyhow!("jobs list is not a JSON array: {}", short(&other))),
    }
}

/// A runner row as a JSON value holding only `id`, `name` and `status` (what
/// `Runner::from_json` reads), and with `LABELS` also `labels`; its other fields are skipped
/// while parsing instead of being built and freed again. A row that is not an object is kept as
/// it is, so that it fails in `Runner::from_json` exactly as a full reading would.
pub struct SlimRow<const LABELS: bool>(pub Value);

/// A list row: what the sweep and the lost-POST lookup read.
pub type SlimRunner = SlimRow<false>;

/// A fixture row: also the labels, which a fetched runner shows.
pub type FixtureRunner = SlimRow<true>;

impl<'de, const LABELS: bool> serde::Deserialize<'de> for SlimRow<LABELS> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<SlimRow<LABELS>, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(field_identifier, rename_all = "lowercase")]
        enum Field {
            Id,
            Name,
            Status,
            Labels,
            #[serde(other)]
            Other,
        }
        struct Slim<const LABELS: bool>;
        impl<'de, const LABELS: bool> serde::de::Visitor<'de> for Slim<LABELS> {
            type Value = SlimRow<LABELS>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a runner")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<SlimRow<LABELS>, A::Error> {
                let mut obj = serde_json::Map::new();
                while let Some(field) = map.next_key::<Field>()? {
                    let key = match field {
                        Field::Id => "id",
                        Field::Name => "name",
                        Field::Status => "status",
                        Field::Labels if LABELS => "labels",
                        Field::Labels | Field::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                            continue;
                        }
                    };
                    obj.insert(key.to_string(), map.next_value::<Value>()?);
                }
                Ok(SlimRow(Value::Object(obj)))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> Result<SlimRow<LABELS>, A::Error> {
                use serde::Deserialize;
                Value::deserialize(serde::de::value::SeqAccessDeserializer::new(seq)).map(SlimRow)
            }
            fn visit_bool<E>(self, v: bool) -> Result<SlimRow<LABELS>, E> {
                Ok(SlimRow(Value::Bool(v)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<SlimRow<LABELS>, E> {
                Ok(SlimRow(Value::from(v)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<SlimRow<LABELS>, E> {
                Ok(SlimRow(Value::from(v)))
            }
            fn visit_f64<E>(self, v: f64) -> Result<SlimRow<LABELS>, E> {
                Ok(SlimRow(Value::from(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<SlimRow<LABELS>, E> {
                Ok(SlimRow(Value::from(v)))
            }
            fn visit_unit<E>(self) -> Result<SlimRow<LABELS>, E> {
                Ok(SlimRow(Value::Null))
            }
        }
        d.deserialize_any(Slim::<LABELS>)
    }
}

/// Parses a runner list page: a bare JSON array.
pub fn parse_runner_page(body: &str) -> anyhow::Result<Vec<Runner>> {
    // Quick reading first; anything it does not take is read again below for the precise error.
    if body.trim_start().starts_with('[')
        && let Ok(rows) = serde_json::from_str::<Vec<SlimRunner>>(body)
    {
        return rows.iter().map(|r| Runner::from_json(&r.0)).collect();
    }
    let v: Value =
        serde_json::from_str(body).map_err(|e| anyhow!("runner list is not JSON: {e}"))?;
    match v {
        Value::Array(items) => items.iter().map(Runner::from_json).collect(),
        other => Err(anyhow!(
            "runner list is not a JSON array: {}",
            short(&other)
        )),
    }
}

/// Forgejo's matching rule (`ActionRunJob.ItRunsOn`, models/actions/run_job.go): a job runs on
/// a runner when every entry of its `runs_on` is one of the runner's label names, and both name
/// at least one. A runner without labels is given no job at all.
pub fn job_matches(job: &Job, names: &[String]) -> bool {
    !names.is_empty()
        && !job.runs_on.is_empty()
        && job.runs_on.iter().all(|r| names.iter().any(|n| n == r))
}

/// The waiting jobs we could serve (with a handle), oldest (lowest id) first.
pub fn waiting_jobs<'a>(jobs: &'a [Job], names: &[String]) -> Vec<&'a Job> {
    let mut w: Vec<&Job> = jobs
        .iter()
        .filter(|j| j.is_waiting() && j.has_handle() && job_matches(j, names))
        .collect();
    w.sort_by_key(|j| j.id);
    w
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 120 {
        let mut end = 120;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &s[..end])
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn declared_labels_are_read_from_a_fetched_runner_only_when_they_are_names() {
        let labels = |v: Value| Runner::from_json_with_labels(&v).unwrap().labels;
        let row = |l: Value| json!({"id": 1, "name": "x", "status": "idle", "version": "v12.8.2", "labels": l});
        assert_eq!(
            labels(row(json!(["debian", "docker"]))),
            Some(vec!["debian".into(), "docker".into()])
        );
        // Forgejo's encoding of none (a nil slice), and an empty list: declared none.
        assert_eq!(labels(row(Value::Null)), Some(vec![]));
        assert_eq!(labels(row(json!([]))), Some(vec![]));
        // Anything else is unknown: nothing may be concluded from it.
        assert_eq!(labels(row(json!([1]))), None);
        assert_eq!(labels(row(json!("debian"))), None);
        assert_eq!(
            labels(json!({"id": 1, "name": "x", "status": "idle", "version": "v12.8.2"})),
            None
        );
        // Before Declare (no version yet) the runner may already be idle: its labels are not
        // known yet, whatever the field says.
        for version in [json!(""), Value::Null, json!(7)] {
            let v =
                json!({"id": 1, "name": "x", "status": "idle", "version": version, "labels": null});
            assert_eq!(labels(v), None, "{version}");
        }
        let v = json!({"id": 1, "name": "x", "status": "idle", "labels": []});
        assert_eq!(labels(v), None, "no version at all");
        // A list row never carries them.
        assert_eq!(
            Runner::from_json(&row(json!(["debian"]))).unwrap().labels,
            None
        );
    }

    #[test]
    fn status_parsing_is_exact() {
        assert_eq!(
            RunnerStatus::from_json(Some(&json!("offline"))),
            RunnerStatus::Offline
        );
        assert_eq!(
            RunnerStatus::from_json(Some(&json!("OFFLINE"))),
            RunnerStatus::Unknown("OFFLINE".into())
        );
        assert_eq!(RunnerStatus::from_json(None), RunnerStatus::Missing);
        assert_eq!(
            RunnerStatus::from_json(Some(&Value::Null)),
            RunnerStatus::Missing
        );
        assert!(matches!(
            RunnerStatus::from_json(Some(&json!(3))),
            RunnerStatus::Unknown(_)
        ));
    }

    #[test]
    fn a_page_reads_the_same_as_through_full_json_values() {
        let full = |body: &str| -> Result<Vec<Runner>, String> {
            match serde_json::from_str::<Value>(body).map_err(|e| e.to_string())? {
                Value::Array(items) => items
                    .iter()
                    .map(|v| Runner::from_json(v).map_err(|e| e.to_string()))
                    .collect(),
                _ => Err("not an array".into()),
            }
        };
        let row = r#"{"id": 1, "uuid": "u", "name": "ephemeral-1", "status": "offline", "labels": ["a", {"b": [1]}], "ephemeral": true}"#;
        for body in [
            format!("[{row}]"),
            format!("[{row}, {row}]"),
            r#"[{"id": 2, "name": 7, "status": "Offline"}, {"id": 3, "status": null}, {"id": 4, "name": "x"}]"#.into(),
            r#"[{"id": 3, "name": "x", "status": "idle", "id": 4, "name": "y"}]"#.into(),
            r#"[{"id": 5, "name": "x", "status": {"a": 1}}, {"id": 6, "name": "y", "status": [1]}]"#.into(),
            r#"[{"name": "no-id", "status": "idle"}]"#.into(),
            r#"[{"id": "7", "name": "x"}]"#.into(),
            format!("[{row}, 5]"),
            format!("[{row}, [1]]"),
            format!("[{row}, null]"),
            "[]".into(),
        ] {
            match (parse_runner_page(&body), full(&body)) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{body}"),
                (Err(_), Err(_)) => {}
                (a, b) => panic!("{body}: {a:?} against {b:?}"),
            }
        }
    }

    #[test]
    fn runner_rows_parse_defensively() {
        let r = Runner::from_json(
            &json!({"id": 5, "name": "ephemeral-x", "status": "offline", "labels": null}),
        )
        .unwrap();
        assert_eq!(r.id, 5);
        assert_eq!(r.status, RunnerStatus::Offline);
        let r = Runner::from_json(&json!({"id": 6, "name": 7})).unwrap();
        assert_eq!(r.name, None);
        assert_eq!(r.status, RunnerStatus::Missing);
        assert!(Runner::from_json(&json!({"id": "6"})).is_err());
        assert!(Runner::from_json(&json!([1])).is_err());
        assert!(parse_runner_page("{\"runners\": []}").is_err());
        assert!(parse_runner_page("<html>").is_err());
        assert_eq!(parse_runner_page("[]").unwrap(), vec![]);
    }

    #[test]
    fn jobs_null_is_empty_and_matching_is_subset() {
        assert!(parse_jobs("null").unwrap().is_empty());
        assert!(parse_jobs("{}").is_err());
        let jobs = parse_jobs(
            r#"[{"id":9,"handle":"h9","status":"waiting","runs_on":["debian","docker"]},
                {"id":3,"handle":"h3","status":"waiting","runs_on":["debian"]},
                {"id":4,"handle":"h4","status":"running","runs_on":["debian"]},
                {"id":5,"handle":"h5","status":"waiting","runs_on":[]},
                {"id":6,"handle":"h6","status":"waiting","runs_on":["gpu"]}]"#,
        )
        .unwrap();
        let names = vec!["debian".to_string(), "docker".to_string()];
        let w: Vec<i64> = waiting_jobs(&jobs, &names).iter().map(|j| j.id).collect();
        assert_eq!(w, vec![3, 9]);
        // A job without a handle (missing, null, empty) is never one to serve.
        let no_handle = parse_jobs(
            r#"[{"id":1,"status":"waiting","runs_on":["debian"]},
                {"id":2,"handle":null,"status":"waiting","runs_on":["debian"]},
                {"id":7,"handle":"","status":"waiting","runs_on":["debian"]}]"#,
        )
        .unwrap();
        assert!(no_handle.iter().all(|j| !j.has_handle()));
        assert!(waiting_jobs(&no_handle, &names).is_empty());
        let only_debian = vec!["debian".to_string()];
        let w: Vec<i64> = waiting_jobs(&jobs, &only_debian)
            .iter()
            .map(|j| j.id)
            .collect();
        assert_eq!(w, vec![3]);
    }
}
