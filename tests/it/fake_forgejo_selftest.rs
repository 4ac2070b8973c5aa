//! Self-tests of the fake Forgejo: each test pins one behaviour of the real Forgejo ≥ 15 API
//! (shared `forgejo-api.md`, sections 1, 2, 3 and 6) that the provisioner's tests rely on.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use crate::support::fake_forgejo::{Conn, FakeForgejo, Fault};
use forgejo_model::rules;
use serde_json::{Value, json};

const TOKEN: &str = "admin-write-token";
const RO_TOKEN: &str = "admin-read-token";
const SWAGGER_URL: &str = "https://forgejo.invalid/api/swagger";

struct Resp {
    status: u16,
    content_type: String,
    total_count: Option<String>,
    link: Option<String>,
    location: Option<String>,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("invalid JSON {:?}: {e}", self.body))
    }
}

/// A ureq client for the fake, with `http_status_as_error(false)`.
struct Api {
    agent: ureq::Agent,
    base: String,
    token: Option<String>,
}

impl Api {
    fn new(fake: &FakeForgejo, token: Option<&str>) -> Api {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        Api {
            agent,
            base: fake.url(),
            token: token.map(str::to_string),
        }
    }

    fn admin(fake: &FakeForgejo) -> Api {
        Api::new(fake, Some(TOKEN))
    }

    fn try_req(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Result<Resp, ureq::Error> {
        let url = format!("{}{}", self.base, path);
        let auth = self.token.as_ref().map(|t| format!("token {t}"));
        macro_rules! with_headers {
            ($rb:expr) => {{
                let mut rb = $rb;
                if let Some(a) = &auth {
                    rb = rb.header("Authorization", a);
                }
                for (k, v) in headers {
                    rb = rb.header(*k, *v);
                }
                rb
            }};
        }
        let resp = match method {
            "GET" => with_headers!(self.agent.get(&url)).call()?,
            "DELETE" => with_headers!(self.agent.delete(&url)).call()?,
            "POST" => {
                let rb = with_headers!(self.agent.post(&url));
                match body {
                    Some(b) => rb.header("Content-Type", "application/json").send(b)?,
                    None => rb.send_empty()?,
                }
            }
            other => panic!("unsupported method {other}"),
        };
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let status = resp.status().as_u16();
        let content_type = header("content-type").unwrap_or_default();
        let total_count = header("x-total-count");
        let link = header("link");
        let location = header("location");
        let body = resp.into_body().read_to_string()?;
        Ok(Resp {
            status,
            content_type,
            total_count,
            link,
            location,
            body,
        })
    }

    fn req(&self, method: &str, path: &str, body: Option<&str>) -> Resp {
        self.try_req(method, path, body, &[])
            .unwrap_or_else(|e| panic!("{method} {path}: transport error {e}"))
    }

    fn get(&self, path: &str) -> Resp {
        self.req("GET", path, None)
    }

    fn delete(&self, path: &str) -> Resp {
        self.req("DELETE", path, None)
    }

    fn post(&self, path: &str, body: &str) -> Resp {
        self.req("POST", path, Some(body))
    }

    /// POST register; returns (id, uuid, token).
    fn register(&self, base: &str, name: &str, ephemeral: bool) -> (i64, String, String) {
        let r = self.post(
            base,
            &json!({"name": name, "ephemeral": ephemeral}).to_string(),
        );
        assert_eq!(r.status, 201, "register: {}", r.body);
        let v = r.json();
        (
            v["id"].as_i64().expect("id"),
            v["uuid"].as_str().expect("uuid").to_string(),
            v["token"].as_str().expect("token").to_string(),
        )
    }

    /// A `/_fake/*` call as the runner process would make it.
    fn runner_call(&self, action_and_query: &str, uuid: &str, token: &str) -> Resp {
        self.try_req(
            "POST",
            &format!("/_fake/{action_and_query}"),
            Some(&format!("{token}\n")),
            &[("X-Runner-UUID", uuid)],
        )
        .expect("transport")
    }
}

const ADMIN: &str = "/api/v1/admin/actions/runners";

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|r| r["id"].as_i64().expect("id"))
        .collect()
}

fn assert_error(r: &Resp, status: u16, message: &str) {
    assert_eq!(r.status, status, "body: {}", r.body);
    assert!(
        r.content_type.starts_with("application/json"),
        "content type {}",
        r.content_type
    );
    assert_eq!(r.json(), json!({"message": message, "url": SWAGGER_URL}));
}

fn is_uuid_v4(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    lens == [8, 4, 4, 4, 12]
        && s.chars().all(|c| c == '-' || c.is_ascii_hexdigit())
        && parts[2].starts_with('4')
        && matches!(parts[3].chars().next(), Some('8' | '9' | 'a' | 'b'))
}

#[test]
fn registered_runner_is_offline_with_null_labels_until_it_connects() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let (id, uuid, token) = api.register(ADMIN, "ephemeral-a", true);
    assert!(id > 0);
    assert!(is_uuid_v4(&uuid), "uuid {uuid}");
    assert_eq!(token.len(), 40);
    assert!(
        token
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    );

    let v = api.get(&format!("{ADMIN}/{id}")).json();
    assert_eq!(
        v,
        json!({"id": id, "uuid": uuid, "owner_id": 0, "repo_id": 0, "name": "ephemeral-a",
               "status": "offline", "version": "", "labels": null, "description": "",
               "ephemeral": true})
    );
    assert_eq!(fake.runner(id).expect("exists").status, "offline");
    assert!(!fake.token_was_presented(id));

    let r = api.runner_call(
        "connect?labels=debian:docker://node:22-bookworm,arm64",
        &uuid,
        &token,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(fake.token_was_presented(id));
    let v = api.get(&format!("{ADMIN}/{id}")).json();
    assert_eq!(v["status"], "idle");
    assert_eq!(v["version"], "12.8.2");
    assert_eq!(v["labels"], json!(["debian", "arm64"]));

    let r = api.runner_call("disconnect", &uuid, &token);
    assert_eq!(r.status, 200);
    assert_eq!(
        api.get(&format!("{ADMIN}/{id}")).json()["status"],
        "offline"
    );
    // Its process is gone: nothing more comes from it.
    assert_eq!(api.runner_call("connect", &uuid, &token).status, 410);
    assert_eq!(
        api.get(&format!("{ADMIN}/{id}")).json()["status"],
        "offline"
    );
}

