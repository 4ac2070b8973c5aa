//! `check`: everything a cycle will need, tried without changing anything (no POST, no DELETE,
//! no cycle.json, no VM). One line per check; exit 0 when all pass, 1 when one fails.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail};
use serde_json::json;

use crate::adapters::files::{StateDir, inspect_state_dir, read_state_file};
use crate::adapters::forgejo_http::{HttpForgejo, is_loopback_url, major_version};
use crate::adapters::process::{find_executable, run_child};
use crate::adapters::signals::StopFlag;
use crate::adapters::tofu_cli::invocation;
use crate::cli::{CheckArgs, OutputFormat, RunArgs};
use crate::commands::config::{forgejo_target, read_token, slot_dir, validate_run_args};
use crate::commands::exit::{EXIT_FAILED, EXIT_LOCKED, EXIT_OK, EXIT_USAGE, Fatal};
use crate::commands::wiring;
use crate::core::labels::Labels;
use crate::core::ports::{Forgejo, Launcher, Tofu};
use crate::core::state::STATE_FILE;

/// The oldest Forgejo whose runner API (`/actions/runners`, `…/jobs`) this tool speaks.
pub const MIN_FORGEJO_MAJOR: u64 = 15;

/// How long `tofu init` (which may download providers) and `validate` may take.
const TOFU_CHECK_TIMEOUT: Duration = Duration::from_secs(300);

/// One check: what was checked, and what was found (`Ok`) or what to do (`Err`), as printed;
/// and what may still fail although the check passed.
struct Line {
    name: &'static str,
    result: Result<String, String>,
    warnings: Vec<String>,
    /// More for the JSON output (the canary's steps).
    detail: Option<serde_json::Value>,
}

impl Line {
    fn new(name: &'static str, result: Result<String, String>) -> Line {
        Line {
            name,
            result,
            warnings: Vec::new(),
            detail: None,
        }
    }
}

pub fn cmd_check(CheckArgs { args: a, boot }: CheckArgs) -> Result<u8, Fatal> {
    // The flags first, as `run` checks them: a wrong one is a usage error (exit 2), and nothing
    // else is tried with it (a zero --http-timeout would only fail again as a time-out).
    let (labels, (url, _)) =
        match validate_run_args(&a).and_then(|l| Ok((l, forgejo_target(&a.common)?))) {
            Ok(config) => config,
            Err(Fatal(_, msg)) => {
                print_lines(
                    &[Line::new("configuration", Err(msg))],
                    a.common.local.output,
                    true,
                );
                return Ok(EXIT_USAGE);
            }
        };
    let mut lines = vec![
        Line {
            name: "configuration",
            result: Ok(format!(
                "Forgejo {url}, scope {}, runner prefix {:?}",
                a.common.target.scope, a.common.target.runner_prefix
            )),
            warnings: loopback_warning(&url, &a).into_iter().collect(),
            detail: None,
        },
        Line {
            name: "labels",
            result: Ok(labels.describe()),
            warnings: labels.iter().filter_map(|l| l.warning()).collect(),
            detail: None,
        },
    ];
    lines.extend(check_forgejo(&a, &labels));
    lines.push(Line::new("tofu", shown(check_tofu(&a))));
    lines.push(Line::new("launch command", shown(check_launch(&a))));
    lines.push(Line::new(
        "state directory",
        slot_dir(&a.common.local)
            .map_err(|Fatal(_, msg)| msg)
            .and_then(|slot| shown(check_state_dir(&slot.dir()))),
    ));
    if a.common.local.store == crate::cli::StoreKind::Pg {
        lines.push(Line::new("pool store", shown(check_pool_store(&a, &url))));
        lines.push(Line::new("tofu backend", shown(check_tofu_backend(&a))));
    }
    if let Some(path) = &a.common.metrics_file {
        lines.push(Line::new("metrics file", shown(check_metrics_dir(path))));
    }
    // The canary only once everything it needs passed: a VM is costly, and its failure would
    // only repeat one of the lines above.
    let mut refused = false;
    if boot {
        let (result, detail) = if lines.iter().any(|l| l.result.is_err()) {
            (
                Err("not booted: fix the failures above first".to_string()),
                serde_json::Value::Null,
            )
        } else {
            let b = crate::commands::canary::boot(&a, &url);
            refused = b.refused;
            (b.result, b.detail)
        };
        let mut line = Line::new("boot", result);
        line.detail = Some(detail);
        lines.push(line);
    }
    let failed = print_lines(&lines, a.common.local.output, false);
    Ok(match (failed, refused) {
        (1, true) => EXIT_LOCKED,
        (0, _) => EXIT_OK,
        _ => EXIT_FAILED,
    })
}

