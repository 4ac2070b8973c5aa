//! The sweep: list every page first, then delete the offline registrations with our prefix.
//! Any doubt deletes nothing.

use anyhow::{anyhow, bail};

use crate::core::claims::Others;
use crate::core::forgejo::Runner;
use crate::core::ports::{Deleted, Forgejo};
use crate::core::report::{Report, SweepReport, SweptRunner};
use crate::core::sweep::gate::DeleteReason;
use crate::core::sweep::gate::{Deletable, is_ours};
use crate::core::sweep::licence::SweepLicence;
use crate::core::sweep::listing::{
    LIST_PASSES, Listing, MAX_PAGES, PAGE_LIMIT, Seen, Selection, select, sweep_failures,
};
use crate::core::sweep::spare::{Spared, SweepGuard};

pub fn list_all(
    forgejo: &mut dyn Forgejo,
    keep: &dyn Fn(&Runner) -> bool,
) -> anyhow::Result<Listing> {
    let mut seen = Seen::new(keep);
    let mut page = 0u32;
    let mut last_total = None;
    let mut totals: Vec<u64> = Vec::new();
    // Rows received, repeats included.
    let mut returned: u64 = 0;
    loop {
        page += 1;
        if page > MAX_PAGES {
            bail!(
                "the runner list did not end within {MAX_PAGES} pages of {PAGE_LIMIT}; deleting nothing"
            );
        }
        let p = forgejo
            .list_runners_page(page, PAGE_LIMIT)
            .map_err(|e| anyhow!("listing runners failed on page {page}: {e}"))?;
        let n = p.rows.len();
        let distinct_before = seen.distinct();
        returned += n as u64;
        last_total = p.total.or(last_total);
        if let Some(t) = p.total
            && !totals.contains(&t)
        {
            totals.push(t);
        }
        seen.merge(p.rows);
        let distinct = seen.distinct();
        let done = match p.total {
            _ if n == 0 => true,
            Some(total) => distinct as u64 >= total,
            None => n < PAGE_LIMIT as usize,
        };
        if done {
            break;
        }
        if distinct == distinct_before {
            if n < PAGE_LIMIT as usize {
                // A short page of repeats: the end of the list (the count was not reached; the
                // re-reads below may find what the overlap hid).
                break;
            }
            // More to come, yet this full page held only ids already listed: the server ignores
            // `page` (or every row moved back a page while we read). Going on would repeat it.
            bail!(
                "page {page} of the runner list held only runners already listed (does the server honour `page`?); deleting nothing"
            );
        }
    }
    // Rows that tie on Forgejo's sort key (`last_online`: 0 for every registration that never
    // connected) come in no stable order, so pages can overlap and skip rows while nothing
    // changes. When every page agreed on the count and as many rows came back as it promised,
    // but some twice, read the pages again: a skipped row shows up.
    let pages = page;
    read_again(forgejo, pages, returned, &mut totals, &mut seen)?;
    // Complete only when every page agreed on the count and we saw exactly that many distinct
    // rows: a count that changed while we paged means rows moved between pages, and more rows
    // than counted means the count is wrong (it may have ended the listing early).
    let distinct = seen.distinct();
    let complete = match totals.as_slice() {
        [] => true,
        [t] => distinct as u64 == *t,
        _ => false,
    };
    Ok(seen.into_listing(pages, complete, last_total))
}

/// The re-reads of pages `1..pages` (at most `LIST_PASSES` reads in all) while every page agreed
/// on the count `t`, `returned` rows came back, but fewer than `t` distinct: rows that tie on
/// the sort key hid some. A count that changes ends them (it is pushed to `totals`).
fn read_again(
    forgejo: &mut dyn Forgejo,
    pages: u32,
    returned: u64,
    totals: &mut Vec<u64>,
    seen: &mut Seen<'_>,
) -> anyhow::Result<()> {
    let mut passes = 1;
    while let [t] = totals.as_slice()
        && (seen.distinct() as u64) < *t
        && returned >= *t
        && passes < LIST_PASSES
    {
        let t = *t;
        passes += 1;
        for again in 1..pages {
            let p = forgejo
                .list_runners_page(again, PAGE_LIMIT)
                .map_err(|e| anyhow!("listing runners failed on page {again}: {e}"))?;
            if p.total.is_some_and(|pt| pt != t) {
                totals.push(p.total.unwrap_or(t));
                break;
            }
            seen.merge(p.rows);
            if seen.distinct() as u64 >= t {
                break;
            }
        }
    }
    Ok(())
}

