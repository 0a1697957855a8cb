#!/usr/bin/env bash
# GPU calls for the session after 23 (carry .whl: the pytest and sgl-flash-mla wheels):
#   bash bench/gpu_session_s23.sh $OUT next    (~500 s) gpu_session_s21.sh's timeline (the 11-layer model at 4K x 1
#                                              with today's defaults, wo_b on fp8_row.cu, the last replay's kernels
#                                              in order); then the kv store inside norm_pair (DSV4_NORM_PAIR_STORE, off
#                                              since session 21 and never run on a GPU): its CUDA tests, then 0 / 1 / 0 / 1
#                                              alternated at 4K x 1 in fresh processes
#   bash bench/gpu_session_s23.sh $OUT tune    (~450 s) bench/tune_in_model.py: the 11-layer model's one-row
#                                              FP8 products each under several launch shapes (fp8_row.cu and Triton)
#                                              and the FP4 MoE under several K splits,
#                                              captured in the model and replayed in alternated rounds at 4K x 1
#   bash bench/gpu_session_s23.sh $OUT table   issue 13's table (gpu_session_s21.sh table: on an H200 the whole table,
#                                              elsewhere the 11-layer model with FlashMLA and with the Triton attention)
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-next}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = next ]; then
  bash bench/gpu_session_s21.sh "$OUT" timeline
  part 120 tests python3 -m pytest -q -p no:cacheprovider tests/test_norm_rope.py tests/test_triton_backend.py \
    -k "store or pair"
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 10
  i=0
  for st in 0 1 0 1; do
    i=$((i + 1))
    DSV4_NORM_PAIR_STORE=$st part 70 "st_$i" python3 bench/bench_quant_model.py --layers 11 --contexts 4096 \
      --batches 1 --skip-kernels --steps 8 --prefill-max-seconds 1 --time-budget 55 --out "$OUT/st_$i.json"
    echo "DSV4_NORM_PAIR_STORE=$st:"; grep "graph replay\|^per layer" "$OUT/st_$i.log" | head -n 2 | cut -c1-160
  done
fi
if [ "$WHICH" = tune ]; then
  part 540 tune python3 bench/tune_in_model.py --layers 11 --context 4096 --rounds 5 --steps 6 \
    --capture-seconds 330 --out "$OUT/tune.json"
  grep -v "^\[" "$OUT/tune.log" | cut -c1-160 | tail -n 70
fi
if [ "$WHICH" = table ]; then
  bash bench/gpu_session_s21.sh "$OUT" table
fi
