# lm-evaluation-harness's log-likelihoods against the server's own scoring of the same tokens:
#   python3 check.py OUT_DIR URL MODE   (MODE: tokenized or text)
# tokenized: the harness sends the text's ids without a BOS, so the server scores the text with
# add_special_tokens false; text: the harness sends text, which the server leads with its BOS.
# The harness's requests go through the prefix cache (a question's answers share its context);
# the server's own scoring here does not (cache_prompt false), so the two paths are compared.
import glob, json, os, sys, urllib.request

out, url, mode = sys.argv[1], sys.argv[2].rstrip("/"), sys.argv[3]


def post(path, body):
    headers = {"Content-Type": "application/json"}
    if os.environ.get("NSACTOR_CHECK_KEY"):
        headers["Authorization"] = "Bearer " + os.environ["NSACTOR_CHECK_KEY"]
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    return json.load(urllib.request.urlopen(req))


worst, n = 0.0, 0
for f in glob.glob(f"{out}/*/samples_my_mc_*.jsonl"):
    for line in open(f):
        s = json.loads(line)
        for key, resp in zip(sorted(s["arguments"]), s["resps"]):
            ctx, cont = s["arguments"][key]["arg_0"], s["arguments"][key]["arg_1"]
            ctx_len = len(post("/tokenize", {"prompt": ctx, "add_special_tokens": False})["tokens"])
            body = {"prompt": ctx + cont, "max_tokens": 0, "echo": True, "logprobs": 0,
                    "cache_prompt": False}
            if mode == "tokenized":
                body["add_special_tokens"] = False
            lp = post("/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"]
            worst = max(worst, abs(sum(lp[ctx_len:]) - float(resp[0][0])))
            n += 1
print(f"{mode}: {n} log-likelihoods, largest |harness - server| = {worst}")
sys.exit(0 if n > 0 and worst == 0.0 else 1)
