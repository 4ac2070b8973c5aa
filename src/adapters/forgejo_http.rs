//! The Forgejo runner API (≥ 15) over HTTP (ureq): the `Forgejo` port for live runs, and the
//! checks of `--forgejo-url` and `--scope`.

use std::sync::Mutex;

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::core::forgejo::{Job, Runner, parse_jobs, parse_runner_page};
use crate::core::sweep::gate::Deletable;

use crate::core::ports::{ApiError, Deleted, Forgejo, NewRunner, RunnerPage};

use crate::core::secret::Secret;

mod target;
use target::encode_query_value;
pub use target::{Scope, is_loopback_url, major_version, validate_url};

pub const MAX_BODY_BYTES: u64 = 4 * 1024 * 1024;

/// ureq's buffers per connection, smaller than its defaults (128 KiB each, zero-filled on every
/// connect; BENCHMARKS.md has the cost). Bodies stream through them; the input buffer bounds the
/// response head, which Forgejo keeps to a few KiB.
const INPUT_BUFFER: usize = 32 * 1024;

const OUTPUT_BUFFER: usize = 16 * 1024;

/// How long a resolved Forgejo address is reused before the name is looked up again.
const RESOLVE_TTL: Duration = Duration::from_secs(60);

/// Resolves each `scheme://host:port` once per [`RESOLVE_TTL`] instead of once per request.
///
/// ureq looks the host up before every request, even one that goes out on a pooled keep-alive
/// connection, and with a timeout set it does so on a new thread (musl's resolver has no cache:
/// one DNS query per request; BENCHMARKS.md has the numbers). Failures are not cached.
#[derive(Debug)]
struct CachingResolver<R> {
    inner: R,
    cache: Mutex<
        Vec<(
            String,
            Instant,
            ureq::unversioned::resolver::ResolvedSocketAddrs,
        )>,
    >,
}

impl<R> CachingResolver<R> {
    fn new(inner: R) -> CachingResolver<R> {
        CachingResolver {
            inner,
            cache: Mutex::new(Vec::new()),
        }
    }
}

impl<R: ureq::unversioned::resolver::Resolver> ureq::unversioned::resolver::Resolver
    for CachingResolver<R>
{
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: ureq::unversioned::transport::NextTimeout,
    ) -> Result<ureq::unversioned::resolver::ResolvedSocketAddrs, ureq::Error> {
        let key = format!(
            "{}://{}",
            uri.scheme_str().unwrap_or(""),
            uri.authority().map(|a| a.as_str()).unwrap_or("")
        );
        let now = Instant::now();
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.retain(|(_, at, _)| now.duration_since(*at) < RESOLVE_TTL);
        if let Some((_, _, addrs)) = cache.iter().find(|(k, _, _)| *k == key) {
            return Ok(addrs.clone());
        }
        let addrs = self.inner.resolve(uri, config, timeout)?;
        cache.push((key, now, addrs.clone()));
        Ok(addrs)
    }
}

pub struct HttpForgejo {
    agent: ureq::Agent,
    base_url: String,
    runners_url: String,
    scope: Scope,
    auth: Secret,
    labels_query: String,
    label_names: Vec<String>,
    /// Requests sent, for the report and benchmarks.
    pub requests: u64,
}

