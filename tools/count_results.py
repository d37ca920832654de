#!/usr/bin/env python3
"""Counts test cases in JUnit XML files and prints "N passed, N failed".

Bazel writes one test.xml per test target (gtest's own cases inside); pytest
writes one file. A target that failed without a readable XML counts as one
failed case, so a crash is never silent.
"""

import argparse
import pathlib
import sys
import xml.etree.ElementTree as ET


def count_file(path):
    root = ET.parse(path).getroot()
    passed = failed = 0
    cases = list(root.iter("testcase"))
    for case in cases:
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.find("skipped") is not None:
            continue
        else:
            passed += 1
    return passed, failed, len(cases)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results_dir")
    parser.add_argument("--bazel_rc", type=int, default=0)
    parser.add_argument("--python_rc", type=int, default=0)
    args = parser.parse_args()
    passed = failed = 0
    root = pathlib.Path(args.results_dir)
    xmls = sorted(root.rglob("*.xml"))
    if args.bazel_rc == 1:
        # The build failed, so no test ran: bazel-testlogs holds an earlier
        # build's results. Count the build as one failure, not those.
        xmls = [x for x in xmls if (root / "bazel") not in x.parents]
        failed += 1
    for xml in xmls:
        try:
            p, f, cases = count_file(xml)
        except ET.ParseError:
            p, f, cases = 0, 1, 1
        if cases == 0:
            # A target whose binary died before gtest wrote its cases.
            log = xml.with_name("test.log")
            f = 1 if log.exists() and "FAILED" in log.read_text(errors="replace") else 0
        passed += p
        failed += f
    if args.bazel_rc not in (0, 1, 4) and failed == 0:
        failed = 1  # the build itself failed
    if args.python_rc != 0 and failed == 0:
        failed = 1
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
