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
/// Reads of the whole list, at most, when pages overlapped while the count stayed the same.
pub const LIST_PASSES: u32 = 3;

/// Every row of every page, de-duplicated by id. Rows whose id appears twice with different
/// contents are returned in the second list: they are doubtful and never deleted.
pub struct Listing {
    pub rows: Vec<Runner>,
    pub conflicting: Vec<i64>,
    pub pages: u32,
    /// False when the listing ended short of `X-Total-Count` (rows moved between pages while we
    /// read them): absence from it proves nothing.
    pub complete: bool,
    pub total: Option<u64>,
}

/// Lists all pages (`page=1..`, `limit=50`). Stops on an empty page, once `X-Total-Count` rows
/// are collected, or on a short page when no count is given; when the pages overlapped while the
/// count held, reads them again (`LIST_PASSES` reads in all). Any failed page is an error.
pub fn list_all(forgejo: &mut dyn Forgejo) -> Result<Listing, String> {
    let mut by_id: BTreeMap<i64, Runner> = BTreeMap::new();
    let mut conflicting: Vec<i64> = Vec::new();
    let mut page = 0u32;
    let mut last_total = None;
    let mut totals: Vec<u64> = Vec::new();
    // Rows received, repeats included.
    let mut returned: u64 = 0;
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
        returned += n as u64;
        last_total = p.total.or(last_total);
        if let Some(t) = p.total
            && !totals.contains(&t)
        {
            totals.push(t);
        }
        merge(&mut by_id, &mut conflicting, p.rows);
        let done = match p.total {
            _ if n == 0 => true,
            Some(total) => by_id.len() as u64 >= total,
            None => n < PAGE_LIMIT as usize,
        };
        if done {
            break;
        }
    }
    // Rows that tie on Forgejo's sort key (`last_online`: 0 for every registration that never
    // connected) come in no stable order, so pages can overlap and skip rows while nothing
    // changes. When every page agreed on the count and as many rows came back as it promised,
    // but some twice, read the pages again: a skipped row shows up.
    let pages = page;
    let mut passes = 1;
    while let [t] = totals.as_slice()
        && (by_id.len() as u64) < *t
        && returned >= *t
        && passes < LIST_PASSES
    {
        let t = *t;
        passes += 1;
        for again in 1..pages {
            let p = forgejo
                .list_runners_page(again, PAGE_LIMIT)
                .map_err(|e| format!("listing runners failed on page {again}: {e}"))?;
            if p.total.is_some_and(|pt| pt != t) {
                totals.push(p.total.unwrap_or(t));
                break;
            }
            merge(&mut by_id, &mut conflicting, p.rows);
            if by_id.len() as u64 >= t {
                break;
            }
        }
    }
    // Complete only when every page agreed on the count and we saw that many distinct rows: a
    // count that changed while we paged means rows moved between pages.
    let complete = match totals.as_slice() {
        [] => true,
        [t] => by_id.len() as u64 >= *t,
        _ => false,
    };
    Ok(Listing {
        rows: by_id.into_values().collect(),
        conflicting,
        pages,
        complete,
        total: last_total,
    })
}

