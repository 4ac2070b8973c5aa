//! THE deletion gate: what the provisioner may delete (a registration with our prefix that
//! Forgejo reports exactly `offline`), the proof of it ([`Deletable`]), and why each deletion is
//! made ([`DeleteReason`]). The cycle's deletions and the sweep's pass through it alike.

use serde::Serialize;

use crate::core::forgejo::{Runner, RunnerStatus};

/// Whether a registration's name carries our prefix (an empty prefix claims nothing).
pub fn is_ours(name: Option<&str>, prefix: &str) -> bool {
    !prefix.is_empty() && name.is_some_and(|n| n.starts_with(prefix))
}

/// A registration that passed THE deletion gate, [`may_delete`]: the only thing
/// `Forgejo::delete_runner` accepts. Its field is private and `may_delete` is its only
/// constructor, so no code can send a DELETE for a registration the gate has not passed:
///
/// (Mutation caught by this doctest: a `Deletable` made without `may_delete`.)
///
/// ```compile_fail,E0451
/// let bypass = ci_ephemeral_provisioner::core::sweep::gate::Deletable { id: 7 };
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deletable {
    id: i64,
}

impl Deletable {
    pub fn id(&self) -> i64 {
        self.id
    }
}

/// THE deletion gate. A registration may be deleted only when its name carries our prefix and
/// Forgejo says it is exactly `offline`; then, and only then, it is [`Deletable`].
///
/// ```
/// use ci_ephemeral_provisioner::core::forgejo::{Runner, RunnerStatus};
/// use ci_ephemeral_provisioner::core::sweep::gate::{Deletable, may_delete};
/// let mut r = Runner { id: 7, name: Some("ephemeral-c1-1".into()), status: RunnerStatus::Offline, labels: None };
/// let d: Option<Deletable> = may_delete(&r, "ephemeral-");
/// assert_eq!(d.map(|d| d.id()), Some(7));
/// r.status = RunnerStatus::Idle;
/// assert!(may_delete(&r, "ephemeral-").is_none());
/// ```
pub fn may_delete(runner: &Runner, prefix: &str) -> Option<Deletable> {
    (is_ours(runner.name.as_deref(), prefix) && runner.status == RunnerStatus::Offline)
        .then_some(Deletable { id: runner.id })
}

/// Declares [`DeleteReason`] with each variant's label, and [`DeleteReason::ALL`] from the
/// same list: a reason cannot be added without its label and its metric.
macro_rules! delete_reasons {
    ($($(#[doc = $doc:literal])* $variant:ident => $label:literal,)+) => {
        /// Why a registration is deleted: the label of its event, audit line and metric.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
        #[serde(rename_all = "snake_case")]
        pub enum DeleteReason {
            $($(#[doc = $doc])* $variant,)+
        }

        impl DeleteReason {
            /// Every reason, in declaration order.
            pub const ALL: &'static [DeleteReason] = &[$(DeleteReason::$variant,)+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(DeleteReason::$variant => $label,)+
                }
            }
        }
    };
}

delete_reasons! {
    /// Its runner connected, then went offline for longer than the registration grace without
    /// running its job: it never consumed itself.
    Unconsumed => "unconsumed",
    /// The launch command exited 0, yet the runner never connected: still `offline` (never
    /// seen `idle` or `active`) past the registration grace. A failed start.
    NeverConnected => "never_connected",
    /// The launch command failed, so the registration can never be used.
    LaunchFailed => "launch_failed",
    /// The launch was cut off (crash or stop) before it reported back; the token is gone.
    LaunchCutOff => "launch_cut_off",
    /// Left over when the VM was torn down.
    Teardown => "teardown",
    /// Its runner sat idle after its job ended or went away (stranded); deleted once the
    /// teardown took it offline.
    Stranded => "stranded",
    /// Its runner sat idle for `--job-pickup-timeout` while its job waited (Forgejo did not
    /// give it the job); deleted once the teardown took it offline.
    PickupTimeout => "pickup_timeout",
    /// Its runner declared labels that do not cover its job's `runs_on`; deleted once the
    /// teardown took it offline.
    WrongLabels => "wrong_labels",
    /// A POST whose answer was lost, found again by its exact name.
    LostRegistration => "lost_registration",
    /// Offline registration with our prefix, found by the sweep after a successful destroy.
    Sweep => "sweep",
}
