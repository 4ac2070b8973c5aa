#!/bin/sh
# create|destroy CYCLE_ID [SLOT]: a VM that takes BENCH_VM_START seconds to start (0 to stop),
# a marker file vm-CYCLE_ID while it exists, and one log line per create and destroy.
set -eu
: "${BENCH_VM_DIR:?BENCH_VM_DIR must be set by benches/run}"
case "$1" in
create)
    sleep "${BENCH_VM_START:-0}"
    touch "$BENCH_VM_DIR/vm-$2"
    echo "create $2 ${3:-1}" >> "$BENCH_VM_DIR/vm.log"
    ;;
destroy)
    rm -f "$BENCH_VM_DIR/vm-$2"
    echo "destroy $2" >> "$BENCH_VM_DIR/vm.log"
    ;;
esac
