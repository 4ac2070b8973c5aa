//! Real VMs: the role deploys a pool of examples/qemu in a container of its own (beside the main
//! test's, on another SSH port and cgroup), and QEMU boots the image that examples/qemu/build-image
//! made (`ROLE_E2E_QEMU_IMAGE`, with the tests' stand-in forgejo-runner) under TCG. The play runs
//! the canary (`canary_after_change`: `check --boot` through the role's launch command); then two
//! jobs of one repository run on one VM, each taken by the runner inside the VM from the fake
//! Forgejo through one forward to the fake on the host's loopback (the module's default network:
//! QEMU's user network `restrict=on` for SSH and the forwards, passt for the rest); the cycle ends
//! with the VM destroyed. Before the container: the module's KVM fallback on this host, whose
//! /dev/kvm hangs guests. Beside it, on this host: from inside a VM of network passt, this host's
//! loopback is out of reach (`qemu_jobs_network_reaches_nothing_of_this_host`).

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::support::fake_forgejo::FakeForgejo;
use super::support::harness::API_TOKEN;
use super::support::tree::root;
use super::{Host, Source, lap, required_env};

const POOL: &str = "qemu";
const UNIT: &str = "ci-ephemeral-provisioner@qemu.service";
const CANARY: &str = "ci-ephemeral-provisioner-canary@qemu.service";
const STATE: &str = "var/lib/ci-ephemeral-provisioner/qemu";
/// Where the image is bound into the container (read-only).
const IMAGE: &str = "/var/lib/ci-ephemeral-qemu/image";

