//! https to a Forgejo whose certificate comes from a private CA: refused with the built-in
//! roots, accepted with `--ca-file`.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use crate::support::harness::{API_TOKEN, BIN};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

fn openssl(dir: &Path, args: &[&str]) {
    let st = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl CLI");
    assert!(
        st.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&st.stderr)
    );
}

/// A private CA and a certificate for 127.0.0.1 signed by it.
fn make_pki(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=Test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            "server.pem",
        ],
    );
}

/// Answers every request with `null` (no jobs) until the listener is dropped.
fn serve(dir: &Path) -> (String, std::thread::JoinHandle<Vec<String>>) {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("server.pem"))
        .unwrap()
        .map(|c| c.unwrap())
        .collect();
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "https://127.0.0.1:{}",
        listener.local_addr().unwrap().port()
    );
    let handle = std::thread::spawn(move || {
        let mut seen = Vec::new();
        // Two connections: the refused one and the accepted one.
        for _ in 0..2 {
            let (tcp, _) = listener.accept().unwrap();
            let conn = rustls::ServerConnection::new(config.clone()).unwrap();
            let mut tls = rustls::StreamOwned::new(conn, tcp);
            let mut buf = [0u8; 4096];
            match tls.read(&mut buf) {
                Ok(n) if n > 0 => {
                    let req = String::from_utf8_lossy(&buf[..n]).into_owned();
                    seen.push(req.lines().next().unwrap_or("").to_string());
                    let body = "null";
                    let _ = write!(
                        tls,
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = tls.flush();
                    tls.conn.send_close_notify();
                    let _ = tls.flush();
                }
                _ => seen.push("(handshake refused)".into()),
            }
        }
        seen
    });
    (url, handle)
}

#[test]
fn private_ca_needs_ca_file() {
    let tmp = tempfile::tempdir().unwrap();
    make_pki(tmp.path());
    let token = tmp.path().join("token");
    std::fs::write(&token, API_TOKEN).unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let (url, server) = serve(tmp.path());
    let run = |extra: &[&str]| {
        Command::new(BIN)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap())
            .args([
                "run",
                "--labels",
                "debian",
                "--forgejo-url",
                &url,
                "--token-file",
            ])
            .arg(&token)
            .arg("--state-dir")
            .arg(tmp.path().join("state"))
            .args(extra)
            .output()
            .unwrap()
    };
    let refused = run(&[]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--ca-file"),
        "the error says what to do: {err}"
    );

    let ca = tmp.path().join("ca.pem");
    let accepted = run(&["--ca-file", ca.to_str().unwrap()]);
    assert_eq!(
        accepted.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&accepted.stderr)
    );
    let seen = server.join().unwrap();
    assert_eq!(seen[0], "(handshake refused)");
    assert!(
        seen[1].starts_with("GET /api/v1/admin/actions/runners/jobs?labels=debian"),
        "{seen:?}"
    );

    // A file without a certificate is a configuration error.
    let bad = run(&["--ca-file", token.to_str().unwrap()]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no PEM certificate"));
}
