//! The OpenAI fields as clients use them, over loopback: `n`, log-probabilities (and that
//! the prompt's, from `echo`, agree with the generation's own), usage chunks, chat
//! log-probabilities, `/tokenize` and `/detokenize`, `x-request-id`, the error shape.

mod common;

use common::{http, http_head, serve, serve_model, sse_events};
use serde_json::{Value, json};

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn n_logprobs_echo_and_usage_chunks_on_completions() {
    let s = serve(4, 8);
    let (addr, prompt, greedy) = (s.addr, s.prompt.clone(), s.greedy.clone());
    let state = s.state.clone();
    s.pipeline.block_on(async move {
        let n_new = greedy.len() - prompt.len();
        // n = 2 greedy choices: both are the fixture's continuation; the prompt counts once.
        let req = json!({"prompt": prompt, "max_tokens": n_new, "temperature": 0, "n": 2,
            "logprobs": 2, "ignore_eos": true});
        let (status, body) =
            http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2);
        assert_eq!(choices[0]["text"], choices[1]["text"]);
        assert_eq!(
            (choices[0]["index"].as_u64(), choices[1]["index"].as_u64()),
            (Some(0), Some(1))
        );
        assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
        assert_eq!(v["usage"]["completion_tokens"], 2 * n_new);
        // Greedy picks the most likely token: its logprob is the first alternative's.
        let lp = &choices[0]["logprobs"];
        let gen_lp: Vec<f64> = lp["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(num)
            .collect();
        assert_eq!(gen_lp.len(), n_new);
        for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
            let top = top.as_object().unwrap();
            assert!(!top.is_empty() && top.len() <= 2, "{top:?}");
            let best = top.values().map(num).fold(f64::NEG_INFINITY, f64::max);
            assert!(
                (best - gen_lp[i]).abs() < 1e-6 && gen_lp[i] <= 0.0,
                "{best} vs {}",
                gen_lp[i]
            );
        }
        let offsets: Vec<u64> = lp["text_offset"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o.as_u64().unwrap())
            .collect();
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
        // `logprobs: 0`: each position's alternatives are the chosen token alone, with its
        // log-probability (OpenAI and vLLM always add the chosen token).
        let req = json!({"prompt": prompt, "max_tokens": 3, "logprobs": 0, "seed": 7,
            "temperature": 1.0, "ignore_eos": true});
        let (status, body) =
            http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let lp = &v["choices"][0]["logprobs"];
        for i in 0..3 {
            let top = lp["top_logprobs"][i].as_object().unwrap();
            let token = lp["tokens"][i].as_str().unwrap();
            assert_eq!(top.len(), 1, "{lp}");
            assert_eq!(top[token], lp["token_logprobs"][i], "{lp}");
        }

        // Scoring prompt + continuation (echo, max_tokens 0) is one prefill of every position;
        // the continuation's logprobs must equal the ones reported while generating.
        // It is one pass, of every position but the last: nothing is generated, so the last
        // token is not fed.
        while state.generator.metrics.running.get() != 0 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let inputs = || state.generator.decoder.batch_counts().1;
        let before = inputs();
        let req = json!({"prompt": greedy, "max_tokens": 0, "echo": true, "logprobs": 0});
        let (status, body) =
            http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(inputs() - before, 1, "inputs fed to score the prompt");
        let v: Value = serde_json::from_str(&body).unwrap();
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], 0);
        // An end token ends the text unshown and counts in usage (OpenAI, vLLM).
        let req = json!({"prompt": greedy, "max_tokens": 5, "logit_bias": {"4": 100}});
        let (_, body) = http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (&e["choices"][0]["finish_reason"], &e["choices"][0]["text"]),
            (&json!("stop"), &json!("")),
            "{e}"
        );
        assert_eq!(e["usage"]["completion_tokens"], 1, "{e}");
        let scored = c["logprobs"]["token_logprobs"].as_array().unwrap();
        assert_eq!(scored.len(), greedy.len());
        assert!(
            scored[0].is_null(),
            "the first token has no context: {}",
            scored[0]
        );
        let tail: Vec<f64> = scored[prompt.len()..].iter().map(num).collect();
        for (a, b) in tail.iter().zip(&gen_lp) {
            assert!(
                (a - b).abs() < 1e-3,
                "echo {tail:?} vs generated {gen_lp:?}"
            );
        }

        // Streaming n = 2 with include_usage: chunks of both indices, each finishing once,
        // `usage: null` on every chunk, then one usage chunk with no choices, then [DONE].
        let req = json!({"prompt": prompt, "max_tokens": 3, "n": 2, "stream": true, "seed": 5,
            "stream_options": {"include_usage": true}, "ignore_eos": true});
        let (status, body) =
            http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
        assert_eq!(status, 200, "{body}");
        let (events, done) = sse_events(&body);
        assert!(done, "{body}");
        let (last, chunks) = events.split_last().unwrap();
        assert_eq!(last["choices"].as_array().unwrap().len(), 0, "{last}");
        assert_eq!(last["usage"]["completion_tokens"], 6, "{last}");
        assert_eq!(last["usage"]["total_tokens"], 6 + prompt.len(), "{last}");
        let mut finished = [0, 0];
        for c in chunks {
            assert!(c["usage"].is_null(), "{c}");
            let i = c["choices"][0]["index"].as_u64().unwrap() as usize;
            if !c["choices"][0]["finish_reason"].is_null() {
                finished[i] += 1;
            }
        }
        assert_eq!(finished, [1, 1], "{body}");

        // The error shape, with the field at fault.
        let (status, body) = http(
            addr,
            "POST",
            "/v1/completions",
            br#"{"prompt":[1],"top_p":3}"#,
        )
        .await;
        assert_eq!(status, 400);
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["param"], "top_p", "{e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        let (status, body) = http(
            addr,
            "POST",
            "/v1/completions",
            br#"{"model":"gpt-4o","prompt":[1]}"#,
        )
        .await;
        assert_eq!(status, 404, "{body}");
        assert!(body.contains("model_not_found"), "{body}");
    });
}

