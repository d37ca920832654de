"""Summarises the projection-stream suite's timed rounds for one call
count.

Reads one file of GB/s figures per position of CHUNKS (one line per round,
rounds in the same order in every file) and prints each position's median,
then every pair's paired ratios: per round, the later position's GB/s
over the earlier's (CHUNKS ascending: below 1 means the larger
chunk was slower), their median, how many rounds were above 1, and the sign test's
one-sided p-value for "the later position is slower" (the chance of that
few rounds above 1 if neither were). A size listed twice gives the noise
floor: its pair should read 1 within the spread. A failed run is "nan":
its round is left out of that setting's median and of its pairs.

  projection_stream_summary.py --calls=4 --chunks="256 512 1024 2048" \
      /tmp/speed_%d_4.txt
"""

import argparse
import itertools
import math
import statistics


def sign_test_p(above, n):
    """P(X <= above) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(above + 1)) / 2**n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", required=True)
    ap.add_argument(
        "--chunks", required=True, help="rows_per_chunk per position (512:b: another CLI's)"
    )
    ap.add_argument("pattern", help="file of position %%d's GB/s, one per round")
    args = ap.parse_args()
    chunks = args.chunks.split()
    speeds = []
    for pos in range(len(chunks)):
        with open(args.pattern % pos) as f:
            speeds.append([float(line) for line in f if line.strip()])
    rounds = min(len(s) for s in speeds)
    print(f"-- {args.calls} call(s): output GB/s over {rounds} timed rounds")
    for chunk, s in zip(chunks, speeds):
        ok = [v for v in s if not math.isnan(v)]
        failed = len(s) - len(ok)
        print(
            f"rows_per_chunk {chunk:>7}  median {statistics.median(ok):.2f}"
            f"  ({min(ok):.2f}-{max(ok):.2f})" + (f"  {failed} failed" if failed else "")
        )
    for a, b in itertools.combinations(range(len(chunks)), 2):
        ratios = [
            speeds[b][r] / speeds[a][r]
            for r in range(rounds)
            if not math.isnan(speeds[a][r]) and not math.isnan(speeds[b][r])
        ]
        above = sum(x > 1 for x in ratios)
        print(
            f"{chunks[b]:>7} / {chunks[a]:<7} paired median {statistics.median(ratios):.3f}"
            f"  ({min(ratios):.3f}-{max(ratios):.3f})  above 1 in {above}/{len(ratios)}"
            f"  sign-test p(slower) {sign_test_p(above, len(ratios)):.3f}"
        )
    print("per round: " + "  ".join(chunks))
    for r in range(rounds):
        print("           " + "  ".join(f"{s[r]:.2f}" for s in speeds))


if __name__ == "__main__":
    main()
