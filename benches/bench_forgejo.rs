//! A lean fake Forgejo for the benchmarks in `benches/run`: std and the model only, so its
//! release build is quick (`cargo build --release -p bench-forgejo`). Its rows and rules are the
//! tests' one model of Forgejo (the crate `forgejo-model/`, as the HTTP fake and the simulation
//! use it): registration, the runner list (`last_online DESC`, ties in no promised order,
//! Forgejo's paging, `X-Total-Count` and `Link`), live statuses, the JSON, deletion, the jobs
//! list and which job a runner is given. What it adds is speed: the list's order is computed
//! once per change of the rows, not per page, so that a page costs O(page) and a GET or DELETE
//! O(log n) — the server is never what is being measured.
//!
//! It serves the admin-scope runner API (`/api/v1/admin/actions/runners`: list pages, GET/DELETE
//! by id, POST, `/jobs`), answers on keep-alive connections (a thread per connection), and counts
//! every API request and every TCP connection that carried one. Control endpoints under
//! `/_bench/` are not counted.
//!
//! ```text
//! bench-forgejo serve --token T [--runners N --stale S --prefix P --no-live-ours] [--pickup JOBS] [--jobs M --job-ms L] [--arrivals N --job-ms L --lead-ms D --span-ms S --seed X --start-ns T] [--port-file F]
//! bench-launch   (the same binary under that name: the launch command of the pickup and slots benchmarks)
//! ```
//!
//! `--pickup JOBS` plays a queue of jobs for the job-pickup benchmark: a job becomes `waiting`
//! right after the server answered a jobs poll with an empty list while the VM was free, so the
//! next poll is one poll interval away; the launch command reports when it started, and its
//! runner, given its job by Forgejo's rule, runs it at once.
//!
//! `--arrivals … --hook ADDR --hook-secret S` also delivers each arrival's push to ADDR, signed
//! as Forgejo signs it, and records the answers (`deliveries` in the stats).
//!
//! `--arrivals N --job-ms L --lead-ms D --span-ms S --seed X [--start-ns T]` is the idle-pool
//! benchmark's schedule: N jobs become waiting one by one at seeded random moments in
//! D … D + S ms after T (Unix ns; without it, the `t` of the first `/_bench/start?t=T`), each
//! running L ms once a runner took it, as a batch's jobs do. The stats give each job's moments (waiting, first listed,
//! the poll of the process that served it, its POST, the launch, the task request, the end);
//! `/_bench/verify` checks the N jobs as it checks a batch.
//!
//! `--jobs M --job-ms L` is the parallel-slots benchmark's batch: `/_bench/batch` (refused while
//! a registration or an unfinished job is left) makes M jobs `waiting` at once. A launched runner
//! declares its labels and asks for a task as `forgejo-runner one-job --handle` does, and the
//! model decides which job it gets, if any; the job then runs for L ms (its registration
//! `active`), after which its final UpdateTask ends it (`success`, no longer listed) and
//! Forgejo deletes the ephemeral registration. `/_bench/verify` says whether every job of the
//! batch ran exactly once and nothing is left. With no arguments it only prints its usage.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use forgejo_model::{Forgejo, NewRunner, Scope, rules};

const API: &str = "/api/v1/admin/actions/runners";
const USAGE: &str = "usage: bench-forgejo serve --token TOKEN [--runners N] [--stale S] [--prefix P] [--no-live-ours] [--pickup JOBS] [--jobs M --job-ms L] [--arrivals N --job-ms L --lead-ms D --span-ms S --seed X --start-ns T [--hook ADDR --hook-secret S]] [--port-file FILE]";
const HOUR_MS: i64 = 3_600_000;

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// The model's clock: Unix ms.
fn now_ms() -> i64 {
    (now_ns() / 1_000_000) as i64
}

#[derive(Default)]
struct Counts {
    requests: u64,
    connections: u64,
    lists: u64,
    jobs: u64,
    gets: u64,
    deletes: u64,
    deleted: u64,
    posts: u64,
}

struct Sample {
    job_id: i64,
    waiting_ns: u128,
    seen_ns: Option<u128>,
    /// When the POST that registered its runner arrived.
    post_ns: Option<u128>,
    launch_ns: Option<u128>,
}

#[derive(Default)]
struct Pickup {
    remaining: u64,
    /// The job that is waiting now: (id, index into samples).
    current: Option<(i64, usize)>,
    /// A launched runner whose consumption the cycle has not yet seen (its GET → 404).
    awaiting_forget: Option<i64>,
    samples: Vec<Sample>,
}

/// One job of the slots benchmark's batch or of the idle-pool benchmark's arrivals (its row is
/// the model's).
#[derive(Default)]
struct BatchJob {
    id: i64,
    /// The registration whose runner took it, and that registration's name.
    runner: Option<i64>,
    runner_name: Option<String>,
    /// How many runners were given it (the benchmark wants exactly one each).
    takes: u32,
    /// When it became waiting (arrivals).
    waiting_ns: Option<u128>,
    /// The jobs list that first listed it (any process's poll).
    first_seen_ns: Option<u128>,
    /// The last jobs list answered on the TCP connection that then POSTed the registration of
    /// the runner that took it (the poll that saw it, for the process that served it), and
    /// that POST.
    seen_ns: Option<u128>,
    post_ns: Option<u128>,
    /// When the launch command started (it says so) and when its runner asked for its task.
    launch_ns: Option<u128>,
    taken_ns: Option<u128>,
    done_ns: Option<u128>,
}

