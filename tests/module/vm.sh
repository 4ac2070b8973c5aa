#!/bin/sh
# create|destroy CYCLE_ID [SLOT]. Faults are switched on by files in $VM_DIR:
#   fail-apply, fail-destroy (exit 1), slow-apply, slow-destroy (sleep 30; SIGINT ends it),
#   graceful-shutdown (the destroy shuts the VM down: its runners get SIGTERM, and one that runs
#   a task reports it failed, so Forgejo deletes it; else the VM is powered off).
set -eu
: "${VM_DIR:?VM_DIR must be set by the test}"
action=$1
id=$2
# What tofu passed on: its environment (ours, minus what must never reach it) and its argv.
env | sort > "$VM_DIR/tofu-env.$action"
env | sort > "$VM_DIR/tofu-env.$action.slot-${TF_VAR_slot:-1}"
p=$PPID
while [ "$p" -gt 1 ]; do
    case "$(cat /proc/$p/comm 2>/dev/null)" in
    terraform|tofu) tr '\0' ' ' < /proc/$p/cmdline > "$VM_DIR/tofu-argv.$action"; break ;;
    esac
    p=$(awk '{print $4}' /proc/$p/stat 2>/dev/null || echo 1)
done
case "$action" in
create)
    if [ -e "$VM_DIR/slow-apply" ]; then touch "$VM_DIR/applying"; sleep 30; fi
    if [ -e "$VM_DIR/fail-apply" ]; then echo "simulated cloud error on create" >&2; exit 1; fi
    echo "create $id" >> "$VM_DIR/vm.log"
    touch "$VM_DIR/vm-$id"
    # The VMs that exist at once, one line per create (the slots tests count them).
    echo "${3:-1} $(ls "$VM_DIR"/vm-* | wc -l)" >> "$VM_DIR/vms-at-create.log"
    ;;
destroy)
    if [ -e "$VM_DIR/slow-destroy" ]; then touch "$VM_DIR/destroying"; sleep 30; fi
    if [ -e "$VM_DIR/fail-destroy" ]; then echo "simulated cloud error on destroy" >&2; exit 1; fi
    # The VM goes away, and with it every runner process still running on it (a runner started
    # on another VM, as launch.sh records in runner-vm.UUID, runs on).
    for f in "$VM_DIR"/runners/*; do
        [ -e "$f" ] || continue
        uuid=$(basename "$f")
        on=$(cat "$VM_DIR/runner-vm.$uuid" 2> /dev/null || echo "$id")
        [ "$on" = "$id" ] || continue
        how=disconnect
        [ -e "$VM_DIR/graceful-shutdown" ] && how=terminate
        curl -fsS -X POST -H "X-Runner-UUID: $uuid" --data-binary @"$f" \
            "$FAKE_FORGEJO_URL/_fake/$how" > /dev/null || true
        rm -f "$f"
    done
    echo "destroy $id" >> "$VM_DIR/vm.log"
    rm -f "$VM_DIR/vm-$id"
    ;;
esac