#[test]
fn runner_control_endpoints_require_the_runner_token() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let (id, uuid, token) = api.register(ADMIN, "r", true);
    let (_, other_uuid, _) = api.register(ADMIN, "other", true);
    assert_eq!(api.runner_call("connect", &uuid, "0000").status, 401);
    assert_eq!(api.runner_call("connect", &other_uuid, &token).status, 401);
    assert!(!fake.token_was_presented(id));
    // The API token does not stand in for the runner token.
    assert_eq!(api.runner_call("connect", &uuid, TOKEN).status, 401);
    assert_eq!(fake.runner(id).expect("exists").status, "offline");
}

#[test]
fn conn_states_give_forgejo_statuses() {
    let fake = FakeForgejo::start(TOKEN);
    let never = fake.add_runner("never", true, Conn::NeverConnected);
    let idle = fake.add_runner("idle", false, Conn::Idle);
    let active = fake.add_runner("active", false, Conn::Active);
    let recent = fake.add_runner("recent", false, Conn::OfflineFor(Duration::from_secs(30)));
    let gone = fake.add_runner("gone", true, Conn::OfflineFor(Duration::from_secs(61)));
    let api = Api::admin(&fake);
    let status = |id: i64| api.get(&format!("{ADMIN}/{id}")).json()["status"].clone();
    assert_eq!(status(never), "offline");
    assert_eq!(status(idle), "idle");
    assert_eq!(status(active), "active");
    assert_eq!(status(recent), "idle", "offline only after 60 s");
    assert_eq!(status(gone), "offline");

    fake.set_conn(never, Conn::Active);
    assert_eq!(status(never), "active");
    fake.set_conn(active, Conn::NeverConnected);
    assert_eq!(status(active), "offline");
    assert_eq!(
        api.get(&format!("{ADMIN}/{active}")).json()["labels"],
        Value::Null
    );

    fake.set_status_override(idle, Some("weird"));
    assert_eq!(status(idle), "weird");
    fake.set_status_override(idle, Some(""));
    let v = api.get(&format!("{ADMIN}/{idle}")).json();
    assert!(v.get("status").is_none(), "{v}");
    fake.set_status_override(idle, None);
    assert_eq!(status(idle), "idle");
}

#[test]
fn list_without_page_returns_every_row_but_link_still_advertises_page_two() {
    let fake = FakeForgejo::start(TOKEN);
    for i in 0..35 {
        fake.add_runner(&format!("r{i}"), true, Conn::NeverConnected);
    }
    let api = Api::admin(&fake);

    let r = api.get(ADMIN);
    assert_eq!(r.status, 200);
    assert!(r.content_type.starts_with("application/json"));
    assert_eq!(r.json().as_array().expect("bare array").len(), 35);
    assert_eq!(r.total_count.as_deref(), Some("35"));
    assert_eq!(
        r.link.as_deref(),
        Some(
            "<http://forgejo.invalid/api/v1/admin/actions/runners?page=2>; rel=\"next\",\
             <http://forgejo.invalid/api/v1/admin/actions/runners?page=2>; rel=\"last\""
        )
    );

    let p1 = api.get(&format!("{ADMIN}?page=1"));
    assert_eq!(
        p1.json().as_array().expect("array").len(),
        30,
        "default limit"
    );

    // Every row ties (never connected): no order is promised, but while nothing changes the
    // pages hold every row once.
    let p2 = api.get(&format!("{ADMIN}?page=2&limit=30"));
    let mut both = ids(&p1.json());
    both.extend(ids(&p2.json()));
    both.sort();
    assert_eq!(both, (1..=35).collect::<Vec<i64>>());
    assert_eq!(p2.total_count.as_deref(), Some("35"));
    assert_eq!(
        p2.link.as_deref(),
        Some(
            "<http://forgejo.invalid/api/v1/admin/actions/runners?limit=30&page=1>; rel=\"first\",\
             <http://forgejo.invalid/api/v1/admin/actions/runners?limit=30&page=1>; rel=\"prev\""
        )
    );

    // Beyond the last page: empty bare array, not null.
    let p9 = api.get(&format!("{ADMIN}?page=9&limit=30"));
    assert_eq!(p9.body, "[]");
}

#[test]
fn limit_is_clamped_to_50_and_total_count_counts_all_matching_rows() {
    let fake = FakeForgejo::start(TOKEN);
    for i in 0..60 {
        fake.add_runner(&format!("r{i}"), true, Conn::NeverConnected);
    }
    fake.add_scoped_runner("org-runner", 100, 0, true, Conn::NeverConnected);
    fake.set_root_url("https://git.example.org");
    let api = Api::admin(&fake);

    let r = api.get(&format!("{ADMIN}?limit=100&page=1"));
    let mut seen = ids(&r.json());
    assert_eq!(seen.len(), 50);
    assert_eq!(
        r.total_count.as_deref(),
        Some("60"),
        "org runner not counted"
    );
    // The link keeps the limit as sent; keys are sorted as Go's url.Values.Encode does.
    assert_eq!(
        r.link.as_deref(),
        Some(
            "<https://git.example.org/api/v1/admin/actions/runners?limit=100&page=2>; rel=\"next\",\
             <https://git.example.org/api/v1/admin/actions/runners?limit=100&page=2>; rel=\"last\""
        )
    );
    let r = api.get(&format!("{ADMIN}?limit=100&page=2"));
    assert_eq!(ids(&r.json()).len(), 10);
    seen.extend(ids(&r.json()));
    seen.sort();
    assert_eq!(seen, (1..=60).collect::<Vec<i64>>());

    let r = api.get(&format!("{ADMIN}?page=1&limit=0"));
    assert_eq!(r.json().as_array().expect("array").len(), 30);
    let r = api.get(&format!("{ADMIN}?page=1&limit=7&visible=true"));
    assert_eq!(r.json().as_array().expect("array").len(), 7);
    assert_eq!(r.total_count.as_deref(), Some("61"));
}

#[test]
fn list_order_is_last_online_desc_and_ties_come_in_no_promised_order() {
    let fake = FakeForgejo::start(TOKEN);
    let a = fake.add_runner("a", true, Conn::NeverConnected);
    let b = fake.add_runner("b", true, Conn::OfflineFor(Duration::from_secs(600)));
    let c = fake.add_runner("c", true, Conn::Idle);
    let d = fake.add_runner("d", true, Conn::NeverConnected);
    let e = fake.add_runner("e", true, Conn::OfflineFor(Duration::from_secs(120)));
    let api = Api::admin(&fake);
    let all = ids(&api.get(ADMIN).json());
    assert_eq!(all[..3], [c, e, b], "last_online DESC");
    let mut tied = all[3..].to_vec();
    tied.sort();
    assert_eq!(tied, [a, d], "the two never-connected rows tie at 0, last");
    // The same reading gives the same order while nothing changes...
    assert_eq!(ids(&api.get(ADMIN).json()), all);
    assert_eq!(
        ids(&api.get(&format!("{ADMIN}?page=2&limit=2")).json()),
        vec![b, all[3]]
    );
}