impl HttpForgejo {
    pub fn new(
        base_url: &str,
        scope: Scope,
        token: &Secret,
        label_names: &[String],
        timeout: Duration,
        ca: Option<&[ureq::tls::Certificate<'static>]>,
    ) -> HttpForgejo {
        HttpForgejo::with_resolver(
            base_url,
            scope,
            token,
            label_names,
            timeout,
            ca,
            CachingResolver::new(ureq::unversioned::resolver::DefaultResolver::default()),
        )
    }

    fn with_resolver(
        base_url: &str,
        scope: Scope,
        token: &Secret,
        label_names: &[String],
        timeout: Duration,
        ca: Option<&[ureq::tls::Certificate<'static>]>,
        resolver: impl ureq::unversioned::resolver::Resolver,
    ) -> HttpForgejo {
        let mut tls = ureq::tls::TlsConfig::builder();
        if let Some(certs) = ca {
            tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(certs));
        }
        let mut config = ureq::Agent::config_builder();
        if is_loopback_url(base_url) {
            // A proxy from *_PROXY would carry the token off this host, even in clear text for
            // http:// (which is allowed only because loopback never leaves the host).
            config = config.proxy(None);
        }
        let config = config
            .tls_config(tls.build())
            .timeout_global(Some(timeout))
            .timeout_connect(Some(timeout.min(Duration::from_secs(10))))
            .http_status_as_error(false)
            .max_redirects(0)
            .input_buffer_size(INPUT_BUFFER)
            .max_response_header_size(INPUT_BUFFER)
            .output_buffer_size(OUTPUT_BUFFER)
            .user_agent(concat!(
                "ci-ephemeral-provisioner/",
                env!("CARGO_PKG_VERSION")
            ))
            .build();
        let agent = ureq::Agent::with_parts(
            config,
            ureq::unversioned::transport::DefaultConnector::default(),
            resolver,
        );
        HttpForgejo {
            agent,
            base_url: base_url.to_string(),
            runners_url: format!("{base_url}/api/v1/{}", scope.runners_path()),
            scope,
            auth: Secret::new(format!("token {}", token.expose())),
            labels_query: encode_query_value(&label_names.join(",")),
            label_names: label_names.to_vec(),
            requests: 0,
        }
    }

    fn send(
        &mut self,
        method: &str,
        url: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Option<u64>, String), ApiError> {
        self.requests += 1;
        let request = format!("{method} {url}");
        let err = |detail: String| ApiError {
            status: None,
            request: request.clone(),
            detail,
        };
        let auth = self.auth.expose();
        let result = match (method, body) {
            ("GET", _) => self
                .agent
                .get(url)
                .header("Authorization", auth)
                .header("Accept", "application/json")
                .call(),
            ("DELETE", _) => self
                .agent
                .delete(url)
                .header("Authorization", auth)
                .header("Accept", "application/json")
                .call(),
            ("POST", Some(b)) => self
                .agent
                .post(url)
                .header("Authorization", auth)
                .header("Accept", "application/json")
                .send_json(b),
            _ => return Err(err("internal error: unsupported request".into())),
        };
        let mut resp = result.map_err(|e| err(transport_hint(&e)))?;
        let status = resp.status().as_u16();
        let total = resp
            .headers()
            .get("x-total-count")
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.trim().parse::<u64>().ok());
        let location = resp
            .headers()
            .get("location")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let text = resp
            .body_mut()
            .with_config()
            .limit(MAX_BODY_BYTES)
            .read_to_string()
            .map_err(|e| {
                err(format!(
                    "reading the response body failed: {}",
                    body_hint(&e)
                ))
            })?;
        if (300..400).contains(&status) {
            let to = location.as_deref().unwrap_or("(no Location)");
            // A renamed organization, user or repository: Forgejo sends its old name's requests
            // to the new one (routers/api/v1/api.go `orgAssignment`, `repoAssignment`:
            // `RedirectToUser`, `RedirectToRepo`, 307), to a path of its own API.
            let moved = to.starts_with('/') || to.starts_with(&self.base_url);
            return Err(err(if moved && to.contains("/api/v1/") {
                format!(
                    "HTTP {status} redirect to {to}: Forgejo knows what --scope names ({}) by another name now (renamed?); set --scope to its new name",
                    self.scope
                )
            } else {
                format!(
                    "HTTP {status} redirect to {to}; set --forgejo-url to the address Forgejo really answers on"
                )
            }));
        }
        Ok((status, total, text))
    }

    /// `GET /api/v1/version`: the version string Forgejo reports, e.g. `15.0.3+gitea-1.22.0`.
    pub fn version(&mut self) -> Result<String, ApiError> {
        let url = format!("{}/api/v1/version", self.base_url);
        let (status, _, body) = self.send("GET", &url, None)?;
        if status != 200 {
            return Err(self.status_error(format!("GET {url}"), status, &body));
        }
        serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v.get("version")?.as_str().map(str::to_string))
            .ok_or_else(|| ApiError {
                status: None,
                request: format!("GET {url}"),
                detail: format!(
                    "the answer has no \"version\" string: {}; is --forgejo-url the address of Forgejo?",
                    snippet(&body)
                ),
            })
    }

    fn status_error(&self, request: String, status: u16, body: &str) -> ApiError {
        if let Some(e) = self.no_scope(&request, status, body) {
            return e;
        }
        let message = first_message(body).unwrap_or_else(|| snippet(body));
        self.status_error_saying(request, status, message)
    }

    /// A 404 of the route itself, not of a runner: the scope's organization, user or repository
    /// is not there (for this token). Its error names the scope and what to fix.
    fn no_scope(&self, request: &str, status: u16, body: &str) -> Option<ApiError> {
        match (status, not_found(body, None)) {
            (404, NotFound::NoScope(message)) => Some(ApiError {
                status: Some(404),
                request: request.to_string(),
                detail: self.scope.missing(&message),
            }),
            _ => None,
        }
    }

    /// [`Self::status_error`] with the message already chosen.
    fn status_error_saying(&self, request: String, status: u16, message: String) -> ApiError {
        let hint = match status {
            401 => " (is the token in --token-file valid?)".to_string(),
            403 => format!(
                " (the token needs the {} scope, and admin scope needs a site administrator)",
                self.scope.write_scope()
            ),
            404 => " (Forgejo ≥ 15 is required; check --scope and --forgejo-url)".to_string(),
            _ => String::new(),
        };
        ApiError {
            status: Some(status),
            request,
            detail: format!("HTTP {status}: {message}{hint}"),
        }
    }
}