/// The slots benchmark: batches of `size` jobs, each running `length_ns` once a runner took it.
struct Batch {
    size: u64,
    length_ns: u128,
    /// The current batch, id ascending (the order Forgejo reads them in).
    jobs: Vec<BatchJob>,
    /// Batches handed out so far.
    batches: u64,
    /// When the current batch became waiting.
    started_ns: u128,
    /// Launched runners Forgejo gave no job (this batch).
    refused: u64,
    /// Arrivals: how many jobs the schedule makes waiting in all (0: batches).
    expected: u64,
    /// Arrivals: the last jobs list answered on each TCP connection, and for each registration
    /// (POSTed on a connection) that moment and the POST's.
    last_list: std::collections::HashMap<u64, u128>,
    posted: std::collections::HashMap<i64, (Option<u128>, u128)>,
    /// Arrivals: the moment the schedule counts from (Unix ns), once set (`--start-ns` or
    /// `/_bench/start?t=`).
    start_ns: Option<u128>,
}

struct World {
    token: String,
    /// Forgejo's rows and rules.
    forgejo: Forgejo<()>,
    /// The runner list's order and the key it was computed for (`rows_version`, `epoch`).
    order: Option<((u64, u64), Vec<i64>)>,
    /// Bumped whenever this server changes who is online (a Declare): the order is then
    /// computed again.
    epoch: u64,
    counts: Counts,
    pickup: Option<Pickup>,
    batch: Option<Batch>,
    base: String,
    /// The population, for `/_bench/restore`: (registrations, stale, prefix, live ones of ours).
    population: (u64, u64, String, bool),
    /// `--hook ADDR --hook-secret S`: where each arrival's push is delivered, signed as Forgejo
    /// signs it (`forgejo_model::webhook`); and each delivery: (job, sent, answered, status).
    hook: Option<(String, String)>,
    deliveries: Vec<(i64, u128, u128, u16)>,
}

impl World {
    /// Jobs that ran their length end with their final UpdateTask, and Forgejo deletes each
    /// one's ephemeral registration. Applied before every request, so every answer sees the
    /// world at its own time.
    fn advance(&mut self) {
        let Some(b) = self.batch.as_mut() else {
            return;
        };
        let now = now_ns();
        for j in &mut b.jobs {
            if j.done_ns.is_none()
                && let Some(t) = j.taken_ns
                && now >= t + b.length_ns
            {
                j.done_ns = Some(t + b.length_ns);
                self.forgejo.final_update_task(j.id, now_ms());
            }
        }
    }

    /// The live rows.
    fn live_rows(&self) -> usize {
        self.forgejo.runners.values().filter(|r| !r.deleted).count()
    }

    /// The runner `id` declares these `--label` values (`Declare`): online from now on.
    fn declare(&mut self, id: i64, labels: &str) {
        let now = now_ms();
        if let Some(r) = self.forgejo.live_mut(id) {
            // A runner that refuses its labels never starts: it declares none.
            r.declare(Some(rules::declared_names(labels).unwrap_or_default()), now);
            self.epoch += 1;
        }
    }
}

/// A fixed seed for the order of tied rows: the same world lists the same pages.
const TIE_SEED: u64 = 0x5eed;

/// `n` registrations, `stale` of them offline with the prefix (never connected: no version, no
/// labels), spread evenly; of the others one in ten is a live one with the prefix (idle or
/// active), the rest are other pools' (offline for hours, and idle) and names that only contain
/// the prefix.
fn population(n: u64, stale: u64, prefix: &str, live_ours: bool) -> Forgejo<()> {
    let mut f = Forgejo::default();
    let now = now_ms();
    let mut other = 0u64;
    for i in 0..n {
        let id = i as i64 + 1;
        let is_stale = stale > 0 && (i + 1) * stale / n > i * stale / n;
        // (name, connected, online, running a task)
        let (name, connected, online, busy) = if is_stale {
            (
                format!("{prefix}20261014t101500z-3f2a-{id}"),
                false,
                false,
                false,
            )
        } else {
            other += 1;
            match (if live_ours { other % 20 } else { 2 }, other % 3) {
                (0, _) => (
                    format!("{prefix}20261014t120000z-9a1b-{id}"),
                    true,
                    true,
                    false,
                ),
                (1, _) => (
                    format!("{prefix}20261014t120000z-9a1b-{id}"),
                    true,
                    true,
                    true,
                ),
                (_, 0) => (format!("static-builder-{id}"), true, false, false),
                (_, 1) => (format!("my-{prefix}{id}"), true, false, false),
                _ => (format!("pool-b-{id}"), true, true, false),
            }
        };
        f.register(NewRunner {
            id: Some(id),
            uuid: format!("00000000-0000-4000-8000-{id:012}"),
            token: format!("bench-runner-token-{id}"),
            name: &name,
            description: "",
            owner_id: 0,
            repo_id: 0,
            ephemeral: true,
            extra: (),
        });
        let r = f.live_mut(id).expect("just registered");
        if connected {
            r.declare(Some(vec!["debian".into(), "docker".into()]), now);
            r.last_active = now - HOUR_MS;
            if !online {
                r.stops_polling(now - 2 * HOUR_MS);
            }
            r.busy = busy;
        }
    }
    f
}

