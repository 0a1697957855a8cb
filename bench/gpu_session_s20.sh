#!/usr/bin/env bash
# GPU calls of session 20 (carry .whl: the pytest and sgl-flash-mla wheels):
#   bash bench/gpu_session_s20.sh $OUT probe   the L2 prefetch probe (bench/probe_l2_prefetch.py: does a side-stream
#                                              prefetch during a chain of small launches shorten the GEMV after it),
#                                              session 19's untested CUDA cases, bench_topk --quick (rank-all rows)
#   bash bench/gpu_session_s20.sh $OUT cuda    fp8_row.cu (the one-row FP8 GEMV in CUDA C; its first rule): CUDA tests, the probe's
#                                              grid beside the Triton kernel on Flash's shapes, then the 11-layer model
#                                              at 4K x 1 / x 32 with DSV4_FP8_ROW_CUDA = 0 and 1 (rank-all top-k in both)
#   bash bench/gpu_session_s20.sh $OUT cuda2   after the probe: fp8_row.cu where it won (ungrouped, K <= 4,096) with the
#                                              probe's launch shapes, on by default: the CUDA tests, then the model A/B
#   bash bench/gpu_session_s20.sh $OUT h200    issue 13's whole table (gpu_session_s19.sh h200)
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-probe}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = probe ]; then
  part 150 l2 python3 bench/probe_l2_prefetch.py --out "$OUT/l2.json"
  cat "$OUT/l2.log" | cut -c1-250
  part 120 tests python3 -m pytest -q -p no:cacheprovider tests/test_mhc_kernel.py tests/test_norm_rope.py \
    tests/test_pdl.py tests/test_topk.py -k "cuda or norm_pair or norm_rope_matches or decode_with_pdl or rank_all"
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
  part 200 topk python3 bench/bench_topk.py --quick --out "$OUT"
  tail -n 30 "$OUT/topk.log" | cut -c1-200
fi
if [ "$WHICH" = cuda ] || [ "$WHICH" = cuda2 ]; then
  DSV4_FP8_ROW_CUDA=1 part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemv.py tests/test_pdl.py -k "cuda or pdl"
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.log" | head -n 20
  if [ "$WHICH" = cuda ]; then
    part 200 probe python3 bench/probe_fp8_row_gemv.py --quick --cuda --skip-w8a16 --out "$OUT/probe_row.json"
    grep -v "^      next" "$OUT/probe.log" | cut -c1-330
  fi
  for c in ${CU:-0 1}; do
    DSV4_FP8_ROW_CUDA=$c part 100 "q_$c" python3 bench/bench_quant_model.py --layers 11 --contexts 4096 --batches 1,32 \
      --skip-kernels --steps 10 --prefill-max-seconds 3 --time-budget 85 --out "$OUT/q_$c.json"
    echo "DSV4_FP8_ROW_CUDA=$c:"; grep "^ *4K\|graph replay\|^per layer" "$OUT/q_$c.log" | head -n 5 | cut -c1-220
  done
fi
if [ "$WHICH" = h200 ]; then
  bash bench/gpu_session_s19.sh "$OUT" h200
fi
