#!/bin/sh
# probe.sh KIND OUT [PATH...]: plays a hostile child of the provisioner — a module's local-exec,
# a provider, the launch command — running as the pool's user, and tries every path to the
# Forgejo token such a process has. What it read goes to OUT (written whole, then renamed), where
# the test looks for the token. Run by the role's end-to-end test (tests/role/module/main.tf, and
# probe-bin/ssh under the default launch command) and by tests/it/secrets.rs.
#
# Tried, in this order:
# - $CREDENTIALS_DIRECTORY and everything under /run/credentials;
# - its own environment and its fd 0 (read when it is a file or /dev/null, never a pipe);
# - each ancestor, from its parent up to the provisioner (comm `ci-ephemeral-pr`): environ,
#   cmdline, mem (every read-write mapping, through /proc/PID/maps), fd/ and the content of every
#   descriptor that is a regular file. An ancestor that /proc does not show (hidepid, i.e.
#   ProtectProc=invisible, hides what we may not inspect) is tried all the same, and ends the
#   walk. Without the provisioner (or a hidden process) above it, no ancestor is inspected;
# - each PATH: a file, or every file below a directory (OUT's directory excepted).
# Each read is kept as its runs of 16 or more letters and digits (a token is one), so that a
# dump of memory stays small. OUT's lines: `TRY <what> ok <n> bytes` or `TRY <what> error
# <message>`, each followed by its runs (indented); `YAMA <ptrace_scope or none>`; `ANCESTOR <pid>
# <comm> uid=<uid> owner=<uid owning /proc/PID/environ: root's when the process is not dumpable,
# proc(5)>` or `ANCESTOR <pid> hidden`; `REACHED <pid>` at the provisioner; last `END tried=<n>`.
set -u
kind=$1
out=$2
shift 2
outdir=$(dirname "$out")
mkdir -p "$outdir"
rep=$out.part
tmp=$out.data
: > "$rep"
tried=0

note() { printf '%s\n' "$*" >> "$rep"; }

# try WHAT CMD...: what CMD prints is what was read (kept even when it fails half-way).
try() {
    what=$1
    shift
    tried=$((tried + 1))
    if "$@" > "$tmp" 2> "$tmp.err"; then
        note "TRY $what ok $(wc -c < "$tmp") bytes"
    else
        note "TRY $what error $(tr '\n' ' ' < "$tmp.err")"
    fi
    tr -c 'A-Za-z0-9' '\n' < "$tmp" | grep -E '^.{16,}$' | sort -u | sed 's/^/    /' >> "$rep"
}

# Every read-write mapping of process $1, as an attacker with its maps would read them.
read_mem() {
    # Opening it is the check (ptrace access); count=0 reads nothing.
    err=$(dd if="/proc/$1/mem" bs=1 count=0 status=none 2>&1 > /dev/null)
    if [ -n "$err" ]; then
        echo "$err" >&2
        return 1
    fi
    maps=$(cat "/proc/$1/maps") || return 1
    printf '%s\n' "$maps" | while read -r range perms _rest; do
        case $perms in rw*) ;; *) continue ;; esac
        s=$((0x${range%-*}))
        e=$((0x${range#*-}))
        [ $((e - s)) -le 268435456 ] || continue
        dd if="/proc/$1/mem" bs=4096 skip=$((s / 4096)) count=$(((e - s) / 4096)) 2> /dev/null || :
    done
}

fd0() {
    target=$(readlink /proc/self/fd/0) || return 1
    case $target in
    /dev/null) head -c 65536 ;;
    *) if [ -f /proc/self/fd/0 ]; then head -c 65536; else echo "not read (not a file): $target"; fi ;;
    esac
}

# Every file below $1 (or $1 itself), OUT's directory excepted.
walk() {
    if [ -f "$1" ] || [ ! -d "$1" ]; then
        try "$1" cat -- "$1"
        return
    fi
    try "$1/" ls -la -- "$1"
    find "$1" -path "$outdir" -prune -o -type f -print > "$out.list" 2> /dev/null || :
    while IFS= read -r f; do
        try "$f" cat -- "$f"
    done < "$out.list"
    rm -f "$out.list"
}

process() {
    try "/proc/$1/environ" cat "/proc/$1/environ"
    try "/proc/$1/cmdline" cat "/proc/$1/cmdline"
    try "/proc/$1/mem" read_mem "$1"
    try "/proc/$1/fd/" ls -l "/proc/$1/fd/"
    for f in "/proc/$1/fd"/*; do
        [ -f "$f" ] || continue
        try "$f ($(readlink "$f"))" head -c 1048576 "$f"
    done
}

ppid_of() {
    stat=$(cat "/proc/$1/stat") || return 1
    # pid (comm) state ppid ...
    set -- ${stat##*) }
    echo "$2"
}

note "PROBE $kind pid=$$ uid=$(id -u)"
# Yama's ptrace_scope 1 or more keeps a process out of its ancestors' mem whatever they are.
note "YAMA $(cat /proc/sys/kernel/yama/ptrace_scope 2> /dev/null || echo none)"
if [ -n "${CREDENTIALS_DIRECTORY:-}" ]; then
    walk "$CREDENTIALS_DIRECTORY"
else
    tried=$((tried + 1))
    note "TRY \$CREDENTIALS_DIRECTORY error not set"
fi
walk /run/credentials
try "own environment" env
try "own fd 0" fd0

# The chain of ancestors up to the provisioner, found by /proc/PID/stat alone (readable by
# anyone) before anything is read: a probe run elsewhere (by hand, or under the recovery helper,
# with no provisioner above it) inspects no ancestor at all.
chain=
p=$PPID
depth=0
while [ "$p" -gt 1 ] && [ "$depth" -lt 30 ]; do
    depth=$((depth + 1))
    chain="$chain $p"
    if [ ! -r "/proc/$p/stat" ]; then
        break # hidden: only the provisioner is ours and not ours to see
    fi
    [ "$(cat "/proc/$p/comm" 2> /dev/null)" != ci-ephemeral-pr ] || break
    p=$(ppid_of "$p") || break
done
if [ "$p" -le 1 ] || [ "$depth" -ge 30 ]; then
    note "NO PROVISIONER among the ancestors; none inspected"
    chain=
fi
for p in $chain; do
    if [ ! -r "/proc/$p/stat" ]; then
        note "ANCESTOR $p hidden"
        process "$p"
        break
    fi
    comm=$(cat "/proc/$p/comm" 2> /dev/null || echo '?')
    uid=$(sed -n 's/^Uid:[[:space:]]*\([0-9]*\).*/\1/p' "/proc/$p/status" 2> /dev/null)
    note "ANCESTOR $p $comm uid=${uid:-?} owner=$(stat -c %u "/proc/$p/environ" 2> /dev/null || echo '?')"
    process "$p"
    if [ "$comm" = ci-ephemeral-pr ]; then
        note "REACHED $p"
    fi
done

for path in "$@"; do
    walk "$path"
done
note "END tried=$tried"
rm -f "$tmp" "$tmp.err"
mv -f "$rep" "$out"
