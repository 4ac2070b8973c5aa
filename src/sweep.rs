//! The sweep: list every page first, then delete the offline registrations with our prefix.
//! Any doubt deletes nothing.

use std::collections::BTreeMap;

use crate::forgejo::{Deleted, Forgejo};
use crate::model::{Runner, RunnerStatus, may_delete};
use crate::planner::DeleteReason;
use crate::report::{SweepReport, SweptRunner};

/// Forgejo clamps `limit` to `[api].MAX_RESPONSE_ITEMS` (default 50).
pub const PAGE_LIMIT: u32 = 50;
/// More pages than this (50,000 registrations) is treated as a misbehaving server.
pub const MAX_PAGES: u32 = 1000;

/// Every row of every page, de-duplicated by id. Rows whose id appears twice with different
/// contents are returned in the second list: they are doubtful and never deleted.
pub struct Listing {
    pub rows: Vec<Runner>,
    pub conflicting: Vec<i64>,
    pub pages: u32,
}

/// Lists all pages (`page=1..`, `limit=50`). Stops on an empty page, once `X-Total-Count` rows
/// are collected, or on a short page when no count is given. Any failed page is an error.
pub fn list_all(forgejo: &mut dyn Forgejo) -> Result<Listing, String> {
    let mut by_id: BTreeMap<i64, Runner> = BTreeMap::new();
    let mut conflicting: Vec<i64> = Vec::new();
    let mut page = 0u32;
    loop {
        page += 1;
        if page > MAX_PAGES {
            return Err(format!(
                "the runner list did not end within {MAX_PAGES} pages of {PAGE_LIMIT}; deleting nothing"
            ));
        }
        let p = forgejo
            .list_runners_page(page, PAGE_LIMIT)
            .map_err(|e| format!("listing runners failed on page {page}: {e}"))?;
        let n = p.rows.len();
        for r in p.rows {
            match by_id.get(&r.id) {
                Some(seen) if *seen != r => {
                    if !conflicting.contains(&r.id) {
                        conflicting.push(r.id);
                    }
                }
                Some(_) => {}
                None => {
                    by_id.insert(r.id, r);
                }
            }
        }
        let done = match p.total {
            _ if n == 0 => true,
            Some(total) => by_id.len() as u64 >= total,
            None => n < PAGE_LIMIT as usize,
        };
        if done {
            break;
        }
    }
    Ok(Listing {
        rows: by_id.into_values().collect(),
        conflicting,
        pages: page,
    })
}

pub struct Selection {
    /// At most `cap`, lowest id first.
    pub delete: Vec<Runner>,
    pub found: usize,
    pub doubtful: Vec<Runner>,
    pub left_over_cap: usize,
}

/// Pure: which listed rows the sweep deletes.
pub fn select(listing: &Listing, prefix: &str, cap: usize) -> Selection {
    let mut deletable: Vec<Runner> = Vec::new();
    let mut doubtful: Vec<Runner> = Vec::new();
    for r in &listing.rows {
        let ours = !prefix.is_empty() && r.name.as_deref().is_some_and(|n| n.starts_with(prefix));
        if listing.conflicting.contains(&r.id) {
            if ours {
                doubtful.push(r.clone());
            }
            continue;
        }
        if may_delete(r.name.as_deref(), &r.status, prefix) {
            deletable.push(r.clone());
        } else if ours && matches!(r.status, RunnerStatus::Unknown(_) | RunnerStatus::Missing) {
            doubtful.push(r.clone());
        }
    }
    let found = deletable.len();
    let left_over_cap = found.saturating_sub(cap);
    deletable.truncate(cap);
    Selection {
        delete: deletable,
        found,
        doubtful,
        left_over_cap,
    }
}

fn swept(r: &Runner) -> SweptRunner {
    SweptRunner {
        runner_id: r.id,
        name: r.name.clone(),
        status: r.status.as_str().to_string(),
    }
}

/// Runs the sweep. Failures are in the report (`error`, `failed`); the caller decides what they
/// mean for the exit status.
pub fn sweep(forgejo: &mut dyn Forgejo, prefix: &str, cap: usize) -> SweepReport {
    let mut report = SweepReport::default();
    let listing = match list_all(forgejo) {
        Ok(l) => l,
        Err(e) => {
            report.error = Some(e);
            return report;
        }
    };
    report.pages = listing.pages;
    report.listed = listing.rows.len();
    let sel = select(&listing, prefix, cap);
    report.found = sel.found;
    report.left_over_cap = sel.left_over_cap;
    report.skipped_doubtful = sel.doubtful.iter().map(swept).collect();
    for r in &report.skipped_doubtful {
        log::warn!(
            "sweep: not deleting runner {} ({}): status {} is not exactly \"offline\"",
            r.runner_id,
            r.name.as_deref().unwrap_or("?"),
            r.status
        );
    }
    for r in &sel.delete {
        match forgejo.delete_runner(r.id, DeleteReason::Sweep.as_str()) {
            Ok(Deleted::Now) => {
                log::info!(
                    "sweep: deleted offline runner {} ({})",
                    r.id,
                    r.name.as_deref().unwrap_or("?")
                );
                report.deleted.push(swept(r));
            }
            Ok(Deleted::AlreadyGone) => report.already_gone.push(r.id),
            Err(e) => {
                log::error!("sweep: {e}");
                report.failed.push(swept(r));
            }
        }
    }
    if report.left_over_cap > 0 {
        log::warn!(
            "sweep: {} more offline registrations left for the next sweep (--sweep-max-deletions)",
            report.left_over_cap
        );
    }
    report
}

/// Whether a sweep report is a failure of the run.
pub fn sweep_failures(report: &SweepReport) -> Vec<String> {
    let mut f = Vec::new();
    if let Some(e) = &report.error {
        f.push(format!("sweep: {e}"));
    }
    if !report.failed.is_empty() {
        f.push(format!(
            "sweep: deleting {} registration(s) failed: {:?}",
            report.failed.len(),
            report
                .failed
                .iter()
                .map(|r| r.runner_id)
                .collect::<Vec<_>>()
        ));
    }
    f
}
