"""CUDA-event timing shared by the device benchmark scripts."""

import statistics

import torch


def median_ms(fn, reps, warmup=3):
    """(median, min, max) milliseconds of `reps` event-timed calls of fn,
    after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), min(times), max(times)
