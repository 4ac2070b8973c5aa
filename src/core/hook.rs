//! The webhook receiver's decisions (`hook`): which request is refused and why, whether a
//! delivery's signature is Forgejo's, whether it was seen before, and what the metrics say.
//! Forgejo signs a delivery with the hex HMAC-SHA256 of its body under the hook's secret in
//! `X-Forgejo-Signature`, names it in `X-Forgejo-Delivery` (a fresh UUID per delivery: a
//! "Redeliver" gets a new one too, `models/webhook/hooktask.go` `ReplayHookTask`) and its event
//! in `X-Forgejo-Event`/`X-Forgejo-Event-Type` (v15.0.3 `services/webhook/shared/payloader.go`
//! `AddDefaultHeaders`). It delivers each task at most once (`services/webhook/deliver.go`
//! `Deliver` marks it delivered first), so a repeated id is a replay, never Forgejo's retry.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::core::time::Timestamp;

pub mod request;

/// The largest body accepted (Forgejo's payloads are a few KiB; a push of many commits more).
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// The receiver's own state file, in its state directory.
pub const HOOK_STATE_FILE: &str = "hook-state.json";
pub const HOOK_STATE_VERSION: u32 = 1;
/// Delivery ids remembered (the oldest are forgotten first): a replay of one of them wakes
/// nothing.
pub const MAX_REMEMBERED: usize = 1000;
/// The largest state file read (1,000 ids and the counters are under 100 KiB).
pub const MAX_HOOK_STATE_BYTES: u64 = 512 * 1024;

/// What became of a request: the `reason` label of the metric, the word in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// Signed, new: the pools were woken.
    Woke,
    /// Signed, new, but every wake file was touched less than [`COALESCE`] ago: the wake of
    /// that delivery stands (its runs look for jobs for their window from it).
    Coalesced,
    /// Signed, but its delivery id was seen before: nothing woken.
    Repeated,
    /// Signed, of an event after which no job can be waiting (a run's end): nothing woken.
    NoJobs,
    Unsigned,
    BadSignature,
    TooLarge,
    Slow,
    Malformed,
    Method,
    ContentType,
    /// Signed and new, but a wake file could not be touched.
    WakeFailed,
}

/// The `outcome` label: what the sender was told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Accepted,
    Ignored,
    Refused,
    Failed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Accepted => "accepted",
            Outcome::Ignored => "ignored",
            Outcome::Refused => "refused",
            Outcome::Failed => "failed",
        }
    }
}

impl Reason {
    pub const ALL: [Reason; 12] = [
        Reason::Woke,
        Reason::Coalesced,
        Reason::Repeated,
        Reason::NoJobs,
        Reason::Unsigned,
        Reason::BadSignature,
        Reason::TooLarge,
        Reason::Slow,
        Reason::Malformed,
        Reason::Method,
        Reason::ContentType,
        Reason::WakeFailed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Woke => "woke",
            Reason::Coalesced => "coalesced",
            Reason::Repeated => "repeated",
            Reason::NoJobs => "no_jobs_event",
            Reason::Unsigned => "unsigned",
            Reason::BadSignature => "bad_signature",
            Reason::TooLarge => "too_large",
            Reason::Slow => "slow",
            Reason::Malformed => "malformed",
            Reason::Method => "method",
            Reason::ContentType => "content_type",
            Reason::WakeFailed => "wake_failed",
        }
    }

    pub fn outcome(self) -> Outcome {
        match self {
            Reason::Woke | Reason::Coalesced => Outcome::Accepted,
            Reason::Repeated | Reason::NoJobs => Outcome::Ignored,
            Reason::WakeFailed => Outcome::Failed,
            _ => Outcome::Refused,
        }
    }

    /// The HTTP status answered (Forgejo counts any 2xx as delivered).
    pub fn status(self) -> u16 {
        match self {
            Reason::Woke | Reason::Coalesced | Reason::Repeated | Reason::NoJobs => 200,
            Reason::Unsigned | Reason::BadSignature => 403,
            Reason::TooLarge => 413,
            Reason::Slow => 408,
            Reason::Malformed => 400,
            Reason::Method => 405,
            Reason::ContentType => 415,
            Reason::WakeFailed => 500,
        }
    }
}

