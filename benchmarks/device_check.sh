#!/usr/bin/env bash
# The open device checks of issue 6, in priority order, at most 9 minutes on one GPU.
#
#   OUT=/some/dir bash benchmarks/device_check.sh           # on the GPU machine
#   OUT=/tmp/dc PYTHON=.venv/bin/python bash benchmarks/device_check.sh --small   # CPU smoke test
#
# Each part has its own time limit and writes PART.txt (and JSON) under $OUT; a part that
# runs out of time or fails does not stop the next one. BENCHMARKS.md ("GPU") explains them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
export PYTHONPATH=.
PY=${PYTHON:-python}
small=()
profile_cfg=(--config=cifar_nondp --ops=nondp_gradient,synthetic_update,client_round)
if [ "${1:-}" = "--small" ]; then
  small=(--small)
  profile_cfg=(--config=mnist_dp_ref --ops=synthetic_update)
fi
start=$(date +%s)

part() {  # part NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s, starting at $(( $(date +%s) - start )) s)"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "   exit $? at $(( $(date +%s) - start )) s"
  grep '^|' "$OUT/$name.txt" | tail -n 6
}

# 1. The default cifar_nondp round with equal evaluation chunks (12.35 s with padded chunks).
part nondp_map 150 "$PY" benchmarks/gpu_round.py "${small[@]}" --only cifar_nondp \
  --client-backends map --budget-s 120 --json "$OUT/nondp_map.json"
# 2. vmap with matrix-product convolutions: batched matmuls instead of grouped convolutions.
part hybrid_vmap 240 "$PY" benchmarks/gpu_round.py "${small[@]}" --only cifar_nondp,cifar_dp \
  --impl hybrid --client-backends vmap,map --budget-s 200 --json "$OUT/hybrid_vmap.json"
# 3. Where one client's time goes: traces summarised as text.
rm -rf /tmp/device_check_prof
part profile 150 "$PY" -m benchmarks.bench "${profile_cfg[@]}" --repeats 2 \
  --profile /tmp/device_check_prof
"$PY" -m benchmarks.trace_summary /tmp/device_check_prof --top 25 > "$OUT/trace_summary.txt" 2>&1
tar czf "$OUT/prof.tgz" -C /tmp device_check_prof 2>/dev/null
echo "== done in $(( $(date +%s) - start )) s; results in $OUT"
