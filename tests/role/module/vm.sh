#!/bin/sh
# create|destroy CYCLE_ID, run by tofu's local-exec under the pool's systemd sandbox.
set -eu
: "${VM_DIR:?VM_DIR must be set in the pool environment}"
action=$1
id=$2
mkdir -p "$VM_DIR"
# Who ran tofu, and with which environment (the test looks for leaked secrets there).
id -u > "$VM_DIR/uid.$action"
env | sort > "$VM_DIR/tofu-env.$action"
# The sandbox it runs in (the test holds the recovery wrapper's to the unit's).
{
    grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status
    if [ -e /proc/1 ]; then echo "pid 1 visible"; else echo "pid 1 hidden"; fi
    if [ -e /proc/sys/kernel ]; then echo "/proc/sys visible"; else echo "/proc/sys hidden"; fi
} > "$VM_DIR/sandbox.$action"
case "$action" in
create)
    echo "create $id" >> "$VM_DIR/vm.log"
    touch "$VM_DIR/vm-$id"
    ;;
destroy)
    if [ -e "$VM_DIR/fail-destroy" ]; then
        echo "simulated cloud error on destroy" >&2
        exit 1
    fi
    echo "destroy $id" >> "$VM_DIR/vm.log"
    rm -f "$VM_DIR/vm-$id"
    ;;
esac
