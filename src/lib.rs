//! ci-ephemeral-provisioner: one provisioner cycle of VM-isolated, ephemeral Forgejo Actions
//! runners per start. The decisions live in `planner` and `sweep::select` (pure); everything
//! that touches the world sits behind the traits in `forgejo`, `tofu`, `launch`, `state` and
//! `cycle::Clock`, chosen once in `app`.

/// A test-only crash point (see `crashpoint`); nothing at all in release builds.
#[macro_export]
macro_rules! crash_point {
    ($name:literal) => {
        #[cfg(debug_assertions)]
        $crate::crashpoint::hit($name, None);
    };
    ($name:literal, $group:expr) => {
        #[cfg(debug_assertions)]
        $crate::crashpoint::hit($name, Some($group));
    };
}

pub mod app;
pub mod audit;
pub mod check;
pub mod cli;
#[cfg(debug_assertions)]
pub mod crashpoint;
pub mod cycle;
pub mod dry;
pub mod escape;
pub mod forgejo;
pub mod holds;
pub mod launch;
pub mod metrics;
pub mod model;
pub mod planner;
pub mod process;
pub mod report;
pub mod secret;
pub mod signals;
pub mod state;
pub mod status;
pub mod sweep;
pub mod time;
pub mod tofu;
