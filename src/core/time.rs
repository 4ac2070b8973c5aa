//! Wall-clock timestamps (as RFC 3339 in every file we write) and `5m`-style durations.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Milliseconds since the Unix epoch, UTC. Serialized as RFC 3339 (`2026-10-14T15:07:57.000Z`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

impl Timestamp {
    pub fn from_system(t: SystemTime) -> Timestamp {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timestamp(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            Err(e) => Timestamp(-i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX)),
        }
    }

    pub fn to_system(self) -> SystemTime {
        if self.0 >= 0 {
            UNIX_EPOCH + Duration::from_millis(self.0 as u64)
        } else {
            UNIX_EPOCH - Duration::from_millis(self.0.unsigned_abs())
        }
    }

    /// Parses RFC 3339 in UTC (`2026-10-14T15:00:00Z`, fractional seconds allowed).
    pub fn parse_rfc3339(s: &str) -> anyhow::Result<Timestamp> {
        humantime::parse_rfc3339(s.trim())
            .map(Timestamp::from_system)
            .map_err(|e| {
                anyhow!("{s:?} is not an RFC 3339 UTC timestamp like 2026-10-14T15:00:00Z: {e}")
            })
    }

    pub fn rfc3339(self) -> String {
        humantime::format_rfc3339_millis(self.to_system()).to_string()
    }

    pub fn plus(self, d: Duration) -> Timestamp {
        Timestamp(
            self.0
                .saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        )
    }

    /// Time elapsed from `earlier` to `self`; zero when `earlier` is in the future.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }

    /// `20261014t150757z`: the timestamp as it appears in cycle ids and runner names.
    pub fn compact(self) -> String {
        humantime::format_rfc3339_seconds(self.to_system())
            .to_string()
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
            .to_ascii_lowercase()
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.rfc3339())
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.rfc3339())
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Timestamp, D::Error> {
        let s = String::deserialize(d)?;
        Timestamp::parse_rfc3339(&s).map_err(serde::de::Error::custom)
    }
}

/// Parses `500ms`, `2s`, `5m`, `1h` (and combinations such as `1h 30m`).
pub fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let t = s.trim();
    if t.is_empty() {
        bail!("empty duration; write it like 500ms, 2s, 5m or 1h");
    }
    if t.starts_with('-') {
        bail!("{s:?} is negative; a duration is 0 or more, like 500ms, 2s, 5m or 1h");
    }
    humantime::parse_duration(t)
        .map_err(|e| anyhow!("{s:?} is not a duration like 500ms, 2s, 5m or 1h: {e}"))
}

/// Formats a duration the way it is written on the command line (`5m`, `1h 30m`, `200ms`).
pub fn format_duration(d: Duration) -> String {
    let ms = Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    humantime::format_duration(ms).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trips_and_compacts() {
        let t = Timestamp::parse_rfc3339("2026-10-14T15:07:57Z").unwrap();
        assert_eq!(t.rfc3339(), "2026-10-14T15:07:57.000Z");
        assert_eq!(t.compact(), "20261014t150757z");
        assert_eq!(Timestamp::parse_rfc3339(&t.rfc3339()).unwrap(), t);
        assert!(Timestamp::parse_rfc3339("yesterday").is_err());
    }

    #[test]
    fn durations_parse_in_operator_notation() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert_eq!(format_duration(Duration::from_secs(300)), "5m");
    }

    #[test]
    fn since_saturates() {
        let a = Timestamp(1_000);
        let b = Timestamp(4_000);
        assert_eq!(b.since(a), Duration::from_secs(3));
        assert_eq!(a.since(b), Duration::ZERO);
    }
}
