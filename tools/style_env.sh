# Sourced by tools/check_style.sh and tools/format.sh: makes clang-format and
# ruff available (Debian's clang-format, ruff in the tests' venv) and lists
# the C++/CUDA sources the formatters own.
ruff_version=0.17.6
if ! command -v clang-format >/dev/null; then
  echo "installing clang-format" >&2
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive $SUDO apt-get \
    install -y -qq --no-install-recommends clang-format >&2 || return 1
fi
venv=${DETLOGP_VENV:-.venv-ci}
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv" || return 1
RUFF="$venv/bin/ruff"
if ! "$RUFF" --version 2>/dev/null | grep -q "$ruff_version"; then
  "$venv/bin/python" -m pip install -q "ruff==${ruff_version}" >&2 || return 1
fi
cxx_sources() {
  git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | grep -v '^third_party/'
}
