//! `status --remote` as data: the pool's registrations in Forgejo, each with the cycle that holds
//! it and what a sweep would do with it by the sweep's own rules (`core::sweep`: the gate, the
//! selection, what it spares), and the resources in the module's tofu state.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::core::forgejo::Runner;
use crate::core::state::CycleState;
use crate::core::sweep::gate::may_delete;
use crate::core::sweep::listing::{Listing, select};
use crate::core::sweep::spare::{Spared, SweepGuard, registered_at};
use crate::core::time::format_duration;

/// What a sweep run now would do with one registration of ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// It passes the gate and nothing spares it: deleted.
    Delete,
    /// Deletable, but past `--sweep-max-deletions`: left for the next sweep.
    OverCap,
    /// Its name shows it is younger than the sweep's minimum age.
    SparedYoung,
    /// Another slot of the pool holds it.
    SparedHeld,
    /// Its status or the time in its name is in doubt: never deleted.
    Doubtful,
    /// Forgejo does not report it `offline` (idle, active): the gate keeps it.
    NotOffline,
}

impl Verdict {
    /// What the text form says of it.
    pub fn describe(self) -> &'static str {
        match self {
            Verdict::Delete => "a sweep deletes it",
            Verdict::OverCap => "a sweep deletes it, after the others (over --sweep-max-deletions)",
            Verdict::SparedYoung => "a sweep spares it: too young to judge",
            Verdict::SparedHeld => "a sweep spares it: another slot holds it",
            Verdict::Doubtful => "a sweep skips it: its status or time is in doubt",
            Verdict::NotOffline => "a sweep keeps it: not offline",
        }
    }
}

/// One registration of ours, as shown.
#[derive(Clone, Debug, Serialize)]
pub struct RemoteRegistration {
    pub id: i64,
    pub name: Option<String>,
    pub status: String,
    /// How long ago its name says it was created (none for a name without a time).
    pub age_seconds: Option<u64>,
    /// The slot and cycle whose cycle.json holds it, if any: none means no cycle of this pool
    /// knows it (the sweep's to judge).
    pub cycle: Option<Holder>,
    pub sweep: Verdict,
}

/// A cycle of the pool, in one of its slots (of one of its hosts, with `--store pg`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Holder {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    pub slot: u32,
    pub cycle_id: String,
}

/// Which cycle of the pool holds each registration name (intents included), from each slot's
/// cycle (and its host, in a pool across hosts).
pub fn holders<'a>(
    cycles: impl IntoIterator<Item = (Option<&'a str>, u32, &'a CycleState)>,
) -> BTreeMap<String, Holder> {
    let mut out = BTreeMap::new();
    for (host, slot, state) in cycles {
        for r in &state.registrations {
            out.insert(
                r.name.clone(),
                Holder {
                    host: host.map(str::to_string),
                    slot,
                    cycle_id: state.cycle_id.clone(),
                },
            );
        }
    }
    out
}

/// Pure: every listed registration of ours with what a sweep would do with it, by the sweep's
/// own selection ([`select`], with its guard and cap) and gate ([`may_delete`]).
pub fn registrations(
    listing: &Listing,
    prefix: &str,
    cap: usize,
    guard: &SweepGuard,
    holders: &BTreeMap<String, Holder>,
) -> Vec<RemoteRegistration> {
    let sel = select(listing, prefix, cap, guard);
    let verdict = |r: &Runner| -> Verdict {
        if sel.delete.iter().any(|(d, _)| d.id() == r.id) {
            return Verdict::Delete;
        }
        if let Some((_, why)) = sel.spared.iter().find(|(s, _)| s.id == r.id) {
            return match why {
                Spared::TooYoung => Verdict::SparedYoung,
                Spared::HeldByAnotherSlot => Verdict::SparedHeld,
                Spared::DoubtfulTime => Verdict::Doubtful,
            };
        }
        if sel.doubtful.iter().any(|d| d.id == r.id) {
            return Verdict::Doubtful;
        }
        if may_delete(r, prefix).is_some() {
            Verdict::OverCap
        } else {
            Verdict::NotOffline
        }
    };
    listing
        .rows
        .iter()
        .map(|r| RemoteRegistration {
            id: r.id,
            name: r.name.clone(),
            status: r.status.as_str().to_string(),
            age_seconds: r
                .name
                .as_deref()
                .and_then(registered_at)
                .and_then(Result::ok)
                .map(|t| guard.now.since(t).as_secs()),
            cycle: r.name.as_ref().and_then(|n| holders.get(n).cloned()),
            sweep: verdict(r),
        })
        .collect()
}

