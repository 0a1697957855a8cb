#!/usr/bin/env bash
# The session's last H200 call: the quantised kernels after their follow-up (act-quant check,
# torch blockwise backend, MoE switch sweep), then the long-context benchmark with FlashMLA and
# Triton side by side.   bash bench/gpu_session_s4b.sh $OUT   (carry .whl)
set -uo pipefail
OUT=${1:?output directory}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
date -u
part() { local t=$1 name=$2; shift 2; echo "=== $name (limit ${t}s)"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name rc=$?"; }
part 60 quant_check python3 bench/gpu_quant_check.py --quick
part 190 quant_kernels python3 bench/bench_quant_kernels.py --quick --out "$OUT/quant_kernels.json"
part 310 long_context python3 bench/bench_long_context.py --attention-kernel flashmla,triton --modes compressed \
  --contexts 4096,131072,1048576 --batches 1,32 --prefill-contexts 4096 --prefill-long 0 \
  --breakdown-contexts 1048576 --breakdown-steps 1 --steps 4 --time-budget 290 --no-progress --out "$OUT/long_context.json"
grep -E "PASS|FAIL" "$OUT/quant_check.log" | cut -c1-200 | head -60
tail -n 30 "$OUT/quant_kernels.log"
tail -n 40 "$OUT/long_context.log"
