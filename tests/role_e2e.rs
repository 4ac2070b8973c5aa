//! The Ansible role on a real systemd host: a Debian rootfs booted with systemd-nspawn (see
//! tests/role/role_e2e.sh), the role applied over SSH with ansible-core, the static binary, the
//! real tofu/terraform CLI inside the container, and the fake Forgejo on the host's loopback (the
//! container shares the host's network). Cycles are started by the timer only; the test never
//! runs `systemctl start`.
//!
//! Ignored by default (needs root, systemd-container, a rootfs and a venv); `.ci/role` runs it:
//! `ROLE_E2E_ROOTFS=<bookworm rootfs, modified in place> ANSIBLE_VENV=<venv with ansible-core>
//! cargo test --test role_e2e -- --ignored`. `ROLE_E2E_BINARY` defaults to `.ci/release`'s
//! dist/ci-ephemeral-provisioner (with its .sha256 beside it). Every play deploys
//! examples/ansible (site.yml, inventory, group_vars) with the test's variables over it; the last
//! one the example's own pool, with stand-ins for Forgejo, the cloud and the VM.

#[path = "it/support/mod.rs"]
mod support;

#[path = "role/qemu_e2e.rs"]
mod qemu;

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use support::fake_forgejo::{Conn, FakeForgejo, TOKEN_USER_ID};
use support::harness::API_TOKEN;
use support::tree::root;

const UNIT: &str = "ci-ephemeral-provisioner@default.service";
const STATE: &str = "var/lib/ci-ephemeral-provisioner/default";
/// Each pool's own system user: the role's prefix and the pool's name.
fn pool_user(pool: &str) -> String {
    format!("ci-ephemeral-{pool}")
}
/// The user every pool shared before each got its own, as an earlier version created it.
const SHARED_USER: &str = "ci-ephemeral-provisioner";
/// The default pool's secret_environment value (a stand-in for a cloud API token).
const CLOUD_SECRET: &str = "cloud-5ecret-4c7e";
/// node_exporter's textfile directory (the role's default), made by "someone else" before the
/// role runs: owned by nobody:nogroup, mode 0755.
const METRICS_DIR: &str = "/var/lib/prometheus/node-exporter";

/// The metrics file a pool writes into the textfile directory.
fn metrics_file(pool: &str) -> String {
    format!("{METRICS_DIR}/ci-ephemeral-provisioner-{pool}.prom")
}

/// The metrics file of slot K >= 2 of a pool with slots > 1 (slot 1 writes the pool's).
fn slot_metrics_file(pool: &str, slot: u32) -> String {
    format!("{METRICS_DIR}/ci-ephemeral-provisioner-{pool}.slot-{slot}.prom")
}

/// A sample line's metric name and labels (`name{a="1",b="2"} value`), and its value.
fn parse_sample(line: &str) -> Option<(&str, BTreeMap<&str, &str>, f64)> {
    let (series, value) = line.rsplit_once(' ')?;
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, rest.strip_suffix('}')?),
        None => (series, ""),
    };
    let labels = labels
        .split(',')
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (k, v) = l.split_once('=')?;
            Some((k, v.strip_prefix('"')?.strip_suffix('"')?))
        })
        .collect::<Option<BTreeMap<_, _>>>()?;
    Some((name, labels, value.trim().parse().ok()?))
}

/// The value of the sample `name` whose labels are exactly `labels` (in any order).
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: BTreeMap<&str, &str> = labels.iter().copied().collect();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(parse_sample)
        .find(|(n, l, _)| *n == name && *l == want)
        .map(|(_, _, v)| v)
}

/// The pool's metrics file: mode 0644, and every sample carries `pool="<pool>"` (so the files of
/// several pools can share the textfile directory). Returns its text.
fn pool_metrics(host: &Host, pool: &str) -> String {
    metrics_at(host, &metrics_file(pool), &[("pool", pool)])
}

/// A metrics file of `pool`'s: mode 0644, owned by the pool's user, more than ten samples, and
/// every sample carries the labels `want` (and maybe others). Returns its text.
fn metrics_at(host: &Host, path: &str, want: &[(&str, &str)]) -> String {
    let pool = want
        .iter()
        .find(|(k, _)| *k == "pool")
        .expect("a pool label")
        .1;
    assert_eq!(
        host.sh_ok(&format!("stat -c '%a %U' {path}")).trim(),
        format!("644 {}", pool_user(pool)),
        "{path}"
    );
    let text = host.sh_ok(&format!("cat {path}"));
    let samples: Vec<&str> = text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert!(samples.len() > 10, "{path}:\n{text}");
    for l in &samples {
        let (_, labels, _) =
            parse_sample(l).unwrap_or_else(|| panic!("not a sample in {path}: {l}"));
        for (k, v) in want {
            assert_eq!(
                labels.get(k),
                Some(v),
                "a sample without {k}=\"{v}\" in {path}: {l}"
            );
        }
    }
    text
}

/// A phase lap on stderr, with the seconds since the test began (shown with `--nocapture`, and
/// in the output of a failed test): where the time went, for a reader of a slow or failed CI log.
fn lap(what: &str) {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = START.get_or_init(Instant::now);
    eprintln!("[role_e2e {:6.1}s] {what}", start.elapsed().as_secs_f64());
}

fn required_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set; run this test through .ci/role (see the header of tests/role_e2e.rs)")
    })
}

/// The booted container; `Drop` always shuts it down (SIGTERM to nspawn) and tidies its cgroups.
struct Host {
    script: PathBuf,
    work: PathBuf,
    rootfs: PathBuf,
    /// The script's environment for this container (another SSH port, cgroup, nspawn arguments).
    env: Vec<(String, String)>,
}

impl Host {
    fn boot(work: &Path, rootfs: &Path) -> Host {
        Host::boot_with(work, rootfs, vec![])
    }

    fn boot_with(work: &Path, rootfs: &Path, env: Vec<(String, String)>) -> Host {
        let host = Host {
            script: root().join("tests/role/role_e2e.sh"),
            work: work.to_path_buf(),
            rootfs: rootfs.to_path_buf(),
            env,
        };
        let out = host.script(&["boot", path_str(work), path_str(rootfs)]);
        assert!(out.0, "booting the container failed:\n{}", out.1);
        host
    }

