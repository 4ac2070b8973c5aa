#!/usr/bin/env python3
"""The role's canaries (role/tasks/canary.yml) on the controller, with stub systemctl and journalctl.

Each case says how the canary unit's start ends (systemctl's exit status: the unit takes exit 75,
a canary its slot refused, for a success) and what its journal holds, and checks the play: a
canary that passed is shown; one that failed fails the play; one that could not run is a warning
the play shows and its recap counts (ignored=1), never a silent ok. Only the pool that asks for a
canary gets one. And the role's configure.yml imports the file. Usage: run.py ANSIBLE_PLAYBOOK
(the venv's; .ci/role passes it).
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
UNIT = "ci-ephemeral-provisioner-canary@qemu.service"
REFUSED = ("FAIL  boot: not booted: cycle 20261014t100000z-aa01 is in progress in this slot, and the "
           "canary never runs beside a cycle: try again once `status` shows none")
PASSED = ('ok    boot: a VM of the module came up and answered the probe with "forgejo-runner version '
          'v12.8.2" (forgejo-runner 12.8.2); apply 20.1s, ready in 9.0s, destroy 3.2s; VM destroyed')
FAILED = "FAIL  boot: tofu apply failed: `tofu apply` exited with status 1 (cycle 20261014t100000z-aa02-canary)"
WARNING = "`check --boot` booted no VM, so this change of the pool is untried on one"

# case: (systemctl's exit status, the journal's lines, the play passes, what the output holds,
# what it must not hold)
CASES = {
    "passed": (0, [PASSED, "all 9 checks passed"], True,
               ["pool qemu: ok    boot: a VM of the module came up", "ignored=0"],
               [WARNING]),
    "refused": (0, [REFUSED, "1 of 9 checks failed"], True,
                ["pool qemu: " + WARNING, REFUSED, f"systemctl start {UNIT}", "ignored=1"], []),
    "failed": (1, [FAILED, "1 of 9 checks failed"], False,
               ["`ci-ephemeral-provisioner check --boot` failed", "failed=1"], [WARNING]),
}

STUBS = {
    # The canary unit's start: its arguments logged, its exit status as the case says.
    "systemctl": '#!/bin/sh\necho "$*" >> "$CASE/systemctl.log"\nexit "$(cat "$CASE/rc")"\n',
    "journalctl": '#!/bin/sh\necho "$*" >> "$CASE/journalctl.log"\ncat "$CASE/journal"\n',
}


def run_case(playbook, name, rc, journal, should_pass, wanted, unwanted):
    with tempfile.TemporaryDirectory() as tmp:
        case = Path(tmp)
        bin_dir = case / "bin"
        bin_dir.mkdir()
        for stub, text in STUBS.items():
            (bin_dir / stub).write_text(text)
            (bin_dir / stub).chmod(0o755)
        (case / "rc").write_text(f"{rc}\n")
        (case / "journal").write_text("".join(line + "\n" for line in journal))
        env = dict(
            os.environ,
            PATH=f"{bin_dir}:{os.environ['PATH']}",
            CASE=str(case),
            ANSIBLE_ROLES_PATH=str(HERE.parent / "roles"),
            ANSIBLE_NOCOLOR="1",
            ANSIBLE_FORCE_COLOR="0",
            ANSIBLE_RETRY_FILES_ENABLED="0",
        )
        run = subprocess.run(
            [playbook, "-i", str(HERE / "inventory.yml"), str(HERE / "site.yml")],
            env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        )
        out = run.stdout + run.stderr
        started = (case / "systemctl.log").read_text() if (case / "systemctl.log").exists() else ""
    problems = []
    if (run.returncode == 0) != should_pass:
        problems.append(f"exit status {run.returncode}, expected {'0' if should_pass else 'a failure'}")
    problems += [f"missing from the output: {w!r}" for w in wanted if w not in out]
    problems += [f"in the output: {w!r}" for w in unwanted if w in out]
    if started != f"start {UNIT}\n":
        problems.append(f"systemctl was asked {started!r}, not only to start {UNIT}")
    if problems:
        print(f"FAIL {name}: " + "; ".join(problems) + f"\n--- output of {name}:\n{out}", file=sys.stderr)
        return False
    print(f"ok   {name}")
    return True


def main():
    playbook = sys.argv[1] if len(sys.argv) > 1 else "ansible-playbook"
    failures = [name for name, case in CASES.items() if not run_case(playbook, name, *case)]
    configure = yaml.safe_load((HERE.parents[2] / "role/tasks/configure.yml").read_text())
    if any(t.get("ansible.builtin.import_tasks") == "canary.yml" for t in configure):
        print("ok   configure.yml imports canary.yml")
    else:
        failures.append("configure")
        print("FAIL role/tasks/configure.yml does not import canary.yml", file=sys.stderr)
    print(f"{len(CASES) + 1 - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
