#!/usr/bin/env bash
# One device call for the kernels (issue 6): the decode launch-configuration probe on the cases
# FlashMLA was timed on, then gpu_check.py (ceilings, correctness at Flash and Pro shapes, the
# timing sweep with its configuration picks, the compiler report).
#   bash bench/gpu_kernels_session.sh $OUT [gpu_check budget seconds]
set -u
OUT=${1:?usage: gpu_kernels_session.sh OUT [budget_s]}
BUDGET=${2:-330}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python3 bench/probe_decode.py --out "$OUT" 2>&1 | grep -v '^\[PASS\]' | tail -60
timeout $((BUDGET + 90)) python3 bench/gpu_check.py --out "$OUT" --quick --budget-s "$BUDGET" 2>&1 \
    | grep -v '^\[PASS\]' | tail -150
