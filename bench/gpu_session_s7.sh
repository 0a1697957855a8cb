#!/usr/bin/env bash
# H200 calls of session 7 (carry .whl for the pytest parts):
#   bash bench/gpu_session_s7.sh $OUT hisparse   issue 21: one CSA layer's swap-in split into lookup and
#                                                copy (bench/probe_hisparse.py) at 1M x 10, torch lookup and
#                                                the lookup kernel; bench_hisparse at 1M, both modes
set -uo pipefail
OUT=${1:?output directory}
WHICH=${2:-hisparse}
mkdir -p "$OUT"
source bench/_gpu_session.sh
if [ "$WHICH" = hisparse ]; then
  part 150 probe1m python3 bench/probe_hisparse.py --batch 10 --context 1048576 --out "$OUT/probe1m.json"
  grep -v "^-\|^Name\|^  *[a-z_:]*  \|^void\|^Self" "$OUT/probe1m.log" | head -40
  part 240 hs python3 bench/bench_hisparse.py --contexts 1048576 --steps 3 --time-budget 220 --out "$OUT/hs.json"
  tail -n 30 "$OUT/hs.log"
fi
