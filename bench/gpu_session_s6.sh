#!/usr/bin/env bash
# H200 calls of session 6 (carry the wheels: sgl-flash-mla, pytest + pluggy + iniconfig, .whl/serve;
# for the SGLang check also .whl/sglang-cp312-extra in call b and .whl/sglang-cp312 in call c: the two
# folders together are over one call's 64 MiB, so call b unpacks the first into /tmp/sgl and call c,
# right after on the same warm machine, the second):
#   bash bench/gpu_session_s6.sh $OUT a    issue 14: host syncs of a decode step on CUDA, the batch-1
#                                          step at 4K and 1M with its floor, kernels and syncs, decodes
#                                          beside a 128K prefill under the old policy (mixed_chunk_tokens
#                                          0) and the capped one (512); the serving run at 8 x 1K against
#                                          the offline step of the same batch
#   bash bench/gpu_session_s6.sh $OUT b    issue 21: HiSparse with the device-side swap-in; issue 18:
#                                          speculative decoding with verify graphs
#   bash bench/gpu_session_s6.sh $OUT c    issue 22: our methods inside SGLang on its CUDA pools
#   bash bench/gpu_session_s6.sh $OUT cpu  part a's long-context rows at tiny sizes on the CPU (the code path)
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-a}
mkdir -p "$OUT"
source bench/_gpu_session.sh
sgl_unpack() {  # $1: a folder of wheels -> /tmp/sgl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgl "$1"/*.whl \
    && echo "unpacked $1 into /tmp/sgl" || echo "unpacking $1 failed"
}
if [ "$WHICH" = cpu ]; then
  SIZES=(--preset tiny --device cpu --contexts 1024,4096 --breakdown-contexts 1024,4096 --mixed-prefill 2048
         --mixed-decode-context 1024 --mixed-decode-batch 2 --prefill-chunk 1024 --mixed-chunk-tokens 256 --steps 2)
else
  SIZES=(--contexts 4096,1048576 --breakdown-contexts 4096,1048576 --mixed-prefill 131072
         --mixed-decode-context 4096 --mixed-decode-batch 8 --steps 6)
fi
STEP=(python3 bench/bench_long_context.py --modes compressed --batches 1 "${SIZES[@]}"
      --breakdown-max-batch 1 --breakdown-steps 1 --kernel-count --prefill-contexts "" --prefill-long 0
      --mixed-max-seconds 50 --no-progress --time-budget 225 --out "$OUT/step.json")
if [ "$WHICH" = a ] || [ "$WHICH" = cpu ]; then
  part 70 syncs python3 -m pytest -q -rs -p no:cacheprovider tests/test_host_syncs.py
  part 240 step "${STEP[@]}"
  tail -n 4 "$OUT/syncs.log"
  echo "before (docs/PERF.md, session 5, commit 330bdfe, the same rows): compressed 4K x 1 30.39 ms (4.86x floor),"
  echo "  1M x 1 34.68 ms (5.37x); host syncs per decode step 6; 8 x 4K decodes beside a 128K prefill in"
  echo "  8,192-token chunks: TPOT alone 39.19 ms, mean 1,768 / p50 1,543 / max 3,656 ms"
  grep -E "^\| compressed|host syncs per decode step|^## kernels|^compressed, " "$OUT/step.log"
  sed -n '/^## decodes beside a prefill/,$p' "$OUT/step.log"
  [ "$WHICH" = cpu ] && exit 0
  # serving: warm-up case first (compiles, captures), then 8 x 1K with 128 tokens out; the offline
  # step of the same model and batch right after, in the same call
  part 150 serve bash bench/serve_and_bench.sh "$OUT/serve" "1024:8:8:9 1024:128:8:8" --preset flash \
    --json-model-override-args '{"n_routed_experts": 8}' --device cuda --mem-fraction-static 0.55 \
    --max-running-requests 64 --chunked-prefill-size 8192 --context-length 262144
  part 90 offline8 python3 bench/bench_long_context.py --modes compressed --contexts 1024 --batches 8 --steps 8 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --no-progress --time-budget 80 \
    --out "$OUT/offline8.json"
  tail -n 20 "$OUT/serve.log"; grep -E "^\| compressed" "$OUT/offline8.log"
elif [ "$WHICH" = b ]; then
  [ -d .whl/sglang-cp312-extra ] && sgl_unpack .whl/sglang-cp312-extra
  part 40 syncs python3 -m pytest -q -rs -p no:cacheprovider tests/test_host_syncs.py
  part 240 hisparse python3 bench/bench_hisparse.py --time-budget 220 --steps 3 --out "$OUT/hisparse.json"
  part 290 spec python3 bench/bench_speculative.py --out "$OUT/spec.json"
  grep -E "AssertionError:|passed|failed" "$OUT/syncs.log" | tail -3
  tail -n 45 "$OUT/hisparse.log"; tail -n 60 "$OUT/spec.log"
else
  if [ -d .whl/sglang-cp312 ] && [ -d /tmp/sgl ]; then
    sgl_unpack .whl/sglang-cp312
    ( export PYTHONPATH=/tmp/sgl:$PYTHONPATH SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1
      part 120 sglang python3 bench/gpu_sglang_check.py --out "$OUT" )
    tail -n 40 "$OUT/sglang.log"
  else
    echo "SGLang check not run: /tmp/sgl (call b's unpack) is missing, the machine was not the same"
  fi
fi
