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
