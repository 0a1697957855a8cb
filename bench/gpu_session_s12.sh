#!/usr/bin/env bash
# H200 calls of session 12 (carry the pytest wheels of .whl for the test parts):
#   bash bench/gpu_session_s12.sh $OUT fill   the static tables from one kernel (kernels/static_tables.py): its CUDA
#                                             tests, the graph check (graph = static bit for bit), the batch-1 probe
#                                             (with the compressors' projections), the 28-layer quantised model at
#                                             4K and 1M x 1 and 32 (the GPU time before each replay), per layer
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-fill}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = fill ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_static_tables.py tests/test_host_syncs.py \
    tests/test_dense_linear.py tests/test_quant_model.py
  tail -n 6 "$OUT/tests.log"
  part 100 graph python3 bench/gpu_graph_check.py --out "$OUT/graph_check.json"
  tail -n 12 "$OUT/graph.log"
  part 60 probe python3 bench/probe_batch1.py --batches 1 --out "$OUT/probe_batch1.json"
  grep "^compressor\|^gate\|^mhc\|^decode" "$OUT/probe.log" | head -n 20
  part 220 q28 python3 bench/bench_quant_model.py --contexts 4096,1048576 --batches 1,32 --skip-kernels --steps 8 \
    --prefill-max-seconds 5 --prefill-context 8192 --time-budget 200 --out "$OUT/q28.json"
  grep -A 16 "^decode" "$OUT/q28.log"
  grep -A 1 "^per layer" "$OUT/q28.log"; grep "layer decode step\|43-layer" "$OUT/q28.log"
fi
#   bash bench/gpu_session_s12.sh $OUT bf16   the bf16 benchmark model (FlashMLA wheel in .whl/flashmla/): batch 1 at
#                                             4K and 1M (issue 14's 2x), then 128K x 17 compressed and dense (4x)
if [ "$WHICH" = bf16 ]; then
  flashmla
  bf16_batch1 230 210
  bf16_128k_x17 250 230
fi
#   bash bench/gpu_session_s12.sh $OUT where  what the batch-1 step spends at 4K and 1M: the graph's kernels by name
#                                             (28-layer quantised model, --timeline), the compressors' projections
if [ "$WHICH" = where ]; then
  part 60 probe python3 bench/probe_batch1.py --batches "" --out "$OUT/probe_batch1.json"
  grep "^compressor" "$OUT/probe.log"
  part 300 q28 python3 bench/bench_quant_model.py --contexts 4096,1048576 --batches 1 --skip-kernels --steps 6 \
    --prefill-max-seconds 2 --prefill-context 8192 --timeline 4 --time-budget 280 --out "$OUT/q28.json"
  grep -A 3 "^decode" "$OUT/q28.log"
  grep -A 60 "^batch 1 at" "$OUT/q28.log" | grep -v "^ *[0-9.]* us  after" | head -n 110
fi
#   bash bench/gpu_session_s12.sh $OUT topk   the top-k floor in at most 32 programs a row: its CUDA tests, bench_topk
#                                             --quick (the old one-program-per-tile floor beside it), the 1M timeline of
#                                             the 28-layer model, the bf16 benchmark model at batch 1
if [ "$WHICH" = topk ]; then
  part 100 tests python3 -m pytest -q -p no:cacheprovider tests/test_topk.py tests/test_static_tables.py tests/test_host_syncs.py
  tail -n 3 "$OUT/tests.log"
  part 150 topk python3 bench/bench_topk.py --quick --out "$OUT"
  tail -n 30 "$OUT/topk.log"
  part 200 q28 python3 bench/bench_quant_model.py --contexts 1048576,4096 --batches 1 --skip-kernels --steps 6 \
    --prefill-max-seconds 2 --prefill-context 8192 --timeline 4 --time-budget 180 --out "$OUT/q28.json"
  grep -A 3 "^decode" "$OUT/q28.log"
  grep -A 30 "^batch 1 at" "$OUT/q28.log" | grep "at\|floor\|radix\|compact\|indexer\|wall" | head -n 20
  flashmla
  bf16_batch1 120 110
fi
#   bash bench/gpu_session_s12.sh $OUT final  after the mHC launch change (and the top-k floor threshold): CUDA tests,
#                                             the bf16 model at batch 1 and 128K x 17 (both modes), the 28-layer table
if [ "$WHICH" = final ]; then
  part 80 tests python3 -m pytest -q -p no:cacheprovider tests/test_mhc_kernel.py tests/test_topk.py
  tail -n 3 "$OUT/tests.log"
  flashmla
  bf16_batch1 100 90
  bf16_128k_x17 120 110
  part 120 q28 python3 bench/bench_quant_model.py --contexts 4096,1048576 --batches 1,32 --skip-kernels --steps 8 \
    --prefill-max-seconds 2 --prefill-context 8192 --time-budget 95 --out "$OUT/q28.json"
  grep -A 10 "^decode" "$OUT/q28.log"; grep -A 1 "^per layer" "$OUT/q28.log"; grep "43-layer" "$OUT/q28.log"
  part 60 graph python3 bench/gpu_graph_check.py --out "$OUT/graph_check.json"
  tail -n 1 "$OUT/graph.log"
fi
#   bash bench/gpu_session_s12.sh $OUT bf16where  the bf16 benchmark model's graph kernels by name at 4K x 1, 1M x 1 and
#                                                 128K x 17 (--timeline 3)
if [ "$WHICH" = bf16where ]; then
  flashmla
  part 200 where python3 bench/bench_long_context.py --modes compressed --batches 1,17 --contexts 4096,131072,1048576 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 5 --timeline 3 --no-progress \
    --time-budget 190 --out "$OUT/where.json"
  grep -E "decode compressed|^  step timeline|^    busy|^      [ 0-9.]+ us  x" "$OUT/where.log" | cut -c1-200 | head -n 150
fi
#   bash bench/gpu_session_s12.sh $OUT mhc   the mHC kernels' launch shapes at 1..64 tokens (bench/probe_mhc.py)
if [ "$WHICH" = mhc ]; then
  part 150 mhc python3 bench/probe_mhc.py --out "$OUT/probe_mhc.json"
  cat "$OUT/mhc.log" | head -n 80
fi
