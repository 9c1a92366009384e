//! The streaming server end to end on loopback, on the `tiny_a` fixture's weights: greedy
//! output equals the fixture's, 32 concurrent WebSocket clients get complete and correct
//! streams, a disconnect frees the session, token ids stream one per delta while text is held
//! back, a session queues its next step while its client is not reading, bad input gets
//! clear errors, API keys guard the endpoints.

mod common;

use common::{connect, generate, http, http_with, next_json, serve, serve_keyed, serve_model};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

#[test]
fn greedy_through_the_server_equals_the_fixture_over_websocket_and_http() {
    let s = serve(8, 8);
    let n = s.greedy.len() - s.prompt.len();
    let req = serde_json::json!({"type": "generate", "id": "g", "prompt": s.prompt,
        "max_tokens": n, "temperature": 0, "token_ids": true, "ignore_eos": true});
    let (prompt, greedy, addr) = (s.prompt.clone(), s.greedy.clone(), s.addr);
    s.pipeline.block_on(async move {
        let mut ws = connect(addr).await;
        let (_, ids, done) = generate(&mut ws, req).await;
        assert_eq!([&prompt[..], &ids[..]].concat(), greedy);
        assert_eq!(done["finish_reason"], "length");
        assert_eq!(done["usage"]["completion_tokens"], n);

        let body = serde_json::json!({"prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": true})
        .to_string();
        let (status, body) = http(addr, "POST", "/v1/completions", body.as_bytes()).await;
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["usage"]["completion_tokens"], n);
        let (status, sse) = http(
            addr,
            "POST",
            "/v1/completions",
            serde_json::json!({"prompt": prompt, "max_tokens": n, "temperature": 0,
                "ignore_eos": true, "stream": true})
            .to_string()
            .as_bytes(),
        )
        .await;
        assert_eq!(status, 200);
        let streamed: String = sse
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| {
                serde_json::from_str::<serde_json::Value>(d).unwrap()["choices"][0]["text"]
                    .as_str()
                    .unwrap_or("")
                    .to_string()
            })
            .collect();
        assert_eq!(streamed, v["choices"][0]["text"].as_str().unwrap());
        assert!(
            sse.trim_end().ends_with("data: [DONE]") || sse.contains("data: [DONE]"),
            "{sse}"
        );

        let (status, models) = http(addr, "GET", "/v1/models", b"").await;
        assert!(status == 200 && models.contains("tiny_a"), "{models}");
        let (status, health) = http(addr, "GET", "/health", b"").await;
        assert!(status == 200 && health.contains("ok"));
        let (status, page) = http(addr, "GET", "/", b"").await;
        assert!(status == 200 && page.contains("new WebSocket"), "{page}");
    });
}

