#!/bin/sh
# Test launch command: plays `forgejo-runner one-job --handle H --label L… --wait` on the VM
# against the fake Forgejo. The runner declares the label names of RUNNER_LABELS (as the real
# one declares those of its --label flags) and the fake gives it its job only by Forgejo's rule
# (tests/support/forgejo_rules.rs). Like `--wait`, a runner that is given no task keeps asking,
# in the background, until it gets its job or its VM is gone ($VM_DIR/vm-* removed by the
# module's destroy; a deleted registration does not stop it).
#
# Mode from $VM_DIR/launch-mode (or launch-mode.N for the Nth launch): one-job (default: connect, take the job, finish it), take (take
# the job and keep running), connect (connect, never take a job), nolabels (one-job without any
# --label: Forgejo gives it nothing), die (connect; the process dies before taking its job, right
# after the provisioner has seen it up), noop (exit 0 but never
# connect), fail (exit 3), hang (never return), leak (print the token on stdout and stderr, then
# exit 3: what reaches our logs must be redacted).
set -eu
env | sort > "$VM_DIR/launch-env.$RUNNER_ID"
echo "$0 $*" > "$VM_DIR/launch-argv.$RUNNER_ID"
# Launches run one at a time: the Nth one may have a mode of its own in launch-mode.N.
n=$(ls "$VM_DIR"/launch-env.* | wc -l)
mode=$(cat "$VM_DIR/launch-mode.$n" 2>/dev/null || cat "$VM_DIR/launch-mode" 2>/dev/null || echo one-job)
IFS= read -r token
case "$mode" in
fail) echo "simulated launch failure" >&2; exit 3 ;;
leak) echo "runner token: $token"; echo "runner token: $token" >&2; exit 3 ;;
hang) sleep 600 ;;
noop) exit 0 ;;
esac
mkdir -p "$VM_DIR/runners"
# The token file on the VM (what `--token-url file:` would read).
tokenfile="$VM_DIR/runners/$RUNNER_UUID"
(umask 077 && printf '%s\n' "$token" > "$tokenfile")
labels="labels=$RUNNER_LABELS"
[ "$mode" = nolabels ] && labels="labels="
# POST /_fake/$1 as this runner; prints the HTTP status.
post() {
    curl -sS -o /dev/null -w '%{http_code}' -X POST -H "X-Runner-UUID: $RUNNER_UUID" \
        --data-binary @"$tokenfile" "$FORGEJO_URL/_fake/$1" || echo 000
}
# `--wait`: ask again every 200 ms while the VM lives (at most 2 minutes in a test).
wait_for_job() {
    (
        i=0
        while [ "$i" -lt 600 ] && ls "$VM_DIR"/vm-* > /dev/null 2>&1; do
            code=$(post "one-job?handle=$JOB_HANDLE")
            [ "$code" = 200 ] && { rm -f "$tokenfile"; break; }
            [ "$code" = 410 ] && break # the process is gone (its VM was destroyed)
            sleep 0.2
            i=$((i + 1))
        done
    ) < /dev/null > /dev/null 2>&1 &
}
case "$mode" in
one-job | nolabels)
    code=$(post "one-job?handle=$JOB_HANDLE&$labels")
    case "$code" in
    200) rm -f "$tokenfile" ;;
    409) wait_for_job ;; # connected, given no task (yet)
    *) echo "runner: the fake Forgejo answered $code" >&2; exit 1 ;;
    esac
    ;;
take) [ "$(post "take?handle=$JOB_HANDLE&$labels")" = 200 ] ;;
connect) [ "$(post "connect?$labels")" = 200 ] ;;
die) [ "$(post "connect?$labels&die=seen")" = 200 ] ;;
esac
