//! `status --remote`: what the pool owns outside this host, read-only. Its registrations in
//! Forgejo (every page listed with GET requests, as the sweep lists them) and the resources in
//! the module's tofu state (`tofu show -json`, which reads the state and changes nothing).

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::adapters::files::{FileStore, SlotDir, pool_slot_dirs, read_state_file};
use crate::adapters::forgejo_http::{HttpForgejo, Scope, load_ca_file, validate_url};
use crate::adapters::pg_store::PgStore;
use crate::adapters::signals::StopFlag;
use crate::adapters::tofu_cli::CliTofu;
use crate::cli::RemoteArgs;
use crate::commands::config::{check_prefix, intent_settle_of, read_token};
use crate::commands::exit::{Fatal, usage};
use crate::commands::wiring::{slot_tofu, sweep_refusal};
use crate::core::forgejo::Runner;
use crate::core::ports::{StateStore, Tofu};
use crate::core::state::STATE_FILE;
use crate::core::status::remote::{holders, registrations, state_resources};
use crate::core::sweep::gate::is_ours;
use crate::core::sweep::spare::{SweepGuard, sweep_min_age};
use crate::core::time::Timestamp;
use crate::driver::sweep::list_all;

/// How long each tofu command of `status --remote` (`workspace list`, `show -json`) may run: a
/// state backend that does not answer must not hang `status` (as `check` bounds its probe).
pub(crate) const TOFU_STATUS_TIMEOUT: Duration = Duration::from_secs(120);

/// The `remote` part of `status`'s document: `forgejo` and `tofu`, each with its `error` when it
/// could not be read. A flag that is wrong (or no token) is a usage error, before any request.
pub(super) fn gather(
    a: &RemoteArgs,
    slot: &SlotDir,
    now: Timestamp,
    mut pg: Option<&mut PgStore>,
) -> Result<Value, Fatal> {
    check_prefix(&a.target.runner_prefix)?;
    if let Some(dir) = a.module.tofu_dir.as_deref() {
        check_module_owner(dir)?;
    }
    let url = a.target.forgejo_url.as_deref().ok_or_else(|| {
        usage("status --remote needs --forgejo-url (or CI_EPHEMERAL_PROVISIONER_FORGEJO_URL), as `sweep` does")
    })?;
    let url = validate_url(url).map_err(|e| usage(format!("--forgejo-url: {e:#}")))?;
    let scope = Scope::parse(&a.target.scope).map_err(|e| usage(format!("--scope: {e:#}")))?;
    let ca = match &a.target.ca_file {
        Some(path) => Some(load_ca_file(path).map_err(|e| usage(format!("--ca-file: {e:#}")))?),
        None => None,
    };
    let token = read_token(&a.target.token_file)?;
    let mut forgejo = HttpForgejo::new(
        &url,
        scope,
        &token,
        &[],
        a.target.http_timeout,
        ca.as_deref(),
    );
    drop(token);
    let mut doc = json!({
        "url": url,
        "scope": a.target.scope,
        "runner_prefix": a.target.runner_prefix,
    });
    match forgejo_registrations(a, slot, &mut forgejo, now, pg.as_deref_mut()) {
        Ok(found) => {
            for (k, v) in found {
                doc[k] = v;
            }
        }
        Err(e) => doc["error"] = json!(format!("{e:#}")),
    }
    let pool = pg.map(|pg| pg.pool().to_string());
    Ok(json!({"forgejo": doc, "tofu": tofu_state(a, slot, pool)}))
}

