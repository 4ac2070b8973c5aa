#![allow(dead_code)]
pub mod fake_forgejo;
pub mod forgejo_model;
pub mod forgejo_rules;
pub mod harness;

/// The product's parsed job, for the model's `JobRow::listed`.
use ci_ephemeral_provisioner::core::forgejo::Job;
