# Hugging Face transformers on an `nsactor export` directory (its remote code, loaded with
# trust_remote_code) against the real `nsactor serve` of the same directory:
#   python3 check.py HF_DIR URL
# Asserts: AutoConfig / AutoTokenizer / AutoModelForCausalLM load, with no missing or unexpected
# weight names; per-position log-probabilities of prompts of several lengths equal the server's
# echo scoring (max abs difference <= 1e-4); greedy `generate` of 16 tokens equals the server's
# greedy tokens (WebSocket `token_ids`, and the HTTP completion's text and logprobs); the labels
# loss equals the mean of -logprob over the shifted targets; stepwise decoding through the state
# equals the full forward. Exits 1 on any mismatch, after printing every figure.
#
# Spikes are a step function: a neuron whose membrane lands within FLIP of its threshold may fire
# in one implementation and not in the other (two correct fp32 orders of the same sums), and
# every later position of that prompt may then differ. As the parity tests do, a prompt's
# positions before the first such token must agree within TOL; from it on the differences are
# reported with the margin, not failed. A difference before it is a failure.
import json, os, sys, urllib.request

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

logging.disable_progress_bar()

hf_dir, url = sys.argv[1], sys.argv[2].rstrip("/")
TOL, NEW, FLIP = 1e-4, 16, 1e-6
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def post(path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))


name = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]

# --- loading ---
config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=True)
check(type(config).__name__ == "NeuronSparkConfig" and config.model_type == "neuronspark",
      f"AutoConfig: {type(config).__name__} D={config.D} N={config.N} K={config.K} "
      f"layers={config.num_layers} D_ff={config.D_ff} plif_out={config.nsactor_plif_out}")
tok = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
check(tok.bos_token_id == config.bos_token_id, f"AutoTokenizer: {type(tok).__name__}, "
      f"vocab {len(tok)}, bos {tok.bos_token_id} eos {tok.eos_token_id}")
model, info = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True,
                                                   output_loading_info=True)
model.eval()
bad = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
check(not bad and not info.get("error_msgs"),
      f"AutoModelForCausalLM: {type(model).__name__}, {sum(p.numel() for p in model.parameters())}"
      f" parameters, loading problems: {bad or 'none'}")
modeling = sys.modules[type(model).__module__]

# --- prompts of several lengths (token ids: the server reads them as sent, no BOS added) ---
texts = [
    "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years.",
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife.",
    "Mr. Woodhouse was fond of society in his own way. He liked very much to have his friends "
    "come and see him; and from various united causes, from his long residence at Hartfield, "
    "and his good nature, from his fortune, his house, and his daughter, he could command the "
    "visits of his own little circle, in a great measure, as he liked. He had not much "
    "intercourse with any families beyond that circle.",
]
prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
prompts[1] = [config.bos_token_id] + prompts[1]  # one prompt led by the BOS
prompts[2] = prompts[2][:100]


def spike_margins(ids):
    """Per token of `ids`: the smallest |v_pre - v_th| over every threshold comparison in its K
    frames, over every PLIF scan of a forward of `ids`."""
    orig, low = modeling.plif_scan, [torch.full((len(ids),), float("inf"))]

    def recording(beta, u, v_th, v0):
        out = orig(beta, u, v_th, v0)
        prev = torch.cat([v0.to(out.dtype).expand_as(out[:1]), out[:-1]], 0).double()
        v_pre = (beta.double() * prev + u.double()).float()
        per_frame = (v_pre - v_th).abs().flatten(1).min(1).values
        low[0] = torch.minimum(low[0], per_frame.view(len(ids), -1).min(1).values)
        return out

    modeling.plif_scan = recording
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        modeling.plif_scan = orig
    return low[0]


worst = 0.0
for ids in prompts:
    served = post("/v1/completions", {"model": name, "prompt": ids, "echo": True, "logprobs": 5,
                                      "max_tokens": 0})["choices"][0]["logprobs"]
    with torch.no_grad():
        out = model(torch.tensor([ids]), labels=torch.tensor([ids]))
    logp = torch.log_softmax(out.logits[0].double(), -1)
    ours = torch.tensor([logp[t, ids[t + 1]].item() for t in range(len(ids) - 1)], dtype=torch.float64)
    theirs = torch.tensor(served["token_logprobs"][1:], dtype=torch.float64)
    top_theirs = torch.tensor([max(d.values()) for d in served["top_logprobs"][1:]], dtype=torch.float64)
    # Position t scores token t + 1 from the frames of tokens 0..t.
    diff = torch.maximum((ours - theirs).abs(), (logp[:-1].max(-1).values - top_theirs).abs())
    margins = spike_margins(ids)[:-1]
    near = (margins < FLIP).nonzero()
    first_flip = int(near[0]) if len(near) else len(diff)
    strict = diff[:first_flip]
    worst = max(worst, strict.max().item() if len(strict) else 0.0)
    note = f"smallest spike margin {margins.min():.1e}"
    if first_flip < len(diff):
        after = diff[first_flip:]
        note = (f"a neuron {margins[first_flip]:.1e} from its threshold at position {first_flip}: "
                f"positions from it reported, not checked (max {after.max():.3e}, "
                f"{int((after > TOL).sum())} of {len(after)} over {TOL:g})")
    bad = (strict > TOL).nonzero()
    if len(bad):
        note += f"; first difference at position {int(bad[0])}, before any near-threshold neuron"
    check(len(bad) == 0,
          f"{len(ids):3d}-token prompt: max |logprob hf - server| (chosen and top-1) over the first "
          f"{first_flip} of {len(diff)} positions = {strict.max() if len(strict) else 0:.3e}; {note}")
    # The labels loss: transformers' shifted mean against the per-position log-probabilities
    # (held against the server's above).
    loss_ref = (-ours).mean().item()
    check(abs(out.loss.item() - loss_ref) <= TOL,
          f"{len(ids):3d}-token prompt: labels loss {out.loss.item():.6f} vs mean -logprob "
          f"{loss_ref:.6f} (diff {abs(out.loss.item() - loss_ref):.2e})")
