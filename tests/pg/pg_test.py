#!/usr/bin/env python3
"""OpenTofu's pg backend as the slots of a pool run it; .ci/pg starts the database and runs this.

Every tofu runs as the binary runs it: `-chdir=` the pool's working copy of the module (one for
all slots of a host), `init -input=false -no-color`, then `apply` or `destroy` with
`-input=false -auto-approve -no-color -lock-timeout=2m`, TF_IN_AUTOMATION=1, TF_INPUT=0,
TF_VAR_cycle_id and TF_VAR_slot=K; slot 1 in the default workspace with the pool's TF_DATA_DIR
(`<pool>/tofu-data`, as the role's unit sets it), slot K >= 2 with TF_WORKSPACE=slot-K and
TF_DATA_DIR=<pool>/slot-K/tofu-data. The connection comes from the environment only
(PG_CONN_STR; for the second host PG_SCHEMA_NAME and PGPASSWORD too), as a pool's service
environment passes it through the binary. The checks read the database itself with psql.

  1. creation lock: the first apply of `default` (no row yet) holds the backend's creation lock
     for the whole apply, and slot 2's first `init` (which writes its row) fails at once; once
     that apply is done the init works. docs/operating.md tells operators about this.
  2. two slots of host a, init + apply at the same time: two states in one database, `default`
     and `slot-2`, each with its own slot's resource only.
  3. host b, slot 2 too, PG_SCHEMA_NAME=ci_host_b: its own state in its own schema; host a's
     `slot-2` is untouched; the state ids (the advisory lock keys) differ across the schemas.
  4. all three destroy at the same time: every state empty, the rows stay.
  5. the lock: apply A of slot 2 waits inside its create (so it holds the lock); an apply with
     -lock-timeout=0s fails with the lock error and changes nothing; apply B with
     -lock-timeout=2m retries its lock (counted in the server's log) and is still running when A
     is released; then both finish, and the state has exactly A's and B's resources, a serial
     two or more past the one before, and A's VM was created once.

No check reads the wall clock against a bound (the machine may be loaded): waits are for states
(a marker file, a count in the server's log) and end with a failure after generous timeouts.

Usage: pg_test.py --tofu BIN --work DIR --server-log FILE   (PG_CONN_STR in the environment)
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "tests" / "pg" / "module"
RUN_TIMEOUT = 300  # one tofu run
WAIT_TIMEOUT = 120  # one wait for something the test expects
CYCLE = "20261201t201057z-5c1d"
DEFAULT_SCHEMA = "terraform_remote_state"
HOST_B_SCHEMA = "ci_host_b"
# The binary's arguments (src/adapters/tofu_cli.rs).
INIT = ["init", "-input=false", "-no-color"]


def change_args(verb, lock_timeout="2m"):
    return [verb, "-input=false", "-auto-approve", "-no-color", f"-lock-timeout={lock_timeout}"]


class Failure(Exception):
    pass


def tail(path, lines=60):
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(cannot read: {e})"
    return "\n".join(text[-lines:])


def fail(message, *logs):
    shown = "".join(f"\n--- {p} (last lines) ---\n{tail(p)}" for p in logs)
    raise Failure(message + shown)


def step(text):
    print(f"[pg-test {time.monotonic() - START:5.1f}s] {text}", flush=True)


START = time.monotonic()


class Test:
    def __init__(self, tofu, work, server_log):
        self.tofu = tofu
        self.work = work
        self.server_log = Path(server_log)
        self.conn = os.environ.get("PG_CONN_STR", "")
        if not self.conn:
            sys.exit("pg_test.py: PG_CONN_STR is not set (.ci/pg sets it)")
        self.vm_log = work / "vm.log"
        self.vm_log.touch()
        (work / "logs").mkdir()
        self.seq = 0
        self.runs = []
        self.gates = []
        # The environment every tofu starts from: this one without what the test sets itself.
        self.base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("TF_VAR_", "PG_SCHEMA_", "PGAPPNAME", "PG_TEST_"))
            and k not in ("TF_WORKSPACE", "TF_DATA_DIR", "TF_CLI_ARGS", "TF_CLI_ARGS_init",
                          "TF_CLI_ARGS_apply", "TF_CLI_ARGS_destroy")
        }

    # --- the database, read with psql (the connection in PG* variables, never on argv) ---

    def sql(self, query):
        u = urllib.parse.urlsplit(self.conn)
        env = dict(os.environ)
        env.update(
            PGHOST=u.hostname or "",
            PGPORT=str(u.port or 5432),
            PGUSER=urllib.parse.unquote(u.username or ""),
            PGPASSWORD=urllib.parse.unquote(u.password or ""),
            PGDATABASE=u.path.lstrip("/"),
            PGSSLMODE="disable",
            PGAPPNAME="pgtest-check",
        )
        r = subprocess.run(["psql", "-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1", "-c", query],
                           env=env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            fail(f"psql failed ({r.returncode}) on: {query}\n{r.stderr.strip()}")
        return r.stdout.strip()

    def states(self, schema):
        """{workspace: {"id": ..., "state": {...}}} of one schema's states table."""
        if self.sql(f"SELECT to_regclass('{schema}.states') IS NOT NULL") != "t":
            return {}
        out = self.sql(
            "SELECT coalesce(json_agg(json_build_object('name', name, 'id', id, 'data', data)"
            f" ORDER BY name), '[]') FROM {schema}.states")
        rows = {}
        for row in json.loads(out):
            try:
                state = json.loads(row["data"])
            except (TypeError, ValueError) as e:
                fail(f"the state {row['name']!r} in {schema}.states is not JSON ({e}): {row['data']!r:.200}")
            rows[row["name"]] = {"id": row["id"], "state": state}
        return rows

    @staticmethod
    def resources(state):
        """Each resource instance as `type.name[index]=input`, sorted."""
        found = []
        for r in state.get("resources", []):
            for inst in r.get("instances", []):
                key = f"[{inst['index_key']}]" if "index_key" in inst else ""
                value = inst.get("attributes", {}).get("input")
                if isinstance(value, dict) and "value" in value:
                    value = value["value"]
                found.append(f"{r['type']}.{r['name']}{key}={value}")
        return sorted(found)

    def advisory_locks(self):
        """(application_name, key) of every advisory lock granted in the database."""
        out = self.sql(
            "SELECT a.application_name || ' ' || ((l.classid::bigint << 32) | l.objid::bigint)"
            " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())")
        return {tuple(line.rsplit(" ", 1)) for line in out.splitlines() if line}

    def lock_attempts(self, app):
        """How often the tofu with PGAPPNAME=app tried a state's lock (the server logs every
        statement of the test's role, each line after `%a `)."""
        pattern = re.compile(r"pg_try_advisory_lock\([^)]*\bid\)")
        n = 0
        with open(self.server_log, errors="replace") as f:
            for line in f:
                if line.startswith(app + " ") and pattern.search(line):
                    n += 1
        return n

    # --- tofu, as the binary runs it ---

    def env(self, slot, **more):
        e = dict(self.base)
        e.update(
            TF_IN_AUTOMATION="1",
            TF_INPUT="0",
            CHECKPOINT_DISABLE="1",
            TF_VAR_cycle_id=CYCLE,
            TF_VAR_slot=str(slot["k"]),
            TF_VAR_host=slot["host"],
            PG_TEST_VM_LOG=str(self.vm_log),
        )
        pool = slot["pool"]
        if slot["k"] == 1:
            e["TF_DATA_DIR"] = str(pool / "tofu-data")
        else:
            e["TF_WORKSPACE"] = f"slot-{slot['k']}"
            e["TF_DATA_DIR"] = str(pool / f"slot-{slot['k']}" / "tofu-data")
        e.update(slot.get("env", {}))
        e.update(more)
        return e

    def start(self, name, slot, args, **env):
        self.seq += 1
        log = self.work / "logs" / f"{self.seq:02d}-{name}.log"
        out = open(log, "w")
        proc = subprocess.Popen(
            [self.tofu, f"-chdir={slot['pool'] / 'tofu'}", *args],
            env=self.env(slot, **env), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        run = {"name": name, "proc": proc, "log": log}
        self.runs.append(run)
        return run

    def wait(self, run):
        try:
            return run["proc"].wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            fail(f"{run['name']} did not finish within {RUN_TIMEOUT}s", run["log"])

    def run(self, name, slot, args, want=0, **env):
        r = self.start(name, slot, args, **env)
        rc = self.wait(r)
        if want is not None and rc != want:
            fail(f"{name} (`{' '.join(args)}`) exited {rc}, not {want}", r["log"])
        r["rc"] = rc
        return r

    def change(self, name, slot, verb):
        """What the binary does for an apply or a destroy: init, then the change."""
        self.run(f"{name}-init", slot, INIT)
        return self.run(f"{name}-{verb}", slot, change_args(verb))

    def concurrently(self, jobs):
        errors = []

        def one(job):
            try:
                job()
            except Failure as e:
                errors.append(e)

        threads = [threading.Thread(target=one, args=(j,)) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def gate(self, name):
        g = self.work / "gates" / name
        g.mkdir(parents=True)
        self.gates.append(g)
        return g

    def wait_until(self, what, predicate, *logs):
        deadline = time.monotonic() + WAIT_TIMEOUT
        while not predicate():
            if time.monotonic() > deadline:
                fail(f"waited {WAIT_TIMEOUT}s for {what}", *logs)
            time.sleep(0.1)

    def wait_inside(self, run, gate):
        self.wait_until(f"{run['name']} to reach its create",
                        lambda: (gate / "inside").exists() or run["proc"].poll() is not None,
                        run["log"])
        if not (gate / "inside").exists():
            fail(f"{run['name']} ended (exit {run['proc'].returncode}) before its create waited",
                 run["log"])

    def vm_events(self):
        return self.vm_log.read_text().splitlines()

    def cleanup(self):
        for g in self.gates:
            (g / "release").touch()
        for r in self.runs:
            p = r["proc"]
            if p.poll() is None:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()

    # --- the phases ---

    def slot(self, host, k, **env):
        pool = self.work / f"host-{host}"
        if not (pool / "tofu").exists():
            # The pool's working copy of the module, as sync-module makes it: one per host.
            shutil.copytree(MODULE, pool / "tofu")
        return {"host": host, "k": k, "pool": pool, "env": env,
                "workspace": "default" if k == 1 else f"slot-{k}"}

    def expect_rows(self, schema, want, when):
        got = {name: self.resources(row["state"]) for name, row in self.states(schema).items()}
        if got != want:
            fail(f"{when}: {schema}.states should be {json.dumps(want, indent=1)}\n"
                 f"but is {json.dumps(got, indent=1)}")

    def creation_lock(self, a1, a2):
        step("1. creation lock: slot 1's first apply (no `default` row yet) holds it for the whole apply")
        self.run("a1-first-init", a1, INIT)
        gate = self.gate("first-apply")
        first = self.start("a1-first-apply", a1, change_args("apply"),
                           TF_VAR_gate=str(gate), PGAPPNAME="pgtest-first")
        self.wait_inside(first, gate)
        r = self.run("a2-first-init", a2, INIT, want=None)
        out = r["log"].read_text()
        if r["rc"] == 0 or "locked for workspace creation" not in out:
            fail("slot 2's first init, while slot 1's first apply was running, should have failed"
                 " at once with `Already locked for workspace creation` (the backend's creation"
                 f" lock), but it exited {r['rc']}. If the backend changed, update"
                 " docs/operating.md (the pg backend section) and this check.", r["log"])
        if "slot-2" in self.states(DEFAULT_SCHEMA):
            fail("the failed first init of slot 2 left a `slot-2` row behind")
        (gate / "release").touch()
        if self.wait(first) != 0:
            fail("slot 1's first apply failed", first["log"])
        step("   slot 2's first init failed at once with the creation lock; after the apply it works")
        self.run("a2-init", a2, INIT)
        self.change("a1-first", a1, "destroy")
        self.expect_rows(DEFAULT_SCHEMA, {"default": [], "slot-2": []},
                         "after the first cycle of slot 1 and the init of slot 2")

    def two_slots(self, a1, a2):
        step("2. slots 1 and 2 of host a: init + apply at the same time, one module directory")
        self.concurrently([lambda: self.change("a1", a1, "apply"),
                           lambda: self.change("a2", a2, "apply")])
        self.expect_rows(DEFAULT_SCHEMA, {
            "default": [f"terraform_data.vm=host-a-slot-1-{CYCLE}"],
            "slot-2": [f"terraform_data.vm=host-a-slot-2-{CYCLE}"],
        }, "after both slots applied")
        step("   two states in one database: `default` holds slot 1's VM, `slot-2` slot 2's")

    def second_host(self, b2):
        step(f"3. host b, slot 2, PG_SCHEMA_NAME={HOST_B_SCHEMA}, password in PGPASSWORD")
        self.change("b2", b2, "apply")
        self.expect_rows(HOST_B_SCHEMA, {"slot-2": [f"terraform_data.vm=host-b-slot-2-{CYCLE}"]},
                         "after host b's slot 2 applied")
        self.expect_rows(DEFAULT_SCHEMA, {
            "default": [f"terraform_data.vm=host-a-slot-1-{CYCLE}"],
            "slot-2": [f"terraform_data.vm=host-a-slot-2-{CYCLE}"],
        }, "after host b's slot 2 applied (host a's states must not change)")
        ids = [row["id"] for schema in (DEFAULT_SCHEMA, HOST_B_SCHEMA)
               for row in self.states(schema).values()]
        if len(set(ids)) != len(ids):
            fail(f"state ids repeat across the schemas ({ids}): their advisory locks would collide")
        step(f"   host b's `slot-2` lives in {HOST_B_SCHEMA}.states; host a's is untouched; ids {ids}")

    def destroy_all(self, a1, a2, b2):
        step("4. all three destroy at the same time")
        self.concurrently([lambda: self.change("a1", a1, "destroy"),
                           lambda: self.change("a2", a2, "destroy"),
                           lambda: self.change("b2", b2, "destroy")])
        self.expect_rows(DEFAULT_SCHEMA, {"default": [], "slot-2": []}, "after the destroys")
        self.expect_rows(HOST_B_SCHEMA, {"slot-2": []}, "after the destroys")
        events = self.vm_events()
        for name in (f"host-a-slot-1-{CYCLE}", f"host-a-slot-2-{CYCLE}", f"host-b-slot-2-{CYCLE}"):
            if events.count(f"create {name}") != events.count(f"destroy {name}"):
                fail(f"{name}: creates and destroys do not match in {self.vm_log}:\n"
                     + "\n".join(events))
        step("   every state empty, every VM destroyed")

    def lock(self, a2):
        step("5. the lock: a second apply of slot 2 waits while the first holds it")
        before = self.states(DEFAULT_SCHEMA)["slot-2"]
        serial0 = before["state"]["serial"]
        row_id = str(before["id"])
        vm = f"host-a-slot-2-{CYCLE}"
        creates0 = self.vm_events().count(f"create {vm}")
        self.run("lock-init", a2, INIT)
        gate = self.gate("lock")
        a = self.start("lock-apply-A", a2, change_args("apply"),
                       TF_VAR_gate=str(gate), PGAPPNAME="pgtest-lock-a")
        self.wait_inside(a, gate)
        if ("pgtest-lock-a", row_id) not in self.advisory_locks():
            fail(f"apply A waits in its create but holds no advisory lock on slot-2's row (id"
                 f" {row_id}); locks held: {sorted(self.advisory_locks())}", a["log"])
        step(f"   A is inside its create and holds the advisory lock {row_id} (slot-2's row)")

        c = self.run("lock-apply-C-no-wait", a2, change_args("apply", lock_timeout="0s"),
                     want=None, TF_VAR_extra="true", PGAPPNAME="pgtest-lock-c")
        out = c["log"].read_text()
        if c["rc"] == 0 or "Error acquiring the state lock" not in out:
            fail(f"apply C with -lock-timeout=0s exited {c['rc']} while A held the lock; it should"
                 " have failed with `Error acquiring the state lock`", c["log"])
        now = self.states(DEFAULT_SCHEMA)["slot-2"]["state"]
        if now["serial"] != serial0 or self.resources(now):
            fail(f"the refused apply C changed the state: serial {serial0} -> {now['serial']},"
                 f" resources {self.resources(now)}", c["log"])
        step("   C (-lock-timeout=0s) failed with the lock error and changed nothing")

        b = self.start("lock-apply-B", a2, change_args("apply"),
                       TF_VAR_extra="true", PGAPPNAME="pgtest-lock-b")
        self.wait_until("apply B to try the lock twice (refused, then retried) or to end",
                        lambda: self.lock_attempts("pgtest-lock-b") >= 2 or b["proc"].poll() is not None,
                        b["log"], self.server_log)
        if b["proc"].poll() is not None:
            fail(f"apply B of the same workspace ended (exit {b['proc'].returncode}) while apply A"
                 " still held the lock: it did not wait for the lock"
                 f" ({self.lock_attempts('pgtest-lock-b')} lock attempts by B in the server's log)",
                 b["log"])
        if a["proc"].poll() is not None:
            fail(f"apply A ended (exit {a['proc'].returncode}) before it was released", a["log"])
        now = self.states(DEFAULT_SCHEMA)["slot-2"]["state"]
        if now["serial"] != serial0:
            fail(f"the state was written (serial {serial0} -> {now['serial']}) while A held the lock")
        step(f"   B tried the lock {self.lock_attempts('pgtest-lock-b')} times and still runs; releasing A")
        (gate / "release").touch()
        if self.wait(a) != 0:
            fail("apply A failed after its release", a["log"])
        if self.wait(b) != 0:
            fail("apply B failed after A released the lock", b["log"])

        final = self.states(DEFAULT_SCHEMA)["slot-2"]["state"]
        want = ["terraform_data.extra[0]=extra-a-slot-2", f"terraform_data.vm={vm}"]
        problems = []
        if self.resources(final) != want:
            problems.append(f"resources {self.resources(final)}, not {want}")
        if final["serial"] < serial0 + 2:
            problems.append(f"serial {final['serial']}: two applies wrote it, so it should be at"
                            f" least {serial0 + 2} (was {serial0})")
        creates = self.vm_events().count(f"create {vm}") - creates0
        if creates != 1:
            problems.append(f"the VM {vm} was created {creates} times, not once")
        if "Resources: 1 added, 0 changed, 0 destroyed" not in b["log"].read_text():
            problems.append("B did not add exactly its one resource (after A it plans on A's state)")
        if problems:
            fail("after A and B: " + "; ".join(problems), a["log"], b["log"])
        step(f"   both done: serial {serial0} -> {final['serial']}, {want}, the VM created once")
        self.change("lock", a2, "destroy")
        self.expect_rows(DEFAULT_SCHEMA, {"default": [], "slot-2": []}, "after the last destroy")

    def main(self):
        a1 = self.slot("a", 1)
        a2 = self.slot("a", 2)
        u = urllib.parse.urlsplit(self.conn)
        # Host b: the password apart from the connection string (PGPASSWORD in the secret
        # environment, the rest in the plain one), and its own schema.
        host_b_conn = urllib.parse.urlunsplit(u._replace(netloc=f"{u.username}@{u.hostname}:{u.port}"))
        b2 = self.slot("b", 2, PG_CONN_STR=host_b_conn, PGPASSWORD=urllib.parse.unquote(u.password or ""),
                       PG_SCHEMA_NAME=HOST_B_SCHEMA)
        self.creation_lock(a1, a2)
        self.two_slots(a1, a2)
        self.second_host(b2)
        self.destroy_all(a1, a2, b2)
        self.lock(a2)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tofu", required=True)
    p.add_argument("--work", required=True, type=Path)
    p.add_argument("--server-log", required=True)
    args = p.parse_args()
    if args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    t = Test(args.tofu, args.work.resolve(), args.server_log)
    try:
        t.main()
    except Failure as e:
        print(f"pg_test.py: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        t.cleanup()
    step("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
