//! What the integration tests share: the HTTP fake of Forgejo over the one model
//! (`forgejo-model/`), the harness that runs the built binary against it, and webhooks.
#![allow(dead_code)]
pub mod fake_forgejo;
pub mod harness;
pub mod tree;
pub mod webhook;