/// Adds one page's rows; an id seen before with different contents is conflicting.
fn merge(by_id: &mut BTreeMap<i64, Runner>, conflicting: &mut Vec<i64>, rows: Vec<Runner>) {
    for r in rows {
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
    report.listing_complete = listing.complete;
    if !listing.complete {
        log::warn!(
            "sweep: the runner list ended with {} distinct rows of the {} Forgejo counted (rows moved while paging); what was missed is left for the next sweep",
            listing.rows.len(),
            listing.total.unwrap_or(0)
        );
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forgejo::{ApiError, NewRunner, RunnerPage};
    use crate::model::Job;

    type ScriptedPage = Result<(Vec<Runner>, Option<u64>), String>;

    /// Serves scripted list pages and records deletions.
    struct Scripted {
        pages: Vec<ScriptedPage>,
        asked: Vec<u32>,
        deleted: Vec<i64>,
        fail_delete: Vec<i64>,
        /// Answer every page with the first one (a server that ignores `page`).
        loop_first: bool,
    }

    impl Scripted {
        fn new(pages: Vec<ScriptedPage>) -> Scripted {
            Scripted {
                pages,
                asked: vec![],
                deleted: vec![],
                fail_delete: vec![],
                loop_first: false,
            }
        }
    }

    fn err(detail: &str) -> ApiError {
        ApiError {
            status: None,
            request: "scripted".into(),
            detail: detail.into(),
        }
    }

    impl Forgejo for Scripted {
        fn list_jobs(&mut self) -> Result<Vec<Job>, ApiError> {
            Err(err("not used"))
        }
        fn get_runner(&mut self, _id: i64) -> Result<Option<Runner>, ApiError> {
            Err(err("not used"))
        }
        fn delete_runner(&mut self, id: i64, _reason: &str) -> Result<Deleted, ApiError> {
            if self.fail_delete.contains(&id) {
                return Err(err("HTTP 500"));
            }
            self.deleted.push(id);
            Ok(Deleted::Now)
        }
        fn register_runner(&mut self, _name: &str) -> Result<NewRunner, ApiError> {
            Err(err("not used"))
        }
        fn list_runners_page(&mut self, page: u32, limit: u32) -> Result<RunnerPage, ApiError> {
            assert_eq!(limit, PAGE_LIMIT);
            self.asked.push(page);
            let idx = if self.loop_first {
                0
            } else {
                page as usize - 1
            };
            match self.pages.get(idx) {
                None => Ok(RunnerPage {
                    rows: vec![],
                    total: None,
                }),
                Some(Ok((rows, total))) => Ok(RunnerPage {
                    rows: rows.clone(),
                    total: *total,
                }),
                Some(Err(e)) => Err(err(e)),
            }
        }
    }

    fn r(id: i64, name: &str, status: RunnerStatus) -> Runner {
        Runner {
            id,
            name: Some(name.into()),
            status,
        }
    }

    fn page(start: i64, n: usize, name: &str) -> Vec<Runner> {
        (0..n as i64)
            .map(|i| {
                r(
                    start + i,
                    &format!("{name}-{}", start + i),
                    RunnerStatus::Offline,
                )
            })
            .collect()
    }

    #[test]
    fn all_pages_are_listed_before_any_delete() {
        let mut f = Scripted::new(vec![
            Ok((page(1, 50, "static"), Some(120))),
            Ok((page(51, 50, "ephemeral"), Some(120))),
            Ok((page(101, 20, "ephemeral"), Some(120))),
        ]);
        let rep = sweep(&mut f, "ephemeral-", 1000);
        assert_eq!(f.asked, vec![1, 2, 3]);
        assert_eq!(rep.pages, 3);
        assert_eq!(rep.listed, 120);
        assert_eq!(f.deleted, (51..=120).collect::<Vec<_>>());
        assert_eq!(rep.deleted.len(), 70);
    }

    #[test]
    fn a_failed_page_deletes_nothing() {
        let mut f = Scripted::new(vec![
            Ok((page(1, 50, "ephemeral"), Some(120))),
            Err("HTTP 500".into()),
            Ok((page(101, 20, "ephemeral"), Some(120))),
        ]);
        let rep = sweep(&mut f, "ephemeral-", 1000);
        assert!(f.deleted.is_empty());
        assert!(rep.error.as_deref().unwrap().contains("page 2"));
        assert_eq!(sweep_failures(&rep).len(), 1);
    }

    #[test]
    fn a_server_that_never_ends_deletes_nothing() {
        let mut f = Scripted::new(vec![Ok((page(1, 50, "ephemeral"), None))]);
        f.loop_first = true;
        // Every page repeats the same full page without a total: bounded, then refused.
        let rep = sweep(&mut f, "ephemeral-", 1000);
        assert!(f.deleted.is_empty());
        assert_eq!(f.asked.len(), MAX_PAGES as usize);
        assert!(rep.error.is_some());
    }

    #[test]
    fn short_page_without_total_ends_the_listing() {
        let mut f = Scripted::new(vec![Ok((page(1, 7, "ephemeral"), None))]);
        let rep = sweep(&mut f, "ephemeral-", 1000);
        assert_eq!(f.asked, vec![1]);
        assert_eq!(rep.deleted.len(), 7);
    }

    #[test]
    fn a_lower_server_limit_is_followed_by_the_total() {
        // The server clamps to 30 rows per page; X-Total-Count says 70.
        let mut f = Scripted::new(vec![
            Ok((page(1, 30, "ephemeral"), Some(70))),
            Ok((page(31, 30, "ephemeral"), Some(70))),
            Ok((page(61, 10, "ephemeral"), Some(70))),
        ]);
        let rep = sweep(&mut f, "ephemeral-", 1000);
        assert_eq!(f.asked, vec![1, 2, 3]);
        assert_eq!(rep.deleted.len(), 70);
    }

    #[test]
    fn a_total_that_lies_high_stops_on_an_empty_page() {
        let mut f = Scripted::new(vec![Ok((page(1, 5, "ephemeral"), Some(5000)))]);
        let rep = sweep(&mut f, "ephemeral-", 1000);
        assert_eq!(f.asked, vec![1, 2]);
        assert_eq!(rep.deleted.len(), 5);
    }

    #[test]
    fn conflicting_duplicates_are_doubtful_and_kept() {
        let mut f = Scripted::new(vec![
            Ok((
                vec![
                    r(1, "ephemeral-a", RunnerStatus::Offline),
                    r(2, "ephemeral-b", RunnerStatus::Offline),
                ],
                Some(3),
            )),
            Ok((
                vec![
                    r(1, "ephemeral-a", RunnerStatus::Idle),
                    r(2, "ephemeral-b", RunnerStatus::Offline),
                    r(3, "ephemeral-c", RunnerStatus::Offline),
                ],
                Some(3),
            )),
        ]);
        // Page 1 is short, but the total says there is more.
        let rep = sweep(&mut f, "ephemeral-", 1000);
        assert_eq!(f.deleted, vec![2, 3], "1 was offline, then idle: doubtful");
        assert_eq!(rep.skipped_doubtful.len(), 1);
        assert_eq!(rep.skipped_doubtful[0].runner_id, 1);
    }

    #[test]
    fn only_offline_rows_with_the_prefix_are_deleted_and_the_cap_holds() {
        let rows = vec![
            r(514, "ephemeral-1", RunnerStatus::Offline),
            r(516, "ephemeral-2", RunnerStatus::Offline),
            r(518, "ephemeral-3", RunnerStatus::Offline),
            r(600, "ephemeral-live", RunnerStatus::Idle),
            r(601, "ephemeral-busy", RunnerStatus::Active),
            r(602, "static-builder", RunnerStatus::Offline),
            r(603, "my-ephemeral-1", RunnerStatus::Offline),
            r(
                604,
                "ephemeral-odd",
                RunnerStatus::Unknown("Offline".into()),
            ),
            r(605, "ephemeral-nostatus", RunnerStatus::Missing),
            Runner {
                id: 606,
                name: None,
                status: RunnerStatus::Offline,
            },
        ];
        let listing = Listing {
            rows,
            conflicting: vec![],
            pages: 1,
            complete: true,
            total: None,
        };
        let sel = select(&listing, "ephemeral-", 2);
        assert_eq!(
            sel.delete.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![514, 516]
        );
        assert_eq!(sel.found, 3);
        assert_eq!(sel.left_over_cap, 1);
        assert_eq!(
            sel.doubtful.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![604, 605]
        );
        assert!(
            select(&listing, "", 100).delete.is_empty(),
            "an empty prefix owns nothing"
        );
    }

    #[test]
    fn a_count_that_changes_while_paging_makes_the_listing_incomplete() {
        // Someone deleted a runner while we paged: the total dropped from 51 to 50 and the row
        // that was 51st slid onto page 1, which we had already read.
        let mut f = Scripted::new(vec![
            Ok((page(1, 50, "ephemeral"), Some(51))),
            Ok((vec![], Some(50))),
        ]);
        let l = list_all(&mut f).unwrap();
        assert_eq!(l.rows.len(), 50);
        assert!(!l.complete);
        let mut f = Scripted::new(vec![
            Ok((page(1, 50, "ephemeral"), Some(60))),
            Ok((page(51, 10, "ephemeral"), Some(60))),
        ]);
        assert!(list_all(&mut f).unwrap().complete);
    }

    #[test]
    fn a_failed_delete_is_reported_and_the_rest_go_on() {
        let mut f = Scripted::new(vec![Ok((page(1, 3, "ephemeral"), Some(3)))]);
        f.fail_delete = vec![2];
        let rep = sweep(&mut f, "ephemeral-", 10);
        assert_eq!(f.deleted, vec![1, 3]);
        assert_eq!(rep.failed.len(), 1);
        assert_eq!(
            sweep_failures(&rep).len(),
            1,
            "a failed delete fails the run"
        );
    }

    /// Answers list requests in order, whatever page is asked for.
    struct InOrder {
        answers: Vec<(Vec<Runner>, Option<u64>)>,
        asked: Vec<u32>,
    }

    impl Forgejo for InOrder {
        fn list_jobs(&mut self) -> Result<Vec<Job>, ApiError> {
            Err(err("not used"))
        }
        fn get_runner(&mut self, _id: i64) -> Result<Option<Runner>, ApiError> {
            Err(err("not used"))
        }
        fn delete_runner(&mut self, _id: i64, _reason: &str) -> Result<Deleted, ApiError> {
            Err(err("not used"))
        }
        fn register_runner(&mut self, _name: &str) -> Result<NewRunner, ApiError> {
            Err(err("not used"))
        }
        fn list_runners_page(&mut self, page: u32, _limit: u32) -> Result<RunnerPage, ApiError> {
            self.asked.push(page);
            let (rows, total) = match self.answers.get(self.asked.len() - 1) {
                Some(a) => a.clone(),
                None => (vec![], None),
            };
            Ok(RunnerPage { rows, total })
        }
    }

    #[test]
    fn pages_that_overlapped_while_the_count_held_are_read_again() {
        // 60 rows that tie on the sort key: page 2 repeats ten rows of page 1 and ten are
        // never shown; the second read of page 1 shows them.
        let mut f = InOrder {
            answers: vec![
                (page(1, 50, "ephemeral"), Some(60)),
                (page(41, 10, "ephemeral"), Some(60)),
                (vec![], Some(60)),
                (page(11, 50, "ephemeral"), Some(60)),
            ],
            asked: vec![],
        };
        let l = list_all(&mut f).unwrap();
        assert_eq!(f.asked, vec![1, 2, 3, 1]);
        assert!(l.complete);
        assert_eq!(l.rows.len(), 60);
        // A count that changes on the second read ends it: incomplete.
        let mut f = InOrder {
            answers: vec![
                (page(1, 50, "ephemeral"), Some(60)),
                (page(41, 10, "ephemeral"), Some(60)),
                (vec![], Some(60)),
                (page(11, 50, "ephemeral"), Some(61)),
            ],
            asked: vec![],
        };
        assert!(!list_all(&mut f).unwrap().complete);
    }
}
