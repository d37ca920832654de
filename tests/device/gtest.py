"""Runs the bundle's GPU gtest binaries without Bazel and reads their JSON
report (--gtest_output=json), never their console output."""

import dataclasses
import json
import os
import shutil
import subprocess


@dataclasses.dataclass
class GtestRun:
    name: str
    returncode: int
    ran: int  # cases that ran to completion (passed or failed)
    failed: list  # "Suite.Case" of each failure
    skipped: list  # "Suite.Case" of each skipped case
    log: str  # the log file's path

    def summary(self):
        return (
            f"{self.name}: {self.ran} ran, {len(self.failed)} failed, "
            f"{len(self.skipped)} skipped (exit {self.returncode}; log {self.log})"
        )


def run_gtest(bundle, name, out_dir, *, timeout_s, args=(), env=None, wrapper=()):
    """bin/NAME [ARGS] under WRAPPER (e.g. compute-sanitizer), its log and
    JSON report in out_dir. Tests that start a server (tests/server_process.cc)
    find it under TEST_SRCDIR, the bundle's runfiles."""
    binary = bundle.bin(name)
    assert binary.exists(), f"{name}: not in the bundle ({binary})"
    report = out_dir / f"{name}.json"
    report.unlink(missing_ok=True)
    log = out_dir / f"{name}.log"
    tmp = out_dir / f"{name}.tmp"
    tmp.mkdir(exist_ok=True)
    run_env = dict(os.environ)
    run_env.setdefault("TEST_SRCDIR", str(bundle.runfiles))
    run_env.setdefault("TEST_TMPDIR", str(tmp))
    run_env.update(env or {})
    with open(log, "wb") as sink:
        try:
            rc = subprocess.run(
                [*wrapper, str(binary), f"--gtest_output=json:{report}", *args],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=run_env,
                timeout=timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name}: timed out after {timeout_s} s (log {log})") from None
    shutil.rmtree(tmp, ignore_errors=True)
    ran, failed, skipped = 0, [], []
    if report.exists():
        for suite in json.loads(report.read_text()).get("testsuites", []):
            for case in suite.get("testsuite", []):
                full = f"{suite['name']}.{case['name']}"
                if case.get("result") == "SKIPPED":
                    skipped.append(full)
                elif case.get("status") == "RUN":
                    ran += 1
                    if case.get("failures"):
                        failed.append(full)
    return GtestRun(name, rc, ran, failed, skipped, str(log))


def assert_gtest_passed(run, *, skips_allowed=False):
    """Exit 0, at least one case ran, none failed, and none skipped unless
    skips_allowed (a capability the device lacks)."""
    assert run.returncode == 0 and not run.failed, (
        f"{run.summary()}; failed: {', '.join(run.failed[:10]) or '(none reported)'}"
    )
    assert run.ran > 0, f"{run.summary()}: no case ran"
    if not skips_allowed:
        assert not run.skipped, (
            f"{run.summary()}: cases skipped on this GPU: {', '.join(run.skipped[:10])}"
        )


def memcheck(bundle, name, gtest_filter, out_dir, *, timeout_s=300):
    """compute-sanitizer's memcheck over bin/NAME's cases matching the filter
    (the small shapes: the full-vocabulary cases are too slow under it)."""
    tool = shutil.which("compute-sanitizer")
    assert tool, "compute-sanitizer not found on this host (PATH)"
    run = run_gtest(
        bundle,
        name,
        out_dir,
        timeout_s=timeout_s,
        args=[f"--gtest_filter={gtest_filter}"],
        wrapper=[tool, "--tool", "memcheck", "--error-exitcode", "3"],
    )
    # The same binary's plain run must not overwrite these.
    for suffix in ("json", "log"):
        if (out_dir / f"{name}.{suffix}").exists():
            os.replace(out_dir / f"{name}.{suffix}", out_dir / f"memcheck_{name}.{suffix}")
    run.log = str(out_dir / f"memcheck_{name}.log")
    return run
