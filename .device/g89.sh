#!/usr/bin/env bash
# s74: the block scan of one long session: producers' loads a chunk ahead, and the staged
# kernel's shape knob, against the staged kernel.
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-s74 CUDA_CACHE_PATH=/tmp/cache-s74/nv
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
k() { tag=$1; shape=$2; shift 2; t0=$(date +%s)
  NSACTOR_STAGE_BLOCK_SCAN=$shape timeout 200 nsactor bench kernels --backend cuda --precision bf16 --options only=prefill,$1 > $OUT/$tag.log 2>&1
  echo "== $tag $shape: rc $? $(( $(date +%s) - t0 )) s"
  grep -E "^  (staged|wide)|WRONG|rror" $OUT/$tag.log | cut -c1-150; }
k long-8x64 8x64 prefill_steps=16384,prefill_batch=1,prefill_chunks=16384,prefill_reps=10
for s in 16x64 16x32 4x64 8x32; do k long-$s $s prefill_steps=16384,prefill_batch=1,prefill_chunks=16384,prefill_reps=10; done
k b8-8x64 8x64 prefill_steps=2048,prefill_batch=8,prefill_chunks=2048,prefill_reps=10
k b8-16x64 16x64 prefill_steps=2048,prefill_batch=8,prefill_chunks=2048,prefill_reps=10
k s320-8x64 8x64 prefill_steps=320,prefill_batch=8,prefill_chunks=320,prefill_reps=10
