#!/bin/sh
# Test tofu: records what the provisioner passed (argv, environment, stdin) and every SIGINT it
# got in $VM_DIR, then runs the real CLI named by $TOFU_REAL, forwarding a SIGINT to it.
set -u
: "${VM_DIR:?VM_DIR must be set by the test}"
: "${TOFU_REAL:?TOFU_REAL must name the real tofu or terraform}"
n=$$
printf '%s\n' "$0 $*" > "$VM_DIR/tofu-wrapper-argv.$n"
env | sort > "$VM_DIR/tofu-wrapper-env.$n"
"$TOFU_REAL" "$@" < /dev/null &
child=$!
trap 'echo "SIGINT during: $*" >> "$VM_DIR/tofu-sigint"; kill -INT "$child"' INT
status=0
wait "$child" || status=$?
# `wait` returns early when the trap ran: wait for the real CLI to finish its shutdown.
while kill -0 "$child" 2>/dev/null; do
    status=0
    wait "$child" || status=$?
done
exit "$status"
