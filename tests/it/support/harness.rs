//! Drives the built binary against the fake Forgejo and the real terraform/tofu CLI.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::fake_forgejo::FakeForgejo;

/// Random-looking, so that any 12 characters of it in a file or log are a leak.
pub const API_TOKEN: &str = "7f3a9c1e5b2d8f4a6c0e9b3d7a1f5c2e8b4d6a0f";
pub const BIN: &str = env!("CARGO_BIN_EXE_ci-ephemeral-provisioner");

/// `tofu` when installed, else `terraform` (CLI-compatible).
pub fn tofu_bin() -> String {
    for candidate in ["tofu", "terraform"] {
        if Command::new(candidate)
            .arg("version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            return candidate.to_string();
        }
    }
    panic!("neither tofu nor terraform is on PATH; .ci/run installs terraform");
}

/// Every file below `dir`, recursively (none when it does not exist).
pub fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.filter_map(|e| e.ok()) {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Direct children of `pid` (each leads its own process group).
pub fn children(pid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in fs::read_dir("/proc").unwrap().filter_map(|e| e.ok()) {
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some(rest) = stat.rsplit_once(") ") else {
            continue;
        };
        let fields: Vec<&str> = rest.1.split_whitespace().collect();
        if fields.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(pid)
            && let Ok(child) = e.file_name().to_string_lossy().parse::<i32>()
        {
            out.push(child);
        }
    }
    out
}

/// SIGKILL the provisioner and the process groups of its children (tofu, the launch command).
pub fn kill_like_systemd(child: &mut std::process::Child) {
    let kids = children(child.id());
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    for k in kids {
        unsafe { libc::kill(-k, libc::SIGKILL) };
    }
    let _ = child.wait();
}

/// Polls `cond` until it holds (panics after 60 s, naming `what`).
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub struct Outcome {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Outcome {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}):\n{}\nstderr:\n{}",
                self.stdout, self.stderr
            )
        })
    }
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

pub struct Env {
    pub tmp: tempfile::TempDir,
    pub fake: FakeForgejo,
    pub state: PathBuf,
    pub module: PathBuf,
    /// The tests' view of the cloud: VM log and markers, the runners' token files on "the VM".
    pub vm: PathBuf,
    pub token_file: PathBuf,
    pub tofu: String,
}

impl Env {
    pub fn new() -> Env {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path();
        let module = root.join("module");
        let vm = root.join("vm");
        let state = root.join("state");
        fs::create_dir_all(&module).unwrap();
        fs::create_dir_all(&vm).unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/module");
        for f in ["main.tf", "vm.sh"] {
            fs::copy(src.join(f), module.join(f)).unwrap();
        }
        let token_file = root.join("forgejo-token");
        fs::write(&token_file, format!("{API_TOKEN}\n")).unwrap();
        fs::set_permissions(&token_file, fs::Permissions::from_mode(0o600)).unwrap();
        Env {
            fake: FakeForgejo::start(API_TOKEN),
            tmp,
            state,
            module,
            vm,
            token_file,
            tofu: tofu_bin(),
        }
    }

    /// The binary with a complete, fast configuration for `sub` (`run`, `sweep`, `status`).
    pub fn cmd(&self, sub: &str) -> Command {
        self.cmd_with(sub, true)
    }

    /// Like `cmd`, without `--token-file` when `token_flag` is false.
    pub fn cmd_with(&self, sub: &str, token_flag: bool) -> Command {
        let mut c = Command::new(BIN);
        c.arg(sub);
        c.env_clear();
        for keep in ["PATH", "HOME", "TMPDIR", "LANG"] {
            if let Some(v) = std::env::var_os(keep) {
                c.env(keep, v);
            }
        }
        c.env("VM_DIR", &self.vm);
        c.env("FAKE_FORGEJO_URL", self.fake.url());
        if sub == "status" {
            c.args(["--state-dir", self.state.to_str().unwrap()]);
            return c;
        }
        if token_flag {
            c.args(["--token-file", self.token_file.to_str().unwrap()]);
        }
        c.args([
            "--forgejo-url",
            &self.fake.url(),
            "--state-dir",
            self.state.to_str().unwrap(),
            "--http-timeout",
            "2s",
        ]);
        if sub == "run" || sub == "check" {
            c.args([
                "--labels",
                "debian:host",
                "--tofu-bin",
                &self.tofu,
                "--tofu-dir",
                self.module.to_str().unwrap(),
                "--launch-command",
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/bin/launch.sh")
                    .to_str()
                    .unwrap(),
                "--poll-interval",
                "100ms",
                "--registration-grace",
                "1s",
                "--idle-timeout",
                "300ms",
                "--launch-timeout",
                "10s",
            ]);
        }
        c
    }

    /// Runs a command to completion (panics after 90 s so a hang fails the test).
    pub fn exec(&self, mut c: Command) -> Outcome {
        let out = self.tmp.path().join(format!("out-{}", std::process::id()));
        let err = self.tmp.path().join(format!("err-{}", std::process::id()));
        c.stdout(fs::File::create(&out).unwrap());
        c.stderr(fs::File::create(&err).unwrap());
        c.stdin(Stdio::null());
        let mut child = c.spawn().expect("spawn the binary");
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > Duration::from_secs(90) {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the binary hung for 90 s; stderr:\n{}",
                    fs::read_to_string(&err).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Outcome {
            code: status.code(),
            stdout: fs::read_to_string(&out).unwrap_or_default(),
            stderr: fs::read_to_string(&err).unwrap_or_default(),
        }
    }

    pub fn run(&self, extra: &[&str]) -> Outcome {
        let mut c = self.cmd("run");
        c.args(extra);
        self.exec(c)
    }

    pub fn set_launch_mode(&self, mode: &str) {
        fs::write(self.vm.join("launch-mode"), mode).unwrap();
    }

    pub fn fault(&self, name: &str, on: bool) {
        let p = self.vm.join(name);
        if on {
            fs::write(p, "").unwrap();
        } else {
            let _ = fs::remove_file(p);
        }
    }

    pub fn vm_log(&self) -> String {
        fs::read_to_string(self.vm.join("vm.log")).unwrap_or_default()
    }

    /// VMs that exist now (created and not destroyed).
    pub fn live_vms(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(&self.vm)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("vm-"))
            .collect();
        v.sort();
        v
    }

    pub fn cycle_json(&self) -> Option<serde_json::Value> {
        fs::read_to_string(self.state.join("cycle.json"))
            .ok()
            .map(|t| serde_json::from_str(&t).expect("cycle.json is JSON"))
    }

    /// The end state of every cycle: no cycle.json, no VM, no registration with our prefix.
    pub fn assert_at_rest(&self) {
        assert!(
            self.cycle_json().is_none(),
            "cycle.json left: {:?}",
            self.cycle_json()
        );
        assert!(self.live_vms().is_empty(), "leaked VM: {}", self.vm_log());
        assert!(
            self.our_runners().is_empty(),
            "leaked registrations: {:?}",
            self.fake.runners()
        );
    }

    /// Registrations with our prefix that Forgejo still has.
    pub fn our_runners(&self) -> Vec<i64> {
        self.fake
            .runners()
            .into_iter()
            .filter(|r| r.name.starts_with("ephemeral-"))
            .map(|r| r.id)
            .collect()
    }
}
