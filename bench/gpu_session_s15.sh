#!/usr/bin/env bash
# H200 calls of session 15 (carry .whl: the pytest wheels for the test parts):
#   bash bench/gpu_session_s15.sh $OUT l2    the packed FP4 experts' L2 prefetch hints (kernels/fp4_mma.cu L2_AHEAD,
#                                            NEXT_AT): CUDA tests, bench/probe_fp4_l2.py, then the 28-layer quantised
#                                            model at 4K x 1 with the hints off and with A:N pairs of
#                                            DSV4_FP4_L2_AHEAD:DSV4_FP4_L2_NEXT (default "8:2")
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-l2}
mkdir -p "$OUT"
source bench/_gpu_session.sh
q4k() {  # NAME LIMIT: the 28-layer model at 4K x 1 (per layer and the 43-layer step derived)
  part "$2" "$1" python3 bench/bench_quant_model.py --contexts 4096 --batches 1 --skip-kernels --steps 6 \
    --prefill-max-seconds 3 --prefill-context 8192 --time-budget 90 --out "$OUT/$1.json"
  grep -A 4 "^decode" "$OUT/$1.log" | grep -v "graph replay" | head -n 3
  grep "^per layer" "$OUT/$1.log" | head -n 1
}
if [ "$WHICH" = l2 ]; then
  part 100 tests python3 -m pytest -q -p no:cacheprovider tests/test_fp4_mma.py tests/test_fp8_gemv.py
  tail -n 3 "$OUT/tests.log"
  part 150 probe python3 bench/probe_fp4_l2.py
  cat "$OUT/probe.log" | cut -c1-400
  q4k q_off 120
  for an in ${PAIRS:-8:2}; do
    DSV4_FP4_L2_AHEAD=${an%:*} DSV4_FP4_L2_NEXT=${an#*:} q4k "q_$(echo $an | tr : _)" 120
  done
fi
