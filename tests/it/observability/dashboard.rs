//! The Grafana dashboard, `contrib/grafana/ci-ephemeral-provisioner.json`: importable (its
//! datasource a variable that every panel and query uses), each panel described and answered in
//! `contrib/README.md`, and every expression held to the metric and label names the binary
//! exports (`core::metrics::render`, the one source of them): no panel on a metric or label that
//! does not exist. With `$OBS_ARTIFACTS` set, the expressions are also left there as a rule file
//! for `promtool check rules` (`.ci/obs`): their syntax is Prometheus's to judge.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;

use ci_ephemeral_provisioner::core::backoff::Backoff;
use ci_ephemeral_provisioner::core::metrics::{Counters, CycleView, render};
use ci_ephemeral_provisioner::core::report::Report;
use ci_ephemeral_provisioner::core::state::CycleState;
use ci_ephemeral_provisioner::core::time::Timestamp;
use serde_json::Value;

use crate::support::tree::{read, root};

const DASHBOARD: &str = "contrib/grafana/ci-ephemeral-provisioner.json";
const PREFIX: &str = "ci_ephemeral_provisioner_";

/// Every metric name the binary exports (a histogram's `_bucket`, `_sum`, `_count` included),
/// with the label names its samples carry: rendered with every optional sample present and the
/// labels a pool of several slots adds.
fn exported() -> BTreeMap<String, BTreeSet<String>> {
    let mut c = Counters::default();
    let mut r = Report::new("run", false, Timestamp(1_000));
    r.exit_code = 1;
    r.finished_at = Some(Timestamp(2_000));
    c.record(&r);
    let cycle = CycleState::new("c1".into(), Timestamp(1_000));
    let text = render(
        &c,
        &CycleView::Active(&cycle),
        Some(&Backoff::new()),
        Some(Timestamp(1_000)),
        &[("pool", "p".into()), ("slot", "2".into())],
    );
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (name, kind) = (it.next().unwrap(), it.next().unwrap());
            let names = if kind == "histogram" {
                ["_bucket", "_sum", "_count"]
                    .iter()
                    .map(|s| format!("{name}{s}"))
                    .collect()
            } else {
                vec![name.to_string()]
            };
            for n in names {
                out.entry(n).or_default();
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let name_end = line.find(['{', ' ']).unwrap();
            let labels = out.entry(line[..name_end].to_string()).or_default();
            if line[name_end..].starts_with('{') {
                let body = &line[name_end + 1..line.rfind('}').unwrap()];
                for pair in body.split("\",") {
                    labels.insert(pair.split('=').next().unwrap().to_string());
                }
            }
        }
    }
    out
}

/// The identifiers of an expression outside its strings and `[…]` ranges, with what follows
/// each (skipping blanks).
fn tokens(expr: &str) -> Vec<(String, Option<char>, usize)> {
    let b: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            '"' => {
                i += 1;
                while i < b.len() && b[i] != '"' {
                    i += if b[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '[' => {
                while i < b.len() && b[i] != ']' {
                    i += 1;
                }
                i += 1;
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == '$' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '_' || b[i] == '$') {
                    i += 1;
                }
                let mut j = i;
                while j < b.len() && b[j] == ' ' {
                    j += 1;
                }
                out.push((b[start..i].iter().collect(), b.get(j).copied(), j));
            }
            _ => i += 1,
        }
    }
    out
}

/// The names inside the parentheses that open at char `at` of `expr` (`by (a, b)`), or the
/// label names of the matchers in the braces that open there (`{a=~"x",b!="y"}`).
fn names_in(expr: &str, at: usize, close: char) -> Vec<String> {
    let rest: String = expr.chars().skip(at + 1).collect();
    let inside = &rest[..rest.find(close).unwrap_or(rest.len())];
    let mut out = Vec::new();
    let mut in_string = false;
    let mut word = String::new();
    let mut expecting_name = true;
    for c in inside.chars() {
        if in_string {
            in_string = c != '"';
            continue;
        }
        match c {
            '"' => in_string = true,
            c if (c.is_ascii_alphanumeric() || c == '_') && expecting_name => word.push(c),
            ',' => {
                expecting_name = true;
                if !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
            }
            '=' | '!' | '~' => {
                if !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
                expecting_name = false;
            }
            _ => {}
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

/// What is wrong with one expression (and the labels its legend names): a metric the binary
/// does not export, a label matched on a metric that does not carry it, or grouped by, or shown,
/// that none of its metrics carries.
fn expression_problems(
    expr: &str,
    legend: &str,
    exported: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let toks = tokens(expr);
    let mut labels: BTreeSet<String> = BTreeSet::new();
    let mut metrics = 0;
    for (t, next, at) in &toks {
        if !t.starts_with(PREFIX) {
            continue;
        }
        metrics += 1;
        let Some(carried) = exported.get(t) else {
            problems.push(format!("{expr}: {t} is not a metric the binary exports"));
            continue;
        };
        labels.extend(carried.iter().cloned());
        if *next == Some('{') {
            for l in names_in(expr, *at, '}') {
                if !carried.contains(&l) {
                    problems.push(format!("{expr}: {t} has no label {l}"));
                }
            }
        }
    }
    if metrics == 0 {
        problems.push(format!("{expr}: no metric of the binary's"));
    }
    for (t, next, at) in &toks {
        if matches!(t.as_str(), "by" | "without" | "on" | "ignoring") && *next == Some('(') {
            for l in names_in(expr, *at, ')') {
                if !labels.contains(&l) {
                    problems.push(format!("{expr}: {t} ({l}): none of its metrics has {l}"));
                }
            }
        }
    }
    for part in legend.split("{{").skip(1) {
        let l = part.split("}}").next().unwrap_or("").trim();
        if !labels.contains(l) {
            problems.push(format!(
                "{expr}: the legend shows {{{{{l}}}}}, which none of its metrics has"
            ));
        }
    }
    problems
}

/// Every expression of the dashboard with its legend and where it is, and the `label_values`
/// queries of its variables.
fn expressions(dash: &Value) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            out.push((
                format!("panel {:?}", p["title"].as_str().unwrap()),
                t["expr"].as_str().unwrap().to_string(),
                t["legendFormat"].as_str().unwrap_or("").to_string(),
            ));
        }
    }
    out
}

