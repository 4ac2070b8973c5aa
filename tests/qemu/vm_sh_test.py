#!/usr/bin/env python3
"""examples/qemu/vm.sh in seconds, without a VM: QEMU is tests/qemu/fake-qemu (it listens on the
SSH forward, daemonizes, prints the guest's systemd banner) and, for the systemd supervisors,
systemd-run and systemctl are the stubs in tests/qemu/stub-bin. The real-VM test
(tests/role/qemu_e2e.rs) boots real guests; this one holds the script's own rules: what QEMU is
asked for (the network, the accelerator), and that a create or destroy, whole or cut short, leaves
no process and no directory. Needs root (the accelerator case runs as nobody), qemu-img,
ssh-keygen and mtools.

    python3 tests/qemu/vm_sh_test.py [-k NAME]
"""
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
VM_SH = ROOT / "examples/qemu/vm.sh"
HERE = ROOT / "tests/qemu"
NOBODY = 65534


class World:
    """A base image, a directory for the VMs, the fake's argv log, the stubs' state."""

    def __init__(self, base):
        self.base = base
        base.chmod(0o755)
        self.image = base / "image"
        self.image.mkdir()
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(self.image / "disk.qcow2"), "16M"], check=True)
        for f in ("vmlinuz", "initrd.img"):
            (self.image / f).write_text("")
        for f in self.image.iterdir():
            f.chmod(0o644)
        self.vms = base / "vms"
        self.vms.mkdir(mode=0o777)
        self.vms.chmod(0o777)
        self.log = base / "qemu-argv.log"
        self.log.write_text("")
        self.log.chmod(0o666)
        self.systemd = base / "systemd"
        self.systemd.mkdir(mode=0o777)
        self.systemd.chmod(0o777)
        # vm.sh, the fake and the stubs where nobody can read them (the checkout may be a clone
        # under /root).
        self.bin = base / "bin"
        shutil.copytree(HERE / "stub-bin", self.bin / "stub")
        shutil.copy(HERE / "fake-qemu", self.bin / "fake-qemu")
        self.vm_sh_path = self.bin / "vm.sh"
        shutil.copy(VM_SH, self.vm_sh_path)
        for p in [self.bin, self.bin / "stub", *self.bin.rglob("*")]:
            p.chmod(0o755)

    def env(self, name, **over):
        env = {
            "PATH": os.environ["PATH"],
            "VM_NAME": name,
            "VM_DIR": str(self.vms / name),
            "VM_IMAGE_DIR": str(self.image),
            "VM_MEMORY": "512",
            "VM_CPUS": "1",
            "VM_ACCEL": "tcg",
            "VM_KVM_PROOF_SECONDS": "2",
            "VM_BOOT_SECONDS": "10",
            "VM_SUPERVISOR": "pidfile",
            "VM_SSH_USER": "runner",
            "VM_RUNNER_DIR": "/var/lib/forgejo-runner",
            "VM_NETWORK": "passt",
            "VM_FORWARDS": "",
            "VM_BRIDGE": "",
            "VM_QEMU": str(self.bin / "fake-qemu"),
            "FAKE_QEMU_LOG": str(self.log),
            "FAKE_SYSTEMD_DIR": str(self.systemd),
        }
        if over.get("VM_SUPERVISOR", "pidfile") != "pidfile":
            env["PATH"] = f"{self.bin / 'stub'}:{env['PATH']}"
        env.update(over)
        return env

    def vm_sh(self, action, env, user=None, timeout=60):
        cmd = ["bash", str(self.vm_sh_path), action]
        if user is not None:
            cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)

    def starts(self):
        """The argv of each QEMU start, in order."""
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def processes(self, name=None):
        """The pids whose command line names this VM's directory (any of this world's)."""
        needle = (str(self.vms / name) + "/" if name else str(self.base) + "/").encode()
        found = []
        for p in pathlib.Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    if needle in (p / "cmdline").read_bytes():
                        found.append(int(p.name))
                except OSError:
                    pass
        return found

    def nothing_left(self, name, what):
        expect(not (self.vms / name).exists(), f"{what}: the VM's directory is left")
        expect(not self.processes(name), f"{what}: processes of the VM are left: {self.processes(name)}")

    def cleanup(self):
        """Whatever a failed case left running: every process that names this world's files."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


class Failed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failed(what)


def netdev(argv):
    return argv[argv.index("-netdev") + 1]


def accel(argv):
    return argv[argv.index("-machine") + 1].split("accel=", 1)[1]


def ok(r, what):
    expect(r.returncode == 0, f"{what} failed (exit {r.returncode}):\n{r.stderr}")


# --- the cases ----------------------------------------------------------------------------------

def test_create_and_destroy_leave_nothing(w):
    env = w.env("whole")
    r = w.vm_sh("create", env)
    ok(r, "create")
    vm = json.loads((w.vms / "whole" / "vm.json").read_text())
    with socket.create_connection(("127.0.0.1", vm["ssh_port"]), timeout=2):
        pass
    expect(vm["accel"] == "tcg" and vm["supervisor"] == "pidfile", f"vm.json: {vm}")
    expect(vm["known_hosts"].startswith(f"[127.0.0.1]:{vm['ssh_port']} ssh-ed25519 "), f"vm.json: {vm}")
    # The seed holds the host key; the VM's directory keeps no copy of the private key.
    expect(not (w.vms / "whole" / "host").exists(), "the host's private key is left beside the seed")
    expect(w.processes("whole"), "no QEMU runs after the create")
    ok(w.vm_sh("destroy", env), "destroy")
    w.nothing_left("whole", "destroy")
    # A second destroy (tofu retries) finds nothing and succeeds.
    ok(w.vm_sh("destroy", env), "a second destroy")


def netdevs(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-netdev"]


# Mutation caught: the user network left unrestricted beside passt or a bridge, or in isolated
# (slirp forwards the guest's 10.0.2.2 to this host's loopback: every local service, the other
# VMs' SSH forwards); passt started without --no-map-gw (its gateway would be this host's loopback).
# The real-VM test (tests/role/qemu_e2e.rs) tries both from inside a VM.
def test_the_user_network_is_restricted_unless_network_user(w):
    cases = [("passt", {}, "restrict=on", "stream"), ("isolated", {"VM_NETWORK": "isolated"}, "restrict=on", None),
             ("bridged", {"VM_NETWORK": "bridge", "VM_BRIDGE": "br0"}, "restrict=on", "bridge"),
             ("user", {"VM_NETWORK": "user"}, "restrict=off", None)]
    for name, over, want, second in cases:
        before = len(w.starts())
        env = w.env(name, **over)
        # (A bridge QEMU would open; the fake only records it.)
        r = w.vm_sh("create", env)
        ok(r, f"create ({name})")
        argv = w.starts()[before]
        nets = netdevs(argv)
        expect(nets[0].startswith(f"user,id=n0,{want},"), f"{name}: -netdev {nets[0]}, expected {want}")
        expect([n.split(",", 1)[0] for n in nets[1:]] == ([second] if second else []),
               f"{name}: the jobs' network is {nets[1:]}, expected {second}")
        expect(("network user" in r.stderr) == (name == "user"), f"{name}: the warning:\n{r.stderr}")
        if name == "passt":
            passt = [p for p in w.processes(name) if b"passt" in pathlib.Path(f"/proc/{p}/cmdline").read_bytes()]
            expect(passt, "network passt: no passt runs")
            cmd = pathlib.Path(f"/proc/{passt[0]}/cmdline").read_bytes().split(b"\0")
            expect(b"--no-map-gw" in cmd, f"passt runs without --no-map-gw: {cmd}")
            expect(b"-t" in cmd and b"-u" in cmd, f"passt forwards ports of this host: {cmd}")
            # As root, passt (nobody) has its socket in a directory of /run that `net` names.
            sock_dir = pathlib.Path((w.vms / name / "net").read_text().strip())
            expect((sock_dir / "passt.sock").is_socket(), f"no passt socket in {sock_dir}")
        ok(w.vm_sh("destroy", env), f"destroy ({name})")
        w.nothing_left(name, f"destroy ({name})")
        if name == "passt":
            expect(not sock_dir.exists(), f"passt's socket directory {sock_dir} is left")


# Mutation caught: vm.sh reading the image's files from VM_IMAGE_DIR itself, not from the build
# that `current` names (build-image's layout); a plain directory (the layout before) still boots.
def test_the_image_is_the_build_current_names(w):
    builds = w.base / "builds"
    for b in ("build-old", "build-new"):
        (builds / b).mkdir(parents=True)
        for f in ("disk.qcow2", "vmlinuz", "initrd.img"):
            shutil.copy(w.image / f, builds / b / f)
    (builds / "current").symlink_to("build-new")
    for p in [builds, *builds.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    env = w.env("current", VM_IMAGE_DIR=str(builds), VM_NETWORK="isolated")
    ok(w.vm_sh("create", env), "create (current)")
    argv = w.starts()[-1]
    kernel = argv[argv.index("-kernel") + 1]
    expect(kernel == str(builds / "build-new" / "vmlinuz"), f"-kernel {kernel}, expected build-new's")
    info = subprocess.run(["qemu-img", "info", "--output=json", str(w.vms / "current" / "overlay.qcow2")],
                          capture_output=True, text=True, check=True)
    backing = json.loads(info.stdout).get("backing-filename")
    expect(backing == str(builds / "build-new" / "disk.qcow2"), f"the overlay's base is {backing}")
    ok(w.vm_sh("destroy", env), "destroy (current)")
    env = w.env("plain", VM_NETWORK="isolated")
    ok(w.vm_sh("create", env), "create (a plain image directory)")
    argv = w.starts()[-1]
    expect(argv[argv.index("-kernel") + 1] == str(w.image / "vmlinuz"), f"-kernel of the plain directory: {argv}")
    ok(w.vm_sh("destroy", env), "destroy (plain)")


# Mutation caught: vm.sh resolving `current` without build-image's lock (shared): a build
# published meanwhile could remove the build the create boots from.
def test_a_create_waits_while_build_image_publishes(w):
    import fcntl
    builds = w.base / "builds"
    (builds / "build-a").mkdir(parents=True)
    for f in ("disk.qcow2", "vmlinuz", "initrd.img"):
        shutil.copy(w.image / f, builds / "build-a" / f)
    (builds / "current").symlink_to("build-a")
    lock = open(builds / ".lock", "w")
    for p in [builds, *builds.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    env = w.env("locked", VM_IMAGE_DIR=str(builds), VM_NETWORK="isolated")
    p = subprocess.Popen(["bash", str(w.vm_sh_path), "create"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        expect(p.poll() is None and not w.log.read_text(),
               "the create went on while build-image held its lock")
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    out, err = p.communicate(timeout=60)
    expect(p.returncode == 0, f"the create after the lock: {err}")
    ok(w.vm_sh("destroy", env), "destroy (locked)")


# Mutation caught: `auto` deciding on KVM by this process's view of /dev/kvm under a systemd
# supervisor (in the role's sandbox, PrivateDevices=, there is no /dev/kvm: every VM ran with TCG).
def test_auto_asks_qemu_for_kvm_where_this_process_cannot_open_it(w):
    env = w.env("auto", VM_ACCEL="auto", VM_SUPERVISOR="systemd-user", FAKE_QEMU_KVM="fail")
    r = w.vm_sh("create", env, user=NOBODY)
    ok(r, "create (auto, as nobody)")
    tried = [accel(a) for a in w.starts()]
    expect(tried == ["kvm", "tcg"], f"accelerators tried: {tried}, expected kvm, then tcg\n{r.stderr}")
    expect("Could not access KVM kernel module" in r.stderr, f"QEMU's reason is not shown:\n{r.stderr}")
    vm = json.loads((w.vms / "auto" / "vm.json").read_text())
    expect(vm["accel"] == "tcg" and vm["supervisor"] == "systemd-user", f"vm.json: {vm}")
    ok(w.vm_sh("destroy", env, user=NOBODY), "destroy")
    w.nothing_left("auto", "destroy")
    # Where QEMU runs in this process's own context (pidfile), the device decides.
    w.log.write_text("")
    env = w.env("auto-pidfile", VM_ACCEL="auto", FAKE_QEMU_KVM="fail")
    ok(w.vm_sh("create", env, user=NOBODY), "create (auto, pidfile, as nobody)")
    others_rw = os.path.exists("/dev/kvm") and os.stat("/dev/kvm").st_mode & 0o006 == 0o006
    want = ["kvm", "tcg"] if others_rw else ["tcg"]
    tried = [accel(a) for a in w.starts()]
    expect(tried == want, f"accelerators tried (pidfile): {tried}, expected {want}")
    ok(w.vm_sh("destroy", env, user=NOBODY), "destroy")
    w.nothing_left("auto-pidfile", "destroy")


def test_a_vm_that_does_not_boot_is_a_failed_create_that_leaves_nothing(w):
    for sup in ("pidfile", "systemd-user"):
        name = f"never-{sup}"
        env = w.env(name, VM_SUPERVISOR=sup, VM_BOOT_SECONDS="1", FAKE_QEMU_BOOT_SECONDS="never")
        r = w.vm_sh("create", env)
        expect(r.returncode != 0, f"{sup}: a VM that never booted was created")
        expect("did not start within 1s (tcg)" in r.stderr, f"{sup}: another failure:\n{r.stderr}")
        w.nothing_left(name, f"{sup}: the failed create")


def test_a_create_killed_half_way_is_undone_by_the_destroy(w):
    for sup in ("pidfile", "systemd-user"):
        name = f"killed-{sup}"
        env = w.env(name, VM_SUPERVISOR=sup, FAKE_QEMU_BOOT_SECONDS="never", VM_BOOT_SECONDS="30")
        p = subprocess.Popen(["bash", str(w.vm_sh_path), "create"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while not (w.vms / name / "console.log").exists() or not w.processes(name):
            expect(time.monotonic() < deadline, f"{sup}: QEMU did not start")
            time.sleep(0.05)
        time.sleep(0.3)
        # SIGKILL, as a killed tofu's local-exec may get: no trap runs, QEMU is left.
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        expect(w.processes(name), f"{sup}: nothing was left to clean up (the kill came too late)")
        ok(w.vm_sh("destroy", env), f"destroy after a killed create ({sup})")
        w.nothing_left(name, f"{sup}: destroy after a killed create")


def test_a_port_taken_before_qemu_binds_it_is_tried_again_and_then_named(w):
    # The range's one port bound by another socket that does not listen: nothing answers there
    # (the choice takes it), but QEMU cannot bind it, as when another VM took it meanwhile.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    env = w.env("port", VM_PORT_MIN=str(port), VM_PORT_MAX=str(port))
    r = w.vm_sh("create", env)
    held.close()
    expect(r.returncode != 0, "a create succeeded on a port another process holds")
    expect(len(w.starts()) == 5, f"{len(w.starts())} start(s), expected 5 tries\n{r.stderr}")
    expect(f"{port}-{port}" in r.stderr, f"the failure does not name the port range:\n{r.stderr}")
    w.nothing_left("port", "the failed create")


def main():
    only = sys.argv[sys.argv.index("-k") + 1] if "-k" in sys.argv else None
    if os.geteuid() != 0:
        sys.exit("tests/qemu/vm_sh_test.py: run as root (one case runs vm.sh as nobody)")
    cases = [(n, f) for n, f in globals().items() if n.startswith("test_") and (only is None or only in n)]
    failed = 0
    started = time.monotonic()
    for name, case in cases:
        with tempfile.TemporaryDirectory(prefix="vm-sh-test.") as tmp:
            w = World(pathlib.Path(tmp))
            t = time.monotonic()
            try:
                case(w)
                print(f"ok    {name} ({time.monotonic() - t:.1f}s)")
            except Failed as e:
                failed += 1
                print(f"FAIL  {name}: {e}")
            finally:
                w.cleanup()
    print(f"{len(cases) - failed} of {len(cases)} passed in {time.monotonic() - started:.1f}s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
