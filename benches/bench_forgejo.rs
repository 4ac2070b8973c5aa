//! A lean fake Forgejo for the benchmarks in `benches/run`: std only, so it builds with one
//! `rustc -O` call, and O(1) or O(log n) per request, so it is never what is being measured.
//!
//! It serves the admin-scope runner API (`/api/v1/admin/actions/runners`: list pages with
//! `X-Total-Count`, GET/DELETE by id, POST, `/jobs`) from rows rendered once at start, answers
//! on keep-alive connections (a thread per connection), and counts every API request and every
//! TCP connection that carried one. Control endpoints under `/_bench/` are not counted.
//!
//! ```text
//! bench-forgejo serve --token T [--runners N --stale S --prefix P --no-live-ours] [--pickup JOBS] [--jobs M --job-ms L] [--port-file F]
//! bench-launch   (the same binary under that name: the launch command of the pickup and slots benchmarks)
//! ```
//!
//! `--pickup JOBS` plays a queue of jobs for the job-pickup benchmark: a job becomes `waiting`
//! right after the server answered a jobs poll with an empty list while the VM was free, so the
//! next poll is one poll interval away; the launch command reports when it started.
//!
//! `--jobs M --job-ms L` is the parallel-slots benchmark's batch: `/_bench/batch` (refused while
//! a registration or an unfinished job is left) makes M jobs `waiting` at once. A launched runner
//! asks for a task as `forgejo-runner one-job --handle` does and Forgejo's rule
//! (`forgejo_rules::pick`) decides which job it gets, if any; the job then runs for L ms (its
//! registration `active`), after which it is done (`success`, no longer listed) and Forgejo
//! removes the ephemeral registration. `/_bench/verify` says whether every job of the batch ran
//! exactly once and nothing is left. With no arguments (as `cargo test --all-targets` runs
//! benchmark targets) it only prints its usage.

// Forgejo's assignment rule and constants, shared with the tests' model of Forgejo. The model
// itself (`tests/support/forgejo_model.rs`, used by the HTTP fake and the simulation) is not
// used here: it computes every list from its rows (a filter and a sort per request), which
// would be part of what a benchmark measures; this server renders its rows once at start.
#[path = "../tests/support/forgejo_rules.rs"]
mod forgejo_rules;

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

const API: &str = "/api/v1/admin/actions/runners";
const USAGE: &str = "usage: bench-forgejo serve --token TOKEN [--runners N] [--stale S] [--prefix P] [--no-live-ours] [--pickup JOBS] [--jobs M --job-ms L] [--port-file FILE]";

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

struct Row {
    id: i64,
    /// The runner object as Forgejo renders it, rendered once.
    json: String,
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
    next_job: i64,
}

/// One job of the slots benchmark's batch.
struct BatchJob {
    id: i64,
    /// `waiting`, `running` (a runner took it) or `success` (it ran for the job length).
    status: &'static str,
    /// The registration whose runner took it.
    runner: Option<i64>,
    /// How many runners were given it (the benchmark wants exactly one each).
    takes: u32,
    taken_ns: Option<u128>,
    done_ns: Option<u128>,
}

/// The slots benchmark: batches of `size` jobs, each running `length_ns` once a runner took it.
struct Batch {
    size: u64,
    length_ns: u128,
    /// The current batch, id ascending (the order Forgejo reads them in).
    jobs: Vec<BatchJob>,
    next_job: i64,
    /// Batches handed out so far.
    batches: u64,
    /// When the current batch became waiting.
    started_ns: u128,
    /// Launched runners Forgejo gave no job (this batch).
    refused: u64,
}

impl Batch {
    /// Jobs that ran their length are done, and Forgejo removes each one's ephemeral
    /// registration (`services/actions/task.go`: an ephemeral runner is deleted with its task's
    /// end). Applied before every request, so every answer sees the world at its own time.
    fn advance(&mut self, now: u128, dead: &mut HashSet<i64>) {
        for j in &mut self.jobs {
            if j.status == "running"
                && let Some(t) = j.taken_ns
                && now >= t + self.length_ns
            {
                j.status = "success";
                j.done_ns = Some(t + self.length_ns);
                if let Some(r) = j.runner {
                    dead.insert(r);
                }
            }
        }
    }
}

struct World {
    token: String,
    /// Live rows in id order (ids are handed out ascending, so binary search finds them).
    rows: Vec<Row>,
    /// Deleted since the last list request; removed from `rows` on the next one.
    dead: HashSet<i64>,
    next_id: i64,
    counts: Counts,
    pickup: Option<Pickup>,
    batch: Option<Batch>,
    base: String,
    /// The population, for `/_bench/restore`: (registrations, stale, prefix, live ones of ours).
    population: (u64, u64, String, bool),
}

