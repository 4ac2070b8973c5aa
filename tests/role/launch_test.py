#!/usr/bin/env python3
"""Fast test of the role's default launch command (role/templates/launch.sh.j2); no container.

The template is rendered by ansible-playbook (the one next to this Python, else on PATH: the
role's own filters and template settings), then run as the provisioner runs it (environment,
token on stdin) with a stub `ssh` first on PATH. The stub answers each call as the scenario says
(connection refused, timed out, hanging until ConnectTimeout, a host key mismatch, permission
denied, ...) and otherwise plays the VM: it runs the remote command with `sh -c`, as sshd would,
in a directory of the scenario with its own PATH, where a fake `forgejo-runner` (and maybe a fake
`cloud-init`) behave as the scenario says. Each scenario then checks the exit status, the time
asked to wait, what the operator reads on stderr, and what reached "the VM".

No check reads the wall clock against an upper bound (these machines are shared; a loaded one
runs everything late). The launch's own part runs on a clock of its own: stub `date +%s` and
`sleep` on its PATH read and advance $FAKE_SSH_DIR/clock, and the stub ssh's hang advances it by
its ConnectTimeout, so its backoff and deadlines are exact numbers. On "the VM", a `sleep` and
a `timeout` that log what they are asked for: what the remote part waits is the sum of those.

Most scenarios start a runner (RUNNER_ACTION unset, which means start); the later ones then run
the command again with RUNNER_ACTION=check or stop and empty stdin, as the provisioner does, and
check what it answers and what is left on "the VM" (the runner's process, UUID.pid, UUID.token).
The fake runner reads its token file and ends on SIGTERM as forgejo-runner does (see RUNNER_STUB).

Scenarios run in parallel (most of their time is sleeping on "the VM"); the whole test takes about 20 s.

Usage: launch_test.py [--template FILE] [-k SUBSTRING]... [-v] [--keep]
  --template  render this file instead of role/templates/launch.sh.j2 (to try a mutation)
  -k          run only the scenarios whose name contains SUBSTRING (repeatable)
  -v          show what each launch printed on stderr (what the operator reads)
  --keep      keep the work directory (the rendered scripts, each scenario's calls and "VM")
"""
import argparse
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import zlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "runner-t0ken-5ecret-e2c1"
URL = "https://forgejo.example.test"
HANDLE = "job-handle-7f3a"
ADDRESS = "vm-1.example.test"
KNOWN_HOSTS = "vm-1.example.test ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPoolKnownHostsLine"
OUTPUT_HOST_KEY = "[vm-1.example.test]:2200 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFromTheModule"
PRIVATE_KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nZmFrZSBrZXk=\n-----END OPENSSH PRIVATE KEY-----"

# The pools the template is rendered for: `a` as the role's defaults have it (runner_bin looked
# up on the VM's PATH), `b` with a known_hosts output, an absolute runner_bin, another port/user.
VARIANTS = {
    "a": {
        "address_output": "address",
        "ssh_private_key_output": "ssh_private_key",
        "ssh_user": "runner",
        "ssh_port": 22,
        "known_hosts": KNOWN_HOSTS,
        "known_hosts_output": "",
        "runner_bin": "forgejo-runner",
        "connect_timeout": 30,
    },
    "b": {
        "address_output": "address",
        "ssh_private_key_output": "ssh_private_key",
        "ssh_user": "ci-b",
        "ssh_port": 2200,
        "known_hosts": KNOWN_HOSTS,
        "known_hosts_output": "host_keys",
        "runner_bin": "@shared@/vm-runner",
        "connect_timeout": 30,
    },
    # `c`: the VM's SSH port from a tofu output (examples/qemu: a port per VM), as `a` otherwise.
    "c": {
        "address_output": "address",
        "ssh_private_key_output": "ssh_private_key",
        "ssh_user": "runner",
        "ssh_port": 22,
        "ssh_port_output": "ssh_port",
        "known_hosts": KNOWN_HOSTS,
        "known_hosts_output": "",
        "runner_bin": "forgejo-runner",
        "connect_timeout": 30,
    },
}

# --- the stub ssh -------------------------------------------------------------------------------
SSH_STUB = r'''#!@PYTHON@
"""Stub ssh: logs each call; answers from $FAKE_SSH_DIR/answers.json, else plays the VM."""
import json, os, stat, subprocess, sys, time
d = os.environ["FAKE_SSH_DIR"]
args = sys.argv[1:]
opts, i = {}, 0
while i < len(args):
    a = args[i]
    if a == "--":
        i += 1
        break
    if not a.startswith("-") or a == "-":
        break
    if a[1] in "bcDEeFIiJLlmOopQRSWw":
        val = a[2:] if len(a) > 2 else args[i + 1]
        i += 1 if len(a) > 2 else 2
        if a[1] == "o":
            k, _, v = val.partition("=")
            opts[k] = v
        else:
            opts["-" + a[1]] = val
    else:
        i += 1
host, command = args[i], " ".join(args[i + 1:])
def read(p):
    try:
        with open(p, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None
key = opts.get("IdentityFile", "")
clock = os.path.join(d, "clock")
with open(clock, encoding="utf-8") as f:
    vt = int(f.read())
call = {
    "t": time.time(), "vt": vt, "argv": args, "host": host, "command": command,
    "port": opts.get("-p"), "user": opts.get("-l"), "options": opts,
    "known_hosts": read(opts.get("UserKnownHostsFile", "")),
    "key": read(key), "key_mode": oct(stat.S_IMODE(os.stat(key).st_mode)) if os.path.exists(key) else None,
}
with open(os.path.join(d, "calls.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps(call) + "\n")
with open(os.path.join(d, "answers.json"), encoding="utf-8") as f:
    plan = json.load(f)
n = sum(1 for _ in open(os.path.join(d, "calls.jsonl"), encoding="utf-8"))
answer = plan["answers"][n - 1] if n <= len(plan["answers"]) else plan["then"]
port, user = opts.get("-p", "22"), opts.get("-l", "root")
say = {
    "refused": f"ssh: connect to host {host} port {port}: Connection refused",
    "timeout": f"ssh: connect to host {host} port {port}: Connection timed out",
    "hostkey": "\n".join([
        "@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@",
        "@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @",
        "@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@",
        "IT IS POSSIBLE THAT SOMEONE IS DOING SOMETHING NASTY!",
        "The fingerprint for the ED25519 key sent by the remote host is",
        "SHA256:fakeFingerprintOfTheNewKey.",
        f"Host key for {host} has changed and you have requested strict checking.",
        "Host key verification failed.",
    ]),
    "unknown-hostkey": f"No ED25519 host key is known for {host} and you have requested strict checking.\nHost key verification failed.",
    "denied": f"{user}@{host}: Permission denied (publickey).",
    "weird": "Bad owner or permissions on /etc/ssh/ssh_config.d/x.conf",
}
if answer == "hang":
    # A VM that accepts the connection and never sends its banner: ssh gives up at ConnectTimeout.
    # (On the launch's clock: no real time passes.)
    with open(clock, "w", encoding="utf-8") as f:
        f.write(str(vt + int(opts.get("ConnectTimeout", "30"))))
    sys.stderr.write(f"Connection timed out during banner exchange\r\nConnection to {host} port {port} timed out\r\n")
    sys.exit(255)
if answer in say:
    sys.stderr.write(say[answer].replace("\n", "\r\n") + "\r\n")
    sys.exit(255)
assert answer == "ok", answer
vm = os.environ["FAKE_VM"]
env = {"PATH": vm + "/bin:" + os.environ["FAKE_HOST_BIN"], "HOME": vm, "FAKE_VM": vm, "LC_ALL": "C"}
os.umask(0o022)  # sshd's, not the launch command's 077
sys.exit(subprocess.run(["/bin/sh", "-c", command], env=env, cwd=vm).returncode)
'''

