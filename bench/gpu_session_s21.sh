#!/usr/bin/env bash
# GPU calls of session 21 (carry .whl: the pytest and sgl-flash-mla wheels):
#   bash bench/gpu_session_s21.sh $OUT timeline   the 11-layer model at 4K x 1 with today's defaults and a timeline of
#                                                 three steps, the last replay's kernels in order (which launches a
#                                                 layer still chains, and what each adds to the span)
#   bash bench/gpu_session_s21.sh $OUT early      DSV4_PDL_EARLY (kernels/pdl.py): every PDL kernel lets the next be
#                                                 scheduled before its own wait, and the FP8 row GEMVs ask L2 for
#                                                 their rows before theirs; DSV4_GATE_QUANT (the experts' act-quant
#                                                 in the gate's launch), DSV4_C4_PAIR (a CSA layer's compressors in
#                                                 two launches): CUDA tests with EARLY on, then the 11-layer model at
#                                                 4K x 1 with (EARLY, GATE_QUANT, C4_PAIR, attention) = 000a 011a 111a
#                                                 (a: auto = FlashMLA, t: Triton; EARLY overrides the
#                                                 list), a timeline of the last (18:26 UTC; DSV4_PDL_EARLY measured
#                                                 slower and removed in 062be75: the flag does nothing since)
#   bash bench/gpu_session_s21.sh $OUT next       (not run: for the next machine) the CUDA tests of this session's
#                                                 launch cuts (gate act-quant, paired C4 compressors, the scaled
#                                                 bf16 GEMV's fp32 output), wo_a -> wo_b chained as in the model
#                                                 (probe_fp8_row_gemv.py --chain), the kv store inside norm_pair
#                                                 (DSV4_NORM_PAIR_STORE 0 / 1)
#   bash bench/gpu_session_s21.sh $OUT table      (not run) on an H200 issue 13's whole table (gpu_session_s19.sh h200);
#                                                 elsewhere the 11-layer model at the defaults at 4K / 1M x 1 / 32 with
#                                                 a timeline, and with the Triton attention
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-timeline}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = timeline ]; then
  part 150 q python3 bench/bench_quant_model.py --layers 11 --contexts 4096 --batches 1 --skip-kernels --steps 10 \
    --prefill-max-seconds 3 --time-budget 120 --timeline 3 --out "$OUT/q.json"
  grep "^ *4K\|graph replay\|^per layer" "$OUT/q.log" | head -n 5 | cut -c1-220
  grep -A 60 "span each adds" "$OUT/q.log" | head -n 45 | cut -c1-150
fi
if [ "$WHICH" = early ]; then
  DSV4_PDL_EARLY=1 part 110 tests python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py tests/test_moe_gate.py \
    tests/test_kernels.py -k "pdl or engine or pair"
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.log" | head -n 20
  set -- ${EARLY:-000a 011a 111a}   # DSV4_PDL_EARLY, DSV4_GATE_QUANT, DSV4_C4_PAIR, attention (auto, triton)
  i=0
  for e in "$@"; do
    i=$((i + 1)); tl=""; [ "$i" = "$#" ] && tl="--timeline 3"
    attn=auto; [ "${e:3:1}" = t ] && attn=triton
    DSV4_PDL_EARLY=${e:0:1} DSV4_GATE_QUANT=${e:1:1} DSV4_C4_PAIR=${e:2:1} part 95 "q_$i" python3 bench/bench_quant_model.py --layers 11 \
      --contexts 4096 --batches 1 --skip-kernels --steps 10 --prefill-max-seconds 3 --time-budget 80 $tl \
      --attention-kernel $attn --out "$OUT/q_$i.json"
    echo "DSV4_PDL_EARLY, DSV4_GATE_QUANT, DSV4_C4_PAIR, attention = $e:"; grep "^ *4K\|graph replay\|^per layer" "$OUT/q_$i.log" | head -n 5 | cut -c1-220
  done
  grep -A 60 "span each adds" "$OUT/q_$#.log" | head -n 45 | cut -c1-150
fi
if [ "$WHICH" = next ]; then
  part 170 tests python3 -m pytest -q -p no:cacheprovider tests/test_bf16_gemv.py tests/test_moe_gate.py \
    tests/test_kernels.py tests/test_pdl.py tests/test_side_stream.py tests/test_norm_rope.py \
    -k "cuda or pdl or engine or pair or scaled or side"
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.log" | head -n 20
  part 120 chain python3 bench/probe_fp8_row_gemv.py --chain --out "$OUT/chain.json"
  cat "$OUT/chain.log" | cut -c1-160
  for st in 0 1; do    # the kv store inside norm_pair (DSV4_NORM_PAIR_STORE, off by default until this decides)
    DSV4_NORM_PAIR_STORE=$st part 100 "st_$st" python3 bench/bench_quant_model.py --layers 11 --contexts 4096 \
      --batches 1,32 --skip-kernels --steps 10 --prefill-max-seconds 1 --time-budget 85 --out "$OUT/st_$st.json"
    echo "DSV4_NORM_PAIR_STORE=$st:"; grep "^ *4K\|graph replay\|^per layer" "$OUT/st_$st.log" | head -n 5 | cut -c1-200
  done
fi
if [ "$WHICH" = table ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash bench/gpu_session_s19.sh "$OUT" h200     # issue 13's whole table (~450 s: alone in its call)
elif [ "$WHICH" = table ]; then
  for a in auto triton; do
    tl=""; [ $a = auto ] && tl="--timeline 3"
    part 150 "q_$a" python3 bench/bench_quant_model.py --layers 11 --contexts 4096,1048576 --batches 1,32 --skip-kernels \
      --steps 6 --prefill-max-seconds 3 --time-budget 130 --attention-kernel $a $tl --out "$OUT/q_$a.json"
    echo "attention $a:"; grep -A 8 "^decode" "$OUT/q_$a.log" | head -n 9 | cut -c1-200; grep "^per layer\|43-layer" "$OUT/q_$a.log" | head -n 2
  done
fi
