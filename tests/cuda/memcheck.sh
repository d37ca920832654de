#!/usr/bin/env bash
# compute-sanitizer memcheck over one gtest binary: memcheck.sh BINARY
# [GTEST ARGS...]. Any error the tool finds fails the test (exit 3).
set -euo pipefail
tool=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
exec "$tool" --tool memcheck --error-exitcode 3 "$@"