#[test]
fn a_batch_of_prompts_gives_each_its_own_choices_in_index_order() {
    let s = serve(8, 16);
    let (addr, prompt, greedy) = (s.addr, s.prompt.clone(), s.greedy.clone());
    s.pipeline.block_on(async move {
        let n_new = greedy.len() - prompt.len();
        let post = |req: Value| async move {
            let (status, body) =
                http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
            assert_eq!(status, 200, "{body}");
            serde_json::from_str::<Value>(&body).unwrap()
        };
        // A list of token-id lists, n = 2: choice index = prompt × n + j; each prompt's
        // greedy text is the one it gets alone; the usage counts each prompt once.
        let short: Vec<i64> = prompt[..prompt.len() - 1].to_vec();
        let alone = post(
            json!({"prompt": short, "max_tokens": n_new, "temperature": 0,
            "ignore_eos": true}),
        )
        .await;
        let v = post(
            json!({"prompt": [prompt, short], "max_tokens": n_new, "temperature": 0,
            "n": 2, "ignore_eos": true}),
        )
        .await;
        let choices = v["choices"].as_array().unwrap();
        let idx: Vec<u64> = choices
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect();
        assert_eq!(idx, [0, 1, 2, 3], "{v}");
        assert_eq!(choices[0]["text"], choices[1]["text"]);
        assert_eq!(choices[2]["text"], alone["choices"][0]["text"], "{v}");
        assert_eq!(choices[3]["text"], alone["choices"][0]["text"], "{v}");
        assert_eq!(
            v["usage"]["prompt_tokens"],
            prompt.len() + short.len(),
            "{v}"
        );
        assert_eq!(v["usage"]["completion_tokens"], 4 * n_new, "{v}");
        // Scoring a batch (echo, max_tokens 0): each choice scores its own prompt.
        let v = post(
            json!({"prompt": [greedy, prompt], "max_tokens": 0, "echo": true,
            "logprobs": 0}),
        )
        .await;
        let scored = |i: usize| {
            v["choices"][i]["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .len()
        };
        assert_eq!((scored(0), scored(1)), (greedy.len(), prompt.len()), "{v}");
        // Streamed: every index finishes once.
        let req = json!({"prompt": [prompt, short], "max_tokens": 2, "stream": true,
            "ignore_eos": true, "stream_options": {"include_usage": true}});
        let (status, body) =
            http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
        assert_eq!(status, 200, "{body}");
        let (events, done) = sse_events(&body);
        assert!(done, "{body}");
        let (last, chunks) = events.split_last().unwrap();
        assert_eq!(
            last["usage"]["prompt_tokens"],
            prompt.len() + short.len(),
            "{last}"
        );
        let mut finished = [0, 0];
        for c in chunks {
            if !c["choices"][0]["finish_reason"].is_null() {
                finished[c["choices"][0]["index"].as_u64().unwrap() as usize] += 1;
            }
        }
        assert_eq!(finished, [1, 1], "{body}");
        // A prompt of no accepted form names the field and the forms.
        let (status, body) =
            http(addr, "POST", "/v1/completions", br#"{"prompt":[[1],"a"]}"#).await;
        assert_eq!(status, 400, "{body}");
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["param"], "prompt", "{e}");
        assert!(!body.contains("untagged"), "{body}");
        assert!(body.contains("list of token-id lists"), "{body}");
    });
}

#[test]
fn chat_logprobs_tokenize_detokenize_and_request_ids() {
    let s = serve_model(4, 8, false);
    let (addr, bos) = (s.addr, s.state.generator.tokenizer.bos_id());
    let name = s.state.model_name.clone();
    let metrics = s.state.generator.metrics.clone();
    s.pipeline.block_on(async move {
        // The model by its id (the client's `models.retrieve`); paths and methods no route
        // takes get OpenAI's error body.
        let (status, body) = http(addr, "GET", &format!("/v1/models/{name}"), b"").await;
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!((status, v["id"].as_str()), (200, Some(name.as_str())), "{body}");
        for (method, path, want, code) in [
            ("GET", "/v1/models/gpt-4", 404, "model_not_found"),
            ("GET", "/v1/nothing", 404, "not_found"),
            ("GET", "/v1/completions", 405, "method_not_allowed"),
        ] {
            let (status, body) = http(addr, method, path, b"").await;
            let v: Value = serde_json::from_str(&body).unwrap_or_default();
            assert_eq!((status, &v["error"]["code"]), (want, &json!(code)), "{path}: {body}");
        }
        let req = json!({"messages": [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
            "max_completion_tokens": 4, "logprobs": true, "top_logprobs": 3, "ignore_eos": true,
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"10": -100}});
        let (status, head, body) = http_head(
            addr,
            "POST",
            "/v1/chat/completions",
            "X-Request-Id: trace-42\r\n",
            req.to_string().as_bytes(),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert!(
            head.to_ascii_lowercase().contains("x-request-id: trace-42"),
            "{head}"
        );
        let v: Value = serde_json::from_str(&body).unwrap();
        let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 4, "{v}");
        let mut text = String::new();
        for e in content {
            assert!(num(&e["logprob"]) <= 0.0);
            assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 3, "{e}");
            let bytes: Vec<u8> = e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect();
            assert_eq!(
                String::from_utf8_lossy(&bytes),
                e["token"].as_str().unwrap()
            );
            // A special token sampled here (`ignore_eos` lifts the bans on them) is named in
            // the log-probabilities and left out of the message's text.
            let token = e["token"].as_str().unwrap();
            if !(token.starts_with("<|") && token.ends_with("|>")) {
                text.push_str(token);
            }
        }
        assert_eq!(
            text,
            v["choices"][0]["message"]["content"].as_str().unwrap()
        );
        // CORS: the configured origin gets a preflight answer (before any key check) and its
        // responses carry the header; another origin gets neither.
        let pre = "Origin: https://app.example\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization,content-type,x-stainless-os\r\n";
        let (status, head, _) = http_head(addr, "OPTIONS", "/v1/completions", pre, b"").await;
        let head = head.to_ascii_lowercase();
        assert!(status == 200 && head.contains("access-control-allow-origin: https://app.example"), "{head}");
        // Whatever headers the browser asks for (the OpenAI SDKs send `x-stainless-*`).
        assert!(head.contains("authorization") && head.contains("x-stainless-os"), "{head}");
        let (_, head, _) = http_head(addr, "GET", "/v1/models", "Origin: https://app.example\r\n", b"").await;
        assert!(head.to_ascii_lowercase().contains("access-control-expose-headers: x-request-id"), "{head}");
        let (_, head, _) = http_head(addr, "GET", "/v1/models", "Origin: https://evil.example\r\n", b"").await;
        assert!(!head.to_ascii_lowercase().contains("access-control-allow-origin"), "{head}");
        // What the server can never do is the client's 400, naming the field: more choices
        // than it holds at once (4 decoding + 8 queued), a bias or a prompt token outside the
        // vocabulary (2,048).
        for (req, param) in [
            (json!({"prompt": "hi", "n": 13, "max_tokens": 1}), "n"),
            (json!({"prompt": "hi", "max_tokens": 1, "logit_bias": {"99999": 5}}), "logit_bias"),
            (json!({"prompt": [5, 99999], "max_tokens": 1}), "prompt"),
        ] {
            let (status, body) =
                http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!((status, &v["error"]["param"]), (400, &json!(param)), "{req}: {body}");
        }
        // A batch with one bad prompt starts none of its generations.
        let before = metrics.requests.get();
        let req = json!({"prompt": [[5], [99999]], "max_tokens": 1});
        let (status, body) =
            http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(metrics.requests.get(), before, "{body}");
        // Without the header the server names the request itself.
        let (_, head, _) = http_head(addr, "GET", "/v1/models", "", b"").await;
        assert!(
            head.to_ascii_lowercase().contains("x-request-id: req-"),
            "{head}"
        );

        // /tokenize is what generation feeds; /detokenize gives the text back.
        let (status, body) = http(
            addr,
            "POST",
            "/tokenize",
            br#"{"prompt":"Hello world","return_token_strs":true}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let t: Value = serde_json::from_str(&body).unwrap();
        let ids = t["tokens"].as_array().unwrap().clone();
        assert_eq!(ids[0], bos, "a prompt starts with the BOS token: {t}");
        assert_eq!(t["max_model_len"], 64, "{t}");
        assert_eq!(t["count"], ids.len());
        assert_eq!(t["token_strs"].as_array().unwrap().len(), ids.len());
        // Token strings are the vocabulary's (as `convert_ids_to_tokens`), whole even where a
        // token holds part of a character.
        let (_, body) = http(
            addr,
            "POST",
            "/tokenize",
            r#"{"prompt":"é café ü","return_token_strs":true}"#.as_bytes(),
        )
        .await;
        let t: Value = serde_json::from_str(&body).unwrap();
        let strs = t["token_strs"].as_array().unwrap();
        assert_eq!(strs.len(), t["tokens"].as_array().unwrap().len());
        assert_eq!(strs[0], "<|im_start|>", "{t}");
        assert!(
            strs.iter().all(|s| !s.as_str().unwrap().contains('\u{FFFD}')),
            "{t}"
        );
        let (status, body) = http(
            addr,
            "POST",
            "/detokenize",
            json!({"tokens": ids}).to_string().as_bytes(),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap()["prompt"],
            "<|im_start|>Hello world",
            "lossless: the BOS is written out"
        );
        let (status, body) = http(addr, "POST", "/detokenize", br#"{"tokens":[99999]}"#).await;
        assert_eq!(status, 400, "{body}");
        assert!(body.contains("\"param\":\"tokens\""), "{body}");
        // /tokenizer_info as lm-evaluation-harness's remote tokenizer reads it, and /tokenize
        // as it calls it (no special tokens: the ids of the text alone).
        let (status, body) = http(addr, "GET", "/tokenizer_info", b"").await;
        assert_eq!(status, 200, "{body}");
        let info: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(info["bos_token_id"], bos, "{info}");
        assert_eq!(info["bos_token"], "<|im_start|>", "{info}");
        assert_eq!(info["eos_token"], "<|im_end|>", "{info}");
        assert_eq!(info["model_max_length"], 64, "{info}");
        assert!(info["chat_template"].as_str().unwrap().contains("message['role']"), "{info}");
        let (status, body) = http(
            addr,
            "POST",
            "/tokenize",
            br#"{"prompt":"Hello world","add_special_tokens":false}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let plain: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(plain["tokens"].as_array().unwrap()[..], ids[1..], "{plain}");
        // Scoring a text prompt: the BOS the server puts in front is context, not echoed, so
        // the echoed positions are the client's tokens (the first scored after the BOS), the
        // same numbers as scoring the ids with the BOS sent by hand; without the BOS
        // (`add_special_tokens: false`) the first token has no context.
        let score = |req: Value| async move {
            let (status, body) =
                http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
            assert_eq!(status, 200, "{body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            v["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().clone()
        };
        let text = score(json!({"prompt": "Hello world", "max_tokens": 0, "echo": true,
            "logprobs": 0}))
        .await;
        let by_hand = score(json!({"prompt": ids, "max_tokens": 0, "echo": true, "logprobs": 0})).await;
        assert_eq!(text.len(), ids.len() - 1);
        assert!(text[0].is_number(), "{text:?}");
        assert_eq!(text[..], by_hand[1..], "text scoring lines up with the ids sent");
        let bare = score(json!({"prompt": "Hello world", "max_tokens": 0, "echo": true,
            "logprobs": 0, "add_special_tokens": false}))
        .await;
        assert_eq!(bare.len(), ids.len() - 1);
        assert!(bare[0].is_null(), "{bare:?}");
        // A text that begins with the BOS (ChatML, or what /detokenize wrote) gets no second.
        let (status, body) = http(
            addr,
            "POST",
            "/tokenize",
            br#"{"prompt":"<|im_start|>Hello world"}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["tokens"], json!(ids));
        let led = score(json!({"prompt": "<|im_start|>Hello world", "max_tokens": 0,
            "echo": true, "logprobs": 0}))
        .await;
        assert_eq!(led, by_hand, "the client's own BOS is echoed and scored as sent");
        let chat = json!({"messages": [{"role": "user", "content": "Hi"}]});
        let (status, body) = http(addr, "POST", "/tokenize", chat.to_string().as_bytes()).await;
        assert_eq!(status, 200, "{body}");
        assert!(
            serde_json::from_str::<Value>(&body).unwrap()["count"]
                .as_u64()
                .unwrap()
                > 3
        );
    });
}

#[test]
fn a_completions_stream_sends_a_chunk_per_token_while_the_text_is_held_back() {
    let s = serve(4, 8);
    let (addr, prompt) = (s.addr, s.prompt.clone());
    s.pipeline.block_on(async move {
        let n = 4;
        let req = |stream: bool, stop: Option<String>| {
            let mut r = json!({"prompt": prompt, "max_tokens": n, "temperature": 0,
                "ignore_eos": true, "stream": stream});
            if let Some(stop) = stop {
                r["stop"] = json!([stop]);
            }
            r.to_string()
        };
        let (status, body) =
            http(addr, "POST", "/v1/completions", req(false, None).as_bytes()).await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let text = v["choices"][0]["text"].as_str().unwrap().to_string();
        assert!(!text.is_empty());
        // A stop string that the whole answer is a prefix of: every step's text might be its
        // start, so the text is held back to the end, yet each token gets its chunk.
        let stop = format!("{text}\u{1}");
        let (status, sse) = http(
            addr,
            "POST",
            "/v1/completions",
            req(true, Some(stop)).as_bytes(),
        )
        .await;
        assert_eq!(status, 200, "{sse}");
        let (events, done) = sse_events(&sse);
        assert!(done, "{sse}");
        let (last, chunks) = events.split_last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length", "{sse}");
        let texts: Vec<&str> = chunks
            .iter()
            .map(|c| c["choices"][0]["text"].as_str().unwrap())
            .collect();
        assert!(
            texts.len() > n,
            "one chunk per token, then the text: {texts:?}"
        );
        assert!(texts[..n].iter().all(|t| t.is_empty()), "{texts:?}");
        assert_eq!(texts.concat(), text);
    });
}