fn swept(r: &Runner) -> SweptRunner {
    SweptRunner {
        runner_id: r.id,
        name: r.name.clone(),
        status: r.status.as_str().to_string(),
    }
}

/// What the sweep spares although it passed the gate: registrations whose name shows they are
/// younger than `min_age` at `now`, and those the pool's other slots hold (`others`, read once
/// the listing is complete, so that a registration created meanwhile is in it).
pub struct Spare<'a> {
    pub now: crate::core::time::Timestamp,
    pub min_age: std::time::Duration,
    pub others: &'a mut dyn FnMut() -> anyhow::Result<Others>,
}

/// What one DELETE of the sweep did: gone (204 or 404), or the error.
pub type DeleteResult = Result<Deleted, String>;

/// Runs the licensed sweep into `report`: each DELETE in its audit trail (its intent just before
/// it is sent, its answer as soon as Forgejo gave it), each failure a failure of the run, the
/// counts in `report.sweep`. True when nothing failed. No sweep runs without its licence: the
/// proof that no VM of ours can exist (`core::sweep::licence`).
pub fn sweep_into(
    report: &mut Report,
    forgejo: &mut dyn Forgejo,
    licence: &SweepLicence,
    prefix: &str,
    cap: usize,
    spare: Spare<'_>,
) -> bool {
    let sw = sweep_with(forgejo, licence, prefix, cap, spare, &mut |r, result| {
        report.sweep_deletion(r, result, licence)
    });
    let failures = sweep_failures(&sw);
    let ok = failures.is_empty();
    for f in failures {
        report.fail(f);
    }
    report.sweep = Some(sw);
    ok
}

/// The sweep, telling `on_delete` about each DELETE just before it is sent (`None`) and as soon
/// as Forgejo answered. Failures are in the result (`error`, `failed`).
fn sweep_with(
    forgejo: &mut dyn Forgejo,
    licence: &SweepLicence,
    prefix: &str,
    cap: usize,
    spare: Spare<'_>,
    on_delete: &mut dyn FnMut(&SweptRunner, Option<DeleteResult>),
) -> SweepReport {
    log::debug!("sweep licensed: {}", licence.evidence());
    let mut report = SweepReport::default();
    let ours = |r: &Runner| is_ours(r.name.as_deref(), prefix);
    let listing = match list_all(forgejo, &ours) {
        Ok(l) => l,
        Err(e) => {
            report.error = Some(format!("{e:#}"));
            return report;
        }
    };
    report.pages = listing.pages;
    report.listed = listing.distinct;
    report.listing_complete = listing.complete;
    if !listing.complete {
        log::warn!(
            "sweep: the runner list ended with {} distinct rows of the {} Forgejo counted (rows moved while paging); what was missed is left for the next sweep",
            listing.distinct,
            listing.total.unwrap_or(0)
        );
    }
    crate::crash_point!("sweep-listed");
    let guard = match (spare.others)() {
        Ok(others) => SweepGuard {
            now: spare.now,
            min_age: spare.min_age,
            held: others.names,
        },
        Err(e) => {
            report.error = Some(format!(
                "{e:#}; deleting nothing while another slot's registrations are unknown"
            ));
            return report;
        }
    };
    let sel = select(&listing, prefix, cap, &guard);
    keep_spared(&mut report, &sel);
    for (target, r) in &sel.delete {
        delete_one(forgejo, target, r, &mut report, on_delete);
    }
    if report.left_over_cap > 0 {
        log::warn!(
            "sweep: {} more offline registrations left for the next sweep (--sweep-max-deletions)",
            report.left_over_cap
        );
    }
    report
}

