//! What the integration tests share: the HTTP fake of Forgejo over the one model
//! (`forgejo-model/`) and the harness that runs the built binary against it.
#![allow(dead_code)]
pub mod fake_forgejo;
pub mod harness;
pub mod tree;
