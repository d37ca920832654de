"""Runs the client's own pytest files on the GPU host and reads their JUnit
XML: which cases passed, failed and skipped, and why."""

import dataclasses
import os
import subprocess
import sys
import xml.etree.ElementTree as ET


@dataclasses.dataclass
class Case:
    name: str  # "file::test[param]"-like: classname.name
    outcome: str  # passed, failed, skipped
    message: str


def run_pytest(name, files, out_dir, *, timeout_s=600, args=()):
    """pytest FILES ARGS in a subprocess; its log and JUnit XML in out_dir.
    Returns (exit code, [Case])."""
    xml = out_dir / f"{name}.xml"
    log = out_dir / f"{name}.log"
    xml.unlink(missing_ok=True)
    with open(log, "wb") as sink:
        try:
            rc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-p",
                    "no:cacheprovider",
                    "-o",
                    "addopts=",
                    "--import-mode=importlib",
                    "-rs",
                    "-q",
                    f"--junitxml={xml}",
                    *args,
                    *map(str, files),
                ],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=dict(os.environ),
                timeout=timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"pytest {name}: timed out after {timeout_s} s (log {log})"
            ) from None
    cases = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            full = f"{case.get('classname')}.{case.get('name')}"
            for outcome, tag in (
                ("failed", "failure"),
                ("failed", "error"),
                ("skipped", "skipped"),
            ):
                element = case.find(tag)
                if element is not None:
                    cases.append(Case(full, outcome, element.get("message") or ""))
                    break
            else:
                cases.append(Case(full, "passed", ""))
    return rc, cases


def assert_passed(name, rc, cases, log_dir):
    failed = [c.name for c in cases if c.outcome == "failed"]
    assert rc == 0 and not failed, (
        f"pytest {name}: exit {rc}, failed {failed[:10]} (log {log_dir / (name + '.log')})"
    )
    assert any(c.outcome == "passed" for c in cases), f"pytest {name}: no case passed"