/// What the gate let go but the sweep keeps, each in its list and the log, and the counts.
fn keep_spared(report: &mut SweepReport, sel: &Selection) {
    for (r, why) in &sel.spared {
        let name = r.name.as_deref().unwrap_or("?");
        let list = match why {
            Spared::TooYoung => {
                log::info!(
                    "sweep: not deleting offline runner {} ({name}): its name shows it is too young to judge",
                    r.id
                );
                &mut report.spared_young
            }
            Spared::HeldByAnotherSlot => {
                log::info!(
                    "sweep: not deleting offline runner {} ({name}): another slot of this pool holds it",
                    r.id
                );
                &mut report.spared_held
            }
            Spared::DoubtfulTime => {
                log::warn!(
                    "sweep: not deleting runner {} ({name}): the time in its name cannot be read or lies in the future; delete it by hand once you know it is dead",
                    r.id
                );
                &mut report.skipped_doubtful
            }
        };
        list.push(swept(r));
    }
    report.found = sel.found;
    report.left_over_cap = sel.left_over_cap;
    for r in sel.doubtful.iter().map(swept) {
        log::warn!(
            "sweep: not deleting runner {} ({}): status {} is not exactly \"offline\"",
            r.runner_id,
            r.name.as_deref().unwrap_or("?"),
            r.status
        );
        report.skipped_doubtful.push(r);
    }
}

/// One DELETE of the sweep, told to `on_delete` before and after, its answer in `report`.
fn delete_one(
    forgejo: &mut dyn Forgejo,
    target: &Deletable,
    r: &Runner,
    report: &mut SweepReport,
    on_delete: &mut dyn FnMut(&SweptRunner, Option<DeleteResult>),
) {
    on_delete(&swept(r), None);
    match forgejo.delete_runner(target, DeleteReason::Sweep.as_str()) {
        Ok(deleted @ (Deleted::Now | Deleted::Planned)) => {
            let (done, note) = if deleted == Deleted::Now {
                crate::crash_point!("sweep-deleted-one");
                ("deleted", "")
            } else {
                ("would delete", " (dry-run: nothing sent)")
            };
            log::info!(
                "sweep: {done} offline runner {} ({}){note}",
                r.id,
                r.name.as_deref().unwrap_or("?")
            );
            on_delete(&swept(r), Some(Ok(deleted)));
            report.deleted.push(swept(r));
        }
        Ok(Deleted::AlreadyGone) => {
            on_delete(&swept(r), Some(Ok(Deleted::AlreadyGone)));
            report.already_gone.push(r.id);
        }
        Err(e) => {
            log::error!("sweep: {e}");
            on_delete(&swept(r), Some(Err(e.to_string())));
            report.failed.push(swept(r));
        }
    }
}

#[cfg(test)]
mod tests {
    //! The sweep against the tests' model of Forgejo (what Forgejo does) and against a scripted
    //! adversary (what it does not).
    use super::*;
    use crate::core::forgejo::Job;
    use crate::core::forgejo::RunnerStatus;
    use crate::core::ports::ApiError;
    use crate::core::ports::NewRunner;
    use crate::core::ports::RunnerPage;
    use crate::test_forgejo::{ModelForgejo, add_runner};

    /// The sweep with no one told of its deletions, no name too young and no other slot.
    fn sweep(
        forgejo: &mut dyn Forgejo,
        licence: &SweepLicence,
        prefix: &str,
        cap: usize,
    ) -> SweepReport {
        let spare = Spare {
            now: crate::core::time::Timestamp(0),
            min_age: std::time::Duration::ZERO,
            others: &mut || Ok(Others::default()),
        };
        sweep_with(forgejo, licence, prefix, cap, spare, &mut |_, _| {})
    }

    // -- Forgejo, as the tests' model of it says -------------------------------------------------

    /// Forgejo (the model) with registrations that never connected (offline): each range of
    /// ids named `{name}-{id}`.
    fn forgejo_with(rows: &[(std::ops::RangeInclusive<i64>, &str)]) -> ModelForgejo {
        let f = ModelForgejo::new("");
        for (ids, name) in rows {
            for id in ids.clone() {
                add_runner(&mut f.server().forgejo, Some(id), &format!("{name}-{id}"));
            }
        }
        f
    }

    #[test]
    fn all_pages_are_listed_before_any_delete() {
        let f = forgejo_with(&[(1..=50, "static"), (51..=120, "ephemeral")]);
        let rep = sweep(&mut f.clone(), &licence(), "ephemeral-", 1000);
        let s = f.server();
        assert_eq!(s.asked, vec![1, 2, 3]);
        assert_eq!(rep.pages, 3);
        assert_eq!(rep.listed, 120);
        assert_eq!(s.deletes, (51..=120).collect::<Vec<_>>());
        assert_eq!(rep.deleted.len(), 70);
    }