/// Reads the CA certificates of `--ca-file` (PEM, one or more certificates).
pub fn load_ca_file(
    path: &std::path::Path,
) -> anyhow::Result<Vec<ureq::tls::Certificate<'static>>> {
    let pem =
        std::fs::read(path).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    let mut certs = Vec::new();
    for item in ureq::tls::parse_pem(&pem) {
        match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => certs.push(c),
            Ok(_) => {}
            Err(e) => anyhow::bail!("{} is not valid PEM: {e}", path.display()),
        }
    }
    if certs.is_empty() {
        anyhow::bail!("{} holds no PEM certificate", path.display());
    }
    Ok(certs)
}

fn transport_hint(e: &ureq::Error) -> String {
    let text = e.to_string();
    // rustls reads a plain-http answer as a TLS record of an unknown type.
    if text.contains("InvalidContentType") || text.contains("corrupt message") {
        return format!(
            "TLS failed: {text}: the server did not answer with TLS; is this a plain-http port? Put Forgejo's https address in --forgejo-url (http:// is allowed only to loopback)"
        );
    }
    match e {
        ureq::Error::Timeout(t) => {
            format!("timed out ({t}); check that Forgejo is reachable or raise --http-timeout")
        }
        ureq::Error::Tls(_) | ureq::Error::Rustls(_) => {
            format!("TLS failed: {e}; for a private CA pass its certificate with --ca-file")
        }
        // rustls reports certificate problems through the I/O layer.
        other if text.to_ascii_lowercase().contains("certificate") => {
            format!("TLS failed: {other}; for a private CA pass its certificate with --ca-file")
        }
        other if text.contains("Connection refused") => format!(
            "request failed: {other}; is Forgejo listening at the host and port of --forgejo-url?"
        ),
        // getaddrinfo's words (glibc, musl) for a name that does not resolve, or no DNS at all.
        other
            if [
                "failed to lookup address",
                "Name or service not known",
                "name resolution",
            ]
            .iter()
            .any(|w| text.contains(w)) =>
        {
            format!(
                "request failed: {other}; the host name of --forgejo-url does not resolve: is it spelt right, and does this host's DNS know it?"
            )
        }
        other => format!("request failed: {other}"),
    }
}

fn body_hint(e: &ureq::Error) -> String {
    match e {
        ureq::Error::BodyExceedsLimit(_) => format!(
            "it is larger than {MAX_BODY_BYTES} bytes, more than any answer of this API; a proxy or a misbehaving server?"
        ),
        other => transport_hint(other),
    }
}

/// What one of Forgejo's 404s says (v15.0.3). Only [`NotFound::Gone`] proves a runner gone.
#[derive(Debug, PartialEq, Eq)]
enum NotFound {
    /// `GetRunnerNotFound` / `DeleteRunnerNotFound` (routers/api/v1/shared/runners.go): an
    /// `APIError` (`message`, `url`) whose message is the error of `GetVisibleRunnerByID`
    /// (models/actions/runner.go) for exactly this id: `runner with ID <id>: resource does not
    /// exist`. Forgejo gives it only once the route's scope was found.
    Gone,
    /// `ctx.NotFound(…)` (services/context/api.go: an `APINotFound`, which alone has `errors`)
    /// before the handler ran: the route's assignment found no organization (`orgAssignment`:
    /// "GetOrgByName"), no owner (`repoAssignment`: "GetUserByName") or no repository, or
    /// Actions are off there (`reqOwner(unit.TypeActions)`; routers/api/v1/api.go). It says
    /// nothing about any runner. The message.
    NoScope(String),
    /// Another error of Forgejo's: "No permission to delete this runner" (a 404 for a runner
    /// that exists), or a runner-not-found for another id. The message.
    Other(String),
    /// Not Forgejo's error body: a proxy's or gateway's 404 proves nothing.
    NotForgejo,
}

