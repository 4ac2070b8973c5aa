//! Property tests (proptest) of what parses Forgejo's answers, cycle.json and `--labels`, and
//! of the one deletion gate, with arbitrary inputs.

use std::collections::BTreeMap;
use std::time::Duration;

use ci_ephemeral_provisioner::adapters::files::FileStore;
use ci_ephemeral_provisioner::adapters::files::read_state_file;
use ci_ephemeral_provisioner::core::forgejo::Job;
use ci_ephemeral_provisioner::core::forgejo::Runner;
use ci_ephemeral_provisioner::core::forgejo::RunnerStatus;
use ci_ephemeral_provisioner::core::forgejo::parse_jobs;
use ci_ephemeral_provisioner::core::forgejo::parse_runner_page;
use ci_ephemeral_provisioner::core::labels::{Labels, Rule};
use ci_ephemeral_provisioner::core::ports::ApiError;
use ci_ephemeral_provisioner::core::ports::Deleted;
use ci_ephemeral_provisioner::core::ports::Forgejo;
use ci_ephemeral_provisioner::core::ports::NewRunner;
use ci_ephemeral_provisioner::core::ports::RunnerPage;
use ci_ephemeral_provisioner::core::ports::StateStore;
use ci_ephemeral_provisioner::core::state::Boundary;
use ci_ephemeral_provisioner::core::state::CycleState;
use ci_ephemeral_provisioner::core::state::Launch;
use ci_ephemeral_provisioner::core::state::NotServed;
use ci_ephemeral_provisioner::core::state::Phase;
use ci_ephemeral_provisioner::core::state::PreviousRunner;
use ci_ephemeral_provisioner::core::state::ProcessState;
use ci_ephemeral_provisioner::core::state::Registration;
use ci_ephemeral_provisioner::core::state::parse_state;
use ci_ephemeral_provisioner::core::sweep::gate::Deletable;
use ci_ephemeral_provisioner::core::sweep::gate::may_delete;
use ci_ephemeral_provisioner::core::sweep::listing::Listing;
use ci_ephemeral_provisioner::core::sweep::listing::PAGE_LIMIT;
use ci_ephemeral_provisioner::core::sweep::listing::select;
use ci_ephemeral_provisioner::core::sweep::spare::SweepGuard;
use ci_ephemeral_provisioner::core::time::Timestamp;
use ci_ephemeral_provisioner::driver::sweep::list_all;
use forgejo_model::rules;
use proptest::prelude::*;
use serde_json::{Value, json};

/// Any JSON value, nested a few levels.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::String),
        prop_oneof![
            Just("offline"),
            Just("idle"),
            Just("active"),
            Just("Offline"),
            Just(" offline"),
            Just("offline "),
            Just("OFFLINE")
        ]
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("id".to_string()),
                    Just("name".to_string()),
                    Just("status".to_string()),
                    Just("handle".to_string()),
                    Just("runs_on".to_string()),
                    "[a-z_]{1,8}"
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn any_status() -> impl Strategy<Value = RunnerStatus> {
    prop_oneof![
        Just(RunnerStatus::Offline),
        Just(RunnerStatus::Idle),
        Just(RunnerStatus::Active),
        Just(RunnerStatus::Missing),
        ".{0,10}".prop_map(RunnerStatus::Unknown),
    ]
}

/// A status as Forgejo would put it in JSON (`None`: the field is absent).
fn status_json(s: &RunnerStatus) -> Option<Value> {
    match s {
        RunnerStatus::Offline => Some(json!("offline")),
        RunnerStatus::Idle => Some(json!("idle")),
        RunnerStatus::Active => Some(json!("active")),
        RunnerStatus::Unknown(u) => Some(json!(u)),
        RunnerStatus::Missing => None,
    }
}

fn canonical(s: RunnerStatus) -> RunnerStatus {
    // An "unknown" string that happens to be a known one parses as the known one.
    match s {
        RunnerStatus::Unknown(u) => RunnerStatus::from_json(Some(&json!(u))),
        other => other,
    }
}

/// Names with and without our usual prefix, statuses often `offline`: deletable rows are common.
fn any_runner() -> impl Strategy<Value = Runner> {
    (
        any::<i64>(),
        proptest::option::of(prop_oneof![
            "ephemeral-.{0,10}",
            ".{0,20}",
            "ephemeral-c-[0-9]-20[0-9]{2}[01][0-9][0-3][0-9]t[0-2][0-9][0-5][0-9]{3}z",
        ]),
        prop_oneof![Just(RunnerStatus::Offline), any_status()],
    )
        .prop_map(|(id, name, status)| Runner {
            id,
            name,
            status: canonical(status),
            labels: None,
        })
}