# --- the fake forgejo-runner on "the VM" ---------------------------------------------------------
RUNNER_STUB = r'''#!@PYTHON@
"""Fake forgejo-runner: --version and one-job as $FAKE_VM/runner.json says.

Like the real one (ppaslan/runner a811c1ac): it reads its --token-url file once, while it builds
its configuration (internal/app/cmd/args.go, connectionFromArguments -> config.ResolveSecretURL),
which takes a moment here (so a launch that removes the file too early is caught), and logs
"Starting job" only after that (internal/app/cmd/job.go, runJob). SIGTERM (main.go:
signal.NotifyContext) ends it: "single task poller is shutting down", exit 0; how it ended goes
to $FAKE_VM/runner-exit.json. Modes: declare, late, quick, fail, silent (never declares),
hold (reads its token only once $FAKE_VM/go exists), ignores-term (a task that does not stop on
SIGTERM: only SIGKILL ends it)."""
import json, os, signal, stat, sys, time
vm = os.environ["FAKE_VM"]
with open(os.path.join(vm, "runner.json"), encoding="utf-8") as f:
    cfg = json.load(f)
if sys.argv[1:] == ["--version"]:
    print(cfg["version"])
    sys.exit(0)
mode = cfg["mode"]
def log(msg, level="info"):
    print(f'time="2026-01-01T00:00:00Z" level={level} msg="{msg}"', file=sys.stderr, flush=True)
def ended(how):
    with open(os.path.join(vm, "runner-exit.json"), "w", encoding="utf-8") as f:
        json.dump({"how": how, "pid": os.getpid()}, f)
def on_term(signum, frame):
    log("single task poller is shutting down")
    ended("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignores-term" else on_term)
args = sys.argv[1:]
token_url = args[args.index("--token-url") + 1] if "--token-url" in args else ""
path = token_url[len("file:"):]
time.sleep(0.3)
while mode == "hold" and not os.path.exists(os.path.join(vm, "go")):
    time.sleep(0.05)
st = os.stat(path)
with open(path, encoding="utf-8") as f:
    token = f.read()
record = {"argv": args, "pid": os.getpid(), "token": token, "token_mode": oct(stat.S_IMODE(st.st_mode)),
          "token_in_env": any(token.strip() in v for v in os.environ.values())}
with open(os.path.join(vm, "runner-run.json"), "w", encoding="utf-8") as f:
    json.dump(record, f)
log("Starting job")
if mode == "fail":
    for i in range(8):
        log(f"config check {i}: ok")
    log("fail to invoke Declare", "error")
    print("Error: unauthenticated: unregistered runner", file=sys.stderr)
    ended("exit 1")
    sys.exit(1)
if mode == "late":
    time.sleep(2)
if mode in ("declare", "late", "quick", "ignores-term"):
    log("runner: ephemeral-1, with version: v12.8.2, with labels: [debian], ephemeral: true, declared successfully")
if mode == "quick":
    ended("exit 0")
    sys.exit(0)
end = time.time() + 40
while time.time() < end and not os.path.exists(os.path.join(vm, "stop")):
    time.sleep(0.1)
ended("exit 0")
'''

# `cloud-init status --wait`: installs the runner a second later (as a first boot would), then
# exits 2 ("done, with recoverable errors"), which the launch must not take as a failure.
CLOUD_INIT_STUB = r'''#!/bin/sh
echo "$*" >> "$FAKE_VM/cloud-init.log"
[ "$1 $2" = "status --wait" ] || exit 0
if [ -e "$FAKE_VM/cloud-init-hangs" ]; then @SLEEP@ 60; fi
@SLEEP@ 1
cp "$FAKE_VM/runner-pending" "$FAKE_VM/bin/forgejo-runner"
exit 2
'''


# The launch's clock (see the header): `date +%s` reads it, `sleep N` advances it by N.
LOCAL_DATE = r'''#!/bin/sh
if [ "$*" = "+%s" ]; then exec cat "$FAKE_SSH_DIR/clock"; fi
exec @DATE@ "$@"
'''
LOCAL_SLEEP = r'''#!/bin/sh
case $1 in
"" | *[!0-9]*) echo "launch_test: sleep $*: the launch's own part sleeps whole seconds" >&2; exit 1 ;;
esac
c=$(cat "$FAKE_SSH_DIR/clock")
echo "$c $1" >> "$FAKE_SSH_DIR/sleeps.log"
echo $((c + $1)) > "$FAKE_SSH_DIR/clock"
'''
# On "the VM": real, but logged.
VM_SLEEP = r'''#!/bin/sh
echo "$1" >> "$FAKE_VM/sleeps.log"
exec @SLEEP@ "$@"
'''
VM_TIMEOUT = r'''#!/bin/sh
echo "$1" >> "$FAKE_VM/timeouts.log"
exec @TIMEOUT@ "$@"
'''
CLOCK_START = 1_800_000_000


def real_tool(name):
    """The host's `name`, not a stub of this test."""
    for d in ("/usr/bin", "/bin", "/usr/local/bin"):
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    sys.exit(f"launch_test: no {name} in /usr/bin, /bin or /usr/local/bin")


def tools(text):
    for name in ("date", "sleep", "timeout"):
        text = text.replace(f"@{name.upper()}@", real_tool(name))
    return text


def write(path, text, mode=0o644):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(mode)


def ansible_playbook():
    here = Path(sys.executable).parent / "ansible-playbook"
    found = str(here) if here.exists() else shutil.which("ansible-playbook")
    if not found:
        sys.exit("launch_test: ansible-playbook not found next to this Python or on PATH; run it with "
                 "the venv .ci/role makes: target/role-e2e/venv/bin/python tests/role/launch_test.py")
    return found


