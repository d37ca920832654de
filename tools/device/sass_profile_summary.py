"""Summarises ncu source-page profiles of the Hopper split kernel
(`DETLOGP_SASS_PROFILE=1 run_suite.sh kernels`): where the warp-stall samples fall.

Each instruction goes to one place: the K loop (executed once per k-block:
its wgmma waits, its full-barrier waits, the wgmma issue, the rest) or the
fold and everything else, and, from --subroutine on, the non-inlined
TopKSite (its offset is the CALL.REL target in `cuobjdump -sass`). For two
profiles (the logp-only one first) it prints the second's extra samples per
place as a share of the first's total, then the fold's stall reasons and its
hottest instructions.

  python3 tools/device/sass_profile_summary.py head_logp_sass.csv \
      head_top20_sass.csv --subroutine 0x658a0
"""

import argparse
import collections
import csv

# An instruction run at least this many times per launch is in a K loop (the
# fold's run once per tile and warp, ~100x fewer at N >= 1024).
K_LOOP_MIN_EXECUTIONS = 200_000


def load(path):
    """The profile's instructions: offset, text, samples, executions and
    samples per stall reason."""
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    column = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][0], 16)
    out = []
    for r in data:
        out.append(
            {
                "offset": int(r[0], 16) - base,
                "text": r[1].strip(),
                "samples": int(r[column["Warp Stall Sampling (All Samples)"]]),
                "executed": int(r[column["Instructions Executed"]]),
                "reasons": {
                    h[len("stall_") :]: int(r[column[h]])
                    for h in reasons
                    if r[column[h]] not in ("", "0")
                },
            }
        )
    return out


def place(instruction, subroutine):
    text = instruction["text"]
    if subroutine is not None and instruction["offset"] >= subroutine:
        return "TopKSite"
    if instruction["executed"] >= K_LOOP_MIN_EXECUTIONS:
        if "DEPBAR" in text:
            return "K loop: wgmma waits"
        if "SYNCS" in text or "BRA" in text:
            return "K loop: full-barrier waits"
        if "HGMMA" in text:
            return "K loop: wgmma issue"
        return "K loop: other"
    if "DEPBAR.LE gsb0, 0x0" in text:
        return "K loop: wgmma waits"
    return "fold and the rest"


def by_place(profile, subroutine):
    samples = collections.Counter()
    for instruction in profile:
        samples[place(instruction, subroutine)] += instruction["samples"]
    return samples


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the logp-only kernel's _sass.csv")
    parser.add_argument("other", nargs="?", help="e.g. the top-20 kernel's")
    parser.add_argument(
        "--subroutine", type=lambda s: int(s, 0), help="TopKSite's offset in the other profile"
    )
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()

    base = load(args.base)
    base_total = sum(i["samples"] for i in base)
    base_places = by_place(base, None)
    print(f"{args.base}: {base_total} samples")
    if not args.other:
        for name, n in sorted(base_places.items()):
            print(f"  {name:28s} {n:8d} {100 * n / base_total:6.1f} %")
        return
    other = load(args.other)
    other_total = sum(i["samples"] for i in other)
    other_places = by_place(other, args.subroutine)
    print(f"{args.other}: {other_total} samples ({100 * (other_total / base_total - 1):+.1f} %)")
    print(f"  {'place':28s} {'base':>8s} {'other':>8s} {'extra, % of base':>17s}")
    for name in sorted(set(base_places) | set(other_places)):
        b, o = base_places[name], other_places[name]
        print(f"  {name:28s} {b:8d} {o:8d} {100 * (o - b) / base_total:+16.1f}")
    fold = [i for i in other if place(i, args.subroutine) in ("fold and the rest", "TopKSite")]
    reasons = collections.Counter()
    for instruction in fold:
        reasons.update(instruction["reasons"])
    print("  fold stall reasons:", ", ".join(f"{k} {v}" for k, v in reasons.most_common(8)))
    print(f"  hottest fold instructions of {args.other}:")
    for i in sorted(fold, key=lambda i: -i["samples"])[: args.top]:
        top = ", ".join(
            f"{k} {v}" for k, v in sorted(i["reasons"].items(), key=lambda kv: -kv[1])[:2]
        )
        print(
            f"    {i['offset']:6x} {i['samples']:6d} x{i['executed']:<9d} "
            f"{i['text'][:56]:56s} {top}"
        )


if __name__ == "__main__":
    main()
