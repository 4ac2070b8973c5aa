//! The connection to PostgreSQL: `PG_CONN_STR` (the variable OpenTofu's pg backend reads) parsed
//! as lib/pq reads it, TLS through rustls (ring) with `sslmode` `disable`, `require` (encrypted,
//! not verified: lib/pq's default), `verify-ca` or `verify-full` and `sslrootcert`; the session's
//! timeouts in the startup packet (no query). The password never leaves this module: messages
//! name the database as `user@host:port/db`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use crate::core::secret::Secret;

/// The environment variable of the connection string (shared with tofu's pg backend).
pub const PG_CONN_STR: &str = "PG_CONN_STR";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    /// Encrypted, the server's certificate not verified (lib/pq's default).
    Require,
    /// Verified against `sslrootcert`, whatever name it is for.
    VerifyCa,
    /// Verified against `sslrootcert`, and for the host connected to.
    VerifyFull,
}

/// A parsed `PG_CONN_STR`.
pub struct ConnSpec {
    /// The URL without `sslmode` and `sslrootcert`, for the client (holds the password).
    url: Secret,
    pub ssl: SslMode,
    pub root_cert: Option<std::path::PathBuf>,
    /// `user@host:port/db`: how messages name the database.
    pub shown: String,
    /// The password, to scrub from any text the client's errors hold.
    password: Option<Secret>,
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl ConnSpec {
    /// Parses a `postgres://` (or `postgresql://`) URL. Never quotes the string in an error.
    pub fn parse(s: &str) -> Result<ConnSpec> {
        let rest = s
            .strip_prefix("postgres://")
            .or_else(|| s.strip_prefix("postgresql://"))
            .ok_or_else(|| {
                anyhow!(
                    "{PG_CONN_STR} is not a postgres:// URL (the key=value form is not read here; write it as postgres://USER:PASSWORD@HOST:PORT/DATABASE?sslmode=verify-full&sslrootcert=/path/ca.pem)"
                )
            })?;
        let (base, query) = match rest.split_once('?') {
            Some((b, q)) => (b, q),
            None => (rest, ""),
        };
        let (auth, hostpart) = match base.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, base),
        };
        let (user, password) = match auth {
            Some(a) => match a.split_once(':') {
                Some((u, p)) => (percent_decode(u), Some(percent_decode(p))),
                None => (percent_decode(a), None),
            },
            None => (String::new(), None),
        };
        let (hostport, db) = hostpart.split_once('/').unwrap_or((hostpart, ""));
        let mut ssl = SslMode::Require;
        let mut root_cert = None;
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "sslmode" => {
                    ssl = match percent_decode(v).as_str() {
                        "disable" => SslMode::Disable,
                        "require" => SslMode::Require,
                        "verify-ca" => SslMode::VerifyCa,
                        "verify-full" => SslMode::VerifyFull,
                        other => bail!(
                            "{PG_CONN_STR}: sslmode={other} is not one this tool speaks: disable, require, verify-ca or verify-full (as OpenTofu's pg backend reads it)"
                        ),
                    }
                }
                "sslrootcert" => root_cert = Some(std::path::PathBuf::from(percent_decode(v))),
                _ => kept.push(pair.to_string()),
            }
        }
        if matches!(ssl, SslMode::VerifyCa | SslMode::VerifyFull) && root_cert.is_none() {
            bail!(
                "{PG_CONN_STR}: sslmode=verify-ca and verify-full need sslrootcert=PATH (the CA certificates that signed the server's, PEM)"
            );
        }
        let mut url = format!("postgres://{base}");
        if !kept.is_empty() {
            url.push('?');
            url.push_str(&kept.join("&"));
        }
        let db = percent_decode(db);
        let shown = format!(
            "{}{hostport}/{db}",
            if user.is_empty() {
                String::new()
            } else {
                format!("{user}@")
            }
        );
        Ok(ConnSpec {
            url: Secret::new(url),
            ssl,
            root_cert,
            shown,
            password: password.filter(|p| !p.is_empty()).map(Secret::new),
        })
    }

    /// Reads `PG_CONN_STR` from the environment.
    pub fn from_env() -> Result<ConnSpec> {
        let s = std::env::var(PG_CONN_STR).map_err(|_| {
            anyhow!(
                "--store pg needs {PG_CONN_STR} in the environment (a postgres:// URL; under the role, in the pool's secret_environment), the variable OpenTofu's pg backend reads too"
            )
        })?;
        ConnSpec::parse(&s)
    }

    /// `text` without the password (any error text of the client).
    pub fn scrub(&self, text: &str) -> String {
        match &self.password {
            Some(p) if !p.expose().is_empty() => text.replace(p.expose(), "***"),
            _ => text.to_string(),
        }
    }

    /// Opens a session: TLS as `sslmode` says, `application_name`, the statement and idle
    /// timeouts, TCP keepalives. `statement_timeout` bounds every statement; an open transaction
    /// idle longer than `idle_in_transaction` is ended by the server.
    pub fn connect(&self, app: &str, statement_timeout: Duration) -> Result<postgres::Client> {
        let mut config = self.url.expose().parse::<postgres::Config>().map_err(|e| {
            anyhow!(
                "{PG_CONN_STR} cannot be read as a connection string: {}",
                self.scrub(&e.to_string())
            )
        })?;
        config
            .application_name(app)
            .connect_timeout(Duration::from_secs(10))
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(15))
            .options(&format!(
                "-c statement_timeout={} -c idle_in_transaction_session_timeout={} -c lock_timeout={}",
                statement_timeout.as_millis(),
                statement_timeout.as_millis() * 2,
                statement_timeout.as_millis()
            ));
        let result = match self.ssl {
            SslMode::Disable => {
                config.ssl_mode(postgres::config::SslMode::Disable);
                config.connect(postgres::NoTls)
            }
            mode => {
                config.ssl_mode(postgres::config::SslMode::Require);
                let tls = tokio_postgres_rustls::MakeRustlsConnect::new(self.tls_config(mode)?);
                config.connect(tls)
            }
        };
        result.map_err(|e| {
            anyhow!(
                "cannot connect to PostgreSQL {}: {}",
                self.shown,
                self.scrub(&format!("{e:#}"))
            )
        })
    }

    fn tls_config(&self, mode: SslMode) -> Result<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("rustls refused its default protocol versions")?;
        let config = match (mode, &self.root_cert) {
            (SslMode::Require, _) => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(verify::Unverified(provider)))
                .with_no_client_auth(),
            (_, Some(path)) => {
                let roots = verify::roots(path)?;
                if mode == SslMode::VerifyFull {
                    builder.with_root_certificates(roots).with_no_client_auth()
                } else {
                    let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
                        Arc::new(roots),
                        provider,
                    )
                    .build()
                    .context("cannot build the certificate verifier")?;
                    builder
                        .dangerous()
                        .with_custom_certificate_verifier(Arc::new(verify::AnyName(inner)))
                        .with_no_client_auth()
                }
            }
            (_, None) => bail!("{PG_CONN_STR}: sslrootcert is missing"),
        };
        Ok(config)
    }
}

