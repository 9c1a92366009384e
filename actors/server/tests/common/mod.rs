//! Shared by the server tests: a model served on loopback, and small WebSocket / HTTP clients.
#![allow(dead_code)]

use futures_util::{SinkExt, StreamExt};
use nsactor_decoding::{Pipeline, PipelinePlan};
use nsactor_engine::engine::StagedModel;
use nsactor_plugin_api::OptimizerKind;
use nsactor_server::generate::GenEvent;
use nsactor_server::generate::{Admission, Generator};
use nsactor_server::logprobs::{TokenLogprob, token_logprob};
use nsactor_server::protocol::Limits;
use nsactor_server::protocol::{GenSpec, PromptSpec};
use nsactor_server::{ServerState, ServingMetrics};
use nsactor_training::verify::TinyAFixture;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use tokio_tungstenite::tungstenite::Message;

pub fn fixture() -> Vec<u8> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures/tiny_a.safetensors");
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

pub struct Served {
    pub pipeline: Pipeline,
    pub addr: std::net::SocketAddr,
    pub state: Arc<ServerState>,
    pub greedy: Vec<i64>,
    pub prompt: Vec<i64>,
}

pub fn serve(max_sessions: usize, max_queue: usize) -> Served {
    serve_model(max_sessions, max_queue, true)
}

/// `tiny_a` behind API `keys`.
pub fn serve_keyed(keys: nsactor_server::auth::ApiKeys) -> Served {
    serve_with(4, 4, true, keys, Limits::default())
}

/// `tiny_a` whose server starts warming up (`ready` says when it is done).
pub fn serve_warming(ready: Arc<nsactor_server::ready::Readiness>) -> Served {
    serve_full(
        4,
        4,
        true,
        Default::default(),
        (Limits::default(), ready),
        None,
    )
}

/// `tiny_a` with a fault injected (`session-panic:LAYER:PASS`), its weights loaded from a
/// source decoding can read again after a rebuild.
pub fn serve_faulty(fault: &str) -> Served {
    let ready = (Limits::default(), Arc::default());
    serve_full(4, 4, true, Default::default(), ready, Some(fault))
}

/// The embedded tiny config (text prompts) behind API `keys`.
pub fn serve_text_keyed(keys: nsactor_server::auth::ApiKeys) -> Served {
    serve_with(4, 8, false, keys, Limits::default())
}

/// `tiny_a` (or the embedded tiny config) under `limits`.
pub fn serve_limited(max_sessions: usize, tiny_a: bool, limits: Limits) -> Served {
    serve_with(
        max_sessions,
        max_sessions,
        tiny_a,
        Default::default(),
        limits,
    )
}

/// `tiny_a` (vocabulary 512, fixture weights) or, with `tiny_a = false`, the embedded tiny
/// config (vocabulary 2048, the bundled tokenizer's, freshly initialised) for text prompts.
pub fn serve_model(max_sessions: usize, max_queue: usize, tiny_a: bool) -> Served {
    serve_with(
        max_sessions,
        max_queue,
        tiny_a,
        Default::default(),
        Limits::default(),
    )
}

fn serve_with(
    max_sessions: usize,
    max_queue: usize,
    tiny_a: bool,
    keys: nsactor_server::auth::ApiKeys,
    limits: Limits,
) -> Served {
    serve_full(
        max_sessions,
        max_queue,
        tiny_a,
        keys,
        (limits, Default::default()),
        None,
    )
}

