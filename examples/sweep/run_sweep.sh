#!/usr/bin/env bash
# Throughput sweep: every (configuration, parallel size, batch) point of a config file, once per round
# (the config's "rounds"; each round runs every engine, so repeats alternate between engines), one JSON each.
#   examples/sweep/run_sweep.sh [CONFIG] [OUTDIR]
#   (defaults: examples/sweep/configs/medium_qwen3_moe.json, out/sweep/<config name>)
# Resumable: a point's round whose JSON exists is skipped (delete it to re-measure). A point that fails
# (bad key, batch larger than the KV pool, peer not set up) prints why, leaves the reason in
# points/NAME-rROUND.failed and the sweep goes on.
# Then: the table (median over rounds, each point's time over the machine's floor, and a "Not measured:"
# list with each reason) and the Pareto plot.
set -uo pipefail
cd "$(dirname "$0")/../.."
CONFIG="${1:-examples/sweep/configs/medium_qwen3_moe.json}"
OUT="${2:-out/sweep/$(basename "$CONFIG" .json)}"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
mkdir -p "$OUT/points"

# The floor's rates are measured once per sweep, so every point is compared with the same floor.
[ -f "$OUT/roofline.json" ] || "$PY" -m examples.sweep.roofline --out "$OUT/roofline.json" || exit 1

# "ROUND NAME" lines; configurations that cannot run (peer missing) go to $OUT/not_measured.json.
runs="$("$PY" -m examples.sweep.sweep list "$CONFIG" "$OUT")" || exit 2
failed=0
while read -r round name <&3; do
  [ -n "$name" ] || continue
  point="$OUT/points/$name-r$round"
  if [ -f "$point.json" ]; then
    echo "skip $name round $round (done: $point.json)"
    continue
  fi
  echo "== round $round: $name"
  "$PY" -m examples.sweep.sweep run "$CONFIG" "$name" "$OUT" "$round"
  rc=$?
  [ $rc = 0 ] && continue
  echo "point $name round $round not measured (exit $rc); going on"
  failed=$((failed + 1))
  # A crash (or a kill) writes no reason of its own: the table still lists the point.
  [ -f "$point.failed" ] || echo "exited with status $rc (see the sweep's log)" > "$point.failed"
done 3<<< "$runs"

# Measured again after the points and merged (best of both): the table's floors use the merged rates.
# SWEEP_REMEASURE=0 skips that, and each point's rates measured right after its run (floor_beside; the test
# suite's tiny sweep does).
[ "${SWEEP_REMEASURE:-1}" = 0 ] || "$PY" -m examples.sweep.roofline --out "$OUT/roofline.json" --merge
"$PY" -m examples.sweep.table "$OUT" | tee "$OUT/table.md"
"$PY" -m examples.sweep.plot_pareto "$OUT/points" --out "$OUT/pareto.png"
echo "$failed point run(s) not measured; results in $OUT"
