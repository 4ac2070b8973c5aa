//! A report as text: one line for the run, one for its counts, one per event, the sweep's and
//! the failures' counts.

use super::{Event, Report, Summary};
use crate::core::escape::escape_controls;

impl Summary {
    /// One line: `VM applied; 2 registered, 2 launched; deleted 1 unconsumed; VM destroyed`.
    pub fn line(&self) -> String {
        let mut parts: Vec<String> = Vec::new();
        let n = |count: u32, what: &str| format!("{count} {what}");
        if self.vm_applied > 0 {
            parts.push("VM applied".into());
        }
        if self.apply_failed > 0 {
            parts.push(n(self.apply_failed, "apply failed"));
        }
        let mut regs = Vec::new();
        for (count, what) in [
            (self.registered, "registered"),
            (self.register_failed, "registration failed"),
            (self.launched, "launched"),
            (self.launch_failed, "launch failed"),
            (self.consumed, "consumed"),
        ] {
            if count > 0 {
                regs.push(n(count, what));
            }
        }
        if !regs.is_empty() {
            parts.push(regs.join(", "));
        }
        if !self.deleted.is_empty() {
            let by: Vec<String> = self.deleted.iter().map(|(r, c)| n(*c, r)).collect();
            parts.push(format!("deleted {}", by.join(", ")));
        }
        if self.already_gone > 0 {
            parts.push(n(self.already_gone, "already gone"));
        }
        if self.delete_failed > 0 {
            parts.push(n(self.delete_failed, "deletion(s) failed"));
        }
        if self.held > 0 {
            parts.push(n(self.held, "job(s) held"));
        }
        if self.vm_destroyed > 0 {
            parts.push("VM destroyed".into());
        }
        if self.destroy_failed > 0 {
            parts.push(n(self.destroy_failed, "destroy failed"));
        }
        if parts.is_empty() {
            "no side effect".into()
        } else {
            parts.join("; ")
        }
    }
}

impl Report {
    /// A short human summary.
    pub fn text(&self) -> String {
        let mut out = format!(
            "{} {}: {} (exit {}, {})",
            self.command,
            self.cycle_id.as_deref().unwrap_or("(no cycle)"),
            self.outcome,
            self.exit_code,
            seconds(self.duration_ms)
        );
        out.push_str(&format!("\n  {}", self.summary.line()));
        // Names and errors in events come from Forgejo and tofu: escaped, one line each.
        for e in &self.events {
            out.push_str(&format!("\n  {}", escape_controls(&event_line(e))));
        }
        if let Some(s) = &self.sweep {
            out.push_str(&format!(
                "\n  sweep{}: {} listed on {} pages, {} offline with our prefix, {} deleted, {} already gone, {} failed, {} doubtful skipped, {} left over the cap",
                if s.error.is_some() {
                    " FAILED (the listing is incomplete)"
                } else {
                    ""
                },
                s.listed,
                s.pages,
                s.found,
                s.deleted.len(),
                s.already_gone.len(),
                s.failed.len(),
                s.skipped_doubtful.len(),
                s.left_over_cap,
            ));
        }
        // Each failure was logged at error level when it happened (on stderr, or the journal):
        // the summary counts them rather than printing every one a second time.
        let failures = self.failures.len() as u64 + self.failures_not_listed;
        if self.failures_not_listed > 0 {
            out.push_str(&format!(
                "\n  {failures} error(s), logged as they happened; the first {} are kept in last-run.json (`ci-ephemeral-provisioner status` shows them)",
                self.failures.len()
            ));
        } else if failures > 0 {
            out.push_str(&format!(
                "\n  {failures} error(s), logged as they happened and kept in last-run.json (`ci-ephemeral-provisioner status` shows them)"
            ));
        }
        out
    }
}

/// `1.25s`
pub fn seconds(ms: u64) -> String {
    format!("{}.{:02}s", ms / 1000, (ms % 1000) / 10)
}

/// `ok    0.10s delete_runner runner 3 ephemeral-x-1 (unconsumed, seen offline): deleted`
pub fn event_line(e: &Event) -> String {
    let mut why: Vec<String> = Vec::new();
    if let Some(r) = &e.reason {
        why.push(r.clone());
    }
    if let Some(s) = &e.status {
        why.push(format!("seen {s}"));
    }
    if let Some(c) = &e.destroyed_cycle_id {
        why.push(format!("after the destroy of {c}"));
    }
    format!(
        "{} {:>6} {}{}{}{}: {}",
        if e.ok { "ok  " } else { "FAIL" },
        seconds(e.duration_ms),
        e.step,
        e.runner_id
            .map(|i| format!(" runner {i}"))
            .unwrap_or_default(),
        e.runner_name
            .as_ref()
            .map(|n| format!(" {n}"))
            .unwrap_or_default(),
        if why.is_empty() {
            String::new()
        } else {
            format!(" ({})", why.join(", "))
        },
        // The whole detail is in the JSON form and the audit trail; the error lines repeat it.
        cut(&e.detail, 300)
    )
}

/// At most `max` bytes of `s`, cut at a character boundary, marked when cut.
pub fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes cut)", &s[..end], s.len() - end)
}
