#!/usr/bin/env bash
# Drives the real service with ghz (https://ghz.sh) using the configurations
# in tests/load/ghz/ and binary payloads made by make_ghz_data.py. The server
# must be running (reflection is on, so no .proto is passed).
#
# Usage: tests/load/run_ghz.sh HOST:PORT [OUT_DIR]
# Writes OUT_DIR/<config>.json (ghz's JSON report) and prints ghz's summary.
# When ghz is not installed it says so and exits 0 without running anything.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
target=${1:?usage: run_ghz.sh HOST:PORT [OUT_DIR]}
out=${2:-$(mktemp -d /tmp/detlogp-ghz.XXXXXX)}
python=${PYTHON:-python3}

if ! command -v ghz >/dev/null 2>&1; then
  echo "ghz is NOT installed: nothing was run." >&2
  echo "Install it (e.g. 'go install github.com/bojand/ghz/cmd/ghz@latest') and rerun," >&2
  echo "or use tests/load/detlogp_load.py, which needs only Python." >&2
  exit 0
fi

mkdir -p "$out/data"
"$python" "$here/make_ghz_data.py" --out "$out/data" --target "$target"
for config in "$here"/ghz/*.json; do
  name=$(basename "$config" .json)
  sed "s#DATA_DIR#$out/data#g" "$config" > "$out/$name.config.json"
  binary_file=$(sed -n 's/.*"binary-file": "\(.*\)".*/\1/p' "$out/$name.config.json")
  echo "== ghz $name" >&2
  ghz --config="$out/$name.config.json" -B "$binary_file" -O json \
    -o "$out/$name.json" "$target" || echo "ghz $name failed" >&2
  "$python" - "$out/$name.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
lat = {d["percentage"]: d["latency"] / 1e6 for d in r.get("latencyDistribution") or []}
print(f"{r.get('name') or sys.argv[1]}: {r['count']} calls, {r['rps']:.1f} calls/s, "
      f"p50 {lat.get(50, 0):.2f} ms, p90 {lat.get(90, 0):.2f} ms, p99 {lat.get(99, 0):.2f} ms, "
      f"status {r.get('statusCodeDistribution')}")
PY
done
echo "reports in $out" >&2
