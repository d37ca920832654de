#!/usr/bin/env bash
# Runs on the device machine with .device/serve carried: one H3 video
# (364,608 rows, 7.8 GB of FP32 output) streamed from cuda:0 by detlogp_cli
# at every rows_per_chunk from 256 to the maximum (2048), then four videos
# at once (issue #12's targets: >= 3 GB/s per stream at every chunk size, no
# larger chunk slower, >= 6 GB/s for four).
#
# The speed table times the stream alone (--nohash_y: the CLI reads and
# checks every chunk, no SHA-256 consumer); one more run per mode hashes Y
# (transfer and SHA-256 reported apart, as before) so the bits can be
# compared with a CPU server's. The server's RSS is sampled during the
# four-stream run (bounded: the request's X plus <= 64 MiB of chunks per
# stream).
#
# Session 9: one projection can go over several Project calls, each on a
# connection of its own (detlogp_cli --project_streams, default 4;
# LogpClient::ProjectOptions::streams): each chunk size runs with 1 and 4.
# Then, when the bundle has it (build_serve.sh), the transport-only bench
# (tools/bench:projection_stream, instant backend, no GPU) on this host's
# cores with 1, 2 and 4 calls per projection, each setting in a fresh
# process (glibc's thresholds move with a process's history). Sessions 5-6
# measured --heap_retain_mb=0 against the default; not repeated.
#   CHUNKS="256 512 1024 2048"  ROWS=364608  FOUR_CHUNK=512  SERVER_ARGS=...
#   REPEATS=1 (runs of each one-projection setting)  CALLS="1 4"
#   WARMUP_ROUNDS=1 (untimed rounds first)
#   TRANSPORT_BENCH=0 (skip the transport-only bench)
#   FOUR_VIDEOS=0 (skip the hashed projection and the four videos at once)
#   FOUR_TARGET=unix (the four videos over the server's Unix socket)
#   TRANSPORT_UNIX=1 (the transport-only bench also over a Unix socket)
# Session 16: the server also listens on a Unix-domain socket
# (--unix_socket); a size with "u" after its colon (CHUNKS="512 512:u",
# "2048:bu") connects there instead of loopback TCP.
set -uo pipefail
dir=${STREAM_DIR:-.device/serve}
export LD_LIBRARY_PATH="$PWD/$dir/lib:${LD_LIBRARY_PATH:-}"
rows=${ROWS:-364608}
four_chunk=${FOUR_CHUNK:-512}
cli_bin=detlogp_cli
cli() { "$dir/$cli_bin" project --target="$cli_target" --project_rows="$rows" "$@"; }
# Where the server's time went during one command (metrics_delta.py): the
# streams' writing and waiting, and per launch queue, run and copy-out.
scrape() { python3 -c "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$(sed -n 2p /tmp/p.port)/metrics').read().decode())"; }
timed() {
  scrape > /tmp/m_before.txt
  local start=$EPOCHREALTIME
  "$@"
  local end=$EPOCHREALTIME
  scrape > /tmp/m_after.txt
  python3 tools/device/metrics_delta.py /tmp/m_before.txt /tmp/m_after.txt \
    "$(python3 -c "print($end - $start)")" | grep "^projection"
}
rm -f /tmp/p.port
unix_target=unix:/tmp/detlogp_p.sock
"$dir/detlogp_server" --port=0 --port_file=/tmp/p.port --metrics_port=0 --device=cuda:0 \
  --unix_socket=/tmp/detlogp_p.sock \
  ${SERVER_ARGS:-} > /tmp/p.log 2>&1 &