struct Reply {
    status: u16,
    body: String,
    headers: Vec<(&'static str, String)>,
    /// Pickup: the jobs list was answered empty while the VM was free; a job becomes waiting
    /// once this reply is on the wire.
    arm_job: bool,
}

fn reply(status: u16, body: impl Into<String>) -> Reply {
    Reply {
        status,
        body: body.into(),
        headers: Vec::new(),
        arm_job: false,
    }
}

/// Forgejo's `APIError` body.
fn error(w: &World, status: u16, message: &str) -> Reply {
    reply(
        status,
        format!(
            "{{\"message\":{},\"url\":\"{}/api/swagger\"}}",
            forgejo_model::json_str(message),
            w.base
        ),
    )
}

fn not_found(w: &World, what: &str) -> Reply {
    error(w, 404, &format!("{what}: resource does not exist"))
}

struct Incoming {
    /// The TCP connection it came on (numbered by the server).
    conn: u64,
    method: String,
    path: String,
    query: String,
    auth: Option<String>,
    body: Vec<u8>,
}

fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

fn handle(w: &mut World, inc: &Incoming) -> Reply {
    w.advance();
    if let Some(control) = inc.path.strip_prefix("/_bench/") {
        return control_request(w, control, &inc.query);
    }
    w.counts.requests += 1;
    if inc.auth.as_deref() != Some(&format!("token {}", w.token)) {
        return error(w, 401, "token is required");
    }
    let Some(rest) = inc.path.strip_prefix(API) else {
        return not_found(w, "path");
    };
    let now = now_ms();
    match (inc.method.as_str(), rest) {
        ("GET", "") => list(w, &inc.path, &inc.query),
        ("POST", "") => register(w, &inc.body, inc.conn),
        ("GET", "/jobs") => jobs(w, &inc.query, inc.conn),
        (method, id) => {
            let Some(id) = id.strip_prefix('/').and_then(|s| s.parse::<i64>().ok()) else {
                return not_found(w, "path");
            };
            match method {
                "GET" => {
                    w.counts.gets += 1;
                    match w.forgejo.live(id) {
                        Some(r) => reply(200, r.json(now)),
                        None => {
                            if let Some(p) = w.pickup.as_mut()
                                && p.awaiting_forget == Some(id)
                            {
                                p.awaiting_forget = None;
                            }
                            not_found(w, &format!("runner with ID {id}"))
                        }
                    }
                }
                "DELETE" => {
                    w.counts.deletes += 1;
                    // No status check (routers/api/v1/shared/runners.go `DeleteRunner`).
                    if w.forgejo.live(id).is_some_and(|r| Scope::ADMIN.edits(r)) {
                        w.forgejo.delete(id, now);
                        w.counts.deleted += 1;
                        reply(204, "")
                    } else {
                        not_found(w, &format!("runner with ID {id}"))
                    }
                }
                _ => error(w, 405, "Method Not Allowed"),
            }
        }
    }
}

/// `ListRunners`: the model's order (kept while the rows do not change), one page of it.
fn list(w: &mut World, path: &str, query: &str) -> Reply {
    w.counts.lists += 1;
    let now = now_ms();
    let key = (w.forgejo.rows_version(), w.epoch);
    if w.order.as_ref().is_none_or(|(k, _)| *k != key) {
        let order = w
            .forgejo
            .runner_order(now, &Scope::ADMIN, false, |id, version| {
                forgejo_model::tie_key(id, version, TIE_SEED)
            });
        w.order = Some((key, order));
    }
    let q = query_pairs(query);
    let number = |k: &str| {
        query_param(query, k)
            .and_then(|s| s.parse::<i64>().ok())
            .unwrap_or(0)
    };
    let (page, limit) = (number("page"), w.forgejo.page_size(number("limit")));
    let order = &w.order.as_ref().expect("just computed").1;
    let ids = w.forgejo.page_of(order, page, limit);
    let mut body = String::with_capacity(ids.len() * 260 + 2);
    body.push('[');
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        if let Some(r) = w.forgejo.runners.get(id) {
            body.push_str(&r.json(now));
        }
    }
    body.push(']');
    let total = order.len() as i64;
    let root = format!("{}/", w.base);
    Reply {
        headers: forgejo_model::list_headers(&root, path, &q, total, limit, page),
        ..reply(200, body)
    }
}

