#!/bin/sh
# Test launch command: plays `forgejo-runner one-job --handle H --label L… --wait` on the VM
# against the fake Forgejo. The runner declares the label names of RUNNER_LABELS (as the real
# one declares those of its --label flags) and the fake gives it its job only by Forgejo's rule
# (forgejo-model/src/rules.rs). Like `--wait`, a runner that is given no task keeps asking,
# in the background, until it gets its job or its VM is gone ($VM_DIR/vm-* removed by the
# module's destroy; a deleted registration does not stop it).
#
# RUNNER_ACTION (the launch command's contract, docs/design.md "The launch command"):
#   start (also when unset): start the runner; the token is on stdin. An empty JOB_HANDLE: exit 1.
#   check: exit 0 while this runner's process still runs on the VM, 3 once it is gone.
#   stop:  end that process (SIGTERM: tell the fake, which fails a running task), exit 0; also 0
#          when it was already gone.
#   probe: the canary (`check --boot`): print forgejo-runner's --version line of the VM and exit 0,
#          as $VM_DIR/probe-mode says: ok (default: v12.8.2, only while the VM of TOFU_OUTPUT_VM
#          exists), old (v12.7.3), fail (exit 1: sshd never answered), hang (never return). Its
#          environment goes to $VM_DIR/probe-env.
#   anything else: exit 2.
# Every call appends `<action> <RUNNER_ID>` to $VM_DIR/actions.log. Only a start writes
# launch-env.N and launch-argv.N (tests count starts by them); check and stop do not.
#
# The runner's process: $VM_DIR/proc.$RUNNER_UUID exists for as long as a runner of that mode
# would still run, holding the pid of its background loop where there is one: the `--wait` loop
# of one-job/nolabels that was given no task at once (409), until it gets its job, its process
# is gone (410) or its VM is; take and connect (their runner stays connected until the VM goes;
# the token file $VM_DIR/runners/$RUNNER_UUID, which the test's module disconnects and removes on
# destroy, is that process's memory: a test that removes it ends the process). No marker: one-job
# that got its job at once (ran it and exited), die (the process died), noop, fail, hang, leak.
# check: marker, a VM, and the loop's pid alive (or, without a pid, the token file there) -> 0;
# else 3.
#
# Start mode from $VM_DIR/launch-mode (or launch-mode.N for the Nth start): one-job (default:
# connect, take the job, finish it), take (take the job and keep running), connect (connect,
# never take a job), nolabels (one-job without any --label: Forgejo gives it nothing), die
# (connect; the process dies before taking its job, right after the provisioner has seen it up),
# noop (exit 0 but never connect), fail (exit 3), hang (never return), leak (print the token on
# stdout and stderr, then exit 3: what reaches our logs must be redacted).
# $VM_DIR/check-mode: unknown (check exits 1: cannot tell), ignore (check behaves like a launch
# command that ignores RUNNER_ACTION: it runs the start path, which fails reading the token from
# the empty stdin; without writing launch-env/launch-argv, which count starts).
# $VM_DIR/stop-mode: fail (stop exits 1 and leaves the process running).
set -eu
action=${RUNNER_ACTION:-start}
echo "$action ${RUNNER_ID:-}" >> "$VM_DIR/actions.log"
if [ "$action" = probe ]; then
    env | sort > "$VM_DIR/probe-env"
    case "$(cat "$VM_DIR/probe-mode" 2> /dev/null || echo ok)" in
    ok)
        if ! ls "$VM_DIR/vm-${TOFU_OUTPUT_VM:?}" > /dev/null 2>&1; then
            echo "launch: probe: no VM $TOFU_OUTPUT_VM" >&2
            exit 1
        fi
        echo "forgejo-runner version v12.8.2"
        ;;
    old) echo "forgejo-runner version v12.7.3" ;;
    fail) echo "launch: probe: sshd on the VM never answered (probe-mode fail)" >&2; exit 1 ;;
    hang) sleep 600 ;;
    esac
    exit 0