server=$!
for _ in $(seq 1 900); do [[ -s /tmp/p.port ]] && break; sleep 0.2; done
target=127.0.0.1:$(head -1 /tmp/p.port)
cli_target=$target
nproc; grep -m1 "model name" /proc/cpuinfo
cli --rows_per_chunk=512 --nohash_y --seed=1 > /dev/null  # warm-up
# Repeats go round all settings in turn (not one setting's runs back to
# back), so that a slow spell of the host hits every setting alike, in
# ascending order in odd rounds and descending in even ones, so that no size
# always runs last (sessions 11-12 always ran 2048 last; docs/perf.md,
# session 13). WARMUP_ROUNDS (default 1) go round every setting first,
# untimed: the first run of a size pins its chunk buffers and grows the
# VM's and the processes' memory (session 15 measured round 1 slower at
# every size). A size may be listed twice (CHUNKS="... 2048 2048"): the
# two positions' paired ratio is the noise floor of the others. The
# summary (projection_stream_summary.py) gives medians per setting and
# every pair's per-round ratios. A size may name another CLI of the bundle
# (CHUNKS="512 512:b" runs $dir/detlogp_cli_b for the second): an A/B of
# two client builds against one server, paired round by round.
rm -f /tmp/speed_*.txt
chunks=(${CHUNKS:-256 512 1024 2048})
warmup=${WARMUP_ROUNDS:-1}
for rep in $(seq $((1 - warmup)) "${REPEATS:-1}"); do
  positions=$(seq 0 $((${#chunks[@]} - 1)))
  (( rep % 2 )) || positions=$(tac <<< "$positions")
  for pos in $positions; do
    chunk=${chunks[$pos]%%:*}
    cli_bin=detlogp_cli
    cli_target=$target
    suffix=
    [[ ${chunks[$pos]} == *:* ]] && suffix=${chunks[$pos]#*:}
    [[ $suffix == *b* ]] && cli_bin=detlogp_cli_b
    [[ $suffix == *u* ]] && cli_target=$unix_target
    for streams in ${CALLS:-1 4}; do
      if (( rep < 1 )); then
        echo "-- warm-up, rows_per_chunk=$chunk, $streams call(s), $cli_bin"
        cli --rows_per_chunk="$chunk" --project_streams="$streams" --seed=7 --nohash_y |
          grep -E "^transfer"
        continue
      fi
      echo "-- one projection, rows_per_chunk=$chunk, $streams call(s), no hashing (run $rep, $cli_bin, $cli_target)"
      timed cli --rows_per_chunk="$chunk" --project_streams="$streams" --seed=7 --nohash_y |
        grep -E "^transfer|^client|^projection" | tee /tmp/run.txt
      # A failed run leaves "nan", so that the files stay aligned by round.
      speed=$(awk '/^transfer/ { print $5 }' /tmp/run.txt)
      echo "${speed:-nan}" >> "/tmp/speed_${pos}_${streams}.txt"
    done
  done
done
cli_bin=detlogp_cli
cli_target=$target
[[ ${FOUR_TARGET:-tcp} == unix ]] && cli_target=$unix_target
for streams in ${CALLS:-1 4}; do
  python3 tools/device/projection_stream_summary.py --calls="$streams" \
    --chunks="${chunks[*]}" /tmp/speed_%d_"$streams".txt
done
if [[ ${FOUR_VIDEOS:-1} != 0 ]]; then
  echo "-- one projection, rows_per_chunk=$four_chunk, 4 calls, SHA-256 on its own thread (1 GiB backlog)"
  cli --rows_per_chunk="$four_chunk" --seed=7 | grep -E "y_sha256|transfer|sha256 seconds"
  # Four videos at once: one call each (issue #12's four streams), and four
  # calls each (16 connections).
  for mode in "--nohash_y 1" "--hash_y 1" "--nohash_y 4"; do
    read -r hash calls <<< "$mode"
    echo "-- four videos at once, rows_per_chunk=$four_chunk, $calls call(s) each, $hash"
    pids=()
    for i in 1 2 3 4; do
      cli --rows_per_chunk="$four_chunk" --project_streams="$calls" --seed=$i $hash > /tmp/four_$i.txt &
      pids+=($!)
    done
    peak=0
    while kill -0 "${pids[@]}" 2>/dev/null; do
      rss=$(awk '/VmRSS/ {print $2}' /proc/$server/status)
      (( rss > peak )) && peak=$rss
      sleep 0.1
    done
    wait "${pids[@]}"
    grep -h transfer /tmp/four_*.txt
    # Total: four videos over the slowest stream's time (they start together).
    grep -h "^transfer" /tmp/four_*.txt | awk -v r="$rows" \
      '{ if ($3 > m) m = $3 } END { printf "four streams: slowest %.3f s, %.2f GB/s in total\n", m, 4 * r * 5376 * 4 / m / 1e9 }'
    echo "server peak RSS during the four streams: $((peak / 1024)) MiB"
  done
fi
kill -TERM $server; wait $server
if [[ -x "$dir/projection_stream" && ${TRANSPORT_BENCH:-1} != 0 ]]; then
  for chunk in $(tr ' ' '\n' <<< "${chunks[*]%%:*}" | sort -nu); do
    for calls in ${BENCH_CALLS:-1 2 4}; do
      sockets=("")
      [[ ${TRANSPORT_UNIX:-0} != 0 ]] && sockets+=(/tmp/detlogp_bench.sock)
      for socket in "${sockets[@]}"; do
        echo "-- transport-only bench, one projection, rows_per_chunk=$chunk, $calls call(s), ${socket:-loopback TCP}"
        "$dir/projection_stream" --reader=client --rows="$rows" --chunks="$chunk" --streams=0 \
          --repeats=3 --client_streams="$calls" --unix_socket="$socket" | grep -A1 "stream(s)"
      done
    done
  done
  echo "-- transport-only bench, four projections of one call, rows_per_chunk=2048"
  "$dir/projection_stream" --reader=client --rows="$rows" --chunks= --streams=4 \
    --concurrent_chunks=2048 --repeats=3 | grep -A1 "stream(s)"
fi