def render(template, work):
    """The template, rendered by Ansible for each variant: {variant: path}."""
    pools_dir = work / "pools"
    variants = []
    for name, launch in VARIANTS.items():
        launch = {k: (v.replace("@shared@", str(work / "shared")) if isinstance(v, str) else v)
                  for k, v in launch.items()}
        launch["runner_dir"] = str(work / "shared" / "runner-dir")
        variants.append({"name": name, "launch": launch})
        # What the role's "Write each pool's known hosts" task writes.
        write(pools_dir / name / "known_hosts", launch["known_hosts"] + "\n")
    (work / "rendered").mkdir()
    write(work / "vars.json", json.dumps({
        "template": str(template),
        "out": str(work / "rendered"),
        "variants": variants,
        "_ci_ephemeral_provisioner_pools_dir": str(pools_dir),
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
    }))
    write(work / "render.yml", textwrap.dedent("""\
        - name: Render the launch template
          hosts: localhost
          gather_facts: false
          tasks:
            - name: Render each variant
              ansible.builtin.template:
                src: "{{ template }}"
                dest: "{{ out }}/{{ item.name }}"
                mode: "0755"
              loop: "{{ variants }}"
        """))
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_LOCALHOST_WARNING="False",
               ANSIBLE_INVENTORY_UNPARSED_WARNING="False", ANSIBLE_RETRY_FILES_ENABLED="False")
    r = subprocess.run([ansible_playbook(), "-i", "localhost,", str(work / "render.yml"),
                        "-e", "@" + str(work / "vars.json")],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"launch_test: rendering {template} failed:\n{r.stdout}{r.stderr}")
    return {name: work / "rendered" / name for name in VARIANTS}


class Case:
    """One run of the launch command. `vm` sets up "the VM": runner (the version it prints and
    how one-job behaves; None = not installed) and cloud_init ("installs" / "hangs" / None)."""

    def __init__(self, name, *, variant="a", answers=(), then="ok", version="forgejo-runner version v12.8.2",
                 mode="declare", runner=True, cloud_init=None, labels="debian:host", timeout=120,
                 address=ADDRESS, uuid=None, check=None, action=None, after=None, handle=HANDLE,
                 vm_files=None, port_output="2201"):
        self.name, self.variant, self.answers, self.then = name, variant, list(answers), then
        self.version, self.mode, self.runner, self.cloud_init = version, mode, runner, cloud_init
        self.labels, self.timeout, self.check, self.handle = labels, timeout, check, handle
        # action: RUNNER_ACTION of the first run (None: not set, which means start). after(c):
        # what happens next (c.act("check"), the runner ending, ...), before the check.
        self.action, self.after, self.acts = action, after, []
        # "@case@" in the address: this case's directory (where a ProxyCommand would leave a mark).
        self.address = address
        self.uuid = uuid or f"00000000-0000-4000-8000-{zlib.crc32(name.encode()):012d}"
        # Files on "the VM" (its HOME), by path relative to it: (content, mode).
        self.vm_files = vm_files or {}
        self.port_output = port_output

    def run(self, work, rendered):
        d = work / "cases" / self.name
        self.dir, self.ssh_dir, self.vm = d, d / "ssh", d / "vm"
        self.address = self.address.replace("@case@", str(d))
        self.ssh_dir.mkdir(parents=True)
        (self.vm / "bin").mkdir(parents=True)
        write(self.ssh_dir / "answers.json", json.dumps({"answers": self.answers, "then": self.then}))
        write(self.vm / "runner.json", json.dumps({"version": self.version, "mode": self.mode}))
        write(self.ssh_dir / "clock", str(CLOCK_START))
        write(self.vm / "bin" / "sleep", tools(VM_SLEEP), 0o755)
        write(self.vm / "bin" / "timeout", tools(VM_TIMEOUT), 0o755)
        for rel, (content, mode) in self.vm_files.items():
            write(self.vm / rel, content, mode)
        runner = RUNNER_STUB.replace("@PYTHON@", sys.executable)
        if self.cloud_init:
            write(self.vm / "bin" / "cloud-init", tools(CLOUD_INIT_STUB), 0o755)
            write(self.vm / "runner-pending", runner, 0o755)
            if self.cloud_init == "hangs":
                write(self.vm / "cloud-init-hangs", "")
        elif self.runner:
            write(self.vm / "bin" / "forgejo-runner", runner, 0o755)
        self.rendered = rendered[self.variant]
        self.env = {
            "PATH": f"{work / 'bin'}:{os.environ['PATH']}",
            "FAKE_HOST_BIN": str(work / "host-bin"),
            "FAKE_SSH_DIR": str(self.ssh_dir),
            "FAKE_VM": str(self.vm),
            "RUNNER_ID": "41",
            "RUNNER_UUID": self.uuid,
            "RUNNER_NAME": "ephemeral-c1-1",
            "RUNNER_LABELS": self.labels,
            "FORGEJO_URL": URL,
            "JOB_HANDLE": self.handle,
            "LAUNCH_TIMEOUT_SECONDS": str(self.timeout),
            "TOFU_OUTPUT_ADDRESS": self.address,
            "TOFU_OUTPUT_SSH_PRIVATE_KEY": PRIVATE_KEY,
            "TOFU_OUTPUT_HOST_KEYS": OUTPUT_HOST_KEY,
            "TOFU_OUTPUT_SSH_PORT": self.port_output,
        }
        if self.action == "probe":
            # As the provisioner runs a probe: no runner, no job, nothing on stdin.
            for k in ("RUNNER_ID", "RUNNER_UUID", "RUNNER_NAME", "JOB_HANDLE"):
                del self.env[k]
        stdin = None if self.action == "probe" else TOKEN + "\n"
        self.rc, self.stdout, self.stderr, self.elapsed, self.waits = self.invoke(self.action, stdin)
        self.calls = self.ssh_calls()
        run = self.vm / "runner-run.json"
        self.started = json.loads(run.read_text()) if run.exists() else None
        self.alive = self.started is not None and pid_alive(self.started["pid"])
        self.after_failed = None
        if self.after:
            try:
                self.after(self)
            except Failed as e:
                self.after_failed = e
        return self

    def invoke(self, action, stdin):
        """One run of the launch command: (exit status, stdout, stderr, seconds, waits). waits:
        "local", the seconds its own part waited (on its clock); "remote", what each `sleep` on
        the VM was asked for; "timeouts", the first argument of each `timeout` there."""
        before = (self.clock(), len(self.vm_log("sleeps")), len(self.vm_log("timeouts")))
        env = dict(self.env)
        if action is not None:
            env["RUNNER_ACTION"] = action
        started = time.monotonic()
        # Its own process group, killed past the launch timeout (+5 s), as the provisioner does.
        p = subprocess.Popen([str(self.rendered)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE, text=True,
                             start_new_session=True)
        try:
            out, err = p.communicate(stdin, timeout=self.timeout + 5)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            err += f"\n[launch_test: killed after {self.timeout + 5}s]"
        waits = {"local": self.clock() - before[0], "remote": [float(x) for x in self.vm_log("sleeps")[before[1]:]],
                 "timeouts": [int(x) for x in self.vm_log("timeouts")[before[2]:]]}
        return p.returncode, out, err, time.monotonic() - started, waits

    def clock(self):
        return int((self.ssh_dir / "clock").read_text())

    def vm_log(self, name):
        f = self.vm / f"{name}.log"
        return f.read_text().split() if f.exists() else []

    def act(self, action):
        """RUNNER_ACTION=action (check, stop), stdin empty, as the provisioner runs it; its
        result (rc, stdout, stderr, elapsed, calls: the ssh calls it made) is appended to acts."""
        before = len(self.ssh_calls())
        rc, out, err, elapsed, waits = self.invoke(action, None)
        r = {"action": action, "rc": rc, "stdout": out, "stderr": err, "elapsed": elapsed, "waits": waits,
             "calls": self.ssh_calls()[before:]}
        self.acts.append(r)
        return r

    def ssh_calls(self):
        f = self.ssh_dir / "calls.jsonl"
        return [json.loads(l) for l in f.read_text().splitlines()] if f.exists() else []

    def runner_file(self, ext):
        """UUID.<ext> in the runner directory on "the VM"."""
        return self.work / "shared" / "runner-dir" / f"{self.uuid}.{ext}"

    def runner_pid(self):
        """The runner's pid: from its own record, else from the pid file."""
        if self.started:
            return self.started["pid"]
        try:
            return int(self.runner_file("pid").read_text())
        except (OSError, ValueError):
            return None

    def end_runner(self):
        """The runner ends by itself (its job done): it exits, and is gone."""
        write(self.vm / "stop", "")
        wait_for(lambda: not pid_alive(self.runner_pid()), 5, f"{self.name}: the runner did not end")

    def stop(self):
        write(self.vm / "stop", "")
        pid = self.runner_pid() if hasattr(self, "work") else None
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL if self.mode == "ignores-term" else signal.SIGTERM)
            except OSError:
                pass
        for p in getattr(self, "others", []):
            p.kill()
            p.wait()

    def remote_calls(self):
        return [c for c in self.calls if c["command"] != "true"]


