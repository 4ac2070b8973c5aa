#!/usr/bin/env python3
"""Writes a dry-run fixture for benches/run: fixture.py teardown|busy RUNNERS JOBS > fixture.json

Both: a running cycle whose VM has been free since 15:10 ("now" is 15:30), RUNNERS
registrations (a fifth of them offline with the prefix, spread evenly; of the rest one in ten a
live one with the prefix, the others other pools' and names that only contain the prefix) and
JOBS jobs, as bench-forgejo builds them.

teardown: the jobs want a `gpu` label we do not have, so the idle timeout tears the VM down and
          the sweep lists every registration: plan = tofu_destroy + RUNNERS/5 delete_runner.
busy:     the jobs match `debian` and are of the VM's repository: plan = one register_runner (for the oldest job), then the
          cycle would wait for that runner.
"""
import json
import sys

kind, n, jobs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stale = n // 5
prefix = "ephemeral-"

runners = []
other = 0
for i in range(n):
    rid = i + 1
    if stale and (i + 1) * stale // n > i * stale // n:
        name, status = f"{prefix}20261014t101500z-3f2a-{rid}", "offline"
    else:
        other += 1
        if other % 20 in (0, 1):
            name, status = f"{prefix}20261014t120000z-9a1b-{rid}", ["idle", "active"][other % 20]
        else:
            name, status = [
                (f"static-builder-{rid}", "offline"),
                (f"my-{prefix}{rid}", "offline"),
                (f"pool-b-{rid}", "idle"),
            ][other % 3]
    runners.append({
        "id": rid, "uuid": f"00000000-0000-4000-8000-{rid:012}", "owner_id": 0, "repo_id": 0,
        "name": name, "status": status, "version": "v11.1.2", "labels": ["debian", "docker"],
        "description": "", "ephemeral": True,
    })

label = "gpu" if kind == "teardown" else "debian"
job_list = [{
    "id": 100000 + j, "attempt": 1, "handle": f"1d0c5e7a-0000-4000-8000-{100000 + j:012}",
    "repo_id": 1, "owner_id": 1, "name": f"build-{j}", "needs": None, "runs_on": [label],
    "task_id": 0, "status": "waiting",
} for j in range(jobs)]

cycle = {
    "version": 1, "cycle_id": "20261014t150000z-5c1d", "runner_prefix": prefix,
    "started_at": "2026-10-14T15:00:00.000Z", "phase": "running",
    "vm_ready_at": "2026-10-14T15:01:00.000Z", "free_since": "2026-10-14T15:10:00.000Z",
    "jobs_started": 3, "next_seq": 4, "start_failures": 0, "registrations": [],
    "teardown_reason": None, "destroyed_at": None, "last_error": None,
    "outputs": {"address": "192.0.2.10"},
    # The jobs' repository: the VM may run them (--reuse-within repo).
    "boundary": {"repo_id": 1, "owner_id": 1},
}
json.dump({"_comment": f"benches/fixture.py {kind} {n} {jobs}", "cycle": cycle,
           "runners": runners, "jobs": job_list, "now": "2026-10-14T15:30:00Z"}, sys.stdout)
