#!/usr/bin/env bash
# H200 calls of session 8 (carry .whl: sgl_flash_mla and, for `sglang`, the three sglang-* folders):
#   bash bench/gpu_session_s8.sh $OUT checks    CUDA tests of this session's work: the FP4 MMA kernels
#                                               (tests/test_fp4_mma.py), HiSparse bit for bit on the GPU,
#                                               the verify attention kernel; then the verify kernel against the one-row kernel
#                                               (bench_kernels --verify) and HiSparse at 128K, both modes
#   bash bench/gpu_session_s8.sh $OUT sglang    issue 22: bench/gpu_sglang_session.sh (our kernels on SGLang's
#                                               CUDA pools, extend-step compression included)
# The FP4 probe and the quantised model ran as single commands (docs/PERF.md, "Session 8").
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-checks}
mkdir -p "$OUT"
if [ "$WHICH" = checks ]; then
  source bench/_gpu_session.sh
  part 240 tests python3 -m pytest -q -p no:cacheprovider tests/test_fp4_mma.py tests/test_verify_attention.py \
    "tests/test_hisparse.py::test_engine_bit_identical_on_cuda"
  tail -n 15 "$OUT/tests.log"
  part 120 verify python3 bench/bench_kernels.py --verify
  tail -n 20 "$OUT/verify.log"
  part 200 hs128k python3 bench/bench_hisparse.py --contexts 131072 --steps 3 --time-budget 180 --out "$OUT/hs128k.json"
  tail -n 8 "$OUT/hs128k.log"
fi
if [ "$WHICH" = sglang ]; then
  bash bench/gpu_sglang_session.sh "$OUT"
fi
