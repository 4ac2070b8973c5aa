//! Secrets (the Forgejo token, runner tokens) in a type that never prints itself, and what a
//! token must look like.

use std::fmt;

use anyhow::{anyhow, bail};

/// The token file is read up to this many bytes (a token is 40 hex digits).
pub const MAX_TOKEN_FILE_BYTES: u64 = 64 * 1024;

/// `--token-file -`: the token comes on standard input.
pub const STDIN_PATH: &str = "-";

#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: String) -> Secret {
        Secret(s)
    }

    /// The secret itself, for the one place that must send it (a header, a child's stdin).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        // Best effort: overwrite the bytes before the allocation is freed.
        // SAFETY: zero bytes are valid UTF-8.
        unsafe { self.0.as_bytes_mut() }.fill(0);
    }
}

/// The token in `bytes` (`what` names where they came from): UTF-8, surrounding whitespace
/// dropped, not empty, one word. The bytes are zeroed on every path.
pub(crate) fn judge(bytes: Vec<u8>, what: &str) -> anyhow::Result<Secret> {
    let text = String::from_utf8(bytes).map_err(|e| {
        // Not shown: the bytes may be the token.
        let mut b = e.into_bytes();
        b.fill(0);
        anyhow!("{what} is not UTF-8 text")
    })?;
    let text = Secret::new(text);
    let token = text.expose().trim();
    if token.is_empty() {
        bail!("{what} is empty");
    }
    if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        bail!("{what} must hold only the token (one line, no spaces)");
    }
    Ok(Secret::new(token.to_string()))
}
