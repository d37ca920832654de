#!/usr/bin/env python3
"""Summarises an A/B of bench libraries (the kernels suite with
DETLOGP_AB_LIBS set): per library and N, the top-20 and entropy cost over
the same library's logp-only in each round and their medians, the top-20
time against the first library's in the same round, and whether every
library's outputs digest matched the first's. Exits 1 when one differs.

  ab_summary.py AB.json

AB.json: {"rounds": [{"round": R, "lib": PATH, "report": EXTRAS.json}, ...]}
in run order, each report logp_extras_bench.py's --json of one round.

Compare libraries within one run only (in interleaved timing a kernel
starts at the clock the one before it left).
"""

import collections
import json
import statistics
import sys


def library_name(path):
    """liblogp_bench_NAME.so -> NAME (a copy of the bundle's library renamed
    for an A/B)."""
    name = path.rsplit("/", 1)[-1]
    name = name.removeprefix("liblogp_bench").removesuffix(".so")
    return name.lstrip("_") or "liblogp_bench"


def parse(path):
    """{lib: {n: [round records]}} and the libraries in their first order."""
    runs = collections.defaultdict(lambda: collections.defaultdict(list))
    order = []
    for entry in json.load(open(path))["rounds"]:
        lib = library_name(entry["lib"])
        if lib not in order:
            order.append(lib)
        for row in json.load(open(entry["report"]))["rows"]:
            logp = row["logp_ms"]
            runs[lib][row["n"]].append(
                {
                    "round": entry["round"],
                    "entropy": 100 * (row["entropy_ms"] / logp - 1),
                    "top20": 100 * (row["top20_ms"] / logp - 1),
                    "top20_ms": row["top20_ms"],
                    "digest": row["both_digest"],
                }
            )
    return runs, order


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    runs, order = parse(sys.argv[1])
    if not order:
        sys.exit(f"{sys.argv[1]}: no rounds found")
    base = order[0]
    differing = 0
    for n in sorted({n for lib in order for n in runs[lib]}):
        print(f"N={n}")
        base_ms = {r["round"]: r["top20_ms"] for r in runs[base][n]}
        base_digest = {r["digest"] for r in runs[base][n]}
        for lib in order:
            recs = runs[lib][n]
            if not recs:
                continue
            top = [r["top20"] for r in recs]
            ent = [r["entropy"] for r in recs]
            vs = [r["top20_ms"] / base_ms[r["round"]] for r in recs if base_ms.get(r["round"])]
            same = {r["digest"] for r in recs} == base_digest
            differing += not same
            print(
                f"  {lib:16.16s} top20 {' '.join(f'{t:+5.1f}' for t in top)}"
                f" (median {statistics.median(top):+5.1f} %)  entropy median"
                f" {statistics.median(ent):+4.1f} %  top20 ms / {base}'s"
                f" {statistics.median(vs) if vs else float('nan'):.3f}"
                f"  digest {'same' if same else 'DIFFERS'}"
            )
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