def pid_alive(pid):
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # A zombie is gone for our purpose.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(cond, seconds, what):
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            raise Failed(what)
        time.sleep(0.05)


# --- checks -------------------------------------------------------------------------------------
class Failed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failed(what)


def waited(waits):
    """The seconds a run asked to wait: its own part's (on its clock) and the VM's sleeps. (A
    `timeout` is a limit, not a wait: the checks that need it add it.)"""
    return waits["local"] + sum(waits["remote"])


def quick(c, limit, plus=0):
    w = waited(c.waits) + plus
    expect(w < limit, f"waited {w:.1f}s ({c.waits}), expected < {limit}s")


def ok_fast(c, limit=5):
    expect(c.rc == 0, f"exit status {c.rc}, expected 0")
    quick(c, limit)


def seen(c):
    """What the operator reads of a failed launch: the provisioner's error message keeps the last
    six non-empty lines of its stderr, joined with " | " (src/adapters/process.rs, describe)."""
    lines = [l for l in c.stderr.splitlines() if l.strip()]
    return " | ".join(lines[-6:])


def failed_with(c, *needles, limit=None):
    """A failure whose message (as the operator sees it) matches every regex in needles."""
    expect(c.rc not in (0, None) and c.rc > 0, f"exit status {c.rc}, expected a failure (> 0)")
    for n in needles:
        expect(re.search(n, seen(c)), f"the last six lines of stderr do not match {n!r}")
    if limit is not None:
        quick(c, limit)


def not_started(c):
    expect(c.started is None, f"forgejo-runner one-job was started: {c.started}")


def runner_argv(c):
    expect(c.started is not None, "forgejo-runner one-job was never started")
    return c.started["argv"]