/// A loopback --forgejo-url reaches Forgejo from this host only, but the launch command hands
/// it to the runner on the VM (FORGEJO_URL), where it names the VM itself.
fn loopback_warning(url: &str, a: &RunArgs) -> Option<String> {
    (is_loopback_url(url) && a.launch_command.is_some()).then(|| {
        format!(
            "{url} is a loopback address: the launch command hands it to the runner on the VM (FORGEJO_URL), where it names the VM itself; give an address the VM can reach (unless the runner runs on this host or the launch command forwards the port)"
        )
    })
}

/// Prints the lines (`stopped`: at a configuration error, before any other check); returns how
/// many failed.
fn print_lines(lines: &[Line], output: OutputFormat, stopped: bool) -> usize {
    let failed = lines.iter().filter(|l| l.result.is_err()).count();
    let warnings: usize = lines.iter().map(|l| l.warnings.len()).sum();
    match output {
        OutputFormat::Json => {
            let checks: Vec<_> = lines
                .iter()
                .map(|l| {
                    let (ok, detail) = match &l.result {
                        Ok(d) => (true, d),
                        Err(d) => (false, d),
                    };
                    let mut c = json!({"check": l.name, "ok": ok, "detail": detail, "warnings": l.warnings});
                    if let Some(steps) = l.detail.as_ref().filter(|d| !d.is_null()) {
                        c["steps"] = steps.clone();
                    }
                    c
                })
                .collect();
            let mut doc = json!({"ok": failed == 0, "failed": failed, "warnings": warnings, "checks": checks});
            if stopped {
                doc["stopped_at"] = json!("configuration");
            }
            println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        }
        OutputFormat::Text => {
            for l in lines {
                match &l.result {
                    Ok(d) => println!("ok    {}: {d}", l.name),
                    Err(d) => println!("FAIL  {}: {d}", l.name),
                }
                for w in &l.warnings {
                    println!("warn  {}: {w}", l.name);
                }
            }
            let warned = match warnings {
                0 => String::new(),
                1 => ", 1 warning".to_string(),
                n => format!(", {n} warnings"),
            };
            if stopped {
                println!("stopped at the configuration: fix it, then check again");
            } else if failed == 0 {
                println!("all {} checks passed{warned}", lines.len());
            } else {
                println!("{failed} of {} checks failed{warned}", lines.len());
            }
        }
    }
    failed
}

/// A check's error as its line shows it: the message and its causes.
fn shown(result: anyhow::Result<String>) -> Result<String, String> {
    result.map_err(|e| format!("{e:#}"))
}

/// Where the token came from, once it was read (and found not empty).
fn token_source(arg: &Option<std::path::PathBuf>) -> &'static str {
    match arg {
        Some(p) if p.as_os_str() == crate::core::secret::STDIN_PATH => {
            "read from standard input, not empty"
        }
        _ => "readable by this user only, not empty",
    }
}

