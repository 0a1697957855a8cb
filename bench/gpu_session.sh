#!/usr/bin/env bash
# One device call: top-k exactness + timing, the decode-graph check, then the long-context
# benchmark with decode graphs (1M prefill left to its own call: see docs/PERF.md).
#   bash bench/gpu_session.sh $OUT [long-context args...]
set -u
OUT=${1:?usage: gpu_session.sh OUT [bench_long_context args]}; shift
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python3 bench/bench_topk.py --quick --out "$OUT" 2>&1 | tail -45
timeout 200 python3 bench/gpu_graph_check.py --out "$OUT" 2>&1 | tail -8
python3 bench/bench_long_context.py --out "$OUT/long.json" --plot "$OUT/long_context.png" "$@" 2>&1 \
    | grep -v "it/s\]" | tail -150
