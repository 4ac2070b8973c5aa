//! `hook`: one webhook delivery, on the connection a socket unit (`Accept=yes`) passes as fd 3.
//! Read within `--read-timeout` and 1 MiB, judged (`core::hook`), answered at once; a new signed
//! delivery touches every `--wake-file`, whose `.path` units start the pools' idle slots. Each
//! request leaves one log line (the delivery's id and what it woke, or why it was refused) and
//! a count by reason in its state and metrics.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::adapters::hook::{
    Conn, LISTEN_FD, load_state, lock_state, read_request, read_secret, respond, save_state, touch,
};
use crate::cli::HookArgs;
use crate::commands::config::check_metrics_path;
use crate::commands::exit::{EXIT_FAILED, EXIT_OK, Fatal, usage};
use crate::core::hook::request::escape;
use crate::core::hook::{HookState, Reason, Refused, decide, key, render_metrics, touches, verify};
use crate::core::secret::Secret;
use crate::core::time::Timestamp;

/// The file of the secret under systemd's `LoadCredential=webhook-secret:…`.
pub const SECRET_CREDENTIAL: &str = "webhook-secret";

/// The receiver's state directory when neither `--state-dir` nor `$STATE_DIRECTORY` is set.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/ci-ephemeral-provisioner-hook";

/// Whether systemd passed this process one descriptor (`LISTEN_FDS=1`, `LISTEN_PID` = ours, as
/// `sd_listen_fds` checks); the error says what was found.
fn passed_one_fd() -> Result<(), String> {
    let pid = std::env::var("LISTEN_PID").unwrap_or_default();
    let fds = std::env::var("LISTEN_FDS").unwrap_or_default();
    if pid == std::process::id().to_string() && fds == "1" {
        Ok(())
    } else {
        Err(format!(
            "LISTEN_FDS is {fds:?} and LISTEN_PID {pid:?} (this process is {})",
            std::process::id()
        ))
    }
}

/// The first descriptor `main` closes: 4 for `hook` with a descriptor passed by systemd (fd 3
/// is the connection), else 3. Read before anything is opened.
pub fn first_fd_to_close() -> libc::c_uint {
    let hook = std::env::args_os().nth(1).is_some_and(|a| a == "hook");
    if hook && passed_one_fd().is_ok() {
        LISTEN_FD as libc::c_uint + 1
    } else {
        3
    }
}

/// The checked configuration: the key, the wake files, the state directory.
struct Setup {
    key: ring::hmac::Key,
    wake_files: Vec<PathBuf>,
    state_dir: PathBuf,
}

fn setup(a: &HookArgs) -> Result<Setup, Fatal> {
    if let Some(p) = a.wake_file.iter().find(|p| !p.is_absolute()) {
        return Err(usage(format!(
            "--wake-file {} is not an absolute path: give the path the slot's --wake-file and .path unit use",
            p.display()
        )));
    }
    if let Some(m) = &a.metrics_file {
        check_metrics_path(m)?;
    }
    let credentials = std::env::var_os("CREDENTIALS_DIRECTORY").map(PathBuf::from);
    let path = match (&a.secret_file, &credentials) {
        (Some(p), _) => p.clone(),
        (None, Some(d)) => d.join(SECRET_CREDENTIAL),
        (None, None) => {
            return Err(usage(
                "no webhook secret: pass --secret-file PATH (under systemd, LoadCredential=webhook-secret:PATH)",
            ));
        }
    };
    let trusted = credentials
        .as_deref()
        .is_some_and(|d| path.parent() == Some(d));
    let secret: Secret = read_secret(&path, trusted).map_err(|e| usage(format!("{e:#}")))?;
    // --state-dir, else systemd's $STATE_DIRECTORY (its first entry), else the default.
    let state_dir = match (&a.state_dir, std::env::var_os("STATE_DIRECTORY")) {
        (Some(d), _) => d.clone(),
        (None, Some(_)) => crate::commands::config::state_dir(&None),
        (None, None) => PathBuf::from(DEFAULT_STATE_DIR),
    };
    Ok(Setup {
        key: key(secret.expose().as_bytes()),
        wake_files: a.wake_file.clone(),
        state_dir,
    })
}

pub fn cmd_hook(a: HookArgs) -> Result<u8, Fatal> {
    let deadline = Instant::now() + a.read_timeout;
    passed_one_fd().map_err(|e| {
        usage(format!(
            "hook answers one connection passed by systemd's socket activation (a .socket unit with Accept=yes): {e}"
        ))
    })?;
    let mut conn = Conn::from_passed_fd().map_err(|e| usage(format!("{e:#}")))?;
    let peer = conn.peer();
    let s = match setup(&a) {
        Ok(s) => s,
        Err(e) => {
            respond(
                &mut conn,
                500,
                "the webhook receiver is misconfigured; its log says why",
            );
            return Err(e);
        }
    };
    let delivery = judge(&mut conn, &s, deadline);
    answer(&mut conn, &a, &s, &peer, delivery, deadline)
}

/// A delivery whose signature checked out: its id, signature and event
/// (`X-Forgejo-Event-Type`, else `X-Forgejo-Event`).
struct Signed {
    id: String,
    signature: String,
    event: String,
}

/// The request read and its signature verified.
fn judge(conn: &mut Conn, s: &Setup, deadline: Instant) -> Result<Signed, Refused> {
    let (head, body) = read_request(conn, deadline)?;
    let signature = head.signature.as_deref().unwrap_or_default();
    verify(&s.key, &body, signature)?;
    let event = head
        .event_type
        .filter(|e| !e.is_empty())
        .or(head.event)
        .unwrap_or_default();
    Ok(Signed {
        id: head.delivery.unwrap_or_default(),
        signature: signature.to_string(),
        event,
    })
}

