#!/usr/bin/env bash
# s75–s76: the one-chain MMA GEMM: its bits against each decoding GEMM's cuBLASLt class (bench
# kernels' chain part), then on the decoding path (NSACTOR_GEMM_CHAIN_ROWS) A/B on one machine:
# one session's step, batch invariance with it on, one client through the server.
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-s75 CUDA_CACHE_PATH=/tmp/cache-s75/nv
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
CFG=$ROOT/configs/neuronspark-0.9b.toml
t0=$(date +%s); el() { echo "   ($(( $(date +%s) - t0 )) s)"; }
timeout 240 nsactor bench kernels --backend cuda --precision bf16 --options only=chain,chain_rows=${CHAIN_BENCH_ROWS:-16/64/256},chain_reps=300,chain_forms=${CHAIN_FORMS:-auto/plain/staged0} > $OUT/chain.log 2>&1
echo "== bench kernels chain: rc $?"; grep -vE "INFO|^\s*$" $OUT/chain.log | tail -100 | cut -c1-150; el
[ "${CHAIN_ONLY:-0}" = 1 ] && exit 0
grep -q "bits class at 0 of" $OUT/chain.log && { echo "no problem in the class: stop"; exit 0; }
for rows in 0 64; do
  NSACTOR_GEMM_CHAIN_ROWS=$rows timeout 80 nsactor bench generate --config $CFG --backend cuda --precision bf16 --sessions 1,4 --tokens 32 > $OUT/gen-$rows.log 2>&1
  echo "== generate chain rows $rows: rc $?"; grep -E "one-chain" $OUT/gen-$rows.log | sort | uniq -c | head -8 | cut -c1-150; grep -E "^ +(1|4|16) +[0-9]" $OUT/gen-$rows.log | head -3 | cut -c1-120; el
done
NSACTOR_GEMM_CHAIN_ROWS=64 timeout 150 nsactor verify batch-invariance --config $CFG --backend cuda --precision bf16 --cohorts 3,17,64 > $OUT/inv.log 2>&1
echo "== batch-invariance (chain 64): rc $?"; tail -3 $OUT/inv.log | cut -c1-160; el
NSACTOR_GEMM_CHAIN_ROWS=64 timeout 90 nsactor verify tiny-a --backend cuda --precision bf16 --fixture $D/fix/tiny_a.safetensors > $OUT/verify.log 2>&1
echo "== verify tiny-a bf16 (chain 64): rc $?"; tail -1 $OUT/verify.log; el
for rows in 64; do
  NSACTOR_GEMM_CHAIN_ROWS=$rows timeout 100 nsactor bench serve --config $CFG --backend cuda --precision bf16 --temperature 0 --sessions 1 --tokens 128 --protocol ws --after-ready 0 > $OUT/serve-$rows.log 2>&1
  echo "== serve 1 client chain rows $rows: rc $?"; grep -E "tokens/s|ITL|digest" $OUT/serve-$rows.log | head -4 | cut -c1-160; el
done
