#!/usr/bin/env bash
# GPU calls of session 17 (carry .whl: the pytest wheels for the test parts):
#   bash bench/gpu_session_s17.sh $OUT full   the CUDA tests of the side streams, then the quantised model's whole table
#                                             (bench_quant_model.py: the FP8 products as the model calls them, the MoE
#                                             over every layer with and without its shared expert, decode at 4K / 128K /
#                                             1M, prefill 128K, per layer) with a timeline of three 4K x 1 steps
#                                             (SKIP_TESTS=1: the table alone)
#   bash bench/gpu_session_s17.sh $OUT pdl    programmatic dependent launch: test_pdl.py, the 11-layer model at 4K x 1 with
#                                             DSV4_PDL 0 / 1
#   bash bench/gpu_session_s17.sh $OUT check  the CUDA tests of the kernels PDL reached, gpu_graph_check.py, 4K x 1 and x 32
#                                             with DSV4_PDL 0 / 1
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-full}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = full ]; then
  [ -n "${SKIP_TESTS:-}" ] || part 120 tests python3 -m pytest -q -p no:cacheprovider tests/test_side_stream.py tests/test_fp4_mma.py
  [ -n "${SKIP_TESTS:-}" ] || tail -n 3 "$OUT/tests.log"
  part 480 full python3 bench/bench_quant_model.py --gemm-m 1,8192 --moe-tokens 1,8,64 --kernel-iters 5 --steps 4 \
    --contexts 4096,131072,1048576 --timeline 3 --prefill-max-seconds 40 --time-budget 420 --out "$OUT/full.json"
  cut -c1-260 "$OUT/full.log" | tail -n 220
fi
if [ "$WHICH" = pdl ]; then   # PDL (kernels/pdl.py): the CUDA tests, then the model at 4K x 1 with PDL off / on (PDLS: values of
                              # DSV4_PDL). The 08:10 UTC call ran PDLS="00 11 10 11 00", pairs with DSV4_PDL_WEIGHT_FIRST
                              # (the row GEMV's first weight step loaded before its wait), a variant removed after it.
  part 200 tests python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py tests/test_fp8_gemv.py tests/test_side_stream.py
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.log" | head -n 20
  for s in ${PDLS:-0 1}; do
    DSV4_PDL=${s:0:1} part 170 "q_$s" python3 bench/bench_quant_model.py \
      --contexts 4096 --batches 1 --skip-kernels --steps 6 --prefill-max-seconds 10 --time-budget 130 --out "$OUT/q_$s.json"
    echo "PDL $s:"; grep "^ *4K\|graph replay\|^per layer" "$OUT/q_$s.log" | head -n 4 | cut -c1-250
  done
fi
if [ "$WHICH" = check ]; then  # after PDL reached the batched and bf16 kernels: their CUDA tests, the graph check, PDL off / on
  part 300 tests python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py tests/test_fp8_gemm.py tests/test_fp8_gemv.py \
    tests/test_bf16_gemv.py tests/test_fp4_moe.py tests/test_moe_grouped.py tests/test_side_stream.py tests/test_cuda_graph.py
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
  part 100 graph python3 bench/gpu_graph_check.py --out "$OUT/graph_check.json"; tail -n 1 "$OUT/graph.log"
  for s in ${PDLS:-0 1}; do
    DSV4_PDL=$s part 170 "q_$s" python3 bench/bench_quant_model.py --contexts 4096 --batches 1,32 --skip-kernels --steps 6 \
      --prefill-max-seconds 10 --time-budget 130 --out "$OUT/q_$s.json"
    echo "PDL $s:"; grep "^ *4K\|graph replay\|^per layer" "$OUT/q_$s.log" | head -n 6 | cut -c1-250
  done
fi
