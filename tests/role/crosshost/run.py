#!/usr/bin/env python3
"""The role's runner prefix check across hosts (role/tasks/crosshost.yml), on two local hosts.

Applies tests/role/crosshost/site.yml to each inventory in tests/role/crosshost/inventory/ and
checks the outcome: overlapping prefixes on two hosts and equal ones fail, naming both hosts,
both pools and both prefixes and saying how to fix it; prefixes templated with each host's
short name pass, and so does a play of one host. And the role's preflight imports the check. Usage: run.py ANSIBLE_PLAYBOOK
(the venv's; .ci/role passes it and runs this with the venv's python, which has PyYAML).
"""
import os
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
FIX = 'runner_prefix: "ephemeral-{{ inventory_hostname_short }}-debian-"'
WHY = "one host's sweep would delete the other's fresh registrations"

# inventory: (should pass, lines the output must hold)
CASES = {
    "overlap": (
        False,
        [
            "Pool debian on host ci-a.example.org (runner_prefix ephemeral-) and pool arm on host "
            "ci-b.example.org (runner_prefix ephemeral-arm-): ephemeral-arm- starts with ephemeral-.",
            "Pool arm on host ci-b.example.org (runner_prefix ephemeral-arm-) and pool debian on host "
            "ci-a.example.org (runner_prefix ephemeral-): ephemeral-arm- starts with ephemeral-.",
            WHY,
            FIX,
        ],
    ),
    "equal": (
        False,
        [
            "Pool debian on host ci-a.example.org (runner_prefix ephemeral-debian-) and pool debian on "
            "host ci-b.example.org (runner_prefix ephemeral-debian-): the prefixes are equal.",
            WHY,
            FIX,
        ],
    ),
    "distinct": (True, ["ci-1.example.org           : ok=3 ", "ci-10.example.org          : ok=3 "]),
    "single": (True, ["ci-a.example.org           : ok=3 "]),
}


def main():
    playbook = sys.argv[1] if len(sys.argv) > 1 else "ansible-playbook"
    env = dict(
        os.environ,
        ANSIBLE_ROLES_PATH=str(HERE.parent / "roles"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_RETRY_FILES_ENABLED="0",
    )
    failures = []
    for case, (should_pass, wanted) in CASES.items():
        run = subprocess.run(
            [playbook, "-i", str(HERE / "inventory" / f"{case}.yml"), str(HERE / "site.yml")],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        out = run.stdout + run.stderr
        problems = []
        if (run.returncode == 0) != should_pass:
            problems.append(f"exit status {run.returncode}, expected {'0' if should_pass else 'a failure'}")
        problems += [f"missing from the output: {w!r}" for w in wanted if w not in out]
        if not should_pass and "failed=1" not in out:
            problems.append("no host failed")
        if should_pass and "failed=1" in out:
            problems.append("a host failed")
        if problems:
            failures.append(case)
            print(f"FAIL {case}: " + "; ".join(problems) + f"\n--- output of {case}:\n{out}", file=sys.stderr)
        else:
            print(f"ok   {case}: {'passed' if should_pass else 'refused'} as expected")
    # The role runs it: preflight (before anything on the host changes) imports the file.
    preflight = yaml.safe_load((HERE.parents[2] / "role/tasks/preflight.yml").read_text())
    if any(t.get("ansible.builtin.import_tasks") == "crosshost.yml" for t in preflight):
        print("ok   preflight.yml imports crosshost.yml")
    else:
        failures.append("preflight")
        print("FAIL role/tasks/preflight.yml does not import crosshost.yml", file=sys.stderr)
    print(f"{len(CASES) + 1 - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
