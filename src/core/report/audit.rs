//! The audit trail of a run: every event and failure appended to the sink as it happens, and
//! each DELETE's intent just before it is sent.

use std::fmt;

use serde_json::{Value, json};

use super::Event;
use super::text::cut;
use crate::core::ports::AuditSink;
use crate::core::time::Timestamp;

/// Details longer than this are cut in the audit trail (tofu's stderr can be long).
pub const MAX_AUDIT_DETAIL: usize = 2048;

/// The sink of a run's audit trail, if any, and how many of its events are in it.
#[derive(Default)]
pub struct AuditTrail {
    sink: Option<Box<dyn AuditSink>>,
    /// Events already appended.
    appended: usize,
}

impl fmt::Debug for AuditTrail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.sink.is_some() {
            "Audit(on)"
        } else {
            "Audit(off)"
        })
    }
}

impl AuditTrail {
    pub fn new(sink: Box<dyn AuditSink>) -> AuditTrail {
        AuditTrail {
            sink: Some(sink),
            appended: 0,
        }
    }

    /// Appends one record; without a sink, nothing.
    pub fn append(&mut self, record: &Value) -> anyhow::Result<()> {
        match self.sink.as_mut() {
            Some(sink) => sink.append(record),
            None => Ok(()),
        }
    }

    /// The next event of `events` not yet appended, counted as appended now.
    pub fn next_pending<'e>(&mut self, events: &'e [Event]) -> Option<&'e Event> {
        let e = events.get(self.appended)?;
        self.appended += 1;
        Some(e)
    }

    /// Makes what was appended durable.
    pub fn sync(&mut self) -> anyhow::Result<()> {
        match self.sink.as_mut() {
            Some(sink) => sink.sync(),
            None => Ok(()),
        }
    }
}

/// The audit record of an event: the event with the cycle id and `name` (the registration's).
pub fn audit_record(cycle_id: Option<&str>, e: &Event) -> Value {
    let mut v = serde_json::to_value(e).unwrap_or_else(|_| json!({}));
    if let Some(o) = v.as_object_mut() {
        o.insert("cycle_id".into(), json!(cycle_id));
        o.insert("kind".into(), json!("side_effect"));
        if let Some(name) = o.remove("runner_name") {
            o.insert("name".into(), name);
        }
        o.insert("detail".into(), json!(cut(&e.detail, MAX_AUDIT_DETAIL)));
    }
    v
}

/// The audit record of a DELETE about to be sent, with its evidence.
pub fn intent_record(cycle_id: Option<&str>, intent: &Event) -> Value {
    let mut record = audit_record(cycle_id, intent);
    if let Some(o) = record.as_object_mut() {
        o.insert("kind".into(), json!("intent"));
        for k in ["ok", "detail", "duration_ms"] {
            o.remove(k);
        }
    }
    record
}

/// The audit record of a failure of the run.
pub fn failure_record(at: Timestamp, cycle_id: Option<&str>, message: &str) -> Value {
    json!({
        "at": at,
        "cycle_id": cycle_id,
        "kind": "failure",
        "detail": cut(message, MAX_AUDIT_DETAIL),
    })
}
