#!/usr/bin/env bash
# Issue 63's cold first step, way against way: `train-run.sh`'s run, cold (its own empty kernel
# caches), once per item of ENVS (default: upstream's compile on launch, `CUBECL_COMPILE_AHEAD=0`,
# against the compile-ahead queue), each TRAIN_ARGS long (default 4 steps). Prints per run the
# start-up phases, the kernels compiled, the memory `auto` read after step 1 and each step's
# time, loss and gradient norm (the ways must agree bit for bit: they launch the same kernels in
# the same order). Run from the repository root on the device machine with `.device/` carried
# (see train-run.sh); the run logs come back under $OUT.
set -uo pipefail
RES=${OUT:-/tmp/out}; mkdir -p "$RES"
export OUT=/tmp/cold-out; rm -rf $OUT; mkdir -p $OUT
ENVS=${ENVS:-"CUBECL_COMPILE_AHEAD=0;none"} PART=run TRAIN_ARGS="${TRAIN_ARGS:---steps 4}" \
  bash tests/gpu/train-run.sh > "$RES/train-run.txt" 2>&1
grep -E "^== run" "$RES/train-run.txt"
for f in $OUT/run*.log; do
  r=$(basename "$f" .log)
  echo "== $r"
  grep -E "keep_activations auto: measured" "$f" | head -1 | sed 's/.*auto: //'
  python3 - "$OUT/$r-metrics.jsonl" "$f" <<'PY'
import json, re, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if 'step_s' in d:
        print(f"step {d['step']} {d['step_s']:.3f} s loss {d['loss']!r} grad norm {d['grad_norm']!r}")
    elif d.get('event') == 'startup':
        print('startup', round(d['seconds'], 2), {k: round(v, 2) for k, v in d['phases'].items()})
ms = [float(m.group(1)) for m in re.finditer(r'compiled in ([\d.]+) ms', open(sys.argv[2]).read())]
print(f"{len(ms)} kernels compiled, {sum(ms) / 1e3:.2f} s of compilation summed")
# The compile-ahead queue's drains (CUBECL_COMPILE_LOG): by cause, how many and the wait.
drains = {}
for m in re.finditer(r'queue of (\d+) \((\d+) compiling\) drained for (.+?) in ([\d.]+) ms', open(sys.argv[2]).read()):
    d = drains.setdefault(m.group(3), [0, 0, 0.0])
    d[0] += 1; d[1] += int(m.group(1)); d[2] += float(m.group(4))
for cause, (n, entries, ms_) in sorted(drains.items(), key=lambda x: -x[1][2]):
    print(f"  drained {n}x for {cause}: {entries} entries, {ms_ / 1e3:.2f} s waited")
PY
  xz -c "$f" > "$RES/$r.log.xz"
done
