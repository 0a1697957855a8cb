#!/usr/bin/env bash
# H200 calls of session 14 (carry .whl: the pytest wheels for the test parts, .whl/flashmla):
#   bash bench/gpu_session_s14.sh $OUT rowgemv  the one-row FP8 GEMV (kernels/fp8_gemv.py): CUDA tests, the probe
#                                               against the act-quant + split GEMV it replaces (and wo_a's W8A16 against
#                                               the bf16 GEMV), the 28-layer quantised model at 4K / 1M x 1 / 32
#   bash bench/gpu_session_s14.sh $OUT w8a16    the same after the in-thread sums and wo_a kept FP8 (W8A16: the row GEMV
#                                               at one token, a tensor-core kernel at 2-64 rows)
#   bash bench/gpu_session_s14.sh $OUT rules    the launch rules taken from the w8a16 call (the first call's row kernel
#                                               back), the quick probe, the 28-layer model with its kernel timeline
#   bash bench/gpu_session_s14.sh $OUT split    the row GEMV's K split: tests, the probe's split variants, the 28-layer
#                                               model at batch 1 with DSV4_FP8_ROW_SPLIT_PROGRAMS 0, 1024, 2048 (commit
#                                               eb20898; the split was removed after this call, so the knob is gone)
#   bash bench/gpu_session_s14.sh $OUT full     issue 13's whole table: kernels against their floors, 4K / 128K / 1M x 1 / 32 / max,
#                                               the 128K prefill, per layer and the 43-layer step (derived)
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-rowgemv}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = rowgemv ] || [ "$WHICH" = w8a16 ]; then
  # (the first call also ran tests/test_fp8_gemm.py, which builds CPU tensors: interpreter-only)
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemv.py \
    tests/test_stacked_linears.py tests/test_quant_model.py tests/test_fp4_mma.py
  tail -n 4 "$OUT/tests.log"
  part 300 probe python3 bench/probe_fp8_row_gemv.py --out "$OUT/probe_row.json"
  grep -v "^  " "$OUT/probe.log" | cut -c1-300; grep "^      next" "$OUT/probe.log" | head -n 40 | cut -c1-100
  q28 200 180 1,32 5
fi
if [ "$WHICH" = rules ]; then   # the launch rules from the w8a16 call's probe (the 3-D row GEMV back)
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemv.py \
    tests/test_stacked_linears.py tests/test_quant_model.py tests/test_fp4_mma.py
  tail -n 4 "$OUT/tests.log"
  part 150 probe python3 bench/probe_fp8_row_gemv.py --quick --out "$OUT/probe_row.json"
  grep -v "^  " "$OUT/probe.log" | cut -c1-300
  part 200 q28 python3 bench/bench_quant_model.py --contexts 4096,1048576 --batches 1,32 --skip-kernels --steps 6 \
    --prefill-max-seconds 5 --prefill-context 8192 --time-budget 180 --timeline 3 --out "$OUT/q28.json"
  grep -A 16 "^decode" "$OUT/q28.log" | head -n 20
  grep "^per layer\|43-layer" "$OUT/q28.log" | head -n 2
  grep -B 2 -A 40 "graph kernels by name" "$OUT/q28.log" | head -n 100 | cut -c1-150
fi
if [ "$WHICH" = split ]; then   # the row GEMV's K split (the last program of a row block sums the splits)
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemv.py tests/test_quant_model.py \
    tests/test_fp4_mma.py
  tail -n 3 "$OUT/tests.log"
  part 150 probe python3 bench/probe_fp8_row_gemv.py --quick --out "$OUT/probe_row.json"
  grep -v "^  " "$OUT/probe.log" | grep -v "W8A16 M=" | cut -c1-300; grep "^      next" "$OUT/probe.log" | cut -c1-80
  for p in 0 1024 2048; do
    DSV4_FP8_ROW_SPLIT_PROGRAMS=$p part 120 q28_$p python3 bench/bench_quant_model.py --contexts 4096,1048576 \
      --batches 1 --skip-kernels --steps 6 --prefill-max-seconds 3 --prefill-context 8192 --time-budget 100 \
      --out "$OUT/q28_$p.json"
    echo "split programs $p:"; grep -A 6 "^decode" "$OUT/q28_$p.log" | grep -v "graph replay" | head -n 4
    grep "^per layer" "$OUT/q28_$p.log" | head -n 1
  done
fi
if [ "$WHICH" = full ]; then    # issue 13's table after this session's kernels (the row GEMV, wo_a W8A16; split off)
  part 430 qfull python3 bench/bench_quant_model.py --gemm-m 1,8192 --moe-tokens 1,64 --kernel-iters 5 --steps 4 \
    --prefill-max-seconds 40 --time-budget 390 --out "$OUT/quant_full.json"
  grep -v "^\[\|^  *graph replay" "$OUT/qfull.log" | tail -n 70 | cut -c1-220
fi
