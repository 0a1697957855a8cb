#!/usr/bin/env bash
# GPU calls of session 19 (carry .whl: the pytest and sgl-flash-mla wheels):
#   bash bench/gpu_session_s19.sh $OUT ab    the CUDA tests of the one-row bf16 GEMV's fp32 / scaled callers and of
#                                            the fused mHC boundaries, the graph check, then the 11-layer model at
#                                            4K x 1 / x 32 with (DSV4_BF16_GEMV_ALL, DSV4_MHC_FUSED) = 00, 10, 11 (AB
#                                            overrides the list), a timeline of three 4K x 1 steps on the last (its
#                                            13:10 UTC run had the finalize + collapse-norm fusion, since removed)
#   bash bench/gpu_session_s19.sh $OUT ab2   after the first call: the fused mHC boundary as the expand computing the
#                                            next mix's partials alone (the finalize + collapse-norm fusion measured
#                                            slower) and the q_lora norm + kv norm-RoPE in one launch (norm_pair); the
#                                            CUDA tests, the graph check, probe_mhc's boundary part, then the 11-layer
#                                            model with (GEMV_ALL, MHC_FUSED, NORM_PAIR, attention kernel) in AB2
#   bash bench/gpu_session_s19.sh $OUT final the defaults after the A/B (all three on): the CUDA tests of the new kernels
#                                            and PDL's decode equality, then the 11-layer model at 4K / 128K / 1M x 1 / 32
#                                            with FlashMLA (auto), and at 4K / 1M x 1 with the Triton attention
#   bash bench/gpu_session_s19.sh $OUT tests the final call's CUDA tests alone (what the device time left allowed)
#   bash bench/gpu_session_s19.sh $OUT topk  (not run: for the next machine) bench_topk.py --quick with the all-pairs
#                                            ranking of short rows (TopKConfig.rank_all_max, off until this decides)
#                                            beside the radix path, then test_topk.py on CUDA
#   bash bench/gpu_session_s19.sh $OUT h200  (not run: for the next H200) issue 13's whole table as session 14 ran it, now
#                                            with PDL, side streams and this session's launches: as many layers as fit
#                                            beside 24 GiB of KV, kernels against their floors, 4K / 128K / 1M x 1 / 32 / max,
#                                            the 128K prefill, per layer and the 43-layer step (derived), a 4K x 1 timeline
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-ab}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = ab ]; then
  DSV4_BF16_GEMV_ALL=1 part 130 tests python3 -m pytest -q -p no:cacheprovider tests/test_bf16_gemv.py tests/test_pdl.py \
    tests/test_side_stream.py tests/test_mhc_kernel.py -k "cuda or pdl or side or gemv"
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
  DSV4_BF16_GEMV_ALL=1 graph_check
  set -- ${AB:-00 10 11}
  last=${@: -1}
  for ab in "$@"; do
    tl=""; [ "$ab" = "$last" ] && tl="--timeline 3"
    DSV4_BF16_GEMV_ALL=${ab:0:1} DSV4_MHC_FUSED=${ab:1:1} part 125 "q_$ab" python3 bench/bench_quant_model.py --layers 11 \
      --contexts 4096 --batches 1,32 --skip-kernels --steps 6 --prefill-max-seconds 5 --time-budget 105 $tl \
      --out "$OUT/q_$ab.json"
    echo "GEMV_ALL, MHC_FUSED = $ab:"; grep "^ *4K\|graph replay\|^per layer" "$OUT/q_$ab.log" | head -n 6 | cut -c1-250
  done
  grep -A 200 "span each adds" "$OUT/q_$last.log" | head -n 70 | cut -c1-160
fi
if [ "$WHICH" = ab2 ]; then
  DSV4_BF16_GEMV_ALL=1 part 110 tests python3 -m pytest -q -p no:cacheprovider tests/test_bf16_gemv.py tests/test_pdl.py \
    tests/test_mhc_kernel.py tests/test_norm_rope.py -k "cuda or pdl or gemv or norm_pair or norm_rope_matches"
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
  DSV4_BF16_GEMV_ALL=1 graph_check
  part 60 probe python3 bench/probe_mhc.py --parts boundary --tokens 1,4,15 --out "$OUT/probe_mhc.json"
  grep "boundary" "$OUT/probe.log"
  set -- ${AB2:-000a 100a 010a 001a 111t 000a 111a}   # DSV4_BF16_GEMV_ALL, DSV4_MHC_FUSED, DSV4_NORM_PAIR, attention
  i=0
  for ab in "$@"; do
    i=$((i + 1)); tl=""; out=/tmp/q_$i.json; [ "$i" = "$#" ] && tl="--timeline 3" && out=$OUT/q_$i.json
    attn=auto; [ "${ab:3:1}" = t ] && attn=triton
    DSV4_BF16_GEMV_ALL=${ab:0:1} DSV4_MHC_FUSED=${ab:1:1} DSV4_NORM_PAIR=${ab:2:1} part 100 "q_$i" \
      python3 bench/bench_quant_model.py --layers 11 \
      --contexts 4096 --batches 1,32 --skip-kernels --steps 10 --prefill-max-seconds 3 --time-budget 85 \
      --attention-kernel $attn $tl --out "$out"
    echo "GEMV_ALL, MHC_FUSED, NORM_PAIR, attention = $ab:"; grep "^ *4K\|graph replay\|^per layer" "$OUT/q_$i.log" | head -n 5 | cut -c1-200
    [ "$i" = "$#" ] || mv "$OUT/q_$i.log" /tmp/   # the files that come back are few: the last run's keep its log
  done
  grep -A 200 "span each adds" "$OUT/q_$#.log" | head -n 48 | cut -c1-150
fi
if [ "$WHICH" = final ] || [ "$WHICH" = tests ]; then
  part 120 tests python3 -m pytest -q -p no:cacheprovider tests/test_mhc_kernel.py tests/test_norm_rope.py \
    tests/test_pdl.py -k "cuda or norm_pair or norm_rope_matches or decode_with_pdl"
  tail -n 3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20
fi
if [ "$WHICH" = final ]; then
  for attn in auto triton; do
    b=1,32; c=4096,131072,1048576; t=110; [ $attn = triton ] && b=1 && c=4096,1048576 && t=80
    part $((t + 20)) "q_$attn" python3 bench/bench_quant_model.py --layers 11 --contexts $c --batches $b \
      --skip-kernels --steps 6 --prefill-max-seconds 3 --time-budget $t --attention-kernel $attn --out "$OUT/q_$attn.json"
    echo "attention $attn:"; grep -A 8 "^decode" "$OUT/q_$attn.log" | cut -c1-150; grep "^per layer\|43-layer" "$OUT/q_$attn.log" | cut -c1-250
  done
fi
if [ "$WHICH" = h200 ]; then
  part 450 qfull python3 bench/bench_quant_model.py --gemm-m 1,8192 --moe-tokens 1,8,64 --kernel-iters 5 --steps 4 \
    --prefill-max-seconds 40 --timeline 3 --time-budget 410 --out "$OUT/quant_full.json"
  grep -v "^\[\|^  *graph replay" "$OUT/qfull.log" | grep -v "^ \{4,\}[0-9.]* us  x" | tail -n 70 | cut -c1-220
fi
if [ "$WHICH" = topk ]; then
  part 240 topk python3 bench/bench_topk.py --quick --out "$OUT"
  tail -n 30 "$OUT/topk.log" | cut -c1-200
  part 120 tests python3 -m pytest -q -p no:cacheprovider tests/test_topk.py
  tail -n 3 "$OUT/tests.log"
fi
