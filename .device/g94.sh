#!/usr/bin/env bash
# s75: s74's last commits checked on the GPU (g93's checks), and the one-chain MMA GEMM
# against the decoding GEMM: same bits? how fast at one session's rows?
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-s75 CUDA_CACHE_PATH=/tmp/cache-s75/nv
nvidia-smi --query-gpu=name --format=csv,noheader; which nsys ncu 2>&1 | head -2
CFG=$ROOT/configs/neuronspark-0.9b.toml
timeout 120 nsactor bench kernels --backend cuda --precision bf16 --options only=chain,chain_rows=16/64/256/4096,chain_reps=500 > $OUT/chain.log 2>&1
echo "== bench kernels chain: rc $?"; grep -vE "INFO|^\s*$" $OUT/chain.log | tail -50 | cut -c1-150
timeout 60 nsactor verify tiny-a --backend cuda --precision bf16 --fixture $D/fix/tiny_a.safetensors > $OUT/verify.log 2>&1
echo "== verify tiny-a bf16: rc $?"; tail -1 $OUT/verify.log
timeout 100 nsactor bench kernels --backend cuda --precision bf16 --options only=prefill > $OUT/k-prefill.log 2>&1
echo "== bench kernels prefill: rc $?"; grep -vE "INFO|^\s*$" $OUT/k-prefill.log | tail -14 | cut -c1-120
timeout 150 nsactor bench prefill --config $CFG --backend cuda --precision bf16 --lengths 1024,4000 --check 0 --reps 5 > $OUT/prefill.log 2>&1
echo "== prefill: rc $?"; grep -E "^one client" $OUT/prefill.log | cut -c1-110
