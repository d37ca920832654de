#!/usr/bin/env bash
# compute-sanitizer memcheck over one gtest binary: memcheck.sh BINARY
# [GTEST ARGS...]. Any error the tool finds fails the test (exit 3).
set -euo pipefail
tool=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [[ ! -x $tool ]]; then
  echo "memcheck.sh: compute-sanitizer is neither on PATH nor in /usr/local/cuda/bin" >&2
  exit 1
fi
exec "$tool" --tool memcheck --error-exitcode 3 "$@"
