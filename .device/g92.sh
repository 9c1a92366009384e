#!/usr/bin/env bash
# s74: the real server at 1 and 256 streaming clients, the bounds checks on and off.
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do [ -x $B/$f ] || xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-s74 CUDA_CACHE_PATH=/tmp/cache-s74/nv
CFG=$ROOT/configs/neuronspark-0.9b.toml
for chk in ${ORDER:-0 1}; do
  NSACTOR_KERNEL_BOUNDS_CHECK=$chk timeout 240 nsactor bench serve --config $CFG --backend cuda --precision bf16 --temperature 0 --sessions 1,256 --tokens 128 --protocol ws --after-ready 0 > $OUT/serve-$chk.log 2>&1
  echo "== serve check=$chk: rc $?"; grep -vE "INFO|WARN|^\s*$" $OUT/serve-$chk.log | tail -12 | cut -c1-180
done