/// A request refused before it could wake anything, and why (safe to log: request text in it
/// is escaped).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    pub reason: Reason,
    pub detail: String,
}

impl Refused {
    pub fn new(reason: Reason, detail: impl Into<String>) -> Refused {
        Refused {
            reason,
            detail: detail.into(),
        }
    }
}

/// The hook's secret as ring's HMAC-SHA256 key.
pub fn key(secret: &[u8]) -> ring::hmac::Key {
    ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret)
}

/// Whether `signature` (hex, as `X-Forgejo-Signature` carries it) is the HMAC-SHA256 of `body`
/// under `key`: compared in constant time (`ring::hmac::verify`).
pub fn verify(key: &ring::hmac::Key, body: &[u8], signature: &str) -> Result<(), Refused> {
    let bad = || {
        Refused::new(
            Reason::BadSignature,
            "X-Forgejo-Signature is not the body's HMAC-SHA256 under the secret: is the webhook's secret the one in the receiver's secret file?",
        )
    };
    let tag = unhex(signature.trim()).ok_or_else(bad)?;
    ring::hmac::verify(key, body, &tag).map_err(|_| bad())
}

/// 64 hex digits (either case) as 32 bytes; anything else is `None`.
fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() != 64 {
        return None;
    }
    let digit = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    s.as_bytes()
        .chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

/// Whether a delivery of this event can be the moment a job waits: every event Forgejo's
/// Actions run on can (v15.0.3 `services/actions/notifier.go`: push, pull requests, issues,
/// comments, releases, …), the `action_run_*` events, sent once a run has ended, cannot. Forgejo
/// (to v17) sends no `workflow_job` events; one would wake. `event` is `X-Forgejo-Event-Type`,
/// else `X-Forgejo-Event` (Forgejo leaves the latter empty for some events).
pub fn may_create_jobs(event: &str) -> bool {
    !event.starts_with("action_run_")
}

/// A wake file touched less than this long ago is not touched again: a burst of deliveries
/// wakes each slot once (its run then looks every second for its window anyway).
pub const COALESCE: Duration = Duration::from_secs(1);

/// Whether a new delivery at `now` touches a wake file last touched at `last`: not within
/// [`COALESCE`] of it (either side: a clock set back a little is no reason to wake twice).
pub fn touches(last: Option<Timestamp>, now: Timestamp) -> bool {
    last.is_none_or(|t| !(now < t.plus(COALESCE) && t <= now.plus(COALESCE)))
}

/// One delivery remembered: its id, its signature and when it was accepted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeenDelivery {
    pub id: String,
    /// `X-Forgejo-Signature` in lower case: Forgejo signs the body alone, so a captured body
    /// sent again under another id or event header is known by it.
    #[serde(default)]
    pub signature: String,
    pub at: Timestamp,
}

/// `hook-state.json`: the delivery ids seen last (at most [`MAX_REMEMBERED`]) and the counts by
/// reason since the file began.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookState {
    pub version: u32,
    #[serde(default)]
    pub recent: VecDeque<SeenDelivery>,
    /// By `Reason::as_str`; a name this build does not know is kept, not shown.
    #[serde(default)]
    pub counts: BTreeMap<String, u64>,
    #[serde(default)]
    pub last_woke: Option<Timestamp>,
}

impl Default for HookState {
    fn default() -> HookState {
        HookState {
            version: HOOK_STATE_VERSION,
            recent: VecDeque::new(),
            counts: BTreeMap::new(),
            last_woke: None,
        }
    }
}

impl HookState {
    pub fn parse(text: &str) -> anyhow::Result<HookState> {
        let s: HookState = serde_json::from_str(text)?;
        if s.version != HOOK_STATE_VERSION {
            anyhow::bail!(
                "version {} is not {HOOK_STATE_VERSION}, the one this build writes",
                s.version
            );
        }
        Ok(s)
    }