#[test]
fn rows_that_tie_are_reordered_by_inserts_and_deletes() {
    // `ToOrders` is only `last_online DESC` (models/actions/runner.go): ties among the
    // never-connected rows come in whatever order the database gives, which is not promised
    // across changes. The fake's order depends on the table's version.
    let fake = FakeForgejo::start(TOKEN);
    for i in 0..20 {
        fake.add_runner(&format!("r{i}"), true, Conn::NeverConnected);
    }
    let api = Api::admin(&fake);
    let before = ids(&api.get(ADMIN).json());
    assert_ne!(
        before,
        (1..=20).collect::<Vec<i64>>(),
        "ties are not broken by id"
    );
    let extra = fake.add_runner("extra", true, Conn::NeverConnected);
    let mut after = ids(&api.get(ADMIN).json());
    after.retain(|id| *id != extra);
    assert_ne!(after, before, "an insert reorders the tied rows");
}

#[test]
fn scopes_filter_lists_and_single_gets() {
    let fake = FakeForgejo::start(TOKEN);
    let org_id = fake.add_org("acme");
    assert_eq!(fake.org_id("acme"), org_id, "stable");
    let repo_id = fake.add_repo("acme/app");
    assert_eq!(fake.repo_id("acme/app"), repo_id);
    let instance = fake.add_runner("instance", true, Conn::NeverConnected);
    let user = fake.add_scoped_runner("user", 1, 0, true, Conn::NeverConnected);
    let org = fake.add_scoped_runner("org", org_id, 0, true, Conn::NeverConnected);
    let repo = fake.add_scoped_runner("repo", 0, repo_id, true, Conn::NeverConnected);
    let api = Api::admin(&fake);
    let list = |path: &str| {
        let mut v = ids(&api.get(path).json());
        v.sort();
        v
    };

    assert_eq!(list(ADMIN), vec![instance]);
    assert_eq!(
        list(&format!("{ADMIN}?visible=true")),
        vec![instance, user, org, repo]
    );
    assert_eq!(list("/api/v1/user/actions/runners"), vec![user]);
    assert_eq!(
        list("/api/v1/user/actions/runners?visible=true"),
        vec![instance, user]
    );
    assert_eq!(list("/api/v1/orgs/acme/actions/runners"), vec![org]);
    assert_eq!(
        list("/api/v1/orgs/acme/actions/runners?visible=1"),
        vec![instance, org]
    );
    assert_eq!(list("/api/v1/repos/acme/app/actions/runners"), vec![repo]);
    assert_eq!(
        list("/api/v1/repos/acme/app/actions/runners?visible=true"),
        vec![instance, org, repo]
    );

    // Get one: own + instance runners; the admin sees everything.
    let org_base = "/api/v1/orgs/acme/actions/runners";
    assert_eq!(api.get(&format!("{org_base}/{instance}")).status, 200);
    assert_eq!(api.get(&format!("{org_base}/{org}")).status, 200);
    assert_error(
        &api.get(&format!("{org_base}/{user}")),
        404,
        &format!("runner with ID {user}: resource does not exist"),
    );
    assert_eq!(api.get(&format!("{ADMIN}/{repo}")).status, 200);
    assert_eq!(api.get(&format!("{ADMIN}/not-a-number")).status, 404);

    // Delete: an instance runner seen from an org is visible but not editable.
    assert_error(
        &api.delete(&format!("{org_base}/{instance}")),
        404,
        "No permission to delete this runner",
    );
    assert_eq!(api.delete(&format!("{ADMIN}/{repo}")).status, 204);
    assert_eq!(api.delete(&format!("{org_base}/{org}")).status, 204);
    assert_eq!(fake.deleted_ids(), vec![repo, org]);

    // POST at a scope gives the runner that scope's owner/repo id.
    let (id, _, _) = api.register(org_base, "o", false);
    let v = api.get(&format!("{ADMIN}/{id}")).json();
    assert_eq!(
        (v["owner_id"].clone(), v["repo_id"].clone()),
        (json!(org_id), json!(0))
    );
    let (id, _, _) = api.register("/api/v1/repos/acme/app/actions/runners", "r", false);
    let s = fake.runner(id).expect("exists");
    assert_eq!((s.owner_id, s.repo_id), (0, repo_id));
    let (id, _, _) = api.register("/api/v1/user/actions/runners", "u", false);
    assert_eq!(fake.runner(id).expect("exists").owner_id, 1);
}