/// Decides what the (signed, or refused) request does under the state lock, wakes, records,
/// answers and logs; the exit status.
fn answer(
    conn: &mut Conn,
    a: &HookArgs,
    s: &Setup,
    peer: &str,
    delivery: Result<Signed, Refused>,
    deadline: Instant,
) -> Result<u8, Fatal> {
    let now = crate::adapters::clock::wall_now();
    let mut failed = Vec::new();
    let lock = lock_state(&s.state_dir, deadline + std::time::Duration::from_secs(5))
        .inspect_err(|e| failed.push(format!("{e:#}; the request is not recorded")))
        .ok();
    let mut state = match &lock {
        Some(l) => load_state(&s.state_dir, l).unwrap_or_else(|e| {
            failed.push(format!(
                "{e:#}; starting a new one (the delivery ids seen before are forgotten)"
            ));
            HookState::default()
        }),
        None => HookState::default(),
    };
    let (reason, detail, id, signature, event) = match delivery {
        Err(r) => (
            r.reason,
            r.detail,
            String::new(),
            String::new(),
            String::new(),
        ),
        Ok(Signed {
            id,
            signature,
            event,
        }) => {
            let (reason, detail) = match decide(&state, &id, &signature, &event) {
                Reason::Woke => wake(&s.wake_files, now, &mut failed),
                other => (other, String::new()),
            };
            (reason, detail, id, signature, event)
        }
    };
    let (id, event) = (id.as_str(), event.as_str());
    if verdict_accepted(reason) {
        state.remember(id, &signature, now);
    }
    state.count(reason, now);
    if let Some(l) = &lock
        && let Err(e) = save_state(&s.state_dir, &state, l)
    {
        failed.push(format!("{e:#}"));
    }
    if let Some(m) = &a.metrics_file
        && let Err(e) = crate::adapters::files::write_textfile(m, &render_metrics(&state))
    {
        failed.push(format!("cannot write {}: {e:#}", m.display()));
    }
    // The answer after the lock: a peer slow to take it holds up no other delivery.
    drop(lock);
    respond(conn, reason.status(), &said(reason, &detail));
    log_line(peer, reason, &detail, id, event);
    for f in &failed {
        log::error!("{f}");
    }
    Ok(if failed.is_empty() {
        EXIT_OK
    } else {
        EXIT_FAILED
    })
}

/// Whether the delivery's id is remembered: signed, read whole and done with (one whose wake
/// failed is not: the same delivery sent again may wake).
fn verdict_accepted(reason: Reason) -> bool {
    matches!(reason, Reason::Woke | Reason::Coalesced | Reason::NoJobs)
}

/// Touches every wake file not touched within the last second (`core::hook::touches`), each
/// tried whatever the others did.
fn wake(files: &[PathBuf], now: Timestamp, failed: &mut Vec<String>) -> (Reason, String) {
    let (mut woke, mut coalesced, mut errors) = (Vec::new(), Vec::new(), 0);
    for f in files {
        let last = std::fs::metadata(f)
            .and_then(|m| m.modified())
            .ok()
            .map(Timestamp::from_system);
        if !touches(last, now) {
            coalesced.push(name(f));
            continue;
        }
        match touch(f) {
            Ok(()) => woke.push(name(f)),
            Err(e) => {
                errors += 1;
                failed.push(format!("{e:#}"));
            }
        }
    }
    let also = match coalesced.len() {
        0 => String::new(),
        _ => format!(" ({} woken less than a second ago)", coalesced.join(", ")),
    };
    if errors > 0 {
        let detail = format!("woke {} of {} wake files", woke.len(), files.len());
        (Reason::WakeFailed, detail)
    } else if woke.is_empty() {
        (Reason::Coalesced, coalesced.join(", "))
    } else {
        (Reason::Woke, format!("{}{also}", woke.join(", ")))
    }
}

fn name(p: &Path) -> String {
    p.file_name().map_or_else(
        || p.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// The answer's text.
fn said(reason: Reason, detail: &str) -> String {
    match reason {
        Reason::Woke => format!("woke {detail}"),
        Reason::Coalesced => format!("coalesced: {detail} woken less than a second ago"),
        Reason::Repeated => "a delivery seen before: nothing woken".into(),
        Reason::NoJobs => "an event after which no job waits: nothing woken".into(),
        Reason::WakeFailed => format!("{detail}; the receiver's log says why"),
        _ => format!("refused ({}): {detail}", reason.as_str()),
    }
}

fn log_line(peer: &str, reason: Reason, detail: &str, id: &str, event: &str) {
    let what = format!("delivery {} ({})", escape(id), escape(event));
    match reason {
        Reason::Woke => log::info!("{what} from {peer}: woke {detail}"),
        Reason::Coalesced => {
            log::info!("{what} from {peer}: {detail} woken less than a second ago, not again")
        }
        Reason::Repeated => log::info!("{what} from {peer}: seen before, nothing woken"),
        Reason::NoJobs => log::info!("{what} from {peer}: no job can wait after it, nothing woken"),
        Reason::WakeFailed => log::error!("{what} from {peer}: {detail}"),
        _ => log::warn!(
            "refused a request from {peer} ({}): {detail}",
            reason.as_str()
        ),
    }
}