#[test]
fn thirty_two_concurrent_clients_get_complete_correct_streams_and_disconnects_free_sessions() {
    let s = serve(64, 64);
    let addr = s.addr;
    let state = s.state.clone();
    s.pipeline.block_on(async move {
        let req = |i: usize| {
            serde_json::json!({"type": "generate", "id": format!("c{i}"),
            "prompt": [87, 372, 275], "max_tokens": 12, "temperature": 0, "ignore_eos": true})
        };
        let mut ws = connect(addr).await;
        let (alone, _, _) = generate(&mut ws, req(0)).await;
        let (c0, n0) = state.generator.decoder.batch_counts();
        let clients: Vec<_> = (0..32)
            .map(|i| {
                tokio::spawn(async move {
                    let mut ws = connect(addr).await;
                    generate(&mut ws, req(i)).await
                })
            })
            .collect();
        for c in clients {
            let (text, _, done) = c.await.unwrap();
            assert_eq!(text, alone);
            assert_eq!(done["usage"]["completion_tokens"], 12);
        }
        // Each session fed its prompt and 11 of its 12 tokens (the last is never fed back).
        let (c1, n1) = state.generator.decoder.batch_counts();
        assert_eq!(n1 - n0, 32 * 12, "one input per prompt and per fed token");
        assert!(
            (n1 - n0) as f64 / (c1 - c0) as f64 > 2.0,
            "32 concurrent sessions were not batched: {} inputs in {} passes",
            n1 - n0,
            c1 - c0
        );
        // Disconnect mid-stream: the session is closed and its states freed.
        let mut ws = connect(addr).await;
        ws.send(Message::Text(
            serde_json::json!({"type": "generate", "id": "long",
            "prompt": [87], "max_tokens": 4000, "ignore_eos": true})
            .to_string()
            .into(),
        ))
        .await
        .unwrap();
        let first = next_json(&mut ws).await;
        assert_eq!(first["type"], "delta", "{first}");
        assert_eq!(state.generator.metrics.running.get(), 1);
        drop(ws);
        let t = std::time::Instant::now();
        while state.generator.metrics.running.get() != 0 {
            assert!(t.elapsed().as_secs() < 10, "the session was not freed");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // Every actor has dropped the session's neuron states.
        assert_eq!(state.generator.decoder.open_sessions(), 0);
        let (_, metrics) = http(addr, "GET", "/metrics", b"").await;
        assert!(
            metrics.contains("nsactor_num_requests_running 0"),
            "{metrics}"
        );
        assert!(
            metrics.contains("nsactor_decode_open_sessions 0"),
            "{metrics}"
        );
        assert!(metrics.contains("nsactor_requests_total 34"), "{metrics}");
        // The whole exposition passes a Prometheus text-format parser.
        let body = &metrics[metrics.find("\r\n\r\n").map_or(0, |i| i + 4)..];
        let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
            .expect("the text format parses");
        let ttft = scrape
            .samples
            .iter()
            .find(|x| x.metric == "nsactor_time_to_first_token_seconds")
            .expect("the time-to-first-token histogram");
        assert!(
            matches!(&ttft.value, prometheus_parse::Value::Histogram(b) if !b.is_empty()),
            "{metrics}"
        );
    });
}

#[test]
fn bad_input_gets_clear_errors_and_the_server_keeps_serving() {
    let s = serve(1, 0);
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let mut ws = connect(addr).await;
        let cases: [(&str, &str, &str); 9] = [
            ("{not json", "invalid_json", "key must be a string"),
            (r#"{"type":"generate","id":"a","prompt":"x","tempratur":1}"#, "invalid_request", "tempratur"),
            (r#"{"type":"generate","id":"a","prompt":"x","max_tokens":"9"}"#, "invalid_request", "max_tokens"),
            (r#"{"type":"generate","id":"a","prompt":"x","top_p":7}"#, "invalid_request", "top_p"),
            (r#"{"type":"generate","id":"a","prompt":""}"#, "invalid_request", "empty"),
            (r#"{"type":"generate","id":"a","prompt":[1,99999]}"#, "invalid_request", "99999"),
            (r#"{"type":"generate","id":"a"}"#, "invalid_request", "exactly one"),
            (r#"{"type":"cancel","id":"nope"}"#, "unknown_request", "nope"),
            (r#"{"type":"generate","id":"a","prompt":"x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x x"}"#, "invalid_request", "limit"),
        ];
        for (text, code, needle) in cases {
            ws.send(Message::Text(text.into())).await.unwrap();
            let m = next_json(&mut ws).await;
            assert_eq!(m["type"], "error", "{text}: {m}");
            assert_eq!(m["code"], code, "{text}: {m}");
            assert!(m["message"].as_str().unwrap().contains(needle), "{text}: {m}");
        }
        ws.send(Message::Binary(vec![0xff, 0xfe].into())).await.unwrap();
        assert_eq!(next_json(&mut ws).await["code"], "invalid_request");
        // Oversized frames close the connection; the server goes on.
        let mut big = connect(addr).await;
        // Past the default limit (4 MiB).
        let _ = big.send(Message::Text("x".repeat(5 << 20).into())).await;
        let closed = loop {
            match big.next().await {
                Some(Ok(Message::Close(f))) => break f,
                Some(Ok(_)) => continue,
                other => panic!("expected a close frame, got {other:?}"),
            }
        };
        let code = closed.map(|f| u16::from(f.code));
        assert_eq!(code, Some(1009), "message too big");
        // Cancel stops a running request within a token; one session slot, no queue: busy.
        ws.send(Message::Text(r#"{"type":"generate","id":"r","prompt":[87],"max_tokens":4000,"ignore_eos":true}"#.into())).await.unwrap();
        assert_eq!(next_json(&mut ws).await["type"], "delta");
        let (status, busy) = http(addr, "POST", "/v1/completions", br#"{"prompt":[87],"max_tokens":2}"#).await;
        assert_eq!(status, 503, "{busy}");
        assert!(busy.contains("busy"), "{busy}");
        ws.send(Message::Text(r#"{"type":"cancel","id":"r"}"#.into())).await.unwrap();
        loop {
            let m = next_json(&mut ws).await;
            if m["type"] == "done" {
                assert_eq!(m["finish_reason"], "cancelled");
                break;
            }
        }
        // HTTP: invalid JSON, unknown fields, invalid UTF-8, wrong endpoint shape.
        for (body, needle) in [
            (&b"{"[..], "invalid JSON"),
            (br#"{"prompt":"x","frequency":1}"#, "frequency"),
            (b"{\"prompt\":\"\xff\xfe\"}", "invalid"),
            (br#"{"messages":[{"role":"user","content":"x"}]}"#, "needs `prompt`"),
            (br#"{"prompt":"x","n":300}"#, "n must be in 1..=16"),
        ] {
            let (status, err) = http(addr, "POST", "/v1/completions", body).await;
            assert_eq!(status, 400, "{err}");
            assert!(err.contains(needle), "{err}");
        }
        // And it still serves.
        let (status, ok) = http(addr, "POST", "/v1/completions", br#"{"prompt":[87],"max_tokens":2}"#).await;
        assert_eq!(status, 200, "{ok}");
    });
}

#[test]
fn chat_and_text_prompts_stream_over_http_and_websocket() {
    let s = serve_model(4, 4, false);
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let (status, chat) = http(addr, "POST", "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"Who is Emma?"}],"max_tokens":6,"temperature":0}"#).await;
        assert_eq!(status, 200, "{chat}");
        let v: serde_json::Value = serde_json::from_str(&chat).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        let (status, sse) = http(addr, "POST", "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"Who is Emma?"}],"max_tokens":6,"temperature":0,"stream":true}"#).await;
        assert_eq!(status, 200);
        let chunks: Vec<serde_json::Value> = sse.lines().filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(chunks.last().unwrap()["object"], "chat.completion.chunk");
        let streamed: String = chunks.iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(streamed, answer);
        assert_eq!(sse.matches("data: [DONE]").count(), 1, "{sse}");
        // The same chat over the WebSocket, and a stop string that cuts the text.
        let mut ws = connect(addr).await;
        let (text, _, done) = generate(&mut ws, serde_json::json!({"type": "generate", "id": "w",
            "messages": [{"role": "user", "content": "Who is Emma?"}], "max_tokens": 6,
            "temperature": 0})).await;
        assert_eq!(text, answer);
        assert!(done["timing"]["time_to_first_token_ms"].as_f64().unwrap() > 0.0);
        if let Some(cut) = answer.char_indices().nth(2).map(|(i, _)| &answer[i..]).filter(|c| !c.trim().is_empty()) {
            let (text, _, done) = generate(&mut ws, serde_json::json!({"type": "generate", "id": "s",
                "messages": [{"role": "user", "content": "Who is Emma?"}], "max_tokens": 6,
                "temperature": 0, "stop": cut})).await;
            assert_eq!(done["finish_reason"], "stop");
            assert_eq!(text, &answer[..answer.find(cut).unwrap()]);
        }
    });
}

/// With API keys, `/v1/*` and `/ws` need one (header, or an `auth` message first on `/ws`);
/// a wrong or missing key is a 401 (HTTP) or an `invalid_api_key` error and close 1008
/// (WebSocket); `/health`, `/metrics` and the tokenizer's routes stay open (unless keyed: the
/// next test); the key never shows in an answer.
#[test]
fn api_keys_guard_the_http_and_websocket_endpoints() {
    use nsactor_server::auth::ApiKeys;
    let keys = ApiKeys::new(["sk-test-1".to_string(), "sk-test-2".into()], false).unwrap();
    let s = serve_keyed(keys);
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let body = br#"{"prompt":[87],"max_tokens":2}"#;
        for (headers, want) in [
            ("", 401),
            ("Authorization: Bearer sk-wrong\r\n", 401),
            ("Authorization: Basic sk-test-1\r\n", 401),
            ("Authorization: Bearer sk-test-2\r\n", 200),
        ] {
            let (status, answer) = http_with(addr, "POST", "/v1/completions", headers, body).await;
            assert_eq!(status, want, "{headers:?}: {answer}");
            if want == 401 {
                let e: serde_json::Value = serde_json::from_str(&answer).unwrap();
                assert_eq!(e["error"]["code"], "invalid_api_key", "{answer}");
                assert!(!answer.contains("sk-"), "the key is echoed: {answer}");
            }
        }
        let (status, _) = http(addr, "GET", "/v1/models", b"").await;
        assert_eq!(status, 401);
        let (status, health) = http(addr, "GET", "/health", b"").await;
        assert_eq!(status, 200);
        assert!(health.contains(r#""api_key_required":true"#), "{health}");
        assert_eq!(http(addr, "GET", "/metrics", b"").await.0, 200);
        // The tokenizer's routes stay open, as vLLM leaves them (lm-evaluation-harness's
        // remote tokenizer calls them without the completions' key).
        assert_eq!(http(addr, "GET", "/tokenizer_info", b"").await.0, 200);
        let (status, answer) = http(addr, "POST", "/tokenize", br#"{"prompt":"hi"}"#).await;
        assert_eq!(status, 200, "{answer}");

        // WebSocket with the header.
        let mut req = format!("ws://{addr}/ws").into_client_request().unwrap();
        req.headers_mut()
            .insert("authorization", "Bearer sk-test-1".parse().unwrap());
        let mut ws = tokio_tungstenite::connect_async(req).await.unwrap().0;
        // Sampled at the default temperature, an end token could come first: ignore_eos makes
        // the two tokens certain.
        let req = serde_json::json!({"type":"generate","id":"h","prompt":[87],"max_tokens":2,
            "ignore_eos":true});
        let (_, _, done) = generate(&mut ws, req.clone()).await;
        assert_eq!(done["usage"]["completion_tokens"], 2);
        // A wrong header is refused before the upgrade.
        let mut bad = format!("ws://{addr}/ws").into_client_request().unwrap();
        bad.headers_mut()
            .insert("authorization", "Bearer nope".parse().unwrap());
        assert!(tokio_tungstenite::connect_async(bad).await.is_err());
        // Without the header: the key as the first message (what the chat page does) …
        let mut ws = connect(addr).await;
        let auth = serde_json::json!({"type":"auth","key":"sk-test-2"}).to_string();
        ws.send(Message::Text(auth.into())).await.unwrap();
        let (_, _, done) = generate(&mut ws, req.clone()).await;
        assert_eq!(done["usage"]["completion_tokens"], 2);
        // … a wrong one, or a request first, gets an error and close 1008.
        for first in [
            serde_json::json!({"type":"auth","key":"sk-test-3"}),
            req.clone(),
        ] {
            let mut ws = connect(addr).await;
            ws.send(Message::Text(first.to_string().into()))
                .await
                .unwrap();
            let m = next_json(&mut ws).await;
            assert_eq!(m["type"], "error", "{m}");
            assert_eq!(m["code"], "invalid_api_key", "{m}");
            let close = loop {
                match ws.next().await {
                    Some(Ok(Message::Close(f))) => break f,
                    Some(Ok(_)) => continue,
                    other => panic!("expected a close frame, got {other:?}"),
                }
            };
            assert_eq!(u16::from(close.unwrap().code), 1008);
        }
    });
}

/// `--metrics-need-key` and `--tokenizer-need-key`: `/metrics`, `/tokenize`, `/detokenize`
/// and `/tokenizer_info` then answer 401 without the key and work with it; `/health` stays open.
#[test]
fn keyed_metrics_and_tokenizer_routes() {
    use nsactor_server::auth::ApiKeys;
    let mut keys = ApiKeys::new(["sk-test-1".to_string()], true).unwrap();
    keys.tokenizer = true;
    let s = serve_keyed(keys);
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let key = "Authorization: Bearer sk-test-1\r\n";
        for (method, path, body) in [
            ("GET", "/metrics", &b""[..]),
            ("GET", "/tokenizer_info", b""),
            ("POST", "/tokenize", br#"{"prompt":"hi"}"#),
            ("POST", "/detokenize", br#"{"tokens":[87]}"#),
        ] {
            let (status, answer) = http_with(addr, method, path, "", body).await;
            assert_eq!(status, 401, "{path} without the key: {answer}");
            let (status, answer) = http_with(addr, method, path, key, body).await;
            assert_eq!(status, 200, "{path} with the key: {answer}");
        }
        assert_eq!(http(addr, "GET", "/health", b"").await.0, 200);
    });
}

/// Every delta of a request: `(text, token ids)`, and the `done` event.
async fn deltas(
    ws: &mut common::Ws,
    req: serde_json::Value,
) -> (Vec<(String, Vec<i64>)>, serde_json::Value) {
    ws.send(Message::Text(req.to_string().into()))
        .await
        .unwrap();
    let mut out = Vec::new();
    loop {
        let m = next_json(ws).await;
        match m["type"].as_str().unwrap() {
            "delta" => {
                let ids = m["token_ids"].as_array().cloned().unwrap_or_default();
                let ids = ids.iter().map(|v| v.as_i64().unwrap()).collect();
                out.push((m["text"].as_str().unwrap().to_string(), ids));
            }
            "done" => return (out, m),
            _ => panic!("unexpected {m}"),
        }
    }
}

#[test]
fn token_ids_stream_one_per_delta_while_their_text_is_held_back() {
    let s = serve(4, 4);
    let (prompt, addr) = (s.prompt.clone(), s.addr);
    s.pipeline.block_on(async move {
        let mut ws = connect(addr).await;
        let n = 4;
        let req = |stop: Option<String>| {
            let mut r = serde_json::json!({"type": "generate", "id": "t", "prompt": prompt,
                "max_tokens": n, "temperature": 0, "token_ids": true, "ignore_eos": true});
            if let Some(stop) = stop {
                r["stop"] = serde_json::json!([stop]);
            }
            r
        };
        let (plain, _) = deltas(&mut ws, req(None)).await;
        let text: String = plain.iter().map(|d| d.0.as_str()).collect();
        let ids: Vec<i64> = plain.iter().flat_map(|d| d.1.clone()).collect();
        assert_eq!(ids.len(), n);
        // A stop string that the whole answer is a prefix of: every step's text might be its
        // start, so the text is held back to the end; the ids must still come one per token.
        let stop = format!("{text}\u{1}");
        assert!(!text.is_empty() && stop.len() <= 128, "{text:?}");
        let (held, done) = deltas(&mut ws, req(Some(stop))).await;
        assert_eq!(done["finish_reason"], "length", "{done}");
        let with_ids: Vec<&Vec<i64>> = held
            .iter()
            .map(|d| &d.1)
            .filter(|i| !i.is_empty())
            .collect();
        assert_eq!(with_ids.len(), n, "one delta per token: {held:?}");
        assert!(with_ids.iter().all(|i| i.len() == 1), "{held:?}");
        assert_eq!(
            held.iter().flat_map(|d| d.1.clone()).collect::<Vec<_>>(),
            ids
        );
        // The text is withheld while each token streams, then comes whole.
        assert!(held[..n].iter().all(|d| d.0.is_empty()), "{held:?}");
        assert_eq!(held.iter().map(|d| d.0.as_str()).collect::<String>(), text);
    });
}

#[test]
fn a_session_runs_ahead_of_a_client_that_is_not_reading_then_parks() {
    use nsactor_decoding::MAX_UNREAD;
    use nsactor_server::protocol::{GenSpec, PromptSpec};
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};
    let s = serve(4, 4);
    let (state, prompt) = (s.state.clone(), s.prompt.clone());
    s.pipeline.block_on(async move {
        let (_, n0) = state.generator.decoder.batch_counts();
        // A client that never reads: its channel takes one delta, the second send waits.
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let max_tokens = MAX_UNREAD + 40;
        let spec = GenSpec {
            prompt: PromptSpec::Ids(prompt),
            max_tokens,
            sampling: nsactor_engine::decode::SamplingParams::greedy(),
            stop: Vec::new(),
            token_ids: true,
            ignore_eos: true,
            logit_bias: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            add_special_tokens: true,
            // One input for the prompt (the cache would feed all of it but its last token
            // first, one input more).
            cache_prompt: false,
            time_limit: None,
            extras: Default::default(),
            parts: Vec::new(),
        };
        let cancel = std::sync::Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let state = state.clone();
            async move { state.generator.run(spec, tx, cancel).await }
        });
        // The batcher feeds each token back itself: the session steps on while its second
        // delta waits for the reader (the generator has read two tokens), until it is
        // MAX_UNREAD tokens ahead of its reader, and then it is parked.
        let fed = || state.generator.decoder.batch_counts().1 - n0;
        let want = (2 + MAX_UNREAD) as u64;
        let deadline = Instant::now() + Duration::from_secs(60);
        while fed() < want {
            assert!(Instant::now() < deadline, "{} inputs fed in 60 s", fed());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            fed(),
            want,
            "parked {MAX_UNREAD} tokens ahead of its reader"
        );
        // The client goes away: the generation ends as cancelled and frees its session.
        drop(rx);
        let done = task.await.unwrap().unwrap();
        assert_eq!(done.finish_reason, "cancelled");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(fed(), want, "nothing fed after the client left");
        assert_eq!(state.generator.decoder.open_sessions(), 0);
    });
}

#[test]
fn an_id_is_free_again_as_soon_as_its_done_arrives() {
    let s = serve(4, 4);
    let (prompt, addr) = (s.prompt.clone(), s.addr);
    s.pipeline.block_on(async move {
        let mut ws = connect(addr).await;
        // Back to back under one id, each sent the moment the last `done` is read: none may
        // be refused as still running (the id used to be freed only after `done` went out).
        for round in 0..40 {
            let req = serde_json::json!({"type": "generate", "id": "same", "prompt": prompt,
                "max_tokens": 1, "temperature": 0, "ignore_eos": true});
            let (_, done) = deltas(&mut ws, req).await;
            assert_eq!(done["finish_reason"], "length", "round {round}: {done}");
        }
        // A cancelled request frees its id as well.
        let long = serde_json::json!({"type": "generate", "id": "same", "prompt": prompt,
            "max_tokens": 4000, "temperature": 0, "ignore_eos": true});
        ws.send(Message::Text(long.to_string().into()))
            .await
            .unwrap();
        let cancel = serde_json::json!({"type": "cancel", "id": "same"});
        ws.send(Message::Text(cancel.to_string().into()))
            .await
            .unwrap();
        let done = loop {
            let m = next_json(&mut ws).await;
            if m["type"] == "done" {
                break m;
            }
            assert_eq!(m["type"], "delta", "{m}");
        };
        assert_eq!(done["finish_reason"], "cancelled", "{done}");
        let again = serde_json::json!({"type": "generate", "id": "same", "prompt": prompt,
            "max_tokens": 2, "temperature": 0, "ignore_eos": true});
        let (_, done) = deltas(&mut ws, again).await;
        assert_eq!(done["usage"]["completion_tokens"], 2, "{done}");
    });
}
