#!/usr/bin/env bash
# Serving run: start server.py with the given flags, wait for /health, drive it with
# bench/bench_serving.py for each "input_len:output_len:num_prompts:concurrency" case, stop it.
#   bench/serve_and_bench.sh OUT_DIR "1024:32:16:8 32768:16:4:4" --preset flash --device cuda ...
set -u
out=$1; cases=$2; shift 2
py=${PYTHON:-python3}
port=${PORT:-30000}
mkdir -p "$out"
$py server.py --port "$port" "$@" > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
healthy() { $py -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; }
for _ in $(seq 1 ${READY_TIMEOUT:-300}); do
  healthy && break
  kill -0 $server 2>/dev/null || { echo "server exited:"; tail -20 "$out/server.log"; exit 1; }
  sleep 1
done
healthy || { echo "server not ready"; tail -20 "$out/server.log"; exit 1; }
echo "server ready after ${SECONDS}s"
for c in $cases; do
  IFS=: read -r inlen outlen n conc <<< "$c"
  echo "== input $inlen, output $outlen, $n prompts, concurrency $conc"
  $py bench/bench_serving.py --port "$port" --input-len "$inlen" --output-len "$outlen" --num-prompts "$n" \
      --concurrency "$conc" --range-ratio 1.0 --disable-tqdm --out "$out/serving_${inlen}_${conc}.json" | tail -16
done
