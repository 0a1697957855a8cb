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