/// Reads a 404's body; `id`: the runner the request named, if any.
fn not_found(body: &str, id: Option<i64>) -> NotFound {
    let Ok(Value::Object(v)) = serde_json::from_str::<Value>(body) else {
        return NotFound::NotForgejo;
    };
    let (Some(message), Some(_)) = (
        v.get("message").and_then(Value::as_str),
        v.get("url").and_then(Value::as_str),
    ) else {
        return NotFound::NotForgejo;
    };
    if v.get("errors").is_some_and(Value::is_array) {
        return NotFound::NoScope(message.to_string());
    }
    match id {
        Some(id) if message == format!("runner with ID {id}: resource does not exist") => {
            NotFound::Gone
        }
        _ => NotFound::Other(message.to_string()),
    }
}

fn not_forgejo_404(request: String, body: &str) -> ApiError {
    ApiError {
        status: None,
        request,
        detail: format!(
            "HTTP 404 without Forgejo's JSON error body ({}); not taken as \"gone\" (a proxy in the way, or the wrong --forgejo-url?)",
            snippet(body)
        ),
    }
}

/// The `message` of Forgejo's error body: of the first JSON value in it (on some errors
/// Forgejo writes a second one after it, e.g. RegisterRunner's answer after a failed insert).
fn first_message(body: &str) -> Option<String> {
    let first = serde_json::Deserializer::from_str(body)
        .into_iter::<Value>()
        .next()?
        .ok()?;
    first.get("message")?.as_str().map(str::to_string)
}

fn snippet(body: &str) -> String {
    let one_line: String = body.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.is_empty() {
        return "(empty body)".into();
    }
    let mut end = one_line.len().min(160);
    while !one_line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}", &one_line[..end])
}

impl Forgejo for HttpForgejo {
    fn list_jobs(&mut self) -> Result<Vec<Job>, ApiError> {
        let url = format!("{}/jobs?labels={}", self.runners_url, self.labels_query);
        let (status, _, body) = self.send("GET", &url, None)?;
        if status != 200 {
            return Err(self.status_error(format!("GET {url}"), status, &body));
        }
        let jobs = parse_jobs(&body)
            .map_err(|e| ApiError::unusable(format!("GET {url}"), format!("{e:#}")))?;
        // Forgejo filters by labels already; filter again so an older server's answer cannot
        // hand us jobs we cannot run.
        Ok(jobs
            .into_iter()
            .filter(|j| crate::core::forgejo::job_matches(j, &self.label_names))
            .collect())
    }

    fn get_runner(&mut self, id: i64) -> Result<Option<Runner>, ApiError> {
        let url = format!("{}/{id}", self.runners_url);
        let (status, _, body) = self.send("GET", &url, None)?;
        match status {
            200 => {
                let unusable = |detail: String| ApiError::unusable(format!("GET {url}"), detail);
                let v: Value = serde_json::from_str(&body).map_err(|e| {
                    unusable(format!("response is not JSON: {e}: {}", snippet(&body)))
                })?;
                let r =
                    Runner::from_json_with_labels(&v).map_err(|e| unusable(format!("{e:#}")))?;
                if r.id != id {
                    return Err(unusable(format!(
                        "Forgejo answered with runner {} instead of {id}",
                        r.id
                    )));
                }
                Ok(Some(r))
            }
            404 => match not_found(&body, Some(id)) {
                NotFound::Gone => Ok(None),
                NotFound::NotForgejo => Err(not_forgejo_404(format!("GET {url}"), &body)),
                NotFound::NoScope(_) | NotFound::Other(_) => {
                    Err(self.status_error(format!("GET {url}"), status, &body))
                }
            },
            _ => Err(self.status_error(format!("GET {url}"), status, &body)),
        }
    }