impl World {
    fn find(&self, id: i64) -> Option<&Row> {
        if self.dead.contains(&id) {
            return None;
        }
        self.rows
            .binary_search_by_key(&id, |r| r.id)
            .ok()
            .map(|i| &self.rows[i])
    }

    fn compact(&mut self) {
        if !self.dead.is_empty() {
            let dead = std::mem::take(&mut self.dead);
            self.rows.retain(|r| !dead.contains(&r.id));
        }
    }
}

fn runner_json(id: i64, name: &str, status: &str) -> String {
    format!(
        "{{\"id\":{id},\"uuid\":\"00000000-0000-4000-8000-{id:012}\",\"owner_id\":0,\"repo_id\":0,\"name\":\"{name}\",\"status\":\"{status}\",\"version\":\"v11.1.2\",\"labels\":[\"debian\",\"docker\"],\"description\":\"\",\"ephemeral\":true}}"
    )
}

/// `n` registrations, `stale` of them offline with the prefix, spread evenly; of the others one
/// in ten is a live one with the prefix, the rest are other pools' (offline and idle) and names
/// that only contain the prefix.
fn population(n: u64, stale: u64, prefix: &str, live_ours: bool) -> Vec<Row> {
    let mut rows = Vec::with_capacity(n as usize);
    let mut other = 0u64;
    for i in 0..n {
        let id = i as i64 + 1;
        let is_stale = stale > 0 && (i + 1) * stale / n > i * stale / n;
        let (name, status) = if is_stale {
            (format!("{prefix}20261014t101500z-3f2a-{id}"), "offline")
        } else {
            other += 1;
            match (if live_ours { other % 20 } else { 2 }, other % 3) {
                (0, _) => (format!("{prefix}20261014t120000z-9a1b-{id}"), "idle"),
                (1, _) => (format!("{prefix}20261014t120000z-9a1b-{id}"), "active"),
                (_, 0) => (format!("static-builder-{id}"), "offline"),
                (_, 1) => (format!("my-{prefix}{id}"), "offline"),
                _ => (format!("pool-b-{id}"), "idle"),
            }
        };
        rows.push(Row {
            id,
            json: runner_json(id, &name, status),
        });
    }
    rows
}

struct Reply {
    status: u16,
    body: String,
    total: Option<usize>,
    /// Pickup: the jobs list was answered empty while the VM was free; a job becomes waiting
    /// once this reply is on the wire.
    arm_job: bool,
}

fn reply(status: u16, body: impl Into<String>) -> Reply {
    Reply {
        status,
        body: body.into(),
        total: None,
        arm_job: false,
    }
}

fn not_found(w: &World, what: &str) -> Reply {
    reply(
        404,
        format!(
            "{{\"message\":\"{what}: resource does not exist\",\"url\":\"{}/api/swagger\"}}",
            w.base
        ),
    )
}

struct Incoming {
    method: String,
    path: String,
    query: String,
    auth: Option<String>,
    body: Vec<u8>,
}

fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

fn handle(w: &mut World, inc: &Incoming) -> Reply {
    if let Some(b) = w.batch.as_mut() {
        b.advance(now_ns(), &mut w.dead);
    }
    if let Some(control) = inc.path.strip_prefix("/_bench/") {
        return control_request(w, control, &inc.query);
    }
    w.counts.requests += 1;
    if inc.auth.as_deref() != Some(&format!("token {}", w.token)) {
        return reply(401, "{\"message\":\"token is required\",\"url\":\"\"}");
    }
    let Some(rest) = inc.path.strip_prefix(API) else {
        return not_found(w, "path");
    };
    match (inc.method.as_str(), rest) {
        ("GET", "") => list(w, &inc.query),
        ("POST", "") => register(w, &inc.body),
        ("GET", "/jobs") => jobs(w),
        (method, id) => {
            let Some(id) = id.strip_prefix('/').and_then(|s| s.parse::<i64>().ok()) else {
                return not_found(w, "path");
            };
            match method {
                "GET" => {
                    w.counts.gets += 1;
                    match w.find(id) {
                        Some(r) => reply(200, r.json.clone()),
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
                    if w.find(id).is_some() {
                        w.dead.insert(id);
                        w.counts.deleted += 1;
                        reply(204, "")
                    } else {
                        not_found(w, &format!("runner with ID {id}"))
                    }
                }
                _ => reply(405, "{\"message\":\"method not allowed\",\"url\":\"\"}"),
            }
        }
    }
}

/// Forgejo's paging: `limit` ≤ 0 is 30, above 50 is 50; no `page` means every row.
fn list(w: &mut World, query: &str) -> Reply {
    w.counts.lists += 1;
    w.compact();
    let limit = query_param(query, "limit")
        .and_then(|s| s.parse::<i64>().ok())
        .unwrap_or(0);
    let limit = if limit <= 0 { 30 } else { limit.min(50) } as usize;
    let page = query_param(query, "page")
        .and_then(|s| s.parse::<i64>().ok())
        .unwrap_or(0);
    let rows: &[Row] = if page >= 1 {
        let start = ((page as usize - 1) * limit).min(w.rows.len());
        let end = (start + limit).min(w.rows.len());
        &w.rows[start..end]
    } else {
        &w.rows
    };
    let mut body = String::with_capacity(rows.len() * 260 + 2);
    body.push('[');
    for (i, r) in rows.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&r.json);
    }
    body.push(']');
    Reply {
        total: Some(w.rows.len()),
        ..reply(200, body)
    }
}