    /// Whether the delivery `id`, or one with this `signature` (its body), was seen among the
    /// last [`MAX_REMEMBERED`].
    pub fn seen(&self, id: &str, signature: &str) -> bool {
        let signature = signature.trim().to_ascii_lowercase();
        self.recent
            .iter()
            .any(|s| s.id == id || (!signature.is_empty() && s.signature == signature))
    }

    /// Remembers `id` and `signature` (the oldest go once there are [`MAX_REMEMBERED`]).
    pub fn remember(&mut self, id: &str, signature: &str, now: Timestamp) {
        while self.recent.len() >= MAX_REMEMBERED {
            self.recent.pop_front();
        }
        self.recent.push_back(SeenDelivery {
            id: id.to_string(),
            signature: signature.trim().to_ascii_lowercase(),
            at: now,
        });
    }

    pub fn count(&mut self, reason: Reason, now: Timestamp) {
        *self.counts.entry(reason.as_str().to_string()).or_default() += 1;
        if reason == Reason::Woke {
            self.last_woke = Some(now);
        }
    }
}

/// What a signed, well-formed delivery does: wake (the pools), or nothing, and why.
pub fn decide(state: &HookState, id: &str, signature: &str, event: &str) -> Reason {
    if state.seen(id, signature) {
        Reason::Repeated
    } else if !may_create_jobs(event) {
        Reason::NoJobs
    } else {
        Reason::Woke
    }
}

