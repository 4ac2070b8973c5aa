//! Where the API is: `--forgejo-url` checked (https, no userinfo, no fragment; plain http only to
//! loopback), `--scope` and the routes it gives, and the version Forgejo reports.

use anyhow::{anyhow, bail};

/// `--scope`: which runner API the registrations live in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    Admin,
    User,
    Org(String),
    Repo(String, String),
}

impl Scope {
    pub fn parse(s: &str) -> anyhow::Result<Scope> {
        let segment_ok = |p: &str| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let parts: Vec<&str> = s.split('/').collect();
        let scope = match parts.as_slice() {
            ["admin"] => Scope::Admin,
            ["user"] => Scope::User,
            ["org", name] if segment_ok(name) => Scope::Org(name.to_string()),
            ["repo", owner, name] if segment_ok(owner) && segment_ok(name) => {
                Scope::Repo(owner.to_string(), name.to_string())
            }
            _ => {
                bail!("{s:?} is not a scope; use admin, user, org/NAME or repo/OWNER/NAME");
            }
        };
        Ok(scope)
    }

    /// The runners API path below `/api/v1/`.
    pub fn runners_path(&self) -> String {
        match self {
            Scope::Admin => "admin/actions/runners".into(),
            Scope::User => "user/actions/runners".into(),
            Scope::Org(n) => format!("orgs/{n}/actions/runners"),
            Scope::Repo(o, n) => format!("repos/{o}/{n}/actions/runners"),
        }
    }

    /// Why every route of this scope answered 404 with Forgejo's `ctx.NotFound(message)` (see
    /// `NotFound::NoScope`), and what to fix: the scope's organization, owner or repository is
    /// not there for this token. Registrations made in it are kept: nothing here says they are
    /// gone.
    pub(super) fn missing(&self, message: &str) -> String {
        match self {
            Scope::Org(n) => format!(
                "Forgejo says organization {n} does not exist (404 {message}): --scope {self} names no organization the token's user can see; if it was renamed or deleted, set --scope to the organization the pool's runners belong to"
            ),
            Scope::Repo(o, _) if message == "GetUserByName" => format!(
                "Forgejo says user or organization {o} does not exist (404 {message}): --scope {self} names no owner; if it was renamed or deleted, set --scope to the repository the pool's runners belong to"
            ),
            Scope::Repo(o, n) => format!(
                "Forgejo says repository {o}/{n} does not exist, is not visible to the token's user or has Actions disabled (404 {message}): check --scope {self} (renamed or deleted?) and the repository's Actions setting"
            ),
            Scope::Admin | Scope::User => format!(
                "Forgejo says the route of --scope {self} does not exist (404 {message}): Forgejo 15 or newer is required; check --forgejo-url"
            ),
        }
    }

    /// The token scope Forgejo asks for on writes, for error hints.
    pub fn write_scope(&self) -> &'static str {
        match self {
            Scope::Admin => "write:admin",
            Scope::User => "write:user",
            Scope::Org(_) => "write:organization",
            Scope::Repo(..) => "write:repository",
        }
    }
}

/// As `--scope` takes it: `org/acme`.
impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Admin => f.write_str("admin"),
            Scope::User => f.write_str("user"),
            Scope::Org(n) => write!(f, "org/{n}"),
            Scope::Repo(o, n) => write!(f, "repo/{o}/{n}"),
        }
    }
}

/// Checks `--forgejo-url`: https, or plain http only to a loopback host. Returns it without a
/// trailing slash.
pub fn validate_url(url: &str) -> anyhow::Result<String> {
    let trimmed = url.trim().trim_end_matches('/');
    // Checked before anything quotes the URL: it is copied into every error message.
    if let Some(at) = userinfo_end(trimmed) {
        let scheme_end = trimmed.find("://").map_or(0, |i| i + 3);
        bail!(
            "\"{}…@{}\" holds a user name or password; remove it (Forgejo is authenticated by the token in --token-file alone, and a URL is copied into every log line and report)",
            &trimmed[..scheme_end],
            &trimmed[at + 1..]
        );
    }
    if trimmed.contains('#') {
        bail!(
            "{url:?} must not have a #fragment; write the base URL only, like https://forgejo.example.org"
        );
    }
    let uri: ureq::http::Uri = trimmed
        .parse()
        .map_err(|e| anyhow!("{url:?} is not a URL: {e}"))?;
    let host = uri
        .host()
        .ok_or_else(|| anyhow!("{url:?} has no host; write it like https://forgejo.example.org"))?;
    if uri.query().is_some() {
        bail!("{url:?} must not have a query string");
    }
    // Every request adds /api/v1 itself: a URL that ends in it would ask /api/v1/api/v1/….
    let path = uri.path().trim_end_matches('/');
    if let Some(base) = ["/api/v1", "/api"].iter().find_map(|api| {
        path.to_ascii_lowercase()
            .ends_with(api)
            .then(|| &trimmed[..trimmed.len() - api.len()])
    }) {
        bail!(
            "{url:?} ends in the API's path; give Forgejo's base URL, {base:?}: every request adds /api/v1 itself"
        );
    }
    match uri.scheme_str() {
        Some("https") => Ok(trimmed.to_string()),
        Some("http") if is_loopback_host(host) => Ok(trimmed.to_string()),
        Some("http") => Err(anyhow!(
            "{url:?} uses plain http to a host that is not loopback; the token would cross the network in clear text. Use https://"
        )),
        _ => Err(anyhow!("{url:?} must start with https://")),
    }
}

/// Index of the `@` that ends a `user:password@` in the authority of `url`, if there is one.
pub(super) fn userinfo_end(url: &str) -> Option<usize> {
    let start = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[start..];
    let authority_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    rest[..authority_len].rfind('@').map(|i| start + i)
}

/// The major version of a Forgejo version string (`15.0.3+gitea-1.22.0` → 15).
pub fn major_version(version: &str) -> Option<u64> {
    let v = version.trim().trim_start_matches('v');
    let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
    if digits.is_empty()
        || !matches!(
            v[digits.len()..].chars().next(),
            None | Some('.' | '-' | '+')
        )
    {
        return None;
    }
    digits.parse().ok()
}

/// Whether `url` names a loopback host (this host alone can reach it).
pub fn is_loopback_url(url: &str) -> bool {
    url.parse::<ureq::http::Uri>()
        .ok()
        .and_then(|u| u.host().map(is_loopback_host))
        .unwrap_or(false)
}

pub(super) fn is_loopback_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    if h.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match h.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => false,
    }
}

/// Percent-encodes a query value, keeping `,` (Forgejo splits `labels` on it).
pub(super) fn encode_query_value(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b',') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