/// Polls `cond` for up to `secs` seconds (a hang guard: TCG on a shared 2-core machine is slow).
fn wait(what: &str, host: &Host, secs: u64, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    lap(&format!("qemu: waiting for {what}"));
    while !cond() {
        if start.elapsed() > Duration::from_secs(secs) {
            let journal = host.journal(UNIT);
            panic!("timed out waiting for {what}; journal of {UNIT}:\n{journal}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    lap(&format!(
        "qemu:   after {:.1}s",
        start.elapsed().as_secs_f64()
    ));
}

/// A unit's journal since `since` (seconds since the epoch; a rootfs used before may keep older
/// runs' lines).
fn journal_since(host: &Host, unit: &str, since: u64) -> String {
    host.sh_ok(&format!(
        "journalctl -u {unit} --no-pager -o cat --since @{since}"
    ))
}

/// The QEMU processes in the container (`pgrep -a`), one line each.
fn qemus(host: &Host) -> Vec<String> {
    host.sh("pgrep -a qemu-system || true")
        .1
        .lines()
        .filter(|l| l.contains("qemu-system"))
        .map(str::to_string)
        .collect()
}

/// The pool's VM directories left (examples/qemu's vm_dir, ~/qemu-vms of the pool's user).
fn vm_dirs(host: &Host) -> Vec<String> {
    fs::read_dir(host.file(&format!("{STATE}/qemu-vms")))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// examples/qemu's vm.sh on this host, as root without systemd (a pid file), with `env`.
fn vm_sh(action: &str, env: &[(&str, String)]) -> (bool, String) {
    let out = Command::new("bash")
        .arg(root().join("examples/qemu/vm.sh"))
        .arg(action)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("run examples/qemu/vm.sh");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// accel=auto on this host: /dev/kvm opens, but a guest hangs under it. The guest must be proven
/// by booting: after kvm_proof_seconds without its systemd, the VM is started with TCG instead
/// (cut short here: a boot timeout of 3 s fails it under TCG, which the message names; the
/// containers' VMs show TCG booting). accel=kvm alone fails within its boot timeout. Each
/// failed create leaves nothing behind.
fn kvm_falls_back_to_tcg(image: &Path, work: &Path) {
    if !Path::new("/dev/kvm").exists() {
        eprintln!("qemu: no /dev/kvm on this host: the KVM fallback is not tried");
        return;
    }
    let dir = work.join("kvm-vms");
    let env = |name: &str, accel: &str, boot: u32| -> Vec<(&'static str, String)> {
        vec![
            ("VM_NAME", name.to_string()),
            ("VM_DIR", dir.join(name).display().to_string()),
            ("VM_IMAGE_DIR", image.display().to_string()),
            ("VM_MEMORY", "1024".into()),
            ("VM_CPUS", "1".into()),
            ("VM_ACCEL", accel.into()),
            ("VM_KVM_PROOF_SECONDS", "8".into()),
            ("VM_BOOT_SECONDS", boot.to_string()),
            ("VM_SUPERVISOR", "pidfile".into()),
            ("VM_SSH_USER", "runner".into()),
            ("VM_RUNNER_DIR", "/var/lib/forgejo-runner".into()),
            ("VM_NETWORK", "isolated".into()),
            // Under this host's KVM (kvm_pvm), QEMU refuses `-cpu host` at once (an MSR it
            // cannot set), which `auto` takes for no KVM too; with qemu64 it starts a guest that
            // hangs: the case the proof by booting is for.
            ("VM_KVM_CPU", "qemu64".into()),
        ]
    };
    let nothing_left = |name: &str, out: &str| {
        assert!(
            !dir.join(name).exists(),
            "a failed create left its directory behind:\n{out}"
        );
        let left = Command::new("pgrep")
            .args(["-f", &dir.join(name).display().to_string()])
            .output()
            .unwrap();
        assert!(
            !left.status.success(),
            "a failed create left QEMU running: {}",
            String::from_utf8_lossy(&left.stdout)
        );
    };
    lap("qemu: the KVM fallback (accel=auto) on this host");
    let started = Instant::now();
    let (ok, out) = vm_sh("create", &env("kvm-auto", "auto", 3));
    eprintln!("  accel=auto: {:.1?}:\n{out}", started.elapsed());
    if ok || out.contains("within 3s (kvm)") {
        // A /dev/kvm that works: the proof passed, nothing to fall back from.
        let _ = vm_sh("destroy", &env("kvm-auto", "auto", 3));
        eprintln!("qemu: KVM works on this host: no fallback to try");
        return;
    }
    assert!(
        out.contains("the guest did not boot within 8s under KVM")
            && out.contains("booting it with TCG")
            && out.contains("did not start within 3s (tcg)"),
        "accel=auto did not fall back to TCG after the KVM proof:\n{out}"
    );
    nothing_left("kvm-auto", &out);
    let (ok, out) = vm_sh("create", &env("kvm-only", "kvm", 10));
    assert!(!ok, "accel=kvm booted a guest that hangs:\n{out}");
    assert!(
        out.contains("did not start within 10s (kvm)"),
        "accel=kvm failed for another reason:\n{out}"
    );
    nothing_left("kvm-only", &out);
}

/// vm.sh's environment for a small TCG VM `name` under `dir`, supervised by a pid file.
fn tcg_vm_env(name: &str, dir: &Path, image: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("VM_NAME", name.into()),
        ("VM_DIR", dir.join(name).display().to_string()),
        ("VM_IMAGE_DIR", image.display().to_string()),
        ("VM_MEMORY", "1024".into()),
        ("VM_CPUS", "1".into()),
        ("VM_ACCEL", "tcg".into()),
        ("VM_BOOT_SECONDS", "300".into()),
        ("VM_SUPERVISOR", "pidfile".into()),
        ("VM_SSH_USER", "runner".into()),
        ("VM_RUNNER_DIR", "/var/lib/forgejo-runner".into()),
    ]
}

/// A VM whose QEMU exits while it boots (its init exits at once, the kernel panics and, with
/// `panic=-1` and `-no-reboot`, QEMU ends) is a failed create that leaves nothing: no directory,
/// no process.
fn a_vm_that_dies_is_a_failed_apply(image: &Path, work: &Path) {
    lap("qemu: a VM that dies while it boots");
    let dir = work.join("dying-vms");
    let mut env = tcg_vm_env("dies", &dir, image);
    env.push(("VM_KERNEL_ARGS", "init=/bin/false".into()));
    let (ok, out) = vm_sh("create", &env);
    assert!(!ok, "a VM without a root file system was created:\n{out}");
    assert!(
        out.contains("QEMU exited while the VM booted"),
        "the create failed for another reason:\n{out}"
    );
    assert!(!dir.join("dies").exists(), "it left its directory:\n{out}");
    let left = Command::new("pgrep")
        .args(["-f", &dir.display().to_string()])
        .output()
        .unwrap();
    assert!(
        !left.status.success(),
        "it left QEMU running: {}",
        String::from_utf8_lossy(&left.stdout)
    );
}

/// The directory of the image's files: build-image's `current` build, or (an image built before
/// it kept builds of their own) the directory itself.
fn image_files(image: &Path) -> PathBuf {
    let current = image.join("current");
    if current.exists() {
        current
    } else {
        image.to_path_buf()
    }
}

/// .ci/role builds the image beside everything else: waits for the end of its build.
fn wait_for_image(image: &Path) {
    let ready = PathBuf::from(format!("{}.ready", image.display()));
    let failed = PathBuf::from(format!("{}.failed", image.display()));
    let start = Instant::now();
    lap("qemu: waiting for the VM image (examples/qemu/build-image)");
    // (An image built by hand, with no build running, is taken as it is.)
    let building = PathBuf::from(format!("{}.pid", image.display()));
    let usable =
        || ready.exists() || (image_files(image).join("disk.qcow2").exists() && !building.exists());
    while !usable() {
        assert!(
            !failed.exists(),
            "examples/qemu/build-image failed:\n{}",
            fs::read_to_string(format!("{}.log", image.display())).unwrap_or_default()
        );
        assert!(
            start.elapsed() < Duration::from_secs(1200),
            "the VM image was not built within 20 minutes"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    lap(&format!(
        "qemu:   image ready after {:.1}s: {}",
        start.elapsed().as_secs_f64(),
        fs::read_to_string(image_files(image).join("manifest"))
            .unwrap_or_default()
            .replace('\n', "; ")
    ));
}

/// A TCP listener on this host's 127.0.0.1 (as every local service is) that counts the
/// connections it accepts and answers each with a line.
fn loopback_service() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            count.fetch_add(1, Ordering::SeqCst);
            let _ = conn.write_all(b"a service on the host's loopback\n");
        }
    });
    (port, accepted)
}

