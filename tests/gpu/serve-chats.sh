#!/usr/bin/env bash
# Issue 61 beside issue 62 on the GPU (s69): eight clients' 20-turn chats through
# `/v1/chat/completions` with the prefix cache at its default and with 40 MiB on the device,
# the 256-client wave twice on one server (each run's conversations new to the cache), batch
# invariance, and the decode figures at 1 and 256 clients. Run from the repository root on the
# device machine, with `.device/` carried holding new/nsactor.xz and
# new/libnsactor_backend_cuda.so.xz (stripped release builds, xz'd). Logs under $OUT.
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-serve CUDA_CACHE_PATH=/tmp/cache-serve/nv
nvidia-smi --query-gpu=name --format=csv,noheader
CFG=$ROOT/configs/neuronspark-0.9b.toml
CHAT=(--config $CFG --backend cuda --precision bf16 --turns 20 --tokens 32 --turn-bytes 100 --after-ready 0)
run() { tag=$1; shift; t0=$(date +%s)
  timeout 150 nsactor bench serve "$@" > $OUT/$tag.log 2>&1
  echo "== $tag: rc $? $(( $(date +%s) - t0 )) s"
  grep -E "^ +(1|2|5|10|15|20) +(1|8|256) |prefix cache" $OUT/$tag.log | cut -c1-200; }
run chat8 "${CHAT[@]}" --sessions 1,8
run chat8-small "${CHAT[@]}" --sessions 8 --prefix-cache-mib 40
run wave --config $CFG --backend cuda --precision bf16 --turns 1 --sessions 1,256,256 --tokens 8 \
  --turn-bytes 60 --system-bytes 5300 --after-ready 0
t0=$(date +%s)
timeout 120 nsactor verify batch-invariance --config $CFG --backend cuda --precision bf16 --cohorts 3,17,64,256 > $OUT/verify.log 2>&1
echo "== verify: rc $? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/verify.log | cut -c1-200
run decode --config $CFG --backend cuda --precision bf16 --temperature 0 --sessions 1,256 --tokens 128 \
  --protocol ws --after-ready 0
grep -E " ws | engine " $OUT/decode.log | cut -c1-200
