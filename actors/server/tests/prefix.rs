//! The prefix state cache through the real server (issue 61): a chat resent turn after turn
//! over `/v1/chat/completions`, a prompt whose cached part ends inside a multi-byte
//! character, and WebSocket conversations that go on from their state give the tokens and
//! log-probabilities of the same requests with the cache off (`cache_prompt: false`), bit for
//! bit; `/metrics` counts the hits.

mod common;

use common::{connect, generate, http, http_bytes, serve_limited, tokenize, ws_send};
use nsactor_server::protocol::Limits;
use serde_json::{Value, json};

fn limits() -> Limits {
    Limits {
        max_prompt_tokens: 4096,
        ..Limits::default()
    }
}

/// A chat completion's answer, its token log-probabilities (as bits) and prompt tokens.
async fn chat(
    addr: std::net::SocketAddr,
    messages: &[Value],
    cache: bool,
) -> (String, Vec<u64>, u64) {
    let req = json!({"messages": messages, "max_tokens": 6, "temperature": 0,
        "logprobs": true, "top_logprobs": 2, "cache_prompt": cache});
    let (status, body) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        req.to_string().as_bytes(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choice = &v["choices"][0];
    let lps = choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["logprob"].as_f64().unwrap().to_bits())
        .collect();
    let text = choice["message"]["content"].as_str().unwrap().to_string();
    (text, lps, v["usage"]["prompt_tokens"].as_u64().unwrap())
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[test]
fn a_chat_resent_turn_after_turn_gives_the_numbers_of_one_without_the_cache() {
    let s = serve_limited(4, false, limits());
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let mut messages = vec![json!({"role": "system", "content": "You answer in French."})];
        for turn in 0..4 {
            messages.push(json!({"role": "user", "content": format!("Question {turn}: où est le café «noir»?")}));
            let off = chat(addr, &messages, false).await;
            let on = chat(addr, &messages, true).await;
            assert_eq!(on, off, "turn {turn}");
            messages.push(json!({"role": "assistant", "content": on.0}));
        }
        // A prompt whose cached part (all but its last token) ends inside a character: its
        // last character is several tokens.
        let prompt = "Le thé est prêt: 龍";
        let short = tokenize(addr, "Le thé est prêt: ", true).await;
        assert!(tokenize(addr, prompt, true).await.len() >= short.len() + 2);
        let mut answers = Vec::new();
        for cache in [true, true, false] {
            let req = json!({"prompt": prompt, "max_tokens": 5, "temperature": 0,
                "logprobs": 1, "cache_prompt": cache});
            let (status, body) =
                http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
            assert_eq!(status, 200, "{body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            let c = &v["choices"][0];
            answers.push((c["text"].clone(), c["logprobs"]["token_logprobs"].clone()));
        }
        assert_eq!(answers[0], answers[2]);
        assert_eq!(answers[1], answers[2]);
        let (_, body) = http(addr, "GET", "/metrics", b"").await;
        let hits = metric(&body, "nsactor_prefix_cache_hits_total");
        let saved = metric(&body, "nsactor_prefix_cache_tokens_saved_total");
        // Turns 2 to 4 find the previous turn's history; the repeated prompt its own.
        assert!(hits >= 4.0, "{hits} hits");
        assert!(metric(&body, "nsactor_prefix_cache_misses_total") >= 2.0);
        assert!(saved > 0.0);
        assert!(metric(&body, "nsactor_prefix_cache_entries") > 0.0);
        assert!(metric(&body, "nsactor_prefix_cache_device_bytes") > 0.0);
    });
}

/// A WebSocket `generate` of 5 greedy tokens: the generated ids and the `done` event.
async fn turn(ws: &mut common::Ws, id: &str, extra: Value) -> (Vec<i64>, Value) {
    let mut req = json!({"type": "generate", "id": id, "max_tokens": 5, "temperature": 0,
        "token_ids": true, "ignore_eos": true});
    for (k, v) in extra.as_object().unwrap() {
        req[k] = v.clone();
    }
    let (_, ids, done) = generate(ws, req).await;
    assert_eq!(done["finish_reason"], "length", "{done}");
    (ids, done)
}