fn serve_full(
    max_sessions: usize,
    max_queue: usize,
    tiny_a: bool,
    keys: nsactor_server::auth::ApiKeys,
    (limits, ready): (Limits, Arc<nsactor_server::ready::Readiness>),
    fault: Option<&str>,
) -> Served {
    let bytes = fixture();
    let fx = TinyAFixture::parse(&bytes).unwrap();
    let backend = nsactor_engine::backend::open(nsactor_engine::backend::EMBEDDED, &[]).unwrap();
    let cfg = nsactor_engine::config::RunConfig::load(None).unwrap();
    let (model, vocab) = if tiny_a {
        (fx.model().unwrap(), 512)
    } else {
        (cfg.model.clone(), 2048)
    };
    let staged = StagedModel::open(backend, &model, 0, OptimizerKind::Adam, None).unwrap();
    let plan = PipelinePlan::balanced(2, 2, &[0]).unwrap();
    let mut train = nsactor_engine::config::RunConfig::load(None).unwrap().train;
    train.inject_fault = fault.map(str::to_string);
    let mut pipeline = Pipeline::start(staged, plan, train, None).unwrap();
    if tiny_a {
        // The fixture's greedy run decodes with the weights after its training step; from a
        // source that a rebuild after a lost stage reads again.
        // With a fault, reading them again takes 300 ms, so `/health` has time to say so.
        let weights = Arc::new(fx.weights("after.").unwrap());
        let stages = pipeline.num_layers() + 1;
        let reads = std::sync::atomic::AtomicUsize::new(0);
        let slow = fault.is_some();
        pipeline
            .load_from(Arc::new(move || {
                if reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 && slow {
                    std::thread::sleep(std::time::Duration::from_millis(300));
                }
                Ok(vec![weights.clone(); stages])
            }))
            .unwrap();
    }
    let state = Arc::new(ServerState {
        generator: Generator {
            decoder: pipeline.decoder(vocab),
            prefix: Arc::default(),
            tokenizer: Arc::new(nsactor_data::Tokenizer::bundled()),
            admission: Admission::new(max_sessions, max_queue),
            metrics: Arc::new(ServingMetrics::default()),
            // 64 unless the limits name another.
            max_prompt_tokens: match limits.max_prompt_tokens {
                nsactor_server::protocol::DEFAULT_MAX_PROMPT_TOKENS => 64,
                n => n,
            },
            drain: Arc::default(),
            ready,
        },
        model_name: "tiny_a".into(),
        limits,
        keys: keys.clone(),
        cors: nsactor_server::cors::Cors::parse(&["https://app.example".into()]).unwrap(),
        state_key: Default::default(),
    });
    let s = state.clone();
    let addr = pipeline.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(nsactor_server::serve(listener, s, std::future::pending()));
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

pub type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

pub async fn connect(addr: std::net::SocketAddr) -> Ws {
    tokio_tungstenite::connect_async(format!("ws://{addr}/ws"))
        .await
        .unwrap()
        .0
}

pub async fn next_json(ws: &mut Ws) -> serde_json::Value {
    loop {
        match ws.next().await.expect("stream open").unwrap() {
            Message::Text(t) => return serde_json::from_str(&t).unwrap(),
            _ => continue,
        }
    }
}

/// Sends a request and collects `(text, token ids, done event)`.
pub async fn generate(
    ws: &mut Ws,
    req: serde_json::Value,
) -> (String, Vec<i64>, serde_json::Value) {
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
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, String) {
    http_with(addr, method, path, "", body).await
}

/// [`http`] with extra header lines (`"Name: value\r\n"` each).
pub async fn http_with(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &[u8],
) -> (u16, String) {
    let (status, _, body) = http_head(addr, method, path, headers, body).await;
    (status, body)
}

/// The JSON `data:` events of a server-sent event stream, and whether it ended in `[DONE]`.
pub fn sse_events(body: &str) -> (Vec<serde_json::Value>, bool) {
    let mut events = Vec::new();
    let mut done = false;
    for line in body.lines() {
        if let Some(d) = line.strip_prefix("data: ") {
            if d == "[DONE]" {
                done = true;
            } else {
                events.push(serde_json::from_str(d).unwrap_or_else(|e| panic!("{d}: {e}")));
            }
        }
    }
    (events, done)
}

/// Connects and sends one JSON request (`headers`: extra `"Name: value\r\n"` lines); the
/// stream, to read the answer from or to drop mid-answer.
pub async fn send_request(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &[u8],
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{headers}\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    s
}

/// [`http_with`] that also returns the response head (status line and headers): reads the
/// head, then `Content-Length` bytes when given, else to the end of the stream (60 s at most).
pub async fn http_head(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: &[u8],
) -> (u16, String, String) {
    let exchange = async {
        use tokio::io::AsyncReadExt;
        let headers = format!("{headers}Connection: close\r\n");
        let mut s = send_request(addr, method, path, &headers, body).await;
        let mut out = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            let n = s.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&out);
            if let Some((h, b)) = text.split_once("\r\n\r\n") {
                let len = h.lines().find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                });
                if len.is_some_and(|len| b.len() >= len) {
                    break;
                }
            }
        }
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text[9..12].parse().unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        (status, head.to_string(), body.to_string())
    };
    tokio::time::timeout(std::time::Duration::from_secs(60), exchange)
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no complete answer in 60 s"))
}