    /// Runs the script; (success, stdout + stderr).
    fn script(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(&self.script)
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .output()
            .expect("run tests/role/role_e2e.sh");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// ansible-playbook with these variables; (success, output, changed count).
    fn play(&self, name: &str, vars: &str) -> (bool, String, usize) {
        self.play_with(name, vars, &[])
    }

    /// The same, with more arguments for ansible-playbook.
    fn play_with(&self, name: &str, vars: &str, more: &[&str]) -> (bool, String, usize) {
        let started = Instant::now();
        let file = self.work.join(format!("{name}.yml"));
        fs::write(&file, vars).unwrap();
        // --diff shows the content of every changed file, except where the role says no_log.
        let mut args = vec!["play", path_str(&self.work), path_str(&file), "--diff"];
        args.extend_from_slice(more);
        let (ok, out) = self.script(&args);
        fs::write(self.work.join(format!("{name}.log")), &out).unwrap();
        lap(&format!(
            "play {name}: ok={ok} in {:.1}s",
            started.elapsed().as_secs_f64()
        ));
        let changed = out
            .lines()
            .filter(|l| l.contains("changed="))
            .filter_map(|l| {
                l.split("changed=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .sum();
        (ok, out, changed)
    }

    /// Runs a shell command inside the container; (success, stdout + stderr).
    fn sh(&self, cmd: &str) -> (bool, String) {
        self.script(&["exec", path_str(&self.work), "sh", "-c", cmd])
    }

    fn sh_ok(&self, cmd: &str) -> String {
        let (ok, out) = self.sh(cmd);
        assert!(ok, "`{cmd}` failed in the container:\n{out}");
        out
    }

    fn show(&self, unit: &str) -> BTreeMap<String, String> {
        self.sh_ok(&format!("systemctl show {unit}"))
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn journal(&self, unit: &str) -> String {
        self.sh_ok(&format!("journalctl -u {unit} --no-pager -o cat"))
    }

    /// A path inside the container, seen from the host (nspawn boots the directory itself).
    fn file(&self, rel: &str) -> PathBuf {
        self.rootfs.join(rel)
    }

    fn read(&self, rel: &str) -> String {
        fs::read_to_string(self.file(rel)).unwrap_or_default()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let (ok, out) = self.script(&["down", path_str(&self.work)]);
        if !ok {
            eprintln!("stopping the container failed:\n{out}");
        }
    }
}

/// Whether any 12 characters of `secret` are in `text` (a wrapped or cut copy counts).
fn holds_part_of(text: &str, secret: &str) -> bool {
    secret
        .as_bytes()
        .windows(12)
        .any(|w| text.contains(std::str::from_utf8(w).unwrap()))
}

/// The reports of tests/role/module/probe.sh from the default pool's cycles so far: one by the
/// module's local-exec (`tofu.<cycle>`), one under the launch command (`launch.<runner uuid>`),
/// each run as the pool's user inside the unit's sandbox. Each ran to its end and tried every
/// path it has — the credential directories, its own environment and fd 0, the token file, every
/// file of the state directory, and each ancestor's environ, mem and fd/ up to the binary, which
/// /proc does not even show it (ProtectProc=invisible hides what is not dumpable) — and none of
/// what it read holds the token. The control: each read some process's memory (a shell's, tofu's),
/// so the binary's refusal is its own (where Yama's ptrace_scope allows that at all).
fn assert_probes_found_no_token(host: &Host) {
    let dir = host.file(&format!("{STATE}/vm/probe"));
    let mut reports: Vec<(String, String)> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("no probe reports in {}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            (n.starts_with("tofu.") || n.starts_with("launch."))
                && ![".part", ".data", ".err", ".list"]
                    .iter()
                    .any(|x| n.ends_with(x))
        })
        .map(|n| {
            let text = fs::read_to_string(dir.join(&n)).unwrap();
            (n, text)
        })
        .collect();
    reports.sort();
    let names: Vec<&str> = reports.iter().map(|(n, _)| n.as_str()).collect();
    assert!(
        names.iter().any(|n| n.starts_with("tofu."))
            && names.iter().any(|n| n.starts_with("launch.")),
        "a probe did not run under tofu or under the launch command: {names:?}"
    );
    for (name, text) in &reports {
        assert!(
            !holds_part_of(text, API_TOKEN),
            "{name}: a child of the provisioner read the Forgejo token:\n{text}"
        );
        assert!(
            text.contains("\nEND tried="),
            "{name} did not finish:\n{text}"
        );
        let tried = text.lines().filter(|l| l.starts_with("TRY ")).count();
        assert!(tried >= 15, "{name}: only {tried} paths tried:\n{text}");
        let line = |prefix: &str| {
            text.lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("{name}: nothing tried as {prefix:?}:\n{text}"))
        };
        assert!(
            line("TRY $CREDENTIALS_DIRECTORY ").contains(" error "),
            "{name}"
        );
        assert!(
            line("TRY /run/credentials").contains(" error "),
            "{name}: {text}"
        );
        assert!(
            line("TRY /etc/ci-ephemeral-provisioner/forgejo-token ").contains("Permission denied"),
            "{name}"
        );
        line("TRY own environment ok");
        line("TRY own fd 0 ");
        line(&format!("TRY /{STATE}/ ok"));
        let state_files = text
            .lines()
            .filter(|l| l.starts_with(&format!("TRY /{STATE}/")))
            .count();
        assert!(
            state_files >= 5,
            "{name}: the state directory was not walked:\n{text}"
        );
        // The walk went up to the binary, which the sandbox does not show its children.
        let pid = text
            .lines()
            .find_map(|l| l.strip_prefix("ANCESTOR ")?.strip_suffix(" hidden"))
            .unwrap_or_else(|| {
                panic!("{name}: the provisioner was visible to its child (dumpable?):\n{text}")
            });
        for what in ["environ", "mem", "fd/"] {
            assert!(
                line(&format!("TRY /proc/{pid}/{what} ")).contains(" error "),
                "{name}: /proc/{pid}/{what}"
            );
        }
        // (Unless Yama's ptrace_scope keeps every process out of its ancestors' memory.)
        let unrestricted = text.lines().any(|l| l == "YAMA none" || l == "YAMA 0");
        assert!(
            !unrestricted
                || text
                    .lines()
                    .any(|l| l.starts_with("TRY /proc/") && l.contains("/mem ok ")),
            "{name}: no process's memory was readable at all:\n{text}"
        );
    }
    eprintln!(
        "  probes: {}",
        reports
            .iter()
            .map(|(n, t)| format!(
                "{n} ({} paths)",
                t.lines().filter(|l| l.starts_with("TRY ")).count()
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

/// As the user the gpu pool's units run as (whatever the unit says), nothing of the default
/// pool's is readable: its state directory (tofu state with SSH keys), its cache, its secret
/// environment file, and the environment and memory of a process of its user that holds its
/// secret environment, as its units do. The same commands as the default pool's user: the
/// control.
fn assert_pools_are_isolated(host: &Host) {
    let other = host.show("ci-ephemeral-provisioner@gpu.service")["User"].clone();
    let owner = pool_user("default");
    host.sh_ok(&format!(
        "systemd-run --quiet --unit=e2e-default-secrets --uid={owner} --gid={owner} \
         -p EnvironmentFile=/etc/ci-ephemeral-provisioner/pools/default/secret.env sleep 600"
    ));
    let pid = host
        .sh_ok("systemctl show -p MainPID --value e2e-default-secrets.service")
        .trim()
        .to_string();
    assert_ne!(pid, "0");
    let as_user = |user: &str, cmd: &str| {
        host.sh(&format!(
            "setpriv --reuid={user} --regid={user} --clear-groups -- sh -c '{cmd}'"
        ))
    };
    let paths = [
        "ls /var/lib/ci-ephemeral-provisioner/default".to_string(),
        "cat /var/lib/ci-ephemeral-provisioner/default/tofu/terraform.tfstate".to_string(),
        "cat /var/lib/ci-ephemeral-provisioner/default/last-run.json".to_string(),
        "ls /var/cache/ci-ephemeral-provisioner/default".to_string(),
        format!("cat /proc/{pid}/environ"),
        format!("dd if=/proc/{pid}/mem bs=1 count=0 status=none"),
    ];
    for cmd in &paths {
        let (ok, out) = as_user(&other, cmd);
        assert!(
            !ok,
            "the gpu pool's user {other} could `{cmd}` of the default pool's:\n{out}"
        );
        let (ok, out) = as_user(&owner, cmd);
        assert!(ok, "the control failed: {owner} could not `{cmd}`:\n{out}");
    }
    let (_, environ) = as_user(&owner, &format!("cat /proc/{pid}/environ"));
    assert!(environ.contains(CLOUD_SECRET), "{environ}");
    for user in [&other, &owner] {
        assert!(
            !as_user(
                user,
                "cat /etc/ci-ephemeral-provisioner/pools/default/secret.env"
            )
            .0,
            "{user} read the default pool's secret.env"
        );
    }
    host.sh_ok("systemctl stop e2e-default-secrets.service");
}

/// Slot 2 of the gpu pool (slots: 2): its own service unit file, written by the role for the
/// instance gpu.2, which systemd loads in place of the template and which passes the gates
/// (`systemd-analyze verify` and `security`); it runs as the pool's user with the pool's state
/// directory, the binary keeps its files in slot-2/ there, and `status` shows the slot.
fn assert_slot_2_of_gpu(host: &Host) {
    let unit = "ci-ephemeral-provisioner@gpu.2.service";
    let s = host.show(unit);
    for (key, want) in [
        (
            "FragmentPath",
            "/etc/systemd/system/ci-ephemeral-provisioner@gpu.2.service",
        ),
        ("User", "ci-ephemeral-gpu"),
        ("StateDirectory", "ci-ephemeral-provisioner/gpu"),
        ("CacheDirectory", "ci-ephemeral-provisioner/gpu"),
        ("TimeoutStartUSec", "1h 20min 20s"),
        ("Result", "success"),
    ] {
        assert_eq!(
            s.get(key).map(String::as_str),
            Some(want),
            "{unit} {key}: {s:?}"
        );
    }
    for timer in [
        "ci-ephemeral-provisioner@gpu.timer",
        "ci-ephemeral-provisioner@gpu.2.timer",
    ] {
        assert_eq!(
            host.sh_ok(&format!("systemctl is-enabled {timer}")).trim(),
            "enabled"
        );
        assert_eq!(
            host.sh_ok(&format!("systemctl is-active {timer}")).trim(),
            "active"
        );
    }
    // Slot 2 of 2 starts half the interval (2 s) after the boot delay (1 s); with 3 slots, the
    // staggered slots' phase finds a third of it.
    let monotonic = host
        .sh_ok("systemctl show -p TimersMonotonic --value ci-ephemeral-provisioner@gpu.2.timer");
    assert!(monotonic.contains("OnActiveUSec=2s ;"), "{monotonic}");
    host.sh_ok(&format!(
        "systemd-analyze verify --recursive-errors=no {unit} ci-ephemeral-provisioner@gpu.2.timer \
         && systemd-analyze security --threshold=20 {unit}"
    ));
    let env = host.read("etc/ci-ephemeral-provisioner/pools/gpu/provisioner.env");
    assert!(
        env.contains("\nCI_EPHEMERAL_PROVISIONER_SLOTS=\"2\"\n"),
        "{env}"
    );
    let slot_env = host.read("etc/ci-ephemeral-provisioner/pools/gpu/slot-2.env");
    assert!(
        slot_env.contains("\nCI_EPHEMERAL_PROVISIONER_SLOT=\"2\"\n"),
        "{slot_env}"
    );
    assert_eq!(
        host.sh_ok("stat -c '%a %U' /var/lib/ci-ephemeral-provisioner/gpu/slot-2")
            .trim(),
        "700 ci-ephemeral-gpu"
    );
    assert!(
        host.file("var/lib/ci-ephemeral-provisioner/gpu/slot-2/last-run.json")
            .exists(),
        "slot 2 keeps its files in slot-2/"
    );
    let status = host.sh_ok(
        "ci-ephemeral-provisioner status --state-dir /var/lib/ci-ephemeral-provisioner/gpu --slots 2 --slot 2",
    );
    eprintln!("  status of gpu slot 2:\n{status}");
}

/// The webhook receiver: with the default pool's timer stopped (only its wake unit can start it
/// now), an unsigned delivery is refused and starts nothing; the fake Forgejo's signed delivery
/// of a job's push starts the idle slot, which serves the job: exactly one start, after the
/// delivery was sent. The receiver runs as its own user with its secret alone, logs each
/// request and counts it.
fn assert_webhooks_wake_the_slot(host: &Host, fake: &FakeForgejo) {
    let url = format!("http://127.0.0.1:{}/", hook_port());
    host.sh_ok("systemctl stop ci-ephemeral-provisioner@default.timer");
    wait_until("the default pool to be idle", host, || {
        host.show(UNIT)["ActiveState"] != "activating"
    });
    let before = starts(host, UNIT).len();
    let payload = forgejo_model::webhook::push_payload(1, TOKEN_USER_ID, &"0".repeat(40));
    let unsigned = forgejo_model::webhook::delivery("", "e2e-unsigned-1", "push", "push", &payload);
    let (status, body) = support::webhook::deliver(&url, &unsigned).expect("the receiver answers");
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("refused (unsigned)"), "{body}");
    fake.set_webhook(&url, WEBHOOK_SECRET);
    let sent_at = monotonic_now();
    let (job, _) = fake.add_job(&["debian"]);
    wait_until(
        "the job, served by the slot its delivery started",
        host,
        || {
            fake.jobs()
                .iter()
                .any(|j| j.id == job && j.status == "success")
                && host.show(UNIT)["ActiveState"] == "inactive"
        },
    );
    fake.clear_webhook();
    let delivery = fake.deliveries()[0].clone();
    assert_eq!(
        delivery.answer,
        Ok((200, "woke default, gpu, gpu.2".into())),
        "{delivery:?}"
    );
    let after = starts(host, UNIT)[before..].to_vec();
    assert_eq!(
        after.len(),
        1,
        "one start, the signed delivery's (the unsigned one started nothing): {after:?}"
    );
    assert!(after[0] > sent_at, "{after:?} {sent_at}");
    eprintln!(
        "  the slot's run started {:.0} ms after the signed delivery was sent",
        (after[0] - sent_at) * 1e3
    );
    let log = host.sh_ok("journalctl --no-pager -o cat -u 'ci-ephemeral-provisioner-hook@*'");
    for line in [
        "refused a request from 127.0.0.1:".to_string(),
        format!("delivery \"{}\" (\"push\") from 127.0.0.1:", delivery.uuid),
    ] {
        assert!(
            log.contains(&line),
            "{line} is not in the receiver's log:\n{log}"
        );
    }
    assert!(!log.contains(WEBHOOK_SECRET) && !log.contains(API_TOKEN));
    let metrics = host.sh_ok(&format!(
        "cat {METRICS_DIR}/ci-ephemeral-provisioner-hook.prom"
    ));
    for (reason, n) in [("woke", 1.0), ("unsigned", 1.0)] {
        let outcome = if reason == "woke" {
            "accepted"
        } else {
            "refused"
        };
        assert_eq!(
            sample(
                &metrics,
                "ci_ephemeral_provisioner_hook_deliveries_total",
                &[("outcome", outcome), ("reason", reason)]
            ),
            Some(n),
            "{metrics}"
        );
    }
    // Its own user, its secret by LoadCredential=, nothing of the pools'.
    let unit = host.sh_ok("systemctl cat ci-ephemeral-provisioner-hook@.service");
    for line in [
        "\nUser=ci-ephemeral-hook\n",
        "\nLoadCredential=webhook-secret:/etc/ci-ephemeral-provisioner/webhook-secret\n",
        "\nPrivateNetwork=yes\n",
    ] {
        assert!(unit.contains(line), "{line:?} missing:\n{unit}");
    }
    assert!(!unit.contains("forgejo-token\n") && !unit.contains("StandardInput=file"));
    // One sender cannot take every connection the socket accepts.
    let socket = host.show("ci-ephemeral-provisioner-hook.socket");
    assert_eq!(
        (
            socket["MaxConnections"].as_str(),
            socket["MaxConnectionsPerSource"].as_str()
        ),
        ("64", "32")
    );
    host.sh_ok(
        "systemd-analyze verify --recursive-errors=no ci-ephemeral-provisioner-hook.socket \
         ci-ephemeral-provisioner@default.path",
    );
    // Two start sources: no start rate limit, whose hit would stop the timer and the wake unit.
    for slot in ["default", "gpu", "gpu.2"] {
        let unit = format!("ci-ephemeral-provisioner@{slot}.service");
        assert_eq!(host.show(&unit)["StartLimitIntervalUSec"], "0", "{unit}");
        let path = format!("ci-ephemeral-provisioner@{slot}.path");
        assert_eq!(
            host.sh_ok(&format!("systemctl is-active {path}")).trim(),
            "active",
            "{path}"
        );
    }
    host.sh_ok("systemctl start ci-ephemeral-provisioner@default.timer");
}

/// A systemd time span as `systemctl show` prints it ("1h 11min 23.997183s", "0", or plain µs),
/// in µs.
fn span_us(text: &str) -> Option<u64> {
    if let Ok(us) = text.parse() {
        return Some(us);
    }
    let mut total = 0.0;
    for part in text.split_whitespace() {
        let at = part.find(|c: char| c.is_ascii_alphabetic())?;
        let (n, unit) = part.split_at(at);
        let n: f64 = n.parse().ok()?;
        let us = match unit {
            "us" => 1.0,
            "ms" => 1e3,
            "s" => 1e6,
            "min" => 60e6,
            "h" => 3600e6,
            "d" => 86400e6,
            _ => return None,
        };
        total += n * us;
    }
    Some(total.round() as u64)
}

/// What Ansible reported for the role's task `name` in a play's output: `ok`, `changed`,
/// `skipping`, `fatal` (the first host line after the task's header), or None when it never ran.
fn task_status<'a>(out: &'a str, name: &str) -> Option<&'a str> {
    let header = format!("TASK [ci_ephemeral_provisioner : {name}]");
    let mut lines = out.lines().skip_while(|l| !l.starts_with(&header)).skip(1);
    lines.find_map(|l| {
        let (status, rest) = l.split_once(": [")?;
        (!rest.is_empty() && ["ok", "changed", "skipping", "fatal"].contains(&status))
            .then_some(status)
    })
}

#[test]
fn task_status_reads_the_line_after_the_tasks_header() {
    let out = "TASK [ci_ephemeral_provisioner : Stage it] ***\n--- before\n+++ after\n\
               changed: [h]\n\nTASK [ci_ephemeral_provisioner : Install it] ***\nok: [h]\n";
    assert_eq!(task_status(out, "Stage it"), Some("changed"));
    assert_eq!(task_status(out, "Install it"), Some("ok"));
    assert_eq!(task_status(out, "Other"), None);
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// Polls `cond` (a hang guard, not a timing assertion: CI machines are slow and shared).
fn wait_until(what: &str, host: &Host, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    lap(&format!("waiting for {what}"));
    while !cond() {
        if start.elapsed() > Duration::from_secs(240) {
            let journal = host.journal(UNIT);
            panic!("timed out waiting for {what}; journal of {UNIT}:\n{journal}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    lap(&format!("  after {:.1}s", start.elapsed().as_secs_f64()));
}

/// Where the role takes the binary from (the other source emptied: the example's group_vars
/// name a local path).
enum Source<'a> {
    /// A file on the controller, checked against the `.sha256` file beside it.
    Local(&'a Path),
    /// A file on the controller and the SHA-256 it must have.
    LocalWithSha256 {
        path: &'a Path,
        sha256: String,
    },
    Url {
        url: String,
        sha256: String,
    },
}

impl Source<'_> {
    fn yaml(&self) -> String {
        match self {
            Source::Local(p) => format!(
                "ci_ephemeral_provisioner_binary_local_path: {}\nci_ephemeral_provisioner_binary_url: \"\"",
                p.display()
            ),
            Source::LocalWithSha256 { path, sha256 } => format!(
                "ci_ephemeral_provisioner_binary_local_path: {}\nci_ephemeral_provisioner_binary_url: \"\"\n\
                 ci_ephemeral_provisioner_binary_sha256: \"{sha256}\"",
                path.display()
            ),
            Source::Url { url, sha256 } => format!(
                "ci_ephemeral_provisioner_binary_local_path: \"\"\nci_ephemeral_provisioner_binary_url: {url}\n\
                 ci_ephemeral_provisioner_binary_sha256: \"{sha256}\""
            ),
        }
    }
}

/// Serves `bytes` to every GET on 127.0.0.1 (the container shares the host's loopback); counts
/// the requests.
fn serve_file(bytes: Vec<u8>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "http://{}/ci-ephemeral-provisioner",
        listener.local_addr().unwrap()
    );
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&hits);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            counter.fetch_add(1, Ordering::SeqCst);
            let header = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                bytes.len()
            );
            let _ = stream.write_all(header.as_bytes());
            let _ = stream.write_all(&bytes);
        }
    });
    (url, hits)
}

fn sha256_hex(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// The webhook's secret in every play but the example's.
const WEBHOOK_SECRET: &str = "e2e-whsec-61b0c2d94f7a";

/// The port the webhook receiver listens on, on the loopback the container shares: free when
/// the test began.
fn hook_port() -> u16 {
    static PORT: OnceLock<u16> = OnceLock::new();
    *PORT.get_or_init(|| {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port for the webhook receiver")
    })
}

/// CLOCK_MONOTONIC, in seconds: the clock of systemd's and the journal's monotonic times in the
/// container too (it shares the kernel).
fn monotonic_now() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `t` is.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) },
        0
    );
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// When each start of `unit` began (systemd's "Starting …" line, monotonic seconds).
fn starts(host: &Host, unit: &str) -> Vec<f64> {
    host.sh_ok(&format!(
        "journalctl --no-pager -o short-monotonic UNIT={unit} MESSAGE_ID=7d4958e842da4a758f6c1cdc7b36dcc5"
    ))
    .lines()
    .filter_map(|l| l.strip_prefix('[')?.split(']').next()?.trim().parse().ok())
    .collect()
}