/// No organization, user (but the token's) or repository exists until the test creates it.
/// Every runner route of an unknown one answers the assignment's 404 (routers/api/v1/api.go
/// `orgAssignment`, `repoAssignment`, `reqOwner(unit.TypeActions)`; the body is
/// services/context/api.go's `APINotFound`, the only one with `errors`), never a runner's; an
/// owner's old name answers 307 to its new one while its redirect lasts, 404 once it is gone,
/// and its runners stay its own; a deleted organization takes its runners with it.
#[test]
fn unknown_renamed_and_deleted_scopes_answer_as_forgejo_does() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let not_found = |r: &Resp, message: &str, errors: Value| {
        assert_eq!(r.status, 404, "body: {}", r.body);
        assert_eq!(
            r.json(),
            json!({"message": message, "url": SWAGGER_URL, "errors": errors})
        );
    };
    let every_route = |base: &str| {
        vec![
            api.get(base),
            api.get(&format!("{base}/5")),
            api.delete(&format!("{base}/5")),
            api.post(base, r#"{"name":"x","ephemeral":true}"#),
            api.get(&format!("{base}/jobs?labels=debian")),
        ]
    };
    let no_acme = json!(["user redirect does not exist [name: acme]"]);
    for r in every_route("/api/v1/orgs/acme/actions/runners") {
        not_found(&r, "GetOrgByName", no_acme.clone());
    }
    // A user is not an organization.
    fake.add_user("bob");
    not_found(
        &api.get("/api/v1/orgs/bob/actions/runners"),
        "GetOrgByName",
        json!(["user redirect does not exist [name: bob]"]),
    );
    // A repository: its owner first, then the repository, then its Actions unit.
    for r in every_route("/api/v1/repos/acme/app/actions/runners") {
        not_found(&r, "GetUserByName", no_acme.clone());
    }
    let target = "The target couldn't be found.";
    not_found(
        &api.get("/api/v1/repos/bob/app/actions/runners"),
        target,
        json!([]),
    );
    not_found(
        &api.get(&format!(
            "/api/v1/repos/{}/app/actions/runners",
            crate::support::fake_forgejo::TOKEN_USER_NAME
        )),
        target,
        json!([]),
    );
    fake.add_repo("bob/app");
    assert_eq!(api.get("/api/v1/repos/bob/app/actions/runners").status, 200);
    fake.set_repo_actions("bob/app", false);
    not_found(
        &api.get("/api/v1/repos/bob/app/actions/runners"),
        target,
        json!([]),
    );
    assert!(fake.runners().is_empty(), "nothing was registered");

    // Created, it answers; renamed, its old name redirects (query kept) while the redirect lasts.
    let org = fake.add_org("acme");
    let (id, _, _) = api.register("/api/v1/orgs/acme/actions/runners", "ephemeral-1", true);
    assert_eq!(fake.runner(id).unwrap().owner_id, org);
    fake.rename_owner("acme", "acme-corp", true);
    let r = api.get("/api/v1/orgs/acme/actions/runners?page=1&limit=50");
    assert_eq!(r.status, 307, "{}", r.body);
    assert_eq!(
        r.location.as_deref(),
        Some("/api/v1/orgs/acme-corp/actions/runners?page=1&limit=50")
    );
    assert_eq!(
        ids(&api.get("/api/v1/orgs/acme-corp/actions/runners").json()),
        vec![id]
    );
    // Renamed again without a redirect for the old name: 404, and the runner lives on.
    fake.rename_owner("acme-corp", "acme-inc", false);
    not_found(
        &api.get(&format!("/api/v1/orgs/acme-corp/actions/runners/{id}")),
        "GetOrgByName",
        json!(["user redirect does not exist [name: acme-corp]"]),
    );
    let base = "/api/v1/orgs/acme-inc/actions/runners";
    assert_eq!(api.get(&format!("{base}/{id}")).status, 200);
    // Deleted: its routes answer 404 and its runners are gone.
    fake.delete_owner("acme-inc");
    not_found(
        &api.get(&format!("{base}/{id}")),
        "GetOrgByName",
        json!(["user redirect does not exist [name: acme-inc]"]),
    );
    assert!(fake.runner(id).is_none());
}

#[test]
fn delete_is_soft_and_a_second_delete_is_404() {
    let fake = FakeForgejo::start(TOKEN);
    let keep = fake.add_runner("keep", true, Conn::NeverConnected);
    let id = fake.add_runner_with_id(500, "busy", true, Conn::Active);
    assert_eq!(fake.add_runner("next", true, Conn::NeverConnected), 501);
    let api = Api::admin(&fake);

    assert_eq!(api.get(&format!("{ADMIN}/{id}")).status, 200);
    // No busy check: an active runner is deleted too.
    let r = api.delete(&format!("{ADMIN}/{id}"));
    assert_eq!(r.status, 204);
    assert_eq!(r.body, "");
    assert_error(
        &api.get(&format!("{ADMIN}/{id}")),
        404,
        &format!("runner with ID {id}: resource does not exist"),
    );
    assert_error(
        &api.delete(&format!("{ADMIN}/{id}")),
        404,
        &format!("runner with ID {id}: resource does not exist"),
    );
    assert_error(
        &api.delete(&format!("{ADMIN}/99999")),
        404,
        "runner with ID 99999: resource does not exist",
    );
    let mut left = ids(&api.get(ADMIN).json());
    left.sort();
    assert_eq!(left, vec![keep, 501]);
    assert_eq!(api.get(ADMIN).total_count.as_deref(), Some("2"));
    assert_eq!(fake.deleted_ids(), vec![id]);
    assert!(fake.runner(id).is_none());
    assert_eq!(
        fake.runners().iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![keep, 501]
    );
}

#[test]
fn register_validates_name_and_allows_duplicates() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    for body in [
        "{}",
        r#"{"name":""}"#,
        r#"{"description":"x","ephemeral":true}"#,
        "not json",
        "",
    ] {
        assert_error(&api.post(ADMIN, body), 422, "[Name]: Required");
    }
    assert!(fake.runners().is_empty());

    let (a, uuid_a, token_a) = api.register(ADMIN, "same", true);
    let (b, uuid_b, token_b) = api.register(ADMIN, "same", false);
    assert!(b > a);
    assert_ne!(uuid_a, uuid_b);
    assert_ne!(token_a, token_b);
    let runners = fake.runners();
    assert_eq!(runners.len(), 2);
    assert!(runners[0].ephemeral && !runners[1].ephemeral);

    let r = api.post(
        ADMIN,
        &json!({"name": "n".repeat(255), "description": "d", "ephemeral": true}).to_string(),
    );
    assert_eq!(r.status, 201);
    let v = r.json();
    assert_eq!(
        v.as_object().expect("object").len(),
        3,
        "only id, uuid, token: {v}"
    );
    let runner = api.get(&format!("{ADMIN}/{}", v["id"])).json();
    assert_eq!(runner["name"].as_str().expect("name").len(), 255);
    assert_eq!(runner["description"], "d");
}