fn register(w: &mut World, body: &[u8]) -> Reply {
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
        return reply(422, "{\"message\":\"Name: Required\",\"url\":\"\"}");
    };
    let id = w.next_id;
    w.next_id += 1;
    w.rows.push(Row {
        id,
        json: runner_json(id, &name, "offline"),
    });
    reply(
        201,
        format!(
            "{{\"id\":{id},\"uuid\":\"00000000-0000-4000-8000-{id:012}\",\"token\":\"bench-runner-token-{id}\"}}"
        ),
    )
}

/// The `runs_on` of every job the pickup benchmark hands out.
const PICKUP_RUNS_ON: &str = "debian";

fn job_handle(job: i64) -> String {
    format!("00000000-0000-4000-9000-{job:012}")
}

/// `GetActionRunJobs`: the waiting and running jobs, id descending.
fn batch_jobs(b: &Batch) -> Reply {
    let mut body = String::from("[");
    for j in b.jobs.iter().rev().filter(|j| j.status != "success") {
        if body.len() > 1 {
            body.push(',');
        }
        let task = if j.status == "running" { j.id } else { 0 };
        body.push_str(&format!(
            "{{\"id\":{},\"attempt\":1,\"handle\":\"{}\",\"repo_id\":1,\"owner_id\":1,\"name\":\"build\",\"needs\":null,\"runs_on\":[\"{PICKUP_RUNS_ON}\"],\"task_id\":{task},\"status\":\"{}\"}}",
            j.id,
            job_handle(j.id),
            j.status
        ));
    }
    body.push(']');
    reply(200, body)
}

fn jobs(w: &mut World) -> Reply {
    w.counts.jobs += 1;
    if let Some(b) = &w.batch {
        return batch_jobs(b);
    }
    let Some(p) = w.pickup.as_mut() else {
        return reply(200, "[]");
    };
    if let Some((job, i)) = p.current {
        p.samples[i].seen_ns.get_or_insert_with(now_ns);
        return reply(
            200,
            format!(
                "[{{\"id\":{job},\"attempt\":1,\"handle\":\"{}\",\"repo_id\":1,\"owner_id\":1,\"name\":\"build\",\"needs\":null,\"runs_on\":[\"{PICKUP_RUNS_ON}\"],\"task_id\":0,\"status\":\"waiting\"}}]",
                job_handle(job)
            ),
        );
    }
    Reply {
        arm_job: p.remaining > 0 && p.awaiting_forget.is_none(),
        ..reply(200, "[]")
    }
}

fn arm_job(w: &mut World) {
    if let Some(p) = w.pickup.as_mut()
        && p.current.is_none()
        && p.remaining > 0
    {
        p.remaining -= 1;
        let job = p.next_job;
        p.next_job += 1;
        p.samples.push(Sample {
            job_id: job,
            waiting_ns: now_ns(),
            seen_ns: None,
            post_ns: None,
            launch_ns: None,
        });
        p.current = Some((job, p.samples.len() - 1));
    }
}

