#!/usr/bin/env bash
# Runs on the device machine with .device/serve carried: one H3 video
# (364,608 rows, 7.8 GB of FP32 output) streamed from cuda:0 by detlogp_cli
# at several rows_per_chunk, then four videos at once; the CLI reports the
# stream's time apart from its SHA-256 (issue #12's targets: >= 3 GB/s per
# stream at every chunk size, >= 6 GB/s for four).
set -uo pipefail
dir=.device/serve
export LD_LIBRARY_PATH="$PWD/$dir/lib:${LD_LIBRARY_PATH:-}"
rows=${ROWS:-364608}
rm -f /tmp/p.port
"$dir/detlogp_server" --port=0 --port_file=/tmp/p.port --device=cuda:0 > /tmp/p.log 2>&1 &
server=$!
for _ in $(seq 1 900); do [[ -s /tmp/p.port ]] && break; sleep 0.2; done
target=127.0.0.1:$(head -1 /tmp/p.port)
for chunk in ${CHUNKS:-256 512 1024 2048}; do
  echo "-- one stream, rows_per_chunk=$chunk"
  "$dir/detlogp_cli" project --target="$target" --project_rows="$rows" \
    --rows_per_chunk="$chunk" --seed=7 | grep -E "transfer|sha256 seconds"
done
echo "-- four streams at once, rows_per_chunk=512"
pids=()
for i in 1 2 3 4; do
  "$dir/detlogp_cli" project --target="$target" --project_rows="$rows" \
    --rows_per_chunk=512 --seed=$i > /tmp/four_$i.txt &
  pids+=($!)
done
wait "${pids[@]}"
grep -h transfer /tmp/four_*.txt
kill -TERM $server; wait $server