fn dashboard() -> Value {
    serde_json::from_str(&read(&root().join(DASHBOARD))).expect("the dashboard is JSON")
}

// Mutation caught: a panel on a metric or label the binary does not export (each of the
// planted ones below), or a dashboard bound to one datasource's uid.
#[test]
fn every_expression_of_the_dashboard_uses_what_the_binary_exports() {
    let exported = exported();
    assert!(exported.contains_key("ci_ephemeral_provisioner_job_pickup_seconds_bucket"));
    assert!(exported["ci_ephemeral_provisioner_job_pickup_seconds_bucket"].contains("le"));
    let dash = dashboard();
    let mut problems = Vec::new();
    let exprs = expressions(&dash);
    assert!(exprs.len() >= 10, "{exprs:?}");
    for (place, expr, legend) in &exprs {
        for p in expression_problems(expr, legend, &exported) {
            problems.push(format!("{place}: {p}"));
        }
    }
    // The variables: the datasource one, and `label_values(metric, label)` of an exported pair.
    let vars = dash["templating"]["list"].as_array().unwrap();
    assert!(
        vars.iter().any(|v| v["type"] == "datasource"
            && v["name"] == "datasource"
            && v["query"] == "prometheus"),
        "no Prometheus datasource variable: {vars:?}"
    );
    for v in vars.iter().filter(|v| v["type"] == "query") {
        let q = v["definition"].as_str().unwrap();
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {}: {q}", v["name"]));
        let (metric, label) = inner.split_once(',').unwrap();
        if !exported
            .get(metric.trim())
            .is_some_and(|l| l.contains(label.trim()))
        {
            problems.push(format!(
                "variable {}: {q}: no such metric and label",
                v["name"]
            ));
        }
    }
    // Every panel and query on the variable, none on a datasource of some installation.
    let ds = serde_json::json!({"type": "prometheus", "uid": "${datasource}"});
    for p in dash["panels"].as_array().unwrap() {
        let title = p["title"].as_str().unwrap();
        if p["datasource"] != ds
            || p["targets"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t["datasource"] != ds)
        {
            problems.push(format!(
                "panel {title:?}: its datasource is not ${{datasource}}"
            ));
        }
        if p["description"].as_str().is_none_or(str::is_empty) {
            problems.push(format!("panel {title:?} says nothing of what it shows"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // The check bites: planted panels on what does not exist.
    for (expr, legend, want) in [
        (
            "sum(ci_ephemeral_provisioner_vms_up)",
            "",
            "is not a metric the binary exports",
        ),
        (
            "sum by (region) (ci_ephemeral_provisioner_cycle_active)",
            "",
            "none of its metrics has region",
        ),
        (
            "ci_ephemeral_provisioner_runs_total{status=\"1\"}",
            "",
            "has no label status",
        ),
        (
            "ci_ephemeral_provisioner_cycle_active",
            "{{reason}}",
            "the legend shows {{reason}}",
        ),
        ("up", "", "no metric of the binary's"),
    ] {
        let found = expression_problems(expr, legend, &exported);
        assert!(found.iter().any(|p| p.contains(want)), "{expr}: {found:?}");
    }
    assert!(expression_problems(
        "histogram_quantile(0.5, sum by (pool, le) (increase(ci_ephemeral_provisioner_job_pickup_seconds_bucket{pool=~\"$pool\"}[1h])))",
        "{{pool}}",
        &exported
    )
    .is_empty());

    if let Some(dir) = std::env::var_os("OBS_ARTIFACTS") {
        // One recording rule per expression, Grafana's variables given values: `promtool check
        // rules` parses each (`.ci/obs`).
        let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
        for (i, (_, expr, _)) in exprs.iter().enumerate() {
            let e = expr
                .replace("$__range", "1d")
                .replace("$__rate_interval", "5m")
                .replace("$pool", ".*");
            rules.push_str(&format!(
                "      - record: dashboard:expr{i}\n        expr: {}\n",
                serde_json::to_string(&e).unwrap()
            ));
        }
        fs::write(
            std::path::Path::new(&dir).join("dashboard-rules.yml"),
            rules,
        )
        .unwrap();
    }
}

// Mutation caught: a panel contrib/README.md does not answer for.
#[test]
fn contrib_readme_says_which_question_each_panel_answers() {
    let readme = read(&root().join("contrib/README.md"));
    let dash = dashboard();
    for p in dash["panels"].as_array().unwrap() {
        let title = p["title"].as_str().unwrap();
        assert!(
            readme
                .lines()
                .any(|l| l.starts_with(&format!("| {title} | "))),
            "contrib/README.md has no row for the panel {title:?}"
        );
    }
}
