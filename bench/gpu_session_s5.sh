#!/usr/bin/env bash
# H200 calls of session 5 (carry the wheels in .whl/: sgl-flash-mla + pytest):
#   bash bench/gpu_session_s5.sh $OUT a   the fused decode kernels' tests and the engine against the
#                                         CPU (issue 14), the long-context rows with byte floors, kernels
#                                         per layer, host syncs, mixed-prefill TPOT (issue 14), the
#                                         prefix cache workloads (issue 17)
#   bash bench/gpu_session_s5.sh $OUT before  part a's long-context rows with the fused norm / RoPE
#                                         kernels and the stacked projections off (the "before" of
#                                         issue 14; not run this session)
#   bash bench/gpu_session_s5.sh $OUT b   HiSparse against the compressed pools (issue 21), the TP/EP
#                                         code path on one rank over NCCL (issue 15), the prefix cache
#                                         again (its first engine ran out of memory in part a)
# (The MoE sweep of issue 13 and the speculative benchmark of issue 18 ran as their own calls:
#  python3 bench/gpu_moe_sweep.py --out $OUT/moe_sweep.json; python3 bench/bench_speculative.py --out $OUT/spec.json.)
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-a}
mkdir -p "$OUT"
source bench/_gpu_session.sh
LONG=(python3 bench/bench_long_context.py --modes compressed,dense --contexts 4096,131072,1048576
      --batches 1,max --breakdown-contexts 4096,1048576 --breakdown-max-batch 1 --breakdown-steps 1 --kernel-count
      --prefill-contexts "" --prefill-long 0 --steps 6 --no-progress --time-budget 255
      --mixed-prefill 131072 --mixed-decode-context 4096 --mixed-decode-batch 8 --mixed-max-seconds 45)
if [ "$WHICH" = before ]; then
  ( export DSV4_NORM_ROPE_KERNEL=0 DSV4_STACK_LINEARS=0
    part 270 long_context_before "${LONG[@]}" --out "$OUT/long_context_before.json" )
  tail -n 80 "$OUT/long_context_before.log"
elif [ "$WHICH" = a ]; then
  part 50 tests python3 -m pytest -q -x -p no:cacheprovider tests/test_norm_rope.py tests/test_sampling.py \
    tests/test_stacked_linears.py tests/test_floor.py
  part 70 engine_check python3 bench/gpu_engine_check.py --part a --out "$OUT"
  part 270 long_context "${LONG[@]}" --out "$OUT/long_context.json"
  part 140 prefix python3 bench/bench_prefix_cache.py --device cuda --preset flash --system-len 32768 --requests 4 \
    --concurrency 1 --chat-system-len 4096 --convs 4 --turns 3 --user-len 512 --new-tokens 32 \
    --out "$OUT/prefix_cache.json"
  tail -n 5 "$OUT/tests.log"; tail -n 25 "$OUT/engine_check.log"; tail -n 80 "$OUT/long_context.log"; tail -n 25 "$OUT/prefix.log"
else
  part 230 hisparse python3 bench/bench_hisparse.py --time-budget 215 --steps 3 --out "$OUT/hisparse.json"
  part 180 tp1 python3 bench/bench_parallel.py --tp-size 1 --nccl-one-rank --time-budget 150 --prefill-max-seconds 30 \
    --out "$OUT/tp1.json"
  part 130 prefix python3 bench/bench_prefix_cache.py --device cuda --preset flash --system-len 32768 --requests 4 \
    --concurrency 1 --chat-system-len 4096 --convs 4 --turns 3 --user-len 512 --new-tokens 32 \
    --out "$OUT/prefix_cache.json"
  tail -n 40 "$OUT/hisparse.log"; tail -n 40 "$OUT/tp1.log"; tail -n 25 "$OUT/prefix.log"
fi
