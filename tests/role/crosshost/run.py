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
    # One pool across hosts on PostgreSQL shares its prefix; a files pool may not join it.
    "pg_pool": (True, ["ci-a.example.org           : ok=3 ", "ci-b.example.org           : ok=3 "]),
    "pg_mixed": (
        False,
        [
            "Pool debian on host ci-a.example.org (runner_prefix ephemeral-debian-) and pool debian on "
            "host ci-b.example.org (runner_prefix ephemeral-debian-): the prefixes are equal.",
        ],
    ),
}


def provisioner_env(pool, webhook=False):
    """role/templates/provisioner.env.j2 rendered for one merged pool, as the role writes it."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["comment"] = lambda s: "# " + s
    # Ansible's bool filter, for the values the role's own variables take.
    env.filters["bool"] = lambda v: v if isinstance(v, bool) else str(v).lower() in ("true", "yes", "1", "on")
    defaults = yaml.safe_load((HERE.parents[2] / "role/defaults/main.yml").read_text())
    item = dict(defaults["ci_ephemeral_provisioner_pool_defaults"], **pool)
    text = (HERE.parents[2] / "role/templates/provisioner.env.j2").read_text()
    return env.from_string(text).render(
        item=item,
        ansible_managed="managed",
        ci_ephemeral_provisioner_forgejo_url="https://forgejo.example.org",
        ci_ephemeral_provisioner_ca_file="",
        ci_ephemeral_provisioner_metrics_dir="",
        _ci_ephemeral_provisioner_webhook=webhook,
        _ci_ephemeral_provisioner_pools_dir="/etc/ci-ephemeral-provisioner/pools",
    )


def store_variables_reach_the_unit():
    """The pool store's variables reach the unit's environment (provisioner.env), the
    connection string never (it is secret_environment's, in secret.env)."""
    pg = provisioner_env({"name": "debian", "store": "pg", "host_id": "ci-a", "lease": "3m",
                          "secret_environment": {"PG_CONN_STR": "postgres://u:s3cret@db/ci"}})
    want = ['CI_EPHEMERAL_PROVISIONER_STORE="pg"', 'CI_EPHEMERAL_PROVISIONER_POOL="debian"',
            'CI_EPHEMERAL_PROVISIONER_HOST_ID="ci-a"', 'CI_EPHEMERAL_PROVISIONER_LEASE="3m"']
    problems = [f"missing {w}" for w in want if w not in pg.splitlines()]
    if "s3cret" in pg:
        problems.append("the connection string is in provisioner.env")
    files = provisioner_env({"name": "debian"})
    if 'CI_EPHEMERAL_PROVISIONER_STORE="files"' not in files.splitlines() or "POOL=" in files:
        problems.append("the files store's environment names a pool")
    if "WAKE_WINDOW=" in files:
        problems.append("a pool without webhooks gets a wake window")
    if 'CI_EPHEMERAL_PROVISIONER_WAKE_WINDOW="30s"' not in provisioner_env({"name": "debian"}, webhook=True):
        problems.append("a pool with webhooks lacks its wake window")
    if problems:
        print("FAIL provisioner.env: " + "; ".join(problems) + "\n" + pg, file=sys.stderr)
        return False
    print("ok   provisioner.env carries the store, pool, host id and lease, and the wake window with webhooks")
    return True



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
    if not store_variables_reach_the_unit():
        failures.append("provisioner.env")
    print(f"{len(CASES) + 2 - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
