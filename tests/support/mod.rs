#![allow(dead_code)]
pub mod fake_forgejo;
pub mod forgejo_model;
pub mod forgejo_rules;
pub mod harness;
