#!/bin/bash
# Hugging Face transformers (torch, transformers >= 5, safetensors; websockets for the greedy ids)
# on an `nsactor export` directory, loaded with trust_remote_code from the model code of
# actors/checkpoint/src/hf_python/, against the real `nsactor serve` of the same directory on the
# CPU (fp32): check.py compares log-probabilities, greedy tokens and the labels loss.
#   tests/clients/transformers/run.sh [path/to/nsactor] [HF_DIR]
# Without HF_DIR it trains a tiny model (the embedded CPU config; $STEPS steps, default 100;
# $PLIF_OUT leak or v_post) and exports it; the export must carry the model code and its
# auto_map. HF_DIR itself is never written.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-target/release/nsactor}
given=${2:-}
work=$(mktemp -d)
server=
trap '[ -n "$server" ] && kill $server 2>/dev/null; rm -rf "$work"' EXIT
if [ -z "$given" ]; then
  NSACTOR_MODEL__PLIF_OUT=${PLIF_OUT:-leak} "$bin" train --steps "${STEPS:-100}" --out "$work/run" \
    > "$work/train.log" 2>&1
  "$bin" export --checkpoint "$work/run" --out "$work/export" > "$work/export.log" 2>&1
  given="$work/export"
fi
given=$(cd "$given" && pwd)
# The export must carry its model code and point transformers at it.
for f in configuration_neuronspark.py modeling_neuronspark.py; do
  [ -f "$given/$f" ] || { echo "the export has no $f" >&2; exit 1; }
done
grep -q '"auto_map"' "$given/config.json" || { echo "the export's config.json has no auto_map" >&2; exit 1; }
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# The embedded CPU backend computes in fp32 (it takes no --precision).
"$bin" serve --checkpoint "$given" --backend embedded --no-warmup \
  --addr 127.0.0.1:$port > "$work/serve.log" 2>&1 &
server=$!
python3 - "$port" "$server" <<'PY' || { cat "$work/serve.log"; exit 1; }
import os, sys, time, urllib.request
for _ in range(1500):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health"); break
    except Exception:
        os.kill(int(sys.argv[2]), 0)  # the server is still running
        time.sleep(0.2)
else:
    sys.exit("the server did not come up")
PY
HF_HUB_OFFLINE=1 python3 "$here/check.py" "$given" "http://127.0.0.1:$port"
