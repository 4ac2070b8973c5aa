#!/usr/bin/env python3
"""The variables with which the role's end-to-end test deploys examples/ansible: the example's own
group_vars/ci_provisioners/main.yml with the test's stand-ins swapped in, so that the example
cannot drift from what works.

Usage: example_vars.py STANDINS OUT. STANDINS (YAML or JSON) has `vars`, top-level variables that
replace or add to the example's (Forgejo's URL, the vault's secrets, short timers), and `pool`,
settings merged (recursively) into each of the example's pools (the stand-in module, the "VM"'s
ssh port). A stand-in for a top-level variable the example does not set must be a vault_* one the
example uses or a ci_ephemeral_provisioner_* one; a stand-in for a pool setting the example does
not set must be a setting of the role. Needs PyYAML (ansible-core brings it).
"""
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/ansible/group_vars/ci_provisioners/main.yml"
POOL_SETTINGS = set(yaml.safe_load((ROOT / "role/defaults/main.yml").read_text())["ci_ephemeral_provisioner_pool_defaults"])


def merge(base, over):
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def main():
    standins = yaml.safe_load(Path(sys.argv[1]).read_text())
    text = EXAMPLE.read_text()
    example = yaml.safe_load(text)
    problems = []
    for k in standins.get("vars", {}):
        if k not in example and not k.startswith("ci_ephemeral_provisioner_") and (
            not k.startswith("vault_") or "{{ " + k + " }}" not in text
        ):
            problems.append(f"stand-in {k}: the example neither sets nor uses it")
    pools = example["ci_ephemeral_provisioner_pools"]
    for k in standins.get("pool", {}):
        if k not in POOL_SETTINGS:
            problems.append(f"stand-in pool setting {k}: the role has no such setting")
    if problems:
        sys.exit("\n".join(f"{EXAMPLE}: {p}" for p in problems))
    out = dict(standins.get("vars", {}))
    out["ci_ephemeral_provisioner_pools"] = [merge(p, standins.get("pool", {})) for p in pools]
    Path(sys.argv[2]).write_text("---\n" + json.dumps(out, indent=2) + "\n")
    print(f"{len(pools)} pool(s) of {EXAMPLE.relative_to(ROOT)}: {', '.join(p['name'] for p in pools)}")


if __name__ == "__main__":
    main()