    #[test]
    fn a_lower_server_limit_is_followed_by_the_total() {
        // The instance sets `[api] MAX_RESPONSE_ITEMS = 30`: 30 rows a page; the count says 70.
        let f = forgejo_with(&[(1..=70, "ephemeral")]);
        f.server().forgejo.max_response_items = 30;
        let rep = sweep(&mut f.clone(), &licence(), "ephemeral-", 1000);
        assert_eq!(f.server().asked, vec![1, 2, 3]);
        assert_eq!(rep.deleted.len(), 70);
    }

    #[test]
    fn only_offline_rows_with_the_prefix_are_deleted_and_the_cap_holds() {
        let f = ModelForgejo::new("");
        {
            let mut s = f.server();
            let now = s.now;
            for (id, name) in [
                (514, "ephemeral-1"),
                (516, "ephemeral-2"),
                (518, "ephemeral-3"),
                (600, "ephemeral-live"),
                (601, "ephemeral-busy"),
                (602, "static-builder"),
                (603, "my-ephemeral-1"),
            ] {
                add_runner(&mut s.forgejo, Some(id), name);
            }
            // 600 connected and polls (idle); 601 runs a task (active).
            for id in [600, 601] {
                let r = s.forgejo.live_mut(id).unwrap();
                r.declare(Some(vec!["debian".into()]), now);
            }
            let job = s
                .forgejo
                .add_job("h".into(), vec!["debian".into()], 1, 1, now);
            s.forgejo.start_task(job, 601, now);
        }
        let rep = sweep(&mut f.clone(), &licence(), "", 100);
        assert!(
            f.server().deletes.is_empty(),
            "an empty prefix owns nothing"
        );
        assert_eq!(rep.found, 0);
        let rep = sweep(&mut f.clone(), &licence(), "ephemeral-", 2);
        assert_eq!(f.server().deletes, vec![514, 516]);
        assert_eq!(rep.deleted.len(), 2);
        assert_eq!(rep.found, 3);
        assert_eq!(rep.left_over_cap, 1);
        assert!(rep.skipped_doubtful.is_empty());
    }

    #[test]
    fn a_count_that_changes_while_paging_makes_the_listing_incomplete() {
        // Someone deleted a runner while we paged: the total dropped from 51 to 50 and the row
        // that was 51st slid onto page 1, which we had already read.
        let f = forgejo_with(&[(1..=51, "ephemeral")]);
        f.server().tie = |_, id, _| id as u64;
        f.server().meanwhile = Some((2, |f, now| f.delete(1, now)));
        let l = list_all(&mut f.clone(), &|_| true).unwrap();
        assert_eq!(f.server().asked, vec![1, 2]);
        assert_eq!(l.rows.len(), 50);
        assert!(!l.complete);
        let f = forgejo_with(&[(1..=60, "ephemeral")]);
        assert!(list_all(&mut f.clone(), &|_| true).unwrap().complete);
    }

    #[test]
    fn only_our_rows_are_kept_but_every_row_is_counted() {
        // 120 registrations, 70 of them ours: the listing keeps the 70, counts all 120.
        let rows = [(1..=50, "static"), (51..=120, "ephemeral")];
        let ours = |r: &Runner| {
            r.name
                .as_deref()
                .is_some_and(|n| n.starts_with("ephemeral-"))
        };
        let l = list_all(&mut forgejo_with(&rows), &ours).unwrap();
        assert_eq!(l.rows.len(), 70, "memory holds the candidates only");
        assert_eq!(l.distinct, 120);
        assert!(l.complete);
        let f = forgejo_with(&rows);
        let rep = sweep(&mut f.clone(), &licence(), "ephemeral-", 1000);
        assert_eq!(rep.listed, 120);
        assert_eq!(f.server().asked, vec![1, 2, 3]);
        assert_eq!(f.server().deletes, (51..=120).collect::<Vec<_>>());
    }

    /// Rows that tie on `last_online` by id, starting from another id on each request: Forgejo
    /// sorts by `last_online DESC` alone (`models/actions/runner.go` `ToOrders`), so the
    /// database may break ties differently for each LIMIT/OFFSET. 1… on the first request,
    /// 51… on the second, 11… on the third.
    fn ties_from_another_row_each_time(request: u32, id: i64, _: u64) -> u64 {
        let first = match request {
            2 => 51,
            3 => 11,
            _ => 1,
        };
        (u64::from(id < first) << 32) | id as u64
    }

