#!/usr/bin/env bash
# Runs one device suite on a GPU host from the bundle that
# tools/device/bundle.sh made: .device/bundle, or .device/bundle.tar.gz
# (unpacked into .device/bundle first) beside the tree; or run as the
# bundle's own scripts/run_suite.sh. The suites are pytest (tests/device,
# one marker a suite); this unpacks the bundle and calls
#
#   pytest -m SUITE <bundle>/tests/device [PYTEST ARGS...]
#
#   tools/device/run_suite.sh SUITE[,SUITE...] [PYTEST ARGS...]
#
# SUITE: tests, kernels, portable, serve, live-weights, projection,
# projection-stream, twin, rollout, fleet-burst, fanout, backward, soak; several
# (fleet-burst,serve,rollout) run in one pytest session, in file order
# (tests/device/conftest.py says what each holds; each test file's
# docstring, its knobs). Logs, JSON reports and figures go to $OUT
# (default /tmp/detlogp-SUITE), with junit.xml. Python packages the host
# lacks (grpcio, protobuf, liger-kernel) are installed from .whl/*.whl when
# present. Exits with pytest's code, and with 2 when the host has no GPU or
# no bundle.
set -uo pipefail

suites="tests kernels portable serve live-weights projection projection-stream twin rollout fleet-burst fanout backward soak"
suite=${1:-}
shift || true
markers=""
IFS=, read -ra asked <<< "$suite"
for one in "${asked[@]}"; do
  if [[ " $suites " != *" $one "* ]]; then
    echo "usage: run_suite.sh ${suites// /|}[,...] [PYTEST ARGS...]" >&2
    exit 2
  fi
  markers+="${markers:+ or }${one//-/_}"
done
if [[ -z $markers ]]; then
  echo "usage: run_suite.sh ${suites// /|}[,...] [PYTEST ARGS...]" >&2
  exit 2
fi

script_dir=$(cd "$(dirname "$0")" && pwd)
if [[ -n ${DETLOGP_BUNDLE:-} ]]; then
  bundle=$(cd "$DETLOGP_BUNDLE" 2> /dev/null && pwd || echo "$DETLOGP_BUNDLE")
elif [[ -x $script_dir/../bin/detlogp_server ]]; then
  bundle=$(cd "$script_dir/.." && pwd) # the bundle's own copy
else
  bundle=$(cd "$script_dir/../.." && pwd)/.device/bundle
  # bundle.sh's compressed copy, unpacked unless this very file was.
  if [[ -f $bundle.tar.gz ]]; then
    digest=$(sha256sum < "$bundle.tar.gz")
    if [[ $digest != "$(cat "$bundle/.unpacked_from" 2> /dev/null)" ]]; then
      rm -rf "$bundle"
      tar -C "$(dirname "$bundle")" -xzf "$bundle.tar.gz" &&
        echo "$digest" > "$bundle/.unpacked_from"
    fi
  fi
fi
if [[ ! -x $bundle/bin/detlogp_server || ! -d $bundle/tests/device ]]; then
  echo "run_suite.sh: no bundle at $bundle: run tools/device/bundle.sh on the build machine and copy .device/bundle.tar.gz here" >&2
  exit 2
fi
if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L 2> /dev/null | grep -q "^GPU "; then
  echo "run_suite.sh: no NVIDIA GPU on this host (nvidia-smi is missing or lists none): the $suite suite runs on a GPU host" >&2
  exit 2
fi
export OUT=${OUT:-/tmp/detlogp-${suite//,/-}}
mkdir -p "$OUT"
site=$OUT/python-site # the wheels below, reinstalled each run
for dir in "$bundle/../../.whl" "$bundle/whl" "$PWD/.whl"; do
  if compgen -G "$dir/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$site" "$dir"/*.whl || echo "pip could not install $dir/*.whl" >&2
    break
  fi
done
export PYTHONPATH="$site:$bundle/python/client${PYTHONPATH:+:$PYTHONPATH}"
export DETLOGP_BUNDLE=$bundle
echo "bundle $bundle ($(cat "$bundle/COMMIT" 2> /dev/null || echo "no commit")); logs in $OUT"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.used,clocks.sm,clocks.max.sm \
  --format=csv | tee "$OUT/gpu.txt"
cd "$bundle/tests/device" &&
  exec python3 -m pytest -p no:cacheprovider --import-mode=importlib -o addopts="" -rs -v \
    --junitxml="$OUT/junit.xml" --device_out="$OUT" -m "$markers" . "$@"
