#!/usr/bin/env bash
# H200 calls of session 13 (carry the pytest wheels of .whl for the test parts):
#   bash bench/gpu_session_s13.sh $OUT probe   the fused mHC sub-layer entry (kernels/mhc.py mhc_mix_collapse_norm) and the
#                                              tl.dot partials: their CUDA tests, then bench/probe_mhc.py --parts sublayer
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-probe}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = probe ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_mhc_kernel.py
  tail -n 6 "$OUT/tests.log"
  part 300 mhc python3 bench/probe_mhc.py --parts sublayer --out "$OUT/probe_mhc.json"
  cat "$OUT/mhc.log" | cut -c1-300
fi
#   bash bench/gpu_session_s13.sh $OUT indexer the mix launch rule (tl.dot partials from 16 tokens, a one-warp finalize) and
#                                              the indexer's fp16 products: CUDA tests, probe_mhc, probe_indexer, then the
#                                              bf16 benchmark model at batch 1 (4K, 1M) with the fp16 products on and off
if [ "$WHICH" = indexer ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_mhc_kernel.py tests/test_kernels.py -k "mix or head or indexer or dispatch or expand"
  tail -n 4 "$OUT/tests.log"
  part 120 mhc python3 bench/probe_mhc.py --parts sublayer --tokens 1,17,64 --out "$OUT/probe_mhc.json"
  grep -A 4 "sub-layer\|partials" "$OUT/mhc.log" | cut -c1-240
  part 200 idx python3 bench/probe_indexer.py --out "$OUT/probe_indexer.json"
  grep -v "^  b " "$OUT/idx.log" | cut -c1-240; grep "^  b .*{}\|products': 'f16'}" "$OUT/idx.log" | cut -c1-200
fi
if [ "$WHICH" = indexer ]; then
  flashmla() { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flashmla/*.whl \
    || echo "flashmla install failed"; }
  flashmla
  part 210 step python3 bench/bench_long_context.py --modes compressed --batches 1 --contexts 4096,1048576 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 8 --no-progress \
    --time-budget 190 --out "$OUT/step.json"
  grep -E "decode compressed|target <= 2x" "$OUT/step.log" | cut -c1-400
fi
#   bash bench/gpu_session_s13.sh $OUT final   CUDA tests of this session's kernels, the graph check, the bf16 benchmark
#                                              model at batch 1 and 128K x 17 (both modes, the compressed one with its
#                                              kernel timeline), the 28-layer quantised model at 4K / 1M x 1 / 32
if [ "$WHICH" = final ]; then
  part 200 tests python3 -m pytest -q -p no:cacheprovider tests/test_moe_grouped.py tests/test_mhc_kernel.py tests/test_kernels_bw.py \
    tests/test_kernels.py tests/test_static_tables.py
  tail -n 4 "$OUT/tests.log"
  part 100 graph python3 bench/gpu_graph_check.py --out "$OUT/graph_check.json"
  tail -n 3 "$OUT/graph.log"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flashmla/*.whl || echo "flashmla install failed"
  part 190 step python3 bench/bench_long_context.py --modes compressed --batches 1 --contexts 4096,1048576 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 8 --no-progress \
    --time-budget 170 --out "$OUT/step.json"
  grep -E "decode compressed|target <= 2x" "$OUT/step.log" | cut -c1-400
  part 230 dense python3 bench/bench_long_context.py --modes compressed,dense --contexts 131072 --batches 17 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 5 --timeline 3 --no-progress \
    --time-budget 210 --out "$OUT/dense.json"
  grep -E "decode (compressed|dense)|compressed / dense|x dense" "$OUT/dense.log" | cut -c1-400
  grep -A 26 "graph kernels by name" "$OUT/dense.log" | cut -c1-120
fi
#   (final also runs tests/test_kernels_bw.py: the compressor kernels' no-work programs for masked events)
#   bash bench/gpu_session_s13.sh $OUT step    after the greedy kernel, the compressors' no-work programs and the shared table
#                                              fill: CUDA tests, the graph check, the bf16 model at batch 1 (1M with its
#                                              kernel timeline), then the 28-layer quantised model at 4K / 1M x 1 / 32
if [ "$WHICH" = step ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_greedy.py tests/test_sampling.py tests/test_kernels_bw.py \
    tests/test_static_tables.py tests/test_moe_grouped.py
  tail -n 4 "$OUT/tests.log"
  part 100 graph python3 bench/gpu_graph_check.py --out "$OUT/graph_check.json"
  tail -n 1 "$OUT/graph.log"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flashmla/*.whl || echo "flashmla install failed"
  part 200 step python3 bench/bench_long_context.py --modes compressed --batches 1 --contexts 4096,1048576 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 8 --timeline 3 --no-progress \
    --time-budget 180 --out "$OUT/step.json"
  grep -E "decode compressed|target <= 2x" "$OUT/step.log" | cut -c1-400
  grep -B 2 -A 30 "1M x 1 .*ms/step" "$OUT/step.log" | grep -v "^  *[0-9.]* us  after" | cut -c1-130
  part 220 q28 python3 bench/bench_quant_model.py --contexts 4096,1048576 --batches 1,32 --skip-kernels --steps 8 \
    --prefill-max-seconds 5 --prefill-context 8192 --time-budget 200 --out "$OUT/q28.json"
  grep -A 16 "^decode" "$OUT/q28.log" | head -n 20
  grep -A 1 "^per layer" "$OUT/q28.log"; grep "layer decode step\|43-layer" "$OUT/q28.log"
fi
#   bash bench/gpu_session_s13.sh $OUT gemv    the one-row bf16 GEMV (kernels/bf16_gemv.py): its CUDA tests, the probe against
#                                              cuBLAS, the bf16 model at batch 1 (4K, 1M), the 28-layer model at batch 1
if [ "$WHICH" = gemv ]; then
  part 100 tests python3 -m pytest -q -p no:cacheprovider tests/test_bf16_gemv.py tests/test_dense_linear.py
  tail -n 3 "$OUT/tests.log"
  part 90 probe python3 bench/probe_gemv_bf16.py --out "$OUT/probe_gemv.json"
  cat "$OUT/probe.log" | cut -c1-260
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flashmla/*.whl || echo "flashmla install failed"
  part 170 step python3 bench/bench_long_context.py --modes compressed --batches 1 --contexts 4096,1048576 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 8 --no-progress \
    --time-budget 150 --out "$OUT/step.json"
  grep -E "decode compressed|target <= 2x" "$OUT/step.log" | cut -c1-400
  part 150 q28 python3 bench/bench_quant_model.py --contexts 4096,1048576 --batches 1 --skip-kernels --steps 8 \
    --prefill-max-seconds 2 --prefill-context 8192 --time-budget 130 --out "$OUT/q28.json"
  grep -A 6 "^decode" "$OUT/q28.log" | head -n 8
  grep "^per layer\|43-layer" "$OUT/q28.log" | head -n 2
fi
#   bash bench/gpu_session_s13.sh $OUT serve   (carry .whl with .whl/serve) the serving run of issue 14's ITL target, warm-up
#                                              first, then the offline step of the same model and batch
if [ "$WHICH" = serve ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flashmla/*.whl || echo "flashmla install failed"
  part 170 serve bash bench/serve_and_bench.sh "$OUT/serve" "1024:8:8:9 1024:128:8:8" --preset flash \
    --json-model-override-args '{"n_routed_experts": 8}' --device cuda --mem-fraction-static 0.55 \
    --max-running-requests 64 --chunked-prefill-size 8192 --context-length 262144
  grep -E "==|ITL|TPOT|TTFT|throughput|completed" "$OUT/serve.log" | cut -c1-200
  part 75 offline python3 bench/bench_long_context.py --modes compressed --contexts 1024 --batches 8 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 8 --no-progress --time-budget 60 \
    --out "$OUT/offline.json"
  grep -E "decode compressed" "$OUT/offline.log" | cut -c1-300
fi
