//! The HTTP side of `nsactor bench serve`: clients of `/v1/completions` with `stream: true`
//! (Server-Sent Events) over hyper on loopback, as an OpenAI client would call the server.

use super::stats::ServeTimings;
use crate::result::CliResult;
use http_body_util::BodyExt;
use std::time::Instant;

/// What one streaming client saw.
struct Stream {
    /// Seconds to the first chunk with a token (its text may be empty, as vLLM's
    /// `benchmark_serving` counts).
    ttft: f64,
    /// Seconds to the first chunk with text.
    first_text: f64,
    /// Seconds between the chunks with a token.
    gaps: Vec<f64>,
    tokens: usize,
    text: String,
}

/// `sessions` clients of `POST /v1/completions` (`stream: true`, usage in the last event),
/// each generating `tokens` tokens at `temperature` (client i with seed i), from the server at
/// `addr`; run on the server's runtime. The clock starts once every client has connected.
pub async fn sse_load(
    addr: std::net::SocketAddr,
    sessions: usize,
    tokens: usize,
    temperature: f32,
) -> CliResult<ServeTimings> {
    // Every client connects first; the clock starts when all are connected and they send
    // together (as the WebSocket clients of `bench serve` do).
    let ready = std::sync::Arc::new(tokio::sync::Barrier::new(sessions + 1));
    let clients: Vec<_> = (0..sessions)
        .map(|i| tokio::spawn(one(addr, i, tokens, temperature, ready.clone())))
        .collect();
    ready.wait().await;
    let start = Instant::now();
    let (mut ttfts, mut gaps, mut total) = (Vec::new(), Vec::new(), 0usize);
    let (mut texts, mut first_texts) = (std::collections::HashSet::new(), Vec::new());
    for c in clients {
        let s = c.await??;
        ttfts.push(s.ttft);
        first_texts.push(s.first_text);
        gaps.extend(s.gaps);
        total += s.tokens;
        texts.insert(s.text);
    }
    let wall = start.elapsed().as_secs_f64();
    let mut t = ServeTimings::of(sessions, ttfts, gaps, total, texts.len(), wall);
    t.first_text_p50_ms = Some(super::stats::pct(&mut first_texts, 0.5) * 1e3);
    Ok(t)
}

/// One HTTP/1 connection's request side.
/// Appends `bytes` of an event stream to `buf`: the `data:` payloads of the events it
/// completes (trimmed), in order; a partial event stays in `buf`.
pub(super) fn data_events(buf: &mut String, bytes: &[u8]) -> Vec<String> {
    buf.push_str(&String::from_utf8_lossy(bytes));
    let mut out = Vec::new();
    while let Some(end) = buf.find("\n\n") {
        let event: String = buf.drain(..end + 2).collect();
        if let Some(p) = event.trim().strip_prefix("data:") {
            out.push(p.trim().to_string());
        }
    }
    out
}

pub(super) type Sender =
    hyper::client::conn::http1::SendRequest<http_body_util::Full<hyper::body::Bytes>>;

/// An HTTP/1 connection to the server at `addr` (no Nagle delay, as a client on another host
/// would have none to wait for).
pub(super) async fn connect(addr: std::net::SocketAddr) -> CliResult<Sender> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .map_err(|e| format!("HTTP handshake: {e}"))?;
    tokio::spawn(conn);
    Ok(sender)
}

/// `POST path` with the JSON `body` on `sender`: the response's body, or an error with the
/// server's answer when it is not a success.
pub(super) async fn post(
    sender: &mut Sender,
    addr: std::net::SocketAddr,
    path: &str,
    body: &serde_json::Value,
) -> CliResult<hyper::body::Incoming> {
    let req = hyper::Request::post(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(hyper::body::Bytes::from(
            body.to_string(),
        )))
        .map_err(|e| format!("request: {e}"))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("POST {path}: {e}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let body = resp.into_body().collect().await.map(|b| b.to_bytes());
        return Err(format!("server answered {status}: {body:?}").into());
    }
    Ok(resp.into_body())
}

async fn one(
    addr: std::net::SocketAddr,
    seed: usize,
    tokens: usize,
    temperature: f32,
    ready: std::sync::Arc<tokio::sync::Barrier>,
) -> CliResult<Stream> {
    let sender = connect(addr).await;
    ready.wait().await;
    let mut sender = sender?;
    let body = serde_json::json!({"prompt": "Emma was", "max_tokens": tokens,
        "temperature": temperature, "seed": seed, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true}});
    let sent = Instant::now();
    let mut body = post(&mut sender, addr, "/v1/completions", &body).await?;
    let (mut buf, mut text) = (String::new(), String::new());
    let (mut ttft, mut first_text, mut last, mut events) = (None, None, sent, Vec::new());
    let mut usage = None;
    'read: while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the stream: {e}"))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        for payload in data_events(&mut buf, data) {
            if payload == "[DONE]" {
                break 'read;
            }
            let v: serde_json::Value = serde_json::from_str(&payload)?;
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                usage = Some(n as usize);
            }
            // A chunk per token: the finish chunk and the usage chunk carry none.
            let choice = &v["choices"][0];
            if choice.is_object() && choice["finish_reason"].is_null() {
                let now = Instant::now();
                ttft.get_or_insert((now - sent).as_secs_f64());
                events.push((now - last).as_secs_f64());
                last = now;
                let piece = choice["text"].as_str().unwrap_or("");
                if !piece.is_empty() {
                    first_text.get_or_insert((now - sent).as_secs_f64());
                }
                text.push_str(piece);
            }
        }
    }
    let tokens = usage.ok_or("the stream ended without its usage")?;
    // The first chunk's wait is the time to first token; the gaps after it are per token.
    let gaps = events.into_iter().skip(1).collect();
    Ok(Stream {
        ttft: ttft.unwrap_or(f64::NAN),
        first_text: first_text.unwrap_or(f64::NAN),
        gaps,
        tokens,
        text,
    })
}
