#!/usr/bin/env bash
# The device check: the side-by-side client path (new) vs one client after another
# (old) on the paper's CIFAR-10 rounds, at most 8 minutes on one GPU (H100).
#
#   OUT=/some/dir bash benchmarks/device_check.sh           # on the GPU machine (timeout_s 600)
#   OUT=/tmp/dc PYTHON=.venv/bin/python bash benchmarks/device_check.sh --small   # CPU smoke test
#   LIMIT_SCALE=4 ... --small    # a busy CPU: every part's time limit and budget times 4
#
# Each part has its own time limit and writes PART.txt (and JSON) under $OUT; a part that
# runs out of time or fails does not stop the next one. Every part prints seconds per round
# and compile seconds, and the goals: cifar_dp <= 3 s, cifar_nondp <= 8 s, compile <= 30 s.
# "new" = client_backend "vmap" with dsa_family_draw "shared"; "old" = "map" with
# "per_client" (the program measured before: cifar_dp 7.3-7.6 s, cifar_nondp 12.35 s).
# docs/benchmarks.md ("GPU") explains them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
export PYTHONPATH=.
PY=${PYTHON:-python}
small=()
if [ "${1:-}" = "--small" ]; then
  small=(--small)
fi
scale=${LIMIT_SCALE:-1}
start=$(date +%s)

part() {  # part NAME LIMIT_S COMMAND...
  local name=$1 limit=$(( $2 * scale ))
  shift 2
  echo "== $name (limit ${limit} s, starting at $(( $(date +%s) - start )) s)"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "   exit $? at $(( $(date +%s) - start )) s"
  grep -E '^\||goal|new / old' "$OUT/$name.txt" | tail -n 8
}

# 1. cifar_dp: new (side by side) first, then old on the same card.
part dp 170 "$PY" benchmarks/gpu_round.py "${small[@]}" --only cifar_dp \
  --variants new,old --budget-s $(( 150 * scale )) --json "$OUT/dp.json"
# 2. cifar_nondp: the same.
part nondp 170 "$PY" benchmarks/gpu_round.py "${small[@]}" --only cifar_nondp \
  --variants new,old --budget-s $(( 150 * scale )) --json "$OUT/nondp.json"
# 3. The new path with matrix-product convolutions: side by side, every client has its own
#    weights, so XLA's convolutions become grouped ones (feature_group_count = 5) that cuDNN
#    may run slowly; impl="hybrid" gives batched matrix products instead.
part hybrid_new 110 "$PY" benchmarks/gpu_round.py "${small[@]}" --only cifar_dp,cifar_nondp \
  --impl hybrid --variants new --budget-s $(( 90 * scale )) --json "$OUT/hybrid_new.json"
echo "== done in $(( $(date +%s) - start )) s; results in $OUT"