def labels_of(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--label"]


def check_good(c):
    ok_fast(c)
    argv = runner_argv(c)
    token_file = f"{c.work}/shared/runner-dir/{c.uuid}.token"
    expect(argv == ["one-job", "--url", URL, "--uuid", c.uuid, "--token-url", f"file:{token_file}",
                    "--label", "debian:host", "--label", "gpu:host", "--label", "big box:host",
                    "--label", "it's:host", "--handle", HANDLE, "--wait"], f"one-job argv: {argv}")
    expect(c.started["token"] == TOKEN + "\n", f"token file holds {c.started['token']!r}")
    expect(c.started["token_mode"] == "0o600", f"token file mode {c.started['token_mode']}")
    expect(not c.started["token_in_env"], "the token is in the runner's environment")
    expect(c.alive, "the runner is not running after the launch returned")
    expect(not c.runner_file("token").exists(), "the token file is still on the VM after the runner declared itself")
    pid = c.runner_file("pid").read_text() if c.runner_file("pid").exists() else None
    expect(pid == f"{c.started['pid']}\n", f"the pid file holds {pid!r}, the runner's pid is {c.started['pid']}")
    expect(len(c.calls) == 2 and c.calls[0]["command"] == "true",
           f"expected one probe (`true`) and one start: {[x['command'][:40] for x in c.calls]}")
    for call in c.calls:
        expect(not any(TOKEN in a for a in call["argv"]), "the token is on ssh's command line")
        o = call["options"]
        expect(o.get("StrictHostKeyChecking") == "yes" and o.get("BatchMode") == "yes"
               and o.get("GlobalKnownHostsFile") == "/dev/null", f"ssh options {o}")
        expect(call["known_hosts"] == KNOWN_HOSTS + "\n", f"known_hosts {call['known_hosts']!r}")
        expect(call["key"] == PRIVATE_KEY + "\n" and call["key_mode"] == "0o600",
               f"key file {call['key_mode']} {call['key']!r}")
        expect((call["host"], call["port"], call["user"]) == (ADDRESS, "22", "runner"),
               f"ssh target {call['host']} {call['port']} {call['user']}")
        expect_destination_after_dashes(call, ADDRESS)


def expect_destination_after_dashes(call, address):
    """ssh was given `--` just before the destination: nothing from the address is an option."""
    argv = call["argv"]
    expect("--" in argv and argv[argv.index("--") + 1] == address == call["host"],
           f"ssh argv has no `--` right before the destination {address!r}: {argv}")


def check_variant_b(c):
    ok_fast(c)
    expect(runner_argv(c)[:1] == ["one-job"], "not started through the absolute runner_bin")
    for call in c.calls:
        expect(call["known_hosts"] == f"{KNOWN_HOSTS}\n{OUTPUT_HOST_KEY}\n",
               f"known_hosts does not add the tofu output: {call['known_hosts']!r}")
        expect((call["port"], call["user"]) == ("2200", "ci-b"), f"port/user {call['port']} {call['user']}")


def check_refused(c):
    expect(c.rc == 0, f"exit status {c.rc}, expected 0 once sshd answers")
    probes = [x for x in c.calls if x["command"] == "true"]
    expect(len(probes) == 3 and len(c.remote_calls()) == 1,
           f"expected 3 probes (2 refused) and one start, got {len(probes)} and {len(c.remote_calls())}")
    gaps = [b["vt"] - a["vt"] for a, b in zip(probes, probes[1:])]
    expect(gaps == [1, 2], f"backoff gaps {gaps} (on the launch's clock), expected 1 s then 2 s")
    expect(runner_argv(c)[0] == "one-job", "runner not started")


def check_hostkey(c):
    failed_with(c, re.escape(ADDRESS), "port 22", "host key of .* does not match its known_hosts",
                "not retrying", "Host key verification failed", "launch.known_hosts", limit=3)
    expect(len(c.calls) == 1, f"{len(c.calls)} ssh calls: a host key mismatch must not be retried")
    not_started(c)


def check_never(c):
    failed_with(c, "gave up waiting for sshd", re.escape(ADDRESS), "port 22", r"after [0-9]+s",
                "the last ssh error: ssh: connect to host .* Connection timed out", r"attempts: [3-9]")
    quick(c, c.timeout - 1)  # done before LAUNCH_TIMEOUT_SECONDS
    expect(not c.remote_calls(), "started something although sshd never answered")


def check_hang(c):
    failed_with(c, "gave up waiting for sshd", "timed out during banner exchange")
    quick(c, c.timeout - 1)  # a probe's ConnectTimeout must not run past the deadline
    for call in c.calls:
        expect(int(call["options"]["ConnectTimeout"]) < c.timeout,
               f"ConnectTimeout {call['options']['ConnectTimeout']} >= the launch timeout {c.timeout}")


def check_denied(c):
    failed_with(c, "Permission denied", "user 'runner'", "launch.ssh_user")
    expect(len(c.calls) == 4, f"{len(c.calls)} ssh calls, expected 4 (3 retries of Permission denied)")
    not_started(c)


def check_denied_twice(c):
    expect(c.rc == 0, f"exit status {c.rc}: a login refused twice, then accepted, is a launch")
    expect(len(c.calls) == 4, f"{len(c.calls)} ssh calls, expected 2 refused probes, 1 accepted, 1 start")
    expect(runner_argv(c)[0] == "one-job", "runner not started")


def check_weird(c):
    failed_with(c, "unexpected", "Bad owner or permissions", limit=3)
    expect(len(c.calls) == 1, f"{len(c.calls)} ssh calls: an unexpected ssh error is not retried")


def check_missing(c):
    failed_with(c, "forgejo-runner is not installed on the VM", "no executable forgejo-runner", "12.8 or newer",
                limit=5)
    not_started(c)


def check_old(c):
    failed_with(c, r"version 12\.7\.3", "12.8 or newer is needed", "one-job --handle", limit=5)
    not_started(c)


def check_dev(c):
    failed_with(c, "cannot tell the version", "forgejo-runner version dev", "12.8 or newer", limit=5)
    not_started(c)


def check_accepted(c):
    ok_fast(c)
    expect(runner_argv(c)[0] == "one-job", "runner not started")


def check_runner_fails(c):
    failed_with(c, "fail to invoke Declare", "Error: unauthenticated: unregistered runner",
                "exited with status 1 before it declared itself", limit=5)
    expect(not c.runner_file("token").exists(), "the token file is still on the VM after the runner exited")
    expect(not c.runner_file("pid").exists(), "the pid file of a runner that exited is still on the VM")


def check_silent(c):
    expect(c.rc == 0, f"exit status {c.rc}: a runner still starting after the watch is left to the grace")
    # A lower bound on the wall clock holds on any machine (a loaded one only takes longer).
    expect(3.5 <= c.elapsed, f"took {c.elapsed:.1f}s: expected a watch of several seconds")
    quick(c, c.timeout - 1)  # the watch ends before the launch timeout
    expect(c.alive, "the runner is not running")
    expect(not c.runner_file("token").exists(),
           "the token file is still on the VM although the runner logged \"Starting job\" (it has read it)")


def check_late(c):
    expect(c.rc == 0, f"exit status {c.rc}")
    expect(1.8 <= c.elapsed, f"took {c.elapsed:.1f}s: expected to wait for the runner to declare (2 s)")
    quick(c, 7)  # and to return once it has (the whole watch is 10 s)


def check_cloud_init(c):
    ok_fast(c)
    log = (c.vm / "cloud-init.log").read_text() if (c.vm / "cloud-init.log").exists() else ""
    expect("status --wait" in log, f"cloud-init status --wait was not run: {log!r}")
    expect(runner_argv(c)[0] == "one-job", "runner not started")


def check_cloud_init_hangs(c):
    failed_with(c, "forgejo-runner is not installed", "cloud-init was still running")
    expect(len(c.waits["timeouts"]) == 1, f"cloud-init was not waited for under `timeout`: {c.waits}")
    quick(c, c.timeout - 1, plus=c.waits["timeouts"][0])  # the cloud-init wait ends before the launch timeout


def check_bad_address(c):
    failed_with(c, "launch: the tofu output 'address'", "is not an IPv4 or IPv6 address or a DNS name",
                "not connecting", limit=2)
    expect(not c.calls, f"ssh was run with the address {c.address!r}: {[x['argv'] for x in c.calls]}")
    expect(not (c.dir / "proxy-ran").exists(), "the address ran a ProxyCommand")
    not_started(c)


def check_address_accepted(c):
    ok_fast(c)
    expect(runner_argv(c)[0] == "one-job", "runner not started")
    for call in c.calls:
        expect_destination_after_dashes(call, c.address)


def check_bad_uuid(c):
    failed_with(c, "RUNNER_UUID", "is not a UUID", limit=2)
    expect(not c.calls, f"ssh was run with RUNNER_UUID {c.uuid!r}")
    expect(not (c.work / "shared" / "etc").exists() and not (c.work / "etc").exists(),
           "a file was written outside the runner directory")
    not_started(c)


def check_empty_handle(c):
    failed_with(c, "JOB_HANDLE is empty", "any job of its labels", limit=2)
    expect(not c.calls, "ssh was run for an empty JOB_HANDLE")
    not_started(c)


def check_no_labels(c):
    failed_with(c, "RUNNER_LABELS", "names no label", limit=2)
    expect(not c.calls, "ssh was run although there is no label")


# --- check and stop (RUNNER_ACTION) --------------------------------------------------------------
def act_result(c, i, action):
    expect(len(c.acts) > i, f"no {action} was run")
    r = c.acts[i]
    expect(r["action"] == action, f"act {i} is {r['action']}, expected {action}")
    return r


def expect_one_strict_call(r):
    """check and stop: one ssh call (no probe), host key checking on, no token anywhere."""
    expect(len(r["calls"]) == 1, f"{r['action']}: {len(r['calls'])} ssh calls, expected 1")
    for call in r["calls"]:
        o = call["options"]
        expect(o.get("StrictHostKeyChecking") == "yes" and o.get("BatchMode") == "yes",
               f"{r['action']}: ssh options {o}")
        expect(not any(TOKEN in a for a in call["argv"]), f"{r['action']}: the token is on ssh's command line")
        expect_destination_after_dashes(call, ADDRESS)


def exited(c):
    """How the runner ended (its own record), or None (still running, or SIGKILLed)."""
    f = c.vm / "runner-exit.json"
    return json.loads(f.read_text())["how"] if f.exists() else None


def after_check(c):
    c.act("check")


def check_check_running(c):
    ok_fast(c)
    r = act_result(c, 0, "check")
    expect(r["rc"] == 0, f"check exited {r['rc']} while the runner runs, expected 0; stderr: {r['stderr']!r}")
    expect_one_strict_call(r)
    expect(pid_alive(c.runner_pid()), "check stopped the runner")


def after_end_check(c):
    c.end_runner()
    c.act("check")


def check_check_gone(c):
    ok_fast(c)
    r = act_result(c, 0, "check")
    expect(r["rc"] == 3, f"check exited {r['rc']} after the runner ended, expected 3; stderr: {r['stderr']!r}")


def check_check_cannot_tell(c):
    ok_fast(c)
    r = act_result(c, 0, "check")
    expect(r["rc"] not in (0, 3) and r["rc"] > 0,
           f"check exited {r['rc']} although ssh failed: neither 0 nor 3 (cannot tell) expected")
    expect(re.search("cannot tell whether runner .* still runs", r["stderr"]),
           f"check's stderr does not say it cannot tell: {r['stderr']!r}")
    expect(pid_alive(c.runner_pid()), "the runner is not running")


def after_stop_ssh_fails(c):
    c.act("stop")


def check_stop_cannot_confirm(c):
    ok_fast(c)
    r = act_result(c, 0, "stop")
    expect(r["rc"] not in (0, None) and r["rc"] > 0, f"stop exited {r['rc']} although ssh failed")
    expect("could not confirm" in r["stderr"], f"stop's stderr: {r['stderr']!r}")


OTHER_UUID = "00000000-0000-4000-8000-0000000000ff"


def after_recycled_pid(c):
    """The runner ended, and its pid now belongs to another process: another runner's, even."""
    c.end_runner()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "forgejo-runner", "one-job",
                              "--uuid", OTHER_UUID, "--token-url",
                              f"file:{c.work}/shared/runner-dir/{OTHER_UUID}.token"])
    c.others = [other]
    wait_for(lambda: b"one-job" in Path(f"/proc/{other.pid}/cmdline").read_bytes(), 5, "the other process did not start")
    write(c.runner_file("pid"), f"{other.pid}\n")
    c.act("check")
    c.act("stop")


