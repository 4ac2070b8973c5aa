//! The lost POST: a registration whose POST got no answer is looked for by its exact name in
//! the runner list. What the listing proves, and so what to do, is decided here.

use crate::core::forgejo::Runner;
use crate::core::sweep::gate::{Deletable, may_delete};
use crate::core::sweep::listing::Listing;

/// The rows a lookup keeps whole: those of that name, and those without a readable name (any
/// of them could be it).
pub fn could_be(name: &str) -> impl Fn(&Runner) -> bool + '_ {
    move |r: &Runner| r.name.is_none() || r.name.as_deref() == Some(name)
}

#[derive(Debug, PartialEq, Eq)]
pub enum LostPost {
    /// Its absence is not proven (the list came back short, or a row had no readable name):
    /// the intent is kept and the lookup retried. The text says why.
    Unproven(String),
    /// Not in a complete list with every name readable: the POST never reached Forgejo, and
    /// the intent may be forgotten.
    NeverCreated,
    /// Rows carry the name, in the listing's order. Those the gate lets go are deleted; any
    /// other (not offline, or listed twice with different contents) keeps the intent.
    Found(Vec<FoundRow>),
}

#[derive(Debug, PartialEq, Eq)]
pub enum FoundRow {
    Delete(Deletable, Runner),
    /// Not deleted; the text says why.
    Refused(String),
}

/// What the listing says of the registration `name` (lost POST), under `prefix`.
pub fn resolve_lost_post(listing: &Listing, name: &str, prefix: &str) -> LostPost {
    let matches: Vec<&Runner> = listing
        .rows
        .iter()
        .filter(|r| r.name.as_deref() == Some(name))
        .collect();
    if matches.is_empty() {
        if !listing.complete {
            return LostPost::Unproven(format!(
                "registration {name} (its POST got no answer) was not in a runner list that ended with {} of the {} rows Forgejo counted; not forgetting it, retrying",
                listing.distinct,
                listing.total.unwrap_or(0)
            ));
        }
        if let Some(r) = listing.rows.iter().find(|r| r.name.is_none()) {
            return LostPost::Unproven(format!(
                "registration {name} (its POST got no answer) was not found, but runner {} was listed without a name; not forgetting it, retrying",
                r.id
            ));
        }
        return LostPost::NeverCreated;
    }
    let rows = matches
        .into_iter()
        .map(|r| match may_delete(r, prefix).filter(|_| !listing.conflicting.contains(&r.id)) {
            Some(target) => FoundRow::Delete(target, r.clone()),
            None => FoundRow::Refused(format!(
                "registration {} ({name}) exists with status {}; not deleting it while it is not offline",
                r.id,
                r.status.as_str()
            )),
        })
        .collect();
    LostPost::Found(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::forgejo::RunnerStatus;

    fn row(id: i64, name: Option<&str>, status: RunnerStatus) -> Runner {
        Runner {
            id,
            name: name.map(str::to_string),
            status,
            labels: None,
        }
    }

    fn listing(rows: Vec<Runner>, complete: bool) -> Listing {
        Listing {
            distinct: rows.len(),
            rows,
            conflicting: Vec::new(),
            pages: 1,
            complete,
            total: None,
        }
    }

    const NAME: &str = "ephemeral-c1-1";

    #[test]
    fn absent_from_a_complete_list_with_every_name_readable_was_never_created() {
        let l = listing(vec![row(1, Some("other"), RunnerStatus::Offline)], true);
        assert_eq!(
            resolve_lost_post(&l, NAME, "ephemeral-"),
            LostPost::NeverCreated
        );
    }

    #[test]
    fn a_short_list_or_a_nameless_row_proves_nothing() {
        let short = listing(vec![], false);
        assert!(
            matches!(resolve_lost_post(&short, NAME, "ephemeral-"), LostPost::Unproven(w) if w.contains("not in a runner list"))
        );
        let nameless = listing(vec![row(4, None, RunnerStatus::Offline)], true);
        assert!(
            matches!(resolve_lost_post(&nameless, NAME, "ephemeral-"), LostPost::Unproven(w) if w.contains("runner 4 was listed without a name"))
        );
    }

    #[test]
    fn found_rows_go_through_the_gate() {
        let mut l = listing(
            vec![
                row(7, Some(NAME), RunnerStatus::Offline),
                row(8, Some(NAME), RunnerStatus::Idle),
                row(9, Some(NAME), RunnerStatus::Offline),
            ],
            true,
        );
        l.conflicting = vec![9];
        let deleted = |prefix: &str| match resolve_lost_post(&l, NAME, prefix) {
            LostPost::Found(rows) => rows
                .iter()
                .map(|row| match row {
                    FoundRow::Delete(d, _) => Some(d.id()),
                    FoundRow::Refused(_) => None,
                })
                .collect::<Vec<_>>(),
            other => panic!("not found: {other:?}"),
        };
        // In the listing's order: 7 deleted, 8 (idle) and 9 (conflicting rows) refused.
        assert_eq!(deleted("ephemeral-"), [Some(7), None, None]);
        // Not our prefix (a pool renamed under the cycle): nothing is deleted.
        assert_eq!(deleted("renamed-"), [None, None, None]);
    }
}
