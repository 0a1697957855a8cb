#!/usr/bin/env bash
# GPU calls of session 15 (carry .whl: the pytest wheels for the test parts):
#   bash bench/gpu_session_s15.sh $OUT l2       (ran at commit 73a4a4d + its nullptr fix; the hints were removed after
#                                               it, so this part no longer runs) the packed FP4 experts' L2 prefetch
#                                               hints: probe_fp4_l2.py and the 11-layer model at 4K x 1 with them off / on
#   bash bench/gpu_session_s15.sh $OUT prefill  the FP4 experts at prefill sizes as bf16 grouped GEMMs
#                                               (kernels/fp4_moe_prefill.py): CUDA tests, probe_fp4_prefill.py, the
#                                               quantised model's prefill with DSV4_FP4_PREFILL_MIN_TOKENS 0 and $MIN
#   bash bench/gpu_session_s15.sh $OUT prefill2 the same model's whole 128K prefill after the bench's new two-chunk
#                                               warm-up, the prefill path off (MIN 0) and at its default; ORDER="0_cold
#                                               7168 0" first fills the Triton cache, then compares warm
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-prefill}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = prefill ]; then
  part 120 tests python3 -m pytest -q -p no:cacheprovider tests/test_fp4_moe_prefill.py tests/test_fp4_mma.py \
    tests/test_fp4_moe.py -k "prefill or packed or fused"
  tail -n 3 "$OUT/tests.log"
  part 150 probe python3 bench/probe_fp4_prefill.py
  cat "$OUT/probe.log" | cut -c1-300
  for m in 0 ${MIN:-2048}; do
    DSV4_FP4_PREFILL_MIN_TOKENS=$m part 140 "pf_$m" python3 bench/bench_quant_model.py --contexts 4096 --batches 1 \
      --skip-kernels --steps 3 --prefill-max-seconds 25 --time-budget 120 --out "$OUT/pf_$m.json"
    echo "min tokens $m:"; grep -i "prefill" "$OUT/pf_$m.log" | grep -v "^\[" | head -n 4 | cut -c1-250
  done
fi
if [ "$WHICH" = prefill2 ]; then
  for m in ${ORDER:-0 7168}; do    # (a fresh machine's Triton cache is cold: the first run compiles for the later ones)
    DSV4_FP4_PREFILL_MIN_TOKENS=${m%_*} part 200 "pf_$m" python3 bench/bench_quant_model.py --contexts 4096 --batches 1 \
      --skip-kernels --steps 3 --prefill-max-seconds 40 --time-budget 170 --out "$OUT/pf_$m.json"
    echo "min tokens $m:"; grep "^prefill\|^decode\|^ *4K\|^per layer" "$OUT/pf_$m.log" | head -n 5 | cut -c1-250
  done
fi