    fn delete_runner(&mut self, target: &Deletable, reason: &str) -> Result<Deleted, ApiError> {
        let url = format!("{}/{}", self.runners_url, target.id());
        log::debug!("DELETE {url} ({reason})");
        let (status, _, body) = self.send("DELETE", &url, None)?;
        match status {
            // Forgejo answers 204 and nothing else on success: any other 2xx (a proxy's page,
            // say) proves nothing, and the registration must not be forgotten on it.
            204 => Ok(Deleted::Now),
            404 => match not_found(&body, Some(target.id())) {
                NotFound::Gone => Ok(Deleted::AlreadyGone),
                NotFound::NotForgejo => Err(not_forgejo_404(format!("DELETE {url}"), &body)),
                NotFound::NoScope(_) | NotFound::Other(_) => {
                    Err(self.status_error(format!("DELETE {url}"), status, &body))
                }
            },
            _ => Err(self.status_error(format!("DELETE {url}"), status, &body)),
        }
    }

    fn register_runner(&mut self, name: &str) -> Result<NewRunner, ApiError> {
        let url = self.runners_url.clone();
        let body = json!({
            "name": name,
            "description": "ephemeral runner registered by ci-ephemeral-provisioner",
            "ephemeral": true,
        });
        let (status, _, text) = self.send("POST", &url, Some(&body))?;
        let request = format!("POST {url}");
        if let Some(e) = self.no_scope(&request, status, &text) {
            return Err(e);
        }
        if status != 201 && status != 200 {
            // Never a piece of the body: when its insert fails, Forgejo writes its error and
            // then the answer it would have given, runner token and all
            // (routers/api/v1/shared/runners.go RegisterRunner: ctx.Error without a return).
            let message = first_message(&text).unwrap_or_else(|| {
                "(the body is not shown: it may hold a runner token)".to_string()
            });
            return Err(self.status_error_saying(request, status, message));
        }
        // The body holds the runner token: never put it in an error message.
        let v: Value = serde_json::from_str(&text).map_err(|_| ApiError {
            status: None,
            request: request.clone(),
            detail: "response is not JSON".into(),
        })?;
        let id = v.get("id").and_then(Value::as_i64);
        let uuid = v.get("uuid").and_then(Value::as_str);
        let token = v.get("token").and_then(Value::as_str);
        match (id, uuid, token) {
            (Some(id), Some(uuid), Some(token)) if !token.is_empty() => Ok(NewRunner {
                id,
                uuid: uuid.to_string(),
                token: Secret::new(token.to_string()),
            }),
            _ => Err(ApiError {
                status: None,
                request,
                detail: "response lacks id, uuid or token".into(),
            }),
        }
    }

