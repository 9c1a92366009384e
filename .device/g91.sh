#!/usr/bin/env bash
# s74: every inference kernel and the norm/ponder/gated training kernels without CubeCL's
# bounds checks: the parity checks, batch invariance, then decoding and training A/B
# (NSACTOR_KERNEL_BOUNDS_CHECK=1 restores the checks) on one machine.
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-s74 CUDA_CACHE_PATH=/tmp/cache-s74/nv
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
CFG=$ROOT/configs/neuronspark-0.9b.toml
t0=$(date +%s); el() { echo "   ($(( $(date +%s) - t0 )) s)"; }
for p in fp32 bf16; do
  timeout 90 nsactor verify tiny-a --backend cuda --precision $p --fixture $D/fix/tiny_a.safetensors > $OUT/verify-$p.log 2>&1
  echo "== verify tiny-a $p: rc $?"; grep -E "PASS|FAIL|greedy" $OUT/verify-$p.log | tail -4 | cut -c1-160; el
done
timeout 120 nsactor bench kernels --backend cuda --precision bf16 --options batch=4,reps=2,check_steps=256 > $OUT/kernels.log 2>&1
echo "== bench kernels: rc $?"; grep -ciE "WRONG|mismatch|FAIL" $OUT/kernels.log; grep -iE "WRONG|FAIL" $OUT/kernels.log | head -5 | cut -c1-160; el
for b in 1 64; do
  timeout 60 nsactor bench decode-profile --backend cuda --precision bf16 --options batch=$b > $OUT/profile-$b.log 2>&1
  echo "== decode-profile batch $b: rc $?"; grep -iE "error|disagree|graphs" $OUT/profile-$b.log | head -4 | cut -c1-160; el
done
timeout 150 nsactor verify batch-invariance --config $CFG --backend cuda --precision bf16 --cohorts 3,17,64,256 > $OUT/inv.log 2>&1
echo "== batch-invariance: rc $?"; tail -3 $OUT/inv.log | cut -c1-160; el
for chk in 1 0 1 0; do
  NSACTOR_KERNEL_BOUNDS_CHECK=$chk timeout 60 nsactor bench generate --config $CFG --backend cuda --precision bf16 --sessions 1,256 --tokens 48 > $OUT/gen.log 2>&1
  echo "== generate check=$chk: rc $?"; grep -E "^ +(1|256) +[0-9]" $OUT/gen.log | head -2 | cut -c1-120; el
done
for chk in 1 0; do
  NSACTOR_KERNEL_BOUNDS_CHECK=$chk timeout 110 nsactor bench train --config $CFG --backend cuda --precision bf16 --batch-size 14 --accumulation 1 --keep-activations 0 --warmup 1 --steps 3 > $OUT/train-$chk.log 2>&1
  echo "== train check=$chk: rc $?"; grep -E "tokens/s|median|GEMM" $OUT/train-$chk.log | tail -4 | cut -c1-170; el
done
