#!/bin/bash
# lm-evaluation-harness (pip install "lm-eval[api]", 0.4.13; no torch needed) against the real
# `nsactor serve` of a tiny model, in every mode: tokenized_requests true and false, batch sizes
# 1 and 8, on three local tasks (multiple choice, loglikelihood_rolling, generate_until); then
# check.py holds its log-likelihoods against the server's own scoring.
#   tests/clients/lm_eval/run.sh [path/to/nsactor]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-target/release/nsactor}
work=$(mktemp -d)
trap 'kill $server 2>/dev/null || true; rm -rf "$work"' EXIT
"$bin" train --steps 30 --out "$work/run" > "$work/train.log" 2>&1
port=18190
# With an API key, as a shared server runs: the harness sends it (OPENAI_API_KEY) on the
# completions; its remote tokenizer calls /tokenizer_info, /tokenize and /detokenize without it,
# which stay open as vLLM leaves them.
export OPENAI_API_KEY=sk-lm-eval NSACTOR_CHECK_KEY=sk-lm-eval
"$bin" serve --checkpoint "$work/run" --addr 127.0.0.1:$port --api-key "$OPENAI_API_KEY" > "$work/serve.log" 2>&1 &
server=$!
python3 - "$port" <<'PY'
import sys, time, urllib.request
for _ in range(100):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health"); break
    except Exception:
        time.sleep(0.2)
PY
mkdir -p "$work/tasks"
cp "$here"/*.jsonl "$work/tasks/"
for t in my_mc my_ppl my_gen; do sed "s#@DIR@#$work/tasks#" "$here/$t.yaml.in" > "$work/tasks/$t.yaml"; done
for tr in True False; do
  for bs in 1 8; do
    echo "=== tokenized_requests=$tr batch_size=$bs"
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python3 -m lm_eval --model local-completions \
      --model_args "model=run,base_url=http://127.0.0.1:$port/v1/completions,tokenizer_backend=remote,tokenized_requests=$tr,num_concurrent=1,max_retries=1" \
      --tasks my_mc,my_ppl,my_gen --include_path "$work/tasks" --batch_size $bs \
      --output_path "$work/out-$tr-$bs" --log_samples 2>&1 | grep -E '^\|'
    mode=$([ $tr = True ] && echo tokenized || echo text)
    python3 "$here/check.py" "$work/out-$tr-$bs" "http://127.0.0.1:$port" $mode
  done
done
