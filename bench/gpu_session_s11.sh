#!/usr/bin/env bash
# H200 calls of session 11 (carry the pytest wheels of .whl for the test parts):
#   bash bench/gpu_session_s11.sh $OUT probe   the new small-batch kernels' CUDA tests (dense GEMV of the compressors,
#                                              gate scores per SM count, top-k rows in one launch), the batch-1
#                                              launch-shape probe (sparse decode, gate), the 4-layer step's kernels
#                                              by part, the 28-layer model at 4K x 1 and x 32
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-probe}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = probe ]; then
  part 240 tests python3 -m pytest -q -p no:cacheprovider tests/test_dense_linear.py tests/test_moe_gate.py tests/test_topk.py \
    tests/test_kernels.py tests/test_quant_model.py tests/test_stacked_linears.py
  tail -n 6 "$OUT/tests.log"
  part 150 probe python3 bench/probe_batch1.py --out "$OUT/probe_batch1.json"
  grep -v "^  .*failed" "$OUT/probe.log" | head -n 70
  part 150 qsplit python3 bench/bench_quant_model.py --layers 4 --contexts 4096 --batches 1 --skip-kernels \
    --prefill-context 8192 --prefill-max-seconds 5 --steps 4 --breakdown 2 --time-budget 140 --out "$OUT/qsplit.json"
  grep -B 2 -A 30 "where the step goes" "$OUT/qsplit.log" | grep -v "^ *layer \|^ *attention:\|^ *moe:\|^ *mhc_norms:" | head -n 45
  part 200 q28 python3 bench/bench_quant_model.py --contexts 4096 --batches 1,32 --skip-kernels --steps 8 \
    --prefill-max-seconds 5 --prefill-context 8192 --time-budget 190 --out "$OUT/q28.json"
  grep -A 12 "^decode" "$OUT/q28.log"
fi
#   bash bench/gpu_session_s11.sh $OUT final   after the small-batch rule: CUDA tests, the probe at batch 1 (the rule's
#                                              pick against the grid), issue 13's 28-layer table, then (FlashMLA wheel
#                                              carried in .whl/flashmla/) the bf16 benchmark model at 128K x 17,
#                                              compressed and dense (issue 14's 4x target)
if [ "$WHICH" = final ]; then
  part 100 tests python3 -m pytest -q -p no:cacheprovider tests/test_dense_linear.py tests/test_moe_gate.py tests/test_topk.py \
    tests/test_kernels.py tests/test_quant_model.py tests/test_stacked_linears.py tests/test_host_syncs.py
  tail -n 4 "$OUT/tests.log"
  part 80 probe python3 bench/probe_batch1.py --batches 1 --out "$OUT/probe_batch1.json"
  grep -A 2 "^decode\|^gate\|^mhc" "$OUT/probe.log" | head -n 40
  part 80 qsplit python3 bench/bench_quant_model.py --layers 4 --contexts 4096 --batches 1 --skip-kernels \
    --prefill-context 8192 --prefill-max-seconds 5 --steps 4 --breakdown 2 --time-budget 70 --out "$OUT/qsplit.json"
  grep -A 9 "where the step goes\|kernels per decode step" "$OUT/qsplit.log" | grep -v "^ *[0-9.]* us " | head -n 16
  part 140 qfull python3 bench/bench_quant_model.py --gemm-m 1,8192 --moe-tokens 1,64 --kernel-iters 5 --steps 4 \
    --prefill-max-seconds 40 --timeline 6 --time-budget 130 --out "$OUT/quant_full.json"
  grep -A 70 "^decode" "$OUT/qfull.log" | head -n 70
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flashmla/*.whl || echo "flashmla install failed"
  part 200 dense python3 bench/bench_long_context.py --modes compressed,dense --contexts 131072 --batches 17 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 5 --no-progress \
    --time-budget 180 --out "$OUT/dense.json"
  grep -E "decode (compressed|dense)|engine built|attention kernel|compressed / dense|x dense" "$OUT/dense.log" | cut -c1-300
  tail -n 15 "$OUT/dense.log"
fi
#   bash bench/gpu_session_s11.sh $OUT expand  the mHC expand's few-token block (64) and the graph step's GPU time around
#                                              its replay (metadata before it, sampling and idle between replays)
if [ "$WHICH" = expand ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_mhc_kernel.py tests/test_cuda_graph.py \
    tests/test_host_syncs.py
  tail -n 4 "$OUT/tests.log"
  part 170 q28 python3 bench/bench_quant_model.py --contexts 4096,1048576 --batches 1,32 --skip-kernels --steps 8 \
    --prefill-max-seconds 5 --prefill-context 8192 --time-budget 160 --out "$OUT/q28.json"
  grep -A 16 "^decode" "$OUT/q28.log"
  grep "per layer\|43-layer" "$OUT/q28.log"
fi
#   bash bench/gpu_session_s11.sh $OUT bf16b1  the bf16 benchmark model (FlashMLA wheel in .whl/flashmla/) at batch 1,
#                                              4K and 1M (issue 14's 2x target on the long-context benchmark's model)
if [ "$WHICH" = bf16b1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flashmla/*.whl || echo "flashmla install failed"
  part 230 step python3 bench/bench_long_context.py --modes compressed --batches 1 --contexts 4096,1048576 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 8 --no-progress \
    --time-budget 210 --out "$OUT/step.json"
  grep -E "decode compressed|engine built|attention kernel" "$OUT/step.log" | cut -c1-400
fi
#   bash bench/gpu_session_s11.sh $OUT layer   the per-layer cost from the graphs' GPU time (28 against 14 layers)
if [ "$WHICH" = layer ]; then
  part 150 q28 python3 bench/bench_quant_model.py --contexts 4096 --batches 1 --skip-kernels --steps 8 \
    --prefill-max-seconds 3 --prefill-context 8192 --time-budget 120 --out "$OUT/q28.json"
  grep -A 3 "^decode" "$OUT/q28.log"; grep -A 1 "^per layer" "$OUT/q28.log"; grep "layer decode step" "$OUT/q28.log"
fi
