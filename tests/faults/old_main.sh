#!/usr/bin/env bash
# Run today's fault tests (tests/faults) against the code of an older commit: every test of an issue-13
# item must fail there and pass on the current tree (docs/faults.md has the table).
#
#   tests/faults/old_main.sh [REV [PYTEST ARGS...]]     REV defaults to 4832a04, the parent of the fix
#
# The old tree is extracted with `git archive` into a temporary folder (nothing in this checkout
# changes); the current tests/faults and their helpers are copied into it and run with its src/ first
# on PYTHONPATH, in this checkout's .venv. For a commit before the issue-10 layout (2b3ae80: one
# train_checkpoint.py instead of train/checkpoint.py), module aliases map the new names to the old ones.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
rev=${1:-4832a04}
shift || true
dir=$(mktemp -d "${TMPDIR:-/tmp}/onepass-old-XXXXXX")
git -C "$root" archive "$rev" | tar -x -C "$dir"
cp -r "$root/tests/faults" "$root/tests/fault_helpers.py" "$root/tests/local_server.py" "$root/tests/conftest.py" \
  "$dir/tests/"
plugin=()
if [[ -f "$dir/src/onepass/train_checkpoint.py" ]]; then
  cat > "$dir/tests/old_layout.py" <<'EOF'
"""Aliases from the package layout of issue 10 to the flat one before it (onepass.train.checkpoint -> ...)."""
import importlib
import sys

for new, old in {"onepass.train.checkpoint": "onepass.train_checkpoint", "onepass.train.config": "onepass.train_config",
                 "onepass.train.run.loop": "onepass.train"}.items():
    sys.modules[new] = importlib.import_module(old)
EOF
  plugin=(-p old_layout)
fi
echo "old tree of $rev in $dir"
cd "$dir"
export PYTHONPATH="$dir/src:$dir/tests" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$root/.venv/bin/pytest" -p no:xdist -p no:cacheprovider "${plugin[@]}" -o addopts= --import-mode=importlib \
  -o pythonpath=tests -q -rA --tb=line tests/faults "$@" && rc=0 || rc=$?
[[ -n "${KEEP:-}" ]] || rm -rf "$dir"   # KEEP=1 keeps the old tree to look at
exit "$rc"
