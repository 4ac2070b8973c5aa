#!/usr/bin/env bash
# Proves the simulation's invariants discriminate: applies each mutation of the README table
# "Deterministic simulation" to the real code, runs the simulation, prints the first seed that
# caught it, and restores the file. Every mutation must be caught; exits non-zero otherwise.
#   bash tests/sim/mutations.sh            # all mutations, SIM_SEEDS (default 3000) each
#   ONLY=no-sweep bash tests/sim/mutations.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export SIM_SEEDS=${SIM_SEEDS:-3000}
missed=0

# mutate NAME FILE OLD NEW: replace the exact text OLD by NEW in FILE, run, restore.
mutate() {
    local name=$1 file=$2 old=$3 new=$4
    if [[ -n ${ONLY:-} && $ONLY != "$name" ]]; then
        return
    fi
    cp "$file" "$file.orig"
    # Restored files are touched: cargo must not keep a binary built from the mutated text.
    trap 'mv -f "'"$file"'.orig" "'"$file"'"; touch "'"$file"'"' EXIT
    OLD=$old NEW=$new python3 - "$file" <<'EOF'
import os, sys
p = sys.argv[1]
s = open(p).read()
old, new = os.environ["OLD"], os.environ["NEW"]
if s.count(old) != 1:
    sys.exit(f"mutation text not found exactly once in {p}: {old!r}")
open(p, "w").write(s.replace(old, new))
EOF
    local out
    out=$(cargo test --release --test sim simulation -- --nocapture 2>&1 || true)
    mv -f "$file.orig" "$file"
    touch "$file"
    trap - EXIT
    local caught
    caught=$(grep -m1 -E '^seed [0-9]+ step [0-9]+: ' <<<"$out" || true)
    if [[ -n $caught ]]; then
        printf '%-28s CAUGHT  %s\n' "$name" "$caught"
    else
        printf '%-28s MISSED  (%s seeds)\n' "$name" "$SIM_SEEDS"
        missed=$((missed + 1))
    fi
}

mutate "gate-ignores-status" src/model.rs \
    '        && *status == RunnerStatus::Offline' \
    ''

mutate "gate-ignores-prefix" src/model.rs \
    '        && name.is_some_and(|n| n.starts_with(prefix))' \
    '        && name.is_some()'

mutate "forget-before-delete-answer" src/cycle.rs \
    '        match self.w.forgejo.delete_runner(id, reason.as_str()) {' \
    '        self.forget(id, now);
        if self.save().is_err() {
            return Some(End::Done);
        }
        match self.w.forgejo.delete_runner(id, reason.as_str()) {'

mutate "forget-post-on-any-error" src/cycle.rs \
    '                if e.is_rejection() {' \
    '                if true {'

mutate "sweep-without-destroy" src/planner.rs \
    '    if !ctx.destroyed_this_run {
        // The destroy happened in an earlier run; only a destroy in this run licenses a sweep.
        // On empty state it is a no-op.
        return Step::Destroy;
    }' \
    ''

mutate "apply-before-intent" src/cycle.rs \
    '        self.report.cycle_id = Some(id.clone());
        if self.save().is_err() {
            return Some(End::Done);
        }' \
    '        self.report.cycle_id = Some(id.clone());'

mutate "no-sweep" src/planner.rs \
    '    if !ctx.swept {
        return Step::Sweep;
    }' \
    ''

mutate "no-cycle-lock" src/app.rs \
    '    match file.try_lock() {' \
    '    match Ok::<(), fs::TryLockError>(()) {'

if ((missed)); then
    echo "$missed mutation(s) not caught" >&2
    exit 1
fi
echo "every mutation was caught"
