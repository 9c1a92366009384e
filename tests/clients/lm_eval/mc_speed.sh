#!/bin/bash
# lm-evaluation-harness's multiple choice against `nsactor serve`, prompts scored through the
# prefix cache and without it (`--prefix-cache-score-mib 0`), a fresh server for each run: wall
# time, accuracy and what /metrics says the cache saved. 60 generated questions of four one-word
# answers, each behind one ~330-token description (as MMLU's subject line and fixed few-shot
# examples put the same text before every question of a subject). A benchmark, not a test:
#   tests/clients/lm_eval/mc_speed.sh [path/to/nsactor] [batch sizes, default "1 8"]
set -euo pipefail
bin=${1:-target/release/nsactor}; sizes=${2:-1 8}
work=$(mktemp -d); port=18192
trap 'kill $server 2>/dev/null || true; rm -rf "$work"' EXIT
server=
"$bin" train --steps 30 --out "$work/run" > "$work/train.log" 2>&1
python3 - "$work" <<'PY'
import json, random, sys
work = sys.argv[1]
random.seed(7)
words = ("the a cat dog sat on mat ran to house tree sun moon star big small red blue green "
         "old new quick slow happy sad little girl boy went saw found").split()
def sent(n): return " ".join(random.choice(words) for _ in range(n))
with open(f"{work}/mc.jsonl", "w") as f:
    for i in range(60):
        q = sent(random.randint(40, 80)).capitalize() + " and then the"
        f.write(json.dumps({"question": q, "choices": [random.choice(words) for _ in range(4)],
                            "label": random.randrange(4)}) + "\n")
pre = "The following are stories with their next word. " + ". ".join(sent(30) for _ in range(8)) + "."
open(f"{work}/mc_speed.yaml", "w").write(f"""task: mc_speed
dataset_path: json
dataset_kwargs:
  data_files:
    test: {work}/mc.jsonl
test_split: test
output_type: multiple_choice
description: {json.dumps(pre + chr(10) + chr(10))}
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
metadata:
  version: 1.0
""")
PY
for mode in on off; do
  extra=""; [ $mode = off ] && extra="--prefix-cache-score-mib 0"
  for bs in $sizes; do
    "$bin" serve --checkpoint "$work/run" --addr 127.0.0.1:$port $extra > "$work/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 100); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 0.2; done
    t0=$(date +%s.%N)
    acc=$(HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python3 -m lm_eval --model local-completions \
      --model_args "model=run,base_url=http://127.0.0.1:$port/v1/completions,tokenizer_backend=remote,tokenized_requests=True,num_concurrent=1,max_retries=1" \
      --tasks mc_speed --include_path "$work" --batch_size $bs 2>&1 | grep -E '^\|mc_speed' | awk -F'|' '{print $8}')
    t1=$(date +%s.%N)
    m=$(curl -s http://127.0.0.1:$port/metrics | grep -E '^nsactor_prefix_cache_(tokens_saved_total|hits_total|misses_total) ' | awk '{printf "%s %s  ", $1, $2}')
    printf "cache %-3s batch %s: %6.1f s, acc %s; %s\n" $mode $bs "$(echo "$t1 - $t0" | bc)" "$acc" "$m"
    kill $server; wait $server 2>/dev/null || true
  done
done
