#!/usr/bin/env python3
"""Where a load phase's time went, from two scrapes of the server's metrics.

  metrics_delta.py BEFORE AFTER SECONDS

prints, for the batches run between the scrapes: their number, rows and
requests per batch, the mean queue delay, gather and compute (backend Run)
per batch, and the batch cycle (SECONDS / batches). With one batch in flight,
cycle - gather - compute is the time the device slot sat between batches
(thread hand-over, answering calls).

For projection streams: streams and chunks, the streams' time with a write
in flight and with nothing to write (next chunk not computed), and per
launch the rows, the oldest chunk's queue delay, the backend's run (copy in,
H2D, kernel, D2H) and the copy of Y into the chunks; and where the streams'
chunk buffers came from (the pool's cache, new pinned memory, the heap), how
many cached ones were freed, and the cache's size after the phase.
"""

import re
import sys


def read(path):
    values = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"^(detlogp_\w+_(?:sum|count|total|bytes)(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                values[m.group(1)] = float(m.group(2))
    return values


def main():
    before, after, seconds = read(sys.argv[1]), read(sys.argv[2]), float(sys.argv[3])
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    projection(delta, after, seconds)
    batches = delta.get("detlogp_batch_rows_count", 0.0)
    if batches <= 0:
        print("no batches between the scrapes")
        return

    def mean_us(name):
        return 1e6 * delta.get(f"detlogp_{name}_seconds_sum", 0.0) / batches

    print(
        f"batches {batches:.0f}  rows/batch {delta['detlogp_batch_rows_sum'] / batches:.1f}"
        f"  requests/batch {delta['detlogp_batch_requests_sum'] / batches:.2f}"
        f"  queue delay {mean_us('queue_delay'):.0f} us  gather {mean_us('gather'):.0f} us"
        f"  compute {mean_us('compute'):.0f} us  cycle {1e6 * seconds / batches:.0f} us"
    )


def projection(delta, after, seconds):
    launches = delta.get("detlogp_projection_launch_rows_count", 0.0)
    streams = delta.get("detlogp_projection_streams_total", 0.0)
    if launches <= 0 and streams <= 0:
        return

    def mean_ms(name):
        return 1e3 * delta.get(f"detlogp_projection_{name}_seconds_sum", 0.0) / max(launches, 1)

    print(
        f"projection: streams {streams:.0f}  chunks "
        f"{delta.get('detlogp_projection_chunks_total', 0.0):.0f}  stream seconds writing "
        f"{delta.get('detlogp_projection_write_seconds_total', 0.0):.3f}  waiting for a chunk "
        f"{delta.get('detlogp_projection_compute_wait_seconds_total', 0.0):.3f}"
    )
    print(
        f"projection: launches {launches:.0f}  rows/launch "
        f"{delta.get('detlogp_projection_launch_rows_sum', 0.0) / max(launches, 1):.0f}"
        f"  queue delay {mean_ms('queue_delay'):.2f} ms  run {mean_ms('run'):.2f} ms"
        f"  copy out {mean_ms('copy_out'):.2f} ms  over {seconds:.2f} s"
    )
    taken = {
        source: delta.get(f'detlogp_projection_chunk_buffers_total{{source="{source}"}}', 0.0)
        for source in ("cache", "new", "heap")
    }
    print(
        f"projection: chunk buffers from cache {taken['cache']:.0f}  new {taken['new']:.0f}"
        f"  heap {taken['heap']:.0f}"
        f"  freed {delta.get('detlogp_projection_chunk_buffers_freed_total', 0.0):.0f}"
        f"  cached after {after.get('detlogp_projection_chunk_buffer_cache_bytes', 0.0) / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
