#!/usr/bin/env bash
# Throughput sweep: every (configuration, parallel size, batch) point of a config file, one JSON each.
#   examples/sweep/run_sweep.sh [CONFIG] [OUTDIR]
#   (defaults: examples/sweep/configs/medium_qwen3_moe.json, out/sweep/<config name>)
# Resumable: a point whose JSON exists is skipped (delete it to re-measure). A point that fails
# (bad key, batch larger than the KV pool, peer not set up) prints why and the sweep goes on.
# Then: the table (with each point's time over the machine's floor) and the Pareto plot.
set -uo pipefail
cd "$(dirname "$0")/../.."
CONFIG="${1:-examples/sweep/configs/medium_qwen3_moe.json}"
OUT="${2:-out/sweep/$(basename "$CONFIG" .json)}"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
mkdir -p "$OUT/points"

# The floor's rates are measured once per sweep, so every point is compared with the same floor.
[ -f "$OUT/roofline.json" ] || "$PY" -m examples.sweep.roofline --out "$OUT/roofline.json" || exit 1

names="$("$PY" -m examples.sweep.sweep list "$CONFIG")" || exit 2
failed=0
while IFS= read -r name <&3; do
  [ -n "$name" ] || continue
  if [ -f "$OUT/points/$name.json" ]; then
    echo "skip $name (done: $OUT/points/$name.json)"
    continue
  fi
  echo "== $name"
  "$PY" -m examples.sweep.sweep run "$CONFIG" "$name" "$OUT" || { echo "point $name not measured (exit $?); going on"; failed=$((failed + 1)); }
done 3<<< "$names"

# Measured again after the points and merged (best of both): the table's floors use the merged rates.
# SWEEP_REMEASURE=0 skips that (the test suite's tiny sweep does).
[ "${SWEEP_REMEASURE:-1}" = 0 ] || "$PY" -m examples.sweep.roofline --out "$OUT/roofline.json" --merge
"$PY" -m examples.sweep.table "$OUT" | tee "$OUT/table.md"
"$PY" -m examples.sweep.plot_pareto "$OUT/points" --out "$OUT/pareto.png"
echo "$failed point(s) not measured; results in $OUT"
