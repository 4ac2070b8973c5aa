//! The sweep's listing and selection: every page gathered (with Forgejo's paging quirks), then
//! which rows the gate lets go. Pure: the paging itself is `driver::sweep`.

use std::collections::{BTreeMap, HashSet};

use crate::core::forgejo::{Runner, RunnerStatus};
use crate::core::report::SweepReport;
use crate::core::sweep::gate::{Deletable, is_ours, may_delete};
use crate::core::sweep::spare::{Spared, SweepGuard};

/// Forgejo clamps `limit` to `[api].MAX_RESPONSE_ITEMS` (default 50).
pub const PAGE_LIMIT: u32 = 50;

/// More pages than this (500,000 registrations) is treated as a misbehaving server. A server
/// that ignores `page` is caught long before: its second page brings no new id.
pub const MAX_PAGES: u32 = 10_000;

/// Reads of the whole list, at most, when pages overlapped while the count stayed the same.
pub const LIST_PASSES: u32 = 3;

/// The rows of every page that the caller kept, de-duplicated by id. Rows whose id appears twice
/// with different contents are returned in the second list: they are doubtful and never deleted.
pub struct Listing {
    /// The kept rows, in id order.
    pub rows: Vec<Runner>,
    pub conflicting: Vec<i64>,
    pub pages: u32,
    /// False when the listing ended short of `X-Total-Count` (rows moved between pages while we
    /// read them): absence from it proves nothing.
    pub complete: bool,
    pub total: Option<u64>,
    /// Distinct ids listed, kept or not.
    pub distinct: usize,
}

/// What the pages showed so far: the kept rows whole, of the others only their ids.
pub struct Seen<'a> {
    keep: &'a dyn Fn(&Runner) -> bool,
    by_id: BTreeMap<i64, Runner>,
    others: HashSet<i64>,
    conflicting: Vec<i64>,
}

impl<'a> Seen<'a> {
    /// Nothing seen yet; `keep` says which rows are kept whole.
    pub fn new(keep: &'a dyn Fn(&Runner) -> bool) -> Seen<'a> {
        Seen {
            keep,
            by_id: BTreeMap::new(),
            others: HashSet::new(),
            conflicting: Vec::new(),
        }
    }

    /// Distinct ids listed, kept or not.
    pub fn distinct(&self) -> usize {
        self.by_id.len() + self.others.len()
    }

    /// Adds one page's rows; an id seen before with different contents is conflicting.
    pub fn merge(&mut self, rows: Vec<Runner>) {
        for r in rows {
            let conflict = if (self.keep)(&r) {
                match self.by_id.get(&r.id) {
                    Some(seen) => *seen != r,
                    None if self.others.contains(&r.id) => true,
                    None => {
                        self.by_id.insert(r.id, r);
                        continue;
                    }
                }
            } else if self.by_id.contains_key(&r.id) {
                // Kept on an earlier page, not now: its contents differ.
                true
            } else {
                self.others.insert(r.id);
                false
            };
            if conflict && !self.conflicting.contains(&r.id) {
                self.conflicting.push(r.id);
            }
        }
    }

    /// The listing, once every page is in: `complete` as the pages' counts said.
    pub fn into_listing(self, pages: u32, complete: bool, total: Option<u64>) -> Listing {
        Listing {
            distinct: self.distinct(),
            rows: self.by_id.into_values().collect(),
            conflicting: self.conflicting,
            pages,
            complete,
            total,
        }
    }
}

pub struct Selection {
    /// At most `cap`, lowest id first: each passed the gate, with its row for the report.
    pub delete: Vec<(Deletable, Runner)>,
    pub found: usize,
    pub doubtful: Vec<Runner>,
    /// Passed the gate, yet spared by `guard`: too young by its name, or another slot's.
    pub spared: Vec<(Runner, Spared)>,
    pub left_over_cap: usize,
}

/// Pure: which listed rows the sweep deletes. `guard` spares the registrations too young to judge
/// and those the pool's other slots hold, before the cap is applied.
pub fn select(listing: &Listing, prefix: &str, cap: usize, guard: &SweepGuard) -> Selection {
    let mut deletable: Vec<(Deletable, Runner)> = Vec::new();
    let mut doubtful: Vec<Runner> = Vec::new();
    let mut spared: Vec<(Runner, Spared)> = Vec::new();
    for r in &listing.rows {
        let ours = is_ours(r.name.as_deref(), prefix);
        if listing.conflicting.contains(&r.id) {
            if ours {
                doubtful.push(r.clone());
            }
            continue;
        }
        if let Some(target) = may_delete(r, prefix) {
            match r.name.as_deref().and_then(|n| guard.spares(n)) {
                Some(why) => spared.push((r.clone(), why)),
                None => deletable.push((target, r.clone())),
            }
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
        spared,
        left_over_cap,
    }
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