/// The token file, then Forgejo: reachable, new enough, and accepting the token for the scope.
fn check_forgejo(a: &RunArgs, labels: &Labels) -> Vec<Line> {
    let token = read_token(&a.common.target.token_file).map_err(|Fatal(_, msg)| msg);
    let mut lines = vec![Line::new(
        "token file",
        token
            .as_ref()
            .map(|_| token_source(&a.common.target.token_file).to_string())
            .map_err(Clone::clone),
    )];
    let (url, scope) = match forgejo_target(&a.common) {
        Ok(target) => target,
        Err(Fatal(_, msg)) => {
            // Checked before any line (`cmd_check`): only a bug gets here.
            lines.push(Line::new("forgejo", Err(msg)));
            return lines;
        }
    };
    let token = match token {
        Ok(t) => t,
        Err(_) => {
            lines.push(Line::new(
                "forgejo",
                Err(format!("{url}: not asked, there is no usable token")),
            ));
            return lines;
        }
    };
    let names = labels.names();
    let mut forgejo = match wiring::http_forgejo(&a.common, &url, scope.clone(), &token, &names) {
        Ok(f) => f,
        Err(Fatal(_, msg)) => {
            lines.push(Line::new("forgejo", Err(msg)));
            return lines;
        }
    };
    drop(token);
    let version = version_line(&mut forgejo, &url);
    let reachable = version.is_ok();
    lines.push(Line::new("forgejo", version));
    if reachable {
        lines.push(Line::new(
            "token scope",
            scope_line(&mut forgejo, &a.common.target.scope),
        ));
    }
    lines
}

/// Forgejo answers, and is new enough.
fn version_line(forgejo: &mut HttpForgejo, url: &str) -> Result<String, String> {
    let v = forgejo.version().map_err(|e| e.to_string())?;
    match major_version(&v) {
        Some(m) if m >= MIN_FORGEJO_MAJOR => Ok(format!("{url} answers, Forgejo {v}")),
        Some(_) => Err(format!(
            "{url} runs Forgejo {v}; this tool needs Forgejo {MIN_FORGEJO_MAJOR} or later (its runner and jobs API): upgrade Forgejo"
        )),
        None => Err(format!(
            "{url} reports the version {v:?}, which is not a Forgejo version; is --forgejo-url the address of Forgejo?"
        )),
    }
}

/// The token lists the scope's runners and the jobs for the labels.
fn scope_line(forgejo: &mut impl Forgejo, scope: &str) -> Result<String, String> {
    let runners = forgejo
        .list_runners_page(1, 1)
        .map_err(|e| e.to_string())
        .map(|p| match p.total {
            Some(n) => format!("{n} registration(s) in the scope"),
            None => "the list answers".to_string(),
        });
    let jobs = forgejo
        .list_jobs()
        .map_err(|e| e.to_string())
        .map(|j| format!("{} waiting or running job(s) for these labels", j.len()));
    // Forgejo checks a token's scope by the request's method: these GETs prove reading only.
    let write = crate::adapters::forgejo_http::Scope::parse(scope)
        .map(|s| s.write_scope())
        .unwrap_or("write");
    match (runners, jobs) {
        (Ok(r), Ok(j)) => Ok(format!(
            "the token lists runners and jobs of scope {scope}: {r}, {j} (registering needs {write}, which check does not try: a run's first registration does)"
        )),
        (Err(e), _) | (_, Err(e)) => Err(e),
    }
}

fn check_launch(a: &RunArgs) -> anyhow::Result<String> {
    let launcher = wiring::launcher(a, StopFlag::new());
    launcher.check_config()?;
    let shown = a
        .launch_command
        .as_deref()
        .map(|p| find_executable(p).unwrap_or_else(|| p.to_path_buf()))
        .unwrap_or_default();
    Ok(format!("{} is an executable file", shown.display()))
}

