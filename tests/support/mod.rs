#![allow(dead_code)]
pub mod fake_forgejo;
pub mod harness;
