#!/usr/bin/env bash
# Issues 61 and 62 on the GPU: the 0.9B (fresh weights, bf16) served by the real server, its
# clients on loopback. Run from the repository root on the device machine, with `.device/`
# carried holding new/nsactor.xz and new/libnsactor_backend_cuda.so.xz (stripped release
# builds, xz'd).
# PART: any of
#   wave    256 clients sharing a ~2,000-token system prompt after one client (issue 61's wave),
#           traced: each cohort's size, length and time (`nsactor_decoding=trace`) and where
#           its time went (NSACTOR_TRACE_COHORTS=1)
#   plain   the same wave untraced (the figure BENCHMARKS.md records)
#   decode  1 and 256 streaming clients, 128 tokens each, greedy (issue 62's two figures)
#   chunks  64 concurrent 2,000-token prompts (issue 60) at chunks of CHUNKS tokens (default
#           "128 32 16"; 128 is the 0.9B's default): a pass holds 1,024 tokens, so 8 prompts ×
#           128 (each scan 2,048 frames long) or 64 × 16 (256 frames, 8× the rows side by side)
# (default "plain wave"). What each part wrote comes back under $OUT with a summary printed.
set -uo pipefail
ROOT=$PWD; D=$ROOT/.device; B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $B $OUT
for f in nsactor libnsactor_backend_cuda.so; do xz -dc $D/new/$f.xz > $B/$f; done
chmod +x $B/nsactor
export NSACTOR_PLUGIN_PATH=$B PATH=$B:$PATH XDG_CACHE_HOME=/tmp/cache-serve CUDA_CACHE_PATH=/tmp/cache-serve/nv
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
since() { python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.2f}')" "$1"; }
WAVE=(--config $ROOT/configs/neuronspark-0.9b.toml --backend cuda --precision bf16 --turns 1
  --sessions 1,256 --tokens 8 --turn-bytes 60 --system-bytes 5300 --after-ready 0)
PARTS=${PART:-plain wave}
if [[ "$PARTS" == *plain* ]]; then
  t=$(date +%s.%N)
  nsactor bench serve "${WAVE[@]}" > $OUT/wave-plain.log 2>&1
  echo "== plain wave: rc $? wall $(since $t) s"
  grep -E "TTFT|turn|prefix cache|ready" $OUT/wave-plain.log | tail -8 | cut -c1-250
fi
if [[ "$PARTS" == *wave* ]]; then
  t=$(date +%s.%N)
  NSACTOR_LOG=info,nsactor_decoding=trace NSACTOR_TRACE_COHORTS=1 \
    nsactor bench serve "${WAVE[@]}" > $OUT/wave-trace.log 2>&1
  echo "== traced wave: rc $? wall $(since $t) s"
  grep -E "TTFT|     1 |prefix cache" $OUT/wave-trace.log | tail -6 | cut -c1-250
  # The 256-client wave's cohorts, in order: the last 'turn' header starts it.
  python3 - "$OUT/wave-trace.log" <<'EOF'
import re, sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
# The wave runs after the one-client turn: its cohorts follow the first table.
first = next((i for i, l in enumerate(lines) if "clients  TTFT" in l), 0)
cohorts = [l for l in lines[first:] if "cohort of" in l]
prompt = [c for c in cohorts if "× 1 inputs:" not in c]
step = [c for c in cohorts if "× 1 inputs:" in c]
ms = lambda c: float(re.search(r"([\d.]+) ms", c.split("inputs:")[1]).group(1))
print(f"wave: {len(prompt)} prompt cohorts {sum(map(ms, prompt)):.1f} ms, {len(step)} step cohorts {sum(map(ms, step)):.1f} ms")
for c in cohorts[:60]:
    print("  " + c.split("TRACE")[-1].strip()[:120])
EOF
fi
if [[ "$PARTS" == *decode* ]]; then
  t=$(date +%s.%N)
  nsactor bench serve --config $ROOT/configs/neuronspark-0.9b.toml --backend cuda --precision bf16 \
    --temperature 0 --sessions 1,256 --tokens 128 --protocol ws,sse --after-ready 0 > $OUT/decode.log 2>&1
  echo "== decode: rc $? wall $(since $t) s"
  grep -E "tokens/s|TTFT|clients|ws |sse " $OUT/decode.log | tail -12 | cut -c1-250
fi
if [[ "$PARTS" == *chunks* ]]; then
  for c in ${CHUNKS:-128 32 16}; do
    t=$(date +%s.%N)
    nsactor bench prefill --config $ROOT/configs/neuronspark-0.9b.toml --backend cuda --precision bf16 \
      --lengths 1024 --concurrent 64x2000 --score 0 --check 0 --reps 1 --memory \
      --prefill-chunk-tokens $c > $OUT/chunks-$c.log 2>&1
    echo "== chunks of $c: rc $? wall $(since $t) s"
    grep -E "64 ?x ?2000|64 × 2|tokens/s" $OUT/chunks-$c.log | tail -3 | cut -c1-250
  done
fi
