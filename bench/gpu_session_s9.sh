#!/usr/bin/env bash
# H200 calls of session 9 (carry .whl for pytest):
#   bash bench/gpu_session_s9.sh $OUT spec     issue 18: the CUDA host-sync tests, then bench_speculative.py on
#                                              this commit (verify, draft and kept-pass graphs, batched rollback);
#                                              issues 13 / 14: where the quantised model's batch-1 step goes
#                                              (4 layers, 4K: GPU time by part, top kernels, kernels per layer)
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-spec}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = spec ]; then
  part 120 syncs python3 -m pytest -q -p no:cacheprovider tests/test_host_syncs.py
  tail -n 6 "$OUT/syncs.log"
  part 330 spec python3 bench/bench_speculative.py --time-budget 240 --out "$OUT/spec.json"
  tail -n 45 "$OUT/spec.log"
  part 150 qsplit python3 bench/bench_quant_model.py --layers 4 --contexts 4096 --batches 1 --skip-kernels \
    --prefill-context 8192 --prefill-max-seconds 5 --steps 4 --breakdown 2 --time-budget 140 --out "$OUT/qsplit.json"
  tail -n 60 "$OUT/qsplit.log"
fi
#   bash bench/gpu_session_s9.sh $OUT quant    the head and FP8-stack tests on CUDA; the 4-layer split again;
#                                              the 28-layer quantised model through the Engine (issue 13's table)
if [ "$WHICH" = quant ]; then
  part 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_head.py tests/test_stacked_linears.py \
    tests/test_quant_model.py
  tail -n 8 "$OUT/tests.log"
  part 120 qsplit python3 bench/bench_quant_model.py --layers 4 --contexts 4096 --batches 1 --skip-kernels \
    --prefill-context 8192 --prefill-max-seconds 5 --steps 4 --breakdown 2 --time-budget 110 --out "$OUT/qsplit.json"
  grep -A 40 "^decode" "$OUT/qsplit.log" | head -n 60
  part 330 qfull python3 bench/bench_quant_model.py --gemm-m 1,8192 --moe-tokens 1,64 --kernel-iters 5 --steps 4 \
    --prefill-max-seconds 40 --time-budget 310 --out "$OUT/quant_full.json"
  tail -n 45 "$OUT/qfull.log"
fi
