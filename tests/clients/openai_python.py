# The official OpenAI Python client (`pip install openai`) against a running `nsactor serve`:
#   nsactor train --steps 20 --out /tmp/run
#   nsactor serve --checkpoint /tmp/run --addr 127.0.0.1:18080 --api-key sk-py &
#   python3 tests/clients/openai_python.py [http://127.0.0.1:18080/v1] [sk-py]
# CI drives the server with the Rust async-openai client instead
# (actors/server/tests/real_client.rs); this is the same check with OpenAI's own library.
import openai, sys
base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:18080/v1"
key = sys.argv[2] if len(sys.argv) > 2 else "sk-py"
c = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
m = c.models.list().data[0].id
r = c.completions.create(model=m, prompt="Emma was", max_tokens=8, n=2, logprobs=2, seed=1)
print("completions n=2 logprobs=2:", [ch.text for ch in r.choices], r.usage.completion_tokens,
      len(r.choices[0].logprobs.tokens), r.choices[0].logprobs.top_logprobs[0])
r = c.completions.create(model=m, prompt="Emma was a girl", max_tokens=0, echo=True, logprobs=0)
print("echo score:", r.choices[0].logprobs.token_logprobs, r.choices[0].finish_reason)
r = c.completions.create(model=m, prompt="Emma was a girl", max_tokens=0,
        extra_body={"prompt_logprobs": 1})
print("vLLM prompt_logprobs:", r.choices[0].model_extra["prompt_logprobs"][:3])
r = c.completions.create(model=m, prompt="Emma was", max_tokens=4,
        extra_body={"return_token_ids": True})
print("vLLM return_token_ids:", r.choices[0].model_extra["prompt_token_ids"],
      r.choices[0].model_extra["token_ids"], repr(r.choices[0].text))
s = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=2)
chunks = list(s)
print("chat stream include_usage:", len(chunks), "chunks; usage", chunks[-1].usage, "last choices", chunks[-1].choices)
r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"10": -100}, user="u", n=3)
print("chat n=3 penalties:", [ch.message.content for ch in r.choices], r.usage)
for bad in [dict(max_tokens=-1), dict(top_p=2), dict(extra_body={"frobnicate": 1}), dict(n=99)]:
    try:
        c.completions.create(model=m, prompt="x", **bad)
        print("ACCEPTED", bad)
    except openai.BadRequestError as e:
        print("400", bad, "->", e.body.get("param"), "|", e.body.get("message")[:70])
try:
    openai.OpenAI(base_url=base, api_key="nope", max_retries=0).models.list()
except openai.AuthenticationError as e:
    print("401:", e.body)
try:
    c.completions.create(model="gpt-4o", prompt="x")
except openai.NotFoundError as e:
    print("404:", e.body)
