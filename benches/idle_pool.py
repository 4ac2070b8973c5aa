"""Part 7 of benches/run: the idle-pool pickup benchmark's table and checks, from each
configuration's bench-server stats (every job's moments) and VM log (benches/slots-module/vm.sh)
in DIR/pool-NAME/.

usage: idle_pool.py DIR "a:1:0 b:3:0 c:3:1" JOBS POLL TICK VM_START SMOKE
Pickup = the runner's task request − the job becoming waiting (both the server's clock). Launch
= the task request − the poll that saw the job (the last jobs list answered on the connection
that then POSTed the runner's registration), for jobs whose VM was up when they arrived.
VM-seconds = Σ over VMs (destroy − create start) / jobs."""
import json, statistics, sys

work, configs, jobs, poll, tick, vm_start, smoke = sys.argv[1:]
jobs, tick, vm_start, smoke = int(jobs), float(tick), float(vm_start), smoke == "true"
POLL = float(poll[:-2]) / 1000 if poll.endswith("ms") else float(poll[:-1])
ok = True


def check(what, got, want):
    global ok
    if got != want:
        print(f"bench: FAILED: part 7: {what}: got {got}, expected {want}", file=sys.stderr)
        ok = False
    else:
        print(f"ok: part 7: {what} = {got}")


def p95(v):
    v = sorted(v)
    return v[min(len(v) - 1, round(0.95 * (len(v) - 1)))]


rows = []
for c in configs.split():
    name, n, warm = c.split(":")
    n, warm = int(n), int(warm)
    d = f"{work}/pool-{name}"
    batch = json.load(open(f"{d}/stats.json"))["batch"]
    vms, gone = {}, {}
    for line in open(f"{d}/vm/vm.log"):
        f = line.split()
        if f[0] == "create":
            vms[f[1]] = (int(f[2]), float(f[3]), float(f[4]))
        elif f[0] == "destroy":
            gone[f[1]] = float(f[2])
    check(f"({name}) jobs served", len(batch), jobs)
    check(f"({name}) jobs given to more than one runner", sum(j["takes"] != 1 for j in batch), 0)
    check(f"({name}) VMs created and not destroyed", sorted(set(vms) - set(gone)), [])

    def vm_of(j):
        for vid in vms:
            if f"-{vid}-" in f"-{j['runner_name']}-":
                return vid
        return None

    cold, nowhere, launch, pickup, to_seen = [], 0, [], [], []
    for j in batch:
        w, t = j["waiting_ns"] / 1e9, j["taken_ns"] / 1e9
        pickup.append(t - w)
        to_seen.append(j["first_seen_ns"] / 1e9 - w)
        vid = vm_of(j)
        if vid is None:
            nowhere += 1
            continue
        if vms[vid][2] > w:  # the VM that ran it was not yet up when it arrived
            cold.append(t - w)
        elif j["seen_ns"]:
            launch.append(t - j["seen_ns"] / 1e9)
    check(f"({name}) jobs whose runner is on no VM of the log", nowhere, 0)
    # The first job arrives at an idle pool: with warm capacity no VM boots on its way.
    first = min(batch, key=lambda j: j["waiting_ns"])
    fw, ft = first["waiting_ns"] / 1e9, first["taken_ns"] / 1e9
    first_vm = vm_of(first)
    first_up = first_vm is not None and vms[first_vm][2] <= fw
    if warm:
        check(f"({name}) VMs up when the first job arrived", sum(v[2] <= fw for v in vms.values()), warm)
        check(f"({name}) VM starts between the first job's arrival and its pickup",
              sum(fw <= v[1] <= ft for v in vms.values()), 0)
        check(f"({name}) the first job ran on a VM up before it arrived", first_up, True)
    vm_s = sum(gone[v] - vms[v][1] for v in vms if v in gone)
    rows.append((name, n, warm, pickup, to_seen, launch, cold, len(vms), vm_s / jobs))

if not smoke:
    med = statistics.median
    all_launch = [x for r in rows for x in r[5]]
    L = med(all_launch) if all_launch else 0.0
    print()
    print(f"launch time (poll that saw the job → the runner's task request, jobs whose VM was up), "
          f"all configurations: median {L * 1e3:.0f} ms, p95 {p95(all_launch) * 1e3:.0f} ms, n={len(all_launch)}")
    print()
    print("| configuration | pickup p50, s | p95, s | max, s | target | met? | VM boot on the path (jobs) | VM starts | VM-seconds per job |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, warm, pickup, to_seen, launch, cold, starts, vm_per_job in rows:
        p50, q95 = med(pickup), p95(pickup)
        if warm:
            t50, t95 = POLL + L, 2 * POLL + L
            target = f"p50 ≤ {t50:.2f}, p95 ≤ {t95:.2f}"
            met = ("p50 ✔" if p50 <= t50 else f"p50 ✘ +{p50 - t50:.2f} s") + ", " + \
                  ("p95 ✔" if q95 <= t95 else f"p95 ✘ +{q95 - t95:.2f} s")
        else:
            t50 = tick / (2 * n) + vm_start + L + POLL
            target = f"p50 ≤ {t50:.2f}"
            met = "✔" if p50 <= t50 else f"✘ +{p50 - t50:.2f} s"
        label = f"({name}) warm {warm}, {n} slot{'s' if n > 1 else ''}{' staggered' if n > 1 else ''}"
        print(f"| {label} | {p50:.2f} | {q95:.2f} | {max(pickup):.2f} | {target} | {met} | "
              f"{len(cold)} of {len(pickup)} | {starts} | {vm_per_job:.0f} |")
    print()
    print("| configuration | waiting → first listed, median (max), s | launch, median (p95), ms | "
          "pickup with a VM boot on the path, median (max), s |")
    print("|---|---|---|---|")
    for name, n, warm, pickup, to_seen, launch, cold, *_ in rows:
        ls = f"{med(launch) * 1e3:.0f} ({p95(launch) * 1e3:.0f}), n={len(launch)}" if launch else "—"
        cs = f"{med(cold):.2f} ({max(cold):.2f}), n={len(cold)}" if cold else "—"
        print(f"| ({name}) | {med(to_seen):.2f} ({max(to_seen):.2f}) | {ls} | {cs} |")
sys.exit(0 if ok else 1)
