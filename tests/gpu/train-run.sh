#!/usr/bin/env bash
# Issue 63 on the GPU: the 30-step `nsactor train` of sessions 49-59 (0.9B, bf16, batch 14 x 511,
# a checkpoint every 10, `keep_checkpoints = 2`, shards of the first 6.0 MB of corpus/en.txt with
# the reference tokenizer), each run cold (its own empty kernel, pick and driver caches) with
# every kernel compile logged (CUBECL_COMPILE_LOG=1); `bench train` beside it; and a server's
# cold start to ready. Run from the repository root on the device machine, with `.device/`
# carried, holding:
#   new/nsactor.xz, new/libnsactor_backend_cuda.so.xz   stripped release builds, xz'd
#   en6m.txt.xz        head -c 6000000 of corpus/en.txt, xz'd (1.5 MB)
#   tokenizer.json     the reference tokenizer (shared/reference/tokenizer.json)
# PART: any of run, disk, ckpt, bench, serve (default run). ENVS: one run per item, `;`-separated, each
# item the extra environment of its run (`none` for none; e.g. ENVS="none;NSACTOR_BATCH_INVARIANT=on":
# the second run's sample times the batch-invariant GEMMs' candidates first, as every run did
# before s61). Each run is cold unless CACHE=shared (see `cold` below). What each run wrote comes
# back under $OUT: its log, metrics.jsonl, the device's memory in use every 100 ms beside it,
# and a table printed last (8 files with PART="run bench serve" and two runs: the device tool's
# limit).
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache
W=/tmp/w; mkdir -p $W; cd $W
cp $D/tokenizer.json .
xz -dc $D/en6m.txt.xz > en.txt
sed -e 's/^steps = .*/steps = 30/' -e 's/^batch_size = .*/batch_size = 14/' \
    -e 's/^accumulation = .*/accumulation = 1/' -e 's/^log_interval = .*/log_interval = 1/' \
    $ROOT/configs/neuronspark-0.9b.toml > b14.toml