#[test]
fn bad_token_is_401_and_read_only_token_is_403_on_writes() {
    let fake = FakeForgejo::start(TOKEN);
    fake.set_read_only_token(RO_TOKEN);
    let id = fake.add_runner("r", true, Conn::NeverConnected);

    for token in [None, Some("wrong")] {
        let api = Api::new(&fake, token);
        let r = api.get(ADMIN);
        assert_eq!(r.status, 401);
        assert_eq!(r.json()["url"], SWAGGER_URL);
        assert!(r.json()["message"].is_string());
        assert_eq!(api.delete(&format!("{ADMIN}/{id}")).status, 401);
        assert_eq!(api.get(&format!("{ADMIN}/jobs")).status, 401);
    }
    // Bearer is accepted like Forgejo does.
    let bearer = Api {
        token: None,
        ..Api::admin(&fake)
    };
    let r = bearer
        .try_req(
            "GET",
            ADMIN,
            None,
            &[("Authorization", &format!("Bearer {TOKEN}"))],
        )
        .expect("transport");
    assert_eq!(r.status, 200);

    let ro = Api::new(&fake, Some(RO_TOKEN));
    assert_eq!(ro.get(ADMIN).status, 200);
    assert_eq!(ro.get(&format!("{ADMIN}/{id}")).status, 200);
    assert_eq!(ro.get(&format!("{ADMIN}/jobs")).status, 200);
    let denied = "token does not have at least one of required scope(s): [write:admin]";
    assert_error(&ro.post(ADMIN, r#"{"name":"x"}"#), 403, denied);
    assert_error(&ro.post(ADMIN, "not json"), 403, denied);
    assert_error(&ro.delete(&format!("{ADMIN}/{id}")), 403, denied);
    assert_error(
        &ro.post("/api/v1/orgs/acme/actions/runners", r#"{"name":"x"}"#),
        403,
        "token does not have at least one of required scope(s): [write:organization]",
    );
    assert_error(
        &ro.delete("/api/v1/user/actions/runners/1"),
        403,
        "token does not have at least one of required scope(s): [write:user]",
    );
    assert_error(
        &ro.post("/api/v1/repos/a/b/actions/runners", r#"{"name":"x"}"#),
        403,
        "token does not have at least one of required scope(s): [write:repository]",
    );
    assert_eq!(fake.runners().len(), 1, "nothing created");
    assert!(fake.deleted_ids().is_empty(), "nothing deleted");
}

#[test]
fn jobs_are_null_when_empty_and_match_runs_on_subset() {
    let fake = FakeForgejo::start(TOKEN);
    fake.add_org("acme");
    let api = Api::admin(&fake);
    let jobs = format!("{ADMIN}/jobs");
    let r = api.get(&jobs);
    assert_eq!(r.status, 200);
    assert_eq!(r.body, "null");
    assert_eq!(api.get(&format!("{jobs}?labels=debian")).body, "null");

    let (j1, h1) = fake.add_job(&["debian"]);
    let (j2, _) = fake.add_job(&["debian", "kvm"]);
    let (j3, _) = fake.add_job(&[]);
    let (j4, _) = fake.add_job(&["debian"]);
    let (j5, _) = fake.add_job(&["debian"]);
    fake.set_job_status(j4, "running");
    fake.set_job_status(j5, "success");

    let v = api.get(&format!("{jobs}?labels=debian")).json();
    assert_eq!(ids(&v), vec![j4, j1], "id desc, waiting and running");
    assert_eq!(
        v[1],
        json!({"id": j1, "attempt": 1, "handle": h1, "repo_id": 1, "owner_id": 1,
               "name": v[1]["name"], "needs": null, "runs_on": ["debian"], "task_id": 0,
               "status": "waiting"})
    );
    assert!(is_uuid_v4(&h1));
    assert_eq!(
        ids(&api.get(&format!("{jobs}?labels=debian,kvm,extra")).json()),
        vec![j4, j2, j1]
    );
    assert_eq!(api.get(&format!("{jobs}?labels=kvm")).body, "null");
    assert_eq!(ids(&api.get(&format!("{jobs}?labels=")).json()), vec![j3]);
    assert_eq!(ids(&api.get(&jobs).json()), vec![j4, j3, j2, j1]);
    // Legacy path and scoped paths.
    assert_eq!(
        ids(&api.get("/api/v1/admin/runners/jobs").json()),
        vec![j4, j3, j2, j1]
    );
    assert_eq!(
        ids(&api.get("/api/v1/user/actions/runners/jobs").json()).len(),
        4
    );
    assert_eq!(
        api.get("/api/v1/orgs/acme/actions/runners/jobs").body,
        "null"
    );
    let (j6, _) = fake.add_scoped_job(&["debian"], fake.org_id("acme"), 7);
    assert_eq!(
        ids(&api.get("/api/v1/orgs/acme/actions/runners/jobs").json()),
        vec![j6]
    );
}

#[test]
fn one_job_runs_the_job_and_forgejo_deletes_the_ephemeral_runner() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let (job, handle) = fake.add_job(&["debian"]);
    let (other_job, _) = fake.add_job(&["debian"]);
    let (id, uuid, token) = api.register(ADMIN, "ephemeral-1", true);

    assert_eq!(
        api.runner_call("one-job?handle=no-such-handle", &uuid, &token)
            .status,
        409
    );
    let r = api.runner_call(
        &format!("one-job?handle={handle}&labels=debian:docker://node:22"),
        &uuid,
        &token,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(fake.token_was_presented(id));
    let jobs = fake.jobs();
    assert_eq!(jobs[0].id, job);
    assert_eq!(jobs[0].status, "success");
    assert_eq!(jobs[0].runner_id, Some(id));
    assert_eq!(jobs[1].id, other_job);
    assert_eq!(jobs[1].status, "waiting");
    assert!(fake.runner(id).is_none());
    assert_eq!(api.get(&format!("{ADMIN}/{id}")).status, 404);
    assert!(
        fake.deleted_ids().is_empty(),
        "deleted by Forgejo, not the API"
    );
    assert_eq!(api.get(&format!("{ADMIN}/jobs")).json()[0]["id"], other_job);
    // The registration is gone: the runner can no longer authenticate.
    assert_eq!(api.runner_call("connect", &uuid, &token).status, 401);
}

#[test]
fn take_makes_the_runner_active_until_finish() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let (job, handle) = fake.add_job(&["debian"]);
    let (id, uuid, token) = api.register(ADMIN, "ephemeral-2", true);
    let (keep, keep_uuid, keep_token) = api.register(ADMIN, "persistent", false);

    let r = api.runner_call(
        &format!("take?handle={handle}&labels=debian:host"),
        &uuid,
        &token,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let runner = api.get(&format!("{ADMIN}/{id}")).json();
    assert_eq!(runner["status"], "active");
    assert_eq!(runner["version"], "12.8.2");
    assert_eq!(runner["labels"], json!(["debian"]), "the declared names");
    let listed = api.get(&format!("{ADMIN}/jobs")).json();
    assert_eq!(listed[0]["status"], "running");
    assert!(listed[0]["task_id"].as_i64().expect("task id") > 0);
    assert_eq!(fake.jobs()[0].runner_id, Some(id));
    // The job is no longer waiting, and an ephemeral runner gets only one task.
    assert_eq!(
        api.runner_call(
            &format!("take?handle={handle}&labels=debian"),
            &keep_uuid,
            &keep_token
        )
        .status,
        409
    );
    fake.add_job(&["debian"]);
    assert_eq!(api.runner_call("take", &uuid, &token).status, 409);

    let r = api.runner_call("finish", &uuid, &token);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(fake.jobs()[0].id, job);
    assert_eq!(fake.jobs()[0].status, "success");
    assert!(fake.runner(id).is_none());

    // A non-ephemeral runner survives its job (active for 10 s after its last report).
    let r = api.runner_call("one-job?labels=debian", &keep_uuid, &keep_token);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(fake.runner(keep).expect("kept").status, "active");
    assert_eq!(fake.jobs()[1].status, "success");
}

#[test]
fn requests_are_recorded_in_order() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    api.get(&format!("{ADMIN}?page=1&limit=50"));
    api.delete(&format!("{ADMIN}/7"));
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].method, "GET");
    assert_eq!(reqs[0].path, ADMIN);
    assert_eq!(reqs[0].query, "page=1&limit=50");
    assert_eq!(
        reqs[0].authorization.as_deref(),
        Some(format!("token {TOKEN}").as_str())
    );
    assert_eq!(reqs[1].method, "DELETE");
    assert_eq!(reqs[1].path, format!("{ADMIN}/7"));
    assert_eq!(reqs[1].query, "");
    fake.clear_requests();
    Api::new(&fake, None).runner_call("connect", "u", "t");
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].path, "/_fake/connect");
    assert_eq!(reqs[0].authorization, None);
}

