#!/usr/bin/env bash
# GPU calls of session 18 (carry .whl: the pytest wheels for the test parts):
#   bash bench/gpu_session_s18.sh $OUT mma   PDL for the NVRTC FP4 MMA kernel (pdl.launch_compiled): the CUDA tests of
#                                            test_pdl.py, test_fp4_mma.py and test_side_stream.py, then the 11-layer
#                                            model's MoE kernels (T = 1 / 8 / 64) and decode at 4K x 1 / x 32 with
#                                            DSV4_PDL 0 / 1, and a timeline of three 4K x 1 steps listing every kernel
#   bash bench/gpu_session_s18.sh $OUT gemv  the compressors' fp32 projections and the indexer's scaled head weights as one
#                                            Triton GEMV launch each (was cuBLAS split-K + reduction (+ a scalar multiply)):
#                                            the CUDA tests, gpu_graph_check.py, then 4K x 1 / x 32 with DSV4_BF16_GEMV_ALL 0 / 1
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-mma}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = mma ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py tests/test_fp4_mma.py tests/test_side_stream.py
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.log" | head -n 20
  for s in ${PDLS:-0 1}; do
    tl=""; [ "$s" = 1 ] && tl="--timeline 3"
    DSV4_PDL=$s part 180 "q_$s" python3 bench/bench_quant_model.py --gemm-m 1 --moe-tokens 1,8,64 --kernel-iters 5 \
      --contexts 4096 --batches 1,32 --steps 6 --prefill-max-seconds 10 --time-budget 160 $tl --out "$OUT/q_$s.json"
    echo "PDL $s:"; grep -i "moe\|^ *4K\|graph replay\|^per layer" "$OUT/q_$s.log" | head -n 16 | cut -c1-250
  done
  grep -A 70 "step timeline" "$OUT/q_1.log" | cut -c1-200
fi
if [ "$WHICH" = gemv ]; then
  DSV4_BF16_GEMV_ALL=1 part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_bf16_gemv.py tests/test_pdl.py tests/test_side_stream.py \
    tests/test_cuda_graph.py tests/test_dense_linear.py
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
  part 100 graph python3 bench/gpu_graph_check.py --out "$OUT/graph_check.json"; tail -n 1 "$OUT/graph.log"
  for s in ${GEMVS:-0 1}; do
    tl=""; [ "$s" = 1 ] && tl="--timeline 3"
    DSV4_BF16_GEMV_ALL=$s part 140 "q_$s" python3 bench/bench_quant_model.py --layers 11 --contexts 4096 --batches 1,32 --skip-kernels \
      --steps 6 --prefill-max-seconds 10 --time-budget 120 $tl --out "$OUT/q_$s.json"
    echo "BF16_GEMV_ALL $s:"; grep "^ *4K\|graph replay\|^per layer" "$OUT/q_$s.log" | head -n 6 | cut -c1-250
  done
  grep -A 50 "step timeline" "$OUT/q_1.log" | cut -c1-200
fi
