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
#   bash bench/gpu_session_s10.sh $OUT fused   the fused shared expert, indexer q, ring writes (and mHC mix) on CUDA:
#                                              their tests, then the 4-layer split with kernel names again
if [ "$WHICH" = fused ]; then
  part 240 tests python3 -m pytest -q -p no:cacheprovider tests/test_fp4_mma.py tests/test_indexer_q.py \
    tests/test_kernels.py tests/test_mhc_kernel.py tests/test_head.py tests/test_stacked_linears.py tests/test_quant_model.py
  tail -n 25 "$OUT/tests.log"
  part 200 qsplit python3 bench/bench_quant_model.py --layers 4 --contexts 4096 --batches 1 --skip-kernels \
    --prefill-context 8192 --prefill-max-seconds 5 --steps 4 --breakdown 2 --time-budget 180 --out "$OUT/qsplit.json"
  grep -B 2 -A 30 "where the step goes" "$OUT/qsplit.log" | grep -v "^ *layer \|^ *attention:\|^ *moe:\|^ *mhc_norms:" | head -n 60
  grep "attention:\|moe:\|mhc_norms:" "$OUT/qsplit.log" | cut -c 1-600
fi
#   bash bench/gpu_session_s10.sh $OUT qfull   the 28-layer quantised model through the Engine (issue 13's table)
if [ "$WHICH" = qfull ]; then
  part 420 qfull python3 bench/bench_quant_model.py --gemm-m 1,8192 --moe-tokens 1,64 --kernel-iters 5 --steps 4 \
    --prefill-max-seconds 40 --time-budget 400 --out "$OUT/quant_full.json"
  tail -n 60 "$OUT/qfull.log"
fi
#   bash bench/gpu_session_s10.sh $OUT gemv    after the M = 1 GEMV rule: the FP8 and fused-expert tests on CUDA, the
#                                              GEMV probe at M = 1, the 28-layer table again
if [ "$WHICH" = gemv ]; then
  part 200 tests python3 -m pytest -q -p no:cacheprovider tests/test_fp4_mma.py tests/test_stacked_linears.py \
    tests/test_quant_model.py tests/test_head.py
  tail -n 4 "$OUT/tests.log"
  part 200 gemv python3 bench/probe_fp8_gemv.py --m 1 --out "$OUT/gemv.json"
  grep "^M=" "$OUT/gemv.log" | cut -c 1-260
  part 300 qfull python3 bench/bench_quant_model.py --gemm-m 1,8192 --moe-tokens 1,64 --kernel-iters 5 --steps 4 \
    --prefill-max-seconds 40 --time-budget 280 --out "$OUT/quant_full.json"
  grep -A 60 "^decode" "$OUT/qfull.log"
fi