/// The tofu binary runs, and the module initializes and validates in a temporary copy with
/// its own `TF_DATA_DIR`: the module directory, its state and its backend stay untouched.
fn check_tofu(a: &RunArgs) -> anyhow::Result<String> {
    // What a run checks first (the binary, the module directory), in the run's words.
    // A bad --slot is the configuration line's failure; the probe needs only the binary and module.
    let slot = slot_dir(&a.common.local)
        .unwrap_or_else(|_| crate::adapters::files::SlotDir::alone(Path::new(".")));
    wiring::tofu(a, &slot, StopFlag::new()).check_config()?;
    let (program, dir) = match (
        find_executable(&a.module.tofu_bin),
        a.module.tofu_dir.as_deref(),
    ) {
        (Some(program), Some(dir)) => (program, dir),
        _ => bail!("--tofu-bin or --tofu-dir changed while they were checked"),
    };
    let tmp = tempfile::Builder::new()
        .prefix("ci-ephemeral-provisioner-check-")
        .tempdir()
        .map_err(|e| anyhow!("cannot create a temporary directory: {e}"))?;
    let copy = tmp.path().join("module");
    copy_module(dir, &copy, 0).map_err(|e| {
        anyhow!(
            "cannot copy the module {} to {}: {e}",
            dir.display(),
            copy.display()
        )
    })?;
    let data = tmp.path().join("data");
    let run = |args: &[&str]| -> anyhow::Result<Vec<u8>> {
        let shown = format!("{} {}", program.display(), args.join(" "));
        let mut spec = invocation(&program, &copy, "check", args);
        spec.env
            .push(("TF_DATA_DIR".into(), data.display().to_string()));
        spec.timeout = Some(TOFU_CHECK_TIMEOUT);
        let r = run_child(&spec, &StopFlag::new())
            .map_err(|e| anyhow!("cannot run {}: {e}", program.display()))?;
        if r.success() {
            Ok(r.stdout)
        } else {
            // tofu's `Error:` heading says what failed; its last lines only how.
            Err(anyhow!("`{shown}` {}", r.describe_from("Error:", 8)))
        }
    };
    let version = run(&["version"])?;
    let version = String::from_utf8_lossy(&version)
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_string();
    run(&["init", "-backend=false", "-input=false", "-no-color"])
        .map_err(|e| anyhow!("{e}; the module {} does not initialize", dir.display()))?;
    run(&["validate", "-no-color"])
        .map_err(|e| anyhow!("{e}; the module {} is not valid", dir.display()))?;
    Ok(format!(
        "{version}; the module {} initializes and validates (in a temporary copy)",
        dir.display()
    ))
}

/// Copies a module for `init`/`validate`, leaving out what tofu made there (its data
/// directory and local state): those stay as they are and are not needed to validate.
fn copy_module(from: &Path, to: &Path, depth: usize) -> std::io::Result<()> {
    const SKIP: [&str; 4] = [
        ".terraform",
        "terraform.tfstate",
        "terraform.tfstate.backup",
        ".terraform.tfstate.lock.info",
    ];
    if depth > 16 {
        return Err(std::io::Error::other(format!(
            "{} is nested more than 16 directories deep (a symlink loop?)",
            from.display()
        )));
    }
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        if SKIP.iter().any(|s| name == *s) {
            continue;
        }
        let src = entry.path();
        let meta = std::fs::metadata(&src)?;
        if meta.is_dir() {
            copy_module(&src, &to.join(&name), depth + 1)?;
        } else if meta.is_file() {
            std::fs::copy(&src, to.join(&name))?;
        }
    }
    Ok(())
}

/// A directory this user owns, may write and can lock, or one it can create; and a cycle.json
/// that reads (a cycle in progress is fine: the next run carries it on).
fn check_state_dir(dir: &Path) -> anyhow::Result<String> {
    match inspect_state_dir(dir)? {
        StateDir::Missing => {
            let parent = nearest_existing(dir).ok_or_else(|| {
                anyhow!(
                    "state directory {} does not exist, and no parent of it does",
                    dir.display()
                )
            })?;
            if !parent.is_dir() || !writable(&parent) {
                bail!(
                    "state directory {} does not exist, and this user cannot create it in {}: create it (owned by the service's user, mode 0700) or point --state-dir elsewhere",
                    dir.display(),
                    parent.display()
                );
            }
            Ok(format!(
                "{} does not exist yet; the first run creates it in {}",
                dir.display(),
                parent.display()
            ))
        }
        StateDir::Usable => {
            tempfile::Builder::new()
                .prefix(".check-")
                .tempfile_in(dir)
                .map_err(|e| {
                    anyhow!(
                        "cannot write in state directory {}: {e}; make it writable by the service's user",
                        dir.display()
                    )
                })?;
            let lock = lock_state(dir)?;
            let cycle = match read_state_file(&dir.join(STATE_FILE)) {
                Ok(None) => "no cycle in progress".to_string(),
                Ok(Some(s)) => format!("cycle {} in progress", s.cycle_id),
                Err(e) => return Err(anyhow!("{e:#}")),
            };
            Ok(format!("{} is writable{lock}; {cycle}", dir.display()))
        }
    }
}

