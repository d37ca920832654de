"""Every performance and memory gate of the device suites, in one place.

A gate compares a measured figure with its threshold; a failure names the
figure, the threshold and the measured value.
"""

# Portable kernel served over gRPC (N=256 rows a request, 64 callers)
# against the kernel alone at N=256, rows/s: the transport may cost 15%.
PORTABLE_SERVED_OVER_KERNEL_MIN = 0.85

# Serving on one Hopper GPU (H = 4096, V = 151936, the CUDA batching
# defaults): throughput of 256-row calls from 64 callers, rows/s, and the
# median latency of 16-row calls from 8 callers, ms. Other GPUs are not held
# to them.
SERVE_256X64_ROWS_PER_S_MIN = 450_000
SERVE_16X8_P50_MS_MAX = 1.1

# Many rollout workers at once (8 x 16,384 and 32 x 4,096 rows through CUDA
# regions) against the kernel alone on one caller's rows, rows/s.
FLEET_BURST_OVER_KERNEL_MIN = 0.9

# A push to 8 replicas on one host down a chain: the last replica ready
# within this multiple of one replica's time, and the pusher's bytes summed
# over the replicas within this multiple of the head's.
FANOUT_CHAIN_OVER_ONE_MAX = 1.5
FANOUT_PUSHER_BYTES_OVER_HEAD_MAX = 1.1

# Cancellation-storm soak: the server's RSS is flat when, over the last
# third of the storms, it grows by at most this fraction of its level at
# the start of that third (RSS read after each storm).
SOAK_LAST_THIRD_RSS_GROWTH_MAX = 0.03


def at_least(figure, measured, threshold, unit=""):
    assert measured >= threshold, (
        f"{figure}: measured {measured:.4g}{unit}, below the threshold {threshold:.4g}{unit}"
    )


def at_most(figure, measured, threshold, unit=""):
    assert measured <= threshold, (
        f"{figure}: measured {measured:.4g}{unit}, above the threshold {threshold:.4g}{unit}"
    )
