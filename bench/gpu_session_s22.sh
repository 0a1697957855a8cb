#!/usr/bin/env bash
# GPU calls of session 22 (carry .whl: the pytest and sgl-flash-mla wheels):
#   bash bench/gpu_session_s22.sh $OUT check   the CUDA tests of sessions 21-22's launch cuts (gate act-quant, paired
#                                              C4 compressors, the scaled bf16 GEMV's fp32 output, the kv store in
#                                              norm_pair, the mHC boundary in one / two launches, the gate's select
#                                              in its scores launch, wo_a's inverse RoPE, with their Engine checks),
#                                              the decode graphs against eager (gpu_graph_check.py), then wo_a ->
#                                              wo_b chained as in the model (probe_fp8_row_gemv.py --chain)
#   bash bench/gpu_session_s22.sh $OUT ab      the 11-layer model at 4K x 1 / 32 for each row of AB (default: off mhc
#                                              gate rope topk on store), a timeline of the last: off = every
#                                              session-22 path off; mhc = DSV4_MHC_FINALIZE_NORM=1
#                                              DSV4_MHC_ONE_LAUNCH_MAX_TOKENS=2; gate = DSV4_GATE_ONE_LAUNCH=1;
#                                              rope = DSV4_WO_A_ROPE=1; topk = DSV4_TOPK_ROWS_ONE_LAUNCH=1; on = all
#                                              of them; store = on + DSV4_NORM_PAIR_STORE=1 (session 21's)
#                                              (7 rows x 130 s: more than one call's 600 s; AB="..." picks rows)
#   bash bench/gpu_session_s22.sh $OUT short   the check's tests, then ab with AB="off on"
#   bash bench/gpu_session_s22.sh $OUT table   gpu_session_s21.sh's table (issue 13's on an H200)
# (written in session 22, when no GPU was lent; session 23 ran `short`, then removed the five paths and
# their flags, which measured no faster (docs/PERF.md): its `ab` rows now all run today's defaults)
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-check}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = check ] || [ "$WHICH" = short ]; then
  part 300 tests python3 -m pytest -q -p no:cacheprovider tests/test_mhc_kernel.py tests/test_bf16_gemv.py \
    tests/test_moe_gate.py tests/test_kernels.py tests/test_norm_rope.py tests/test_fp8_gemv.py tests/test_topk.py \
    -k "cuda or engine or pair or scaled or one_launch or select or rope or rows_kernel_path"
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.log" | head -n 20 | cut -c1-300
fi
if [ "$WHICH" = short ]; then WHICH=ab; AB=${AB:-off on}; AB_LIMIT=${AB_LIMIT:-115}; fi   # ~540 s in all
if [ "$WHICH" = check ]; then
  part 100 graph python3 bench/gpu_graph_check.py --out "$OUT/graph_check.json"; tail -n 2 "$OUT/graph.log"
  part 120 chain python3 bench/probe_fp8_row_gemv.py --chain --out "$OUT/chain.json"
  cut -c1-160 "$OUT/chain.log" | tail -n 40
fi
if [ "$WHICH" = ab ]; then
  row_env() {   # the session-22 flags of an AB row
    local m=0 o=0 g=0 r=0 k=0 st=0
    case $1 in mhc) m=1;; gate) g=1;; rope) r=1;; topk) k=1;; on) m=1 g=1 r=1 k=1;; store) m=1 g=1 r=1 k=1 st=1;; esac
    [ $m = 1 ] && o=2
    echo "DSV4_MHC_FINALIZE_NORM=$m DSV4_MHC_ONE_LAUNCH_MAX_TOKENS=$o DSV4_GATE_ONE_LAUNCH=$g DSV4_WO_A_ROPE=$r" \
      "DSV4_TOPK_ROWS_ONE_LAUNCH=$k DSV4_NORM_PAIR_STORE=$st"
  }
  set -- ${AB:-off mhc gate rope topk on store}
  i=0
  for e in "$@"; do
    i=$((i + 1)); tl=""; [ "$i" = "$#" ] && tl="--timeline 3"
    flags=$(row_env "$e")
    (export $flags; part "${AB_LIMIT:-130}" "ab_$i" python3 bench/bench_quant_model.py --layers 11 --contexts 4096 \
      --batches 1,32 --skip-kernels --steps 10 --prefill-max-seconds 1 --time-budget $(( ${AB_LIMIT:-130} - 20 )) $tl \
      --out "$OUT/ab_$i.json")
    echo "$e ($flags):"
    grep "^ *4K\|graph replay\|^per layer" "$OUT/ab_$i.log" | head -n 6 | cut -c1-200
  done
  grep -A 70 "span each adds" "$OUT/ab_$#.log" | head -n 50 | cut -c1-150
fi
if [ "$WHICH" = table ]; then
  bash bench/gpu_session_s21.sh "$OUT" table
fi
