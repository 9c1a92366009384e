//! vLLM's extra sampling parameters on `/v1/completions`, over loopback: `stop_token_ids`,
//! `min_tokens`, `include_stop_str_in_output`, `skip_special_tokens`, `truncate_prompt_tokens`,
//! `allowed_token_ids` and `min_p`; the refusals name their field.

mod common;

use common::{http, serve};
use serde_json::{Value, json};

/// The completion for `req`, asserting a 200.
async fn complete(addr: std::net::SocketAddr, req: Value) -> Value {
    let (status, body) = http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
    assert_eq!(status, 200, "{req}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// The error for `req`, asserting a 400 that names `param`.
async fn refused(addr: std::net::SocketAddr, req: Value, param: &str) -> String {
    let (status, body) = http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
    assert_eq!(status, 400, "{req}: {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["param"], param, "{body}");
    v["error"]["message"].as_str().unwrap().to_string()
}

fn ended(v: &Value) -> (String, u64) {
    (
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

#[test]
fn vllm_sampling_extras_do_what_vllm_says() {
    let s = serve(4, 8);
    let (addr, prompt, greedy) = (s.addr, s.prompt.clone(), s.greedy.clone());
    s.pipeline.block_on(async move {
        let n_new = greedy.len() - prompt.len();
        let x = greedy[prompt.len()];
        // A token forced every step ends at once as a stop token id, and only after
        // `min_tokens` when it is banned until then.
        let forced = |extra: Value| {
            let mut req = json!({"prompt": prompt, "max_tokens": 8, "ignore_eos": true,
                "logit_bias": {x.to_string(): 100}, "stop_token_ids": [x]});
            req.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            req
        };
        let v = complete(addr, forced(json!({}))).await;
        assert_eq!(ended(&v), ("stop".into(), 1), "{v}");
        // vLLM's `stop_reason` names the stop token id.
        assert_eq!(v["choices"][0]["stop_reason"], x, "{v}");
        let v = complete(addr, forced(json!({"min_tokens": 3}))).await;
        assert_eq!(ended(&v), ("stop".into(), 4), "{v}");
        let v = complete(addr, forced(json!({"stop_token_ids": []}))).await;
        assert_eq!(ended(&v), ("length".into(), 8), "{v}");

        // A stop string: the text before it, or with it where asked.
        let whole = complete(
            addr,
            json!({"prompt": prompt, "max_tokens": n_new, "temperature": 0, "ignore_eos": true}),
        )
        .await;
        let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        assert!(
            chars.len() >= 6,
            "the fixture's greedy text is long enough: {text:?}"
        );
        let (at, end) = (chars[3].0, chars[5].0);
        let stop = &text[at..end];
        let first = text.find(stop).unwrap();
        for (include, want) in [(false, &text[..first]), (true, &text[..first + stop.len()])] {
            let v = complete(
                addr,
                json!({"prompt": prompt, "max_tokens": n_new, "temperature": 0,
                    "ignore_eos": true, "stop": [stop], "include_stop_str_in_output": include}),
            )
            .await;
            assert_eq!(v["choices"][0]["text"], want, "include {include}: {v}");
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            assert_eq!(v["choices"][0]["stop_reason"], stop, "{v}");
        }

        // Special tokens in the text only where asked: `<|im_end|>` (4), forced.
        for (skip, want) in [(true, String::new()), (false, "<|im_end|>".repeat(2))] {
            let v = complete(
                addr,
                json!({"prompt": prompt, "max_tokens": 2, "ignore_eos": true,
                    "logit_bias": {"4": 100}, "skip_special_tokens": skip}),
            )
            .await;
            assert_eq!(v["choices"][0]["text"], want.as_str(), "skip {skip}: {v}");
        }

        // The prompt's last k tokens.
        for (k, read) in [(json!(3), 3), (json!(-1), prompt.len())] {
            let v = complete(
                addr,
                json!({"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": k}),
            )
            .await;
            assert_eq!(v["usage"]["prompt_tokens"], read, "truncate {k}: {v}");
        }

        // Only the allowed tokens are drawn, whatever the sampling.
        let y = greedy[prompt.len() + 1];
        let pieces = |id: i64| async move {
            let (_, body) = http(
                addr,
                "POST",
                "/detokenize",
                json!({"tokens": [id]}).to_string().as_bytes(),
            )
            .await;
            serde_json::from_str::<Value>(&body).unwrap()["prompt"]
                .as_str()
                .unwrap()
                .to_string()
        };
        let allowed = [pieces(x).await, pieces(y).await];
        let v = complete(
            addr,
            json!({"prompt": prompt, "max_tokens": 12, "temperature": 1.5, "seed": 7,
                "ignore_eos": true, "allowed_token_ids": [x, y], "logprobs": 0}),
        )
        .await;
        let tokens = v["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), 12, "{v}");
        for t in tokens {
            assert!(
                allowed.iter().any(|a| a == t),
                "{t} not in {allowed:?}: {v}"
            );
        }
        // min_p = 1 keeps only the most likely token: sampling hot gives the greedy text.
        let v = complete(
            addr,
            json!({"prompt": prompt, "max_tokens": n_new, "temperature": 1.8, "seed": 3,
                "ignore_eos": true, "min_p": 1.0}),
        )
        .await;
        assert_eq!(v["choices"][0]["text"], text.as_str(), "{v}");
        let hot = complete(
            addr,
            json!({"prompt": prompt, "max_tokens": n_new, "temperature": 1.8, "seed": 3,
                "ignore_eos": true}),
        )
        .await;
        assert_ne!(
            hot["choices"][0]["text"],
            text.as_str(),
            "hot sampling strays: {hot}"
        );

        // Refusals name their field.
        for (req, param, says) in [
            (
                json!({"prompt": prompt, "max_tokens": 2, "min_tokens": 3}),
                "min_tokens",
                "at most max_tokens",
            ),
            (
                json!({"prompt": prompt, "truncate_prompt_tokens": 0}),
                "truncate_prompt_tokens",
                "-1 or at least 1",
            ),
            (
                json!({"prompt": prompt, "stop_token_ids": [100000]}),
                "stop_token_ids",
                "outside the vocabulary",
            ),
            (
                json!({"prompt": prompt, "allowed_token_ids": []}),
                "allowed_token_ids",
                "at least one",
            ),
            (
                json!({"prompt": prompt, "allowed_token_ids": [-1]}),
                "allowed_token_ids",
                "negative",
            ),
            (json!({"prompt": prompt, "min_p": 1.5}), "min_p", "[0, 1]"),
        ] {
            let e = refused(addr, req, param).await;
            assert!(e.contains(says), "{param}: {e}");
        }
    });
}

/// The prompt's log-probabilities in vLLM's shape (`prompt_logprobs`) on both endpoints, the
/// same numbers as `echo`'s; and the WebSocket takes the same extras as the OpenAI bodies.
#[test]
fn prompt_logprobs_and_the_websocket_extras() {
    use common::{connect, generate, next_json};
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::Message;
    let s = serve(4, 8);
    let (addr, prompt, greedy) = (s.addr, s.prompt.clone(), s.greedy.clone());
    s.pipeline.block_on(async move {
        // Scored alone: no text, no generated tokens, every prompt token with its rank.
        let v = complete(
            addr,
            json!({"prompt": prompt, "max_tokens": 0, "prompt_logprobs": 2}),
        )
        .await;
        let c = &v["choices"][0];
        assert_eq!(
            (c["text"].as_str(), &c["logprobs"]),
            (Some(""), &Value::Null),
            "{v}"
        );
        let plp = c["prompt_logprobs"].as_array().unwrap();
        assert_eq!(plp.len(), prompt.len(), "{v}");
        assert!(plp[0].is_null());
        let echo = complete(
            addr,
            json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 2}),
        )
        .await;
        let echoed = echo["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .clone();
        for (i, pos) in plp.iter().enumerate().skip(1) {
            let m = pos.as_object().unwrap();
            let own = &m[&prompt[i].to_string()];
            assert_eq!(own["logprob"], echoed[i], "position {i}: {pos}");
            assert!(own["rank"].as_u64().unwrap() >= 1, "{pos}");
            assert!(own["decoded_token"].is_string(), "{pos}");
            // The token and two alternatives at most; the most likely ranks first.
            assert!((2..=3).contains(&m.len()), "{pos}");
            assert!(m.values().any(|e| e["rank"] == 1), "{pos}");
            let best = m.values().filter_map(|e| e["logprob"].as_f64());
            let best = best.fold(f64::NEG_INFINITY, f64::max);
            for e in m.values() {
                let r = e["rank"].as_u64().unwrap();
                assert_eq!(r == 1, e["logprob"].as_f64().unwrap() == best, "{pos}");
            }
        }
        let e = refused(
            addr,
            json!({"prompt": prompt, "prompt_logprobs": 1, "stream": true}),
            "prompt_logprobs",
        )
        .await;
        assert!(e.contains("not streamed"), "{e}");

        // The WebSocket: a `prompt` event with the same numbers, before `done`.
        let mut ws = connect(addr).await;
        let req = json!({"type": "generate", "id": "p", "prompt": prompt, "max_tokens": 0,
            "prompt_logprobs": 2});
        ws.send(Message::Text(req.to_string().into()))
            .await
            .unwrap();
        let m = next_json(&mut ws).await;
        assert_eq!(m["type"], "prompt", "{m}");
        assert_eq!(m["token_ids"], json!(prompt), "{m}");
        let lps = m["logprobs"].as_array().unwrap();
        assert!(lps[0].is_null(), "{m}");
        for (i, l) in lps.iter().enumerate().skip(1) {
            assert_eq!(l["token_id"], prompt[i], "{m}");
            // The same f32 (JSON writes it shorter here than OpenAI's f64 form).
            let f32_of = |v: &Value| v.as_f64().unwrap() as f32;
            assert_eq!(
                f32_of(&l["logprob"]),
                f32_of(&echoed[i]),
                "position {i}: {m}"
            );
            assert_eq!(l["top"].as_array().unwrap().len(), 2, "{m}");
        }
        let done = next_json(&mut ws).await;
        assert_eq!(done["type"], "done", "{done}");
        assert_eq!(done["usage"]["completion_tokens"], 0, "{done}");

        // A forced stop token is banned until `min_tokens`, then ends the generation.
        let x = greedy[prompt.len()];
        let (_, ids, done) = generate(
            &mut ws,
            json!({"type": "generate", "id": "f", "prompt": prompt, "max_tokens": 8,
                "ignore_eos": true, "logit_bias": {x.to_string(): 100}, "stop_token_ids": [x],
                "min_tokens": 3, "token_ids": true}),
        )
        .await;
        assert_eq!(done["finish_reason"], "stop", "{done}");
        assert_eq!(ids.len(), 4, "{ids:?}");
        assert!(ids[3] == x && !ids[..3].contains(&x), "{ids:?}");
        let n_new = greedy.len() - prompt.len();
        let (_, ids, _) = generate(
            &mut ws,
            json!({"type": "generate", "id": "h", "prompt": prompt, "max_tokens": n_new,
                "temperature": 1.8, "seed": 3, "ignore_eos": true, "min_p": 1.0,
                "token_ids": true}),
        )
        .await;
        assert_eq!(ids, greedy[prompt.len()..], "min_p 1 over the WebSocket");
        // Refusals name their field, as on HTTP.
        for (req, says) in [
            (
                json!({"truncate_prompt_tokens": 0}),
                "truncate_prompt_tokens",
            ),
            (json!({"logit_bias": {"x": 1}}), "logit_bias"),
            (json!({"min_tokens": 9, "max_tokens": 2}), "min_tokens"),
            (json!({"prompt_logprobs": 50}), "prompt_logprobs"),
        ] {
            let mut r = json!({"type": "generate", "id": "e", "prompt": prompt});
            r.as_object_mut()
                .unwrap()
                .extend(req.as_object().unwrap().clone());
            ws.send(Message::Text(r.to_string().into())).await.unwrap();
            let m = next_json(&mut ws).await;
            assert_eq!(m["type"], "error", "{m}");
            assert!(m["message"].as_str().unwrap().contains(says), "{says}: {m}");
        }
    });
}

/// With text prompts (the embedded tiny config and the bundled tokenizer): a chat's
/// `prompt_logprobs` is the answer's, and the WebSocket leaves the BOS out where asked.
#[test]
fn text_prompts_take_prompt_logprobs_and_the_bos_choice() {
    use common::{connect, generate};
    let s = common::serve_model(4, 8, false);
    let addr = s.addr;
    s.pipeline.block_on(async move {
        // On chat, the answer's.
        let (status, body) = http(
            addr,
            "POST",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "prompt_logprobs": 0})
            .to_string()
            .as_bytes(),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let chat: Value = serde_json::from_str(&body).unwrap();
        let plp_chat = chat["prompt_logprobs"].as_array().unwrap();
        assert!(plp_chat.len() > 3 && plp_chat[0].is_null(), "{chat}");
        assert!(plp_chat[1].as_object().unwrap().len() == 1, "{chat}");
        // `return_token_ids` on chat: the prompt's on the answer, the choice's own.
        let (status, body) = http(
            addr,
            "POST",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "return_token_ids": true})
            .to_string()
            .as_bytes(),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let chat: Value = serde_json::from_str(&body).unwrap();
        let ids = chat["prompt_token_ids"].as_array().unwrap();
        assert_eq!(ids.len() as u64, chat["usage"]["prompt_tokens"], "{chat}");
        let own = chat["choices"][0]["token_ids"].as_array().unwrap();
        assert_eq!(
            own.len() as u64,
            chat["usage"]["completion_tokens"],
            "{chat}"
        );
        let mut ws = connect(addr).await;
        // A text prompt without its BOS reads one token fewer.
        let mut read = Vec::new();
        for bos in [true, false] {
            let (_, _, done) = generate(
                &mut ws,
                json!({"type": "generate", "id": "b", "prompt": "Emma was", "max_tokens": 1,
                    "add_special_tokens": bos}),
            )
            .await;
            read.push(done["usage"]["prompt_tokens"].as_u64().unwrap());
        }
        assert_eq!(read[0], read[1] + 1, "{read:?}");
    });
}

/// vLLM's `return_token_ids`: the prompt's ids and each choice's generated ones (the end
/// token that stopped it included), whole and streamed.
#[test]
fn return_token_ids_gives_the_prompt_and_the_generated_ids() {
    let s = serve(4, 8);
    let (addr, prompt, greedy) = (s.addr, s.prompt.clone(), s.greedy.clone());
    s.pipeline.block_on(async move {
        let n_new = greedy.len() - prompt.len();
        let want = &greedy[prompt.len()..];
        let v = complete(
            addr,
            json!({"prompt": prompt, "max_tokens": n_new, "temperature": 0,
                "ignore_eos": true, "return_token_ids": true}),
        )
        .await;
        let c = &v["choices"][0];
        assert_eq!(c["prompt_token_ids"], json!(prompt), "{v}");
        assert_eq!(c["token_ids"], json!(want), "{v}");
        // Without it, neither field.
        let v = complete(addr, json!({"prompt": prompt, "max_tokens": 2})).await;
        let c = v["choices"][0].as_object().unwrap();
        assert!(!c.contains_key("token_ids") && !c.contains_key("prompt_token_ids"));
        // An end token forced: counted, never shown, and among the ids.
        let v = complete(
            addr,
            json!({"prompt": prompt, "max_tokens": 4, "logit_bias": {"4": 100},
                "return_token_ids": true}),
        )
        .await;
        let c = &v["choices"][0];
        assert_eq!(
            (c["text"].as_str(), &c["token_ids"]),
            (Some(""), &json!([4])),
            "{v}"
        );
        // An end token is not one of the request's stops: no `stop_reason`, as in vLLM.
        assert_eq!(c["stop_reason"], Value::Null, "{v}");
        assert_eq!(ended(&v), ("stop".into(), 1), "{v}");
        // A batch of two prompts with two choices each: each choice its prompt's ids.
        let other: Vec<i64> = prompt.iter().rev().copied().collect();
        let v = complete(
            addr,
            json!({"prompt": [prompt, other], "n": 2, "max_tokens": 2,
                "return_token_ids": true}),
        )
        .await;
        for (i, c) in v["choices"].as_array().unwrap().iter().enumerate() {
            let p = if c["index"].as_u64().unwrap() < 2 {
                &prompt
            } else {
                &other
            };
            assert_eq!(c["prompt_token_ids"], json!(p), "choice {i}: {v}");
            assert_eq!(c["token_ids"].as_array().unwrap().len(), 2, "{v}");
        }
        // Streamed: the prompt's ids on the first chunk only, each chunk its own tokens.
        let (status, body) = http(
            addr,
            "POST",
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": n_new, "temperature": 0,
                "ignore_eos": true, "stream": true, "return_token_ids": true})
            .to_string()
            .as_bytes(),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let (events, done) = common::sse_events(&body);
        assert!(done, "{body}");
        let with_prompt: Vec<&Value> = events
            .iter()
            .filter(|e| e["choices"][0].get("prompt_token_ids").is_some())
            .collect();
        assert_eq!(with_prompt.len(), 1, "{body}");
        assert_eq!(
            with_prompt[0]["choices"][0]["prompt_token_ids"],
            json!(prompt)
        );
        assert!(std::ptr::eq(with_prompt[0], &events[0]), "{body}");
        let streamed: Vec<i64> = events
            .iter()
            .flat_map(|e| e["choices"][0]["token_ids"].as_array().unwrap().clone())
            .map(|t| t.as_i64().unwrap())
            .collect();
        assert_eq!(streamed, want, "{body}");
        let last = &events.last().unwrap()["choices"][0];
        assert_eq!(last["finish_reason"], "length", "{body}");
        assert!(
            last.get("stop_reason").is_some_and(Value::is_null),
            "{body}"
        );
        // A streamed stop string ends the last chunk's `stop_reason`.
        let text = complete(
            addr,
            json!({"prompt": prompt, "max_tokens": n_new, "temperature": 0, "ignore_eos": true}),
        )
        .await["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_string();
        let stop: String = text.chars().skip(2).take(2).collect();
        let (_, body) = http(
            addr,
            "POST",
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": n_new, "temperature": 0,
                "ignore_eos": true, "stream": true, "stop": [stop]})
            .to_string()
            .as_bytes(),
        )
        .await;
        let (events, _) = common::sse_events(&body);
        let last = &events.last().unwrap()["choices"][0];
        assert_eq!(
            (&last["finish_reason"], &last["stop_reason"]),
            (&json!("stop"), &json!(stop)),
            "{body}"
        );
    });
}
