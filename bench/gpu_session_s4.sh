#!/usr/bin/env bash
# One H200 call for this session's new GPU code: the FP8 GEMM / FP4 MoE kernels (issue 13) and
# the FlashMLA backend (issue 23), then the kernel tests' derived bounds on the GPU (issue 12).
#   bash bench/gpu_session_s4.sh $OUT        (carry .whl: sgl-flash-mla + pytest wheels)
# Each part has its own time limit so one that hangs leaves the others their share.
set -uo pipefail
OUT=${1:?output directory}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
date -u; git log -1 --format='commit %h %s' 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
part() { local t=$1 name=$2; shift 2; echo "=== $name (limit ${t}s)"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name rc=$?"; }
part 110 quant_check python3 bench/gpu_quant_check.py --quick
part 170 quant_kernels python3 bench/bench_quant_kernels.py --quick --out "$OUT/quant_kernels.json"
part 190 flashmla python3 bench/gpu_flashmla_check.py --quick --out "$OUT"
part 90 kernel_tests python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_kernels_bw.py
for f in quant_check quant_kernels flashmla kernel_tests; do echo "----- $f (tail)"; tail -n 40 "$OUT/$f.log"; done
