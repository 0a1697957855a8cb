#!/usr/bin/env bash
# H200 calls of session 7 (carry .whl for the pytest parts):
#   bash bench/gpu_session_s7.sh $OUT hisparse   issue 21: one CSA layer's swap-in split into lookup and
#                                                copy (bench/probe_hisparse.py) at 1M x 10, torch lookup and
#                                                the lookup kernel; bench_hisparse at 1M, both modes
#   bash bench/gpu_session_s7.sh $OUT step       issue 14: the batch-1 step at 4K and 1M (the bf16 benchmark
#                                                model, FlashMLA by auto: carry the sgl_flash_mla wheel) with the
#                                                overlap schedule and, same engine, synchronous steps
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-hisparse}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = hisparse ]; then
  part 150 probe1m python3 bench/probe_hisparse.py --batch 10 --context 1048576 --out "$OUT/probe1m.json"
  grep -v "^-\|^Name\|^  *[a-z_:]*  \|^void\|^Self" "$OUT/probe1m.log" | head -40
  part 240 hs python3 bench/bench_hisparse.py --contexts 1048576 --steps 3 --time-budget 220 --out "$OUT/hs.json"
  tail -n 30 "$OUT/hs.log"
fi
if [ "$WHICH" = step ]; then
  part 210 step python3 bench/bench_long_context.py --modes compressed --batches 1 --contexts 4096,1048576 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 8 --overlap-ab --no-progress \
    --time-budget 190 --out "$OUT/step.json"
  grep -E "decode compressed|engine built|attention kernel|overlap schedule" "$OUT/step.log" | cut -c1-400
fi
