#!/usr/bin/env bash
# Issues 62 and 63 on the GPU: two streams on one device. Two pipeline stages (or two
# data-parallel replicas) placed on device 0 each run on their own worker thread, so on their
# own CUDA stream; the decoder keeps one cohort in flight per stage and 1F1B one micro-batch per
# stage. Does one stage's latency-bound work (scans, norms, halting) overlap the other's GEMMs?
# Each layout against one stage on the same machine (0.9B, fresh weights, bf16). Run from the
# repository root on the device machine, with `.device/` carried holding new/nsactor.xz and
# new/libnsactor_backend_cuda.so.xz (stripped release builds, xz'd).
# RUNS: "name|bench-subcommand args;…" (config, backend and precision are added); the default
# is the whole comparison. TO: seconds each run may take (200). What each run printed comes
# back under $OUT, with its key lines here.
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-2s CUDA_CACHE_PATH=/tmp/cache-2s/nv
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
t0=$(date +%s); el() { echo "   ($(( $(date +%s) - t0 )) s)"; }
TRAIN="train --warmup 1 --steps 3 --keep-activations auto"
DEFAULT="g1|generate --sessions 1,256,512,1024 --tokens 32"
DEFAULT+=";g2|generate --pipeline 2 --sessions 256,512,1024 --tokens 32"
DEFAULT+=";g3|generate --pipeline 2 --max-num-seqs 128 --sessions 256 --tokens 32"
DEFAULT+=";t1|$TRAIN --batch-size 4 --accumulation 4"
DEFAULT+=";t2|$TRAIN --batch-size 4 --accumulation 4 --pipeline 2"
DEFAULT+=";t3|$TRAIN --batch-size 2 --accumulation 4 --data-parallel 2"
IFS=';' read -ra R <<< "${RUNS:-$DEFAULT}"
for r in "${R[@]}"; do
  n=${r%%|*}; args=${r#*|}; sub=${args%% *}; rest=${args#* }
  timeout ${TO:-200} nsactor bench $sub --config $ROOT/configs/neuronspark-0.9b.toml \
    --backend cuda --precision bf16 $rest > $OUT/$n.log 2>&1
  echo "== $n (bench $args): rc $?"
  grep -vE "INFO|WARN|batch-invariant GEMM|^\s*$" $OUT/$n.log \
    | grep -E "median step|device time|GEMM|sessions|^ +[0-9]|step p50|tokens/s|kept|memory|rror|panick|pipeline" \
    | cut -c1-300 | tail -${LINES_EACH:-22}
  nvidia-smi --query-gpu=memory.used --format=csv,noheader; el
done