/// A page of runners whose ids repeat (within and across pages).
fn few_ids() -> impl Strategy<Value = Vec<Runner>> {
    prop::collection::vec(
        (0i64..20, any_runner()).prop_map(|(id, r)| Runner { id, ..r }),
        0..60,
    )
}

fn runner_json(r: &Runner) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("id".into(), json!(r.id));
    if let Some(n) = &r.name {
        m.insert("name".into(), json!(n));
    }
    if let Some(s) = status_json(&r.status) {
        m.insert("status".into(), s);
    }
    m.insert("labels".into(), Value::Null);
    Value::Object(m)
}

fn any_timestamp() -> impl Strategy<Value = Timestamp> {
    (0i64..4_102_444_800_000).prop_map(Timestamp)
}

fn any_registration() -> impl Strategy<Value = Registration> {
    (
        ".{0,30}",
        proptest::option::of(any::<i64>()),
        proptest::option::of(".{0,36}"),
        any::<i64>(),
        ".{0,36}",
        any_timestamp(),
        prop_oneof![
            Just(Launch::Pending),
            Just(Launch::Started),
            Just(Launch::Done),
            Just(Launch::Failed)
        ],
        proptest::option::of(any_timestamp()),
        (
            proptest::option::of(any_timestamp()),
            any::<bool>(),
            prop_oneof![
                Just(None),
                Just(Some(NotServed::PickupTimeout)),
                Just(Some(NotServed::WrongLabels))
            ],
            any::<bool>(),
            any_process(),
        ),
    )
        .prop_map(
            |(
                name,
                id,
                uuid,
                job_id,
                job_handle,
                requested_at,
                launch,
                launched_at,
                (gone, connected, not_served, failed_start, stopped),
            )| {
                Registration {
                    name,
                    id,
                    uuid,
                    job_id,
                    job_handle,
                    requested_at,
                    launch,
                    launched_at,
                    job_gone_since: gone,
                    busy: connected && failed_start,
                    connected,
                    not_served,
                    failed_start,
                    stopped,
                    job_first_seen: launched_at,
                }
            },
        )
}

fn any_process() -> impl Strategy<Value = Option<ProcessState>> {
    prop_oneof![
        Just(None),
        Just(Some(ProcessState::Unchecked)),
        Just(Some(ProcessState::Gone)),
        ".{0,20}".prop_map(|w| Some(ProcessState::NotGone(w))),
    ]
}

fn any_previous() -> impl Strategy<Value = PreviousRunner> {
    (
        any::<i64>(),
        ".{0,12}",
        ".{0,12}",
        any::<i64>(),
        any_process(),
    )
        .prop_map(|(id, name, uuid, job_id, process)| PreviousRunner {
            id,
            name,
            uuid: uuid.clone(),
            job_id,
            job_handle: uuid,
            process: process.unwrap_or(ProcessState::Unchecked),
        })
}

fn any_state() -> impl Strategy<Value = CycleState> {
    (
        // The ids this tool writes (cycle.json refuses any other).
        "[a-z0-9-]{1,30}",
        ".{0,12}",
        any_timestamp(),
        prop_oneof![
            Just(Phase::Applying),
            Just(Phase::Running),
            Just(Phase::TearingDown),
            Just(Phase::Destroyed)
        ],
        proptest::option::of(any_timestamp()),
        (any::<u32>(), any::<u32>(), any::<u32>()),
        prop::collection::vec(any_registration(), 0..4),
        proptest::option::of(".{0,40}"),
        proptest::option::of(".{0,40}"),
        prop::collection::btree_map("[a-z_]{1,8}", ".{0,16}".prop_map(Value::String), 0..3),
        (
            proptest::option::of((
                proptest::option::of(any::<i64>()),
                proptest::option::of(any::<i64>()),
            )),
            prop::collection::vec(any_previous(), 0..3),
        ),
    )
        .prop_map(
            |(
                id,
                prefix,
                started,
                phase,
                ready,
                (jobs, seq, fails),
                regs,
                why,
                err,
                outputs,
                (boundary, previous),
            )| {
                let mut s = CycleState::new(id, started);
                s.runner_prefix = prefix;
                s.phase = phase;
                s.vm_ready_at = ready;
                s.free_since = ready;
                s.jobs_started = jobs;
                s.next_seq = seq;
                s.start_failures = fails;
                s.registrations = regs;
                s.teardown_reason = why;
                s.last_error = err;
                s.outputs = outputs.into_iter().collect::<BTreeMap<_, _>>();
                s.boundary = boundary.map(|(repo_id, owner_id)| Boundary { repo_id, owner_id });
                s.previous = previous;
                s
            },
        )
}

