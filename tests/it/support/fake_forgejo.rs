//! A fake Forgejo (>= 15) for integration tests.
//!
//! It serves the Actions runner REST API (list/get/delete/register runners and the waiting-jobs
//! search) at the admin, user, org and repo scopes, with the wire behaviour of the real server as
//! recorded in the shared `forgejo-api.md` notes (sections 1, 2, 3 and 6): bare JSON arrays,
//! `X-Total-Count`/`Link` headers, the "no `page` means every row" quirk, the 60 s / 10 s status
//! computation, `null` labels before the runner connects, `null` for an empty jobs result, soft
//! deletes, `{"message","url"}` error bodies and the 401/403/404/422 codes.
//!
//! `/_fake/*` endpoints simulate a `forgejo-runner` process (connect, take a job, finish it,
//! disconnect); they authenticate with the runner's own token, not the API token. Which runner
//! is given which job, the status thresholds and the clean-up timeouts are Forgejo's, from
//! the one model (`forgejo-model/`, shared with the unit tests, the simulation and the
//! benchmarks' server).
//!
//! Faults can be injected per request (status codes, HTML pages, truncated or mistyped JSON,
//! delays, dropped connections, effects applied but the answer lost).
//!
//! Network layout: the public port is a small TCP relay in front of a `tiny_http` server. The
//! relay exists only so that a fault can close the client's socket without any response, which
//! `tiny_http` cannot do on its own (dropping a `tiny_http::Request` answers 500, and the
//! keep-alive connection stays open).

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use forgejo_model::{self as model, Assigned, Forgejo, JobRow, NewRunner, Scope, ScopeKind, rules};

/// `url` of every API error body.
pub const SWAGGER_URL: &str = "https://forgejo.invalid/api/swagger";
/// Default `ROOT_URL` used in `Link` headers.
pub const DEFAULT_ROOT_URL: &str = "http://forgejo.invalid/";
/// Answer of `GET /api/v1/version`.
pub const FORGEJO_VERSION: &str = "15.0.3+gitea-1.22.0";
/// Id of the user who owns the API token (the `/user/...` scope).
pub const TOKEN_USER_ID: i64 = 1;
/// Its name (it exists from the start; no other user, organization or repository does).
pub const TOKEN_USER_NAME: &str = "ci-admin";

const JSON_CONTENT_TYPE: &str = "application/json;charset=utf-8";
const WORKER_THREADS: usize = 8;

/// How a runner registration is connected, for seeding state.
#[derive(Clone, Debug, PartialEq)]
pub enum Conn {
    /// Registered, never ran Declare: `last_online = 0`, so `offline`; `version ""`, `labels null`.
    NeverConnected,
    /// Connected and polling (stays online), no job: `idle`.
    Idle,
    /// Connected, polling and running a job: `active`.
    Active,
    /// Connected once, stopped polling this long ago (was idle). `offline` only when > 60 s.
    OfflineFor(Duration),
}

#[derive(Clone, Debug)]
pub struct RunnerSnapshot {
    pub id: i64,
    pub uuid: String,
    pub name: String,
    /// The computed status (`offline`/`idle`/`active`); ignores `set_status_override`.
    pub status: String,
    pub ephemeral: bool,
    pub owner_id: i64,
    pub repo_id: i64,
}

#[derive(Clone, Debug)]
pub struct JobSnapshot {
    pub id: i64,
    pub handle: String,
    pub status: String,
    pub runs_on: Vec<String>,
    /// The runner that took the job, if any.
    pub runner_id: Option<i64>,
}

/// One request as received.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    /// Path without the query string, as sent (not percent-decoded).
    pub path: String,
    /// Raw query string without `?` ("" when none).
    pub query: String,
    pub authorization: Option<String>,
}

