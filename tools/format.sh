#!/usr/bin/env bash
# Applies the tree's formatters in place: clang-format, then ruff's safe
# fixes and formatter. tools/check_style.sh checks the same in the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/style_env.sh
cxx_sources | xargs clang-format -i
"$RUFF" check --no-cache --fix -q .
"$RUFF" format --no-cache -q .