/// The gate as a yes/no: whether `may_delete` makes a `Deletable` of a runner with this name
/// and status (and, when it does, one for that runner).
fn gate(name: Option<&str>, status: &RunnerStatus, prefix: &str) -> bool {
    let r = Runner {
        id: 7,
        name: name.map(str::to_string),
        status: status.clone(),
        labels: None,
    };
    let d = may_delete(&r, prefix);
    assert!(d.as_ref().is_none_or(|d| d.id() == 7));
    d.is_some()
}

/// The gate's cases one by one (the properties below explore the rest).
#[test]
fn gate_requires_prefix_and_exactly_offline() {
    let p = "ephemeral-";
    assert!(gate(Some("ephemeral-1"), &RunnerStatus::Offline, p));
    for status in [
        RunnerStatus::Idle,
        RunnerStatus::Active,
        RunnerStatus::Missing,
        RunnerStatus::Unknown("Offline".into()),
    ] {
        assert!(!gate(Some("ephemeral-1"), &status, p), "{status:?}");
    }
    for name in [Some("my-ephemeral-1"), Some("static-builder"), None] {
        assert!(!gate(name, &RunnerStatus::Offline, p), "{name:?}");
    }
    assert!(!gate(Some("anything"), &RunnerStatus::Offline, ""));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    // -- the deletion gate ---------------------------------------------------------------------

    /// Deletable exactly when: a non-empty prefix, a name that starts with it, status offline.
    // Mutation caught: may_delete without the offline check.
    // Mutation caught: may_delete without the prefix check.
    #[test]
    fn gate_needs_prefix_name_and_exactly_offline(
        name in proptest::option::of(".{0,24}"),
        ours in any::<bool>(),
        status in any_status(),
        prefix in ".{0,8}",
    ) {
        // Half of the names carry the prefix, so both sides of the gate are explored.
        let name = name.map(|n| if ours { format!("{prefix}{n}") } else { n });
        let ok = gate(name.as_deref(), &status, &prefix);
        if ok {
            prop_assert!(!prefix.is_empty());
            prop_assert!(name.as_deref().unwrap().starts_with(&prefix));
            prop_assert_eq!(&status, &RunnerStatus::Offline);
        }
        if status != RunnerStatus::Offline || prefix.is_empty() || name.is_none() {
            prop_assert!(!ok);
        }
    }

    /// Any name made of the prefix and a suffix, offline, passes; any other status does not.
    // Mutation caught: may_delete without the offline check.
    #[test]
    fn gate_admits_our_offline_runners(prefix in ".{1,8}", suffix in ".{0,24}", status in any_status()) {
        let name = format!("{prefix}{suffix}");
        prop_assert_eq!(
            gate(Some(&name), &status, &prefix),
            status == RunnerStatus::Offline
        );
    }

    /// Whatever JSON Forgejo sends as `status`, only the exact string "offline" can delete.
    // Mutation caught: RunnerStatus parses "Offline" (any case) as offline.
    #[test]
    fn only_the_exact_string_offline_can_delete(v in proptest::option::of(any_json())) {
        let status = RunnerStatus::from_json(v.as_ref());
        if gate(Some("ephemeral-x"), &status, "ephemeral-") {
            prop_assert_eq!(v, Some(json!("offline")));
        }
    }

    // -- runner and job answers ----------------------------------------------------------------

    /// Arbitrary text never panics the parsers.
    #[test]
    fn parsers_never_panic_on_text(s in ".{0,200}") {
        let _ = parse_runner_page(&s);
        let _ = parse_jobs(&s);
        let _ = parse_state(&s);
    }

    /// Arbitrary JSON: a page either fails or holds one row per entry, each with the entry's id,
    /// and a row is offline only when its entry said exactly "offline".
    #[test]
    fn runner_pages_keep_ids_and_never_invent_offline(v in any_json()) {
        if let Ok(rows) = parse_runner_page(&v.to_string()) {
            let items = v.as_array().expect("only an array parses");
            prop_assert_eq!(rows.len(), items.len());
            for (row, item) in rows.iter().zip(items) {
                prop_assert_eq!(Some(row.id), item.get("id").and_then(Value::as_i64));
                if row.status == RunnerStatus::Offline {
                    prop_assert_eq!(item.get("status"), Some(&json!("offline")));
                }
                prop_assert_eq!(row.name.as_deref(), item.get("name").and_then(Value::as_str));
            }
        }
    }

    /// Runners written the way Forgejo writes them parse back to themselves.
    #[test]
    fn runner_pages_round_trip(runners in prop::collection::vec(any_runner(), 0..60)) {
        let body = Value::Array(runners.iter().map(runner_json).collect()).to_string();
        prop_assert_eq!(parse_runner_page(&body).unwrap(), runners);
    }

    /// Jobs round-trip, and `null` is no jobs.
    #[test]
    fn jobs_round_trip(jobs in prop::collection::vec(
        (any::<i64>(), ".{0,20}", ".{0,10}", prop::collection::vec(".{0,8}", 0..4)), 0..20)
    ) {
        let jobs: Vec<Job> = jobs.into_iter().map(|(id, handle, status, runs_on)| Job { id, handle, status, runs_on, repo_id: None, owner_id: None }).collect();
        let body = Value::Array(jobs.iter().map(|j| json!({
            "id": j.id, "handle": j.handle, "status": j.status, "runs_on": j.runs_on,
        })).collect()).to_string();
        prop_assert_eq!(parse_jobs(&body).unwrap(), jobs);
        prop_assert!(parse_jobs("null").unwrap().is_empty());
    }

    // -- cycle.json ----------------------------------------------------------------------------

    /// Every state the tool can hold is written and read back unchanged.
    #[test]
    fn cycle_json_round_trips_through_the_file(state in any_state()) {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::new(dir.path());
        store.save(&state).unwrap();
        prop_assert_eq!(read_state_file(&store.path()).unwrap(), Some(state));
    }

    /// A flipped byte anywhere in a valid file: refused, or read as a state that is still
    /// version 1 (never a panic).
    #[test]
    fn a_corrupted_byte_is_refused_or_harmless(state in any_state(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut bytes = serde_json::to_vec_pretty(&state).unwrap();
        let i = at.index(bytes.len());
        bytes[i] = byte;
        if let Ok(text) = String::from_utf8(bytes) && let Ok(s) = parse_state(&text) {
            prop_assert_eq!(s.version, 1);
        }
    }

    // -- the sweep -----------------------------------------------------------------------------

    /// Whatever the listing holds, the sweep selects only rows the gate admits, never a
    /// conflicting one, at most `cap`.
    // Mutation caught: core::sweep::listing::select ignores conflicting rows.
    #[test]
    fn sweep_selects_only_what_the_gate_admits(
        rows in prop::collection::vec(any_runner(), 0..80),
        conflicting in prop::collection::vec(any::<prop::sample::Index>(), 0..4),
        prefix in prop_oneof![Just("ephemeral-".to_string()), ".{0,4}"],
        cap in 0usize..100,
        held in prop::collection::vec(any::<prop::sample::Index>(), 0..4),
        now_ms in 0i64..4_000_000_000_000,
        min_age_s in 0u64..100_000,
    ) {
        let conflicting: Vec<i64> = if rows.is_empty() { vec![] } else {
            conflicting.iter().map(|i| rows[i.index(rows.len())].id).collect()
        };
        let held: std::collections::BTreeSet<String> = if rows.is_empty() { Default::default() } else {
            held.iter().filter_map(|i| rows[i.index(rows.len())].name.clone()).collect()
        };
        let guard = SweepGuard { now: Timestamp(now_ms), min_age: Duration::from_secs(min_age_s), held };
        let listing = Listing { rows: rows.clone(), conflicting: conflicting.clone(), pages: 1, complete: true, total: None, distinct: rows.len() };
        let sel = select(&listing, &prefix, cap, &guard);
        prop_assert!(sel.delete.len() <= cap);
        for (target, r) in &sel.delete {
            prop_assert_eq!(target.id(), r.id);
            prop_assert_eq!(may_delete(r, &prefix), Some(target.clone()));
            prop_assert!(!conflicting.contains(&r.id));
            // Nothing another slot holds, nothing too young by its name.
            prop_assert_eq!(guard.spares(r.name.as_deref().unwrap_or_default()), None);
        }
    }

    /// Paging through arbitrary pages (rows, counts, an error anywhere) always ends, and a row
    /// seen with two different contents is marked conflicting.
    // Mutation caught: list_all never marks a row seen with two contents as conflicting.
    // Mutation caught: a listing with more rows than its count taken as complete (the bug, reintroduced).
    #[test]
    fn listing_arbitrary_pages_ends_and_flags_conflicts(
        pages in prop::collection::vec((few_ids(), proptest::option::of(0u64..200)), 0..6),
        fail_at in proptest::option::of(0usize..6),
    ) {
        let mut f = Pages { pages: pages.clone(), fail_at, asked: 0 };
        match list_all(&mut f, &|_| true) {
            // A failed page, or a page of only ids already listed while more were announced
            // (a server that ignores `page`).
            Err(e) => prop_assert!(
                fail_at.is_some_and(|k| k < f.asked) || e.to_string().contains("only runners already listed"),
                "{}", e
            ),
            Ok(listing) => {
                prop_assert!(f.asked as u32 <= ci_ephemeral_provisioner::core::sweep::listing::MAX_PAGES);
                // Complete means: exactly as many distinct rows as the count every page gave.
                if listing.complete && let Some(t) = listing.total {
                    prop_assert_eq!(listing.rows.len() as u64, t);
                }
                let mut seen: BTreeMap<i64, Vec<&Runner>> = BTreeMap::new();
                for (rows, _) in pages.iter().take(f.asked) {
                    for r in rows {
                        seen.entry(r.id).or_default().push(r);
                    }
                }
                for (id, versions) in seen {
                    if versions.iter().any(|v| *v != versions[0]) {
                        prop_assert!(listing.conflicting.contains(&id), "id {} differs between pages", id);
                    }
                }
            }
        }
    }
}

/// A Forgejo whose runner pages are given (pages past the end are empty).
struct Pages {
    pages: Vec<(Vec<Runner>, Option<u64>)>,
    fail_at: Option<usize>,
    asked: usize,
}

impl Forgejo for Pages {
    fn list_jobs(&mut self) -> Result<Vec<Job>, ApiError> {
        unreachable!()
    }
    fn get_runner(&mut self, _: i64) -> Result<Option<Runner>, ApiError> {
        unreachable!()
    }
    fn delete_runner(&mut self, _: &Deletable, _: &str) -> Result<Deleted, ApiError> {
        unreachable!()
    }
    fn register_runner(&mut self, _: &str) -> Result<NewRunner, ApiError> {
        unreachable!()
    }
    fn list_runners_page(&mut self, page: u32, limit: u32) -> Result<RunnerPage, ApiError> {
        assert_eq!(limit, PAGE_LIMIT);
        let i = (page - 1) as usize;
        self.asked = self.asked.max(i + 1);
        if self.fail_at == Some(i) {
            return Err(ApiError {
                request: format!("page {page}"),
                detail: "injected".into(),
                status: Some(500),
            });
        }
        Ok(match self.pages.get(i) {
            Some((rows, total)) => RunnerPage {
                rows: rows.clone(),
                total: *total,
            },
            None => RunnerPage {
                rows: vec![],
                total: None,
            },
        })
    }
}

// --- `--labels` against forgejo-runner's own parser ---------------------------------------------

/// One `--labels` entry, from pieces that hit `labels.Parse`'s edges: blanks and control
/// characters around and inside names, schemes and arguments; the known schemes, a plugin's, an
/// empty one; no argument, an empty one, `//`-prefixed ones.
fn any_entry() -> impl Strategy<Value = String> {
    use prop::sample::select;
    let names = vec![
        "debian",
        "a b",
        " x",
        "x ",
        "\u{a0}x",
        "",
        "ü",
        "q\tq",
        "n\u{1b}",
        "x\u{202e}",
    ];
    let name = prop_oneof![select(names).prop_map(String::from), "[a-c]{1,3}"];
    let scheme = select(vec![
        "host", "docker", "lxc", "k8spod", "hots", "", " host", "host ",
    ]);
    let argument = select(vec!["", "//node:22", "node", " //x", "//x ", "a:b"]);
    (
        name,
        proptest::option::of((scheme, proptest::option::of(argument))),
    )
        .prop_map(|(n, rest)| match rest {
            None => n,
            Some((s, None)) => format!("{n}:{s}"),
            Some((s, Some(a))) => format!("{n}:{s}:{a}"),
        })
}

/// What the product refuses beyond `labels.Parse`, and why, read off forgejo-runner's own
/// reading of the entry (`rules::parse_label`): `None` when it has no reason to.
fn beyond_parse(entry: &str) -> Option<&'static str> {
    let parsed = rules::parse_label(entry).ok()?;
    let parts: Vec<&str> = entry.splitn(3, ':').collect();
    let blank = |p: Option<&&str>| p.is_some_and(|p| p.trim() != *p);
    if entry.is_empty() {
        Some("empty entry")
    } else if parsed.name.is_empty() {
        Some("no name")
    } else if entry.chars().any(|c| {
        // Control characters, and the marks that make a line read other than it is.
        const MARKS: [(char, char); 4] = [
            ('\u{200e}', '\u{200f}'),
            ('\u{2028}', '\u{2029}'),
            ('\u{202a}', '\u{202e}'),
            ('\u{2066}', '\u{2069}'),
        ];
        c.is_control() || MARKS.iter().any(|&(lo, hi)| (lo..=hi).contains(&c))
    }) {
        Some("a control character")
    } else if blank(parts.get(1)) || blank(parts.get(2)) {
        Some("a blank around the scheme or argument")
    } else if !["host", "docker", "lxc"].contains(&parsed.schema.as_str()) {
        Some("a scheme this tool does not serve")
    } else {
        None
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Every list the product takes, forgejo-runner takes entry by entry with the same names,
    /// schemes and images, and declares those names; every entry forgejo-runner refuses, the
    /// product refuses; and the product refuses more only for a reason it states.
    // Mutation caught: core::labels takes a plugin's scheme as host.
    #[test]
    fn labels_read_as_forgejo_runner_reads_them(
        entries in prop::collection::vec(any_entry(), 1..5),
        noise in "[a-c:, /\t]{0,12}",
    ) {
        for list in [entries.join(","), noise] {
            match Labels::parse(&list) {
                Ok(None) => prop_assert!(list.is_empty()),
                Ok(Some(labels)) => {
                    let entries: Vec<&str> = list.split(',').collect();
                    let mine: Vec<_> = labels.iter().collect();
                    prop_assert_eq!(mine.len(), entries.len());
                    for (l, entry) in mine.iter().zip(&entries) {
                        let theirs = rules::parse_label(entry);
                        prop_assert!(theirs.is_ok(), "{:?}: {:?}", entry, theirs);
                        let theirs = theirs.unwrap();
                        prop_assert_eq!(&l.name, &theirs.name);
                        prop_assert_eq!(l.scheme.as_str(), theirs.schema.as_str());
                        let image = theirs.arg.strip_prefix("//").unwrap_or(&theirs.arg);
                        prop_assert_eq!(l.image.as_deref(), (!image.is_empty()).then_some(image));
                        prop_assert!(beyond_parse(entry).is_none(), "{:?}", entry);
                    }
                    prop_assert_eq!(
                        rules::declared_names(&list).unwrap(),
                        labels.names()
                    );
                }
                Err(e) => {
                    let entries: Vec<&str> = list.split(',').collect();
                    prop_assert!(e.position >= 1 && e.position <= entries.len());
                    let entry = entries[e.position - 1];
                    prop_assert_eq!(&e.entry, entry);
                    // Every entry before it was fine.
                    for before in &entries[..e.position - 1] {
                        prop_assert!(
                            rules::parse_label(before).is_ok() && beyond_parse(before).is_none(),
                            "{:?} before {:?}", before, entry
                        );
                    }
                    let refused_by_runner = rules::parse_label(entry).is_err();
                    let duplicate = matches!(e.rule, Rule::Duplicate { .. });
                    prop_assert!(
                        refused_by_runner || beyond_parse(entry).is_some() || duplicate,
                        "{:?} refused ({}) although forgejo-runner takes it and no rule of ours says why",
                        entry, e
                    );
                    if let Rule::Duplicate { first } = e.rule {
                        let name = |x: &str| rules::parse_label(x).map(|l| l.name);
                        prop_assert_eq!(name(entries[first - 1]), name(entry));
                    }
                    let shown = format!("--labels entry {} (", e.position);
                    prop_assert!(e.to_string().starts_with(&shown), "{}", e);
                }
            }
        }
    }
}