/// Every counter, and the samples of the pickup or slots benchmark.
fn stats(w: &World) -> String {
    let c = &w.counts;
    let ours = format!("\"name\":\"{}", w.population.2);
    let ours = w.rows.iter().filter(|r| r.json.contains(&ours)).count();
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
        w.rows.len() - w.dead.len()
    );
    if let Some(p) = &w.pickup {
        body.push_str(",\"samples\":[");
        for (i, s) in p.samples.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            let opt = |v: Option<u128>| v.map_or("null".to_string(), |v| v.to_string());
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
            ",\"batches\":{},\"batch_started_ns\":{},\"job_ns\":{},\"refused\":{},\"batch\":[",
            b.batches, b.started_ns, b.length_ns, b.refused
        ));
        for (i, j) in b.jobs.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            let opt = |v: Option<u128>| v.map_or("null".to_string(), |v| v.to_string());
            body.push_str(&format!(
                "{{\"job\":{},\"status\":\"{}\",\"takes\":{},\"runner\":{},\"taken_ns\":{},\"done_ns\":{}}}",
                j.id,
                j.status,
                j.takes,
                j.runner.map_or("null".to_string(), |r| r.to_string()),
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
            w.rows = population(n, stale, &prefix, live_ours);
            w.dead.clear();
            w.next_id = n as i64 + 1;
            w.counts = Counts::default();
            reply(200, "{}")
        }
        "batch" => new_batch(w),
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
            // The runner asks for its job as forgejo-runner would: Forgejo's rule decides.
            if let Some(p) = &w.pickup
                && let Some((job, _)) = p.current
            {
                // A runner that refuses its labels never starts: it declares none.
                let labels =
                    forgejo_rules::declared_names(query_param(query, "labels").unwrap_or(""))
                        .unwrap_or_default();
                let handle = job_handle(job);
                let runs_on = [PICKUP_RUNS_ON.to_string()];
                let runner = forgejo_rules::RunnerView {
                    owner_id: 0,
                    repo_id: 0,
                    labels: &labels,
                    ephemeral: true,
                    has_task: false,
                    handle: query_param(query, "handle"),
                };
                let offered = forgejo_rules::JobView {
                    status: "waiting",
                    task_id: 0,
                    handle: &handle,
                    runs_on: &runs_on,
                    owner_id: 1,
                    repo_id: 1,
                    queued_behind: false,
                };
                if !forgejo_rules::may_take(&runner, &offered) {
                    return reply(409, "{\"message\":\"no task for this runner\"}");
                }
            }
            // The runner took its job and ran it: Forgejo removes an ephemeral registration.
            if w.find(id).is_some() {
                w.dead.insert(id);
            }
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

fn live_rows(w: &World) -> usize {
    w.rows.len() - w.dead.len()
}

/// `/_bench/batch`: the next M jobs waiting at once, refused (409) unless the last batch is
/// done and no registration is left: every measured run starts from nothing.
fn new_batch(w: &mut World) -> Reply {
    let live = live_rows(w);
    let Some(b) = w.batch.as_mut() else {
        return reply(409, "{\"message\":\"not started with --jobs\"}");
    };
    let unfinished = b.jobs.iter().filter(|j| j.status != "success").count();
    if live > 0 || unfinished > 0 {
        return reply(
            409,
            format!(
                "{{\"message\":\"not at rest: {live} registrations, {unfinished} unfinished jobs\"}}"
            ),
        );
    }
    b.jobs = (0..b.size as i64)
        .map(|i| BatchJob {
            id: b.next_job + i,
            status: "waiting",
            runner: None,
            takes: 0,
            taken_ns: None,
            done_ns: None,
        })
        .collect();
    b.next_job += b.size as i64;
    b.batches += 1;
    b.refused = 0;
    b.started_ns = now_ns();
    reply(200, format!("{{\"jobs\":{}}}", b.size))
}

/// `/_bench/verify`: 200 and the stats when every job of the batch ran exactly once, no launched
/// runner was refused a job, and no registration is left; else 409 with what is wrong.
fn verify_batch(w: &mut World) -> Reply {
    let live = live_rows(w);
    let Some(b) = &w.batch else {
        return reply(409, "{\"message\":\"not started with --jobs\"}");
    };
    let mut wrong = Vec::new();
    for j in &b.jobs {
        if j.takes != 1 || j.status != "success" {
            wrong.push(format!("job {} {} taken {} times", j.id, j.status, j.takes));
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
    if wrong.is_empty() {
        reply(200, stats(w))
    } else {
        reply(409, format!("{{\"message\":\"{}\"}}", wrong.join("; ")))
    }
}

/// A launched runner asks for its task (`one-job --handle`): Forgejo's rule picks the job, which
/// runs from now for the job length; its registration shows `active` meanwhile.
fn take_from_batch(w: &mut World, id: i64, query: &str) -> Reply {
    let Ok(row) = w.rows.binary_search_by_key(&id, |r| r.id) else {
        return not_found(w, &format!("runner with ID {id}"));
    };
    if w.dead.contains(&id) {
        return not_found(w, &format!("runner with ID {id}"));
    }
    let Some(b) = w.batch.as_mut() else {
        return reply(409, "{\"message\":\"not started with --jobs\"}");
    };
    let labels = forgejo_rules::declared_names(query_param(query, "labels").unwrap_or(""))
        .unwrap_or_default();
    let runner = forgejo_rules::RunnerView {
        owner_id: 0,
        repo_id: 0,
        labels: &labels,
        ephemeral: true,
        has_task: b.jobs.iter().any(|j| j.runner == Some(id)),
        handle: query_param(query, "handle").filter(|h| !h.is_empty()),
    };
    let runs_on = [PICKUP_RUNS_ON.to_string()];
    let handles: Vec<String> = b.jobs.iter().map(|j| job_handle(j.id)).collect();
    let picked = forgejo_rules::pick(
        &runner,
        b.jobs.iter().zip(&handles).enumerate().map(|(i, (j, h))| {
            let view = forgejo_rules::JobView {
                status: j.status,
                task_id: if j.status == "waiting" { 0 } else { j.id },
                handle: h,
                runs_on: &runs_on,
                owner_id: 1,
                repo_id: 1,
                queued_behind: false,
            };
            (i, view)
        }),
    );
    let Some(i) = picked else {
        b.refused += 1;
        return reply(409, "{\"message\":\"no task for this runner\"}");
    };
    let j = &mut b.jobs[i];
    j.status = "running";
    j.runner = Some(id);
    j.takes += 1;
    j.taken_ns = Some(now_ns());
    let r = &mut w.rows[row];
    r.json = r
        .json
        .replace("\"status\":\"offline\"", "\"status\":\"active\"");
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
            method,
            path,
            query,
            auth,
            body,
        },
        keep_alive,
    )))
}