/// One resource in the module's tofu state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StateResource {
    /// With `--store pg`: the cycle's workspace it is in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    pub address: String,
    /// Its `id` and `name` attributes, when the resource has them and they are not sensitive.
    pub id: Option<String>,
    pub name: Option<String>,
}

/// The managed resources of `tofu show -json` (the root module and its children), with their
/// `id` and `name` unless tofu marks them sensitive. Data sources are left out: they own
/// nothing.
pub fn state_resources(show: &Value) -> Vec<StateResource> {
    let mut out = Vec::new();
    let mut modules = vec![&show["values"]["root_module"]];
    while let Some(m) = modules.pop() {
        for r in m["resources"].as_array().into_iter().flatten() {
            if r["mode"] != "managed" {
                continue;
            }
            let attr = |key: &str| -> Option<String> {
                if r["sensitive_values"][key] == Value::Bool(true) {
                    return None;
                }
                match &r["values"][key] {
                    Value::String(s) => Some(s.clone()),
                    Value::Number(n) => Some(n.to_string()),
                    _ => None,
                }
            };
            out.push(StateResource {
                workspace: None,
                address: r["address"].as_str().unwrap_or("?").to_string(),
                id: attr("id"),
                name: attr("name"),
            });
        }
        modules.extend(m["child_modules"].as_array().into_iter().flatten());
    }
    out.sort_by(|a, b| a.address.cmp(&b.address));
    out
}

/// The text form of the document `status --remote` adds (`remote`): its lines.
pub fn text_lines(remote: &Value) -> Vec<String> {
    let mut o = forgejo_lines(&remote["forgejo"]);
    o.extend(tofu_lines(&remote["tofu"]));
    o
}

fn str_of(v: &Value) -> String {
    v.as_str().unwrap_or("?").to_string()
}

/// The registrations' lines: a heading, then one per registration.
fn forgejo_lines(f: &Value) -> Vec<String> {
    if let Some(e) = f["error"].as_str() {
        return vec![format!("forgejo: FAILED: {e}")];
    }
    let regs = f["registrations"].as_array().cloned().unwrap_or_default();
    let mut o = vec![format!(
        "forgejo: {} registration(s) with prefix {} of {} listed in scope {} at {}{}",
        regs.len(),
        str_of(&f["runner_prefix"]),
        f["listed"],
        str_of(&f["scope"]),
        str_of(&f["url"]),
        if f["complete"] == Value::Bool(false) {
            " (the list changed while it was read: it may be short)"
        } else {
            ""
        }
    )];
    if let Some(refused) = f["sweep_refused"].as_str() {
        o.push(format!("  a sweep now is refused: {refused}"));
    }
    o.extend(regs.iter().map(registration_line));
    o
}

fn registration_line(r: &Value) -> String {
    // To the minute past one: what a reader compares with the sweep's minimum age.
    let age = r["age_seconds"]
        .as_u64()
        .map(|s| if s >= 60 { s - s % 60 } else { s })
        .map(|s| {
            format!(
                ", {} old",
                format_duration(std::time::Duration::from_secs(s))
            )
        })
        .unwrap_or_default();
    let held = match &r["cycle"] {
        Value::Null => "no cycle holds it".to_string(),
        c => format!(
            "held by cycle {} (slot {}{})",
            str_of(&c["cycle_id"]),
            c["slot"],
            c["host"]
                .as_str()
                .map(|h| format!(" of host {h}"))
                .unwrap_or_default()
        ),
    };
    let verdict: Verdict = serde_json::from_value(r["sweep"].clone()).unwrap_or(Verdict::Doubtful);
    format!(
        "  {} {} {}{age}; {held}; {}",
        r["id"],
        str_of(&r["name"]),
        str_of(&r["status"]),
        verdict.describe()
    )
}

