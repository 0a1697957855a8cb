# Sourced by the bench/gpu_session_*.sh scripts: installs the wheels carried in .whl/ and .whl/serve/ (if any),
# prints the machine, and defines `part LIMIT NAME CMD...`, which runs CMD under its own time
# limit with its output in $OUT/NAME.log (so one part that hangs leaves the others their share).
# (.whl/serve/: FastAPI, uvicorn, pydantic and the tokenizer packages, for serving runs)
# .whl/ is git-ignored; `bench/device_wheels.sh [DIR]` rebuilds it (and the .whl/sglang-* folders of
# bench/gpu_sglang_session.sh) with pip download of cp312 linux wheels at the venv's versions, skipping
# wheels already there, and fails if one distribution would sit in both .whl/ and .whl/serve/.
wheels=$(ls .whl/*.whl .whl/serve/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    || echo "wheel install failed"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
part() { local t=$1 name=$2; shift 2; echo "=== $name (limit ${t}s)"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name rc=$?"; }
# The bf16 benchmark model (43 Flash-shaped layers, FlashMLA: its wheel is carried in .whl/flashmla/).
flashmla() { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flashmla/*.whl \
  || echo "flashmla install failed"; }
bf16_batch1() {    # LIMIT BUDGET [ARGS]: batch 1 at 4K and 1M (issue 14's 2x)
  local limit=$1 budget=$2; shift 2
  part "$limit" step python3 bench/bench_long_context.py --modes compressed --batches 1 --contexts 4096,1048576 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 8 --no-progress \
    --time-budget "$budget" --out "$OUT/step.json" "$@"
  grep -E "decode compressed|target <= 2x" "$OUT/step.log" | cut -c1-400
}
bf16_128k_x17() {  # LIMIT BUDGET [ARGS]: 128K x 17, compressed and dense (issue 14's 4x)
  local limit=$1 budget=$2; shift 2
  part "$limit" dense python3 bench/bench_long_context.py --modes compressed,dense --contexts 131072 --batches 17 \
    --breakdown-contexts "" --prefill-contexts "" --prefill-long 0 --steps 5 --no-progress \
    --time-budget "$budget" --out "$OUT/dense.json" "$@"
  grep -E "decode (compressed|dense)|compressed / dense|x dense" "$OUT/dense.log" | cut -c1-400
}
graph_check() {  # the decode graphs bit for bit against the static and eager steps
  part 100 graph python3 bench/gpu_graph_check.py --out "$OUT/graph_check.json"; tail -n 1 "$OUT/graph.log"; }
q28() {            # LIMIT BUDGET BATCHES PREFILL_SECONDS: the 28-layer quantised model at 4K and 1M
  part "$1" q28 python3 bench/bench_quant_model.py --contexts 4096,1048576 --batches "$3" --skip-kernels --steps 8 \
    --prefill-max-seconds "$4" --prefill-context 8192 --time-budget "$2" --out "$OUT/q28.json"
  grep -A 16 "^decode" "$OUT/q28.log" | head -n 20
  grep "^per layer\|43-layer" "$OUT/q28.log" | head -n 2
}