/// A fault for the next matching requests, see [`FakeForgejo::inject`].
#[derive(Clone, Debug)]
pub enum Fault {
    /// Answer this status with a JSON error body; nothing is applied.
    Status(u16),
    /// Answer this status with an HTML page (`text/html`); nothing is applied.
    Html(u16),
    /// Apply the request, answer 200 with the first half of the real body.
    Truncated,
    /// Sleep, then handle the request normally.
    Delay(Duration),
    /// Close the socket without any response; nothing is applied.
    DropConnection,
    /// Apply the request, then answer this status with a JSON error body.
    ApplyThenStatus(u16),
    /// Apply the request, then close the socket without any response.
    ApplyThenDrop,
    /// Apply the request, answer 200 with the real JSON where every `id`/`*_id` number is a
    /// string and every `status` is a number.
    WrongTypes,
    /// Answer 200 with exactly this body (`application/json` content type); nothing is applied.
    Body(String),
    /// Answer this status with exactly this body (`application/json`); nothing is applied.
    StatusBody(u16, String),
    /// Apply the request, then answer with these headers set (replacing any of the same name):
    /// an `X-Total-Count` that lies, a `Link` that loops.
    Headers(Vec<(&'static str, String)>),
    /// Apply the request, then set these fields in the JSON answer (in every element of an
    /// array answer); a `null` value removes the field.
    Patch(Value),
    /// Answer 200 with this body, its headers at once and then one byte every `every` (a server
    /// that drips past any timeout); nothing is applied.
    Drip { body: String, every: Duration },
}

// ---------------------------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------------------------

/// What the fake keeps with each runner row besides Forgejo's columns (`forgejo_model`).
#[derive(Clone, Debug, Default)]
struct FakeRow {
    status_override: Option<String>,
    token_presented: bool,
    /// `/_fake/disconnect` was called: the runner's process is gone (it died, or its VM was
    /// destroyed), so nothing it "sends" afterwards can reach Forgejo.
    process_gone: bool,
    /// `/_fake/connect?die=seen`: the process dies right after a `GET …/runners/{id}` showed it
    /// up (a runner that connects, is seen, and dies before its job; deterministic for tests).
    die_when_seen: bool,
}

type RunnerRow = model::RunnerRow<FakeRow>;

/// The model's JSON of the row (`RunnerRow::json`), with a test's status override applied.
fn runner_json(r: &RunnerRow, now: i64) -> Value {
    let mut v: Value = serde_json::from_str(&r.json(now)).expect("the model writes JSON");
    match r.extra.status_override.as_deref() {
        None => {}
        Some("") => {
            v.as_object_mut().expect("object").remove("status");
        }
        Some(s) => v["status"] = json!(s),
    }
    v
}

fn runner_snapshot(r: &RunnerRow, now: i64) -> RunnerSnapshot {
    RunnerSnapshot {
        id: r.id,
        uuid: r.uuid.clone(),
        name: r.name.clone(),
        status: r.status(now).to_string(),
        ephemeral: r.ephemeral,
        owner_id: r.owner_id,
        repo_id: r.repo_id,
    }
}

/// Seeds a row's connection state (test set-up, not an RPC).
fn apply_conn(r: &mut RunnerRow, conn: &Conn, now: i64) {
    match conn {
        Conn::NeverConnected => {
            r.version = String::new();
            r.labels = None;
            r.last_online = 0;
            r.last_active = 0;
            r.polling = false;
            r.busy = false;
        }
        Conn::Idle => {
            r.declare(None, now);
            r.busy = false;
            r.last_active = now - 3_600_000;
        }
        Conn::Active => {
            r.declare(None, now);
            r.busy = true;
            r.last_active = now;
        }
        Conn::OfflineFor(d) => {
            r.declare(None, now);
            r.polling = false;
            r.busy = false;
            r.last_online = now - d.as_millis() as i64;
            r.last_active = r.last_online - 3_600_000;
        }
    }
}

fn job_snapshot(j: &JobRow) -> JobSnapshot {
    JobSnapshot {
        id: j.id,
        handle: j.handle.clone(),
        status: j.status.clone(),
        runs_on: j.runs_on.clone(),
        runner_id: j.runner_id,
    }
}

struct FaultRule {
    method: String,
    path_contains: String,
    fault: Fault,
    remaining: usize,
}

struct World {
    token: String,
    read_only_token: Option<String>,
    root_url: String,
    /// Forgejo's rows and rules.
    forgejo: Forgejo<FakeRow>,
    deleted_ids: Vec<i64>,
    /// (id, name, computed status) of each API deletion, at the moment it happened.
    deletions: Vec<(i64, String, String)>,
    requests: Vec<Request>,
    faults: Vec<FaultRule>,
    rng: u64,
    /// Rows that tie on `last_online` are listed in an order hashed from it (see `list_runners`).
    tie_seed: u64,
    /// What `GET /api/v1/version` answers (`routers/api/v1/misc/version.go` `Version`:
    /// `{"version": setting.AppVer}`, e.g. `15.0.3+gitea-1.22.0`).
    forgejo_version: String,
}

/// A request as the handler needs it.
struct Incoming {
    method: String,
    url: String,
    path: String,
    query: String,
    authorization: Option<String>,
    runner_uuid: Option<String>,
    body: Vec<u8>,
}

/// A response before it is put on the wire.
struct Reply {
    status: u16,
    content_type: Option<&'static str>,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn json(status: u16, v: &Value) -> Reply {
        Reply {
            status,
            content_type: Some(JSON_CONTENT_TYPE),
            headers: Vec::new(),
            body: serde_json::to_vec(v).expect("serialize json"),
        }
    }

    /// Forgejo's `APIError` body.
    fn error(status: u16, message: &str) -> Reply {
        Reply::json(status, &json!({"message": message, "url": SWAGGER_URL}))
    }

    fn empty(status: u16) -> Reply {
        Reply {
            status,
            content_type: None,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    fn not_found() -> Reply {
        Reply::error(404, "not found")
    }

    fn method_not_allowed() -> Reply {
        Reply::error(405, "Method Not Allowed")
    }
}

enum Op {
    List,
    Register,
    Jobs,
    Get(i64),
    Delete(i64),
    RegistrationToken,
}

impl World {
    fn new(token: &str) -> World {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let count = COUNTER.fetch_add(1, Ordering::Relaxed);
        let seed = nanos
            ^ (u64::from(std::process::id()) << 32)
            ^ count.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        World {
            token: token.to_string(),
            read_only_token: None,
            root_url: DEFAULT_ROOT_URL.to_string(),
            forgejo: {
                let mut f = Forgejo::default();
                f.accounts
                    .add_account(Some(TOKEN_USER_ID), TOKEN_USER_NAME, false);
                f
            },
            deleted_ids: Vec::new(),
            deletions: Vec::new(),
            requests: Vec::new(),
            faults: Vec::new(),
            rng: seed | 1,
            tie_seed: seed.rotate_left(17),
            forgejo_version: FORGEJO_VERSION.to_string(),
        }
    }

    // -- randomness (xorshift64*) ---------------------------------------------------------------

    fn next_u64(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn random_bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        for chunk in out.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
        out
    }

    fn uuid_v4(&mut self) -> String {
        let mut b: [u8; 16] = self.random_bytes();
        b[6] = (b[6] & 0x0f) | 0x40;
        b[8] = (b[8] & 0x3f) | 0x80;
        let h = hex(&b);
        format!(
            "{}-{}-{}-{}-{}",
            &h[0..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..32]
        )
    }

    fn runner_token(&mut self) -> String {
        let b: [u8; 20] = self.random_bytes();
        hex(&b)
    }

    // -- rows -----------------------------------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    fn insert_runner(
        &mut self,
        id: Option<i64>,
        name: &str,
        description: &str,
        owner_id: i64,
        repo_id: i64,
        ephemeral: bool,
        conn: &Conn,
        now: i64,
    ) -> (i64, String, String) {
        let uuid = self.uuid_v4();
        let token = self.runner_token();
        let id = self.forgejo.register(NewRunner {
            id,
            uuid: uuid.clone(),
            token: token.clone(),
            name,
            description,
            owner_id,
            repo_id,
            ephemeral,
            extra: FakeRow::default(),
        });
        let row = self.forgejo.live_mut(id).expect("just registered");
        apply_conn(row, conn, now);
        (id, uuid, token)
    }

    /// Deletes a row (`DeleteRunner`); `via_api`: a DELETE request, recorded in `deleted_ids`.
    fn soft_delete(&mut self, id: i64, via_api: bool, now: i64) {
        self.forgejo.delete(id, now);
        if via_api {
            self.deleted_ids.push(id);
        }
    }

    fn take_fault(&mut self, method: &str, url: &str) -> Option<Fault> {
        let idx = self.faults.iter().position(|f| {
            f.remaining > 0
                && (f.method == "*" || f.method.eq_ignore_ascii_case(method))
                && url.contains(&f.path_contains)
        })?;
        let rule = &mut self.faults[idx];
        let fault = rule.fault.clone();
        if rule.remaining != usize::MAX {
            rule.remaining -= 1;
        }
        if rule.remaining == 0 {
            self.faults.remove(idx);
        }
        Some(fault)
    }

    // -- request handling -----------------------------------------------------------------------

    fn handle(&mut self, inc: &Incoming, now: i64) -> Reply {
        if let Some(action) = inc.path.strip_prefix("/_fake/") {
            return self.control(inc, action, now);
        }
        let Some(api) = inc.path.strip_prefix("/api/v1/") else {
            return Reply::not_found();
        };
        let segs: Vec<String> = api
            .split('/')
            .filter(|s| !s.is_empty())
            .map(|s| percent_decode(s, false))
            .collect();
        let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
        // The route, and the token scope its writes need; its scope is looked up after the
        // token's checks (`tokenRequiresScopes` comes before `orgAssignment`/`repoAssignment`,
        // routers/api/v1/api.go).
        enum Route<'a> {
            Admin,
            User,
            Org(&'a str),
            Repo(&'a str, &'a str),
        }
        let (route, write_scope, rest): (Route, &str, &[&str]) = match segs.as_slice() {
            ["version"] => {
                return if inc.method == "GET" {
                    Reply::json(200, &json!({"version": self.forgejo_version}))
                } else {
                    Reply::method_not_allowed()
                };
            }
            ["admin", "actions", "runners", rest @ ..] => (Route::Admin, "write:admin", rest),
            // Legacy path, deprecated in 15 but still routed.
            ["admin", "runners", "jobs"] => (Route::Admin, "write:admin", &["jobs"][..]),
            ["user", "actions", "runners", rest @ ..] => (Route::User, "write:user", rest),
            ["orgs", org, "actions", "runners", rest @ ..] => {
                (Route::Org(org), "write:organization", rest)
            }
            ["repos", owner, repo, "actions", "runners", rest @ ..] => {
                (Route::Repo(owner, repo), "write:repository", rest)
            }
            _ => return Reply::not_found(),
        };

        let method = inc.method.as_str();
        let op = match (rest, method) {
            ([], "GET") => Op::List,
            ([], "POST") => Op::Register,
            (["jobs"], "GET") => Op::Jobs,
            (["registration-token"], "GET") => Op::RegistrationToken,
            ([id], "GET") => Op::Get(parse_i64(id)),
            ([id], "DELETE") => Op::Delete(parse_i64(id)),
            ([] | [_], _) => return Reply::method_not_allowed(),
            _ => return Reply::not_found(),
        };

        // Authentication, then the read/write token scope check (by HTTP method).
        let presented = presented_token(inc.authorization.as_deref());
        let writable = match presented {
            Some(t) if t == self.token => true,
            Some(t) if self.read_only_token.as_deref() == Some(t) => false,
            _ => return Reply::error(401, "token is required"),
        };
        if !writable && method != "GET" {
            return Reply::error(
                403,
                &format!(
                    "token does not have at least one of required scope(s): [{}]",
                    write_scope
                ),
            );
        }

        // The scope's rows: an organization, owner or repository Forgejo does not know ends
        // the request before its handler (`Assigned`).
        let accounts = &self.forgejo.accounts;
        let assigned = match route {
            Route::Admin => Assigned::Scope(Scope::ADMIN),
            Route::User => Assigned::Scope(Scope {
                kind: ScopeKind::Owner,
                owner_id: TOKEN_USER_ID,
                repo_id: 0,
                repo_owner_id: 0,
            }),
            Route::Org(org) => accounts.assign_org(org),
            Route::Repo(owner, repo) => accounts.assign_repo(owner, repo, TOKEN_USER_ID),
        };
        let scope = match assigned {
            Assigned::Scope(s) => s,
            Assigned::NotFound { message, errors } => {
                return Reply::json(
                    404,
                    &json!({"message": message, "url": SWAGGER_URL, "errors": errors}),
                );
            }
            Assigned::Renamed { old, new } => {
                // `RedirectToUser`: the first occurrence of the old name in the escaped path
                // replaced by the new one, the query kept, 307.
                let mut to = inc.path.replacen(&old, &new, 1);
                if !inc.query.is_empty() {
                    to = format!("{to}?{}", inc.query);
                }
                let mut reply = Reply::empty(307);
                reply.headers.push(("Location", to));
                return reply;
            }
        };

        match op {
            Op::List => self.list_runners(inc, scope, now),
            Op::Register => self.register_runner(inc, scope, now),
            Op::Jobs => self.list_jobs(inc, scope),
            Op::Get(id) => match self.forgejo.live(id) {
                Some(r) if scope.sees(r) => {
                    let reply = Reply::json(200, &runner_json(r, now));
                    if r.extra.die_when_seen && r.status(now) != "offline" {
                        self.process_dies(id, now);
                    }
                    reply
                }
                _ => Reply::error(
                    404,
                    &format!("runner with ID {id}: resource does not exist"),
                ),
            },
            Op::Delete(id) => match self.forgejo.live(id) {
                Some(r) if scope.sees(r) => {
                    if !scope.edits(r) {
                        return Reply::error(404, "No permission to delete this runner");
                    }
                    // No busy check: Forgejo deletes active runners too.
                    let seen = (id, r.name.clone(), r.status(now).to_string());
                    self.deletions.push(seen);
                    self.soft_delete(id, true, now);
                    Reply::empty(204)
                }
                _ => Reply::error(
                    404,
                    &format!("runner with ID {id}: resource does not exist"),
                ),
            },
            Op::RegistrationToken => {
                // Deprecated in 15; a stable 43-character token per scope.
                let token = format!(
                    "FakeRegistrationToken{:0>22}",
                    format!("{}x{}", scope.owner_id, scope.repo_id)
                );
                Reply::json(200, &json!({ "token": token }))
            }
        }
    }

    /// `shared.ListRunners`.
    fn list_runners(&self, inc: &Incoming, scope: Scope, now: i64) -> Reply {
        let q = parse_query(&inc.query);
        let visible = go_parse_bool(first(&q, "visible"));
        let page = go_atoi(first(&q, "page"));
        let limit = self.forgejo.page_size(go_atoi(first(&q, "limit")));
        // `ToOrders` is only `last_online DESC` (models/actions/runner.go): rows that tie (every
        // never-connected one has 0) come in no promised order. Here their order is a hash of
        // the row and of the table's version: the same while nothing is added or deleted (as one
        // database plan would give), shuffled by every insert and delete, so pages read across a
        // change overlap or skip rows as they can on Forgejo.
        let tie_seed = self.tie_seed;
        let (rows, total) =
            self.forgejo
                .list_runners(now, &scope, visible, page, limit, |id, version| {
                    model::tie_key(id, version, tie_seed)
                });
        let total = total as i64;
        let shown: Vec<Value> = rows.iter().map(|r| runner_json(r, now)).collect();
        let mut reply = Reply::json(200, &Value::Array(shown));
        reply.headers = model::list_headers(&self.root_url, &inc.path, &q, total, limit, page);
        reply
    }

    /// `shared.RegisterRunner`.
    fn register_runner(&mut self, inc: &Incoming, scope: Scope, now: i64) -> Reply {
        let parsed: Option<Value> = serde_json::from_slice(&inc.body).ok();
        let obj = parsed.as_ref().and_then(Value::as_object);
        let name = obj
            .and_then(|o| o.get("name"))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty());
        let Some(name) = name.map(str::to_string) else {
            // `bind()` formats the field names of the error, a slice.
            return Reply::error(422, "[Name]: Required");
        };
        // `CreateRunner` cuts a name over 255 bytes (`rules::stored_runner_name`) and
        // the registration is created all the same (201).
        let description = obj
            .and_then(|o| o.get("description"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let ephemeral = obj
            .and_then(|o| o.get("ephemeral"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let (id, uuid, token) = self.insert_runner(
            None,
            &name,
            description,
            scope.owner_id,
            scope.repo_id,
            ephemeral,
            &Conn::NeverConnected,
            now,
        );
        Reply::json(201, &json!({"id": id, "uuid": uuid, "token": token}))
    }

    /// `shared.GetActionRunJobs`.
    fn list_jobs(&self, inc: &Incoming, scope: Scope) -> Reply {
        let q = parse_query(&inc.query);
        let labels: Option<Vec<&str>> = first(&q, "labels").map(|l| {
            if l.is_empty() {
                Vec::new()
            } else {
                l.split(',').collect()
            }
        });
        let matching = self.forgejo.list_jobs(&scope, labels.as_deref());
        let mut reply = Reply::json(200, &Value::Null);
        reply.body = model::jobs_json(&matching).into_bytes();
        reply
    }

    // -- simulated runner process ---------------------------------------------------------------

    fn control(&mut self, inc: &Incoming, action: &str, now: i64) -> Reply {
        if inc.method != "POST" {
            return Reply::method_not_allowed();
        }
        let token = String::from_utf8_lossy(&inc.body);
        let token = token.trim_end();
        let uuid = inc.runner_uuid.as_deref().unwrap_or("").trim();
        let id = self
            .forgejo
            .runners
            .values()
            .find(|r| !r.deleted && !uuid.is_empty() && r.uuid == uuid && r.token == token)
            .map(|r| r.id);
        let Some(id) = id else {
            return Reply::error(401, "unregistered runner");
        };
        if self
            .forgejo
            .runners
            .get(&id)
            .is_some_and(|r| r.extra.process_gone)
        {
            // A request a dead process could not have sent (a test poller that lost the race
            // against its VM's destroy): it changes nothing.
            return Reply::error(410, "this runner's process is gone");
        }
        let q = parse_query(&inc.query);
        // forgejo-runner parses every --label before it contacts Forgejo, and does not start on
        // one it refuses (`rules::declared_names`): such a "runner" never reached Forgejo.
        let labels = match first(&q, "labels").map(rules::declared_names).transpose() {
            Ok(labels) => labels,
            Err(e) => return Reply::error(400, &format!("invalid configuration: {e}")),
        };
        if let Some(r) = self.forgejo.runners.get_mut(&id) {
            r.extra.token_presented = true;
        }
        let handle = first(&q, "handle").filter(|h| !h.is_empty());
        match action {
            "connect" => {
                let die_when_seen = first(&q, "die") == Some("seen");
                let r = self.forgejo.live_mut(id).expect("runner exists");
                r.extra.die_when_seen = die_when_seen;
                r.declare(labels, now);
                let status = r.status(now);
                Reply::json(200, &json!({"runner_id": id, "status": status}))
            }
            "take" => match self.take(id, handle, labels, now) {
                Ok(job_id) => Reply::json(200, &self.control_job_json(id, job_id)),
                Err(reply) => reply,
            },
            "finish" => match self.finish(id, now) {
                Ok(job_id) => Reply::json(200, &self.control_job_json(id, job_id)),
                Err(reply) => reply,
            },
            "one-job" => {
                let job_id = match self.take(id, handle, labels, now) {
                    Ok(job_id) => job_id,
                    Err(reply) => return reply,
                };
                match self.finish(id, now) {
                    Ok(_) => Reply::json(200, &self.control_job_json(id, job_id)),
                    Err(reply) => reply,
                }
            }
            // SIGTERM to `one-job`: a running task is cancelled and reported `failure`, and
            // Forgejo deletes the ephemeral runner at once (`Forgejo::terminate`); the process
            // then exits.
            "terminate" => {
                let deleted = self.forgejo.terminate(id, now).is_some();
                self.process_dies(id, now);
                Reply::json(200, &json!({"runner_id": id, "runner_deleted": deleted}))
            }
            "disconnect" => {
                self.process_dies(id, now);
                let status = self.forgejo.runners[&id].status(now);
                Reply::json(200, &json!({"runner_id": id, "status": status}))
            }
            _ => Reply::not_found(),
        }
    }

    fn control_job_json(&self, runner_id: i64, job_id: i64) -> Value {
        let job = &self.forgejo.jobs[&job_id];
        let runner_deleted = self.forgejo.live(runner_id).is_none();
        json!({
            "runner_id": runner_id,
            "runner_deleted": runner_deleted,
            "job_id": job_id,
            "handle": job.handle,
            "task_id": job.task_id,
            "status": job.status,
        })
    }

    /// FetchTask / FetchSingleTask: the runner declares itself if needed, then is given the
    /// job Forgejo's rule picks for it (`rules::pick`: waiting, not queued behind its
    /// concurrency group, in scope, its handle, its labels).
    fn take(
        &mut self,
        id: i64,
        handle: Option<&str>,
        labels: Option<Vec<String>>,
        now: i64,
    ) -> Result<i64, Reply> {
        let r = self.forgejo.live_mut(id).expect("runner exists");
        if r.labels.is_none() || r.version.is_empty() || labels.is_some() {
            r.declare(labels, now);
        }
        r.last_online = now;
        let ephemeral = r.ephemeral;
        if ephemeral && self.forgejo.has_had_task(id) {
            return Err(Reply::error(
                409,
                "no task: ephemeral runner already has an assigned task",
            ));
        }
        let Some(job_id) = self.forgejo.task_for(id, handle) else {
            return Err(Reply::error(409, "no task available"));
        };
        self.forgejo.start_task(job_id, id, now);
        Ok(job_id)
    }

    /// The runner's process is gone (it died, or its VM was destroyed): offline at once (a
    /// shortcut: Forgejo waits 60 s after the last contact, so its last RPC is dated two
    /// minutes back), and nothing more comes from it.
    fn process_dies(&mut self, id: i64, now: i64) {
        let Some(r) = self.forgejo.live_mut(id) else {
            return;
        };
        r.extra.process_gone = true;
        r.stops_polling(now - 2 * rules::OFFLINE_AFTER_MS);
    }

    /// Final UpdateTask: the job succeeds; an ephemeral runner is deleted by Forgejo.
    fn finish(&mut self, id: i64, now: i64) -> Result<i64, Reply> {
        let Some(job_id) = self.forgejo.running_job_of(id) else {
            return Err(Reply::error(409, "runner holds no running task"));
        };
        self.forgejo.final_update_task(job_id, now);
        Ok(job_id)
    }
}

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

/// Where the fake delivers its webhooks, and what came of each delivery.
#[derive(Default)]
struct Webhooks {
    /// The hook's URL and secret (`FakeForgejo::set_webhook`).
    target: Option<(String, String)>,
    sent: Vec<SentDelivery>,
}

/// One webhook delivery the fake sent, and its answer (`Err`: no answer, and why).
#[derive(Clone, Debug)]
pub struct SentDelivery {
    pub uuid: String,
    /// The job whose push it announced (`None`: a push sent on its own).
    pub job_id: Option<i64>,
    pub answer: Result<(u16, String), String>,
}

struct Shared {
    world: Mutex<World>,
    webhooks: Arc<Mutex<Webhooks>>,
    /// Relay connections by the relay's upstream local address (= what `tiny_http` reports as
    /// the remote address), holding the client-side socket so a fault can close it.
    conns: Mutex<HashMap<SocketAddr, TcpStream>>,
    stop: AtomicBool,
}

impl Shared {
    fn world(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn conns(&self) -> MutexGuard<'_, HashMap<SocketAddr, TcpStream>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The fake server. Dropping it stops the server threads and closes open connections.
pub struct FakeForgejo {
    shared: Arc<Shared>,
    addr: SocketAddr,
    threads: Vec<JoinHandle<()>>,
}

impl FakeForgejo {
    /// Binds 127.0.0.1 on a free port and serves on background threads.
    pub fn start(token: &str) -> FakeForgejo {
        // TCP_NODELAY on the listener (accepted sockets inherit it on Linux): tiny_http writes
        // headers and body separately, and Nagle + delayed ACKs would add 40 ms per request.
        let listener = TcpListener::bind("127.0.0.1:0").expect("fake forgejo: bind backend");
        {
            use std::os::fd::AsRawFd;
            let one: libc::c_int = 1;
            // SAFETY: setsockopt on a socket we own, with a valid c_int.
            unsafe {
                libc::setsockopt(
                    listener.as_raw_fd(),
                    libc::IPPROTO_TCP,
                    libc::TCP_NODELAY,
                    (&one as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
        let backend = Arc::new(
            tiny_http::Server::from_listener(listener, None).expect("fake forgejo: bind backend"),
        );
        let backend_addr = backend
            .server_addr()
            .to_ip()
            .expect("fake forgejo: backend is TCP");
        let front = TcpListener::bind("127.0.0.1:0").expect("fake forgejo: bind");
        let addr = front.local_addr().expect("fake forgejo: local addr");
        let shared = Arc::new(Shared {
            world: Mutex::new(World::new(token)),
            webhooks: Arc::default(),
            conns: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
        });

        let mut threads = Vec::new();
        {
            let shared = shared.clone();
            threads.push(
                thread::Builder::new()
                    .name("fake-forgejo-accept".into())
                    .spawn(move || accept_loop(&shared, &front, backend_addr))
                    .expect("spawn"),
            );
        }
        for i in 0..WORKER_THREADS {
            let shared = shared.clone();
            let backend = backend.clone();
            threads.push(
                thread::Builder::new()
                    .name(format!("fake-forgejo-worker-{i}"))
                    .spawn(move || {
                        while !shared.stop.load(Ordering::SeqCst) {
                            match backend.recv_timeout(Duration::from_millis(50)) {
                                Ok(Some(rq)) => serve(&shared, rq),
                                Ok(None) => {}
                                Err(_) => break,
                            }
                        }
                    })
                    .expect("spawn"),
            );
        }
        FakeForgejo {
            shared,
            addr,
            threads,
        }
    }

    fn world(&self) -> MutexGuard<'_, World> {
        self.shared.world()
    }

    /// `http://127.0.0.1:PORT`, no trailing slash.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A second token that may GET but gets 403 on POST/DELETE.
    pub fn set_read_only_token(&self, token: &str) {
        self.world().read_only_token = Some(token.to_string());
    }

    /// `ROOT_URL` for `Link` headers (default `http://forgejo.invalid/`); a missing trailing
    /// slash is added.
    pub fn set_root_url(&self, root_url: &str) {
        let mut root = root_url.to_string();
        if !root.ends_with('/') {
            root.push('/');
        }
        self.world().root_url = root;
    }

    /// An organization Forgejo knows from now on; its id. Until a test creates one, no
    /// organization, user (but the token's, `TOKEN_USER_NAME`) or repository exists: its routes
    /// answer 404 as Forgejo does (`forgejo_model::Accounts`).
    pub fn add_org(&self, name: &str) -> i64 {
        self.world().forgejo.accounts.add_account(None, name, true)
    }

    /// A user (not the token's); its id.
    pub fn add_user(&self, name: &str) -> i64 {
        self.world().forgejo.accounts.add_account(None, name, false)
    }

    /// A repository `owner/name` (the owner must exist), Actions enabled; its id.
    pub fn add_repo(&self, owner_repo: &str) -> i64 {
        let (owner, name) = owner_repo
            .split_once('/')
            .unwrap_or_else(|| panic!("fake forgejo: {owner_repo} is not OWNER/NAME"));
        self.world().forgejo.accounts.add_repo(owner, name)
    }

    /// The id of an organization or user. Panics on an unknown name.
    pub fn org_id(&self, name: &str) -> i64 {
        self.world()
            .forgejo
            .accounts
            .by_name(name)
            .unwrap_or_else(|| panic!("fake forgejo: no organization or user {name}"))
            .id
    }

    /// The id of a repository `owner/name`. Panics on an unknown one.
    pub fn repo_id(&self, owner_repo: &str) -> i64 {
        let (owner, name) = owner_repo.split_once('/').unwrap_or((owner_repo, ""));
        self.world()
            .forgejo
            .accounts
            .repo(owner, name)
            .unwrap_or_else(|| panic!("fake forgejo: no repository {owner_repo}"))
            .id
    }

    /// Renames an organization or user: its runners stay its own. With `redirect`, the old
    /// name's routes answer 307 to the new one's; without, the redirect is gone (more renames
    /// than `[service] MAX_USER_REDIRECTS` keeps) and they answer 404.
    pub fn rename_owner(&self, old: &str, new: &str, redirect: bool) {
        self.world().forgejo.accounts.rename(old, new, redirect);
    }

    /// Deletes an organization or user, and its runners with it (as Forgejo does).
    pub fn delete_owner(&self, name: &str) {
        let now = now_ms();
        self.world().forgejo.delete_account(name, now);
    }

    /// Turns a repository's Actions unit off or on: off, its runner routes answer 404.
    pub fn set_repo_actions(&self, owner_repo: &str, enabled: bool) {
        let id = self.repo_id(owner_repo);
        if let Some(r) = self.world().forgejo.accounts.repos.get_mut(&id) {
            r.actions = enabled;
        }
    }

    /// An instance-scope runner (owner 0, repo 0).
    pub fn add_runner(&self, name: &str, ephemeral: bool, conn: Conn) -> i64 {
        self.add_scoped_runner(name, 0, 0, ephemeral, conn)
    }

    /// An instance-scope runner with this id; later ids continue after it.
    pub fn add_runner_with_id(&self, id: i64, name: &str, ephemeral: bool, conn: Conn) -> i64 {
        let now = now_ms();
        self.world()
            .insert_runner(Some(id), name, "", 0, 0, ephemeral, &conn, now)
            .0
    }

    pub fn add_scoped_runner(
        &self,
        name: &str,
        owner_id: i64,
        repo_id: i64,
        ephemeral: bool,
        conn: Conn,
    ) -> i64 {
        let now = now_ms();
        self.world()
            .insert_runner(None, name, "", owner_id, repo_id, ephemeral, &conn, now)
            .0
    }

    /// Changes the connection state of a (not deleted) runner. Panics on an unknown id.
    pub fn set_conn(&self, id: i64, conn: Conn) {
        let now = now_ms();
        let mut w = self.world();
        let r = w
            .forgejo
            .live_mut(id)
            .unwrap_or_else(|| panic!("fake forgejo: no runner {id}"));
        apply_conn(r, &conn, now);
    }

    /// A waiting job in repo 1 owned by user 1; returns `(id, handle)`.
    pub fn add_job(&self, runs_on: &[&str]) -> (i64, String) {
        self.add_scoped_job(runs_on, TOKEN_USER_ID, 1)
    }

    /// A waiting job with this owner/repo; returns `(id, handle)`. With a webhook set, the push
    /// that created it is delivered (from a thread of its own, as Forgejo's queue does).
    pub fn add_scoped_job(&self, runs_on: &[&str], owner_id: i64, repo_id: i64) -> (i64, String) {
        let (id, handle) = {
            let mut w = self.world();
            let handle = w.uuid_v4();
            let runs_on = runs_on.iter().map(|s| s.to_string()).collect();
            let id = w
                .forgejo
                .add_job(handle.clone(), runs_on, owner_id, repo_id, now_ms());
            (id, handle)
        };
        self.deliver_push(Some(id), owner_id, repo_id);
        (id, handle)
    }

    /// From now on every job added is announced by a signed push delivery to `url` (Forgejo's
    /// `forgejo` webhook with this secret; "" sends it unsigned, as a hook without one).
    pub fn set_webhook(&self, url: &str, secret: &str) {
        let mut h = self.shared.webhooks.lock().unwrap();
        h.target = Some((url.to_string(), secret.to_string()));
    }

    /// No more deliveries from now on.
    pub fn clear_webhook(&self) {
        self.shared.webhooks.lock().unwrap().target = None;
    }

    /// A push delivered now with no job yet (Forgejo sends the push's webhook before its Actions
    /// notifier has written the jobs: `routers/init.go` registers the webhook notifier first).
    /// Returns its uuid; panics without a webhook.
    pub fn send_push(&self, owner_id: i64, repo_id: i64) -> String {
        assert!(
            self.shared.webhooks.lock().unwrap().target.is_some(),
            "fake forgejo: no webhook set"
        );
        self.deliver_push(None, owner_id, repo_id)
            .expect("a webhook is set")
    }

    /// Every delivery that was answered (or failed) so far, in that order.
    pub fn deliveries(&self) -> Vec<SentDelivery> {
        self.shared.webhooks.lock().unwrap().sent.clone()
    }

    /// Delivers a push announcing `job_id` when a webhook is set; its uuid.
    fn deliver_push(&self, job_id: Option<i64>, owner_id: i64, repo_id: i64) -> Option<String> {
        let (url, secret) = self.shared.webhooks.lock().unwrap().target.clone()?;
        let uuid = self.world().uuid_v4();
        let after = model::webhook::hex(&model::webhook::sha256(uuid.as_bytes()));
        let payload = model::webhook::push_payload(repo_id, owner_id, &after[..40]);
        let d = model::webhook::delivery(&secret, &uuid, "push", "push", &payload);
        let hooks = self.shared.webhooks.clone();
        thread::spawn(move || {
            let answer = super::webhook::deliver(&url, &d).map_err(|e| e.to_string());
            hooks.lock().unwrap().sent.push(SentDelivery {
                uuid: d.uuid,
                job_id,
                answer,
            });
        });
        Some(uuid)
    }

    /// Reruns a done job (the web UI's "Re-run", `services/actions/rerun.go` `RerunJob`): a new
    /// attempt with a new handle, `waiting` (`forgejo_model::Forgejo::rerun_job`). Returns the
    /// new handle; panics when the job is unknown or not done (Forgejo refuses that rerun).
    pub fn rerun_job(&self, job_id: i64) -> String {
        let mut w = self.world();
        let handle = w.uuid_v4();
        assert!(
            w.forgejo.rerun_job(job_id, handle.clone(), now_ms()),
            "fake forgejo: job {job_id} is unknown or not done, so it cannot be rerun"
        );
        handle
    }

    /// The `cancel_abandoned_jobs` cron with this `ABANDONED_JOB_TIMEOUT` (Forgejo's default is
    /// 24 h, `rules::ABANDONED_JOB_TIMEOUT_MS`): every job still waiting or blocked whose
    /// row is older is cancelled. Returns the jobs cancelled.
    pub fn cancel_abandoned_jobs(&self, older_than: Duration) -> Vec<i64> {
        let mut w = self.world();
        w.forgejo
            .cancel_abandoned_jobs(now_ms(), older_than.as_millis() as i64)
    }

    /// What `GET /api/v1/version` answers from now on (`FORGEJO_VERSION` until then).
    pub fn set_forgejo_version(&self, version: &str) {
        self.world().forgejo_version = version.to_string();
    }

    /// Queues a job's run behind another run of its concurrency group (`true`), or lets it go
    /// (`false`). A queued job is still listed `waiting` by the REST jobs list, but Forgejo gives
    /// it to no runner (`CONCURRENCY_GROUP_QUEUE_ENABLED`, on by default). Panics on an unknown id.
    pub fn set_job_queued(&self, job_id: i64, queued: bool) {
        let mut w = self.world();
        let job = w
            .forgejo
            .jobs
            .get_mut(&job_id)
            .unwrap_or_else(|| panic!("fake forgejo: no job {job_id}"));
        job.queued_behind = queued;
    }

    /// The `stop_endless_tasks` cron with this `ENDLESS_TASK_TIMEOUT` (Forgejo's default is
    /// 3 h, `rules::ENDLESS_TASK_TIMEOUT_MS`): every task running longer fails, and its
    /// ephemeral runner is deleted (`StopTask`), while the runner's process may still run.
    /// Returns the jobs stopped.
    pub fn stop_endless_tasks(&self, older_than: Duration) -> Vec<i64> {
        let now = now_ms();
        let mut w = self.world();
        let endless = w.forgejo.endless_tasks(now, older_than.as_millis() as i64);
        for id in &endless {
            w.forgejo.stop_task(*id, "failure", now);
        }
        endless
    }

    /// Sets a job's status (`waiting`, `running`, `success`, `failure`, `cancelled`,
    /// `skipped`, `blocked`). A running job that ends this way (a cancel, say) stops its task,
    /// and Forgejo deletes the ephemeral runner that had it (`StopTask`). Panics on an unknown id.
    pub fn set_job_status(&self, job_id: i64, status: &str) {
        let now = now_ms();
        let mut w = self.world();
        let job = w
            .forgejo
            .jobs
            .get_mut(&job_id)
            .unwrap_or_else(|| panic!("fake forgejo: no job {job_id}"));
        if job.is_running() && model::is_done(status) {
            w.forgejo.stop_task(job_id, status, now);
        } else {
            job.status = status.to_string();
        }
    }

    /// Runners not deleted, id ascending.
    pub fn runners(&self) -> Vec<RunnerSnapshot> {
        let now = now_ms();
        self.world()
            .forgejo
            .runners
            .values()
            .filter(|r| !r.deleted)
            .map(|r| runner_snapshot(r, now))
            .collect()
    }

    /// A runner that is not deleted.
    pub fn runner(&self, id: i64) -> Option<RunnerSnapshot> {
        let now = now_ms();
        self.world()
            .forgejo
            .live(id)
            .map(|r| runner_snapshot(r, now))
    }

    /// Ids deleted through the API's DELETE, in order (not Forgejo's own ephemeral deletions).
    pub fn deleted_ids(&self) -> Vec<i64> {
        self.world().deleted_ids.clone()
    }

    /// Every runner token the fake ever issued (deleted registrations included).
    pub fn issued_tokens(&self) -> Vec<String> {
        self.world()
            .forgejo
            .runners
            .values()
            .map(|r| r.token.clone())
            .collect()
    }

    /// Every API deletion as (id, name, status the runner had when it was deleted), in order.
    pub fn deletions(&self) -> Vec<(i64, String, String)> {
        self.world().deletions.clone()
    }

    /// All jobs, id ascending.
    pub fn jobs(&self) -> Vec<JobSnapshot> {
        self.world()
            .forgejo
            .jobs
            .values()
            .map(job_snapshot)
            .collect()
    }

    /// Every request received, in order, including `/_fake/*` ones.
    pub fn requests(&self) -> Vec<Request> {
        self.world().requests.clone()
    }

    pub fn clear_requests(&self) {
        self.world().requests.clear();
    }

    /// The next `times` requests (`usize::MAX` = all) whose method equals `method` (any case;
    /// `"*"` = any method) and whose URL (path and query) contains `path_contains` get `fault`.
    /// Rules are matched in the order they were added.
    pub fn inject(&self, method: &str, path_contains: &str, fault: Fault, times: usize) {
        if times == 0 {
            return;
        }
        self.world().faults.push(FaultRule {
            method: method.to_string(),
            path_contains: path_contains.to_string(),
            fault,
            remaining: times,
        });
    }

    pub fn clear_faults(&self) {
        self.world().faults.clear();
    }

    /// Forces the JSON `status` of a runner: `Some("weird")` sends that string, `Some("")`
    /// omits the field, `None` goes back to the computed value.
    pub fn set_status_override(&self, id: i64, status: Option<&str>) {
        let mut w = self.world();
        let r = w
            .forgejo
            .runners
            .get_mut(&id)
            .unwrap_or_else(|| panic!("fake forgejo: no runner {id}"));
        r.extra.status_override = status.map(str::to_string);
    }

    /// True once a `/_fake/*` endpoint was called with this runner's correct token.
    pub fn token_was_presented(&self, id: i64) -> bool {
        self.world()
            .forgejo
            .runners
            .get(&id)
            .is_some_and(|r| r.extra.token_presented)
    }
}

impl Drop for FakeForgejo {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = TcpStream::connect(self.addr);
        let accept = self.threads.remove(0);
        let _ = accept.join();
        for (_, s) in self.shared.conns().drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Accepts client connections and relays each one to the `tiny_http` backend.
fn accept_loop(shared: &Arc<Shared>, front: &TcpListener, backend: SocketAddr) {
    for client in front.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(client) = client else { continue };
        let Ok(upstream) = TcpStream::connect(backend) else {
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        let (Ok(key), Ok(client_w), Ok(upstream_w), Ok(client_keep)) = (
            upstream.local_addr(),
            client.try_clone(),
            upstream.try_clone(),
            client.try_clone(),
        ) else {
            continue;
        };
        shared.conns().insert(key, client_keep);
        // client -> backend
        let _ = thread::Builder::new()
            .name("fake-forgejo-relay-up".into())
            .spawn(move || {
                let mut from = client;
                let mut to = upstream_w;
                let _ = std::io::copy(&mut from, &mut to);
                let _ = to.shutdown(Shutdown::Write);
            });
        // backend -> client
        let shared2 = shared.clone();
        let _ = thread::Builder::new()
            .name("fake-forgejo-relay-down".into())
            .spawn(move || {
                let mut from = upstream;
                let mut to = client_w;
                let _ = std::io::copy(&mut from, &mut to);
                let _ = to.shutdown(Shutdown::Both);
                let _ = from.shutdown(Shutdown::Both);
                shared2.conns().remove(&key);
            });
    }
}

/// Handles one request on a worker thread.
fn serve(shared: &Shared, mut rq: tiny_http::Request) {
    let url = rq.url().to_string();
    let (path, query) = match url.split_once('?') {
        Some((p, q)) => (p.to_string(), q.to_string()),
        None => (url.clone(), String::new()),
    };
    let header = |name: &'static str| {
        rq.headers()
            .iter()
            .find(|h| h.field.equiv(name))
            .map(|h| h.value.as_str().to_string())
    };
    let authorization = header("Authorization");
    let runner_uuid = header("X-Runner-UUID");
    let mut body = Vec::new();
    let _ = rq.as_reader().read_to_end(&mut body);
    let inc = Incoming {
        method: rq.method().as_str().to_ascii_uppercase(),
        url,
        path,
        query,
        authorization,
        runner_uuid,
        body,
    };

    let fault = {
        let mut w = shared.world();
        w.requests.push(Request {
            method: inc.method.clone(),
            path: inc.path.clone(),
            query: inc.query.clone(),
            authorization: inc.authorization.clone(),
        });
        w.take_fault(&inc.method, &inc.url)
    };

    // Faults that answer without reaching "Forgejo".
    match &fault {
        Some(Fault::DropConnection) => return drop_connection(shared, rq),
        Some(Fault::Status(code)) => {
            return send(
                rq,
                Reply::error(*code, &format!("fake forgejo: injected status {code}")),
            );
        }
        Some(Fault::Html(code)) => return send(rq, html_reply(*code)),
        Some(Fault::Body(s)) => {
            let mut reply = Reply::json(200, &Value::Null);
            reply.body = s.clone().into_bytes();
            return send(rq, reply);
        }
        Some(Fault::StatusBody(code, s)) => {
            let mut reply = Reply::json(*code, &Value::Null);
            reply.body = s.clone().into_bytes();
            return send(rq, reply);
        }
        Some(Fault::Delay(d)) => thread::sleep(*d),
        Some(Fault::Drip { body, every }) => return drip(rq, body.as_bytes(), *every),
        _ => {}
    }

    let reply = shared.world().handle(&inc, now_ms());

    match fault {
        Some(Fault::ApplyThenDrop) => drop_connection(shared, rq),
        Some(Fault::ApplyThenStatus(code)) => send(
            rq,
            Reply::error(code, &format!("fake forgejo: injected status {code}")),
        ),
        Some(Fault::Truncated) => {
            let mut reply = reply;
            reply.status = 200;
            reply.body.truncate(reply.body.len() / 2);
            reply.content_type = Some(JSON_CONTENT_TYPE);
            send(rq, reply)
        }
        Some(Fault::WrongTypes) => {
            let mut v: Value = serde_json::from_slice(&reply.body)
                .unwrap_or_else(|_| json!({"id": 0, "status": "unknown"}));
            mistype(&mut v);
            let mut wrong = Reply::json(200, &v);
            wrong.headers = reply.headers;
            send(rq, wrong)
        }
        Some(Fault::Headers(set)) => {
            let mut reply = reply;
            for (k, v) in set {
                reply
                    .headers
                    .retain(|(name, _)| !name.eq_ignore_ascii_case(k));
                reply.headers.push((k, v));
            }
            send(rq, reply)
        }
        Some(Fault::Patch(patch)) => {
            let mut reply = reply;
            if let Ok(mut v) = serde_json::from_slice::<Value>(&reply.body) {
                match &mut v {
                    Value::Array(items) => items.iter_mut().for_each(|i| apply_patch(i, &patch)),
                    other => apply_patch(other, &patch),
                }
                reply.body = serde_json::to_vec(&v).expect("serialize json");
            }
            send(rq, reply)
        }
        _ => send(rq, reply),
    }
}

/// Sets (or, for `null`, removes) the patch's fields in an object.
fn apply_patch(v: &mut Value, patch: &Value) {
    if let (Some(obj), Some(p)) = (v.as_object_mut(), patch.as_object()) {
        for (k, val) in p {
            if val.is_null() {
                obj.remove(k);
            } else {
                obj.insert(k.clone(), val.clone());
            }
        }
    }
}

/// Writes a 200 answer by hand: the headers at once, then the body one byte at a time, flushed,
/// every `every`; stops when the client has gone (or after 60 s).
fn drip(rq: tiny_http::Request, body: &[u8], every: Duration) {
    use std::io::Write;
    let mut w = rq.into_writer();
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {JSON_CONTENT_TYPE}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    if w.write_all(head.as_bytes())
        .and_then(|()| w.flush())
        .is_err()
    {
        return;
    }
    let start = std::time::Instant::now();
    for b in body {
        thread::sleep(every);
        if start.elapsed() > Duration::from_secs(60)
            || w.write_all(&[*b]).and_then(|()| w.flush()).is_err()
        {
            return;
        }
    }
}

/// Closes the client's socket without any response.
fn drop_connection(shared: &Shared, rq: tiny_http::Request) {
    if let Some(peer) = rq.remote_addr()
        && let Some(client) = shared.conns().remove(peer)
    {
        let _ = client.shutdown(Shutdown::Both);
    }
    // Release tiny_http's writer without writing anything (dropping `rq` would answer 500).
    drop(rq.into_writer());
}

fn send(rq: tiny_http::Request, reply: Reply) {
    let mut resp = tiny_http::Response::from_data(reply.body)
        .with_status_code(reply.status)
        .with_chunked_threshold(usize::MAX);
    if let Some(ct) = reply.content_type {
        resp.add_header(header("Content-Type", ct));
    }
    for (k, v) in &reply.headers {
        resp.add_header(header(k, v));
    }
    let _ = rq.respond(resp);
}

fn header(name: &str, value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("ASCII header")
}

fn html_reply(code: u16) -> Reply {
    let body = format!(
        "<!DOCTYPE html>\n<html><head><title>{code} Error</title></head>\
         <body><h1>{code}</h1><p>nginx: upstream error</p></body></html>\n"
    );
    Reply {
        status: code,
        content_type: Some("text/html; charset=utf-8"),
        headers: Vec::new(),
        body: body.into_bytes(),
    }
}

/// Ids become strings, statuses numbers.
fn mistype(v: &mut Value) {
    match v {
        Value::Array(items) => items.iter_mut().for_each(mistype),
        Value::Object(map) => {
            for (k, val) in map.iter_mut() {
                if (k == "id" || k.ends_with("_id")) && val.is_number() {
                    *val = Value::String(val.to_string());
                } else if k == "status" {
                    *val = json!(2);
                } else {
                    mistype(val);
                }
            }
        }
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `Authorization: token T` (exact scheme) or `Bearer T` (any case), as Forgejo accepts.
fn presented_token(auth: Option<&str>) -> Option<&str> {
    let (scheme, token) = auth?.split_once(' ')?;
    (scheme == "token" || scheme.eq_ignore_ascii_case("bearer")).then_some(token)
}

/// `ParamsInt64`: anything unparsable is 0.
fn parse_i64(s: &str) -> i64 {
    s.parse().unwrap_or(0)
}

fn percent_decode(s: &str, plus_as_space: bool) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex_val(bytes[i + 1]), hex_val(bytes[i + 2]))
        {
            out.push(h * 16 + l);
            i += 3;
            continue;
        }
        out.push(if plus_as_space && b == b'+' { b' ' } else { b });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Go `url.ParseQuery` (lenient): pairs in order, values decoded.
fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k, true), percent_decode(v, true))
        })
        .collect()
}

fn first<'a>(q: &'a [(String, String)], key: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// `ctx.FormInt`: `strconv.Atoi`, 0 on error.
fn go_atoi(s: Option<&str>) -> i64 {
    s.and_then(|s| s.parse::<i64>().ok()).unwrap_or(0)
}

/// `ctx.FormBool`: `strconv.ParseBool`, false on error.
fn go_parse_bool(s: Option<&str>) -> bool {
    matches!(s, Some("1" | "t" | "T" | "true" | "TRUE" | "True"))
}