fn register(w: &mut World, body: &[u8], conn: u64) -> Reply {
    w.counts.posts += 1;
    if let Some(p) = w.pickup.as_mut()
        && let Some((_, i)) = p.current
    {
        p.samples[i].post_ns.get_or_insert_with(now_ns);
    }
    let text = String::from_utf8_lossy(body);
    // The string value of "name" (our names need no JSON escapes).
    let name = text
        .split_once("\"name\"")
        .map(|(_, rest)| rest.trim_start().trim_start_matches(':').trim_start())
        .and_then(|rest| rest.strip_prefix('"'))
        .and_then(|rest| rest.split_once('"'))
        .map(|(n, _)| n.to_string())
        .filter(|n| !n.is_empty());
    let Some(name) = name else {
        // `bind()` formats the field names of the error, a slice.
        return error(w, 422, "[Name]: Required");
    };
    let ephemeral = text.replace(' ', "").contains("\"ephemeral\":true");
    let id = w.forgejo.next_runner_id();
    if let Some(b) = w.batch.as_mut()
        && b.expected > 0
    {
        let seen = b.last_list.get(&conn).copied();
        b.posted.insert(id, (seen, now_ns()));
    }
    let (uuid, token) = (
        format!("00000000-0000-4000-8000-{id:012}"),
        format!("bench-runner-token-{id}"),
    );
    w.forgejo.register(NewRunner {
        id: None,
        uuid: uuid.clone(),
        token: token.clone(),
        name: &name,
        description: "",
        owner_id: 0,
        repo_id: 0,
        ephemeral,
        extra: (),
    });
    reply(
        201,
        format!("{{\"id\":{id},\"uuid\":\"{uuid}\",\"token\":\"{token}\"}}"),
    )
}

/// The `runs_on` of every job the pickup and slots benchmarks hand out.
const PICKUP_RUNS_ON: &str = "debian";

fn job_handle(job: i64) -> String {
    format!("00000000-0000-4000-9000-{job:012}")
}

/// A waiting job of repository 1 (owner 1), in the model: its id.
fn add_job(w: &mut World) -> i64 {
    let id = w.forgejo.next_job_id();
    w.forgejo.add_job(
        job_handle(id),
        vec![PICKUP_RUNS_ON.to_string()],
        1,
        1,
        now_ms(),
    )
}

/// `GetActionRunJobs`: the waiting and running jobs the labels run, id descending; `null` for
/// none.
fn jobs(w: &mut World, query: &str, conn: u64) -> Reply {
    w.counts.jobs += 1;
    if let Some(b) = w.batch.as_mut()
        && b.expected > 0
    {
        let now = now_ns();
        b.last_list.insert(conn, now);
        for j in b.jobs.iter_mut().filter(|j| j.taken_ns.is_none()) {
            j.first_seen_ns.get_or_insert(now);
        }
    }
    let labels: Option<Vec<&str>> = query_param(query, "labels").map(|l| {
        if l.is_empty() {
            Vec::new()
        } else {
            l.split(',').collect()
        }
    });
    let body = forgejo_model::jobs_json(&w.forgejo.list_jobs(&Scope::ADMIN, labels.as_deref()));
    let Some(p) = w.pickup.as_mut() else {
        return reply(200, body);
    };
    if let Some((_, i)) = p.current {
        p.samples[i].seen_ns.get_or_insert_with(now_ns);
        return reply(200, body);
    }
    Reply {
        arm_job: p.remaining > 0 && p.awaiting_forget.is_none(),
        ..reply(200, body)
    }
}

fn arm_job(w: &mut World) {
    let ready = w
        .pickup
        .as_ref()
        .is_some_and(|p| p.current.is_none() && p.remaining > 0);
    if !ready {
        return;
    }
    let job = add_job(w);
    let p = w.pickup.as_mut().expect("pickup");
    p.remaining -= 1;
    p.samples.push(Sample {
        job_id: job,
        waiting_ns: now_ns(),
        seen_ns: None,
        post_ns: None,
        launch_ns: None,
    });
    p.current = Some((job, p.samples.len() - 1));
}

