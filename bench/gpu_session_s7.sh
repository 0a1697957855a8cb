#!/usr/bin/env bash
# H200 calls of session 7 (carry .whl for the pytest parts):
#   bash bench/gpu_session_s7.sh $OUT hisparse   issue 21: one CSA layer's swap-in split into lookup and
#                                                copy (bench/probe_hisparse.py) at 1M x 10 and 128K x 80,
#                                                and the HiSparse engine at batch 7 x 1M (the batch the
#                                                non-HiSparse pools hold) against session 6's compressed row
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-hisparse}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = hisparse ]; then
  part 120 probe1m python3 bench/probe_hisparse.py --batch 10 --context 1048576 --out "$OUT/probe1m.json"
  part 120 probe128k python3 bench/probe_hisparse.py --batch 80 --context 131072 --reps 10 --out "$OUT/probe128k.json"
  cat "$OUT/probe1m.log"; grep -v "^-\|^Name\|^ " "$OUT/probe128k.log" | head -20; grep -A30 "Name" "$OUT/probe128k.log" | head -30
  part 240 hs7 python3 bench/bench_hisparse.py --modes hisparse --contexts 1048576 --max-batch 7 --steps 3 \
    --time-budget 220 --out "$OUT/hs7.json"
  tail -n 30 "$OUT/hs7.log"
fi