/// The receiver's metrics (Prometheus text): every reason, zeros too, so that a rate works from
/// the first delivery on.
pub fn render_metrics(state: &HookState) -> String {
    const P: &str = "ci_ephemeral_provisioner_hook";
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# HELP {P}_deliveries_total Requests the webhook receiver answered, by outcome and reason.\n# TYPE {P}_deliveries_total counter"
    );
    for r in Reason::ALL {
        let n = state.counts.get(r.as_str()).copied().unwrap_or(0);
        let _ = writeln!(
            o,
            "{P}_deliveries_total{{outcome=\"{}\",reason=\"{}\"}} {n}",
            r.outcome().as_str(),
            r.as_str()
        );
    }
    let last = state
        .last_woke
        .map(|t| format!("{}.{:03}", t.0.div_euclid(1000), t.0.rem_euclid(1000)))
        .unwrap_or_else(|| "0".into());
    let _ = writeln!(
        o,
        "# HELP {P}_last_woke_timestamp_seconds Unix time of the last delivery that woke the pools; 0 if none did.\n# TYPE {P}_last_woke_timestamp_seconds gauge\n{P}_last_woke_timestamp_seconds {last}"
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sign(secret: &[u8], body: &[u8]) -> String {
        ring::hmac::sign(&key(secret), body)
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    // Mutation caught: verify answering Ok without comparing (any signature of 64 hex digits passes).
    #[test]
    fn only_the_secrets_signature_of_this_very_body_passes() {
        let k = key(b"s3cret");
        let body = br#"{"ref":"refs/heads/main"}"#;
        let good = sign(b"s3cret", body);
        assert_eq!(verify(&k, body, &good), Ok(()));
        assert_eq!(verify(&k, body, &good.to_uppercase()), Ok(()));
        let refused = |sig: &str, body: &[u8]| verify(&k, body, sig).unwrap_err().reason;
        assert_eq!(refused(&sign(b"other", body), body), Reason::BadSignature);
        assert_eq!(
            refused(&good, br#"{"ref":"refs/heads/evil"}"#),
            Reason::BadSignature
        );
        assert_eq!(refused(&good[..63], body), Reason::BadSignature);
        assert_eq!(refused(&format!("{good}00"), body), Reason::BadSignature);
        assert_eq!(refused(&"zz".repeat(32), body), Reason::BadSignature);
        assert_eq!(refused(&"0".repeat(64), body), Reason::BadSignature);
        // RFC 4231, test case 2: the key "Jefe".
        let tc2 = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        assert_eq!(
            verify(&key(b"Jefe"), b"what do ya want for nothing?", tc2),
            Ok(())
        );
    }

    // Mutation caught: `decide` without the `seen` check (a replayed delivery wakes again);
    // `seen` by id alone (a captured body under a new id or event header wakes again).
    #[test]
    fn a_delivery_seen_before_by_id_or_body_wakes_nothing_and_memory_is_bounded() {
        let mut s = HookState::default();
        assert_eq!(decide(&s, "a", "AB01", "push"), Reason::Woke);
        s.remember("a", "AB01", Timestamp(1));
        assert_eq!(decide(&s, "a", "cd02", "push"), Reason::Repeated);
        // Forgejo signs the body alone: its signature under another id and event is a replay.
        assert_eq!(decide(&s, "z", "ab01", "create"), Reason::Repeated);
        assert_eq!(decide(&s, "b", "", "pull_request_sync"), Reason::Woke);
        assert_eq!(
            decide(&s, "b", "cd02", "action_run_success"),
            Reason::NoJobs
        );
        for i in 0..MAX_REMEMBERED {
            s.remember(&format!("id-{i}"), &format!("{i:064x}"), Timestamp(2));
        }
        assert_eq!(s.recent.len(), MAX_REMEMBERED);
        assert!(
            !s.seen("a", "ab01"),
            "the oldest delivery is forgotten first"
        );
        assert!(s.seen("id-0", "") && s.seen("new", &format!("{:064x}", MAX_REMEMBERED - 1)));
    }

    // Mutation caught: `touches` always true (a burst of deliveries touches a wake file once each).
    #[test]
    fn a_burst_touches_each_wake_file_once_a_second() {
        let t = Timestamp(1_000_000);
        assert!(touches(None, t));
        assert!(!touches(Some(t), t));
        assert!(!touches(Some(t), t.plus(Duration::from_millis(999))));
        assert!(touches(Some(t), t.plus(COALESCE)));
        assert!(touches(Some(t), t.plus(Duration::from_secs(3600))));
        // A time a little ahead of the clock coalesces; one far ahead does not.
        assert!(!touches(Some(t.plus(Duration::from_millis(500))), t));
        assert!(touches(Some(t.plus(Duration::from_secs(3600))), t));
    }

    #[test]
    fn the_state_round_trips_and_another_version_is_refused() {
        let mut s = HookState::default();
        s.remember("a", "ab01", Timestamp(5));
        s.count(Reason::Woke, Timestamp(5));
        s.count(Reason::BadSignature, Timestamp(6));
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(HookState::parse(&text).unwrap(), s);
        assert!(HookState::parse(&text.replace("\"version\":1", "\"version\":2")).is_err());
        assert!(HookState::parse("{").is_err());
    }

    #[test]
    fn the_metrics_name_every_reason_with_its_outcome() {
        let mut s = HookState::default();
        s.count(Reason::Woke, Timestamp(1_500));
        s.count(Reason::Unsigned, Timestamp(2_000));
        s.count(Reason::Unsigned, Timestamp(2_000));
        let m = render_metrics(&s);
        assert!(m.contains(
            "ci_ephemeral_provisioner_hook_deliveries_total{outcome=\"accepted\",reason=\"woke\"} 1\n"
        ));
        assert!(m.contains(
            "ci_ephemeral_provisioner_hook_deliveries_total{outcome=\"refused\",reason=\"unsigned\"} 2\n"
        ));
        assert!(m.contains(
            "ci_ephemeral_provisioner_hook_deliveries_total{outcome=\"ignored\",reason=\"repeated\"} 0\n"
        ));
        assert!(m.contains("ci_ephemeral_provisioner_hook_last_woke_timestamp_seconds 1.500\n"));
        assert_eq!(
            m.lines()
                .filter(|l| l.contains("_deliveries_total{"))
                .count(),
            Reason::ALL.len()
        );
    }
}
