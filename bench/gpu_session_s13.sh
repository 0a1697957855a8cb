#!/usr/bin/env bash
# H200 calls of session 13 (carry .whl: the pytest wheels for the test parts, .whl/flashmla, .whl/serve):
#   bash bench/gpu_session_s13.sh $OUT probe   the mHC sub-layer entry's launch candidates: CUDA tests, then
#                                              bench/probe_mhc.py --parts sublayer (the first call also timed a fused
#                                              finalize + collapse-norm, since dropped)
#   bash bench/gpu_session_s13.sh $OUT indexer the mix launch rule (tl.dot partials from 16 tokens, a one-warp finalize) and
#                                              the indexer's fp16 products: CUDA tests, probe_mhc, probe_indexer, then the
#                                              bf16 benchmark model at batch 1 (4K, 1M)
#   bash bench/gpu_session_s13.sh $OUT final   CUDA tests of the session's kernels, the graph check, the bf16 benchmark
#                                              model at batch 1 and at 128K x 17 (both modes, the compressed one with its
#                                              kernel timeline)
#   bash bench/gpu_session_s13.sh $OUT step    after the greedy kernel and the shared table fill: CUDA tests, the graph
#                                              check, the bf16 model at batch 1 (with its kernel timelines), the 28-layer
#                                              quantised model at 4K / 1M x 1 / 32
#   bash bench/gpu_session_s13.sh $OUT gemv    the one-row bf16 GEMV (kernels/bf16_gemv.py): its CUDA tests, the probe against
#                                              cuBLAS, the bf16 model at batch 1 (4K, 1M), the 28-layer model at batch 1
#   bash bench/gpu_session_s13.sh $OUT serve   the serving run of issue 14's ITL target, warm-up first, then the offline
#                                              step of the same model and batch
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-probe}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = probe ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_mhc_kernel.py
  tail -n 6 "$OUT/tests.log"
  part 300 mhc python3 bench/probe_mhc.py --parts sublayer --out "$OUT/probe_mhc.json"
  cut -c1-300 "$OUT/mhc.log"
fi
if [ "$WHICH" = indexer ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_mhc_kernel.py tests/test_kernels.py \
    -k "mix or head or indexer or dispatch or expand"
  tail -n 4 "$OUT/tests.log"
  part 120 mhc python3 bench/probe_mhc.py --parts sublayer --tokens 1,17,64 --out "$OUT/probe_mhc.json"
  grep -A 4 "sub-layer\|partials" "$OUT/mhc.log" | cut -c1-240
  part 200 idx python3 bench/probe_indexer.py --out "$OUT/probe_indexer.json"
  grep -v "^  b " "$OUT/idx.log" | cut -c1-240; grep "^  b .*{'products': '[bf16]*'}" "$OUT/idx.log" | cut -c1-200
  flashmla
  bf16_batch1 210 190
fi
if [ "$WHICH" = final ]; then
  part 200 tests python3 -m pytest -q -p no:cacheprovider tests/test_moe_grouped.py tests/test_mhc_kernel.py \
    tests/test_kernels_bw.py tests/test_kernels.py tests/test_static_tables.py
  tail -n 4 "$OUT/tests.log"
  graph_check
  flashmla
  bf16_batch1 190 170
  bf16_128k_x17 230 210 --timeline 3
  grep -A 26 "graph kernels by name" "$OUT/dense.log" | cut -c1-120
fi
if [ "$WHICH" = step ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_greedy.py tests/test_sampling.py \
    tests/test_kernels_bw.py tests/test_static_tables.py tests/test_moe_grouped.py
  tail -n 4 "$OUT/tests.log"
  graph_check
  flashmla
  bf16_batch1 200 180 --timeline 3
  grep -B 2 -A 30 "1M x 1 .*ms/step" "$OUT/step.log" | grep -v "^  *[0-9.]* us  after" | cut -c1-130
  q28 220 200 1,32 5
fi
if [ "$WHICH" = gemv ]; then
  part 100 tests python3 -m pytest -q -p no:cacheprovider tests/test_bf16_gemv.py tests/test_dense_linear.py
  tail -n 3 "$OUT/tests.log"
  part 90 probe python3 bench/probe_gemv_bf16.py --out "$OUT/probe_gemv.json"
  cut -c1-260 "$OUT/probe.log"
  flashmla
  bf16_batch1 170 150
  q28 150 130 1 2
fi
if [ "$WHICH" = serve ]; then
  flashmla
  part 170 serve bash bench/serve_and_bench.sh "$OUT/serve" "1024:8:8:9 1024:128:8:8" --preset flash \
    --json-model-override-args '{"n_routed_experts": 8}' --device cuda --mem-fraction-static 0.55 \
    --max-running-requests 64 --chunked-prefill-size 8192 --context-length 262144
  grep -E "==|ITL|TPOT|TTFT|throughput|completed" "$OUT/serve.log" | cut -c1-200
  part 75 offline python3 bench/bench_long_context.py --modes compressed --contexts 1024 --batches 8 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 8 --no-progress --time-budget 60 \
    --out "$OUT/offline.json"
  grep -E "decode compressed" "$OUT/offline.log" | cut -c1-300
fi
