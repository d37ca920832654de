#!/usr/bin/env python3
"""Median duration per kernel and grid from ncu's raw CSV page with
gpu__time_duration.sum (`DETLOGP_NCU=1 run_suite.sh kernels`).

  kernel_durations_summary.py DURATIONS.csv

Give it one N's run (the suite profiles each N on its own): the
persistent split kernel's grid is the SM count at every N, so a file with
several N would pool their launches.
"""

import collections
import csv
import statistics
import sys


def durations(path):
    """{(kernel, grid): [microseconds]} from ncu's CSV, skipping the
    benchmark's own output before ncu's header."""
    lines = open(path).read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"ID"')]
    if not starts:
        sys.exit(f"{path}: no ncu table (did the profiled run fail?)")
    rows = list(csv.reader(lines[starts[0] :]))
    header, units = rows[0], rows[1]
    name = header.index("Kernel Name")
    grid = header.index("launch__grid_size")
    value = header.index("gpu__time_duration.sum")
    scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "nsecond": 1e-3}[
        units[value]
    ]
    out = collections.defaultdict(list)
    for r in rows[2:]:
        if len(r) == len(header):
            out[(r[name].split("(")[0], r[grid])].append(float(r[value].replace(",", "")) * scale)
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for (kernel, grid), us in sorted(durations(sys.argv[1]).items()):
        print(
            f"{kernel:70.70s} grid {grid:>6s}  {len(us):3d} launches  "
            f"median {statistics.median(us):9.2f} us  "
            f"min {min(us):9.2f}  max {max(us):9.2f}"
        )


if __name__ == "__main__":
    main()
