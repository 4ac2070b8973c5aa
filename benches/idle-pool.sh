#!/usr/bin/env bash
# benches/idle-pool.sh DIR N WARM [HOOK]: one configuration of the idle-pool pickup benchmark
# (benches/run, part 7): a pool of N slots with --warm WARM against its own bench server, which
# makes the jobs waiting on its schedule. Each slot has its own timer, as systemd would run it:
# slot K's first run at BENCH_T0 + (K-1)/N × BENCH_TICK, then each run BENCH_TICK after the
# previous one ended (OnUnitInactiveSec). Once the server says every job ran, the pool wants no
# warm VM: later runs get --warm 0, and a run started with WARM > 0 that waits on a cycle is sent
# SIGHUP (it ends at its next wait, cycle.json kept; its slot's next run resumes the cycle and
# tears an unused warm VM down). A slot's timer stops after a run that left it no cycle.
# Fails unless every run exited 0, every job ran exactly once, no registration, no cycle.json
# and no VM is left, and every VM created was destroyed. With HOOK 1 the bench server delivers
# each job's push to a webhook receiver (benches/hook_activate.py, started by benches/run), which
# touches DIR/wake/slot-K; a slot's runs get --wake-file, and after a run its next one starts at
# the tick or at the first change of its file after the run ended, as its .path unit would
# (benches/wake_wait.py). runs.log says which started each run.
#
# From benches/run: BENCH_BIN, BENCH_URL, BENCH_TOKEN_FILE, BENCH_TOFU, BENCH_LAUNCH,
# BENCH_POLL, BENCH_IDLE, BENCH_TICK (seconds), BENCH_T0 (Unix seconds), BENCH_VM_START,
# BENCH_CHECK (seconds between the supervisor's looks), BENCH_DEADLINE (seconds after BENCH_T0:
# past it the runs are stopped and the configuration fails, so a run that never ends cannot hang
# the suite). DIR holds module/ (a copy of
# benches/slots-module), and gets state/, vm/, runs/.
set -euo pipefail
d=$1 n=$2 warm=$3 hook=${4:-0}
fail() { echo "idle-pool.sh $d: FAILED: $*" >&2; exit 1; }
mkdir -p "$d/state" "$d/vm" "$d/runs" "$d/wake"
: > "$d/vm/vm.log"
: > "$d/hups.log"
echo "$warm" > "$d/warm"
rm -f "$d/done"

cycle_file() { # cycle_file K: slot K's cycle.json
    if (($1 == 1)); then echo "$d/state/cycle.json"; else echo "$d/state/slot-$1/cycle.json"; fi
}
sleep_until() { # sleep_until UNIX_SECONDS
    local s
    s=$(/usr/bin/python3 -c "import sys, time; print(max(0.0, float(sys.argv[1]) - time.time()))" "$1")
    sleep "$s"
}
slot_timer() { # slot_timer K
    local k=$1 i=0 w code pid how=timer wake=()
    ((hook)) && wake=(--wake-file "$d/wake/slot-$k")
    sleep_until "$(/usr/bin/python3 -c "print($BENCH_T0 + ($k - 1) * $BENCH_TICK / $n)")"
    while :; do
        i=$((i + 1))
        w=$(< "$d/warm")
        BENCH_VM_DIR=$d/vm BENCH_VM_START=$BENCH_VM_START "$BENCH_BIN" run \
            --forgejo-url "$BENCH_URL" --token-file "$BENCH_TOKEN_FILE" \
            --state-dir "$d/state" --tofu-bin "$BENCH_TOFU" --tofu-dir "$d/module" \
            --runner-prefix ephemeral- --labels debian:host --slots "$n" --slot "$k" \
            --warm "$w" --launch-command "$BENCH_LAUNCH" --poll-interval "$BENCH_POLL" \
            --idle-timeout "$BENCH_IDLE" --output json "${wake[@]}" \
            > "$d/runs/slot-$k-$i.json" 2> "$d/runs/slot-$k-$i.err" &
        pid=$!
        echo "$pid $w" > "$d/pid-$k"
        code=0
        wait "$pid" || code=$?
        rm -f "$d/pid-$k"
        echo "$k $i $w $code $how" >> "$d/runs.log"
        ((code == 0)) || fail "slot $k run $i exited $code; its stderr ends: $(tail -n 5 "$d/runs/slot-$k-$i.err")"
        if [[ -e $d/done && ! -e $(cycle_file "$k") ]]; then
            return 0
        fi
        if ((hook)); then
            how=timer
            /usr/bin/python3 "$(dirname "$0")/wake_wait.py" "$d/wake/slot-$k" "$BENCH_TICK" "$(date +%s%N)" && how=wake
        else
            sleep "$BENCH_TICK"
        fi
    done
}

timers=()
for ((k = 1; k <= n; k++)); do
    slot_timer "$k" &
    timers+=($!)
done

# The supervisor: every job ran → no warm VM wanted; SIGHUP to each run that still has them.
stats() { curl -fsS "$BENCH_URL/_bench/stats"; }
all_done() {
    stats | /usr/bin/python3 -c 'import json, sys; s = json.load(sys.stdin); sys.exit(0 if s["done"] == s["expected"] else 1)'
}
declare -A hupped=()
alive() {
    local p
    for p in "${timers[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done
    return 1
}
deadline=$(/usr/bin/python3 -c "print(int($BENCH_T0 + $BENCH_DEADLINE))")
while alive; do
    if ((EPOCHSECONDS > deadline)); then
        for ((k = 1; k <= n; k++)); do
            read -r pid w 2> /dev/null < "$d/pid-$k" && kill -TERM "$pid" 2> /dev/null
        done
        kill "${timers[@]}" 2> /dev/null
        fail "not done ${BENCH_DEADLINE}s after the start: $(stats)"
    fi
    if [[ ! -e $d/done ]] && all_done; then
        echo 0 > "$d/warm"
        touch "$d/done"
    fi
    if [[ -e $d/done ]]; then
        for ((k = 1; k <= n; k++)); do
            read -r pid w 2> /dev/null < "$d/pid-$k" || continue
            if ((w > 0)) && [[ -e $(cycle_file "$k") && -z ${hupped[$pid]:-} ]] &&
                kill -HUP "$pid" 2> /dev/null; then
                hupped[$pid]=1
                echo "$k $pid" >> "$d/hups.log"
            fi
        done
    fi
    sleep "$BENCH_CHECK"
done
for p in "${timers[@]}"; do wait "$p" || fail "a slot's timer failed (see above)"; done

for ((k = 1; k <= n; k++)); do
    [[ -e $(cycle_file "$k") ]] && fail "slot $k has a cycle.json left"
done
for f in "$d"/vm/vm-*; do
    [[ -e $f ]] && fail "a VM is left (${f##*/})"
done
code=$(curl -sS -o "$d/verify.json" -w '%{http_code}' "$BENCH_URL/_bench/verify") || fail "verify: curl failed"
[[ $code == 200 ]] || fail "the bench server's verify answered $code: $(< "$d/verify.json")"
creates=$(grep -c '^create ' "$d/vm/vm.log" || true)
destroys=$(grep -c '^destroy ' "$d/vm/vm.log" || true)
((creates == destroys)) || fail "$creates VMs created, $destroys destroyed"
echo "idle-pool.sh $d: ok ($creates VMs, $(wc -l < "$d/runs.log") runs, $(wc -l < "$d/hups.log") SIGHUPs)"
