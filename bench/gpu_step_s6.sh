#!/usr/bin/env bash
# Issue 14, session 6, one H200 call (<= 6 min):
#   bash bench/gpu_step_s6.sh $OUT        host syncs of a decode step on CUDA (tests/test_host_syncs.py),
#                                         then the batch-1 decode step at 4K and 1M with its floor, kernels
#                                         and host syncs per step, and the decodes-beside-a-128K-prefill TPOT
#                                         under the old policy (mixed_chunk_tokens 0) and the capped one
#                                         (512), with the long prompt's TTFT for each
#   bash bench/gpu_step_s6.sh $OUT cpu    the same parts at tiny sizes on the CPU (the code path)
set -uo pipefail
OUT=${1:?output directory}
WHERE=${2:-gpu}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHERE" = cpu ]; then
  SIZES=(--preset tiny --device cpu --contexts 1024,4096 --breakdown-contexts 1024,4096 --mixed-prefill 2048
         --mixed-decode-context 1024 --mixed-decode-batch 2 --prefill-chunk 1024 --mixed-chunk-tokens 256 --steps 2)
else
  SIZES=(--contexts 4096,1048576 --breakdown-contexts 4096,1048576 --mixed-prefill 131072
         --mixed-decode-context 4096 --mixed-decode-batch 8 --steps 6)
fi
part 80 syncs python3 -m pytest -q -rs -p no:cacheprovider tests/test_host_syncs.py
part 270 step python3 bench/bench_long_context.py --modes compressed --batches 1 "${SIZES[@]}" \
  --breakdown-max-batch 1 --breakdown-steps 1 --kernel-count --prefill-contexts "" --prefill-long 0 \
  --mixed-max-seconds 60 --no-progress --time-budget 255 --out "$OUT/step.json"
tail -n 4 "$OUT/syncs.log"
echo "before (docs/PERF.md, session 5, commit 330bdfe, the same rows): compressed 4K x 1 30.39 ms (4.86x floor),"
echo "  1M x 1 34.68 ms (5.37x); host syncs per decode step 6; 8 x 4K decodes beside a 128K prefill in"
echo "  8,192-token chunks: TPOT alone 39.19 ms, mean 1,768 / p50 1,543 / max 3,656 ms"
grep -E "^\| compressed|host syncs per decode step|^## kernels|^compressed, " "$OUT/step.log"
sed -n '/^## decodes beside a prefill/,$p' "$OUT/step.log"