def check_recycled_pid(c):
    ok_fast(c)
    r = act_result(c, 0, "check")
    expect(r["rc"] != 0, "check took another process, whose pid is in the pid file, for the runner")
    expect(r["rc"] == 3, f"check exited {r['rc']}, expected 3 (the runner is gone)")
    s = act_result(c, 1, "stop")
    expect(s["rc"] == 0, f"stop exited {s['rc']}; stderr: {s['stderr']!r}")
    expect(c.others[0].poll() is None, "stop killed another process, whose pid was in the pid file")


def after_no_pid_file(c):
    """A runner without a pid file (started by an earlier launch command, say)."""
    c.runner_file("pid").unlink()
    c.act("check")
    c.act("stop")


def check_no_pid_file(c):
    ok_fast(c)
    r = act_result(c, 0, "check")
    expect(r["rc"] == 0, f"check exited {r['rc']} for a running runner without a pid file, expected 0")
    s = act_result(c, 1, "stop")
    expect(s["rc"] == 0, f"stop exited {s['rc']}; stderr: {s['stderr']!r}")
    expect(not pid_alive(c.runner_pid()), "stop left the runner without a pid file running")


def after_stop_check(c):
    # A token file left behind (a runner stopped before it read it): stop removes it too.
    write(c.runner_file("token"), TOKEN + "\n", 0o600)
    c.act("stop")
    c.act("check")


def check_stop(c):
    ok_fast(c)
    r = act_result(c, 0, "stop")
    expect(r["rc"] == 0, f"stop exited {r['rc']}; stderr: {r['stderr']!r}")
    expect_one_strict_call(r)
    expect(not pid_alive(c.runner_pid()), "the runner still runs after stop")
    expect(exited(c) == "SIGTERM", f"the runner did not end on SIGTERM (its record: {exited(c)})")
    w = waited(r["waits"])
    expect(w < 5, f"stop waited {w:.1f}s ({r['waits']}) for a runner that ends on SIGTERM")
    expect(not c.runner_file("pid").exists(), "the pid file is still on the VM after stop")
    expect(not c.runner_file("token").exists(), "the token file is still on the VM after stop")
    k = act_result(c, 1, "check")
    expect(k["rc"] == 3, f"check after stop exited {k['rc']}, expected 3")


def after_end_stop(c):
    c.end_runner()
    c.act("stop")
    c.act("check")


def check_stop_gone(c):
    r = act_result(c, 0, "stop")
    expect(r["rc"] == 0, f"stop of a runner already gone exited {r['rc']}; stderr: {r['stderr']!r}")
    expect(not c.runner_file("pid").exists(), "the pid file is still on the VM after stop")
    k = act_result(c, 1, "check")
    expect(k["rc"] == 3, f"check after stop exited {k['rc']}, expected 3")


def check_stop_never_started(c):
    check_missing(c)
    check_stop_gone(c)


def after_stop(c):
    c.act("stop")


def check_stop_kill(c):
    ok_fast(c)
    r = act_result(c, 0, "stop")
    expect(r["rc"] == 0, f"stop exited {r['rc']}; stderr: {r['stderr']!r}")
    expect(not pid_alive(c.runner_pid()), "the runner that ignores SIGTERM still runs after stop")
    expect(exited(c) is None, f"the runner ended by itself ({exited(c)}), not by SIGKILL")
    w = waited(r["waits"])
    expect(9.9 <= w < 15, f"stop waited {w:.1f}s ({r['waits']}): expected SIGKILL 10 s after SIGTERM")
    expect("SIGKILL" in r["stderr"], f"stop does not say it used SIGKILL: {r['stderr']!r}")
    expect(not c.runner_file("pid").exists(), "the pid file is still on the VM after stop")


