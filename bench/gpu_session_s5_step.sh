#!/usr/bin/env bash
# Issue 14 (the decode step at its floor) on one H200, one device call of < 8 minutes:
#   bash bench/gpu_session_s5_step.sh $OUT          the new kernels' tests on the GPU, the engine
#                                                   check against the CPU (tiny preset), then the
#                                                   long-context rows with their byte floors, kernels
#                                                   per layer, host syncs per step, and the TPOT of
#                                                   8 decodes of 4K while a 128K prompt prefills
#   bash bench/gpu_session_s5_step.sh $OUT before   the long-context part only, with the fused
#                                                   norm / RoPE kernel and the stacked linears off
#                                                   (DSV4_NORM_ROPE_KERNEL=0 DSV4_STACK_LINEARS=0):
#                                                   the "before" of the same rows
# (carry .whl as in gpu_session_s4.sh to let "auto" pick FlashMLA; without it the Triton kernel runs.)
# Each part has its own time limit so one that hangs leaves the others their share.
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-after}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
part() { local t=$1 name=$2; shift 2; echo "=== $name (limit ${t}s)"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name rc=$?"; }
LONG=(python3 bench/bench_long_context.py --modes compressed,dense --contexts 4096,131072,1048576 --batches 1,max
      --breakdown-contexts 4096,1048576 --breakdown-max-batch 1 --breakdown-steps 1 --kernel-count
      --prefill-contexts "" --prefill-long 0 --steps 6 --no-progress)
if [ "$WHICH" = before ]; then
  ( export DSV4_NORM_ROPE_KERNEL=0 DSV4_STACK_LINEARS=0
    part 450 long_context_before "${LONG[@]}" --time-budget 430 \
    --mixed-prefill 131072 --mixed-decode-context 4096 --mixed-decode-batch 8 --mixed-max-seconds 60 \
    --out "$OUT/long_context_before.json" )
  tail -n 90 "$OUT/long_context_before.log"
else
  part 60 tests python3 -m pytest -q -x -p no:cacheprovider tests/test_norm_rope.py tests/test_sampling.py \
    tests/test_stacked_linears.py tests/test_floor.py
  part 90 engine_check python3 bench/gpu_engine_check.py --part a --out "$OUT"
  part 300 long_context "${LONG[@]}" --time-budget 285 \
    --mixed-prefill 131072 --mixed-decode-context 4096 --mixed-decode-batch 8 --mixed-max-seconds 60 \
    --out "$OUT/long_context.json"
  tail -n 5 "$OUT/tests.log"
  tail -n 30 "$OUT/engine_check.log"
  tail -n 90 "$OUT/long_context.log"
fi