/// Tries `cycle.lock` if it exists (never creates it). A lock held by a run in progress is fine.
fn lock_state(dir: &Path) -> anyhow::Result<&'static str> {
    let path = dir.join(crate::adapters::files::LOCK_FILE);
    let file = match std::fs::OpenOptions::new().write(true).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(""),
        Err(e) => return Err(anyhow!("cannot open lock file {}: {e}", path.display())),
    };
    match file.try_lock() {
        Ok(()) => Ok(" and lockable"),
        Err(std::fs::TryLockError::WouldBlock) => Ok(" (a run in progress holds its lock)"),
        Err(std::fs::TryLockError::Error(e)) => Err(anyhow!("cannot lock {}: {e}", path.display())),
    }
}

/// `--store pg`: the database answers (`PG_CONN_STR`), its schema is one this build knows,
/// this host id is live on no other machine; the connection string's TLS is said.
fn check_pool_store(a: &RunArgs, url: &str) -> anyhow::Result<String> {
    let store = wiring::pg_store(&a.common.local, url, false).map_err(|Fatal(_, m)| anyhow!(m))?;
    let Some(mut store) = store else {
        bail!("--store pg is not set");
    };
    store.check()
}

/// `--store pg`: the module keeps its tofu state in PostgreSQL too (`backend "pg"`), so that
/// any host of the pool can destroy a cycle's VM.
fn check_tofu_backend(a: &RunArgs) -> anyhow::Result<String> {
    let dir = a
        .module
        .tofu_dir
        .as_deref()
        .ok_or_else(|| anyhow!("--tofu-dir is not set"))?;
    let entries =
        std::fs::read_dir(dir).map_err(|e| anyhow!("cannot list {}: {e}", dir.display()))?;
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "tf")
            && let Ok(text) = std::fs::read_to_string(&p)
            && text
                .lines()
                .map(|l| l.split('#').next().unwrap_or("").replace(' ', ""))
                .any(|l| l.starts_with("backend\"pg\""))
        {
            return Ok(format!(
                "{} keeps its state in PostgreSQL (backend \"pg\"), workspaces POOL-CYCLE_ID",
                p.display()
            ));
        }
    }
    bail!(
        "with --store pg the module's tofu state must be in PostgreSQL too, or only the host that made a VM could destroy it: add `terraform {{ backend \"pg\" {{}} }}` to the module in {} (its connection from PG_CONN_STR, docs/operating.md)",
        dir.display()
    )
}

/// The directory node_exporter reads must take our temporary file and rename.
fn check_metrics_dir(path: &Path) -> anyhow::Result<String> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !parent.is_dir() {
        bail!(
            "--metrics-file {}: directory {} does not exist (is node_exporter's textfile directory created?)",
            path.display(),
            parent.display()
        );
    }
    if !writable(parent) {
        bail!(
            "--metrics-file {}: this user cannot write in {}; grant it write access (the role uses a POSIX ACL)",
            path.display(),
            parent.display()
        );
    }
    Ok(format!("{} can be written", path.display()))
}

fn nearest_existing(dir: &Path) -> Option<PathBuf> {
    dir.ancestors()
        .skip(1)
        .find(|p| p.exists())
        .map(Path::to_path_buf)
}

/// Whether this process may create files in `dir` (`faccessat` with the effective ids).
fn writable(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    unsafe {
        libc::faccessat(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::W_OK | libc::X_OK,
            libc::AT_EACCESS,
        ) == 0
    }
}