def after_token_unread(c):
    c.token_after_start = c.runner_file("token").exists()
    write(c.vm / "go", "")
    wait_for(lambda: (c.vm / "runner-run.json").exists(), 5, "the runner never read its token")
    c.started = json.loads((c.vm / "runner-run.json").read_text())
    c.token_gone = True
    try:
        wait_for(lambda: not c.runner_file("token").exists(), 4, "")
    except Failed:
        c.token_gone = False


def check_token_unread(c):
    expect(c.rc == 0, f"exit status {c.rc}: a runner still starting after the watch is left to the grace")
    expect(c.token_after_start, "the token file was removed before the runner read it")
    expect(c.started["token"] == TOKEN + "\n", f"the runner read {c.started['token']!r}")
    expect(c.token_gone, "the token file is still on the VM 4 s after the runner read it")


def check_probe(c):
    """probe: forgejo-runner's --version line on stdout, exit 0; nothing started, no token sent."""
    ok_fast(c)
    expect(c.stdout == c.version + "\n", f"stdout {c.stdout!r}, expected the --version line {c.version!r}")
    not_started(c)
    for call in c.calls:
        expect(TOKEN not in json.dumps(call), "the probe sent a runner token")
    expect(len(c.remote_calls()) == 1, f"{len(c.remote_calls())} remote calls, expected one")


def check_probe_old(c):
    # The provisioner judges the version (core/canary.rs): the probe only reports it.
    check_probe(c)


def check_probe_missing(c):
    failed_with(c, "forgejo-runner is not installed on the VM", limit=5)
    expect(c.stdout == "", f"stdout {c.stdout!r}")


def check_probe_waits(c):
    check_probe(c)
    probes = [x for x in c.calls if x["command"] == "true"]
    expect(len(probes) == 3, f"{len(probes)} sshd probes, expected 3 (2 refused)")


def check_probe_cloud_init(c):
    check_probe(c)
    log = (c.vm / "cloud-init.log").read_text() if (c.vm / "cloud-init.log").exists() else ""
    expect("status --wait" in log, f"cloud-init status --wait was not run: {log!r}")


def check_probe_host_key(c):
    failed_with(c, "host key of .* does not match its known_hosts", limit=3)
    expect(c.stdout == "", f"stdout {c.stdout!r}")


def check_port_output(c):
    ok_fast(c)
    expect(runner_argv(c)[0] == "one-job", "runner not started")
    for call in c.calls:
        expect(call["port"] == "2201", f"ssh went to port {call['port']}, not the output's 2201")


def check_bad_port_output(c):
    failed_with(c, "the tofu output 'ssh_port'", "not a port number", limit=3)
    expect(not c.calls, "ssh was run with a bad port")
    not_started(c)


def check_unknown_action(c):
    expect(c.rc == 2, f"exit status {c.rc} for RUNNER_ACTION=restart, expected 2")
    expect("RUNNER_ACTION='restart' is not start, check, stop or probe" in c.stderr, f"stderr: {c.stderr!r}")
    expect(not c.calls, "ssh was run for an unknown RUNNER_ACTION")
    not_started(c)


def check_labels_as_given(c):
    ok_fast(c)
    labels = labels_of(runner_argv(c))
    expect(labels == ["debian:host", "", " x:host "], f"the --label values: {labels}")


def check_docker_without_engine(c):
    failed_with(c, r'the docker label\(s\) "ubuntu" "arm:docker://node:22" need a Docker engine on the VM',
                r"NAME:host", limit=5)
    not_started(c)


def check_lxc_without_lxc(c):
    failed_with(c, r'the lxc label\(s\) "c:lxc" need LXC on the VM: no lxc-create or lxc-attach', limit=5)
    not_started(c)


def check_schemes_served(c):
    ok_fast(c)
    labels = labels_of(runner_argv(c))
    expect(labels == c.labels.split(","), f"the --label values: {labels}")