print(f"largest |logprob difference| over all prompts: {worst:.3e}")

# --- stateful decoding: token by token through the state = the full forward ---
ids = prompts[1]
with torch.no_grad():
    full = model(torch.tensor([ids])).logits[0]
    state, steps = None, []
    for t in ids:
        logits, state = model.step(torch.tensor([t]), state)
        steps.append(logits[0])
    split = model(torch.tensor([ids[:7]])).state
    rest = model(torch.tensor([ids[7:]]), state=split).logits[0]
d_step = (torch.stack(steps) - full).abs().max().item()
d_split = (rest - full[7:]).abs().max().item()
check(d_step <= 1e-4 and d_split <= 1e-4, f"stateful decoding: step-by-step vs full forward "
      f"max |logit diff| {d_step:.2e}, forward(state=...) after a split {d_split:.2e}")

# --- a batch of equal-length prompts = each alone ---
n = min(len(p) for p in prompts[1:])
with torch.no_grad():
    batch = model(torch.tensor([p[:n] for p in prompts[1:]])).logits
    alone = torch.cat([model(torch.tensor([p[:n]])).logits for p in prompts[1:]])
check((batch - alone).abs().max().item() <= 1e-4,
      f"batch of {len(prompts) - 1} x {n} tokens vs one by one: {(batch - alone).abs().max():.2e}")

# --- greedy generation ---
fed = []
hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append((a[0] if a else kw["input_ids"]).shape[1]),
                                       with_kwargs=True)
for ids in prompts:
    fed[:] = []
    with torch.no_grad():
        g = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None, pad_token_id=config.pad_token_id)
    ours = g[0, len(ids):].tolist()
    steps_fed = list(fed)
    with torch.no_grad():
        g2 = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=config.pad_token_id, use_cache=False)
    theirs = None
    try:
        from websockets.sync.client import connect
        with connect(url.replace("http", "ws", 1) + "/ws") as ws:
            ws.send(json.dumps({"type": "generate", "id": "g", "prompt": ids, "max_tokens": NEW,
                                "temperature": 0, "repetition_penalty": 1.0, "token_ids": True,
                                "ignore_eos": True}))
            theirs = []
            while True:
                ev = json.loads(ws.recv())
                if ev["type"] == "delta":
                    theirs += ev.get("token_ids") or []
                elif ev["type"] == "done":
                    break
                else:
                    raise RuntimeError(ev)
    except ImportError:
        print("     (no `websockets` package: comparing text and logprobs only)")
    http = post("/v1/completions", {"model": name, "prompt": ids, "max_tokens": NEW,
                                    "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                    "repetition_penalty": 1.0})["choices"][0]
    with torch.no_grad():
        lp = torch.log_softmax(model(g).logits[0].double(), -1)
    our_lp = [lp[len(ids) - 1 + i, t].item() for i, t in enumerate(ours)]
    lp_diff = max(abs(a - b) for a, b in zip(our_lp, http["logprobs"]["token_logprobs"]))
    same_text = tok.decode(ours, skip_special_tokens=True) == http["text"]  # as the server shows it
    stateful = steps_fed == [len(ids)] + [1] * (NEW - 1)
    agree = sum(a == b for a, b in zip(ours, theirs or []))
    check((theirs is None or ours == theirs) and same_text and lp_diff <= TOL and stateful
          and g2.tolist() == g.tolist(),
          f"{len(ids):3d}-token prompt: greedy {NEW} tokens, "
          + (f"{agree}/{NEW} equal to the server's ids" if theirs is not None else "ids not checked")
          + f", text {'equal' if same_text else 'DIFFERENT'}, max |logprob diff| {lp_diff:.2e}, "
          f"tokens fed per pass {steps_fed[:3]}..., recompute-each-step "
          f"{'equal' if g2.tolist() == g.tolist() else 'DIFFERENT'}")
    if theirs is not None and ours != theirs:
        print(f"     hf     {ours}\n     server {theirs}")
hook.remove()

print("PASS" if not failures else f"{len(failures)} FAILED")
sys.exit(1 if failures else 0)