/// The tofu state's lines: a heading, then one per resource.
fn tofu_lines(t: &Value) -> Vec<String> {
    match (t["error"].as_str(), t["skipped"].as_str()) {
        (Some(e), _) => vec![format!("tofu state: FAILED: {e}")],
        (None, Some(why)) => vec![format!("tofu state: not read: {why}")],
        (None, None) => {
            let res = t["resources"].as_array().cloned().unwrap_or_default();
            let mut o = vec![format!(
                "tofu state of {}: {} resource(s)",
                str_of(&t["tofu_dir"]),
                res.len()
            )];
            for r in &res {
                let mut line = format!("  {}", str_of(&r["address"]));
                for key in ["workspace", "id", "name"] {
                    if let Some(v) = r[key].as_str() {
                        line.push_str(&format!(" {key}={v}"));
                    }
                }
                o.push(line);
            }
            o
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::forgejo::RunnerStatus;
    use crate::core::sweep::listing::Seen;
    use crate::core::time::Timestamp;
    use std::time::Duration;

    fn listing(rows: Vec<Runner>) -> Listing {
        let keep = |_: &Runner| true;
        let mut seen = Seen::new(&keep);
        seen.merge(rows);
        seen.into_listing(1, true, None)
    }

    fn runner(id: i64, name: &str, status: RunnerStatus) -> Runner {
        Runner {
            id,
            name: Some(name.into()),
            status,
            labels: None,
        }
    }

    // Mutation caught: a verdict of its own (a second copy of the sweep's rules) that deletes
    // an idle runner, a young one, one another slot holds, or one past the cap.
    #[test]
    fn each_registration_gets_the_sweeps_own_verdict() {
        let now = Timestamp::parse_rfc3339("2026-10-14T12:00:00Z").unwrap();
        let old = "20261014t100000z";
        let young = "20261014t115959z";
        let rows = vec![
            runner(1, &format!("ephemeral-c1-1-{old}"), RunnerStatus::Offline),
            runner(2, &format!("ephemeral-c1-2-{old}"), RunnerStatus::Offline),
            runner(3, &format!("ephemeral-c2-1-{young}"), RunnerStatus::Offline),
            runner(4, &format!("ephemeral-c3-1-{old}"), RunnerStatus::Offline),
            runner(5, &format!("ephemeral-c4-1-{old}"), RunnerStatus::Idle),
            runner(
                6,
                &format!("ephemeral-c5-1-{old}"),
                RunnerStatus::Unknown("x".into()),
            ),
        ];
        let guard = SweepGuard {
            now,
            min_age: Duration::from_secs(600),
            held: [format!("ephemeral-c3-1-{old}")].into_iter().collect(),
        };
        let mut state = CycleState::new("c3".into(), now);
        state
            .registrations
            .push(crate::core::state::Registration::intent(
                format!("ephemeral-c3-1-{old}"),
                9,
                "h".into(),
                now,
            ));
        let held = holders([(None, 2, &state)]);
        let v = registrations(&listing(rows), "ephemeral-", 1, &guard, &held);
        let verdicts: Vec<(i64, Verdict)> = v.iter().map(|r| (r.id, r.sweep)).collect();
        assert_eq!(
            verdicts,
            [
                (1, Verdict::Delete),
                (2, Verdict::OverCap),
                (3, Verdict::SparedYoung),
                (4, Verdict::SparedHeld),
                (5, Verdict::NotOffline),
                (6, Verdict::Doubtful),
            ]
        );
        assert_eq!(v[0].age_seconds, Some(7200));
        assert_eq!(
            v[3].cycle,
            Some(Holder {
                host: None,
                slot: 2,
                cycle_id: "c3".into()
            })
        );
        assert_eq!(v[0].cycle, None);
    }

    #[test]
    fn state_resources_are_the_managed_ones_without_sensitive_attributes() {
        let show = serde_json::json!({"values": {"root_module": {
            "resources": [
                {"address": "hcloud_server.vm", "mode": "managed",
                 "values": {"id": "123", "name": "ci-hetzner-c1"}, "sensitive_values": {}},
                {"address": "data.hcloud_image.debian", "mode": "data", "values": {"id": "9"}},
                {"address": "tls_private_key.vm", "mode": "managed",
                 "values": {"id": "k", "name": "secret"}, "sensitive_values": {"name": true}}
            ],
            "child_modules": [{"resources": [
                {"address": "module.net.hcloud_network.n", "mode": "managed", "values": {"id": 7}}
            ]}]
        }}});
        let r = state_resources(&show);
        assert_eq!(
            r,
            [
                StateResource {
                    workspace: None,
                    address: "hcloud_server.vm".into(),
                    id: Some("123".into()),
                    name: Some("ci-hetzner-c1".into())
                },
                StateResource {
                    workspace: None,
                    address: "module.net.hcloud_network.n".into(),
                    id: Some("7".into()),
                    name: None
                },
                StateResource {
                    workspace: None,
                    address: "tls_private_key.vm".into(),
                    id: Some("k".into()),
                    name: None
                },
            ]
        );
        assert!(state_resources(&serde_json::json!({"format_version": "1.0"})).is_empty());
    }
}