/// Every counter, and the samples of the pickup or slots benchmark.
fn stats(w: &World) -> String {
    let c = &w.counts;
    let prefix = &w.population.2;
    let ours = w
        .forgejo
        .runners
        .values()
        .filter(|r| !r.deleted && r.name.starts_with(prefix.as_str()))
        .count();
    let mut body = format!(
        "{{\"ours\":{ours},\"requests\":{},\"connections\":{},\"lists\":{},\"jobs\":{},\"gets\":{},\"deletes\":{},\"deleted\":{},\"posts\":{},\"rows\":{}",
        c.requests,
        c.connections,
        c.lists,
        c.jobs,
        c.gets,
        c.deletes,
        c.deleted,
        c.posts,
        w.live_rows()
    );
    let opt = |v: Option<u128>| v.map_or("null".to_string(), |v| v.to_string());
    body.push_str(",\"deliveries\":[");
    for (i, (job, sent, answered, status)) in w.deliveries.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            "{{\"job\":{job},\"sent_ns\":{sent},\"answered_ns\":{answered},\"status\":{status}}}"
        ));
    }
    body.push(']');
    if let Some(p) = &w.pickup {
        body.push_str(",\"samples\":[");
        for (i, s) in p.samples.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            body.push_str(&format!(
                "{{\"job\":{},\"waiting_ns\":{},\"seen_ns\":{},\"post_ns\":{},\"launch_ns\":{}}}",
                s.job_id,
                s.waiting_ns,
                opt(s.seen_ns),
                opt(s.post_ns),
                opt(s.launch_ns)
            ));
        }
        body.push(']');
    }
    if let Some(b) = &w.batch {
        body.push_str(&format!(
            ",\"batches\":{},\"batch_started_ns\":{},\"job_ns\":{},\"refused\":{},\"expected\":{},\"arrived\":{},\"done\":{},\"batch\":[",
            b.batches,
            b.started_ns,
            b.length_ns,
            b.refused,
            b.expected,
            b.jobs.len(),
            b.jobs.iter().filter(|j| j.done_ns.is_some()).count()
        ));
        for (i, j) in b.jobs.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            let status = w.forgejo.jobs.get(&j.id).map_or("?", |r| r.status.as_str());
            body.push_str(&format!(
                "{{\"job\":{},\"status\":\"{status}\",\"takes\":{},\"runner\":{},\"runner_name\":{},\"waiting_ns\":{},\"first_seen_ns\":{},\"seen_ns\":{},\"post_ns\":{},\"launch_ns\":{},\"taken_ns\":{},\"done_ns\":{}}}",
                j.id,
                j.takes,
                j.runner.map_or("null".to_string(), |r| r.to_string()),
                j.runner_name
                    .as_deref()
                    .map_or("null".to_string(), forgejo_model::json_str),
                opt(j.waiting_ns),
                opt(j.first_seen_ns),
                opt(j.seen_ns),
                opt(j.post_ns),
                opt(j.launch_ns),
                opt(j.taken_ns),
                opt(j.done_ns)
            ));
        }
        body.push(']');
    }
    body.push('}');
    body
}

fn control_request(w: &mut World, what: &str, query: &str) -> Reply {
    match what {
        "stats" => reply(200, stats(w)),
        "reset" => {
            w.counts = Counts::default();
            reply(200, "{}")
        }
        // The world as it was at start (every deleted row back) and the counters at zero.
        "restore" => {
            let (n, stale, prefix, live_ours) = w.population.clone();
            w.forgejo = population(n, stale, &prefix, live_ours);
            w.order = None;
            w.counts = Counts::default();
            reply(200, "{}")
        }
        "batch" => new_batch(w),
        "start" => {
            let t = query_param(query, "t").and_then(|s| s.parse::<u128>().ok());
            match (w.batch.as_mut(), t) {
                (Some(b), Some(t)) if b.expected > 0 && b.start_ns.is_none() => {
                    b.start_ns = Some(t);
                    reply(200, "{}")
                }
                _ => reply(
                    409,
                    "{\"message\":\"not started with --arrivals, already started, or no t\"}",
                ),
            }
        }
        "verify" => verify_batch(w),
        "launched" => {
            let id = query_param(query, "id").and_then(|s| s.parse::<i64>().ok());
            let t = query_param(query, "t").and_then(|s| s.parse::<u128>().ok());
            let (Some(id), Some(t)) = (id, t) else {
                return reply(400, "{\"message\":\"id and t are required\"}");
            };
            if w.batch.is_some() {
                return take_from_batch(w, id, query);
            }
            // The runner declares its labels and asks for its job as forgejo-runner would:
            // Forgejo's rule decides; given it, it runs it at once (its final UpdateTask deletes
            // the ephemeral registration).
            if w.forgejo.live(id).is_none() {
                return not_found(w, &format!("runner with ID {id}"));
            }
            w.declare(id, query_param(query, "labels").unwrap_or(""));
            let handle = query_param(query, "handle").filter(|h| !h.is_empty());
            let Some(job) = w.forgejo.task_for(id, handle) else {
                return reply(409, "{\"message\":\"no task for this runner\"}");
            };
            let now = now_ms();
            w.forgejo.start_task(job, id, now);
            w.forgejo.final_update_task(job, now);
            if let Some(p) = w.pickup.as_mut()
                && let Some((_, i)) = p.current.take()
            {
                p.samples[i].launch_ns = Some(t);
                p.awaiting_forget = Some(id);
            }
            reply(200, "{}")
        }
        _ => reply(404, "{\"message\":\"no such control endpoint\"}"),
    }
}

/// `/_bench/batch`: the next M jobs waiting at once, refused (409) unless the last batch is
/// done and no registration is left: every measured run starts from nothing.
fn new_batch(w: &mut World) -> Reply {
    let live = w.live_rows();
    let Some(b) = w.batch.as_ref().filter(|b| b.expected == 0) else {
        return reply(409, "{\"message\":\"not started with --jobs\"}");
    };
    let unfinished = b.jobs.iter().filter(|j| j.done_ns.is_none()).count();
    if live > 0 || unfinished > 0 {
        return reply(
            409,
            format!(
                "{{\"message\":\"not at rest: {live} registrations, {unfinished} unfinished jobs\"}}"
            ),
        );
    }
    let size = b.size;
    let jobs: Vec<BatchJob> = (0..size)
        .map(|_| BatchJob {
            id: add_job(w),
            ..BatchJob::default()
        })
        .collect();
    let b = w.batch.as_mut().expect("batch");
    b.jobs = jobs;
    b.batches += 1;
    b.refused = 0;
    b.started_ns = now_ns();
    reply(200, format!("{{\"jobs\":{size}}}"))
}

