#!/usr/bin/env bash
# GPU calls of session 16 (carry .whl: the pytest wheels for the test parts):
#   bash bench/gpu_session_s16.sh $OUT moe    the decode MoE at 1-8 tokens: the CUDA tests of test_fp4_mma.py and
#                                             test_side_stream.py, the read floor and the shared expert on a second
#                                             stream (probe_moe_overlap.py), an ncu profile of its T = 1 kernels
#   bash bench/gpu_session_s16.sh $OUT model  the 11-layer quantised model at 4K x 1 with the side streams (SIDE="00 10 11":
#                                             DSV4_SHARED_EXPERT_STREAM and DSV4_COMPRESSOR_STREAM, each 0 / 1)
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-moe}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = moe ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_fp4_mma.py tests/test_side_stream.py
  tail -n 3 "$OUT/tests.log"
  part 150 probe python3 bench/probe_moe_overlap.py
  cut -c1-330 "$OUT/probe.log"
  part 150 ncu ncu --clock-control none -k regex:"fp4_mma|_read_words|_row_gemv" --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats python3 bench/probe_moe_overlap.py --profile
  grep -E "fp4_mma_gemv|_read_words|_row_gemv|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Waves Per SM|Warp Cycles Per Issued|No Eligible|Theoretical Occupancy|Block Limit" \
    "$OUT/ncu.log" | head -n 120
fi
if [ "$WHICH" = model ]; then
  for s in ${SIDE:-00 10 11}; do    # DSV4_SHARED_EXPERT_STREAM, DSV4_COMPRESSOR_STREAM
    DSV4_SHARED_EXPERT_STREAM=${s:0:1} DSV4_COMPRESSOR_STREAM=${s:1:1} part 170 "q_$s" python3 bench/bench_quant_model.py \
      --contexts 4096 --batches 1 --skip-kernels --steps 6 --prefill-max-seconds 10 --time-budget 130 --out "$OUT/q_$s.json"
    echo "side streams (shared, compressor) $s:"; grep "^decode\|^ *4K\|^per layer" "$OUT/q_$s.log" | head -n 5 | cut -c1-250
  done
fi