#[test]
fn a_websocket_conversation_goes_on_from_its_state() {
    let s = serve_limited(4, false, limits());
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let mut ws = connect(addr).await;
        let (gen1, done1) = turn(
            &mut ws,
            "a",
            json!({"conversation": "c", "prompt": "Once upon a time"}),
        )
        .await;
        let mut history = tokenize(addr, "Once upon a time", true).await;
        history.extend(&gen1);
        assert_eq!(done1["conversation_tokens"], history.len());
        assert_eq!(done1["conversation_started"], true, "{done1}");
        // A turn that means to start the conversation afresh is refused while it is kept.
        ws_send(
            &mut ws,
            json!({"type": "generate", "id": "x", "prompt": "x", "conversation": "c",
                "conversation_continue": false}),
        )
        .await;
        let e = common::next_json(&mut ws).await;
        assert_eq!(
            (&e["id"], &e["code"]),
            (&json!("x"), &json!("invalid_request")),
            "{e}"
        );
        // A text turn: appended as it is.
        let (gen2, done2) = turn(
            &mut ws,
            "b",
            json!({"conversation": "c", "prompt": " and then"}),
        )
        .await;
        history.extend(tokenize(addr, " and then", false).await);
        let (want2, _) = turn(
            &mut ws,
            "ref2",
            json!({"prompt": history, "cache_prompt": false}),
        )
        .await;
        assert_eq!(gen2, want2);
        history.extend(&gen2);
        assert_eq!(done2["conversation_tokens"], history.len());
        assert_eq!(done2["conversation_started"], false, "{done2}");
        // A chat turn: after the end of the last answer.
        let (gen3, _) = turn(
            &mut ws,
            "c",
            json!({"conversation": "c",
            "messages": [{"role": "user", "content": "Go on."}]}),
        )
        .await;
        let cont = "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n";
        history.extend(tokenize(addr, cont, false).await);
        let (want3, _) = turn(
            &mut ws,
            "ref3",
            json!({"prompt": history, "cache_prompt": false}),
        )
        .await;
        assert_eq!(gen3, want3);
        // Forgotten, a conversation starts again; an unknown one is an error, and a turn
        // that means to go on from one is refused rather than started afresh.
        ws_send(&mut ws, json!({"type": "forget", "conversation": "c"})).await;
        ws_send(
            &mut ws,
            json!({"type": "generate", "id": "y", "prompt": " more", "conversation": "c",
                "conversation_continue": true}),
        )
        .await;
        let e = common::next_json(&mut ws).await;
        assert_eq!(
            (&e["id"], &e["code"]),
            (&json!("y"), &json!("unknown_request")),
            "{e}"
        );
        let (again, done) = turn(
            &mut ws,
            "d",
            json!({"conversation": "c", "prompt": "Once upon a time"}),
        )
        .await;
        assert_eq!(
            (again, done["conversation_tokens"].clone()),
            (gen1, done1["conversation_tokens"].clone())
        );
        ws_send(
            &mut ws,
            json!({"type": "forget", "id": "f", "conversation": "nope"}),
        )
        .await;
        let e = common::next_json(&mut ws).await;
        assert_eq!(
            (&e["id"], &e["code"]),
            (&json!("f"), &json!("unknown_request")),
            "{e}"
        );
    });
}