/// The old way: one decoder pass per token, each position's logits scoring the next token.
pub async fn token_at_a_time(g: &Generator, prompt: &[i64], top: usize) -> Vec<TokenLogprob> {
    let s = g.decoder.session();
    let mut out = Vec::new();
    let mut logits = g.decoder.feed(s, vec![prompt[0]]).await.unwrap();
    for &t in &prompt[1..] {
        out.push(token_logprob(&logits, t, top));
        logits = g.decoder.feed(s, vec![t]).await.unwrap();
    }
    g.decoder.close(s).await;
    out
}

/// The server's way: a scoring request (`max_tokens` 1, prompt log-probabilities) through the
/// prefix cache, parting from the prompts scored beside it at `parts`.
pub async fn scored(
    g: Arc<Generator>,
    prompt: Vec<i64>,
    top: usize,
    parts: Vec<usize>,
) -> Vec<TokenLogprob> {
    let spec = GenSpec {
        prompt: PromptSpec::Ids(prompt),
        max_tokens: 1,
        sampling: nsactor_engine::decode::SamplingParams::greedy(),
        stop: Vec::new(),
        token_ids: true,
        ignore_eos: true,
        logit_bias: Vec::new(),
        logprobs: Some(top),
        prompt_logprobs: Some(top),
        add_special_tokens: false,
        cache_prompt: true,
        time_limit: None,
        extras: Default::default(),
        parts,
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let run = tokio::spawn(async move {
        g.run(spec, tx, Arc::new(AtomicBool::new(false)))
            .await
            .unwrap()
    });
    let mut prompt_lps = None;
    while let Some(e) = rx.recv().await {
        if let GenEvent::Prompt { logprobs, .. } = e {
            prompt_lps = Some(logprobs);
        }
    }
    run.await.unwrap();
    let lps = prompt_lps.expect("the prompt's log-probabilities");
    assert!(lps[0].is_none(), "the first token has no context");
    lps.into_iter().skip(1).map(Option::unwrap).collect()
}

/// A scored position's token, its log-probability's bits and its alternatives'.
pub type Bits = (i64, u32, Vec<(i64, u32)>);

pub fn bits(lps: &[TokenLogprob]) -> Vec<Bits> {
    lps.iter()
        .map(|l| {
            let top = l.top.iter().map(|(t, p)| (*t, p.to_bits())).collect();
            (l.token_id, l.logprob.to_bits(), top)
        })
        .collect()
}

/// The token ids `/tokenize` gives `text` (with the BOS where `bos`).
pub async fn tokenize(addr: std::net::SocketAddr, text: &str, bos: bool) -> Vec<i64> {
    let req = json!({"prompt": text, "add_special_tokens": bos});
    let (status, body) = http(addr, "POST", "/tokenize", req.to_string().as_bytes()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect()
}

/// Sends `v` as a text message.
pub async fn ws_send(ws: &mut Ws, v: Value) {
    ws.send(Message::Text(v.to_string().into())).await.unwrap();
}

/// POST `body` to `path`: the status and the raw body.
pub async fn http_bytes(addr: std::net::SocketAddr, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let mut s = send_request(addr, "POST", path, "Connection: close\r\n", body).await;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let split = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&out[..split]).to_string();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, out[split + 4..].to_vec())
}