    #[test]
    fn pages_that_overlapped_while_the_count_held_are_read_again() {
        // 60 rows that tie on the sort key: page 2 repeats ten rows of page 1 and ten are
        // never shown; the second read of page 1 shows them.
        let f = forgejo_with(&[(1..=60, "ephemeral")]);
        f.server().tie = ties_from_another_row_each_time;
        let l = list_all(&mut f.clone(), &|_| true).unwrap();
        // Page 2 is short and brought nothing new: the end of this read; page 1 again.
        assert_eq!(f.server().asked, vec![1, 2, 1]);
        assert!(l.complete);
        assert_eq!(l.rows.len(), 60);
        // A count that changes on the second read (a registration meanwhile) ends it: incomplete.
        let f = forgejo_with(&[(1..=60, "ephemeral")]);
        f.server().tie = ties_from_another_row_each_time;
        f.server().meanwhile = Some((3, |f, _| {
            add_runner(f, None, "ephemeral-61");
        }));
        assert!(!list_all(&mut f.clone(), &|_| true).unwrap().complete);
        assert_eq!(f.server().asked, vec![1, 2, 1]);
    }

    // -- What Forgejo never sends -----------------------------------------------------------------

    #[test]
    fn rows_forgejo_never_sends_are_kept() {
        // A status in another casing, none at all, no name: kept (next to one that goes).
        let rows = vec![
            r(514, "ephemeral-1", RunnerStatus::Offline),
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
                labels: None,
            },
        ];
        let listing = Listing {
            rows,
            conflicting: vec![],
            pages: 1,
            complete: true,
            total: None,
            distinct: 4,
        };
        let sel = select(&listing, "ephemeral-", 2, &no_guard());
        assert_eq!(
            sel.delete.iter().map(|(d, _)| d.id()).collect::<Vec<_>>(),
            vec![514]
        );
        assert_eq!(sel.found, 1);
        assert_eq!(
            sel.doubtful.iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![604, 605]
        );
        assert!(
            select(&listing, "", 100, &no_guard()).delete.is_empty(),
            "an empty prefix owns nothing"
        );
    }

    fn licence() -> SweepLicence {
        crate::core::sweep::licence::without_cycle(None, "cycle.json", None).unwrap()
    }

    /// A guard that spares nothing: no other slot, and no name too young.
    fn no_guard() -> SweepGuard {
        SweepGuard {
            now: crate::core::time::Timestamp(0),
            min_age: std::time::Duration::ZERO,
            held: Default::default(),
        }
    }

    type ScriptedPage = Result<(Vec<Runner>, Option<u64>), String>;

    /// A scripted adversary of the paging and deletion code, not a model of Forgejo: it serves
    /// pages Forgejo does not (a server that ignores `page`, a list without end, pages without
    /// a total, totals that lie, a page short of the limit while the count says more rows
    /// follow, then rows that differ on the next page), fails pages and deletes on cue, and
    /// records the deletions. Tests of Forgejo's own behaviour run on the tests' model of it
    /// (`crate::test_forgejo`).
    struct Scripted {
        pages: Vec<ScriptedPage>,
        asked: Vec<u32>,
        deleted: Vec<i64>,
        fail_delete: Vec<i64>,
        /// Answer every page with the first one (a server that ignores `page`).
        loop_first: bool,
        /// Answer every page with 50 new rows and no total (a list that never ends).
        endless: bool,
    }

    impl Scripted {
        fn new(pages: Vec<ScriptedPage>) -> Scripted {
            Scripted {
                pages,
                asked: vec![],
                deleted: vec![],
                fail_delete: vec![],
                loop_first: false,
                endless: false,
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
        fn delete_runner(
            &mut self,
            target: &Deletable,
            _reason: &str,
        ) -> Result<Deleted, ApiError> {
            let id = target.id();
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
            if self.endless {
                return Ok(RunnerPage {
                    rows: self::page(i64::from(page) * 100, 50, "other"),
                    total: None,
                });
            }
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
            labels: None,
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
    fn a_failed_page_deletes_nothing() {
        let mut f = Scripted::new(vec![
            Ok((page(1, 50, "ephemeral"), Some(120))),
            Err("HTTP 500".into()),
            Ok((page(101, 20, "ephemeral"), Some(120))),
        ]);
        let rep = sweep(&mut f, &licence(), "ephemeral-", 1000);
        assert!(f.deleted.is_empty());
        assert!(rep.error.as_deref().unwrap().contains("page 2"));
        assert_eq!(sweep_failures(&rep).len(), 1);
    }

    #[test]
    fn a_server_that_ignores_page_deletes_nothing_after_two_pages() {
        let mut f = Scripted::new(vec![Ok((page(1, 50, "ephemeral"), None))]);
        f.loop_first = true;
        // Every page repeats the same full page without a total: refused at the first repeat.
        let rep = sweep(&mut f, &licence(), "ephemeral-", 1000);
        assert!(f.deleted.is_empty());
        assert_eq!(f.asked.len(), 2);
        assert!(rep.error.as_deref().unwrap().contains("page 2"));
    }

    #[test]
    fn a_list_that_never_ends_deletes_nothing() {
        let mut f = Scripted::new(vec![]);
        f.endless = true;
        let rep = sweep(&mut f, &licence(), "ephemeral-", 1000);
        assert!(f.deleted.is_empty());
        assert_eq!(f.asked.len(), MAX_PAGES as usize);
        assert!(rep.error.as_deref().unwrap().contains("did not end"));
    }

    #[test]
    fn short_page_without_total_ends_the_listing() {
        let mut f = Scripted::new(vec![Ok((page(1, 7, "ephemeral"), None))]);
        let rep = sweep(&mut f, &licence(), "ephemeral-", 1000);
        assert_eq!(f.asked, vec![1]);
        assert_eq!(rep.deleted.len(), 7);
    }

    // Mutation caught: a listing with more rows than its count taken as complete.
    #[test]
    fn a_total_that_lies_low_makes_the_listing_incomplete() {
        // 50 rows on page 1 but a count of 10: the count ended the listing early, so absence
        // from it proves nothing (a lost registration on page 2 must not be forgotten).
        let mut f = Scripted::new(vec![
            Ok((page(1, 50, "static"), Some(10))),
            Ok((page(51, 20, "ephemeral"), Some(10))),
        ]);
        let l = list_all(&mut f, &|_| true).unwrap();
        assert_eq!(f.asked, vec![1]);
        assert!(!l.complete);
    }

    #[test]
    fn a_total_that_lies_high_stops_on_an_empty_page() {
        let mut f = Scripted::new(vec![Ok((page(1, 5, "ephemeral"), Some(5000)))]);
        let rep = sweep(&mut f, &licence(), "ephemeral-", 1000);
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
        let rep = sweep(&mut f, &licence(), "ephemeral-", 1000);
        assert_eq!(f.deleted, vec![2, 3], "1 was offline, then idle: doubtful");
        assert_eq!(rep.skipped_doubtful.len(), 1);
        assert_eq!(rep.skipped_doubtful[0].runner_id, 1);
    }

    #[test]
    fn a_row_whose_name_changes_between_pages_is_never_deleted() {
        // Id 7 is another pool's on page 1 and ours (offline) on page 2; id 9 the other way round.
        let mut f = Scripted::new(vec![
            Ok((
                vec![
                    r(7, "static-7", RunnerStatus::Offline),
                    r(9, "ephemeral-9", RunnerStatus::Offline),
                ],
                Some(3),
            )),
            Ok((
                vec![
                    r(7, "ephemeral-7", RunnerStatus::Offline),
                    r(8, "ephemeral-8", RunnerStatus::Offline),
                    r(9, "static-9", RunnerStatus::Offline),
                ],
                Some(3),
            )),
        ]);
        let rep = sweep(&mut f, &licence(), "ephemeral-", 1000);
        assert_eq!(f.deleted, vec![8]);
        assert_eq!(rep.listed, 3);
        assert_eq!(
            rep.skipped_doubtful
                .iter()
                .map(|r| r.runner_id)
                .collect::<Vec<_>>(),
            vec![9]
        );
    }

    #[test]
    fn a_failed_delete_is_reported_and_the_rest_go_on() {
        let mut f = Scripted::new(vec![Ok((page(1, 3, "ephemeral"), Some(3)))]);
        f.fail_delete = vec![2];
        let rep = sweep(&mut f, &licence(), "ephemeral-", 10);
        assert_eq!(f.deleted, vec![1, 3]);
        assert_eq!(rep.failed.len(), 1);
        assert_eq!(
            sweep_failures(&rep).len(),
            1,
            "a failed delete fails the run"
        );
    }
}
