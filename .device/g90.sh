#!/usr/bin/env bash
# s74: inference block scans without CubeCL's bounds checks, the ahead kernel's shapes, and
# what it does to one long prompt's first token and to decoding.
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-s74 CUDA_CACHE_PATH=/tmp/cache-s74/nv
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
CFG=$ROOT/configs/neuronspark-0.9b.toml
k() { tag=$1; shape=$2; chk=$3; shift 3
  env ${shape:+NSACTOR_STAGE_BLOCK_SCAN=$shape} NSACTOR_KERNEL_BOUNDS_CHECK=$chk timeout 100 nsactor bench kernels --backend cuda --precision bf16 --options only=prefill,$1 > $OUT/k.log 2>&1
  echo "== $tag ${shape:-default} check=$chk: rc $?"
  grep -E "^  (staged|wide)|WRONG|rror" $OUT/k.log | sed -E 's/ +\(bf16 projections in, V_post out\)//' | cut -c1-110 >> $OUT/kernels.txt
  grep -E "^  (staged|wide)|WRONG|rror" $OUT/k.log | sed -E 's/ +\(bf16 projections in, V_post out\)//' | cut -c1-110; }
L=prefill_steps=16384,prefill_batch=1,prefill_chunks=16384,prefill_reps=10
k long "" 1 $L
k long "" 0 $L
for s in 24x48 31x62 16x16 12x24 20x40 8x64; do k long $s 0 $L; done
k b8 "" 0 prefill_steps=2048,prefill_batch=8,prefill_chunks=2048,prefill_reps=10
k b8 16x32 0 prefill_steps=2048,prefill_batch=8,prefill_chunks=2048,prefill_reps=10
k w64 "" 1 prefill_steps=240,prefill_batch=64,prefill_chunks=240,prefill_reps=10
k w64 "" 0 prefill_steps=240,prefill_batch=64,prefill_chunks=240,prefill_reps=10
k w256 "" 1 prefill_steps=16,prefill_batch=256,prefill_chunks=16,prefill_reps=20
k w256 "" 0 prefill_steps=16,prefill_batch=256,prefill_chunks=16,prefill_reps=20
p() { tag=$1; shift
  env "$@" timeout 150 nsactor bench prefill --config $CFG --backend cuda --precision bf16 --lengths 1024,4000 --concurrent 2x64 --check 0 --reps 5 > $OUT/$tag.log 2>&1
  echo "== prefill $tag: rc $?"; grep -E "^one client" $OUT/$tag.log | cut -c1-120; }
p old NSACTOR_BLOCK_SCAN_AHEAD=0 NSACTOR_KERNEL_BOUNDS_CHECK=1
p new NSACTOR_BLOCK_SCAN_AHEAD=1
p old2 NSACTOR_BLOCK_SCAN_AHEAD=0 NSACTOR_KERNEL_BOUNDS_CHECK=1
p new2 NSACTOR_BLOCK_SCAN_AHEAD=1
