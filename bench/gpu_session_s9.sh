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