mod verify {
    //! The two verifiers lib/pq's modes need beside rustls' own (`verify-full`).
    use std::sync::Arc;

    use anyhow::{Result, anyhow};
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{DigitallySignedStruct, SignatureScheme};

    /// The CA certificates of `sslrootcert`.
    pub fn roots(path: &std::path::Path) -> Result<rustls::RootCertStore> {
        let pem = std::fs::read(path)
            .map_err(|e| anyhow!("cannot read sslrootcert {}: {e}", path.display()))?;
        let mut roots = rustls::RootCertStore::empty();
        let mut n = 0;
        for cert in rustls_pemfile_certs(&pem) {
            roots.add(cert).map_err(|e| {
                anyhow!(
                    "sslrootcert {}: a certificate is unusable: {e}",
                    path.display()
                )
            })?;
            n += 1;
        }
        if n == 0 {
            return Err(anyhow!(
                "sslrootcert {} holds no PEM certificate",
                path.display()
            ));
        }
        Ok(roots)
    }

    /// The `CERTIFICATE` blocks of a PEM file.
    fn rustls_pemfile_certs(pem: &[u8]) -> Vec<CertificateDer<'static>> {
        use rustls::pki_types::pem::PemObject;
        CertificateDer::pem_slice_iter(pem)
            .filter_map(|c| c.ok())
            .collect()
    }

    /// `sslmode=require`: encrypted, any certificate (lib/pq's default, and libpq's `require`).
    /// The handshake's signatures are still checked.
    #[derive(Debug)]
    pub struct Unverified(pub Arc<rustls::crypto::CryptoProvider>);

    impl ServerCertVerifier for Unverified {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }

    /// `sslmode=verify-ca`: the chain verified, any name.
    #[derive(Debug)]
    pub struct AnyName(pub Arc<rustls::client::WebPkiServerVerifier>);

    impl ServerCertVerifier for AnyName {
        fn verify_server_cert(
            &self,
            end: &CertificateDer<'_>,
            inter: &[CertificateDer<'_>],
            name: &ServerName<'_>,
            ocsp: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            match self.0.verify_server_cert(end, inter, name, ocsp, now) {
                Err(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::NotValidForName,
                ))
                | Err(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::NotValidForNameContext { .. },
                )) => Ok(ServerCertVerified::assertion()),
                other => other,
            }
        }
        fn verify_tls12_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.0.verify_tls12_signature(m, c, d)
        }
        fn verify_tls13_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.0.verify_tls13_signature(m, c, d)
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.supported_verify_schemes()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_is_read_as_lib_pq_reads_it_and_the_password_never_shown() {
        let c = ConnSpec::parse(
            "postgres://ci:s%40cret@db.example:5433/pool?sslmode=verify-full&sslrootcert=/etc/ca.pem&connect_timeout=5",
        )
        .unwrap();
        assert_eq!(c.ssl, SslMode::VerifyFull);
        assert_eq!(
            c.root_cert.as_deref(),
            Some(std::path::Path::new("/etc/ca.pem"))
        );
        assert_eq!(c.shown, "ci@db.example:5433/pool");
        assert_eq!(c.scrub("auth for s@cret failed"), "auth for *** failed");
        assert!(!c.url.expose().contains("sslmode"));
        assert!(c.url.expose().contains("connect_timeout=5"));
        // lib/pq's default: require.
        assert_eq!(
            ConnSpec::parse("postgres://h/d").unwrap().ssl,
            SslMode::Require
        );
        for bad in [
            "host=h dbname=d password=s3cret",
            "postgres://u:s3cret@h/d?sslmode=prefer",
            "postgres://u:s3cret@h/d?sslmode=verify-full",
        ] {
            let e = format!("{:#}", ConnSpec::parse(bad).err().expect(bad));
            assert!(!e.contains("s3cret"), "{e}");
        }
    }
}
