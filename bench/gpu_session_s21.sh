#!/usr/bin/env bash
# GPU calls of session 21 (carry .whl: the pytest and sgl-flash-mla wheels):
#   bash bench/gpu_session_s21.sh $OUT timeline   the 11-layer model at 4K x 1 with today's defaults and a timeline of
#                                                 three steps, the last replay's kernels in order (which launches a
#                                                 layer still chains, and what each adds to the span)
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-timeline}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = timeline ]; then
  part 150 q python3 bench/bench_quant_model.py --layers 11 --contexts 4096 --batches 1 --skip-kernels --steps 10 \
    --prefill-max-seconds 3 --time-budget 120 --timeline 3 --out "$OUT/q.json"
  grep "^ *4K\|graph replay\|^per layer" "$OUT/q.log" | head -n 5 | cut -c1-220
  grep -A 60 "span each adds" "$OUT/q.log" | head -n 45 | cut -c1-150
fi