#[test]
fn keep_alive_with_content_length() {
    let fake = FakeForgejo::start(TOKEN);
    fake.add_runner("r", true, Conn::NeverConnected);
    let addr = fake.url().trim_start_matches("http://").to_string();
    let mut s = TcpStream::connect(&addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = Vec::new();
    for _ in 0..2 {
        write!(
            s,
            "GET {ADMIN}/1 HTTP/1.1\r\nHost: {addr}\r\nAuthorization: token {TOKEN}\r\n\r\n"
        )
        .expect("write");
        // Read exactly one response: headers, then Content-Length bytes.
        buf.clear();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            s.read_exact(&mut byte).expect("read header");
            buf.push(byte[0]);
        }
        let head = String::from_utf8(buf.clone()).expect("ascii");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(!head.to_ascii_lowercase().contains("transfer-encoding"));
        let len: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse().expect("number"))
            })
            .expect("content-length");
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).expect("body");
        let v: Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["id"], 1);
    }
    assert_eq!(fake.requests().len(), 2);
}

// ---------------------------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------------------------

#[test]
fn fault_status_and_html_and_body_apply_nothing() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    fake.inject("POST", "/actions/runners", Fault::Status(503), 1);
    let r = api.post(ADMIN, r#"{"name":"x"}"#);
    assert_eq!(r.status, 503);
    assert!(r.content_type.starts_with("application/json"));
    assert!(r.json()["message"].is_string());
    assert!(fake.runners().is_empty(), "Status(c) applies nothing");
    // times = 1: the next one goes through.
    assert_eq!(api.post(ADMIN, r#"{"name":"x"}"#).status, 201);

    fake.inject("get", ADMIN, Fault::Html(502), 2);
    for _ in 0..2 {
        let r = api.get(ADMIN);
        assert_eq!(r.status, 502);
        assert!(
            r.content_type.starts_with("text/html"),
            "{}",
            r.content_type
        );
        assert!(r.body.contains("<html>"));
        assert!(serde_json::from_str::<Value>(&r.body).is_err());
    }
    assert_eq!(api.get(ADMIN).status, 200);

    fake.inject("DELETE", "/runners/1", Fault::Body("{\"ok\":1}".into()), 1);
    let r = api.delete(&format!("{ADMIN}/1"));
    assert_eq!((r.status, r.body.as_str()), (200, "{\"ok\":1}"));
    assert_eq!(fake.runners().len(), 1, "Body(s) applies nothing");

    fake.inject("*", "jobs", Fault::Status(500), usize::MAX);
    for _ in 0..3 {
        assert_eq!(api.get(&format!("{ADMIN}/jobs")).status, 500);
    }
    assert_eq!(api.get(ADMIN).status, 200, "only matching paths");
    fake.clear_faults();
    assert_eq!(api.get(&format!("{ADMIN}/jobs")).status, 200);
}

#[test]
fn fault_truncated_and_wrong_types() {
    let fake = FakeForgejo::start(TOKEN);
    let id = fake.add_runner("r", true, Conn::Idle);
    let api = Api::admin(&fake);
    let full = api.get(ADMIN).body;

    fake.inject("GET", ADMIN, Fault::Truncated, 1);
    let r = api.get(ADMIN);
    assert_eq!(r.status, 200);
    assert_eq!(r.body, full[..full.len() / 2]);
    assert!(serde_json::from_str::<Value>(&r.body).is_err());

    fake.inject("GET", ADMIN, Fault::WrongTypes, 1);
    let v = api.get(ADMIN).json();
    assert_eq!(v[0]["id"], json!(id.to_string()));
    assert_eq!(v[0]["owner_id"], json!("0"));
    assert!(v[0]["status"].is_number());

    // WrongTypes applies the request: the runner is created, the answer is mistyped.
    fake.inject("POST", ADMIN, Fault::WrongTypes, 1);
    let r = api.post(ADMIN, r#"{"name":"w"}"#);
    assert_eq!(r.status, 200);
    assert!(r.json()["id"].is_string());
    assert_eq!(fake.runners().len(), 2);
}

#[test]
fn fault_delay_does_not_block_other_requests() {
    let fake = FakeForgejo::start(TOKEN);
    fake.inject("GET", "/jobs", Fault::Delay(Duration::from_millis(200)), 1);
    let slow_api = Api::admin(&fake);
    let slow = thread::spawn(move || {
        let t = Instant::now();
        let r = slow_api.get(&format!("{ADMIN}/jobs"));
        (r.status, r.body, t.elapsed())
    });
    thread::sleep(Duration::from_millis(30));
    let api = Api::admin(&fake);
    let t = Instant::now();
    for _ in 0..3 {
        assert_eq!(api.get(ADMIN).status, 200);
    }
    assert!(
        t.elapsed() < Duration::from_millis(150),
        "blocked: {:?}",
        t.elapsed()
    );
    let (status, body, elapsed) = slow.join().expect("join");
    assert_eq!((status, body.as_str()), (200, "null"));
    assert!(elapsed >= Duration::from_millis(200), "{elapsed:?}");
}

#[test]
fn fault_drop_connection_is_a_transport_error_and_applies_nothing() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    // Warm a keep-alive connection first, so the drop hits a pooled connection.
    assert_eq!(api.get(ADMIN).status, 200);
    fake.inject("POST", ADMIN, Fault::DropConnection, 1);
    let err = api
        .try_req("POST", ADMIN, Some(r#"{"name":"x"}"#), &[])
        .err()
        .expect("transport error");
    assert!(
        matches!(err, ureq::Error::Io(_)),
        "not a socket error: {err:?}"
    );
    assert!(fake.runners().is_empty(), "nothing applied");
    // One request only was made (no silent retry), and the server keeps serving.
    assert_eq!(
        fake.requests()
            .iter()
            .filter(|r| r.method == "POST")
            .count(),
        1
    );
    assert_eq!(api.post(ADMIN, r#"{"name":"x"}"#).status, 201);
    assert_eq!(fake.runners().len(), 1);
}

#[test]
fn fault_apply_then_status_or_drop_applies_the_effect() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let a = fake.add_runner("a", true, Conn::NeverConnected);
    let b = fake.add_runner("b", true, Conn::NeverConnected);

    fake.inject("POST", ADMIN, Fault::ApplyThenStatus(500), 1);
    let r = api.post(ADMIN, r#"{"name":"lost"}"#);
    assert_eq!(r.status, 500);
    assert!(r.json()["message"].is_string());
    assert!(
        fake.runners().iter().any(|r| r.name == "lost"),
        "created although the answer was 500"
    );

    fake.inject("DELETE", &format!("/{a}"), Fault::ApplyThenStatus(502), 1);
    assert_eq!(api.delete(&format!("{ADMIN}/{a}")).status, 502);
    assert!(fake.runner(a).is_none());
    assert_eq!(api.delete(&format!("{ADMIN}/{a}")).status, 404);

    fake.inject("DELETE", &format!("/{b}"), Fault::ApplyThenDrop, 1);
    let err = api
        .try_req("DELETE", &format!("{ADMIN}/{b}"), None, &[])
        .err()
        .expect("transport error");
    assert!(
        matches!(err, ureq::Error::Io(_)),
        "not a socket error: {err:?}"
    );
    assert!(fake.runner(b).is_none());
    assert_eq!(fake.deleted_ids(), vec![a, b]);

    fake.inject("POST", ADMIN, Fault::ApplyThenDrop, 1);
    assert!(
        api.try_req("POST", ADMIN, Some(r#"{"name":"dropped"}"#), &[])
            .is_err()
    );
    assert!(fake.runners().iter().any(|r| r.name == "dropped"));
}

#[test]
fn unknown_paths_and_methods() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    assert_eq!(api.get("/api/v1/nope").status, 404);
    assert_eq!(api.delete(ADMIN).status, 405);
    assert_eq!(
        api.get("/api/v1/version").json(),
        json!({"version": "15.0.3+gitea-1.22.0"})
    );
}

/// Runs one case of Forgejo's assignment rule through the fake's HTTP API: a runner registered
/// over REST, declaring its labels by connecting, asks for the case's job.
fn fake_takes(c: &rules::Case) -> bool {
    let fake = FakeForgejo::start(TOKEN);
    fake.add_org("acme");
    fake.add_repo("acme/app");
    fake.add_repo("acme/other");
    let api = Api::admin(&fake);
    let repo = "/api/v1/repos/acme/app/actions/runners";
    let (id, uuid, token) = match c.same_repo {
        None => api.register(ADMIN, "ephemeral-case", true),
        Some(_) => api.register(repo, "ephemeral-case", true),
    };
    let job_repo = match c.same_repo {
        Some(false) => fake.repo_id("acme/other"),
        _ => fake.repo_id("acme/app"),
    };
    let labels = c.runner_labels.join(",");
    let r = api.runner_call(&format!("connect?labels={labels}"), &uuid, &token);
    assert_eq!(r.status, 200, "{}: {}", c.what, r.body);
    if c.ephemeral_with_task {
        let (first, _) = fake.add_scoped_job(&["debian"], 1, job_repo);
        let r = api.runner_call("take", &uuid, &token);
        assert_eq!(r.status, 200, "{}: {}", c.what, r.body);
        assert_eq!(fake.jobs()[0].id, first);
    }
    let (job, handle) = fake.add_scoped_job(c.job_runs_on, 1, job_repo);
    if c.job_status != "waiting" {
        fake.set_job_status(job, c.job_status);
    }
    fake.set_job_queued(job, c.queued_behind);
    let query = match c.with_handle {
        None => "take".to_string(),
        Some(true) => format!("take?handle={handle}"),
        Some(false) => "take?handle=00000000-0000-4000-8000-000000000000".to_string(),
    };
    let r = api.runner_call(&query, &uuid, &token);
    let taken = r.status == 200;
    if taken {
        assert_eq!(
            fake.jobs()
                .iter()
                .find(|j| j.id == job)
                .and_then(|j| j.runner_id),
            Some(id),
            "{}",
            c.what
        );
    } else {
        assert_eq!(r.status, 409, "{}: {}", c.what, r.body);
    }
    taken
}

// Mutation caught: the fake lets a runner without labels take any job (the old fake).
#[test]
fn the_fake_follows_forgejos_assignment_rule_in_every_case_of_the_table() {
    rules::check_rule_against_the_table();
    for c in rules::CASES {
        assert_eq!(fake_takes(c), c.taken, "{}", c.what);
    }
}

#[test]
fn a_job_queued_behind_its_concurrency_group_is_listed_waiting_and_given_to_nobody() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let (job, handle) = fake.add_job(&["debian"]);
    fake.set_job_queued(job, true);
    let listed = api.get(&format!("{ADMIN}/jobs?labels=debian")).json();
    assert_eq!(listed[0]["id"], job);
    assert_eq!(
        listed[0]["status"], "waiting",
        "the REST list does not filter"
    );
    let (_, uuid, token) = api.register(ADMIN, "ephemeral-q", true);
    let take = format!("take?handle={handle}&labels=debian");
    assert_eq!(api.runner_call(&take, &uuid, &token).status, 409);
    // Once the run ahead of it ends, the polling runner gets it.
    fake.set_job_queued(job, false);
    assert_eq!(api.runner_call(&take, &uuid, &token).status, 200);
}

#[test]
fn cancelling_a_running_job_deletes_its_ephemeral_runner() {
    // services/actions/rerun.go cancelSingleJob -> StopTask deletes an ephemeral runner.
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let (job, handle) = fake.add_job(&["debian"]);
    let (id, uuid, token) = api.register(ADMIN, "ephemeral-c", true);
    let take = format!("take?handle={handle}&labels=debian");
    assert_eq!(api.runner_call(&take, &uuid, &token).status, 200);
    fake.set_job_status(job, "cancelled");
    assert!(fake.runner(id).is_none(), "deleted by Forgejo");
    assert!(fake.deleted_ids().is_empty(), "not through the API");
    assert_eq!(api.get(&format!("{ADMIN}/{id}")).status, 404);
    // A cancelled job that was still waiting deletes nothing.
    let (waiting, _) = fake.add_job(&["debian"]);
    let (other, _, _) = api.register(ADMIN, "ephemeral-d", true);
    fake.set_job_status(waiting, "cancelled");
    assert!(fake.runner(other).is_some());
}

#[test]
fn a_rerun_is_a_new_attempt_with_a_new_handle_for_which_only_a_new_runner_asks() {
    // services/actions/rerun.go RerunJob -> PrepareNextAttempt (models/actions/run_job.go).
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let (job, first) = fake.add_job(&["debian"]);
    let (_, uuid, token) = api.register(ADMIN, "ephemeral-r1", true);
    let take = |handle: &str, uuid: &str, token: &str| {
        let q = format!("take?handle={handle}&labels=debian");
        api.runner_call(&q, uuid, token).status
    };
    assert_eq!(take(&first, &uuid, &token), 200);
    let finish = api.runner_call("finish", &uuid, &token);
    assert_eq!(finish.status, 200, "{}", finish.body);
    let second = fake.rerun_job(job);
    assert_ne!(second, first);
    let listed: Value = serde_json::from_str(&api.get(&format!("{ADMIN}/jobs")).body).unwrap();
    assert_eq!(listed[0]["id"], job);
    assert_eq!(listed[0]["attempt"], 2);
    assert_eq!(listed[0]["handle"], second.as_str());
    assert_eq!(listed[0]["task_id"], 0);
    assert_eq!(listed[0]["status"], "waiting");
    // A runner asking for the first attempt's handle gets nothing; one for the new handle does.
    let (_, uuid2, token2) = api.register(ADMIN, "ephemeral-r2", true);
    assert_eq!(take(&first, &uuid2, &token2), 409);
    assert_eq!(take(&second, &uuid2, &token2), 200);
    // A job that is not done cannot be rerun.
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fake.rerun_job(job)));
    assert!(refused.is_err(), "a running job is not rerun");
}

#[test]
fn abandoned_waiting_jobs_are_cancelled_and_running_ones_kept() {
    // services/actions/clear_tasks.go CancelAbandonedJobs: waiting or blocked, not updated for
    // ABANDONED_JOB_TIMEOUT.
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let (waiting, _) = fake.add_job(&["debian"]);
    let (blocked, _) = fake.add_job(&["debian"]);
    fake.set_job_status(blocked, "blocked");
    let (running, handle) = fake.add_job(&["debian"]);
    let (id, uuid, token) = api.register(ADMIN, "ephemeral-a1", true);
    let take = format!("take?handle={handle}&labels=debian");
    assert_eq!(api.runner_call(&take, &uuid, &token).status, 200);
    let day = Duration::from_millis(rules::ABANDONED_JOB_TIMEOUT_MS as u64);
    assert!(
        fake.cancel_abandoned_jobs(day).is_empty(),
        "younger than 24 h"
    );
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        fake.cancel_abandoned_jobs(Duration::from_millis(10)),
        vec![waiting, blocked]
    );
    let status = |j: i64| fake.jobs().into_iter().find(|x| x.id == j).unwrap().status;
    assert_eq!(status(waiting), "cancelled");
    assert_eq!(status(running), "running");
    assert!(fake.runner(id).is_some(), "no runner touched");
}

#[test]
fn sigterm_to_one_job_with_a_running_task_fails_it_and_forgejo_deletes_the_runner() {
    // forgejo-runner: the task's context is the signal context (main.go, single.go); the
    // reporter's Close sends the final state, result failure (reporter.go); Forgejo's UpdateTask
    // then deletes the ephemeral runner (routers/api/actions/runner/runner.go).
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let (_, handle) = fake.add_job(&["debian"]);
    let (id, uuid, token) = api.register(ADMIN, "ephemeral-t", true);
    let take = format!("take?handle={handle}&labels=debian");
    assert_eq!(api.runner_call(&take, &uuid, &token).status, 200);
    let r = api.runner_call("terminate", &uuid, &token);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(fake.jobs()[0].status, "failure");
    assert!(fake.runner(id).is_none(), "deleted at once");
    assert!(
        fake.deleted_ids().is_empty(),
        "by Forgejo, not through the API"
    );
    assert_eq!(api.get(&format!("{ADMIN}/{id}")).status, 404);
    // Without a task the process just stops: the registration stays (offline).
    let (other, uuid, token) = api.register(ADMIN, "ephemeral-u", true);
    assert_eq!(
        api.runner_call("connect?labels=debian", &uuid, &token)
            .status,
        200
    );
    assert_eq!(api.runner_call("terminate", &uuid, &token).status, 200);
    assert_eq!(fake.runner(other).expect("kept").status, "offline");
}

#[test]
fn the_endless_task_clean_up_deletes_a_runner_whose_process_goes_on() {
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let (job, handle) = fake.add_job(&["debian"]);
    let (id, uuid, token) = api.register(ADMIN, "ephemeral-e", true);
    let take = format!("take?handle={handle}&labels=debian");
    assert_eq!(api.runner_call(&take, &uuid, &token).status, 200);
    assert!(
        fake.stop_endless_tasks(Duration::from_millis(rules::ENDLESS_TASK_TIMEOUT_MS as u64))
            .is_empty(),
        "younger than Forgejo's 3 h"
    );
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        fake.stop_endless_tasks(Duration::from_millis(10)),
        vec![job]
    );
    assert_eq!(fake.jobs()[0].status, "failure");
    assert_eq!(api.get(&format!("{ADMIN}/{id}")).status, 404);
    // The process is not told: it can only find out that it no longer authenticates.
    assert_eq!(api.runner_call("connect", &uuid, &token).status, 401);
}

#[test]
fn a_name_longer_than_255_bytes_is_cut_and_registered() {
    // `CreateRunner` (models/actions/runner.go) cuts the name with `SplitStringAtByteN(name,
    // 255)` and answers 201: 255 bytes fit, a longer name keeps its whole characters up to 252
    // bytes and gets "…".
    rules::check_stored_runner_name();
    let fake = FakeForgejo::start(TOKEN);
    let api = Api::admin(&fake);
    let fits = format!("ephemeral-{}", "é".repeat(122)); // 10 + 244 = 254 bytes
    let (id, _, _) = api.register(ADMIN, &fits, true);
    assert_eq!(fake.runner(id).expect("exists").name, fits, "kept as sent");
    let long = format!("{fits}xé"); // 257 bytes
    let r = api.post(ADMIN, &json!({"name": long, "ephemeral": true}).to_string());
    assert_eq!(r.status, 201, "{}", r.body);
    let answer: Value = serde_json::from_str(&r.body).expect("one JSON answer");
    let id = answer["id"].as_i64().expect("an id");
    let stored = fake.runner(id).expect("created").name;
    // The 122nd "é" would end at byte 254, past 252: it goes whole.
    assert_eq!(stored, format!("ephemeral-{}…", "é".repeat(121)));
    assert!(stored.len() <= 255);
    let listed = api.get(&format!("{ADMIN}/{id}"));
    assert_eq!(
        serde_json::from_str::<Value>(&listed.body).unwrap()["name"],
        stored.as_str()
    );
}
