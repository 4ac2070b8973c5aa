#!/usr/bin/env bash
# benches/slots.sh N: one measured run of the parallel-slots benchmark (benches/run, part 6).
# Starts the N slot processes of one pool together (the same --state-dir, --tofu-dir,
# --runner-prefix and --labels, each --slots N --slot K) against the bench server's next batch
# of M waiting jobs, waits for all of them, and fails unless the run started from nothing and
# left nothing: no cycle.json in any slot's directory and no VM before and after, every job run
# exactly once and no registration left (the bench server's /_bench/verify), and min(N, M) VMs
# created and destroyed. Only shell builtins and two requests besides the slots themselves, so
# the checks add milliseconds to a measurement of seconds. --max-jobs-per-vm is M + 1, so that
# no slot ends by reaching it: every slot tears its VM down after its idle timeout.
#
# From benches/run: BENCH_BIN, BENCH_URL, BENCH_TOKEN_FILE, BENCH_TOFU, BENCH_LAUNCH,
# BENCH_SLOTS_DIR (slots-N/{module,state,vm,runs} under it), BENCH_JOBS (M), BENCH_POLL,
# BENCH_IDLE, BENCH_VM_START.
set -euo pipefail
n=$1
d=$BENCH_SLOTS_DIR/slots-$n
t0=$EPOCHREALTIME
fail() { echo "slots.sh $n: FAILED: $*" >&2; exit 1; }

at_rest() { # at_rest WHEN: no slot has a cycle in progress, no VM exists
    local k f
    for ((k = 1; k <= n; k++)); do
        if ((k == 1)); then f=$d/state/cycle.json; else f=$d/state/slot-$k/cycle.json; fi
        [[ -e $f ]] && fail "$1: slot $k has a cycle.json ($f)"
    done
    for f in "$d"/vm/vm-*; do
        [[ -e $f ]] && fail "$1: a VM is left (${f##*/})"
    done
    return 0
}
# request WHAT: one control request to the bench server; fails on any answer but 200.
request() {
    local code
    code=$(curl -sS -o "$run/$1.json" -w '%{http_code}' "$BENCH_URL/_bench/$1") || fail "$1: curl failed"
    [[ $code == 200 ]] || fail "$1: the bench server answered $code: $(< "$run/$1.json")"
}

run=$d/runs/${t0/./}
mkdir -p "$run"
at_rest "before the run"
: > "$d/vm/vm.log"
request batch # refused unless the last batch is done and no registration is left

pids=()
for ((k = 1; k <= n; k++)); do
    BENCH_VM_DIR=$d/vm BENCH_VM_START=$BENCH_VM_START "$BENCH_BIN" run \
        --forgejo-url "$BENCH_URL" --token-file "$BENCH_TOKEN_FILE" \
        --state-dir "$d/state" --tofu-bin "$BENCH_TOFU" --tofu-dir "$d/module" \
        --runner-prefix ephemeral- --labels debian:host --slots "$n" --slot "$k" \
        --launch-command "$BENCH_LAUNCH" --poll-interval "$BENCH_POLL" \
        --idle-timeout "$BENCH_IDLE" --max-jobs-per-vm $((BENCH_JOBS + 1)) --output json \
        > "$run/slot-$k.json" 2> "$run/slot-$k.err" &
    pids+=($!)
done
for ((k = 1; k <= n; k++)); do
    code=0
    wait "${pids[k - 1]}" || code=$?
    ((code == 0)) || fail "slot $k exited $code; its stderr ends: $(tail -n 5 "$run/slot-$k.err")"
done
t1=$EPOCHREALTIME

at_rest "after the run"
request verify # every job once, no launched runner refused, no registration left
want=$((n < BENCH_JOBS ? n : BENCH_JOBS))
creates=0 destroys=0
while read -r what _; do
    case $what in
    create) creates=$((creates + 1)) ;;
    destroy) destroys=$((destroys + 1)) ;;
    esac
done < "$d/vm/vm.log"
((creates == want)) || fail "$creates VMs created for $n slots and $BENCH_JOBS jobs, expected $want"
((destroys == want)) || fail "$destroys VMs destroyed, expected $want"
printf '%s %s %s %s\n' "$t0" "$t1" "$creates" "$destroys" > "$run/times"
