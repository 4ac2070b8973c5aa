#!/usr/bin/env python3
"""The example's FILL IN placeholders are refused on the controller, before any host is reached.

Runs examples/ansible/site.yml as a new operator would after copying vault.yml.example to
vault.yml and changing nothing else, against a host on 127.0.0.1 where nothing listens: the play
must fail at the role's first task, naming every variable that still holds a placeholder, and
must never try the host (no UNREACHABLE). Then, with the placeholders filled in
(tests/role/example_vars.py with stand-ins), the same play gets past that task and does try the
host (it is unreachable): the check refuses the placeholders and nothing else.
Usage: fill_in_test.py ANSIBLE_PLAYBOOK (the venv's; .ci/role runs this with the venv's python).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/ansible"
PLACEHOLDERS = [
    "ci_ephemeral_provisioner_forgejo_url",
    "ci_ephemeral_provisioner_forgejo_token",
    "ci_ephemeral_provisioner_pools",
]
FIRST_TASK = "Assert that no variable still holds the example's FILL IN placeholder"


def play(playbook, work, extra):
    env = dict(
        os.environ,
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_RETRY_FILES_ENABLED="0",
        ANSIBLE_HOST_KEY_CHECKING="0",
        ANSIBLE_TIMEOUT="5",
    )
    run = subprocess.run(
        [playbook, "-i", str(work / "inventory.ini"), str(work / "site.yml"), *extra],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    return run.returncode, run.stdout


def main():
    playbook = sys.argv[1] if len(sys.argv) > 1 else "ansible-playbook"
    playbook = str(Path(playbook).resolve()) if "/" in playbook else playbook
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "ansible"
        shutil.copytree(EXAMPLE, work, symlinks=False)
        vars_dir = work / "group_vars/ci_provisioners"
        shutil.copy(vars_dir / "vault.yml.example", vars_dir / "vault.yml")
        # The example's inventory with its host on loopback, where nothing listens on port 9.
        (work / "inventory.ini").write_text(
            "[ci_provisioners]\nci-host-1 ansible_host=127.0.0.1 ansible_port=9 ansible_user=nobody\n"
        )

        code, out = play(playbook, work, [])
        if code == 0:
            failures.append("the play with the placeholders passed")
        if FIRST_TASK not in out or "still hold the example's FILL IN placeholder" not in out:
            failures.append("the placeholders were not refused by the role's first task")
        for name in PLACEHOLDERS:
            if name not in out.split("still hold the example's FILL IN")[0]:
                failures.append(f"the refusal does not name {name}")
        if "UNREACHABLE" in out or "Look for a running systemd" in out:
            failures.append("the play reached for the host before refusing the placeholders")
        for secret in ("vault_forgejo_runner_token", "vault_hcloud_token"):
            if f'"{secret}"' in out:
                failures.append(f"the refusal quotes {secret}")
        refused = out

        # Filled in: the stand-ins every FILL IN of the example needs.
        standins = {
            "vars": {
                "ci_ephemeral_provisioner_forgejo_url": "https://forgejo.example.org",
                "vault_forgejo_runner_token": "0123456789abcdef",
                "vault_hcloud_token": "hcloud-stand-in",
            },
            "pool": {
                "environment": {
                    "TF_VAR_forgejo_runner_sha256": "0" * 64,
                    "TF_VAR_ssh_source_ips": '["198.51.100.7/32"]',
                }
            },
        }
        (work / "standins.json").write_text(json.dumps(standins))
        merged = work / "filled.yml"
        subprocess.run(
            [sys.executable, str(ROOT / "tests/role/example_vars.py"), str(work / "standins.json"), str(merged)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        code, out = play(playbook, work, ["-e", f"@{merged}"])
        if code == 0:
            failures.append("the filled-in play passed against a host where nothing listens")
        if "still hold the example's FILL IN placeholder" in out:
            failures.append("the filled-in values were refused as placeholders")
        if "UNREACHABLE" not in out:
            failures.append("the filled-in play did not get as far as the host")
        filled = out

    if failures:
        print("with the placeholders:\n" + refused + "\nfilled in:\n" + filled, file=sys.stderr)
        sys.exit("\n".join(f"FAIL: {f}" for f in failures))
    print("the example's placeholders are refused before any host is reached; filled in, they pass")


if __name__ == "__main__":
    main()
