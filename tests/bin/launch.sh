#!/bin/sh
# Test launch command: plays `forgejo-runner one-job` on the VM against the fake Forgejo.
# Mode from $VM_DIR/launch-mode: one-job (default: connect, take the job, finish it), take (take
# the job and keep running), connect (connect, never take a job), noop (never connect), fail
# (exit 3), hang (never return), leak (print the token on stdout and stderr, then exit 3: what
# reaches our logs must be redacted).
set -eu
env | sort > "$VM_DIR/launch-env.$RUNNER_ID"
echo "$0 $*" > "$VM_DIR/launch-argv.$RUNNER_ID"
mode=$(cat "$VM_DIR/launch-mode" 2>/dev/null || echo one-job)
IFS= read -r token
case "$mode" in
fail) echo "simulated launch failure" >&2; exit 3 ;;
leak) echo "runner token: $token"; echo "runner token: $token" >&2; exit 3 ;;
hang) sleep 600 ;;
noop) exit 0 ;;
esac
mkdir -p "$VM_DIR/runners"
# The token file on the VM (what `--token-url file:` would read).
(umask 077 && printf '%s\n' "$token" > "$VM_DIR/runners/$RUNNER_UUID")
post() {
    curl -fsS -X POST -H "X-Runner-UUID: $RUNNER_UUID" \
        --data-binary @"$VM_DIR/runners/$RUNNER_UUID" "$FORGEJO_URL/_fake/$1" > /dev/null
}
case "$mode" in
one-job) post "one-job?handle=$JOB_HANDLE"; rm -f "$VM_DIR/runners/$RUNNER_UUID" ;;
take) post "take?handle=$JOB_HANDLE" ;;
connect) post "connect" ;;
esac
