#!/bin/sh
# create NAME [GATE] | destroy NAME: the "VM" of the pg backend test. Logs the action in
# $PG_TEST_VM_LOG. With GATE (a directory), a create writes GATE/inside and waits until
# GATE/release exists (at most 5 minutes), so the test can hold an apply, and its lock, open.
set -eu
: "${PG_TEST_VM_LOG:?PG_TEST_VM_LOG must be set by the test}"
action=$1
name=$2
gate=${3:-}
echo "$action $name" >> "$PG_TEST_VM_LOG"
if [ "$action" = create ] && [ -n "$gate" ]; then
    : > "$gate/inside"
    i=0
    while [ ! -e "$gate/release" ]; do
        i=$((i + 1))
        if [ "$i" -gt 3000 ]; then
            echo "vm.sh: $gate/release did not appear within 5 minutes" >&2
            exit 1
        fi
        sleep 0.1
    done
fi