/// `/_bench/verify`: 200 and the stats when every job of the batch ran exactly once, no launched
/// runner was refused a job, and no registration is left; else 409 with what is wrong.
fn verify_batch(w: &mut World) -> Reply {
    let live = w.live_rows();
    let Some(b) = &w.batch else {
        return reply(409, "{\"message\":\"not started with --jobs\"}");
    };
    let mut wrong = Vec::new();
    for j in &b.jobs {
        let status = w.forgejo.jobs.get(&j.id).map_or("?", |r| r.status.as_str());
        if j.takes != 1 || status != "success" {
            wrong.push(format!("job {} {status} taken {} times", j.id, j.takes));
        }
    }
    if b.refused > 0 {
        wrong.push(format!("{} launched runners were given no job", b.refused));
    }
    if live > 0 {
        wrong.push(format!("{live} registrations left"));
    }
    if b.jobs.is_empty() {
        wrong.push("no batch was handed out".into());
    }
    if b.expected > 0 && b.jobs.len() as u64 != b.expected {
        wrong.push(format!("{} of {} jobs arrived", b.jobs.len(), b.expected));
    }
    if wrong.is_empty() {
        reply(200, stats(w))
    } else {
        reply(409, format!("{{\"message\":\"{}\"}}", wrong.join("; ")))
    }
}

/// A launched runner declares its labels and asks for its task (`one-job --handle`): the model
/// picks the job (`rules::pick`), which runs from now for the job length; its
/// registration shows `active` meanwhile.
fn take_from_batch(w: &mut World, id: i64, query: &str) -> Reply {
    if w.forgejo.live(id).is_none() {
        return not_found(w, &format!("runner with ID {id}"));
    }
    w.declare(id, query_param(query, "labels").unwrap_or(""));
    let handle = query_param(query, "handle").filter(|h| !h.is_empty());
    let picked = w.forgejo.task_for(id, handle);
    let Some(b) = w.batch.as_mut() else {
        return reply(409, "{\"message\":\"not started with --jobs\"}");
    };
    let Some(job) = picked else {
        b.refused += 1;
        return reply(409, "{\"message\":\"no task for this runner\"}");
    };
    let now = now_ns();
    let launch_ns = query_param(query, "t").and_then(|s| s.parse::<u128>().ok());
    let posted = b.posted.get(&id).copied();
    let name = w.forgejo.live(id).map(|r| r.name.clone());
    if let Some(j) = b.jobs.iter_mut().find(|j| j.id == job) {
        j.runner = Some(id);
        j.runner_name = name;
        j.takes += 1;
        j.taken_ns.get_or_insert(now);
        j.launch_ns = j.launch_ns.or(launch_ns);
        if let Some((seen, post)) = posted {
            j.seen_ns = j.seen_ns.or(seen);
            j.post_ns = j.post_ns.or(Some(post));
        }
    }
    w.forgejo.start_task(job, id, now_ms());
    reply(200, "{}")
}

fn lock(world: &Mutex<World>) -> MutexGuard<'_, World> {
    world.lock().unwrap_or_else(|e| e.into_inner())
}

fn read_request(r: &mut BufReader<TcpStream>) -> std::io::Result<Option<(Incoming, bool)>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let target = parts.next().unwrap_or("").to_string();
    let version = parts.next().unwrap_or("");
    let mut keep_alive = version == "HTTP/1.1";
    let mut length = 0usize;
    let mut auth = None;
    let mut chunked = false;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 {
            return Ok(None);
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            let v = v.trim();
            match k.to_ascii_lowercase().as_str() {
                "content-length" => length = v.parse().unwrap_or(0),
                "authorization" => auth = Some(v.to_string()),
                "transfer-encoding" => chunked = v.eq_ignore_ascii_case("chunked"),
                "connection" if v.eq_ignore_ascii_case("close") => keep_alive = false,
                "connection" if v.eq_ignore_ascii_case("keep-alive") => keep_alive = true,
                _ => {}
            }
        }
    }
    let mut body = vec![0; length];
    r.read_exact(&mut body)?;
    if chunked {
        loop {
            let mut size = String::new();
            r.read_line(&mut size)?;
            let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk)?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), q.to_string()),
        None => (target, String::new()),
    };
    Ok(Some((
        Incoming {
            conn: 0,
            method,
            path,
            query,
            auth,
            body,
        },
        keep_alive,
    )))
}