fi
marker="$VM_DIR/proc.$RUNNER_UUID"
tokenfile="$VM_DIR/runners/$RUNNER_UUID"
# POST /_fake/$1 as this runner; prints the HTTP status.
post() {
    curl -sS -m 5 -o /dev/null -w '%{http_code}' -X POST -H "X-Runner-UUID: $RUNNER_UUID" \
        --data-binary @"$tokenfile" "$FORGEJO_URL/_fake/$1" || echo 000
}
# This runner's VM (TOFU_OUTPUT_VM, the module's output), or any VM.
vm_exists() { ls "$VM_DIR"/vm-"${TOFU_OUTPUT_VM:-*}" > /dev/null 2>&1; }
# A live process (a zombie is not: nothing may reap an orphan here).
alive() {
    [ -n "$1" ] && kill -0 "$1" 2> /dev/null &&
        [ "$(sed 's/.*) //' "/proc/$1/stat" 2> /dev/null | cut -c1)" != Z ]
}
running() {
    [ -e "$marker" ] && vm_exists || return 1
    pid=$(cat "$marker" 2> /dev/null || true)
    if [ -n "$pid" ]; then alive "$pid"; else [ -e "$tokenfile" ]; fi
}
case "$action" in
start) ;;
check)
    case "$(cat "$VM_DIR/check-mode" 2> /dev/null || true)" in
    unknown) echo "launch: check: cannot tell (check-mode unknown)" >&2; exit 1 ;;
    ignore) IFS= read -r token; exit 0 ;; # the start path: no token on the empty stdin
    esac
    if running; then exit 0; fi
    exit 3
    ;;
stop)
    if [ "$(cat "$VM_DIR/stop-mode" 2> /dev/null || true)" = fail ]; then
        echo "launch: stop: simulated failure (stop-mode fail); the process runs on" >&2
        exit 1
    fi
    [ -e "$marker" ] || exit 0 # already gone
    pid=$(cat "$marker" 2> /dev/null || true)
    rm -f "$marker" # the loop ends once it sees its marker gone (after its request in flight)
    i=0
    while alive "$pid" && [ "$i" -lt 30 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    if alive "$pid"; then
        kill -KILL "$pid" 2> /dev/null || true
    fi
    # The process got SIGTERM (`one-job` reports a running task failed, and Forgejo deletes the
    # runner) and is gone: the fake hears it at once (Forgejo would after 60 s). Best effort: a
    # deleted registration answers 401.
    if [ -e "$tokenfile" ]; then
        post terminate > /dev/null
        rm -f "$tokenfile"
    fi
    exit 0
    ;;
*)
    echo "launch: RUNNER_ACTION='$action' is not start, check, stop or probe" >&2
    exit 2
    ;;
esac
# An empty handle is none: `one-job --handle ''` would take any job of its labels.
if [ -z "${JOB_HANDLE:-}" ]; then
    echo "launch: JOB_HANDLE is empty; not starting a runner that would take any job of its labels" >&2
    exit 1
fi
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
# Which VM it runs on: the destroy of another VM leaves it running.
[ -n "${TOFU_OUTPUT_VM:-}" ] && printf '%s\n' "$TOFU_OUTPUT_VM" > "$VM_DIR/runner-vm.$RUNNER_UUID"
# The token file on the VM (what `--token-url file:` would read).
(umask 077 && printf '%s\n' "$token" > "$tokenfile")
labels="labels=$RUNNER_LABELS"
[ "$mode" = nolabels ] && labels="labels="
# `--wait`: ask again every 200 ms while the VM lives and stop has not ended it (at most 2
# minutes in a test); its marker holds its pid and goes with it.
wait_for_job() {
    : > "$marker"
    (
        i=0
        while [ "$i" -lt 600 ] && [ -e "$marker" ] && vm_exists; do
            code=$(post "one-job?handle=$JOB_HANDLE")
            [ "$code" = 200 ] && { rm -f "$tokenfile"; break; }
            [ "$code" = 410 ] && break # the process is gone (its VM was destroyed)
            sleep 0.2
            i=$((i + 1))
        done
        rm -f "$marker"
    ) < /dev/null > /dev/null 2>&1 &
    # (The loop may have ended already: then the marker names a pid that is gone.)
    echo "$!" > "$marker.new" && mv "$marker.new" "$marker"
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
take) [ "$(post "take?handle=$JOB_HANDLE&$labels")" = 200 ] && : > "$marker" ;;
connect) [ "$(post "connect?$labels")" = 200 ] && : > "$marker" ;;
die) [ "$(post "connect?$labels&die=seen")" = 200 ] ;;
esac
