#!/usr/bin/env python3
"""Where a load phase's time went, from two scrapes of the server's metrics.

  metrics_delta.py BEFORE AFTER SECONDS

prints, for the batches run between the scrapes: their number, rows and
requests per batch, the mean queue delay, gather and compute (backend Run)
per batch, and the batch cycle (SECONDS / batches). With one batch in flight,
cycle - gather - compute is the time the device slot sat between batches
(thread hand-over, answering calls).
"""
import re
import sys


def read(path):
    values = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"^(detlogp_\w+_(?:sum|count)) (\S+)$", line)
            if m:
                values[m.group(1)] = float(m.group(2))
    return values


def main():
    before, after, seconds = read(sys.argv[1]), read(sys.argv[2]), float(sys.argv[3])
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
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


if __name__ == "__main__":
    main()