fn serve_connection(world: &Mutex<World>, stream: TcpStream, conn: u64) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut out = stream.try_clone()?;
    let mut r = BufReader::new(stream);
    let mut counted = false;
    while let Some((mut inc, keep_alive)) = read_request(&mut r)? {
        inc.conn = conn;
        let rep = {
            let mut w = lock(world);
            if !counted && !inc.path.starts_with("/_bench/") {
                counted = true;
                w.counts.connections += 1;
            }
            handle(&mut w, &inc)
        };
        let reason = match rep.status {
            200 => "OK",
            201 => "Created",
            204 => "No Content",
            401 => "Unauthorized",
            404 => "Not Found",
            409 => "Conflict",
            422 => "Unprocessable Entity",
            _ => "Error",
        };
        let mut head = format!("HTTP/1.1 {} {reason}\r\n", rep.status);
        if rep.status != 204 {
            head.push_str("Content-Type: application/json;charset=utf-8\r\n");
            head.push_str(&format!("Content-Length: {}\r\n", rep.body.len()));
        }
        for (k, v) in &rep.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        if !keep_alive {
            head.push_str("Connection: close\r\n");
        }
        head.push_str("\r\n");
        head.push_str(&rep.body);
        out.write_all(head.as_bytes())?;
        if rep.arm_job {
            arm_job(&mut lock(world));
        }
        if !keep_alive {
            break;
        }
    }
    Ok(())
}