/// Every registration with the prefix, with the cycle that holds it and the sweep's verdict.
fn forgejo_registrations(
    a: &RemoteArgs,
    slot: &SlotDir,
    forgejo: &mut HttpForgejo,
    now: Timestamp,
    pg: Option<&mut PgStore>,
) -> anyhow::Result<Vec<(&'static str, Value)>> {
    let prefix = a.target.runner_prefix.as_str();
    let ours = |r: &Runner| is_ours(r.name.as_deref(), prefix);
    let listing = list_all(forgejo, &ours)?;
    // What the sweep reads of the pool's other slots (and hosts), and every cycle of the pool.
    let (cycles, others) = match pg {
        Some(pg) => {
            let (cycles, others) = pg.pool_cycles()?;
            let cycles = cycles
                .into_iter()
                .map(|(h, k, s)| (Some(h), k, s))
                .collect();
            (cycles, others)
        }
        None => {
            let mut cycles = Vec::new();
            for (k, dir) in pool_slot_dirs(&slot.pool)? {
                if let Some(state) = read_state_file(&dir.join(STATE_FILE))? {
                    cycles.push((None, k, state));
                }
            }
            (cycles, FileStore::slot(slot.clone()).others()?)
        }
    };
    let held = holders(cycles.iter().map(|(h, k, s)| (h.as_deref(), *k, s)));
    let guard = SweepGuard {
        now,
        min_age: sweep_min_age(
            a.grace.registration_grace,
            a.grace.launch_timeout,
            intent_settle_of(a.target.http_timeout),
        ),
        held: others.names,
    };
    let rows = registrations(
        &listing,
        prefix,
        a.target.sweep_max_deletions,
        &guard,
        &held,
    );
    Ok(vec![
        ("listed", json!(listing.distinct)),
        ("complete", json!(listing.complete)),
        ("registrations", json!(rows)),
        (
            "sweep_refused",
            json!(sweep_refusal(&slot.dir().join(STATE_FILE))),
        ),
    ])
}

/// The managed resources in this slot's tofu state, or with `--store pg` in the workspace of
/// each of the pool's cycles; `skipped` without --tofu-dir, `error` when tofu cannot run or
/// read it.
fn tofu_state(a: &RemoteArgs, slot: &SlotDir, pool: Option<String>) -> Value {
    let Some(dir) = a.module.tofu_dir.as_deref() else {
        return json!({"skipped": "no --tofu-dir: the module directory holds the state (or names its backend)"});
    };
    let shown = dir.display().to_string();
    let tofu = status_tofu(&a.module.tofu_bin, dir, slot, pool);
    if let Err(e) = tofu.check_config() {
        return json!({"tofu_dir": shown, "error": format!("{e:#}")});
    }
    let read = tofu
        .show_states()
        .map_err(|e| e.message)
        .and_then(|states| {
            let mut all = Vec::new();
            for (workspace, out) in states {
                let show = serde_json::from_slice::<Value>(&out)
                    .map_err(|e| format!("`tofu show -json` did not print JSON ({e})"))?;
                all.extend(state_resources(&show).into_iter().map(|mut r| {
                    r.workspace = workspace.clone();
                    r
                }));
            }
            Ok(all)
        });
    match read {
        Ok(resources) => json!({"tofu_dir": shown, "resources": resources}),
        Err(e) => json!({"tofu_dir": shown, "error": e}),
    }
}

/// The tofu of `status --remote`: the slot's (or with `--store pg` the pool's workspaces), each
/// command bounded by [`TOFU_STATUS_TIMEOUT`].
fn status_tofu(bin: &Path, dir: &Path, slot: &SlotDir, pool: Option<String>) -> CliTofu {
    let mut tofu = slot_tofu(bin, Some(dir), slot, pool, StopFlag::default());
    tofu.timeout = Some(TOFU_STATUS_TIMEOUT);
    tofu
}

/// Refuses a module directory another user owns (as a run refuses such a state directory):
/// tofu would write there as this user (root-owned files fail the pool's later runs) and run
/// the module's provider plugins as it. One that cannot be inspected is left to tofu's check.
fn check_module_owner(dir: &Path) -> Result<(), Fatal> {
    let Ok(meta) = std::fs::metadata(dir) else {
        return Ok(());
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() == me {
        return Ok(());
    }
    Err(usage(format!(
        "--tofu-dir {} is owned by uid {}, not by this user (uid {me}): tofu would write files there as this user and run the module's providers as it; run status --remote as the directory's owner (under the role: as the pool's user, `as_pool` in docs/troubleshooting.md)",
        dir.display(),
        meta.uid()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Mutation caught: status --remote's tofu built without its bound (a hung backend hangs
    // `status`).
    #[test]
    fn status_runs_tofu_with_a_bound() {
        let slot = SlotDir {
            pool: "/var/lib/ci-ephemeral-provisioner/pool".into(),
            k: 1,
            n: 1,
        };
        let tofu = status_tofu(Path::new("tofu"), Path::new("/module"), &slot, None);
        assert_eq!(tofu.timeout, Some(TOFU_STATUS_TIMEOUT));
    }
}