/// `vars` with the webhook receiver on [`hook_port`] (the first deployment and its repetition;
/// the next play that reaches the units, without it, removes it).
fn with_webhook(vars: String) -> String {
    format!(
        "{vars}ci_ephemeral_provisioner_webhook_listen: 127.0.0.1:{}\nci_ephemeral_provisioner_webhook_secret: {WEBHOOK_SECRET}\n",
        hook_port()
    )
}

/// Role variables: the fake Forgejo, the test module, the default (SSH) launch command aimed at
/// the container's own sshd, short timer and cycle durations. `pools` is the YAML of the list.
fn vars(fake: &FakeForgejo, work: &Path, source: &Source, pools: &str) -> String {
    let known_hosts = fs::read_to_string(work.join("known_hosts")).expect("known_hosts from boot");
    let module = root().join("tests/role/module");
    format!(
        r#"---
{source}
ci_ephemeral_provisioner_forgejo_url: {url}
ci_ephemeral_provisioner_forgejo_token: {API_TOKEN}
ci_ephemeral_provisioner_timer_boot_delay: 1s
ci_ephemeral_provisioner_timer_interval: 2s
ci_ephemeral_provisioner_timer_accuracy: 100ms
ci_ephemeral_provisioner_pool_defaults:
  runner_prefix: ephemeral-
  labels: ""
  scope: admin
  tofu_module_src: {module}
  tofu_bin: /usr/local/bin/tofu
  environment:
    VM_DIR: /var/lib/ci-ephemeral-provisioner/default/vm
    TF_VAR_ssh_key_path: /etc/e2e/id_vm
    # The default launch command finds the probe's ssh first (tests/role/probe-bin/ssh,
    # installed there by role_e2e.sh).
    PATH: /etc/e2e/probe-bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  secret_environment: {{}}
  launch_command: ""
  launch:
    address_output: address
    ssh_private_key_output: ssh_private_key
    ssh_user: root
    ssh_port: 2222
    known_hosts: "{known_hosts}"
    known_hosts_output: ""
    runner_bin: /usr/local/bin/forgejo-runner
    runner_dir: /var/lib/forgejo-runner
    connect_timeout: 10
  launch_timeout: 30s
  max_jobs_per_vm: 10
  idle_timeout: 1s
  registration_grace: 5s
  job_pickup_timeout: 2m
  poll_interval: 500ms
  max_cycle_duration: 10m
  hard_deadline: 20m
  sweep_max_deletions: 50
  http_timeout: 5s
  verbose: true
  wake_window: 2s
ci_ephemeral_provisioner_pools:
{pools}
"#,
        source = source.yaml(),
        url = fake.url(),
        module = module.display(),
        known_hosts = known_hosts.trim(),
    )
}