#[test]
fn a_conversation_s_state_carried_to_another_server_goes_on_there_as_it_would_have() {
    // Two servers of the same model (the embedded tiny config, seed 0).
    let (a, b) = (
        serve_limited(4, false, limits()),
        serve_limited(4, false, limits()),
    );
    let (at_a, at_b) = (a.addr, b.addr);
    a.pipeline.block_on(async move {
        let mut messages = vec![
            json!({"role": "system", "content": "Answer in one word."}),
            json!({"role": "user", "content": "Where is the café?"}),
        ];
        let (answer, _, _) = chat(at_a, &messages, true).await;
        messages.push(json!({"role": "assistant", "content": answer}));
        let body = json!({"messages": messages}).to_string();
        let (status, file) = http_bytes(at_a, "/v1/state/export", body.as_bytes()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&file));
        assert_eq!(&file[..8], b"NSSTATE\0");
        let (status, ok) = http_bytes(at_b, "/v1/state/import", &file).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&ok));
        let ok: Value = serde_json::from_slice(&ok).unwrap();
        let tokens = ok["tokens"].as_u64().unwrap();
        messages.push(json!({"role": "user", "content": "And the tea?"}));
        // On B the next turn starts from the imported state; on A, with the cache off, from
        // nothing: the same answer and log-probabilities.
        let (_, before) = http(at_b, "GET", "/metrics", b"").await;
        let on_b = chat(at_b, &messages, true).await;
        let on_a = chat(at_a, &messages, false).await;
        assert_eq!(on_b, on_a);
        let (_, after) = http(at_b, "GET", "/metrics", b"").await;
        let saved = |m: &str| metric(m, "nsactor_prefix_cache_tokens_saved_total");
        assert!(
            saved(&after) - saved(&before) >= tokens as f64,
            "{tokens} tokens imported"
        );
        // Bad files are refused, saying why; the server serves on.
        let (status, e) = http_bytes(at_b, "/v1/state/import", b"{\"prompt\": \"hi\"}").await;
        assert_eq!(status, 400);
        assert!(String::from_utf8_lossy(&e).contains("not an nsactor state file"));
        let mut cut = file.clone();
        cut.truncate(file.len() - 100);
        let (status, e) = http_bytes(at_b, "/v1/state/import", &cut).await;
        assert_eq!(status, 400);
        assert!(String::from_utf8_lossy(&e).contains("SHA-256"));
        // The same file signed with another server's key: its membranes would reach other
        // clients' requests through the cache, so it is refused, saying so.
        use nsactor_server::saved;
        use nsactor_server::state_key::StateKey;
        let read = saved::decode(&file, &StateKey::process()).unwrap();
        let elsewhere = saved::encode(&read, &StateKey::from_secret(b"another server's secret"));
        let (status, e) = http_bytes(at_b, "/v1/state/import", &elsewhere).await;
        let e = String::from_utf8_lossy(&e);
        assert_eq!(status, 400, "{e}");
        assert!(e.contains("not signed with this server's state key"), "{e}");
        // Over the WebSocket: exported from one connection's conversation, imported into
        // another's, whose next turn equals a fresh request of the whole history.
        let mut ws = connect(at_a).await;
        let (gen1, _) = turn(
            &mut ws,
            "a",
            json!({"conversation": "c", "prompt": "Tea or"}),
        )
        .await;
        ws_send(
            &mut ws,
            json!({"type": "export", "id": "x", "conversation": "c"}),
        )
        .await;
        let state = common::next_json(&mut ws).await;
        assert_eq!(state["type"], "state", "{state}");
        let mut other = connect(at_b).await;
        ws_send(
            &mut other,
            json!({"type": "import", "id": "y", "conversation": "d",
            "state": state["state"]}),
        )
        .await;
        let imported = common::next_json(&mut other).await;
        assert_eq!(imported["type"], "imported", "{imported}");
        assert_eq!(imported["tokens"], state["tokens"]);
        let (gen2, _) = turn(
            &mut other,
            "b",
            json!({"conversation": "d", "prompt": " coffee"}),
        )
        .await;
        let mut history = tokenize(at_a, "Tea or", true).await;
        history.extend(&gen1);
        history.extend(tokenize(at_a, " coffee", false).await);
        let (want, _) = turn(
            &mut ws,
            "ref",
            json!({"prompt": history, "cache_prompt": false}),
        )
        .await;
        assert_eq!(gen2, want);
        ws_send(
            &mut other,
            json!({"type": "import", "id": "z", "conversation": "e", "state": "%%%"}),
        )
        .await;
        let e = common::next_json(&mut other).await;
        assert!(e["message"].as_str().unwrap().contains("base64"), "{e}");
    });
    drop(b);
}

