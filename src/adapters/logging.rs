//! Logging: to the journal with priorities when stderr is the journal, else plain lines; capped.

use std::fs;
use std::path::Path;

use crate::core::escape::{escape_controls, needs_escape};
use crate::core::secret::Secret;

/// Info by default; debug with `-v`; warnings only for dry-runs, whose product is the plan on
/// stdout (their "deleted" would be a lie). `RUST_LOG`, when set, replaces all of that (on a
/// default of warnings).
pub fn init_logging(verbose: bool, dry_run: bool) {
    let mut b = env_logger::Builder::new();
    match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => {
            // Warnings and errors stay on unless RUST_LOG itself sets a lower default.
            b.filter_level(log::LevelFilter::Warn);
            b.parse_filters(&spec);
        }
        _ => {
            b.filter_level(log::LevelFilter::Warn);
            let ours = match (verbose, dry_run) {
                (true, _) => log::LevelFilter::Debug,
                (false, true) => log::LevelFilter::Warn,
                (false, false) => log::LevelFilter::Info,
            };
            b.filter_module("ci_ephemeral_provisioner", ours);
        }
    }
    b.target(env_logger::Target::Stderr);
    if stderr_is_journal() {
        // journald stamps every line itself, and reads the priority from a `<N>` prefix
        // (sd-daemon(3)), so `journalctl -p err` finds failures.
        b.format(|buf, record| {
            use std::io::Write;
            let p = priority(record.level());
            let target = record.target();
            let text = if target.starts_with("ci_ephemeral_provisioner") {
                record.args().to_string()
            } else {
                format!("{target}: {}", record.args())
            };
            // Every line of a multi-line message (tofu's stderr) keeps the priority.
            writeln!(buf, "<{p}>{}", text.replace('\n', &format!("\n<{p}>")))
        });
    }
    let inner = b.build();
    let max = inner.filter();
    if log::set_boxed_logger(Box::new(CappedLogger { inner })).is_ok() {
        log::set_max_level(max);
    }
}

/// The syslog priority of a log level (sd-daemon(3) prefixes).
pub fn priority(level: log::Level) -> u8 {
    match level {
        log::Level::Error => 3,
        log::Level::Warn => 4,
        log::Level::Info => 6,
        log::Level::Debug | log::Level::Trace => 7,
    }
}

/// `JOURNAL_STREAM` names our stderr (`<device>:<inode>`): systemd connected it to journald.
/// A child that merely inherited the variable with stderr redirected elsewhere keeps the normal
/// format.
fn stderr_is_journal() -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = stream.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let meta = std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .map(fs::File::from)
        .and_then(|f| f.metadata());
    match (meta, dev.parse::<u64>(), ino.parse::<u64>()) {
        (Ok(m), Ok(d), Ok(i)) => m.dev() == d && m.ino() == i,
        _ => false,
    }
}

/// The effective configuration at debug level: every flag as parsed (defaults filled in), the
/// state directory, and the token only as `<redacted>`.
pub(crate) fn log_config(args: &dyn std::fmt::Debug, token: Option<&Secret>, dir: Option<&Path>) {
    if !log::log_enabled!(log::Level::Debug) {
        return;
    }
    log::debug!("effective configuration: {args:?}");
    log::debug!(
        "state directory: {}; Forgejo token: {}",
        dir.map_or_else(|| "(none: dry-run)".into(), |d| d.display().to_string()),
        match token {
            Some(t) => format!("{t:?} (redacted)"),
            None => "(not read)".into(),
        }
    );
}

/// Never lets the HTTP and TLS stack log below info, whatever `RUST_LOG` says (however
/// specific): their debug and trace output is where request headers — the token — appear.
struct CappedLogger {
    inner: env_logger::Logger,
}

impl CappedLogger {
    fn allowed(meta: &log::Metadata<'_>) -> bool {
        let t = meta.target();
        let http_stack = ["ureq", "ureq_proto", "rustls"]
            .iter()
            .any(|m| t == *m || t.starts_with(&format!("{m}::")));
        !http_stack || meta.level() <= log::Level::Info
    }
}

impl log::Log for CappedLogger {
    fn enabled(&self, meta: &log::Metadata<'_>) -> bool {
        Self::allowed(meta) && self.inner.enabled(meta)
    }

    /// A record is one line whatever it holds: control characters (a runner name from Forgejo
    /// with `\n<3>…`, an ESC sequence, tofu's multi-line stderr) are written escaped, so no text
    /// can forge a log line (or a journald priority) or drive a terminal.
    fn log(&self, record: &log::Record<'_>) {
        if !Self::allowed(record.metadata()) {
            return;
        }
        let text = record.args().to_string();
        if !text.chars().any(needs_escape) {
            self.inner.log(record);
            return;
        }
        let escaped = escape_controls(&text);
        self.inner.log(
            &log::Record::builder()
                .metadata(record.metadata().clone())
                .module_path(record.module_path())
                .file(record.file())
                .line(record.line())
                .args(format_args!("{escaped}"))
                .build(),
        );
    }

    fn flush(&self) {
        self.inner.flush();
    }
}
