//! Warm capacity in the simulation (`--warm`, `--warm-max-age`, `--warm-during`): the seed's
//! choice per host, and the invariants on unused warm VMs. A warm VM is what the product says
//! it is (`core::warm::is_unused_warm` on the slot's cycle.json as last written); its age is the
//! world's (when the apply that made it up ended), its wanted count the run's flags.

use std::time::Duration;

use ci_ephemeral_provisioner::core::state::{CycleState, Phase};
use ci_ephemeral_provisioner::core::time::Timestamp;
use ci_ephemeral_provisioner::core::warm::{WarmPolicy, Windows, is_unused_warm};

use super::rng::Rng;
use super::world::{NOT_SERVED_SLACK_MS, POLL_MS, Sim, T0};

const MIN: i64 = 60_000;

/// What a seed does with warm capacity (from a random stream of its own, so that a seed without
/// warm VMs runs as it did before warm capacity).
#[derive(Clone, Debug, Default)]
pub struct WarmPlan {
    /// Per host, the flags of the faulty period.
    pub policies: Vec<WarmPolicy>,
    /// The quiet period keeps `--warm` (else it is 0).
    pub quiet_keeps: bool,
    /// At this time of the faulty period, host 0's `--warm` becomes this (runs started from
    /// then on have it; a running one keeps its flags).
    pub change: Option<(i64, u32)>,
}

/// One seed in three has `--warm` ≥ 1 on its first host (0..=slots on the second), a
/// `--warm-max-age` of a few minutes, half the time `--warm-during` windows around the faulty
/// period (or none that is ever open); a third of those keep it in the quiet period, a third
/// change host 0's `--warm` once while faults are on.
pub fn plan(seed: u64, slots_per_host: &[u32]) -> WarmPlan {
    let mut rng = Rng::new(seed ^ 0x5741_524D_5741_524D);
    if !rng.chance(1.0 / 3.0) {
        return WarmPlan::default();
    }
    let max_age = Duration::from_millis(rng.pick(&[2, 3, 5, 8]) as u64 * MIN as u64);
    let during = windows(&mut rng);
    let policies = slots_per_host
        .iter()
        .enumerate()
        .map(|(h, &n)| WarmPolicy {
            count: if h == 0 {
                rng.range(1, i64::from(n) + 1) as u32
            } else {
                rng.range(0, i64::from(n) + 1) as u32
            },
            max_age,
            during: during.clone(),
        })
        .collect();
    let quiet_keeps = rng.chance(1.0 / 3.0);
    let change = rng.chance(1.0 / 3.0).then(|| {
        let at = T0 + rng.range(10 * MIN, 100 * MIN);
        (at, rng.range(0, i64::from(slots_per_host[0]) + 1) as u32)
    });
    WarmPlan {
        policies,
        quiet_keeps,
        change,
    }
}

/// `--warm-during`: none (always) half the time; else one or two windows that open or close
/// within the seed's first two hours (the simulation starts on a Monday afternoon, UTC), or one
/// on a day the seed never sees.
fn windows(rng: &mut Rng) -> Windows {
    let hhmm = |m: i64| format!("{:02}:{:02}", m / 60, m % 60);
    let start = (T0 / 1000).rem_euclid(86_400) / 60;
    let text = match rng.below(6) {
        0..=2 => return Windows::always(),
        3 => {
            let a = start + rng.range(-20, 60);
            format!("{}-{}", hhmm(a), hhmm(a + rng.range(10, 80)))
        }
        4 => {
            let a = start + rng.range(-10, 30);
            let b = a + rng.range(5, 30);
            let c = b + rng.range(5, 30);
            format!(
                "Mon {}-{}, Mon {}-{}",
                hhmm(a),
                hhmm(b),
                hhmm(c),
                hhmm(c + rng.range(10, 60))
            )
        }
        _ => "Sat+Sun 00:00-24:00".to_string(),
    };
    Windows::parse(&text).expect("the simulation's --warm-during parses")
}

/// Whether cycle.json `disk` is an unused warm VM that is up (its apply ended).
pub fn unused_warm_up(disk: Option<&CycleState>) -> bool {
    disk.is_some_and(|s| is_unused_warm(s) && s.phase == Phase::Running)
}

impl Sim {
    fn disk_state(&self, slot: usize) -> Option<&CycleState> {
        self.slots[slot].disk.as_ref().map(|(_, s)| s)
    }

    /// The unused warm VMs (booting or up) of host `h`'s pool.
    pub fn warm_count(&self, h: usize) -> u32 {
        self.hosts[h]
            .slots
            .iter()
            .filter(|&&k| self.disk_state(k).is_some_and(is_unused_warm))
            .count() as u32
    }