// Mutation caught: QEMU's user network unrestricted (`usernet=restrict=off` in vm.sh): the VM
// reached the host's 127.0.0.1 through 10.0.2.2 ("reached 10.0.2.2"). Mutation caught: passt
// without --no-map-gw: the VM reached it through passt's gateway ("reached 192.0.2.1", this
// host's gateway).
/// Network passt (the default): from inside a VM, a service that listens on this host's
/// 127.0.0.1 is out of reach through 10.0.2.2 (QEMU's user network, which carries SSH) and
/// through passt's gateway (the jobs' route), while a forward to it still reaches it, and the
/// VM's default route is passt's card. The VM runs on this host (root, a pid file, TCG) and is
/// driven over its SSH forward with the module's login key.
#[test]
#[ignore = "needs root, QEMU, passt, socat and a VM image: run by .ci/role"]
fn qemu_jobs_network_reaches_nothing_of_this_host() {
    let image = PathBuf::from(required_env("ROLE_E2E_QEMU_IMAGE"));
    wait_for_image(&image);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("net-vms");
    let (port, accepted) = loopback_service();
    let mut env = tcg_vm_env("net", &dir, &image);
    env.extend([
        ("VM_NETWORK", "passt".into()),
        // The forward: 127.0.0.1:PORT in the VM is the service (the positive control).
        ("VM_FORWARDS", format!("127.0.0.1:{port} 127.0.0.1:{port}")),
    ]);
    lap("qemu: a VM with network passt, probing this host's loopback from inside");
    let (ok, out) = vm_sh("create", &env);
    assert!(ok, "the VM (network passt) was not created:\n{out}");
    let vm_dir = dir.join("net");
    let vm: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(vm_dir.join("vm.json")).unwrap()).unwrap();
    let known_hosts = tmp.path().join("known_hosts");
    fs::write(
        &known_hosts,
        format!("{}\n", vm["known_hosts"].as_str().unwrap()),
    )
    .unwrap();
    // Each target: "reached ADDR" or "refused ADDR"; first the routes.
    let probe = format!(
        r#"set -u
ip -4 route show default
gw=$(ip -4 route show default | awk '{{print $3; exit}}')
for a in 10.0.2.2 "$gw" 127.0.0.1; do
    if timeout 10 bash -c "exec 3<>/dev/tcp/$a/{port} && head -n 1 <&3" | grep -q 'host.s loopback'; then
        echo "reached $a"
    else
        echo "refused $a"
    fi
done"#
    );
    let ssh = |script: &str| {
        Command::new("ssh")
            .args([
                "-o",
                "BatchMode=yes",
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                "ConnectTimeout=10",
            ])
            .arg("-o")
            .arg(format!("UserKnownHostsFile={}", known_hosts.display()))
            .arg("-i")
            .arg(vm_dir.join("login"))
            .args([
                "-p",
                &vm["ssh_port"].to_string(),
                "runner@127.0.0.1",
                script,
            ])
            .output()
            .expect("run ssh")
    };
    // sshd (and the forward's proxy) come up after the VM's systemd, later under TCG.
    let start = Instant::now();
    let result = loop {
        let o = ssh(&probe);
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        if o.status.success() && text.contains("127.0.0.1") && !text.contains("refused 127.0.0.1") {
            break text;
        }
        if start.elapsed() > Duration::from_secs(300) {
            let (_, down) = vm_sh("destroy", &env);
            panic!(
                "no probe through SSH within 300s: {text}{}\n{down}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_secs(3));
    };
    eprintln!("  from inside the VM:\n{result}");
    let (ok, down) = vm_sh("destroy", &env);
    assert!(ok, "destroy failed:\n{down}");
    let gw = result.lines().next().unwrap_or_default();
    assert!(
        gw.starts_with("default via ") && !gw.contains("10.0.2."),
        "the VM's default route is not passt's card: {result}"
    );
    assert!(
        result.contains("reached 127.0.0.1"),
        "the forward did not reach the service: {result}"
    );
    assert!(
        result.contains("refused 10.0.2.2"),
        "the VM reached this host's loopback through 10.0.2.2: {result}"
    );
    assert_eq!(
        result.matches("refused ").count(),
        2,
        "the VM reached this host's loopback through passt's gateway: {result}"
    );
    // Each connection the service took came through the forward (one per probe that passed).
    let probes = result.matches("reached 127.0.0.1").count();
    assert!(
        accepted.load(Ordering::SeqCst) >= probes,
        "the service counted fewer connections than the forward made"
    );
    assert!(!vm_dir.exists(), "the destroy left {}", vm_dir.display());
}

/// Run in a transient unit of the pool user's manager: whether it may ptrace (here
/// PTRACE_TRACEME, syscall 101: the drop-in refuses ptrace, pidfd_getfd and process_vm_* alike)
/// and whether it can gain privileges.
const ESCAPE_PROBE: &str = r#"
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
r = libc.syscall(101, 0, 0, 0, 0)
print("ptrace:", "allowed" if r == 0 else errno.errorcode[ctypes.get_errno()])
print([l for l in open("/proc/self/status") if l.startswith("NoNewPrivs")][0], end="")
"#;

/// The role's variables for the QEMU pool: examples/qemu, the role's launch command with the
/// module's outputs, VMs of the default network (passt) whose one forward reaches the fake Forgejo.
fn qemu_vars(fake: &FakeForgejo, source: &Source) -> String {
    let port = fake.url().rsplit(':').next().unwrap().to_string();
    format!(
        r#"---
{source}
ci_ephemeral_provisioner_forgejo_url: {url}
ci_ephemeral_provisioner_forgejo_token: {API_TOKEN}
ci_ephemeral_provisioner_timer_boot_delay: 1s
ci_ephemeral_provisioner_timer_interval: 2s
ci_ephemeral_provisioner_timer_accuracy: 100ms
ci_ephemeral_provisioner_pools:
  - name: {POOL}
    runner_prefix: qemu-
    labels: qemu:host
    tofu_module_src: {module}
    tofu_bin: /usr/local/bin/tofu
    systemd_user_manager: true
    canary_after_change: true
    environment:
      TF_VAR_image_dir: {IMAGE}
      TF_VAR_memory: "1024"
      TF_VAR_cpus: "1"
      TF_VAR_forwards: '[{{guest = "127.0.0.1:{port}", host = "127.0.0.1:{port}"}}]'
    launch:
      ssh_user: runner
      ssh_port_output: ssh_port
      known_hosts_output: known_hosts
      runner_bin: forgejo-runner
    launch_timeout: 10m
    max_jobs_per_vm: 5
    idle_timeout: 20s
    registration_grace: 2m
    poll_interval: 1s
    http_timeout: 5s
    verbose: true
"#,
        source = source.yaml(),
        url = fake.url(),
        module = root().join("examples/qemu").display(),
    )
}

#[test]
#[ignore = "needs root, systemd-container, QEMU, a rootfs, a VM image and ansible: run by .ci/role"]
fn qemu_vms_boot_serve_two_jobs_and_are_destroyed() {
    lap("qemu: start");
    let rootfs = PathBuf::from(required_env("ROLE_E2E_QEMU_ROOTFS"));
    let image = PathBuf::from(required_env("ROLE_E2E_QEMU_IMAGE"));
    required_env("ANSIBLE_VENV");
    let binary = std::env::var("ROLE_E2E_BINARY")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root().join("dist/ci-ephemeral-provisioner"));
    let tmp = tempfile::tempdir().unwrap();
    let kept = std::env::var_os("ROLE_E2E_QEMU_WORK").map(PathBuf::from);
    let work = kept.as_deref().unwrap_or(tmp.path());
    fs::create_dir_all(work).unwrap();

    wait_for_image(&image);

    kvm_falls_back_to_tcg(&image, work);
    a_vm_that_dies_is_a_failed_apply(&image, work);

    let fake = FakeForgejo::start(API_TOKEN);
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    lap("qemu: booting its container");
    let host = Host::boot_with(
        work,
        &rootfs,
        // .ci/role's port and cgroup (its lock), or another pair to run this beside it.
        vec![
            (
                "SSH_PORT".into(),
                std::env::var("ROLE_E2E_QEMU_SSH_PORT").unwrap_or_else(|_| "2223".into()),
            ),
            (
                "E2E_CGROUP".into(),
                std::env::var("ROLE_E2E_QEMU_CGROUP").unwrap_or_else(|_| "qemu-e2e".into()),
            ),
            (
                "E2E_NSPAWN_ARGS".into(),
                format!("--bind-ro={}:{IMAGE}", image.display()),
            ),
        ],
    );
    let source = Source::Local(&binary);

    lap("qemu: the play, with the canary (check --boot) of the new pool");
    let (ok, out, _) = host.play("qemu", &qemu_vars(&fake, &source));
    assert!(ok, "the role failed to deploy the QEMU pool:\n{out}");
    assert!(!out.contains(API_TOKEN), "Ansible printed the token");
    // The canary ran, through the role's launch command, and its VM is gone.
    let canary = journal_since(&host, CANARY, since);
    let boot = canary
        .lines()
        .rfind(|l| l.starts_with("ok    boot: ") || l.starts_with("FAIL  boot: "))
        .filter(|l| l.starts_with("ok    "))
        .unwrap_or_else(|| panic!("the canary did not pass:\n{canary}\n{out}"));
    eprintln!("  {boot}");
    assert!(
        canary.contains(" destroy -input=false"),
        "the canary ran no tofu destroy:\n{canary}"
    );
    for part in [
        "forgejo-runner version v12.8.2",
        "apply ",
        "ready in ",
        "destroy ",
    ] {
        assert!(boot.contains(part), "{part:?} missing: {boot}");
    }
    assert!(
        out.contains("pool qemu: ok    boot: "),
        "the play did not show the canary's line:\n{out}"
    );
    assert!(
        qemus(&host).is_empty(),
        "the canary's QEMU runs on: {:?}",
        qemus(&host)
    );
    assert!(vm_dirs(&host).is_empty(), "{:?}", vm_dirs(&host));
    assert!(!host.file(&format!("{STATE}/cycle.json")).exists());
    // Mutation caught: the role's user-manager-sandbox.conf.j2 without SystemCallFilter= and
    // NoNewPrivileges= ("ptrace: allowed", "NoNewPrivs: 0"). (pidfd_getfd on a child of the
    // probe was refused there without the drop-in too: it tells nothing here.)
    // What the pool's user starts through its manager (`systemd-run --user`, as any child
    // of a run can) runs outside the pool units' sandbox; the role's drop-in for user@UID.service
    // still keeps it from taking another process's descriptors (the Forgejo token on a run's
    // standard input while it starts) and from gaining privileges.
    let uid = host.sh_ok("id -u ci-ephemeral-qemu").trim().to_string();
    // (systemd-run --wait would need the user's D-Bus; the unit writes into the runtime directory.)
    host.sh_ok(&format!(
        "XDG_RUNTIME_DIR=/run/user/{uid} setpriv --reuid={uid} --regid={uid} --clear-groups \
         systemd-run --user --quiet --collect --unit=escape-probe -p StandardError=journal \
         -p StandardOutput=file:/run/user/{uid}/escape-probe.out python3 -c '{ESCAPE_PROBE}' < /dev/null"
    ));
    let mut escaped = String::new();
    wait(
        "the probe in a transient unit of the pool user's manager",
        &host,
        60,
        || {
            escaped = host.sh(&format!("cat /run/user/{uid}/escape-probe.out")).1;
            escaped.contains("NoNewPrivs")
        },
    );
    assert!(
        escaped.contains("ptrace: EPERM") && escaped.contains("NoNewPrivs:\t1"),
        "a transient unit of the pool user's manager is not held: {escaped}"
    );
    let posts_before = fake
        .requests()
        .iter()
        .filter(|r| r.method == "POST")
        .count();
    assert_eq!(posts_before, 0, "the canary registered a runner");

    lap("qemu: two jobs of one repository, one VM");
    let (job1, _) = fake.add_scoped_job(&["qemu"], super::TOKEN_USER_ID, 7);
    let (job2, _) = fake.add_scoped_job(&["qemu"], super::TOKEN_USER_ID, 7);
    let done = |id: i64| {
        fake.jobs()
            .iter()
            .any(|j| j.id == id && j.status == "success")
    };
    // While the VM is up: its QEMU and passt, in the pool user's own manager, one forward.
    wait("the first job, run inside the VM", &host, 900, || {
        assert_ne!(
            host.show(UNIT)["ActiveState"],
            "failed",
            "a run of the QEMU pool failed:\n{}",
            host.journal(UNIT)
        );
        done(job1) || done(job2)
    });
    let running = qemus(&host);
    assert_eq!(running.len(), 1, "{running:?}");
    let cmdline = &running[0];
    let fake_port = fake.url().rsplit(':').next().unwrap().to_string();
    // The default network: passt's card beside the restricted user network.
    for part in [
        "restrict=on",
        "-netdev stream,id=n1,server=off,addr.type=unix,",
        "hostfwd=tcp:127.0.0.1:",
        &format!("guestfwd=tcp:10.0.2.100:{fake_port}-cmd:socat - TCP:127.0.0.1:{fake_port}"),
        "accel=tcg",
    ] {
        assert!(cmdline.contains(part), "{part:?} missing: {cmdline}");
    }
    assert_eq!(cmdline.matches("guestfwd=").count(), 1, "{cmdline}");
    let owner = host.sh_ok(&format!(
        "ps -o user= -p {}",
        cmdline.split_whitespace().next().unwrap()
    ));
    assert_eq!(owner.trim(), "ci-ephemeral-qemu", "QEMU runs as {owner}");
    let units = host.sh_ok(&format!(
        "XDG_RUNTIME_DIR=/run/user/{uid} setpriv --reuid={uid} --regid={uid} --clear-groups \
         systemctl --user list-units --no-legend 'ci-vm-*'"
    ));
    assert!(
        units.contains("ci-vm-ci-"),
        "the VM is not a unit of the pool user's manager: {units}"
    );
    assert!(
        units.contains("-net.service"),
        "the VM's passt is not a unit of the pool user's manager: {units}"
    );
    wait("both jobs and the pool back at rest", &host, 900, || {
        let s = host.show(UNIT);
        assert_ne!(
            s["ActiveState"],
            "failed",
            "a run of the QEMU pool failed:\n{}",
            host.journal(UNIT)
        );
        done(job1)
            && done(job2)
            && !host.file(&format!("{STATE}/cycle.json")).exists()
            && s["ActiveState"] == "inactive"
    });
    let journal = journal_since(&host, UNIT, since);
    // One VM for both jobs: one apply, two launches, one destroy.
    let applies = journal.matches(" apply -input=false").count();
    assert_eq!(
        applies, 1,
        "the jobs of one repository did not share a VM:\n{journal}"
    );
    assert_eq!(journal.matches("launching runner").count(), 2, "{journal}");
    assert_eq!(
        journal.matches(" destroy -input=false").count(),
        1,
        "{journal}"
    );
    // Nothing at rest: no QEMU, no overlay or seed, no unit, no registration.
    assert!(qemus(&host).is_empty(), "QEMU runs on: {:?}", qemus(&host));
    assert!(vm_dirs(&host).is_empty(), "{:?}", vm_dirs(&host));
    let units = host.sh_ok(&format!(
        "XDG_RUNTIME_DIR=/run/user/{uid} setpriv --reuid={uid} --regid={uid} --clear-groups \
         systemctl --user list-units --all --no-legend 'ci-vm-*'"
    ));
    assert!(units.trim().is_empty(), "units left: {units}");
    assert!(
        fake.runners().iter().all(|r| !r.name.starts_with("qemu-")),
        "registrations left: {:?}",
        fake.runners()
    );
    let posts = fake
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/actions/runners"))
        .count();
    assert_eq!(posts, 2, "one registration per job");
    drop(host);
    lap("qemu: done; its container is down");
}
