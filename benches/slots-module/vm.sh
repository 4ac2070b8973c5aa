#!/bin/sh
# create|destroy CYCLE_ID [SLOT]: a VM that takes BENCH_VM_START seconds to start (0 to stop),
# a marker file vm-CYCLE_ID while it exists, and one log line per create and destroy with its
# times (Unix seconds: create's start and end, destroy's end).
set -eu
: "${BENCH_VM_DIR:?BENCH_VM_DIR must be set by benches/run}"
case "$1" in
create)
    t0=$(date +%s.%N)
    sleep "${BENCH_VM_START:-0}"
    touch "$BENCH_VM_DIR/vm-$2"
    echo "create $2 ${3:-1} $t0 $(date +%s.%N)" >> "$BENCH_VM_DIR/vm.log"
    ;;
destroy)
    rm -f "$BENCH_VM_DIR/vm-$2"
    echo "destroy $2 $(date +%s.%N)" >> "$BENCH_VM_DIR/vm.log"
    ;;
esac