/// `serve --prefix-cache-dir`: the cache written when a server stops comes back into another
/// server's host tier, whose next turn then prefills only what is new and answers as a server
/// without the cache does; a damaged file is set aside, named, and the others load.
#[test]
fn a_cache_written_to_a_folder_comes_back_in_another_server() {
    use nsactor_server::persist;
    let dir = std::env::temp_dir().join(format!("nsactor-persist-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (a, b) = (
        serve_limited(4, false, limits()),
        serve_limited(4, false, limits()),
    );
    let (at_a, at_b) = (a.addr, b.addr);
    let (state_a, state_b) = (a.state.clone(), b.state.clone());
    let d = dir.clone();
    a.pipeline.block_on(async move {
        let mut messages = vec![
            json!({"role": "system", "content": "Answer in one word."}),
            json!({"role": "user", "content": "Where is the station?"}),
        ];
        let (answer, _, _) = chat(at_a, &messages, true).await;
        let w = persist::save(&state_a, &d).await.unwrap();
        assert!(w.files >= 2 && w.bytes > 0, "{w:?}");
        // Written again over the first set: the old files make way.
        let again = persist::save(&state_a, &d).await.unwrap();
        assert_eq!(again.files, w.files);
        let names = |f: &std::path::Path| {
            let mut n: Vec<String> = std::fs::read_dir(f)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            n.sort();
            n
        };
        assert_eq!(names(&w.folder).len(), w.files, "{:?}", names(&w.folder));
        // One damaged file among them.
        let last = w.folder.join(format!("{:06}.nsstate", w.files - 1));
        let mut bytes = std::fs::read(&last).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        std::fs::write(&last, bytes).unwrap();
        let l = persist::load(&state_b, &d).await.unwrap();
        assert_eq!((l.adopted, l.left), (w.files - 1, 0), "{l:?}");
        assert_eq!(l.refused.len(), 1, "{l:?}");
        assert!(l.refused[0].1.contains("SHA-256"), "{l:?}");
        assert!(last.with_extension("refused").exists());
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": "And the port?"}));
        let (_, before) = http(at_b, "GET", "/metrics", b"").await;
        let on_b = chat(at_b, &messages, true).await;
        let on_a = chat(at_a, &messages, false).await;
        assert_eq!(on_b, on_a);
        let (_, after) = http(at_b, "GET", "/metrics", b"").await;
        let hits = |m: &str| metric(m, "nsactor_prefix_cache_hits_total");
        assert_eq!(
            hits(&after) - hits(&before),
            1.0,
            "the loaded snapshot was hit"
        );
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// A request's prompts that share a few-shot prefix are generated from one pass over it: the
/// first feeds it and keeps a snapshot where the prompts part, the others wait for it and
/// start there; each text and its log-probabilities are those of the prompt alone without
/// the cache.
#[test]
fn a_batch_of_prompts_sharing_a_prefix_feeds_it_once() {
    let s = serve_limited(8, true, limits());
    let (addr, state) = (s.addr, s.state.clone());
    let shared: Vec<i64> = (0..50).map(|i| 5 + (i * 13) % 400).collect();
    let prompts: Vec<Vec<i64>> = (0..4)
        .map(|k| {
            shared
                .iter()
                .copied()
                .chain([100 + k, 200 + k, 7])
                .collect()
        })
        .collect();
    s.pipeline.block_on(async move {
        let body = |prompt: Value, cache: bool| {
            json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": true,
                "logprobs": 1, "cache_prompt": cache})
            .to_string()
        };
        let answers = |v: &Value| -> Vec<Value> {
            let mut c = v["choices"].as_array().unwrap().clone();
            c.sort_by_key(|c| c["index"].as_u64());
            c.iter()
                .map(|c| json!([c["text"], c["logprobs"]["token_logprobs"]]))
                .collect()
        };
        let mut alone = Vec::new();
        for p in &prompts {
            let (st, b) = http(
                addr,
                "POST",
                "/v1/completions",
                body(json!(p), false).as_bytes(),
            )
            .await;
            assert_eq!(st, 200, "{b}");
            alone.extend(answers(&serde_json::from_str(&b).unwrap()));
        }
        let saved0 = state.generator.prefix.report().tokens_saved;
        let (st, b) = http(
            addr,
            "POST",
            "/v1/completions",
            body(json!(prompts), true).as_bytes(),
        )
        .await;
        assert_eq!(st, 200, "{b}");
        assert_eq!(answers(&serde_json::from_str(&b).unwrap()), alone);
        let saved = state.generator.prefix.report().tokens_saved - saved0;
        assert_eq!(saved, 3 * shared.len() as u64, "the shared prefix fed once");
    });
}