    /// The running invocation of `slot`, if one is on the stack.
    fn running_inv(&self, slot: usize) -> Option<usize> {
        self.stack
            .iter()
            .rev()
            .copied()
            .find(|&i| self.invs[i].slot == slot)
    }

    /// After every step. (1) The unused warm VMs of a pool never exceed `--warm`: never more than
    /// the most any running invocation of the pool (or the pool's flags now) wants, unless as
    /// many or more were there before (a lowered `--warm`, a closed window: they drain). (2)
    /// When each slot's unused warm VM became unwanted by its own run's flags (the slots below
    /// it keep as many as are wanted), for the check at a wait.
    pub fn check_warm(&mut self, after: &str) {
        if self.warm.policies.is_empty() {
            return;
        }
        let now = self.now;
        for h in 0..self.hosts.len() {
            let c = self.warm_count(h);
            let allowed = self.hosts[h]
                .slots
                .iter()
                .filter_map(|&k| self.running_inv(k))
                .map(|i| self.invs[i].warm.wanted(Timestamp(now)))
                .chain(std::iter::once(self.hosts[h].warm.wanted(Timestamp(now))))
                .max()
                .unwrap_or(0);
            let before = self.hosts[h].warm_last;
            self.hosts[h].warm_last = c;
            self.stats.warm_most = self.stats.warm_most.max(c);
            if c > allowed && c > before {
                self.violate(format!(
                    "host {}'s pool has {c} unused warm VMs (it had {before}), more than --warm wants ({allowed}); after {after}",
                    h + 1
                ));
                return;
            }
        }
        for slot in 0..self.slots.len() {
            let unwanted = self.running_inv(slot).is_some_and(|i| {
                unused_warm_up(self.disk_state(slot)) && {
                    let host = &self.hosts[self.slots[slot].host];
                    let me = self.slots[slot].k;
                    let lower = host
                        .slots
                        .iter()
                        .filter(|&&o| {
                            self.slots[o].k < me && self.disk_state(o).is_some_and(is_unused_warm)
                        })
                        .count() as u32;
                    lower >= self.invs[i].warm.wanted(Timestamp(now))
                }
            });
            let since = &mut self.slots[slot].warm_unwanted_since;
            *since = if unwanted {
                Some(since.unwrap_or(now))
            } else {
                None
            };
        }
    }

    /// At a wait of invocation `inv` on its slot's unused warm VM: the VM is still wanted and
    /// younger than `--warm-max-age`, but for one poll interval plus `NOT_SERVED_SLACK_MS` past
    /// the moment it became unwanted or too old (its age counted from the end of the apply that
    /// made it up, as the product counts it). Counted from the start of the run or its last
    /// fault, whichever is later, as for an unserved job (`check_not_served`).
    pub fn check_warm_wait(&mut self, inv: usize) {
        if self.warm.policies.is_empty() {
            return;
        }
        let slot = self.slot_of(inv);
        self.check_warm("the decision to wait");
        if self.violation.is_some() || !unused_warm_up(self.disk_state(slot)) {
            return;
        }
        let now = self.now;
        let clean_from = self.invs[inv].started_at.max(self.invs[inv].last_fault_at);
        let cycle = self.disk_state(slot).map(|s| s.cycle_id.clone());
        let vm = self.vm_key(slot, cycle.as_deref().unwrap_or_default());
        let max_age = self.invs[inv].warm.max_age.as_millis() as i64;
        let allowed = POLL_MS + NOT_SERVED_SLACK_MS;
        if let Some(&ready) = self.vm_ready.get(&vm) {
            let over = now - (ready + max_age).max(clean_from);
            if over > allowed {
                self.violate(format!(
                    "the run waits on the unused warm VM {vm}, up since t+{} s, {over} ms past --warm-max-age ({} s; allowed {allowed} ms)",
                    (ready - T0) / 1000,
                    max_age / 1000
                ));
                return;
            }
        }
        if let Some(since) = self.slots[slot].warm_unwanted_since {
            let over = now - since.max(clean_from);
            if over > allowed {
                let wanted = self.invs[inv].warm.wanted(Timestamp(now));
                self.violate(format!(
                    "the run waits on the unused warm VM {vm} although the pool wants {wanted} and the slots below keep as many, {over} ms after it was no longer wanted (allowed {allowed} ms)"
                ));
            }
        }
    }

    /// The quiet period keeps warm VMs: slot `slot`'s cycle.json and VM are those of an unused
    /// warm VM that is up, and its host keeps up to `--warm` of them at rest.
    pub fn kept_warm_at_rest(&self, slot: usize) -> bool {
        let disk = self.disk_state(slot);
        unused_warm_up(disk)
            && disk.is_some_and(|s| self.slots[slot].vms == [self.vm_key(slot, &s.cycle_id)])
    }
}
