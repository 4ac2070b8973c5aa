//! The lost POST: a registration whose POST got no answer is looked for by its exact name in
//! the runner list. What the listing proves, and so what to do, is decided here.

use crate::core::listing::Listing;
use crate::core::model::{Deletable, Runner, may_delete};

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
    /// Rows carry the name. Those the gate lets go are deleted; any other (not offline, or
    /// listed twice with different contents) keeps the intent, with the text why.
    Found {
        delete: Vec<(Deletable, Runner)>,
        refused: Vec<String>,
    },
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
    let mut delete = Vec::new();
    let mut refused = Vec::new();
    for r in matches {
        match may_delete(r, prefix).filter(|_| !listing.conflicting.contains(&r.id)) {
            Some(target) => delete.push((target, r.clone())),
            None => refused.push(format!(
                "registration {} ({name}) exists with status {}; not deleting it while it is not offline",
                r.id,
                r.status.as_str()
            )),
        }
    }
    LostPost::Found { delete, refused }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::model::RunnerStatus;

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
        let LostPost::Found { delete, refused } = resolve_lost_post(&l, NAME, "ephemeral-") else {
            panic!("not found");
        };
        assert_eq!(delete.iter().map(|(d, _)| d.id()).collect::<Vec<_>>(), [7]);
        assert_eq!(refused.len(), 2, "{refused:?}");
        // Not our prefix (a pool renamed under the cycle): nothing is deleted.
        let LostPost::Found { delete, .. } = resolve_lost_post(&l, NAME, "renamed-") else {
            panic!("not found");
        };
        assert!(delete.is_empty());
    }
}
