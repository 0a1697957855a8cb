#!/usr/bin/env bash
# Issue 22 on one GPU: SGLang 0.5.23 from carried wheels, then bench/gpu_sglang_check.py (our methods
# on SGLang's CUDA pools; docs/sglang.md, "Tests and the GPU check").
#   bash bench/gpu_sglang_session.sh $OUT
# One call: first, on the CPU machine,
#   python bench/sglang_check_wheels.py .whl/sglang-cp312 .whl/sglang-cp312-extra --out .whl/sglang-check
# (every wheel of the two folders, SGLang's cut from 37 to 14 MiB: bench/sglang_check_wheels.py), then
# carry .whl/sglang-check (and, for the FlashMLA comparison, the sgl_flash_mla wheel of .whl/) in one
# call. Without that folder: carry .whl/sglang-cp312 and .whl/sglang-cp312-extra, in one call when
# they fit the 64 MiB carry, else in two on the same warm machine (each call unpacks what it carries
# into /tmp/sgl; the check runs as soon as SGLang imports from there). sgl_kernel is not carried: the
# check stands in for it (bench/sglang_stubs.py) and says so.
set -uo pipefail
OUT=${1:?output directory}
mkdir -p "$OUT"
source bench/_gpu_session.sh  # .whl/*.whl (flash_mla, pytest) into /tmp/site; part()
for dir in .whl/sglang-check .whl/sglang-serve .whl/sglang-extra .whl/sglang-cp312-extra .whl/sglang-cp312; do
  [ -d "$dir" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sgl "$dir"/*.whl \
    && echo "unpacked $dir into /tmp/sgl" || echo "unpacking $dir failed"
done
export PYTHONPATH=/tmp/sgl:$PYTHONPATH SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1
if ! python3 -c "import sglang" 2> "$OUT/sglang_import.log"; then
  tail -n 3 "$OUT/sglang_import.log"
  echo "SGLang does not import from /tmp/sgl: carry .whl/sglang-cp312 (and the extras) to this warm machine"
  exit 0
fi
command -v nvcc > /dev/null && echo "nvcc: $(command -v nvcc) (SGLang's JIT kernels may build)" \
  || echo "no nvcc: SGLang's JIT store and compressor will not build (those comparisons SKIP)"
part 420 sglang python3 bench/gpu_sglang_check.py --out "$OUT"
grep -E "^(PASS|FAIL|SKIP|INFO) |^checks:|^stand-in" "$OUT/sglang.log" | cut -c1-400
