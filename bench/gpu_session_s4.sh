#!/usr/bin/env bash
# H200 calls of session 4 (carry .whl: sgl-flash-mla + pytest wheels):
#   bash bench/gpu_session_s4.sh $OUT first      the FP8 GEMM / FP4 MoE kernels (issue 13), the
#                                                FlashMLA backend (issue 23), the kernel tests'
#                                                derived bounds on the GPU (issue 12)
#   bash bench/gpu_session_s4.sh $OUT followup   the quantised kernels after their follow-up,
#                                                then the long-context run, FlashMLA beside Triton
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-first}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = first ]; then
  part 110 quant_check python3 bench/gpu_quant_check.py --quick
  part 170 quant_kernels python3 bench/bench_quant_kernels.py --quick --out "$OUT/quant_kernels.json"
  part 190 flashmla python3 bench/gpu_flashmla_check.py --quick --out "$OUT"
  part 90 kernel_tests python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_kernels_bw.py
  for f in quant_check quant_kernels flashmla kernel_tests; do echo "----- $f (tail)"; tail -n 40 "$OUT/$f.log"; done
else
  part 60 quant_check python3 bench/gpu_quant_check.py --quick
  part 190 quant_kernels python3 bench/bench_quant_kernels.py --quick --out "$OUT/quant_kernels.json"
  part 310 long_context python3 bench/bench_long_context.py --attention-kernel flashmla,triton --modes compressed \
    --contexts 4096,131072,1048576 --batches 1,32 --prefill-contexts 4096 --prefill-long 0 \
    --breakdown-contexts 1048576 --breakdown-steps 1 --steps 4 --time-budget 290 --no-progress --out "$OUT/long_context.json"
  grep -E "PASS|FAIL" "$OUT/quant_check.log" | cut -c1-200 | head -60
  tail -n 30 "$OUT/quant_kernels.log"
  tail -n 40 "$OUT/long_context.log"
fi