#[test]
#[ignore = "needs root, systemd-container, a rootfs and ansible: run by .ci/role"]
fn role_deploys_pools_that_the_timer_runs_on_a_real_systemd_host() {
    lap("start");
    let rootfs = PathBuf::from(required_env("ROLE_E2E_ROOTFS"));
    required_env("ANSIBLE_VENV");
    let binary = std::env::var("ROLE_E2E_BINARY")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root().join("dist/ci-ephemeral-provisioner"));
    assert!(
        binary.is_file() && binary.with_extension("sha256").is_file(),
        "{} or its .sha256 is missing: run .ci/release first",
        binary.display()
    );
    // ROLE_E2E_WORK keeps the keys, inventory, variables and logs for a look afterwards.
    let tmp = tempfile::tempdir().unwrap();
    let kept = std::env::var_os("ROLE_E2E_WORK").map(PathBuf::from);
    let work = kept.as_deref().unwrap_or(tmp.path());

    // Forgejo before the role: stale registrations of ours, another pool's, a persistent runner,
    // one of ours that is online, and a job for the default pool.
    let fake = FakeForgejo::start(API_TOKEN);
    let stale_a = fake.add_runner("ephemeral-stale-a", true, Conn::NeverConnected);
    let stale_b = fake.add_runner(
        "ephemeral-stale-b",
        true,
        Conn::OfflineFor(Duration::from_secs(7200)),
    );
    let other_pool = fake.add_runner("gpu-stale", true, Conn::NeverConnected);
    let persistent = fake.add_runner(
        "build-01",
        false,
        Conn::OfflineFor(Duration::from_secs(7200)),
    );
    let online = fake.add_runner("ephemeral-online", true, Conn::Idle);
    let (job, handle) = fake.add_job(&["debian"]);

    lap("booting the container");
    let host = Host::boot(work, &rootfs);
    let local = Source::Local(&binary);
    // node_exporter's textfile directory exists already, owned by someone else; setfacl is not
    // installed (the role installs the acl package).
    host.sh_ok(&format!(
        "install -d -o nobody -g nogroup -m 0755 {METRICS_DIR} && ! command -v setfacl"
    ));
    // An earlier version ran every pool as one shared user, which owns the default pool's state
    // directory: the role retires that user, and systemd hands the directory to the pool's own.
    host.sh_ok(&format!(
        "useradd --system --user-group --home-dir /var/lib/ci-ephemeral-provisioner --no-create-home \
         --shell /usr/sbin/nologin --comment ci-ephemeral-provisioner {SHARED_USER} \
         && install -d -m 0755 /var/lib/ci-ephemeral-provisioner \
         && install -d -o {SHARED_USER} -g {SHARED_USER} -m 0700 /{STATE} \
         && install -o {SHARED_USER} -g {SHARED_USER} -m 0600 /dev/null /{STATE}/from-the-shared-user"
    ));
    // The default pool has a cloud secret for tofu (secret_environment); the gpu pool its own
    // VM directory (in its own state directory: it may not write the default pool's).
    let two_pools = "  - name: default\n    runner_prefix: ephemeral-\n    labels: debian:host,arm64:host\n\
                     \x20   secret_environment:\n      E2E_CLOUD_TOKEN: cloud-5ecret-4c7e\n\
                     \x20 - name: gpu\n    runner_prefix: gpu-\n    labels: gpu:host\n    slots: 2\n\
                     \x20   environment:\n      VM_DIR: /var/lib/ci-ephemeral-provisioner/gpu/vm\n";

    lap("phase: preflight refusals");
    // Preflight refuses pools whose prefixes overlap, before touching the host.
    let overlap = "  - name: default\n    runner_prefix: ephemeral-\n    labels: debian:host\n\
                   \x20 - name: more\n    runner_prefix: ephemeral-more-\n    labels: more:host\n";
    let (ok, out, _) = host.play("overlap", &vars(&fake, work, &local, overlap));
    assert!(!ok, "overlapping prefixes were accepted:\n{out}");
    assert!(
        out.contains("runner_prefix ephemeral-more- starts with pool default's"),
        "{out}"
    );
    assert!(!host.file("etc/ci-ephemeral-provisioner").exists());
    // ... and a pool whose user name would be longer than systemd accepts (31 characters).
    let long =
        "  - name: a-pool-name-far-too-long\n    runner_prefix: long-\n    labels: long:host\n";
    let (ok, out, _) = host.play("long-name", &vars(&fake, work, &local, long));
    assert!(!ok, "a pool with a user name too long was accepted:\n{out}");
    assert!(
        out.contains("would run as the user ci-ephemeral-a-pool-name-far-too-long, 37 characters; systemd accepts at most 31"),
        "{out}"
    );
    assert!(!host.file("etc/ci-ephemeral-provisioner").exists());
    // ... and a webhook secret of blanks (every delivery would be refused) or too short to resist
    // a guess against one captured delivery.
    for secret in ["'                    '", "short-5ecret"] {
        let weak = format!(
            "{}ci_ephemeral_provisioner_webhook_listen: 127.0.0.1:{}\nci_ephemeral_provisioner_webhook_secret: {secret}\n",
            vars(&fake, work, &local, two_pools),
            hook_port()
        );
        let (ok, out, _) = host.play("weak-secret", &weak);
        assert!(
            !ok && out.contains("at least 16 characters"),
            "{secret}:\n{out}"
        );
        assert!(!host.file("etc/ci-ephemeral-provisioner").exists());
    }

    lap("phase: first deployment and its first job");
    // First run: installs and enables the timers; the timers start the cycles.
    let (ok, out, changed) = host.play("site", &with_webhook(vars(&fake, work, &local, two_pools)));
    assert!(ok, "the role failed:\n{out}");
    assert!(changed > 0, "{out}");
    for secret in [API_TOKEN, CLOUD_SECRET] {
        assert!(!out.contains(secret), "Ansible printed a secret:\n{out}");
    }

    wait_until(
        "the job to be run and the default pool back at rest",
        &host,
        || {
            let s = host.show(UNIT);
            assert_ne!(
                s["ActiveState"],
                "failed",
                "a run of the default pool failed:\n{}",
                host.journal(UNIT)
            );
            fake.jobs()
                .iter()
                .any(|j| j.id == job && j.status == "success")
                && !host.file(&format!("{STATE}/cycle.json")).exists()
                && host
                    .read("var/lib/ci-ephemeral-provisioner/default/vm/vm.log")
                    .contains("destroy ")
                && s["ActiveState"] == "inactive"
                && s["Result"] == "success"
        },
    );

    // The fake saw one registration per job, created under our prefix, the stale ones swept and
    // everything else untouched.
    let posts: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.path == "/api/v1/admin/actions/runners")
        .collect();
    assert_eq!(
        posts.len(),
        1,
        "one registration for the one job: {posts:?}"
    );
    let deleted = fake.deleted_ids();
    assert!(
        deleted.contains(&stale_a) && deleted.contains(&stale_b),
        "stale ones swept: {deleted:?}"
    );
    let alive: Vec<i64> = fake.runners().iter().map(|r| r.id).collect();
    for (id, what) in [
        (other_pool, "another pool's"),
        (persistent, "the persistent"),
        (online, "the online"),
    ] {
        assert!(
            alive.contains(&id),
            "{what} runner was deleted: {:?}",
            fake.runners()
        );
    }
    assert!(
        fake.runners()
            .iter()
            .all(|r| !r.name.starts_with("ephemeral-") || r.id == online),
        "our registrations left behind: {:?}",
        fake.runners()
    );

    // systemd's view: the pool's own non-root user ran it, it exited 0, the timer started it.
    let s = host.show(UNIT);
    assert_eq!(
        s.get("User").map(String::as_str),
        Some(pool_user("default").as_str()),
        "the service must run as the pool's user: {s:?}"
    );
    assert_eq!(s["ExecMainStatus"], "0", "{s:?}");
    assert_eq!(s["Result"], "success");
    let uid = host
        .sh_ok(&format!("id -u {}", pool_user("default")))
        .trim()
        .to_string();
    assert_ne!(uid, "0");
    assert_ne!(
        uid,
        host.sh_ok(&format!("id -u {}", pool_user("gpu"))).trim(),
        "two pools share a uid"
    );
    // The shared user of earlier versions is gone; what it owned is the pool's now (systemd
    // chowns a StateDirectory= whose owner is not the unit's user).
    assert!(
        !host.sh(&format!("getent passwd {SHARED_USER}")).0,
        "the shared user of earlier versions is still there"
    );
    assert_eq!(
        host.sh_ok(&format!(
            "stat -c %U /{STATE} /{STATE}/from-the-shared-user"
        ))
        .split_whitespace()
        .collect::<Vec<_>>(),
        [pool_user("default"), pool_user("default")]
    );

    // Every path to the token that a child has, tried by a hostile module step (a local-exec)
    // and by a hostile program under the launch command (the ssh it finds on PATH): the token
    // is in none of what they read.
    assert_probes_found_no_token(&host);
    // One pool's user cannot read another pool's state, cache, secret environment, or the
    // environment and memory of its processes.
    assert_pools_are_isolated(&host);
    assert_eq!(
        host.read("var/lib/ci-ephemeral-provisioner/default/vm/uid.create")
            .trim(),
        uid,
        "tofu ran as the service user"
    );
    // The unit as systemd loaded it: oneshot, a start timeout of hard_deadline + margin + the
    // watch of a woken run (10 wake windows of 2s), a stop that reaches the binary only, exit 75
    // (lock held) counted as success, private files.
    for (key, want) in [
        ("Type", "oneshot"),
        ("TimeoutStartUSec", "1h 20min 20s"),
        ("KillMode", "mixed"),
        ("UMask", "0077"),
        ("StateDirectory", "ci-ephemeral-provisioner/default"),
        ("CacheDirectory", "ci-ephemeral-provisioner/default"),
    ] {
        assert_eq!(s.get(key).map(String::as_str), Some(want), "{key}: {s:?}");
    }
    // The token comes as standard input, opened by systemd; no credential directory.
    let unit = host.sh_ok(&format!("systemctl cat {UNIT}"));
    for line in [
        "\nStandardInput=file:/etc/ci-ephemeral-provisioner/forgejo-token\n",
        "\nStandardOutput=journal\n",
        "\nEnvironment=CI_EPHEMERAL_PROVISIONER_TOKEN_FILE=-\n",
        "\nUser=ci-ephemeral-%i\n",
    ] {
        assert!(unit.contains(line), "{line:?} missing:\n{unit}");
    }
    assert!(!unit.contains("LoadCredential"), "{unit}");
    let timer = host.show("ci-ephemeral-provisioner@default.timer");
    let fired = &timer["LastTriggerUSec"];
    assert!(
        !fired.is_empty() && fired != "n/a",
        "the timer never fired: {timer:?}"
    );
    // One TimersMonotonic= line per timer setting.
    let triggers =
        host.sh_ok("systemctl show -p TimersMonotonic ci-ephemeral-provisioner@default.timer");
    assert!(
        triggers.contains("OnUnitInactiveUSec=2s") && triggers.contains("OnActiveUSec=1s"),
        "{triggers}"
    );

    lap("phase: a start while the lock is held");
    // A start while another run holds the lock exits 75, which the unit counts as success.
    // The holder waits for the lock (a run may have it), says so, and keeps it until released.
    fs::write(host.file("var/tmp/hold"), "").unwrap();
    let mut holder = Command::new(&host.script)
        .args(["exec", path_str(&host.work), "flock"])
        .arg(format!("/{STATE}/cycle.lock"))
        .args([
            "sh",
            "-c",
            "touch /var/tmp/lock-held; while [ -e /var/tmp/hold ]; do sleep 0.2; done",
        ])
        .stdin(Stdio::null())
        .spawn()
        .expect("hold the lock");
    wait_until("the test to hold the lock", &host, || {
        host.file("var/tmp/lock-held").exists()
    });
    let before = host.show(UNIT)["InvocationID"].clone();
    wait_until("a run skipped because the lock is held", &host, || {
        let s = host.show(UNIT);
        s["InvocationID"] != before && s["ActiveState"] != "activating"
    });
    let skipped = host.show(UNIT);
    fs::remove_file(host.file("var/tmp/hold")).unwrap();
    let _ = holder.wait();
    assert_eq!(
        (
            skipped["ExecMainStatus"].as_str(),
            skipped["Result"].as_str()
        ),
        ("75", "success"),
        "{skipped:?}"
    );
    assert_eq!(
        host.sh_ok("systemctl is-enabled ci-ephemeral-provisioner@default.timer")
            .trim(),
        "enabled"
    );
    assert_eq!(
        host.sh_ok("systemctl is-enabled ci-ephemeral-provisioner@default.service || true")
            .trim(),
        "static"
    );
    let journal = host.journal(UNIT);
    assert!(journal.contains("running /usr/local/bin/tofu"), "{journal}");

    // The default launch command ran forgejo-runner one-job on the "VM" over SSH, the runner
    // token in a 0600 file there.
    let runner_log = host.read("var/log/fake-forgejo-runner.jsonl");
    let launch: serde_json::Value =
        serde_json::from_str(runner_log.lines().next().unwrap_or("null")).unwrap();
    assert_eq!(launch["token_file_mode"], "0o600", "{runner_log}");
    let argv: Vec<String> = serde_json::from_value(launch["argv"].clone()).unwrap();
    assert_eq!(argv[0], "one-job");
    assert!(
        argv.windows(2)
            .any(|w| w[0] == "--handle" && w[1] == handle),
        "{argv:?}"
    );
    assert!(
        argv.windows(2)
            .any(|w| w[0] == "--url" && w[1] == fake.url()),
        "{argv:?}"
    );
    assert!(
        argv.windows(2)
            .any(|w| w[0] == "--token-url" && w[1].starts_with("file:")),
        "{argv:?}"
    );
    assert!(argv.iter().any(|a| a == "--wait"), "{argv:?}");
    // One --label per entry of the pool's labels, each whole, as given: the stand-in declares
    // their names, and the fake (Forgejo's rule) gives a job only to a runner that declared
    // every name the job runs on — the job above ran because of them.
    let labels: Vec<&str> = argv
        .windows(2)
        .filter(|w| w[0] == "--label")
        .map(|w| w[1].as_str())
        .collect();
    assert_eq!(labels, ["debian:host", "arm64:host"], "{argv:?}");

    lap("phase: two repositories, two VMs");
    // Two jobs of two repositories wait at once. Under the role's default (--reuse-within repo)
    // the VM that ran the one never runs the other: each gets a VM of its own, although the pool
    // may run 10 jobs on one VM (--max-jobs-per-vm).
    let creates = || {
        host.read("var/lib/ci-ephemeral-provisioner/default/vm/vm.log")
            .matches("create ")
            .count()
    };
    let creates_before = creates();
    let (repo_a_job, _) = fake.add_scoped_job(&["debian"], TOKEN_USER_ID, 1);
    let (repo_b_job, _) = fake.add_scoped_job(&["debian"], TOKEN_USER_ID, 2);
    wait_until(
        "the jobs of two repositories to be run and the default pool back at rest",
        &host,
        || {
            let s = host.show(UNIT);
            assert_ne!(
                s["ActiveState"],
                "failed",
                "a run failed while serving two repositories:\n{}",
                host.journal(UNIT)
            );
            let done = |id: i64| {
                fake.jobs()
                    .iter()
                    .any(|j| j.id == id && j.status == "success")
            };
            done(repo_a_job)
                && done(repo_b_job)
                && !host.file(&format!("{STATE}/cycle.json")).exists()
                && s["ActiveState"] == "inactive"
        },
    );
    assert_eq!(
        creates() - creates_before,
        2,
        "the jobs of two repositories shared a VM:\n{}",
        host.read("var/lib/ci-ephemeral-provisioner/default/vm/vm.log")
    );

    lap("phase: a launch while sshd is down");
    // A VM whose sshd is not up yet when its job arrives (it boots slowly): the launch command
    // waits for sshd instead of failing, and the first launch serves the job. The "VM" is the
    // container itself; host.sh reaches it with nsenter, not ssh, and Ansible is not needed
    // meanwhile. The job runs on both labels, so only a runner that declared both gets it.
    host.sh_ok("systemctl stop ssh.socket ssh.service");
    assert!(
        std::net::TcpStream::connect("127.0.0.1:2222").is_err(),
        "sshd still answers on 127.0.0.1:2222"
    );
    let launches = |j: &str| j.matches("launching runner").count();
    let before = launches(&host.journal(UNIT));
    let (job3, _) = fake.add_job(&["debian", "arm64"]);
    wait_until("a launch while the VM's sshd is down", &host, || {
        launches(&host.journal(UNIT)) > before
    });
    let down = Instant::now();
    std::thread::sleep(Duration::from_secs(6));
    host.sh_ok("systemctl start ssh.service");
    eprintln!(
        "sshd down for {:.1?} after the launch began",
        down.elapsed()
    );
    wait_until(
        "the job to be served by the launch that waited for sshd",
        &host,
        || {
            let s = host.show(UNIT);
            assert_ne!(
                s["ActiveState"],
                "failed",
                "a run failed while sshd was down:\n{}",
                host.journal(UNIT)
            );
            fake.jobs()
                .iter()
                .any(|j| j.id == job3 && j.status == "success")
                && !host.file(&format!("{STATE}/cycle.json")).exists()
                && s["ActiveState"] == "inactive"
        },
    );
    // The run report in the journal: one launch for the job, a success that lasted about as
    // long as sshd was down (`ok    7.41s launch_runner runner 12 ephemeral-…: for job 3`).
    let journal = host.journal(UNIT);
    assert!(
        !journal
            .lines()
            .any(|l| l.trim_start().starts_with("FAIL") && l.contains(" launch_runner ")),
        "a launch failed instead of waiting for sshd:\n{journal}"
    );
    let for_job = format!(": for job {job3}");
    let reported: Vec<&str> = journal
        .lines()
        .filter(|l| l.contains(" launch_runner ") && l.trim_end().ends_with(&for_job))
        .collect();
    assert_eq!(reported.len(), 1, "one launch for job {job3}:\n{journal}");
    let line = reported[0].trim();
    eprintln!("  the run report: {line}");
    assert!(line.starts_with("ok "), "{line}");
    let took: f64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|t| t.strip_suffix('s'))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no duration in {line}"));
    assert!(
        took >= 5.0,
        "the launch took {took}s: it did not wait for sshd (down for 6 s after it began):\n{journal}"
    );
    let records = host.read("var/log/fake-forgejo-runner.jsonl");
    // The first job, the two repositories' and the one that waited for sshd.
    assert_eq!(records.lines().count(), 4, "one runner per job:\n{records}");

    lap("phase: webhooks");
    assert_webhooks_wake_the_slot(&host, &fake);

    lap("phase: secrets, check units, recovery by hand, gates");
    // The token: a root-only file (the units' standard input), nowhere else.
    assert_eq!(
        host.sh_ok("stat -c '%U:%G %a' /etc/ci-ephemeral-provisioner/forgejo-token")
            .trim(),
        "root:root 600"
    );
    let (found, grep) = host.sh(&format!(
        "grep -rl {API_TOKEN} /etc/systemd/system /etc/ci-ephemeral-provisioner/pools /var/lib/ci-ephemeral-provisioner"
    ));
    assert!(
        !found,
        "the token is in files other than the token file: {grep}"
    );
    assert!(
        !host
            .sh_ok("journalctl --no-pager -o verbose")
            .contains(API_TOKEN),
        "the token is in the journal"
    );
    let tofu_env = host.read("var/lib/ci-ephemeral-provisioner/default/vm/tofu-env.create");
    assert!(
        tofu_env.contains("TF_DATA_DIR=/var/lib/ci-ephemeral-provisioner/default/tofu-data"),
        "{tofu_env}"
    );
    assert!(
        tofu_env.contains("TF_PLUGIN_CACHE_DIR=/var/cache/ci-ephemeral-provisioner/default"),
        "{tofu_env}"
    );
    // The cloud secret reaches tofu, from a root-only file, and nothing else shows it.
    assert!(
        tofu_env.contains(&format!("E2E_CLOUD_TOKEN={CLOUD_SECRET}")),
        "{tofu_env}"
    );
    assert_eq!(
        host.sh_ok("stat -c '%U:%G %a' /etc/ci-ephemeral-provisioner/pools/default/secret.env")
            .trim(),
        "root:root 600"
    );
    assert!(
        !host
            .read("etc/ci-ephemeral-provisioner/pools/default/provisioner.env")
            .contains(CLOUD_SECRET)
    );
    assert!(
        !host.journal(UNIT).contains(CLOUD_SECRET),
        "the cloud secret is in the journal"
    );
    for leak in [
        API_TOKEN,
        "CREDENTIALS_DIRECTORY",
        "CI_EPHEMERAL_PROVISIONER_",
    ] {
        assert!(
            !tofu_env.contains(leak),
            "tofu's environment has {leak}:\n{tofu_env}"
        );
    }

    // `check` ran for each pool at deploy time, under the pool's user, token and sandbox, and
    // everything passed.
    for pool in ["default", "gpu"] {
        let unit = format!("ci-ephemeral-provisioner-check@{pool}.service");
        let s = host.show(&unit);
        assert_eq!(
            (s["Result"].as_str(), s["ExecMainStatus"].as_str()),
            ("success", "0"),
            "{unit}: {s:?}"
        );
        assert_eq!(
            s.get("User").map(String::as_str),
            Some(pool_user(pool).as_str())
        );
        let j = host.journal(&unit);
        assert!(j.contains("all 9 checks passed"), "{unit}:\n{j}");
        assert!(
            !j.contains(API_TOKEN),
            "{unit}: the token is in the journal"
        );
    }

    // Recovery by hand: the pool's tofu as the service's user, with the pool's environment and
    // secret environment, on the pool's working copy (a "VM" applied and destroyed).
    let vm_dir = "var/lib/ci-ephemeral-provisioner/default/vm";
    fs::remove_file(host.file(&format!("{vm_dir}/uid.create"))).unwrap();
    // The sandbox of the unit's tofu (tests/role/module/vm.sh): seccomp filter, no new
    // privileges, /proc showing only its own user's processes (ProtectProc, ProcSubset).
    let sandbox_file = format!("{vm_dir}/sandbox.create");
    let of_the_unit = host.read(&sandbox_file);
    assert_eq!(
        of_the_unit,
        "NoNewPrivs:\t1\nSeccomp:\t2\npid 1 hidden\n/proc/sys hidden\n"
    );
    fs::remove_file(host.file(&sandbox_file)).unwrap();
    host.sh_ok(
        "TF_VAR_cycle_id=by-hand ci-ephemeral-provisioner-tofu default apply -auto-approve -no-color -input=false \
         && ci-ephemeral-provisioner-tofu default destroy -auto-approve -no-color -input=false",
    );
    assert_eq!(host.read(&format!("{vm_dir}/uid.create")).trim(), uid);
    let by_hand = host.read(&format!("{vm_dir}/vm.log"));
    assert!(
        by_hand.contains("create by-hand\n") && by_hand.contains("destroy by-hand\n"),
        "{by_hand}"
    );
    let recovery_env = host.read(&format!("{vm_dir}/tofu-env.create"));
    assert!(
        recovery_env.contains(&format!("E2E_CLOUD_TOKEN={CLOUD_SECRET}")),
        "{recovery_env}"
    );
    assert!(!recovery_env.contains(API_TOKEN) && !recovery_env.contains("CREDENTIALS_DIRECTORY"));
    // The recovery wrapper's tofu runs in the same sandbox.
    assert_eq!(
        host.read(&sandbox_file),
        of_the_unit,
        "ci-ephemeral-provisioner-tofu"
    );
    let (ok, out) = host.sh("ci-ephemeral-provisioner-tofu no-such-pool destroy");
    assert!(
        !ok && out.contains("no pool no-such-pool on this host"),
        "{out}"
    );

    // The gates on the units as installed (systemd 252 in the container).
    host.sh_ok(
        "d=$(mktemp -d) && cp /etc/systemd/system/ci-ephemeral-provisioner@.service $d/ci-ephemeral-provisioner@default.service \
         && systemd-analyze verify --recursive-errors=no $d/ci-ephemeral-provisioner@default.service /etc/systemd/system/ci-ephemeral-provisioner@.timer \
         && systemd-analyze security --offline=true --threshold=20 $d/ci-ephemeral-provisioner@default.service",
    );
    host.sh_ok("systemd-analyze verify --recursive-errors=no ci-ephemeral-provisioner@default.service ci-ephemeral-provisioner@default.timer");
    host.sh_ok("systemd-analyze security --threshold=20 ci-ephemeral-provisioner@default.service");

    lap("phase: the gpu pool, its slot 2, metrics");
    // The other pool ran too (idle: nothing to do) and kept its hands off: both its slots.
    for unit in [
        "ci-ephemeral-provisioner@gpu.service",
        "ci-ephemeral-provisioner@gpu.2.service",
    ] {
        wait_until(&format!("{unit} to have run"), &host, || {
            let g = host.show(unit);
            g["ExecMainExitTimestampMonotonic"] != "0" && g["Result"] == "success"
        });
    }
    assert_slot_2_of_gpu(&host);

    // Metrics: each pool's file in node_exporter's textfile directory, its samples labelled
    // with the pool, a success recorded. (Runs go on every 2 s; a run in progress writes the
    // counters so far, which keep these values.)
    let default_metrics = pool_metrics(&host, "default");
    let success = sample(
        &default_metrics,
        "ci_ephemeral_provisioner_last_success_timestamp_seconds",
        &[("pool", "default")],
    );
    assert!(success.is_some_and(|t| t > 0.0), "{default_metrics}");
    assert_eq!(
        sample(
            &default_metrics,
            "ci_ephemeral_provisioner_last_run_exit_code",
            &[("pool", "default")]
        ),
        Some(0.0),
        "{default_metrics}"
    );
    // The gpu pool has two slots: each writes its own file, every sample labelled with the
    // slot too.
    for (slot, path) in [
        ("1", metrics_file("gpu")),
        ("2", slot_metrics_file("gpu", 2)),
    ] {
        let text = metrics_at(&host, &path, &[("pool", "gpu"), ("slot", slot)]);
        assert!(
            sample(
                &text,
                "ci_ephemeral_provisioner_last_success_timestamp_seconds",
                &[("pool", "gpu"), ("slot", slot)]
            )
            .is_some_and(|t| t > 0.0),
            "{path}:\n{text}"
        );
    }
    // The directory is still node_exporter's: same owner and group, same permission entries;
    // the service user has its own ACL entry. (With an ACL, the group bits `stat` shows are the
    // mask, rwx; the owning group's own entry stays r-x.)
    assert_eq!(
        host.sh_ok(&format!("stat -c '%U:%G' {METRICS_DIR}")).trim(),
        "nobody:nogroup"
    );
    let acl = host.sh_ok(&format!(
        "getfacl --omit-header --absolute-names {METRICS_DIR}"
    ));
    for entry in [
        "user::rwx",
        "group::r-x",
        "other::r-x",
        "user:ci-ephemeral-default:rwx",
        "user:ci-ephemeral-gpu:rwx",
        "mask::rwx",
    ] {
        assert!(acl.lines().any(|l| l == entry), "{entry} missing:\n{acl}");
    }
    assert!(
        !acl.contains(&format!("user:{SHARED_USER}:")),
        "the shared user's entry is still there:\n{acl}"
    );

    lap("phase: a cycle on gpu slot 2");
    // A cycle on slot 2 of the gpu pool (slot 1's timer stopped meanwhile, so slot 2 takes the
    // job): tofu in the pool's working copy, in the slot's own workspace and TF_DATA_DIR.
    host.sh_ok("systemctl stop ci-ephemeral-provisioner@gpu.timer");
    wait_until("gpu slot 1 to be idle", &host, || {
        host.show("ci-ephemeral-provisioner@gpu.service")["ActiveState"] != "activating"
    });
    let (gpu_job, _) = fake.add_job(&["gpu"]);
    wait_until(
        "slot 2 of the gpu pool to run its job and be back at rest",
        &host,
        || {
            let s = host.show("ci-ephemeral-provisioner@gpu.2.service");
            assert_ne!(
                s["ActiveState"],
                "failed",
                "a run of gpu slot 2 failed:\n{}",
                host.journal("ci-ephemeral-provisioner@gpu.2.service")
            );
            fake.jobs()
                .iter()
                .any(|j| j.id == gpu_job && j.status == "success")
                && !host
                    .file("var/lib/ci-ephemeral-provisioner/gpu/slot-2/cycle.json")
                    .exists()
                && s["ActiveState"] == "inactive"
        },
    );
    let gpu_vm = "var/lib/ci-ephemeral-provisioner/gpu/vm";
    let vm_log = host.read(&format!("{gpu_vm}/vm.log"));
    assert!(
        vm_log.contains("create ") && vm_log.contains("destroy "),
        "{vm_log}"
    );
    let tofu_env = host.read(&format!("{gpu_vm}/tofu-env.create"));
    for line in [
        "TF_WORKSPACE=slot-2",
        "TF_DATA_DIR=/var/lib/ci-ephemeral-provisioner/gpu/slot-2/tofu-data",
        "TF_VAR_slot=2",
    ] {
        assert!(
            tofu_env.lines().any(|l| l == line),
            "{line} missing:\n{tofu_env}"
        );
    }
    assert!(
        host.file(
            "var/lib/ci-ephemeral-provisioner/gpu/tofu/terraform.tfstate.d/slot-2/terraform.tfstate"
        )
        .exists(),
        "slot 2's local state is not in its workspace"
    );
    assert!(
        !host
            .journal("ci-ephemeral-provisioner@gpu.service")
            .contains(&format!("for job {gpu_job}")),
        "slot 1 ran the job while its timer was stopped"
    );
    // The recovery helper finds the slot's workspace.
    assert_eq!(
        host.sh_ok("ci-ephemeral-provisioner-tofu gpu.2 workspace show")
            .trim(),
        "slot-2"
    );
    assert_eq!(
        host.sh_ok("ci-ephemeral-provisioner-tofu gpu.2 state list")
            .trim(),
        "",
        "slot 2's VM was destroyed, its state is empty"
    );
    host.sh_ok("systemctl start ci-ephemeral-provisioner@gpu.timer");

    lap("phase: idempotence, binary sources and version");
    // Second run of the role: nothing to change.
    let (ok, out, changed) = host.play(
        "site-again",
        &with_webhook(vars(&fake, work, &local, two_pools)),
    );
    assert!(ok, "{out}");
    assert_eq!(changed, 0, "the second run changed something:\n{out}");

    // The binary from a URL: a wrong SHA-256 fails the run and leaves the installed binary
    // alone; the right one finds the same bytes installed and changes nothing.
    let installed = || host.sh_ok("sha256sum /usr/local/bin/ci-ephemeral-provisioner");
    let before = installed();
    let sha256 = sha256_hex(&binary);
    assert!(before.starts_with(&sha256), "{before}");
    let (url, hits) = serve_file(fs::read(&binary).unwrap());
    let wrong = Source::Url {
        url: url.clone(),
        sha256: "0".repeat(64),
    };
    let (ok, out, _) = host.play("url-wrong-sha", &vars(&fake, work, &wrong, two_pools));
    assert!(
        !ok,
        "a download with the wrong SHA-256 was accepted:\n{out}"
    );
    assert!(out.contains("did not match"), "{out}");
    assert!(hits.load(Ordering::SeqCst) > 0, "get_url never downloaded");
    assert_eq!(installed(), before, "the installed binary changed");
    // The right one, with the version expected, is deployed by the staggered slots' play below.
    let right = Source::Url {
        url,
        sha256: sha256.clone(),
    };
    let version = env!("CARGO_PKG_VERSION");
    // A local file is checked too: against binary_sha256 when given (else its .sha256 file,
    // as in every other play), before anything changes.
    let wrong_local = Source::LocalWithSha256 {
        path: &binary,
        sha256: "0".repeat(64),
    };
    let (ok, out, _) = host.play(
        "local-wrong-sha",
        &vars(&fake, work, &wrong_local, two_pools),
    );
    assert!(
        !ok && out.contains(&format!("has the SHA-256 {sha256}, not {}", "0".repeat(64))),
        "a local binary with another SHA-256 was accepted:\n{out}"
    );
    assert_eq!(installed(), before, "the installed binary changed");
    // Another version expected than the binary has: refused.
    let (ok, out, _) = host.play(
        "version-other",
        &format!(
            "{}ci_ephemeral_provisioner_version: \"9.9.9\"\n",
            vars(&fake, work, &local, two_pools)
        ),
    );
    assert!(
        !ok && out.contains(&format!(
            "--version says: ci-ephemeral-provisioner {version} (commit "
        )) && out.contains("; but ci_ephemeral_provisioner_version is 9.9.9"),
        "a binary of another version was accepted:\n{out}"
    );

    lap("phase: staggered slots");
    // Staggered slots. The gpu pool raised to 3 slots: slot K's timer is a file of its own,
    // OnActiveSec= the boot delay plus (K-1)/3 of the interval, and the play restarts the pool's
    // timers together (and only the gpu pool's), so that the slots look at Forgejo in turn.
    // Warm options reach provisioner.env.
    // The warm window is on a day three days from today: inside it, slot 2 would keep a warm VM
    // up, its cycle running and its timer from ticking, for as long as this test runs.
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        / 86_400;
    // 1970-01-01 was a Thursday (3, counting from Monday = 0).
    let warm_day = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"][((days + 3 + 3) % 7) as usize];
    let warm_during = format!("{warm_day} 07:00-19:00");
    let three_slots = two_pools
        .replace(
            "    slots: 2\n",
            &format!("    slots: 3\n    warm: 1\n    warm_during: {warm_during}\n"),
        )
        .replace(
            "    labels: debian:host,arm64:host\n",
            "    labels: debian:host,arm64:host\n    warm_max_age: 30m\n",
        );
    let (ok, out, _) = host.play(
        "warm-beyond-slots",
        &vars(
            &fake,
            work,
            &local,
            &three_slots.replace("    warm: 1\n", "    warm: 4\n"),
        ),
    );
    assert!(
        !ok && out.contains("Pool gpu: warm is 4 but slots is 3: a warm VM occupies a slot."),
        "more warm VMs than slots were accepted:\n{out}"
    );
    // This play also takes the binary from its URL, with the right SHA-256 and the version
    // expected: the same bytes, so the staged and the installed binary stay as they are, and the
    // installed binary's --version is printed.
    // systemctl prints *TimestampMonotonic in µs, LastTriggerUSecMonotonic as a time span.
    let usec = |host: &Host, unit: &str, key: &str| -> u64 {
        let v = host.sh_ok(&format!("systemctl show -p {key} --value {unit}"));
        span_us(v.trim()).unwrap_or_else(|| panic!("{unit} {key}: {v:?}"))
    };
    let since = |host: &Host, unit: &str| usec(host, unit, "InactiveExitTimestampMonotonic");
    let default_timer = "ci-ephemeral-provisioner@default.timer";
    let (gpu_before, default_before) = (
        since(&host, "ci-ephemeral-provisioner@gpu.timer"),
        since(&host, default_timer),
    );
    let (ok, out, _) = host.play(
        "three-slots",
        &format!(
            "{}ci_ephemeral_provisioner_version: \"{version}\"\n",
            vars(&fake, work, &right, &three_slots)
        ),
    );
    assert!(ok, "{out}");
    for task in [
        "Stage the binary from its URL, checked against its SHA-256",
        "Install the checked binary",
    ] {
        assert_eq!(
            task_status(&out, task),
            Some("ok"),
            "{task}: the same bytes from the URL changed something:\n{out}"
        );
    }
    assert_eq!(installed(), before, "the installed binary changed");
    assert!(
        out.contains(&format!(
            "Installed: ci-ephemeral-provisioner {version} (commit "
        )),
        "{out}"
    );
    // Without webhook_listen the receiver goes: its units, wake units, secret, state and user.
    for gone in [
        "etc/systemd/system/ci-ephemeral-provisioner-hook.socket",
        "etc/systemd/system/ci-ephemeral-provisioner@.path",
        "etc/systemd/system/paths.target.wants/ci-ephemeral-provisioner@gpu.2.path",
        "etc/ci-ephemeral-provisioner/webhook-secret",
        "var/lib/ci-ephemeral-provisioner-hook",
    ] {
        assert!(!host.file(gone).exists(), "{gone} is still there:\n{out}");
    }
    assert!(!host.sh("getent passwd ci-ephemeral-hook").0, "{out}");
    // The pools' units are back to the timer alone: a start rate limit, no wake file or window.
    let unit = host.sh_ok("systemctl cat ci-ephemeral-provisioner@.service");
    assert!(
        !unit.contains("WAKE_FILE") && !unit.contains("StartLimitIntervalSec=0"),
        "{unit}"
    );
    let default = host.show("ci-ephemeral-provisioner@default.service");
    assert_ne!(default["StartLimitIntervalUSec"], "0");
    assert_eq!(
        default["TimeoutStartUSec"], "1h 20min",
        "no watch to wait for"
    );
    let gpu_env = host.read("etc/ci-ephemeral-provisioner/pools/gpu/provisioner.env");
    for line in [
        "CI_EPHEMERAL_PROVISIONER_WARM=\"1\"",
        "CI_EPHEMERAL_PROVISIONER_WARM_MAX_AGE=\"1h\"",
        format!("CI_EPHEMERAL_PROVISIONER_WARM_DURING=\"{warm_during}\"").as_str(),
    ] {
        assert!(
            gpu_env.lines().any(|l| l == line),
            "{line} missing:\n{gpu_env}"
        );
    }
    let default_env = host.read("etc/ci-ephemeral-provisioner/pools/default/provisioner.env");
    assert!(!default_env.contains("WAKE_WINDOW"), "{default_env}");
    for line in [
        "CI_EPHEMERAL_PROVISIONER_WARM=\"0\"",
        "CI_EPHEMERAL_PROVISIONER_WARM_MAX_AGE=\"30m\"",
    ] {
        assert!(
            default_env.lines().any(|l| l == line),
            "{line} missing:\n{default_env}"
        );
    }
    assert!(!default_env.contains("WARM_DURING"), "{default_env}");
    let gpu_timers = [
        "ci-ephemeral-provisioner@gpu.timer",
        "ci-ephemeral-provisioner@gpu.2.timer",
        "ci-ephemeral-provisioner@gpu.3.timer",
    ];
    let mut started = Vec::new();
    // systemd's own reading of the schedule: the boot delay (1 s) plus 0, 1/3 and 2/3 of the
    // interval (2 s), in whole milliseconds.
    for (timer, want) in gpu_timers.iter().zip([1_000_000, 1_666_000, 2_333_000]) {
        let monotonic = host.sh_ok(&format!(
            "systemctl show -p TimersMonotonic --value {timer}"
        ));
        let on_active = monotonic
            .split("OnActiveUSec=")
            .nth(1)
            .and_then(|rest| span_us(rest.split(" ;").next()?));
        assert_eq!(on_active, Some(want), "{timer}: {monotonic}");
        assert!(
            monotonic.contains("OnUnitInactiveUSec=2s ;"),
            "{timer}: {monotonic}"
        );
        started.push(since(&host, timer));
    }
    // Restarted by this play, in one systemctl call; the default pool's timer left alone.
    let spread = started.iter().max().unwrap() - started.iter().min().unwrap();
    assert!(
        started[0] > gpu_before && spread < 500_000,
        "the gpu pool's timers did not restart together: {started:?}, before: {gpu_before}"
    );
    assert_eq!(
        since(&host, default_timer),
        default_before,
        "the default pool's timer was restarted although its schedule did not change"
    );
    // Each slot ticks after the restart. When it ticks is systemd's schedule, checked exactly
    // above; the ticks' times are not asserted, since OnUnitInactiveSec= counts from the end of
    // each run, and a run still in progress when the timers restarted moves a slot's tick.
    let mut ticked = [false; 3];
    wait_until("each gpu slot to tick after the restart", &host, || {
        for (k, timer) in gpu_timers.iter().enumerate() {
            ticked[k] = ticked[k] || usec(&host, timer, "LastTriggerUSecMonotonic") > started[k];
        }
        ticked.iter().all(|t| *t)
    });

    lap("phase: retiring a slot");
    // Lowering the gpu pool's slots from 3 to 1 retires slots 2 and 3, never one with a cycle in
    // progress. A stand-in for one: slot 2 stopped, a cycle.json in its slot-2/.
    let gpu_one_slot = vars(
        &fake,
        work,
        &local,
        &two_pools.replace("    slots: 2\n", ""),
    );
    assert!(!gpu_one_slot.contains("slots:"));
    let slot_2 = "var/lib/ci-ephemeral-provisioner/gpu/slot-2";
    let slot_2_unit = "etc/systemd/system/ci-ephemeral-provisioner@gpu.2.service";
    host.sh_ok("systemctl stop ci-ephemeral-provisioner@gpu.2.timer ci-ephemeral-provisioner@gpu.2.service");
    fs::write(host.file(&format!("{slot_2}/cycle.json")), "{}\n").unwrap();
    // Preflight refuses, before anything changes.
    let (ok, out, _) = host.play("slots-lowered-busy", &gpu_one_slot);
    assert!(
        !ok && out.contains(
            "Slot 2 of pool gpu (ci-ephemeral-provisioner@gpu.2) is to be retired (slots lowered to 1) \
             but has a cycle in progress"
        ) && out.contains("Keep the pool, with slots: 3,")
            && out.contains("--slots 3 --slot 2"),
        "{out}"
    );
    assert!(host.file(slot_2_unit).exists() && host.file(slot_2).exists());
    assert_eq!(
        host.sh_ok("systemctl is-enabled ci-ephemeral-provisioner@gpu.2.timer")
            .trim(),
        "enabled"
    );
    // A cycle that began after preflight looked (a run the timer started during the play): the
    // play after preflight (skipped: the configuration from its first task on, the slot to retire
    // named as preflight would) stops the slot, looks again and keeps everything of it, and fails
    // before the pool's environment changes (under slots: 1, slot 1 would stop at slot 2's
    // cycle.json).
    let (ok, out, _) = host.play_with(
        "retire-busy-slot",
        &format!("{gpu_one_slot}__ci_ephemeral_provisioner_retired_slots: [gpu.2, gpu.3]\n"),
        &["--start-at-task=ci_ephemeral_provisioner : Create the configuration directories"],
    );
    assert!(
        !ok && out.contains(
            "Slot 2 of pool gpu (ci-ephemeral-provisioner@gpu.2) began a cycle while it was being retired"
        ),
        "{out}"
    );
    assert!(
        host.file(slot_2_unit).exists() && host.file(&format!("{slot_2}/cycle.json")).exists(),
        "a slot with a cycle in progress lost its files:\n{out}"
    );
    assert!(
        host.read("etc/ci-ephemeral-provisioner/pools/gpu/provisioner.env")
            .contains("\nCI_EPHEMERAL_PROVISIONER_SLOTS=\"3\"\n"),
        "the pool's slots changed although a slot could not be retired:\n{out}"
    );
    // Once the cycle has ended: retired.
    fs::remove_file(host.file(&format!("{slot_2}/cycle.json"))).unwrap();
    let (ok, out, _) = host.play("slots-lowered", &gpu_one_slot);
    assert!(ok, "{out}");
    for (unit, enabled, active) in [
        (
            "ci-ephemeral-provisioner@gpu.2.timer",
            "disabled",
            "inactive",
        ),
        (
            "ci-ephemeral-provisioner@gpu.3.timer",
            "disabled",
            "inactive",
        ),
        ("ci-ephemeral-provisioner@gpu.timer", "enabled", "active"),
    ] {
        assert_eq!(
            host.sh(&format!("systemctl is-enabled {unit}")).1.trim(),
            enabled,
            "{unit}"
        );
        assert_eq!(
            host.sh(&format!("systemctl is-active {unit}")).1.trim(),
            active,
            "{unit}"
        );
    }
    for k in [2, 3] {
        for gone in [
            format!("var/lib/ci-ephemeral-provisioner/gpu/slot-{k}"),
            format!("etc/systemd/system/ci-ephemeral-provisioner@gpu.{k}.service"),
            format!("etc/systemd/system/ci-ephemeral-provisioner@gpu.{k}.timer"),
            format!("etc/ci-ephemeral-provisioner/pools/gpu/slot-{k}.env"),
            slot_metrics_file("gpu", k)[1..].to_string(),
        ] {
            assert!(!host.file(&gone).exists(), "{gone} is still there:\n{out}");
        }
    }
    // Slot 1's schedule is the same with or without slots behind it: no timer restarts.
    assert_eq!(
        since(&host, gpu_timers[0]),
        started[0],
        "slot 1's timer was restarted although its schedule did not change:\n{out}"
    );
    assert_eq!(since(&host, default_timer), default_before, "{out}");
    assert!(
        !host
            .read("etc/ci-ephemeral-provisioner/pools/gpu/provisioner.env")
            .contains("SLOTS")
    );

    lap("phase: removing a pool");
    // Removing a pool from the list stops and disables its timer.
    let one_pool =
        "  - name: default\n    runner_prefix: ephemeral-\n    labels: debian:host,arm64:host\n";
    let (ok, out, _) = host.play("one-pool", &vars(&fake, work, &local, one_pool));
    assert!(ok, "{out}");
    assert_eq!(
        host.sh("systemctl is-enabled ci-ephemeral-provisioner@gpu.timer")
            .1
            .trim(),
        "disabled"
    );
    assert_eq!(
        host.sh("systemctl is-active ci-ephemeral-provisioner@gpu.timer")
            .1
            .trim(),
        "inactive"
    );
    assert!(
        !host.file("etc/ci-ephemeral-provisioner/pools/gpu").exists(),
        "{out}"
    );
    // Its metrics file goes too: left behind, it would keep a dead pool in the alerts.
    assert!(
        !host.file(&metrics_file("gpu")[1..]).exists(),
        "the retired pool's metrics file is still there:\n{out}"
    );
    // And its user, once its units are gone: the account, its ACL entry; what it owned in the
    // state and cache directories is root's now (a later account with its uid inherits nothing).
    assert!(
        !host.sh(&format!("getent passwd {}", pool_user("gpu"))).0,
        "the retired pool's user is still there:\n{out}"
    );
    assert!(!host.sh(&format!("getent group {}", pool_user("gpu"))).0);
    let acl = host.sh_ok(&format!(
        "getfacl --omit-header --absolute-names {METRICS_DIR}"
    ));
    assert!(
        !acl.contains("user:ci-ephemeral-gpu:") && acl.contains("user:ci-ephemeral-default:rwx"),
        "{acl}"
    );
    assert_eq!(
        host.sh_ok(
            "find /var/lib/ci-ephemeral-provisioner/gpu /var/cache/ci-ephemeral-provisioner/gpu \
             ! -user root -o ! -group root | wc -l"
        )
        .trim(),
        "0"
    );
    assert_eq!(
        host.sh_ok("systemctl is-enabled ci-ephemeral-provisioner@default.timer")
            .trim(),
        "enabled"
    );

    lap("phase: a failing destroy, retried, then converging");
    // A destroy that fails leaves the unit failed, the error in the journal and the cycle on disk.
    fs::write(
        host.file("var/lib/ci-ephemeral-provisioner/default/vm/fail-destroy"),
        "",
    )
    .unwrap();
    let (job2, _) = fake.add_job(&["debian"]);
    wait_until("a failed run after the destroy failed", &host, || {
        let s = host.show(UNIT);
        fake.jobs()
            .iter()
            .any(|j| j.id == job2 && j.status == "success")
            && s["ActiveState"] == "failed"
            && s["Result"] == "exit-code"
    });
    let s = host.show(UNIT);
    assert_eq!(s["ExecMainStatus"], "1", "{s:?}");
    let journal = host.journal(UNIT);
    assert!(
        journal.contains("simulated cloud error on destroy"),
        "{journal}"
    );
    assert!(
        host.file(&format!("{STATE}/cycle.json")).exists(),
        "the cycle must be kept until its VM is gone"
    );
    // The timer retries; while the cloud keeps failing, so does every retry, and the VM stays
    // known (its tofu state survives the module sync before each run).
    let failed_run = s["InvocationID"].clone();
    wait_until("a retry of the failed destroy", &host, || {
        let s = host.show(UNIT);
        s["InvocationID"] != failed_run && s["ActiveState"] != "activating"
    });
    let s = host.show(UNIT);
    assert_eq!(
        (s["Result"].as_str(), s["ExecMainStatus"].as_str()),
        ("exit-code", "1"),
        "the retry did not fail while the destroy still fails: the VM was forgotten? {s:?}"
    );
    assert!(
        host.file(&format!("{STATE}/cycle.json")).exists(),
        "cycle.json vanished while the VM still exists"
    );
    // The metrics say so: the failed runs' exit status, and that destroys are failing.
    let failing = pool_metrics(&host, "default");
    assert_eq!(
        sample(
            &failing,
            "ci_ephemeral_provisioner_last_run_exit_code",
            &[("pool", "default")]
        ),
        Some(1.0),
        "{failing}"
    );
    assert_eq!(
        sample(
            &failing,
            "ci_ephemeral_provisioner_destroy_failing",
            &[("pool", "default")]
        ),
        Some(1.0),
        "{failing}"
    );

    // The role refuses to remove a pool while it has a cycle in progress.
    let spare = "  - name: spare\n    runner_prefix: spare-\n    labels: spare:host\n";
    let (ok, out, _) = host.play("remove-busy", &vars(&fake, work, &local, spare));
    assert!(!ok && out.contains("has a cycle in progress"), "{out}");
    assert!(
        !host
            .file("etc/ci-ephemeral-provisioner/pools/spare")
            .exists(),
        "the refusal must come before anything changes on the host"
    );
    assert_eq!(
        host.sh_ok("systemctl is-enabled ci-ephemeral-provisioner@default.timer")
            .trim(),
        "enabled"
    );

    // Once the cloud works again the timer's next runs converge: VM gone, registrations gone.
    fs::remove_file(host.file("var/lib/ci-ephemeral-provisioner/default/vm/fail-destroy")).unwrap();
    wait_until("the default pool to converge", &host, || {
        let s = host.show(UNIT);
        !host.file(&format!("{STATE}/cycle.json")).exists()
            && s["Result"] == "success"
            && s["ActiveState"] == "inactive"
    });
    let vm_log = host.read("var/lib/ci-ephemeral-provisioner/default/vm/vm.log");
    assert_eq!(
        vm_log.matches("create ").count(),
        vm_log.matches("destroy ").count(),
        "{vm_log}"
    );
    assert!(
        fake.runners()
            .iter()
            .all(|r| !r.name.starts_with("ephemeral-") || r.id == online),
        "our registrations left behind: {:?}",
        fake.runners()
    );

    lap("phase: broken pools");
    // A missing tofu is refused by preflight; a tofu that does not work is found by the pool's
    // `check`, which fails the deployment, saying what to fix.
    let missing = vars(&fake, work, &local, one_pool).replace(
        "  tofu_bin: /usr/local/bin/tofu\n",
        "  tofu_bin: /nonexistent/tofu\n",
    );
    let (ok, out, _) = host.play("missing-tofu", &missing);
    assert!(
        !ok && out
            .contains("Pool default: tofu_bin /nonexistent/tofu is not an executable on the host"),
        "a pool with a missing tofu binary was deployed:\n{out}"
    );
    // Both in one play: the deployed pool's tofu broken, and a pool deployed for the first time
    // with a broken tofu, in a play that also changes the timer template (which restarts the
    // timers): the new pool's timer is never started, not even for a moment before the check
    // (the check comes first).
    let new_broken = format!(
        "{one_pool}  - name: fresh\n    runner_prefix: fresh-\n    labels: fresh:host\n\
         \x20   tofu_bin: /bin/false\n"
    );
    let new_broken = vars(&fake, work, &local, &new_broken)
        .replace(
            "ci_ephemeral_provisioner_timer_interval: 2s\n",
            "ci_ephemeral_provisioner_timer_interval: 3s\n",
        )
        .replacen(
            "  tofu_bin: /usr/local/bin/tofu\n",
            "  tofu_bin: /bin/false\n",
            1,
        );
    assert!(new_broken.contains("timer_interval: 3s"));
    let (ok, out, _) = host.play("broken-pools", &new_broken);
    assert!(!ok, "pools with a tofu that fails were deployed:\n{out}");
    for pool in ["default", "fresh"] {
        assert!(
            out.contains(&format!(
                "pool {pool}: `ci-ephemeral-provisioner check` failed"
            )),
            "pool {pool} with a tofu that fails was deployed:\n{out}"
        );
    }
    assert!(
        out.contains("FAIL  tofu: `/bin/false version` exited with status 1"),
        "{out}"
    );
    assert!(
        !out.contains(API_TOKEN),
        "Ansible printed the token:\n{out}"
    );
    assert_eq!(
        host.show("ci-ephemeral-provisioner@fresh.timer")["ActiveEnterTimestampMonotonic"],
        "0",
        "the new pool's timer was started before its check failed"
    );
    assert_eq!(
        host.show("ci-ephemeral-provisioner@fresh.service")["ExecMainStartTimestampMonotonic"],
        "0",
        "a run of the new pool started before its check failed"
    );
    // That play changed the timer template but failed before the timers restarted: the next
    // play restarts them although it changes the template no more (the pending restart was
    // written down), and then forgets it.
    let pending = "etc/ci-ephemeral-provisioner/timers-restart-pending";
    assert!(
        host.file(pending).exists(),
        "the failed play did not record the timers' pending restart"
    );
    let started = |host: &Host| -> u64 {
        host.show("ci-ephemeral-provisioner@default.timer")["ActiveEnterTimestampMonotonic"]
            .parse()
            .unwrap()
    };
    let before = started(&host);
    // The same play also moves the metrics to a textfile directory that does not exist yet,
    // which changes no timer.
    let fresh_dir = "/var/lib/e2e-textfile";
    let fixed = format!(
        "{}\nci_ephemeral_provisioner_metrics_dir: {fresh_dir}\n",
        vars(&fake, work, &local, one_pool).replace(
            "ci_ephemeral_provisioner_timer_interval: 2s\n",
            "ci_ephemeral_provisioner_timer_interval: 3s\n",
        )
    );
    let (ok, out, _) = host.play("after-the-failed-play", &fixed);
    assert!(ok, "{out}");
    assert!(
        started(&host) > before,
        "the timers were not restarted for the template the failed play changed"
    );
    assert!(
        !host.file(pending).exists(),
        "the pending restart was not forgotten"
    );

    // The textfile directory that did not exist: the role created it (root:root 0755, the
    // service user's ACL entry), puts it in ReadWritePaths=, and the next run writes there.
    assert_eq!(
        host.sh_ok(&format!("stat -c '%U:%G' {fresh_dir}")).trim(),
        "root:root"
    );
    let acl = host.sh_ok(&format!(
        "getfacl --omit-header --absolute-names {fresh_dir}"
    ));
    for entry in [
        "user::rwx",
        "group::r-x",
        "other::r-x",
        "user:ci-ephemeral-default:rwx",
    ] {
        assert!(acl.lines().any(|l| l == entry), "{entry} missing:\n{acl}");
    }
    let fresh_file = format!("{fresh_dir}/ci-ephemeral-provisioner-default.prom");
    wait_until(
        "a run to write its metrics into the new directory",
        &host,
        || host.file(&fresh_file[1..]).exists(),
    );
    assert_eq!(
        host.sh_ok(&format!("stat -c '%a' {fresh_file}")).trim(),
        "644"
    );

    lap("phase: the example's own pool");
    // The example itself (examples/ansible): its group_vars as they are, with stand-ins swapped in
    // (tests/role/example_vars.py) for Forgejo, the vault's secrets, the cloud (the test module)
    // and the "VM" (this host's sshd, whose host key the module outputs as the example's
    // known_hosts_output). It replaces the test's pools and serves a job.
    let hetzner_vm = "/var/lib/ci-ephemeral-provisioner/hetzner/vm";
    let hcloud_stand_in = "hcloud-5tand-1n-9d2f";
    let standins = serde_json::json!({
        "vars": {
            "ci_ephemeral_provisioner_forgejo_url": fake.url(),
            "vault_forgejo_runner_token": API_TOKEN,
            "vault_hcloud_token": hcloud_stand_in,
            "ci_ephemeral_provisioner_timer_boot_delay": "1s",
            "ci_ephemeral_provisioner_timer_interval": "2s",
            "ci_ephemeral_provisioner_timer_accuracy": "100ms",
        },
        "pool": {
            "tofu_module_src": root().join("tests/role/module"),
            "environment": {
                "VM_DIR": hetzner_vm,
                // The example's FILL IN values, which the role refuses (the test module reads
                // neither).
                "TF_VAR_forgejo_runner_sha256": "0".repeat(64),
                "TF_VAR_ssh_source_ips": "[\"127.0.0.1/32\"]",
                "TF_VAR_ssh_key_path": "/etc/e2e/id_vm",
                "TF_VAR_known_hosts": fs::read_to_string(work.join("known_hosts")).unwrap().trim(),
            },
            "launch": { "ssh_user": "root", "ssh_port": 2222 },
            "idle_timeout": "1s",
            "registration_grace": "5s",
            "poll_interval": "500ms",
            "http_timeout": "5s",
        },
    });
    let standins_file = work.join("example-standins.json");
    fs::write(&standins_file, standins.to_string()).unwrap();
    let merged = work.join("example-vars.yml");
    let (ok, out) = host.script(&[
        "example-vars",
        path_str(work),
        path_str(&standins_file),
        path_str(&merged),
    ]);
    assert!(ok, "{out}");
    let (ok, out, _) = host.play("example", &fs::read_to_string(&merged).unwrap());
    assert!(ok, "the example did not deploy:\n{out}");
    for secret in [API_TOKEN, hcloud_stand_in] {
        assert!(!out.contains(secret), "Ansible printed a secret:\n{out}");
    }
    // The example's pool, as its group_vars say; the test's pool is gone.
    let env = host.read("etc/ci-ephemeral-provisioner/pools/hetzner/provisioner.env");
    for want in [
        "CI_EPHEMERAL_PROVISIONER_LABELS=\"debian:host\"",
        "CI_EPHEMERAL_PROVISIONER_RUNNER_PREFIX=\"ephemeral-hetzner-\"",
        "CI_EPHEMERAL_PROVISIONER_LAUNCH_TIMEOUT=\"5m\"",
        "TF_VAR_name_prefix=\"ci-hetzner-\"",
    ] {
        assert!(
            env.contains(want),
            "{want} is not in provisioner.env:\n{env}"
        );
    }
    assert_eq!(
        host.sh_ok("stat -c '%a %U' /etc/ci-ephemeral-provisioner/pools/hetzner/secret.env")
            .trim(),
        "600 root"
    );
    assert!(
        host.read("etc/ci-ephemeral-provisioner/pools/hetzner/secret.env")
            .contains(&format!("TF_VAR_hcloud_token=\"{hcloud_stand_in}\"")),
        "the example's vault_hcloud_token is not its pool's TF_VAR_hcloud_token"
    );
    assert_eq!(
        host.sh("systemctl is-enabled ci-ephemeral-provisioner@default.timer")
            .1
            .trim(),
        "disabled"
    );
    let hetzner = "ci-ephemeral-provisioner@hetzner.service";
    let (job3, _) = fake.add_job(&["debian"]);
    wait_until(
        "the example's pool to run a job and be back at rest",
        &host,
        || {
            let s = host.show(hetzner);
            assert_ne!(
                s["ActiveState"],
                "failed",
                "a run of the example's pool failed:\n{}",
                host.journal(hetzner)
            );
            fake.jobs()
                .iter()
                .any(|j| j.id == job3 && j.status == "success")
                && !host
                    .file("var/lib/ci-ephemeral-provisioner/hetzner/cycle.json")
                    .exists()
                && host
                    .read(&format!("{}/vm.log", &hetzner_vm[1..]))
                    .contains("destroy ")
                && s["ActiveState"] == "inactive"
                && s["Result"] == "success"
        },
    );
    assert!(
        fake.runners()
            .iter()
            .all(|r| !r.name.starts_with("ephemeral-hetzner-")),
        "the example's registrations left behind: {:?}",
        fake.runners()
    );
    drop(host);
    lap("done; the container is down");
}
