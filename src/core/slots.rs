//! Parallel slots of one pool: how many there may be and where each keeps its files. Each slot
//! runs the single-VM cycle with its own cycle.json; what the other slots hold is
//! `core::claims`'s, what a sweep spares of theirs `core::sweep::spare`'s.

/// Most slots one pool may have.
pub const MAX_SLOTS: u32 = 64;

/// The directory name of slot `k` (≥ 2) inside the pool's state directory; slot 1 keeps its files
/// in the state directory itself.
pub fn slot_dir_name(k: u32) -> Option<String> {
    (k >= 2).then(|| format!("slot-{k}"))
}

/// The slot number of a directory named by [`slot_dir_name`].
pub fn parse_slot_dir_name(name: &str) -> Option<u32> {
    let n = name.strip_prefix("slot-")?;
    if n.starts_with('0') || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok().filter(|k| *k >= 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_directories_round_trip() {
        assert_eq!(slot_dir_name(1), None);
        assert_eq!(slot_dir_name(2).as_deref(), Some("slot-2"));
        assert_eq!(parse_slot_dir_name("slot-12"), Some(12));
        for bad in [
            "slot-1", "slot-0", "slot-02", "slot-", "slot-x", "slots-2", "slot-2a",
        ] {
            assert_eq!(parse_slot_dir_name(bad), None, "{bad}");
        }
    }
}
