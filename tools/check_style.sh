#!/usr/bin/env bash
# Checks that the tree passes its formatters: clang-format (.clang-format) on
# the C++ and CUDA sources, ruff (ruff.toml) lint and format on the Python.
# Writes one JUnit case per check to the given XML path; exits non-zero when
# any check fails. tools/format.sh applies the formatters.
#
# Usage: tools/check_style.sh <junit-xml-path>
set -uo pipefail
cd "$(dirname "$0")/.."
xml=${1:?usage: tools/check_style.sh <junit-xml-path>}
xml=$(realpath -m "$xml")
source tools/style_env.sh || exit 1

cases=()
failed=0
run_check() {
  local name=$1
  shift
  local log
  if log=$("$@" 2>&1); then
    cases+=("<testcase classname=\"style\" name=\"${name}\"/>")
  else
    failed=$((failed + 1))
    echo "== style check failed: ${name}" >&2
    echo "$log" | head -60 >&2
    local escaped
    escaped=$(echo "$log" | head -60 | sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g')
    cases+=("<testcase classname=\"style\" name=\"${name}\"><failure message=\"not formatted\">${escaped}</failure></testcase>")
  fi
}

mapfile -t cxx_files < <(cxx_sources)
run_check clang-format clang-format --dry-run --Werror "${cxx_files[@]}"
run_check ruff-check "$RUFF" check --no-cache .
run_check ruff-format "$RUFF" format --no-cache --check .

mkdir -p "$(dirname "$xml")"
{
  echo '<?xml version="1.0" encoding="utf-8"?>'
  echo "<testsuite name=\"style\" tests=\"${#cases[@]}\" failures=\"${failed}\">"
  printf '%s\n' "${cases[@]}"
  echo '</testsuite>'
} >"$xml"
exit $((failed > 0))