# Several labels, a name with a blank inside and one with a quote: each one --label, whole.
SEVERAL = "debian:host,gpu:host,big box:host,it's:host"
NO_LXC = "#!/bin/sh\nexit 0\n"
SCHEMES = "debian:host,ubuntu,arm:docker://node:22,c:lxc"
CASES = [
    Case("good", labels=SEVERAL, check=check_good),
    Case("variant-b", variant="b", check=check_variant_b),
    Case("refused-twice", answers=["refused", "refused"], check=check_refused),
    Case("host-key-changed", answers=["hostkey"], check=check_hostkey),
    Case("host-key-unknown", answers=["unknown-hostkey"], check=check_hostkey),
    Case("never-answers", then="timeout", timeout=8, check=check_never),
    Case("hangs", then="hang", timeout=10, check=check_hang),
    Case("permission-denied", then="denied", timeout=30, check=check_denied),
    Case("permission-denied-twice", answers=["denied", "denied"], check=check_denied_twice),
    Case("unexpected-ssh-error", answers=["weird"], check=check_weird),
    Case("runner-missing", runner=False, check=check_missing),
    Case("runner-12.7.3", version="forgejo-runner version v12.7.3", check=check_old),
    Case("runner-dev", version="forgejo-runner version dev", check=check_dev),
    Case("runner-12.8.0", version="12.8.0", mode="quick", check=check_accepted),
    Case("runner-12.10.0", version="forgejo-runner version v12.10.0", mode="quick", check=check_accepted),
    Case("runner-13.0.1", version="forgejo-runner version v13.0.1", mode="quick", check=check_accepted),
    Case("runner-exits-at-once", mode="fail", check=check_runner_fails),
    Case("runner-silent", mode="silent", timeout=10, check=check_silent),
    Case("runner-declares-late", mode="late", check=check_late),
    Case("cloud-init-installs-runner", cloud_init="installs", check=check_cloud_init),
    Case("cloud-init-hangs", cloud_init="hangs", timeout=10, check=check_cloud_init_hangs),
    Case("no-labels", labels=" , ,", check=check_no_labels),
    # `one-job --handle ''` would take any job of its labels.
    Case("empty-handle", handle="", check=check_empty_handle),
    # Entries reach forgejo-runner as given (the provisioner has parsed them as it does).
    # (The empty one is a docker label to forgejo-runner: the VM has a Docker socket here.)
    Case("labels-as-given", labels="debian:host,, x:host ", mode="quick", check=check_labels_as_given,
         vm_files={".docker/run/docker.sock": ("", 0o600)}),
    # What the schemes need on the VM: a Docker engine's socket, LXC's tools.
    # Mutation caught: the Docker socket check (or its docker label detection) removed.
    Case("docker-without-engine", labels="debian:host,ubuntu,arm:docker://node:22",
         check=check_docker_without_engine),
    # Mutation caught: the LXC check removed.
    Case("lxc-without-lxc", labels="c:lxc", vm_files={"bin/lxc-create": (NO_LXC, 0o755)},
         check=check_lxc_without_lxc),
    Case("schemes-served", labels=SCHEMES, mode="quick", check=check_schemes_served,
         vm_files={".docker/run/docker.sock": ("", 0o600), "bin/lxc-create": (NO_LXC, 0o755),
                   "bin/lxc-attach": (NO_LXC, 0o755)}),
    Case("docker-host-socket", labels="ubuntu", mode="quick", check=check_schemes_served,
         vm_files={".colima/docker.sock": ("", 0o600)}),
    # What the module outputs as the address is checked before ssh sees it (and ssh gets `--`).
    Case("address-is-an-option", address="-oProxyCommand=touch @case@/proxy-ran", check=check_bad_address),
    Case("address-with-an-option", address="vm-1.example.test -oProxyCommand=touch @case@/proxy-ran",
         check=check_bad_address),
    Case("address-user-at", address="root@vm-1.example.test", check=check_bad_address),
    Case("address-host-port", address="vm-1.example.test:2222", check=check_bad_address),
    Case("address-bracketed-ipv6", address="[2001:db8::10]", check=check_bad_address),
    Case("address-newline", address="vm-1.example.test\n-oProxyCommand=touch @case@/proxy-ran",
         check=check_bad_address),
    Case("address-ipv4", address="192.0.2.10", mode="quick", check=check_address_accepted),
    Case("address-ipv6", address="2001:db8::10", mode="quick", check=check_address_accepted),
    Case("uuid-traversal", uuid="../../etc/x", check=check_bad_uuid),
    Case("uuid-with-a-tail", uuid="00000000-0000-4000-8000-000000000001/../../x", check=check_bad_uuid),
    # RUNNER_ACTION: start (also unset: every case above), check and stop.
    Case("start-explicit", action="start", mode="quick", check=check_accepted),
    Case("unknown-action", action="restart", check=check_unknown_action),
    # probe (the canary): the VM reachable and ready, forgejo-runner's --version line on stdout.
    Case("probe", action="probe", check=check_probe),
    Case("probe-runner-12.7.3", action="probe", version="forgejo-runner version v12.7.3", check=check_probe_old),
    Case("probe-runner-missing", action="probe", runner=False, check=check_probe_missing),
    Case("probe-sshd-late", action="probe", answers=["refused", "refused"], check=check_probe_waits),
    Case("probe-cloud-init", action="probe", cloud_init="installs", check=check_probe_cloud_init),
    Case("probe-host-key", action="probe", answers=["hostkey"], check=check_probe_host_key),
    Case("probe-port-output", action="probe", variant="c", check=check_probe),
    # The port from a tofu output (launch.ssh_port_output).
    Case("port-output", variant="c", mode="quick", check=check_port_output),
    Case("port-output-missing", variant="c", port_output="", check=check_bad_port_output),
    Case("port-output-not-a-number", variant="c", port_output="22 -oProxyCommand=x", check=check_bad_port_output),
    Case("check-running", after=after_check, check=check_check_running),
    Case("check-after-exit", after=after_end_check, check=check_check_gone),
    Case("check-ssh-refused", answers=["ok", "ok", "refused"], after=after_check, check=check_check_cannot_tell),
    Case("check-ssh-host-key", answers=["ok", "ok", "hostkey"], after=after_check, check=check_check_cannot_tell),
    Case("check-recycled-pid", after=after_recycled_pid, check=check_recycled_pid),
    Case("check-without-pid-file", after=after_no_pid_file, check=check_no_pid_file),
    Case("stop", after=after_stop_check, check=check_stop),
    Case("stop-already-gone", after=after_end_stop, check=check_stop_gone),
    Case("stop-never-started", runner=False, after=after_end_stop, check=check_stop_never_started),
    Case("stop-ignores-sigterm", mode="ignores-term", after=after_stop, check=check_stop_kill),
    Case("stop-ssh-refused", answers=["ok", "ok", "refused"], after=after_stop_ssh_fails,
         check=check_stop_cannot_confirm),
    # The token file goes once the runner has read it, even when that is after the watch.
    Case("token-read-after-the-watch", mode="hold", timeout=6, after=after_token_unread, check=check_token_unread),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", type=Path, default=ROOT / "role/templates/launch.sh.j2")
    ap.add_argument("-k", action="append", default=[])
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("-v", action="store_true", help="show every launch's stderr")
    a = ap.parse_args()
    cases = [c for c in CASES if not a.k or any(k in c.name for k in a.k)]
    work = Path(tempfile.mkdtemp(prefix="launch-test-"))
    try:
        write(work / "bin" / "ssh", SSH_STUB.replace("@PYTHON@", sys.executable), 0o755)
        write(work / "bin" / "date", tools(LOCAL_DATE), 0o755)
        write(work / "bin" / "sleep", LOCAL_SLEEP, 0o755)
        # "The VM"'s own tools: this host's, but never its cloud-init (a VM without one is a
        # scenario of its own; the ones with it get the stub).
        host_bin = work / "host-bin"
        host_bin.mkdir()
        for d in ("/usr/local/bin", "/usr/bin", "/bin"):
            for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                if name != "cloud-init" and not os.path.lexists(host_bin / name):
                    (host_bin / name).symlink_to(Path(d) / name)
        write(work / "shared" / "vm-runner", '#!/bin/sh\nexec "$FAKE_VM/bin/forgejo-runner" "$@"\n', 0o755)
        rendered = render(a.template.resolve(), work)
        for c in cases:
            c.work = work
        with ThreadPoolExecutor(max_workers=len(cases)) as pool:
            list(pool.map(lambda c: c.run(work, rendered), cases))
        failures = 0
        for c in cases:
            try:
                if c.after_failed:
                    raise c.after_failed
                c.check(c)
                print(f"ok   {c.name} ({c.elapsed:.1f}s)")
                if a.v:
                    print(textwrap.indent(c.stderr, "       | "), end="")
            except Failed as e:
                failures += 1
                print(f"FAIL {c.name} ({c.elapsed:.1f}s, exit {c.rc}): {e}")
                print(textwrap.indent(f"stderr:\n{c.stderr}stdout:\n{c.stdout}", "       | "))
            finally:
                c.stop()
        print(f"launch template: {len(cases) - failures} passed, {failures} failed")
        return 1 if failures else 0
    finally:
        for c in cases:
            if hasattr(c, "vm"):
                c.stop()
        if a.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
