//! The streaming server end to end on loopback, on the `tiny_a` fixture's weights: greedy
//! output equals the fixture's, 32 concurrent WebSocket clients get complete and correct
//! streams, a disconnect frees the session, bad input gets clear errors.

#![cfg(feature = "embedded-cpu")]

use futures_util::{SinkExt, StreamExt};
use nsactor::engine::StagedModel;
use nsactor::pipeline::{Pipeline, PipelinePlan};
use nsactor::server::generate::{Admission, Generator};
use nsactor::server::protocol::Limits;
use nsactor::server::{Metrics, ServerState};
use nsactor::verify::TinyAFixture;
use nsactor_plugin_api::OptimizerKind;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio_tungstenite::tungstenite::Message;

fn fixture() -> Vec<u8> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/tiny_a.safetensors");
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

struct Served {
    pipeline: Pipeline,
    addr: std::net::SocketAddr,
    state: Arc<ServerState>,
    greedy: Vec<i64>,
    prompt: Vec<i64>,
}

fn serve(max_sessions: usize, max_queue: usize) -> Served {
    serve_model(max_sessions, max_queue, true)
}

/// `tiny_a` (vocabulary 512, fixture weights) or, with `tiny_a = false`, the embedded tiny
/// config (vocabulary 2048, the bundled tokenizer's, freshly initialised) for text prompts.
fn serve_model(max_sessions: usize, max_queue: usize, tiny_a: bool) -> Served {
    let bytes = fixture();
    let fx = TinyAFixture::parse(&bytes).unwrap();
    let backend = nsactor::backend::open(nsactor::backend::EMBEDDED, &[]).unwrap();
    let cfg = nsactor::config::RunConfig::load(None).unwrap();
    let (toml, vocab) = if tiny_a {
        (fx.model_toml(), 512)
    } else {
        (cfg.model_toml(), 2048)
    };
    let mut staged = StagedModel::open(backend, &toml, 0, OptimizerKind::Adam, None).unwrap();
    if tiny_a {
        // The fixture's greedy run decodes with the weights after its training step.
        staged
            .load_model_bytes(&fx.weights("after.").unwrap())
            .unwrap();
    }
    let plan = PipelinePlan::balanced(2, 2, &[0]).unwrap();
    let train = nsactor::config::RunConfig::load(None).unwrap().train;
    let pipeline = Pipeline::start(staged, plan, train, None).unwrap();
    let state = Arc::new(ServerState {
        generator: Generator {
            decoder: pipeline.decoder(vocab),
            tokenizer: Arc::new(nsactor_data::Tokenizer::bundled()),
            admission: Admission::new(max_sessions, max_queue),
            metrics: Arc::new(Metrics::default()),
            max_prompt_tokens: 64,
        },
        model_name: "tiny_a".into(),
        limits: Limits::default(),
    });
    let s = state.clone();
    let addr = pipeline.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(nsactor::server::serve(listener, s, std::future::pending()));
        addr
    });
    Served {
        pipeline,
        addr,
        state,
        greedy: fx.i64s("gen.greedy").unwrap(),
        prompt: fx.i64s("gen.prompt").unwrap(),
    }
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(addr: std::net::SocketAddr) -> Ws {
    tokio_tungstenite::connect_async(format!("ws://{addr}/ws"))
        .await
        .unwrap()
        .0
}

async fn next_json(ws: &mut Ws) -> serde_json::Value {
    loop {
        match ws.next().await.expect("stream open").unwrap() {
            Message::Text(t) => return serde_json::from_str(&t).unwrap(),
            _ => continue,
        }
    }
}

/// Sends a request and collects `(text, token ids, done event)`.
async fn generate(ws: &mut Ws, req: serde_json::Value) -> (String, Vec<i64>, serde_json::Value) {
    let id = req["id"].as_str().unwrap().to_string();
    ws.send(Message::Text(req.to_string().into()))
        .await
        .unwrap();
    let (mut text, mut ids) = (String::new(), Vec::new());
    loop {
        let m = next_json(ws).await;
        assert_eq!(m["id"], id.as_str(), "{m}");
        match m["type"].as_str().unwrap() {
            "delta" => {
                text.push_str(m["text"].as_str().unwrap());
                if let Some(t) = m["token_ids"].as_array() {
                    ids.extend(t.iter().map(|v| v.as_i64().unwrap()));
                }
            }
            "done" => return (text, ids, m),
            _ => panic!("unexpected {m}"),
        }
    }
}

/// A raw HTTP/1.1 exchange: status line and body (chunked bodies are returned as sent).
async fn http(addr: std::net::SocketAddr, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text[9..12].parse().unwrap();
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

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
        assert_eq!(
            state
                .generator
                .metrics
                .active_sessions
                .load(Ordering::SeqCst),
            1
        );
        drop(ws);
        let t = std::time::Instant::now();
        while state
            .generator
            .metrics
            .active_sessions
            .load(Ordering::SeqCst)
            != 0
        {
            assert!(t.elapsed().as_secs() < 10, "the session was not freed");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let (_, metrics) = http(addr, "GET", "/metrics", b"").await;
        assert!(metrics.contains("nsactor_active_sessions 0"), "{metrics}");
        assert!(metrics.contains("nsactor_requests_total 34"), "{metrics}");
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
        let _ = big.send(Message::Text("x".repeat(2 << 20).into())).await;
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
            (&b"{"[..], "invalid request body"),
            (br#"{"prompt":"x","frequency":1}"#, "frequency"),
            (b"{\"prompt\":\"\xff\xfe\"}", "invalid request body"),
            (br#"{"messages":[{"role":"user","content":"x"}]}"#, "needs `prompt`"),
            (br#"{"prompt":"x","n":3}"#, "n = 1"),
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
