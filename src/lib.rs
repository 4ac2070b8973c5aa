//! ci-ephemeral-provisioner: one provisioner cycle of VM-isolated, ephemeral Forgejo Actions
//! runners per start. The decisions live in `planner` and `sweep::select` (pure); everything
//! that touches the world sits behind the traits in `forgejo`, `tofu`, `launch`, `state` and
//! `cycle::Clock`, chosen once in `app`.

pub mod app;
pub mod audit;
pub mod cli;
pub mod cycle;
pub mod dry;
pub mod forgejo;
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
