#!/usr/bin/env bash
# Issue 33 on the GPU at 0.9B (run from a folder holding nsactor, libnsactor_backend_cuda.so and
# neuronspark-0.9b.toml; OUT names where the log goes): the step stall of synchronous and background checkpoints with
# device snapshots (ABI 6), and whether a background snapshot holds the step it was taken at.
cd "${DIR:-$(dirname "$0")}"
OUT=${OUT:-$PWD}
export NSACTOR_PLUGIN_PATH=$PWD
L=$OUT/g3.log
nvidia-smi -L | tee -a $L
df -h /tmp . | tee -a $L
sed -e 's/^steps = .*/steps = 6/' -e 's/^batch_size = .*/batch_size = 4/' \
    -e 's/^accumulation = .*/accumulation = 1/' -e 's/^log_interval = .*/log_interval = 1/' \
    neuronspark-0.9b.toml > ck.toml
(while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; sleep 0.5; done) > $OUT/mem.txt &
MON=$!
for mode in true false; do
  D=/tmp/run-$mode
  rm -rf $D
  sed "s/^\[train\]/[train]\nasync_checkpoint = $mode\nkeep_checkpoints = 2/" ck.toml > ck-$mode.toml
  echo "### async_checkpoint = $mode" | tee -a $L
  /usr/bin/time -f "(%e s, max RSS %M KB)" ./nsactor train --config ck-$mode.toml --backend cuda --precision bf16 \
     --checkpoint-every 3 --out $D 2>&1 | grep -v "^$" | tail -30 | tee -a $L
  cp $D/metrics.jsonl $OUT/metrics-$mode.jsonl
  python3 - $D/metrics.jsonl <<'PY' | tee -a $L
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
steps=[r for r in rows if 'event' not in r]
t=[r['tokens']/r['tokens_per_s'] for r in steps]
dt=[b-a for a,b in zip([0]+t,t)]
for r,d in zip(steps,dt): print(f"step {r['step']:>3} loss {r['loss']:.6f} wall since previous {d:7.2f} s")
for r in rows:
  if r.get('event'): print(r)
PY
  ls $D/checkpoints | tee -a $L
  [ $mode = true ] && rm -rf $D/checkpoints/step-00000006
done
kill $MON
echo "peak GPU memory MiB: $(sort -n $OUT/mem.txt | tail -1)" | tee -a $L
python3 - /tmp/run-true/checkpoints/step-00000003 /tmp/run-false/checkpoints/step-00000003 /tmp/run-false/checkpoints/step-00000006 <<'PY' | tee -a $L
# Background step-3 (A3) against synchronous step-3 (B3) and step-6 (B6): a snapshot that moved
# with training would sit near B6's distance from B3, not at the run-to-run noise.
import json,struct,sys,os,numpy as np
def load(d,f):
    b=open(os.path.join(d,f),'rb').read()
    n=struct.unpack('<Q',b[:8])[0]; h=json.loads(b[8:8+n]); h.pop('__metadata__',None)
    return {k:np.frombuffer(b,dtype=np.float32,count=(v['data_offsets'][1]-v['data_offsets'][0])//4,offset=8+n+v['data_offsets'][0]) for k,v in h.items()}
a3,b3,b6=sys.argv[1:4]
files=sorted(f for f in os.listdir(b3) if f.endswith('.safetensors'))
worst={'A3-B3':0.0,'B6-B3':0.0}; equal=0; total=0; n=0
for f in files:
    A,B,C=load(a3,f),load(b3,f),load(b6,f)
    for k in B:
        total+=1; equal+=int(np.array_equal(A[k],B[k]))
        s=np.abs(B[k]).max()+1e-30
        worst['A3-B3']=max(worst['A3-B3'],float(np.abs(A[k]-B[k]).max()/s))
        worst['B6-B3']=max(worst['B6-B3'],float(np.abs(C[k]-B[k]).max()/s))
print(f"{len(files)} shards, {total} tensors; A3 == B3 bitwise for {equal}; worst relative diff A3-B3 {worst['A3-B3']:.3e}, B6-B3 {worst['B6-B3']:.3e}")
PY
rm -rf /tmp/run-true /tmp/run-false
