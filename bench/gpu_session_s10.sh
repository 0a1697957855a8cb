#!/usr/bin/env bash
# H200 calls of session 10 (carry the pytest wheels of .whl for the test parts):
#   bash bench/gpu_session_s10.sh $OUT names   issue 14: the quantised 4-layer model's batch-1 step at 4K, GPU time
#                                              by part and every kernel of one layer of each kind, by name
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-names}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = names ]; then
  part 200 qsplit python3 bench/bench_quant_model.py --layers 4 --contexts 4096 --batches 1 --skip-kernels \
    --prefill-context 8192 --prefill-max-seconds 5 --steps 4 --breakdown 2 --time-budget 180 --out "$OUT/qsplit.json"
  grep -A 80 "^decode" "$OUT/qsplit.log" | head -n 120
fi