fn serve(args: &[String]) -> Result<(), String> {
    let mut token = None;
    let (mut runners, mut stale, mut pickup) = (0u64, 0u64, None);
    let (mut batch_jobs, mut job_ms) = (None, 0u64);
    let mut arrivals = None;
    let (mut span_ms, mut lead_ms, mut seed, mut start_ns) = (0u64, 0u64, 1u64, None);
    let mut prefix = "ephemeral-".to_string();
    let mut port_file = None;
    let mut live_ours = true;
    let (mut hook_addr, mut hook_secret) = (None, String::new());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{a} needs a value"));
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{a} {v}: {e}"));
        match a.as_str() {
            "--token" => token = Some(value()?),
            "--runners" => runners = number(value()?)?,
            "--stale" => stale = number(value()?)?,
            "--prefix" => prefix = value()?,
            "--pickup" => pickup = Some(number(value()?)?),
            "--jobs" => batch_jobs = Some(number(value()?)?),
            "--job-ms" => job_ms = number(value()?)?,
            "--arrivals" => arrivals = Some(number(value()?)?),
            "--span-ms" => span_ms = number(value()?)?,
            "--lead-ms" => lead_ms = number(value()?)?,
            "--seed" => seed = number(value()?)?,
            "--start-ns" => start_ns = Some(u128::from(number(value()?)?)),
            "--port-file" => port_file = Some(value()?),
            "--no-live-ours" => live_ours = false,
            "--hook" => hook_addr = Some(value()?),
            "--hook-secret" => hook_secret = value()?,
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    let token = token.ok_or(format!("--token is required\n{USAGE}"))?;
    if [pickup.is_some(), batch_jobs.is_some(), arrivals.is_some()]
        .iter()
        .filter(|x| **x)
        .count()
        > 1
    {
        return Err("--pickup, --jobs and --arrivals are three benchmarks: one at a time".into());
    }
    let hook = hook_addr.map(|a| (a, hook_secret));
    let arrivals = arrivals.map(|n| Arrivals {
        offsets_ms: schedule(n, lead_ms, span_ms, seed),
    });
    if stale > runners {
        return Err("--stale must not exceed --runners".into());
    }
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    let addr = listener.local_addr().map_err(|e| format!("bind: {e}"))?;
    let base = format!("http://{addr}");
    let world = Arc::new(Mutex::new(World {
        token,
        forgejo: population(runners, stale, &prefix, live_ours),
        order: None,
        epoch: 0,
        counts: Counts::default(),
        pickup: pickup.map(|jobs| Pickup {
            remaining: jobs,
            ..Pickup::default()
        }),
        batch: batch_jobs
            .or(arrivals.as_ref().map(|_| 0))
            .map(|size| Batch {
                size,
                length_ns: u128::from(job_ms) * 1_000_000,
                jobs: Vec::new(),
                batches: 0,
                started_ns: 0,
                refused: 0,
                expected: arrivals.as_ref().map_or(0, |a| a.offsets_ms.len() as u64),
                last_list: Default::default(),
                posted: Default::default(),
                start_ns,
            }),
        base: base.clone(),
        population: (runners, stale, prefix, live_ours),
        hook,
        deliveries: Vec::new(),
    }));
    // The first job waits from the start: it is what makes the cycle begin (a cold sample).
    arm_job(&mut lock(&world));
    if let Some(f) = port_file {
        std::fs::write(&f, format!("{}\n", addr.port())).map_err(|e| format!("{f}: {e}"))?;
    }
    println!("{base}");
    if let Some(a) = arrivals {
        let world = Arc::clone(&world);
        std::thread::spawn(move || play_arrivals(&world, &a));
    }
    for (conn, stream) in listener.incoming().enumerate() {
        let Ok(stream) = stream else { continue };
        let world = Arc::clone(&world);
        std::thread::spawn(move || {
            let _ = serve_connection(&world, stream, conn as u64);
        });
    }
    Ok(())
}

/// The idle-pool benchmark's schedule: jobs that become waiting at fixed offsets from its start.
struct Arrivals {
    offsets_ms: Vec<u64>,
}

/// `n` arrival offsets, ms, uniform in `lead .. lead + span`, sorted: the same for the same seed
/// (splitmix64), so that every configuration of a run meets the same schedule.
fn schedule(n: u64, lead_ms: u64, span_ms: u64, seed: u64) -> Vec<u64> {
    let mut x = seed;
    let mut next = || {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut v: Vec<u64> = (0..n).map(|_| lead_ms + next() % span_ms.max(1)).collect();
    v.sort_unstable();
    v
}

/// Makes each job of the schedule waiting at its moment (a job of repository 1, as every job
/// of the benchmarks); it then runs for the job length once a runner took it.
fn play_arrivals(world: &Arc<Mutex<World>>, a: &Arrivals) {
    let start = loop {
        if let Some(t) = lock(world).batch.as_ref().and_then(|b| b.start_ns) {
            break t;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    for off in &a.offsets_ms {
        let at = start + u128::from(*off) * 1_000_000;
        let now = now_ns();
        if at > now {
            std::thread::sleep(std::time::Duration::from_nanos((at - now) as u64));
        }
        let mut w = lock(world);
        let id = add_job(&mut w);
        if let Some(b) = w.batch.as_mut() {
            b.jobs.push(BatchJob {
                id,
                waiting_ns: Some(now_ns()),
                ..BatchJob::default()
            });
        }
        if let Some(hook) = w.hook.clone() {
            drop(w);
            deliver(world, id, &hook);
        }
    }
}

/// The push that created job `id`, delivered to the hook as Forgejo delivers it (from a queue:
/// here a thread, so that the schedule goes on); its answer is recorded.
fn deliver(world: &Arc<Mutex<World>>, id: i64, (addr, secret): &(String, String)) {
    use forgejo_model::webhook;
    let uuid = format!("00000000-0000-4000-8000-{id:012}");
    let payload =
        webhook::push_payload(1, 1, &webhook::hex(&webhook::sha256(uuid.as_bytes()))[..40]);
    let d = webhook::delivery(secret, &uuid, "push", "push", &payload);
    let mut req = format!(
        "POST / HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nContent-Type: application/json\r\n",
        d.body.len()
    );
    for (k, v) in &d.headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&d.body);
    let (world, addr) = (Arc::clone(world), addr.clone());
    std::thread::spawn(move || {
        let sent = now_ns();
        let status = TcpStream::connect(&addr)
            .and_then(|mut s| {
                s.write_all(req.as_bytes())?;
                let mut answer = String::new();
                s.read_to_string(&mut answer)?;
                Ok(answer)
            })
            .ok()
            .and_then(|a| a.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0);
        lock(&world).deliveries.push((id, sent, now_ns(), status));
    });
}

/// The launch command of the pickup benchmark: notes when it started, reads the runner token
/// from stdin (as `forgejo-runner` would), and tells the server.
fn launched() -> Result<(), String> {
    // The runner it started took its job at once and ran it to its end (see `/_bench/launched`;
    // with `--jobs`, the cycle asks only once the job's end removed the registration): `check`
    // finds its process gone (3), and `stop` has nothing left to end.
    match std::env::var("RUNNER_ACTION").as_deref() {
        Ok("check") => std::process::exit(3),
        Ok("stop") => return Ok(()),
        _ => {}
    }
    let started = now_ns();
    let mut token = String::new();
    std::io::stdin()
        .read_line(&mut token)
        .map_err(|e| format!("stdin: {e}"))?;
    let id = std::env::var("RUNNER_ID").map_err(|_| "RUNNER_ID is not set".to_string())?;
    let labels = std::env::var("RUNNER_LABELS").unwrap_or_default();
    let handle = std::env::var("JOB_HANDLE").unwrap_or_default();
    let url = std::env::var("FORGEJO_URL").map_err(|_| "FORGEJO_URL is not set".to_string())?;
    let host = url
        .strip_prefix("http://")
        .ok_or(format!("{url} is not http://"))?;
    let mut s = TcpStream::connect(host).map_err(|e| format!("connect {host}: {e}"))?;
    write!(
        s,
        "GET /_bench/launched?id={id}&t={started}&labels={labels}&handle={handle} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("write: {e}"))?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .map_err(|e| format!("read: {e}"))?;
    if !answer.starts_with("HTTP/1.1 200") {
        return Err(format!("the server said {answer:?}"));
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let as_launch = args.first().is_some_and(|a| a.ends_with("bench-launch"));
    let result = if as_launch {
        launched()
    } else if args.get(1).map(String::as_str) == Some("serve") {
        serve(&args[2..])
    } else {
        println!("{USAGE}");
        Ok(())
    };
    if let Err(e) = result {
        eprintln!("bench-forgejo: {e}");
        std::process::exit(1);
    }
}
