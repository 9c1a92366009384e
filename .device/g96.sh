#!/usr/bin/env bash
# s77: the one-chain GEMM's forms against cuBLASLt (bits and times) at 16/64/1024 rows, then one
# session's step accounted for part by part (bench decode-profile).
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-s77 CUDA_CACHE_PATH=/tmp/cache-s77/nv
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
t0=$(date +%s); el() { echo "   ($(( $(date +%s) - t0 )) s)"; }
timeout 300 nsactor bench kernels --backend cuda --precision bf16 --options only=chain,chain_rows=${CHAIN_BENCH_ROWS:-16/64},chain_reps=300,chain_forms=${CHAIN_FORMS:-auto/plain/staged0} > $OUT/chain.log 2>&1
echo "== bench kernels chain: rc $?"; grep -vE "INFO|^\s*$" $OUT/chain.log | grep -v "batch-invariant GEMM" | tail -100 | cut -c1-150; el
for opt in batch=1,tokens=1,reps=200; do
  timeout 120 nsactor bench decode-profile --backend cuda --precision bf16 --options $opt > $OUT/prof-$opt.log 2>&1
  echo "== decode-profile $opt: rc $?"; grep -vE "INFO|batch-invariant GEMM" $OUT/prof-$opt.log | tail -60 | cut -c1-160; el
done