echo 'keep_checkpoints = 2' >> b14.toml
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
# Seconds since the time of day $1 (the device machine has no `bc`).
since() { python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.2f}')" "$1"; }
# A run's own empty kernel, pick and driver caches (emptied first: a warm machine may hold an
# earlier call's); with CACHE=shared every run (and `bench train` after them) shares one, so the
# first run is cold and those after it warm.
cold() {
  local c=/tmp/cache-$1
  if [ "${CACHE:-}" = shared ]; then c=/tmp/cache-shared; else rm -rf $c; fi
  export XDG_CACHE_HOME=$c CUDA_CACHE_PATH=$c/nv
}
if [[ "${PART:-run}" == *run* ]]; then
  t=$(date +%s.%N)
  nsactor data prepare --tokenizer tokenizer.json --out shards en.txt > prep.log 2>&1 || tail prep.log
  echo "prepare $(since $t) s"
  IFS=';' read -ra envs <<< "${ENVS:-none}"
  for r in $(seq 1 ${#envs[@]}); do
    e=${envs[$((r-1))]}; [ "$e" = none ] && e=""
    rm -rf runs; cold run$r
    t=$(date +%s.%N)
    echo "== run $r: ${e:-no extra environment}"
    # Device memory, SM clock, power and utilisation beside the run every 100 ms, to set beside
    # each step (is a step beside a checkpoint slower on the GPU, at a lower clock, or idle?).
    nvidia-smi --query-gpu=timestamp,memory.used,clocks.sm,power.draw,utilization.gpu \
      --format=csv,noheader,nounits -lms 100 > $OUT/mem-run$r.csv 2>/dev/null &
    mon=$!
    t0=$(date +%s.%N)
    env $e CUBECL_COMPILE_LOG=1 nsactor train --config b14.toml --backend cuda --precision bf16 \
      --data shards --tokenizer tokenizer.json --checkpoint-every 10 ${TRAIN_ARGS:-} > $OUT/run$r.log 2>&1
    rc=$?
    kill $mon 2>/dev/null
    echo "== run $r: rc $rc wall $(since $t) s;" \
      "$(grep -c ' compiled in' $OUT/run$r.log) kernels compiled"
    m=$(find runs -name metrics.jsonl | head -1); cp "$m" $OUT/run$r-metrics.jsonl
    grep -E "after the last step|sample in|startup|tokens/s; weights|probed in| MB/s; reading" $OUT/run$r.log \
      | cut -c1-300
    python3 - $OUT/run$r-metrics.jsonl $OUT/run$r.log $OUT/mem-run$r.csv $t0 <<'PY'
import json, re, sys, datetime, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
# Each step's mean SM clock (MHz), power (W) and utilisation (%) from the samples inside it.
samples = []
for l in open(sys.argv[3]):
    f = [x.strip() for x in l.split(',')]
    try:
        t = datetime.datetime.strptime(f[0], '%Y/%m/%d %H:%M:%S.%f').timestamp()
        samples.append((t, float(f[2]), float(f[3]), float(f[4])))
    except (ValueError, IndexError):
        pass
t0, prev = float(sys.argv[4]), None
steps = [d for d in rows if 'step_s' in d]
med = statistics.median(d['step_s'] for d in steps) if steps else 0
for d in steps:
    end = t0 + d['wall_s']; start = end - d['step_s']
    inside = [s for s in samples if start <= s[0] < end]
    if inside and med:
        n = len(inside)
        print(f"step {d['step']:>2} {d['step_s']:.3f} s ({100 * (d['step_s'] / med - 1):+5.1f} %)"
              f" clock {sum(s[1] for s in inside) / n:6.0f} MHz power {sum(s[2] for s in inside) / n:5.0f} W"
              f" util {sum(s[3] for s in inside) / n:5.1f} % ({n} samples)")
for d in rows:
    if 'step_s' in d:
        print(f"{d['step']} {d['step_s']:.3f} {d['wall_s']:.2f}", end=' | ')
    elif d.get('event') in ('startup', 'end'):
        print('\n', d)
print()
# compile time by second of the log (time of day), to set beside the steps
ms = {}
for l in open(sys.argv[2]):
    m = re.match(r'(\d\d:\d\d:\d\d)\.\d+ nsactor: kernel (\S+) (compiled|loaded from the cache) in ([\d.]+) ms', l)
    if m:
        ms.setdefault(m.group(1), [0, 0.0])
        ms[m.group(1)][0] += 1
        ms[m.group(1)][1] += float(m.group(4))
print('compiles by second (count, ms):', ' '.join(f"{k}:{n}/{t:.0f}" for k, (n, t) in sorted(ms.items())))
PY
  done
fi
if [[ "${PART:-run}" == *disk* ]]; then
  # The disk's own write rate where the checkpoints go, beside their figures: 10.7 GB (a 0.9B
  # checkpoint's size) written direct, then through the page cache with an fsync at the end.
  for mode in oflag=direct conv=fsync; do
    t=$(date +%s.%N)
    dd if=/dev/zero of=$W/ddtest bs=64M count=160 $mode status=none
    s=$(since $t); rm -f $W/ddtest
    python3 -c "print('disk write ($mode): 10.74 GB in $s s =', round(10.737 / $s, 2), 'GB/s')"
  done
fi
if [[ "${PART:-run}" == *ckpt* ]]; then
  # `bench checkpoint` on the run's shape, once per way of writing (NSACTOR_CHECKPOINT_IO): the
  # disk probes in both ways, a synchronous checkpoint, one beside steps, the final one.
  for m in ${CKPT_MODES:-buffered direct}; do
    echo "== bench checkpoint, NSACTOR_CHECKPOINT_IO=$m"
    NSACTOR_CHECKPOINT_IO=$m nsactor bench checkpoint --config b14.toml --backend cuda \
      --precision bf16 --dir $W/bench-ckpt 2>&1 | grep -vE "^\s*$|INFO|WARN" | tail -14
  done
fi
if [[ "${PART:-run}" == *bench* ]]; then
  nsactor bench train --config b14.toml --backend cuda --precision bf16 --keep-activations auto \
    --steps 3 --no-breakdown 2>&1 | tail -15 | tee $OUT/bench.txt
fi
if [[ "${PART:-run}" == *serve* ]]; then
  cold serve
  t=$(date +%s.%N)
  CUBECL_COMPILE_LOG=1 nsactor bench serve --config $ROOT/configs/neuronspark-0.9b.toml \
    --backend cuda --precision bf16 --temperature 0 --sessions 1 --tokens 16 --protocol ws \
    --after-ready 3 > $OUT/serve.log 2>&1
  echo "== serve: rc $? wall $(since $t) s;" \
    "$(grep -c ' compiled in' $OUT/serve.log) kernels compiled"
  grep -iE "ready|warm|TTFT|tokens/s|probed in" $OUT/serve.log | tail -12 | cut -c1-250
fi
