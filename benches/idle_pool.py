"""Part 7 of benches/run: the idle-pool pickup benchmark's table and checks, from each
configuration's bench-server stats (every job's moments) and VM log (benches/slots-module/vm.sh)
in DIR/pool-NAME/.

usage: idle_pool.py DIR "a:1:0:0 … e:3:1:1" JOBS POLL TICK VM_START SMOKE (NAME:SLOTS:WARM:HOOK)
Pickup = the runner's task request − the job becoming waiting (both the server's clock). Launch
= the task request − the poll that saw the job (the last jobs list answered on the connection
that then POSTed the runner's registration), for jobs whose VM was up when they arrived.
VM-seconds = Σ over VMs (destroy − create start) / jobs. With webhooks: the deliveries the server
sent (one per job, each answered 200), the receiver's processes (one per delivery, each exit 0)
and their CPU and peak RSS (benches/hook_activate.py: each of half of them), its counts (hook.prom), and which
started each run (runs.log: the slot's timer or its wake file)."""
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


def hook_checks(name, d, stats):
    """The webhook side of a configuration: (requests per job, CPU ms, RSS KiB lists, counts)."""
    sent = stats["deliveries"]
    check(f"({name}) webhook deliveries (one per job)", len(sent), jobs)
    check(f"({name}) deliveries not answered 200", [x["job"] for x in sent if x["status"] != 200], [])
    usage = [line.split() for line in open(f"{d}/hook-usage")]
    check(f"({name}) receiver processes (one per delivery)", len(usage), len(sent))
    check(f"({name}) receiver processes that did not exit 0", [u for u in usage if u[0] != "0"], [])
    counts = {}
    for line in open(f"{d}/hook.prom"):
        if line.startswith("ci_ephemeral_provisioner_hook_deliveries_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            counts[reason] = int(line.split()[-1])
    check(f"({name}) deliveries that woke or were coalesced", counts.get("woke", 0) + counts.get("coalesced", 0), len(sent))
    runs = [line.split() for line in open(f"{d}/runs.log")]
    woken = sum(1 for r in runs if r[4:] == ["wake"])
    cpu = [float(u[2]) for u in usage if u[1] == "cpu"]
    rss = [int(u[2]) for u in usage if u[1] == "rss"]
    return len(usage) / jobs, cpu, rss, counts, woken, len(runs)


rows, hooks = [], {}
for c in configs.split():
    name, n, warm, hook = c.split(":")
    n, warm, hook = int(n), int(warm), int(hook)
    d = f"{work}/pool-{name}"
    stats = json.load(open(f"{d}/stats.json"))
    batch = stats["batch"]
    if hook:
        hooks[name] = hook_checks(name, d, stats)
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
    rows.append((name, n, warm, hook, pickup, to_seen, launch, cold, len(vms), vm_s / jobs))

if not smoke:
    med = statistics.median
    all_launch = [x for r in rows for x in r[6]]
    L = med(all_launch) if all_launch else 0.0
    print()
    print(f"launch time (poll that saw the job → the runner's task request, jobs whose VM was up), "
          f"all configurations: median {L * 1e3:.0f} ms, p95 {p95(all_launch) * 1e3:.0f} ms, n={len(all_launch)}")
    print()
    print("| configuration | pickup p50, s | p95, s | max, s | target | met? | VM boot on the path (jobs) | VM starts | VM-seconds per job |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, warm, hook, pickup, to_seen, launch, cold, starts, vm_per_job in rows:
        p50, q95 = med(pickup), p95(pickup)
        if hook:
            # Webhooks: within a second of the launch (warm) or of the VM's start and the launch.
            t50 = (0 if warm else vm_start) + L + 1
            target = f"p50 ≤ {t50:.2f}"
            met = "✔" if p50 <= t50 else f"✘ +{p50 - t50:.2f} s"
        elif warm:
            t50, t95 = POLL + L, 2 * POLL + L
            target = f"p50 ≤ {t50:.2f}, p95 ≤ {t95:.2f}"
            met = ("p50 ✔" if p50 <= t50 else f"p50 ✘ +{p50 - t50:.2f} s") + ", " + \
                  ("p95 ✔" if q95 <= t95 else f"p95 ✘ +{q95 - t95:.2f} s")
        else:
            t50 = tick / (2 * n) + vm_start + L + POLL
            target = f"p50 ≤ {t50:.2f}"
            met = "✔" if p50 <= t50 else f"✘ +{p50 - t50:.2f} s"
        label = (f"({name}) warm {warm}, {n} slot{'s' if n > 1 else ''}{' staggered' if n > 1 else ''}"
                 f"{', webhooks' if hook else ', timer alone'}")
        print(f"| {label} | {p50:.2f} | {q95:.2f} | {max(pickup):.2f} | {target} | {met} | "
              f"{len(cold)} of {len(pickup)} | {starts} | {vm_per_job:.0f} |")
    print()
    print("| configuration | waiting → first listed, median (max), s | launch, median (p95), ms | "
          "pickup with a VM boot on the path, median (max), s |")
    print("|---|---|---|---|")
    for name, n, warm, hook, pickup, to_seen, launch, cold, *_ in rows:
        ls = f"{med(launch) * 1e3:.0f} ({p95(launch) * 1e3:.0f}), n={len(launch)}" if launch else "—"
        cs = f"{med(cold):.2f} ({max(cold):.2f}), n={len(cold)}" if cold else "—"
        print(f"| ({name}) | {med(to_seen):.2f} ({max(to_seen):.2f}) | {ls} | {cs} |")
    if hooks:
        print()
        print("| configuration | hook requests per job | receiver CPU per request, median (max) ms | "
              "receiver peak RSS, median (max) KiB | woke, coalesced | runs started by a delivery, of all runs |")
        print("|---|---|---|---|---|---|")
        for name, (per_job, cpu, rss, counts, woken, nruns) in hooks.items():
            print(f"| ({name}) | {per_job:.2f} | {med(cpu):.1f} ({max(cpu):.1f}) | {med(rss):.0f} ({max(rss)}) | "
                  f"{counts.get('woke', 0)}, {counts.get('coalesced', 0)} | {woken} of {nruns} |")
sys.exit(0 if ok else 1)
