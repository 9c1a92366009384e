#!/usr/bin/env bash
# s80: two streams on one GPU. Two pipeline stages (or two data-parallel replicas) on device 0
# each run on their own worker thread, so on their own CUDA stream: does one stage's
# latency-bound work (scans, norms) overlap the other's GEMMs? Decoding (two cohorts in flight)
# and training (micro-batches in flight), each against one stage on the same machine.
# RUNS: "name|bench-subcommand args;..." (config, backend and precision are added).
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-s80 CUDA_CACHE_PATH=/tmp/cache-s80/nv
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
t0=$(date +%s); el() { echo "   ($(( $(date +%s) - t0 )) s)"; }
C=configs/neuronspark-0.9b.toml
IFS=';' read -ra R <<< "$RUNS"
for r in "${R[@]}"; do
  n=${r%%|*}; args=${r#*|}; sub=${args%% *}; rest=${args#* }
  timeout ${TO:-200} nsactor bench $sub --config $C --backend cuda --precision bf16 $rest > $OUT/$n.log 2>&1
  echo "== $n (bench $args): rc $?"
  grep -vE "INFO|WARN|batch-invariant GEMM|^\s*$" $OUT/$n.log | grep -E "median step|device time|GEMM|sessions|^ +[0-9]|step p50|tokens/s|kept|memory|rror|panick|pipeline" | cut -c1-300 | tail -${LINES_EACH:-16}
  nvidia-smi --query-gpu=memory.used --format=csv,noheader; el
done