fn serve_connection(world: &Mutex<World>, stream: TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut out = stream.try_clone()?;
    let mut r = BufReader::new(stream);
    let mut counted = false;
    while let Some((inc, keep_alive)) = read_request(&mut r)? {
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
            _ => "Error",
        };
        let mut head = format!("HTTP/1.1 {} {reason}\r\n", rep.status);
        if rep.status != 204 {
            head.push_str("Content-Type: application/json;charset=utf-8\r\n");
            head.push_str(&format!("Content-Length: {}\r\n", rep.body.len()));
        }
        if let Some(t) = rep.total {
            head.push_str(&format!("X-Total-Count: {t}\r\n"));
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
    let mut prefix = "ephemeral-".to_string();
    let mut port_file = None;
    let mut live_ours = true;
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
            "--port-file" => port_file = Some(value()?),
            "--no-live-ours" => live_ours = false,
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    let token = token.ok_or(format!("--token is required\n{USAGE}"))?;
    if pickup.is_some() && batch_jobs.is_some() {
        return Err("--pickup and --jobs are two benchmarks: one at a time".into());
    }
    if stale > runners {
        return Err("--stale must not exceed --runners".into());
    }
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    let addr = listener.local_addr().map_err(|e| format!("bind: {e}"))?;
    let base = format!("http://{addr}");
    let world = Arc::new(Mutex::new(World {
        token,
        rows: population(runners, stale, &prefix, live_ours),
        dead: HashSet::new(),
        next_id: runners as i64 + 1,
        counts: Counts::default(),
        pickup: pickup.map(|jobs| Pickup {
            remaining: jobs,
            next_job: 1,
            ..Pickup::default()
        }),
        batch: batch_jobs.map(|size| Batch {
            size,
            length_ns: u128::from(job_ms) * 1_000_000,
            jobs: Vec::new(),
            next_job: 1,
            batches: 0,
            started_ns: 0,
            refused: 0,
        }),
        base: base.clone(),
        population: (runners, stale, prefix, live_ours),
    }));
    // The first job waits from the start: it is what makes the cycle begin (a cold sample).
    arm_job(&mut lock(&world));
    if let Some(f) = port_file {
        std::fs::write(&f, format!("{}\n", addr.port())).map_err(|e| format!("{f}: {e}"))?;
    }
    println!("{base}");
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let world = Arc::clone(&world);
        std::thread::spawn(move || {
            let _ = serve_connection(&world, stream);
        });
    }
    Ok(())
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
