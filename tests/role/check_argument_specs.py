#!/usr/bin/env python3
"""Fails when role/meta/argument_specs.yml and role/defaults/main.yml drift apart.

Every variable in defaults has an option with the same default and the same keys below it
(the pool defaults and the launch settings), every option has a variable, the entries of the pool
list accept exactly the keys of the pool defaults plus `name`, and each option's type matches its
default; and role/README.md's two variable tables name exactly these variables and pool settings.
Usage: check_argument_specs.py [ROLE_DIR]   (needs PyYAML, which ansible-core brings).
"""
import re
import sys
from pathlib import Path

import yaml

TYPES = {"str": str, "path": str, "int": int, "bool": bool, "dict": dict, "list": list}


def compare(where, options, defaults, problems):
    """options: an argument_specs `options` mapping; defaults: the dict of values it must mirror."""
    for key in sorted(set(defaults) - set(options)):
        problems.append(f"{where}{key}: in defaults/main.yml but not in meta/argument_specs.yml")
    for key in sorted(set(options) - set(defaults)):
        problems.append(f"{where}{key}: in meta/argument_specs.yml but not in defaults/main.yml")
    for key in sorted(set(options) & set(defaults)):
        spec, value = options[key], defaults[key]
        if "default" not in spec:
            problems.append(f"{where}{key}: argument_specs has no default (defaults/main.yml: {value!r})")
        elif spec["default"] != value:
            problems.append(f"{where}{key}: argument_specs default {spec['default']!r} != defaults/main.yml {value!r}")
        kind = TYPES.get(spec.get("type", "str"))
        if kind is None:
            problems.append(f"{where}{key}: unknown type {spec.get('type')!r}")
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            problems.append(f"{where}{key}: type {spec.get('type')} but the default is {value!r}")
        # Structured mappings (the pool defaults, launch) are compared key by key; free-form ones
        # (environment) have no `options`.
        if isinstance(value, dict) and "options" in spec:
            compare(f"{where}{key}.", spec["options"], value, problems)


def readme_tables(text):
    """The names in the first column of each table of README.md's `## Variables`, per table."""
    section = text.split("\n## Variables\n", 1)[-1].split("\n## ", 1)[0]
    tables, rows = [], None
    for line in section.splitlines():
        if line.startswith("|"):
            if rows is None:
                rows = set()
                tables.append(rows)
            first = line.split("|")[1]
            if not re.fullmatch(r"\s*-+\s*", first) and first.strip() not in ("variable", "key"):
                rows |= {n.split(".")[0] for n in re.findall(r"`([^`]+)`", first)}
        else:
            rows = None
    return tables


def main():
    role = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "role")
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text())
    specs = yaml.safe_load((role / "meta/argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    problems = []
    compare("", options, defaults, problems)

    pool_defaults = defaults.get("ci_ephemeral_provisioner_pool_defaults", {})
    pool_default_spec = options.get("ci_ephemeral_provisioner_pool_defaults", {})
    if "options" not in pool_default_spec:
        problems.append("ci_ephemeral_provisioner_pool_defaults: argument_specs has no `options`")
    if "options" not in pool_default_spec.get("options", {}).get("launch", {}):
        problems.append("ci_ephemeral_provisioner_pool_defaults.launch: argument_specs has no `options`")

    element = options.get("ci_ephemeral_provisioner_pools", {}).get("options", {})
    if set(element) != set(pool_defaults) | {"name"}:
        problems.append(
            "ci_ephemeral_provisioner_pools entries: options "
            f"{sorted(element)} != the pool defaults' keys plus name {sorted(set(pool_defaults) | {'name'})}"
        )
    for key in sorted(set(element) & set(pool_defaults)):
        if element[key].get("default") != pool_defaults[key]:
            problems.append(f"ci_ephemeral_provisioner_pools entries: {key} default differs from the pool defaults")
    if not element.get("name", {}).get("required"):
        problems.append("ci_ephemeral_provisioner_pools entries: name must be required")

    readme = role / "README.md"
    tables = readme_tables(readme.read_text()) if readme.exists() else []
    if len(tables) != 2:
        problems.append(f"{readme}: `## Variables` should have two tables (variables, pool settings), has {len(tables)}")
    else:
        prefix = "ci_ephemeral_provisioner_"
        for where, listed, want in (
            ("variables", tables[0], {k.removeprefix(prefix) for k in defaults}),
            ("pool settings", tables[1], set(pool_defaults) | {"name"}),
        ):
            for key in sorted(want - listed):
                problems.append(f"README.md's table of {where} lacks {key}")
            for key in sorted(listed - want):
                problems.append(f"README.md's table of {where} lists {key}, which the role does not have")

    for p in problems:
        print(f"argument_specs drift: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"argument_specs mirror defaults and README.md: {len(options)} variables, {len(pool_defaults)} pool settings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