    fn list_runners_page(&mut self, page: u32, limit: u32) -> Result<RunnerPage, ApiError> {
        let url = format!("{}?page={page}&limit={limit}", self.runners_url);
        let (status, total, body) = self.send("GET", &url, None)?;
        if status != 200 {
            return Err(self.status_error(format!("GET {url}"), status, &body));
        }
        let rows = parse_runner_page(&body)
            .map_err(|e| ApiError::unusable(format!("GET {url}"), format!("{e:#}")))?;
        Ok(RunnerPage { rows, total })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    #[test]
    fn plain_http_only_to_loopback() {
        assert!(validate_url("http://127.0.0.1:3000/").is_ok());
        assert!(validate_url("http://127.8.9.1").is_ok());
        assert!(validate_url("http://localhost:3000").is_ok());
        assert!(validate_url("http://[::1]:3000").is_ok());
        assert!(validate_url("https://forgejo.example.org/sub").is_ok());
        assert_eq!(
            validate_url("https://forgejo.example.org/").unwrap(),
            "https://forgejo.example.org"
        );
        assert!(validate_url("http://forgejo.example.org").is_err());
        assert!(validate_url("http://10.0.0.1").is_err());
        assert!(validate_url("http://localhost.evil.example").is_err());
        assert!(validate_url("ftp://forgejo.example.org").is_err());
        assert!(validate_url("forgejo.example.org").is_err());
    }

    #[test]
    fn urls_with_credentials_or_fragments_are_refused_without_echoing_the_password() {
        for url in [
            "https://admin:hunter2@forgejo.example.org",
            "https://hunter2@forgejo.example.org/sub",
            "http://u:hunter2@127.0.0.1:3000",
        ] {
            let e = validate_url(url).unwrap_err().to_string();
            assert!(e.contains("user name or password"), "{url}: {e}");
            assert!(
                !e.contains("hunter2"),
                "{url}: the error repeats the secret: {e}"
            );
        }
        let e = validate_url("https://forgejo.example.org/#frag")
            .unwrap_err()
            .to_string();
        assert!(e.contains("#fragment"), "{e}");
        // An `@` in the path is not userinfo.
        assert!(validate_url("https://forgejo.example.org/@sub").is_ok());
    }

    // Mutation caught (#32, point 6): a base URL ending in /api/v1 accepted, every request then
    // going to /api/v1/api/v1/….
    #[test]
    fn a_url_that_ends_in_the_api_path_is_refused_with_the_base_url() {
        for (url, base) in [
            (
                "https://forgejo.example.org/api/v1",
                "https://forgejo.example.org",
            ),
            (
                "https://forgejo.example.org/api/v1/",
                "https://forgejo.example.org",
            ),
            (
                "https://example.org/forgejo/API/V1",
                "https://example.org/forgejo",
            ),
            ("http://127.0.0.1:3000/api", "http://127.0.0.1:3000"),
        ] {
            let e = validate_url(url).unwrap_err().to_string();
            assert!(
                e.contains("ends in the API's path") && e.contains(&format!("{base:?}")),
                "{url}: {e}"
            );
        }
        // A Forgejo under a sub-path is fine, an "api" inside a name too.
        assert!(validate_url("https://example.org/forgejo").is_ok());
        assert!(validate_url("https://example.org/api-docs/forgejo").is_ok());
        assert!(validate_url("https://api.example.org").is_ok());
    }

    #[test]
    fn forgejo_major_versions() {
        assert_eq!(major_version("15.0.3+gitea-1.22.0"), Some(15));
        assert_eq!(major_version("v16.1.0"), Some(16));
        assert_eq!(major_version("15.0.0-dev-12-abcdef+gitea-1.22.0"), Some(15));
        assert_eq!(major_version("14"), Some(14));
        assert_eq!(major_version("1.22.0"), Some(1));
        assert_eq!(major_version("development"), None);
        assert_eq!(major_version("15a.1"), None);
        assert_eq!(major_version(""), None);
    }

    #[test]
    fn scopes_map_to_paths() {
        assert_eq!(
            Scope::parse("admin").unwrap().runners_path(),
            "admin/actions/runners"
        );
        assert_eq!(
            Scope::parse("user").unwrap().runners_path(),
            "user/actions/runners"
        );
        assert_eq!(
            Scope::parse("org/acme").unwrap().runners_path(),
            "orgs/acme/actions/runners"
        );
        assert_eq!(
            Scope::parse("repo/acme/app").unwrap().runners_path(),
            "repos/acme/app/actions/runners"
        );
        for bad in [
            "",
            "org",
            "org/",
            "repo/acme",
            "org/a/b",
            "repo/a/b?x",
            "site",
        ] {
            assert!(Scope::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_forgejos_runner_not_found_for_that_id_means_gone() {
        let url = r#""url": "https://f.example/api/swagger""#;
        let body = |message: &str| format!(r#"{{"message": "{message}", {url}}}"#);
        let gone = body("runner with ID 5: resource does not exist");
        assert_eq!(not_found(&gone, Some(5)), NotFound::Gone);
        // Another id's answer, or no id at all, proves nothing about this one.
        assert!(matches!(not_found(&gone, Some(55)), NotFound::Other(_)));
        assert!(matches!(not_found(&gone, None), NotFound::Other(_)));
        assert!(matches!(
            not_found(&body("No permission to delete this runner"), Some(5)),
            NotFound::Other(_)
        ));
        // The scope's assignment (ctx.NotFound): an unknown organization, owner or repository.
        for (b, message) in [
            (
                format!(
                    r#"{{"message": "GetOrgByName", {url}, "errors": ["user redirect does not exist [name: acme]"]}}"#
                ),
                "GetOrgByName",
            ),
            (
                format!(r#"{{"message": "The target couldn't be found.", {url}, "errors": []}}"#),
                "The target couldn't be found.",
            ),
        ] {
            assert_eq!(not_found(&b, Some(5)), NotFound::NoScope(message.into()));
        }
        // A gateway's JSON 404 (Kong's, say), a web server's page: not Forgejo's.
        for b in [
            r#"{"message":"no Route matched with those values"}"#,
            "<html><body>404 Not Found</body></html>",
            "",
            r#"{"error":"not found"}"#,
            r#"{"message": 404, "url": "x"}"#,
            "404 page not found",
        ] {
            assert_eq!(not_found(b, Some(5)), NotFound::NotForgejo, "{b}");
        }
    }

    #[test]
    fn a_missing_scope_is_named_with_what_to_fix() {
        let org = Scope::parse("org/acme").unwrap().missing("GetOrgByName");
        assert!(
            org.starts_with("Forgejo says organization acme does not exist (404 GetOrgByName)"),
            "{org}"
        );
        assert!(org.contains("--scope org/acme"), "{org}");
        let owner = Scope::parse("repo/acme/app")
            .unwrap()
            .missing("GetUserByName");
        assert!(owner.contains("acme does not exist"), "{owner}");
        let repo = Scope::parse("repo/acme/app")
            .unwrap()
            .missing("The target couldn't be found.");
        assert!(
            repo.contains("repository acme/app does not exist") && repo.contains("Actions"),
            "{repo}"
        );
    }

    /// A loopback HTTP/1.1 server answering every request `[]` on keep-alive connections; counts
    /// the TCP connections it accepted and the requests it answered.
    fn counting_server(body: String) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let conns = Arc::new(AtomicUsize::new(0));
        let reqs = Arc::new(AtomicUsize::new(0));
        let (c, r) = (Arc::clone(&conns), Arc::clone(&reqs));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                c.fetch_add(1, SeqCst);
                let r = Arc::clone(&r);
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Total-Count: 0\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                std::thread::spawn(move || {
                    let mut out = stream.try_clone().unwrap();
                    let mut rd = BufReader::new(stream);
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if rd.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line != "\r\n" {
                            continue;
                        }
                        r.fetch_add(1, SeqCst);
                        if out.write_all(answer.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (url, conns, reqs)
    }

    /// Resolves as ureq does, counting the lookups.
    #[derive(Debug)]
    struct CountingResolver(Arc<AtomicUsize>);

    impl ureq::unversioned::resolver::Resolver for CountingResolver {
        fn resolve(
            &self,
            uri: &ureq::http::Uri,
            config: &ureq::config::Config,
            timeout: ureq::unversioned::transport::NextTimeout,
        ) -> Result<ureq::unversioned::resolver::ResolvedSocketAddrs, ureq::Error> {
            self.0.fetch_add(1, SeqCst);
            ureq::unversioned::resolver::DefaultResolver::default().resolve(uri, config, timeout)
        }
    }

    #[test]
    fn requests_share_one_keep_alive_connection_and_one_lookup() {
        let (url, conns, reqs) = counting_server("[]".into());
        let lookups = Arc::new(AtomicUsize::new(0));
        let mut f = HttpForgejo::with_resolver(
            &url,
            Scope::Admin,
            &Secret::new("t".into()),
            &["debian".to_string()],
            Duration::from_secs(10),
            None,
            CachingResolver::new(CountingResolver(Arc::clone(&lookups))),
        );
        for page in 1..=3 {
            f.list_runners_page(page, 50).unwrap();
        }
        f.list_jobs().unwrap();
        f.list_jobs().unwrap();
        assert_eq!(reqs.load(SeqCst), 5);
        assert_eq!(f.requests, 5);
        assert_eq!(conns.load(SeqCst), 1, "every request on one connection");
        assert_eq!(lookups.load(SeqCst), 1, "the host is looked up once");
    }

    #[test]
    fn a_body_larger_than_the_buffers_is_read_whole() {
        let job = |id: usize| {
            format!(
                r#"{{"id":{id},"handle":"h-{id}","status":"waiting","runs_on":["debian"],"name":"{}"}}"#,
                "x".repeat(200)
            )
        };
        let jobs: Vec<String> = (1..=1000).map(job).collect();
        let body = format!("[{}]", jobs.join(","));
        assert!(body.len() > 4 * (INPUT_BUFFER + OUTPUT_BUFFER));
        let (url, _, _) = counting_server(body);
        let mut f = HttpForgejo::new(
            &url,
            Scope::Admin,
            &Secret::new("t".into()),
            &["debian".to_string()],
            Duration::from_secs(10),
            None,
        );
        let jobs = f.list_jobs().unwrap();
        assert_eq!(jobs.len(), 1000);
        assert_eq!(jobs[999].handle, "h-1000");
    }

    #[test]
    fn label_query_is_encoded() {
        assert_eq!(encode_query_value("debian,docker"), "debian,docker");
        assert_eq!(encode_query_value("a b&c"), "a%20b%26c");
    }
}
