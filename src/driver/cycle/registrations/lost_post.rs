//! A registration whose POST lost its answer: found again by its name in the full listing,
//! deleted (it can only be offline: nobody ever got its token), then forgotten; an unproven
//! lookup forgets nothing and is retried after the next wait.

use crate::core::forgejo::Runner;
use crate::core::resolve::{FoundRow, LostPost, could_be, resolve_lost_post};
use crate::core::sweep::gate::{Deletable, DeleteReason};
use crate::driver::cycle::{Driver, End};
use crate::driver::sweep;

impl Driver<'_, '_> {
    /// A lost-POST lookup failed (or was inconclusive): retried after the next wait, and counted.
    fn intent_failed(&mut self, name: &str) {
        self.ctx.failed_intents.insert(name.to_string());
        *self
            .ctx
            .cleanup_failures
            .entry(name.to_string())
            .or_default() += 1;
    }

    /// A POST whose answer was lost: list everything, delete the registrations with exactly this
    /// name (they can only be offline: nobody ever got their token), then forget it.
    pub(in crate::driver::cycle) fn resolve_intent(&mut self, name: &str) -> Option<End> {
        if let Some(end) = self.guard("a lost registration's lookup and DELETE") {
            return Some(end);
        }
        let listing = match sweep::list_all(self.w.forgejo, &could_be(name)) {
            Ok(l) => l,
            Err(e) => {
                self.intent_failed(name);
                self.report.fail(format!(
                    "looking for registration {name} (its POST got no answer) failed: {e}"
                ));
                return None;
            }
        };
        crate::crash_point!("resolve-listed");
        let mut all_gone = true;
        match resolve_lost_post(&listing, name, &self.cycle_prefix()) {
            LostPost::Unproven(why) => {
                self.intent_failed(name);
                self.report.fail(why);
                return None;
            }
            LostPost::NeverCreated => {
                log::info!(
                    "registration {name} was never created (its POST did not reach Forgejo)"
                );
            }
            LostPost::Found(rows) => {
                for row in rows {
                    all_gone &= match row {
                        FoundRow::Delete(target, r) => self.delete_lost(&target, &r, name),
                        FoundRow::Refused(why) => {
                            self.report.fail(why);
                            false
                        }
                    };
                }
            }
        }
        if !all_gone {
            self.intent_failed(name);
            return None;
        }
        let s = self.state.as_mut()?;
        s.registrations.retain(|r| r.name != name || r.id.is_some());
        if s.registrations.is_empty() {
            s.free_since = Some(self.w.clock.now());
        }
        let end = self.save().err().map(|_| End::Done);
        crate::crash_point!("resolve-forgotten-written");
        end
    }

    /// Deletes a registration found by name after its POST lost its answer; true once gone.
    fn delete_lost(&mut self, target: &Deletable, r: &Runner, name: &str) -> bool {
        let mut intent = self.report.draft("delete_runner", "");
        intent.runner_id = Some(r.id);
        intent.runner_name = Some(name.to_string());
        intent.reason = Some(DeleteReason::LostRegistration.as_str().into());
        intent.status = Some(r.status.as_str().to_string());
        self.report.intend_deletion(&intent);
        match self
            .w
            .forgejo
            .delete_runner(target, DeleteReason::LostRegistration.as_str())
        {
            Ok(_) => {
                crate::crash_point!("resolve-deleted");
                let e = self.report.event(
                    "delete_runner",
                    true,
                    "found by name after a lost POST answer",
                );
                e.runner_id = Some(r.id);
                e.runner_name = Some(name.to_string());
                e.reason = Some(DeleteReason::LostRegistration.as_str().into());
                e.status = Some(r.status.as_str().to_string());
                true
            }
            Err(e) => {
                self.report.fail(format!(
                    "deleting registration {} ({name}) failed: {e}",
                    r.id
                ));
                false
            }
        }
    }
}
