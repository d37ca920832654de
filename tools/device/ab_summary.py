#!/usr/bin/env python3
"""Summarises the A/B log of `run_suite.sh kernels` with LIBS set: per
library and N, the top-20 and entropy cost over the same library's logp-only
in each round and
their medians, the top-20 time against the first library's in the same
round, and whether every library's outputs digest matched the first's.

  ab_summary.py AB.log

Compare libraries within one run only (in interleaved timing a kernel
starts at the clock the one before it left).
"""

import collections
import re
import statistics
import sys

ROUND = re.compile(r"^== round (\d+) (\S+)")
LINE = re.compile(
    r"^N=(\d+): logp ([\d.]+) ms, \+entropy ([-+\d.]+)%, \+top20 ([-+\d.]+)%"
    r".*outputs digest (\w+)"
)
TABLE = re.compile(r"^ +(\d+) +([\d.]+) +[\d.]+ +([\d.]+) +[-\d.]+% +([\d.]+) ")


def library_name(path):
    """liblogp_bench_NAME.so -> NAME (a copy of the bundle's library renamed
    for an A/B)."""
    name = path.rsplit("/", 1)[-1]
    name = name.removeprefix("liblogp_bench").removesuffix(".so")
    return name.lstrip("_") or "liblogp_bench"


def parse(path):
    """{lib: {n: [round records]}} and the libraries in their first order."""
    runs = collections.defaultdict(lambda: collections.defaultdict(list))
    order, lib, rnd = [], None, None
    for line in open(path):
        if m := ROUND.match(line):
            rnd, lib = int(m.group(1)), library_name(m.group(2))
            if lib not in order:
                order.append(lib)
        elif lib and (m := LINE.match(line)):
            runs[lib][int(m.group(1))].append(
                {
                    "round": rnd,
                    "logp": float(m.group(2)),
                    "entropy": float(m.group(3)),
                    "top20": float(m.group(4)),
                    "digest": m.group(5),
                }
            )
        elif lib and (m := TABLE.match(line)):
            for rec in runs[lib][int(m.group(1))]:
                if rec["round"] == rnd:
                    rec["top20_ms"] = float(m.group(4))
    return runs, order


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    runs, order = parse(sys.argv[1])
    if not order:
        sys.exit(f"{sys.argv[1]}: no rounds found")
    base = order[0]
    for n in sorted({n for lib in order for n in runs[lib]}):
        print(f"N={n}")
        base_ms = {r["round"]: r.get("top20_ms") for r in runs[base][n]}
        base_digest = {r["digest"] for r in runs[base][n]}
        for lib in order:
            recs = runs[lib][n]
            if not recs:
                continue
            top = [r["top20"] for r in recs]
            ent = [r["entropy"] for r in recs]
            vs = [
                r["top20_ms"] / base_ms[r["round"]]
                for r in recs
                if r.get("top20_ms") and base_ms.get(r["round"])
            ]
            same = {r["digest"] for r in recs} == base_digest
            print(
                f"  {lib:16.16s} top20 {' '.join(f'{t:+5.1f}' for t in top)}"
                f" (median {statistics.median(top):+5.1f} %)  entropy median"
                f" {statistics.median(ent):+4.1f} %  top20 ms / {base}'s"
                f" {statistics.median(vs) if vs else float('nan'):.3f}"
                f"  digest {'same' if same else 'DIFFERS'}"
            )


if __name__ == "__main__":
    main()
