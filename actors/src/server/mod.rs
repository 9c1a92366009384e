//! `nsactor serve`: streaming generation over WebSocket and OpenAI-compatible HTTP (axum on the
//! pipeline's tokio runtime). NeuronSpark needs no KV cache: each session's neuron membranes,
//! held by the layer actors, carry the context, so every new token costs the same whatever the
//! prompt length.
//!
//! * `GET /ws`: JSON messages — `generate` (prompt or ChatML messages, sampling options, stop
//!   strings), `cancel`; events `delta`, `done` (finish reason, usage, timing), `error`; several
//!   requests per connection, each with its own `id`.
//! * `POST /v1/completions`, `POST /v1/chat/completions` (with and without `stream: true`,
//!   server-sent events ending in `data: [DONE]`), `GET /v1/models`, `GET /health`,
//!   `GET /metrics` (Prometheus text).
//! * `GET /`: a small chat page that talks to `/ws`.
//!
//! Bad input never crashes the server and always gets an error naming what was wrong.

pub mod generate;
pub mod protocol;

use axum::Router;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::{SinkExt, StreamExt};
use generate::{Finished, GenEvent, Generator};
use protocol::{ClientMsg, GenSpec, Limits, OpenAiRequest, Options, PromptSpec, ServerMsg};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Busy(String),
    #[error("{0}")]
    Internal(String),
}

impl ServeError {
    fn code(&self) -> &'static str {
        match self {
            ServeError::Invalid(_) => "invalid_request",
            ServeError::Busy(_) => "busy",
            ServeError::Internal(_) => "internal",
        }
    }

    fn status(&self) -> StatusCode {
        match self {
            ServeError::Invalid(_) => StatusCode::BAD_REQUEST,
            ServeError::Busy(_) => StatusCode::SERVICE_UNAVAILABLE,
            ServeError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ServeError {
    /// OpenAI's error body.
    fn into_response(self) -> Response {
        let body = serde_json::json!({"error": {
            "message": self.to_string(), "type": self.code(), "code": self.code(),
        }});
        let mut r = (self.status(), axum::Json(body)).into_response();
        if matches!(self, ServeError::Busy(_)) {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        r
    }
}

/// Request latency buckets, seconds.
const BUCKETS: [f64; 9] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Counters behind `GET /metrics`.
#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    pub busy: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub active_sessions: AtomicI64,
    ttft: Mutex<Histogram>,
    duration: Mutex<Histogram>,
}

#[derive(Default)]
struct Histogram {
    buckets: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (b, le) in self.buckets.iter_mut().zip(BUCKETS) {
            if v <= le {
                *b += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (b, le) in self.buckets.iter().zip(BUCKETS) {
            out.push_str(&format!("{name}_bucket{{le=\"{le}\"}} {b}\n"));
        }
        out.push_str(&format!(
            "{name}_bucket{{le=\"+Inf\"}} {c}\n{name}_sum {s}\n{name}_count {c}\n",
            c = self.count,
            s = self.sum
        ));
    }
}

impl Metrics {
    fn record(&self, f: &Finished) {
        self.prompt_tokens
            .fetch_add(f.usage.prompt_tokens as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(f.usage.completion_tokens as u64, Ordering::Relaxed);
        if let Ok(mut h) = self.ttft.lock() {
            h.observe(f.timing.time_to_first_token_ms / 1e3);
        }
        if let Ok(mut h) = self.duration.lock() {
            h.observe(f.timing.total_ms / 1e3);
        }
    }

    /// Prometheus text exposition.
    /// `batches` is the decoder's (cohorts, session inputs) so far, `open` its open sessions.
    pub fn render(&self, queued: usize, batches: (u64, u64), open: u64) -> String {
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, kind: &str, v: String| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        };
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed).to_string();
        counter(
            "nsactor_requests_total",
            "Generation requests received.",
            "counter",
            get(&self.requests),
        );
        counter(
            "nsactor_requests_failed_total",
            "Requests that ended in an error.",
            "counter",
            get(&self.failed),
        );
        counter(
            "nsactor_requests_busy_total",
            "Requests refused because the server was full.",
            "counter",
            get(&self.busy),
        );
        counter(
            "nsactor_prompt_tokens_total",
            "Prompt tokens prefilled.",
            "counter",
            get(&self.prompt_tokens),
        );
        counter(
            "nsactor_completion_tokens_total",
            "Tokens generated.",
            "counter",
            get(&self.completion_tokens),
        );
        counter(
            "nsactor_active_sessions",
            "Sessions decoding now (their neuron states are held by the layer actors).",
            "gauge",
            self.active_sessions.load(Ordering::SeqCst).to_string(),
        );
        counter(
            "nsactor_queued_sessions",
            "Requests waiting for a session slot.",
            "gauge",
            queued.to_string(),
        );
        counter(
            "nsactor_decode_open_sessions",
            "Sessions whose neuron states the layer actors hold.",
            "gauge",
            open.to_string(),
        );
        counter(
            "nsactor_decode_batches_total",
            "Batched passes through the layers (prompts and tokens of several sessions each).",
            "counter",
            batches.0.to_string(),
        );
        counter(
            "nsactor_decode_batch_inputs_total",
            "Session inputs carried by those passes (divided by the batches: the mean batch).",
            "counter",
            batches.1.to_string(),
        );
        if let Ok(h) = self.ttft.lock() {
            h.render(
                "nsactor_time_to_first_token_seconds",
                "Request received to first token.",
                &mut out,
            );
        }
        if let Ok(h) = self.duration.lock() {
            h.render(
                "nsactor_request_duration_seconds",
                "Request received to last token.",
                &mut out,
            );
        }
        out
    }
}

/// Everything a request handler needs.
pub struct ServerState {
    pub generator: Generator,
    pub model_name: String,
    pub limits: Limits,
}

type Shared = Arc<ServerState>;

/// The router of the server.
pub fn router(state: Shared) -> Router {
    let limit = state.limits.max_message_bytes;
    Router::new()
        .route("/", get(index))
        .route("/ws", get(ws))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Serves on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Shared,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    // Tokens go out one small frame at a time: without TCP_NODELAY, Nagle's algorithm holds a
    // frame back until the client's delayed ACK (~40 ms on Linux).
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("TCP_NODELAY: {e}");
        }
    });
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn index() -> Html<&'static str> {
    Html(include_str!("chat.html"))
}

async fn health() -> impl IntoResponse {
    axum::Json(serde_json::json!({"status": "ok"}))
}

async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.generator.metrics.render(
            s.generator.admission.queued(),
            s.generator.decoder.batch_counts(),
            s.generator.decoder.open_sessions(),
        ),
    )
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(s): State<Shared>) -> impl IntoResponse {
    axum::Json(serde_json::json!({"object": "list", "data": [{
        "id": s.model_name, "object": "model", "created": now(), "owned_by": "nsactor",
    }]}))
}

/// Starts a generation task; its events arrive on the returned receiver.
fn start(
    s: &Shared,
    spec: GenSpec,
    cancel: Arc<AtomicBool>,
) -> mpsc::Receiver<Result<GenEvent, ServeError>> {
    let (tx, mut rx_gen) = mpsc::channel::<GenEvent>(64);
    let (out, rx) = mpsc::channel(64);
    s.generator.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let s = s.clone();
    tokio::spawn(async move {
        let forward = {
            let out = out.clone();
            async move {
                while let Some(e) = rx_gen.recv().await {
                    if out.send(Ok(e)).await.is_err() {
                        break;
                    }
                }
            }
        };
        let run = s.generator.run(spec, tx, cancel);
        let (r, ()) = tokio::join!(run, forward);
        if let Err(e) = r {
            let m = &s.generator.metrics;
            if matches!(e, ServeError::Busy(_)) {
                m.busy.fetch_add(1, Ordering::Relaxed);
            } else {
                m.failed.fetch_add(1, Ordering::Relaxed);
            }
            let _ = out.send(Err(e)).await;
        }
    });
    rx
}

fn parse_openai(body: &Bytes, limits: &Limits, chat: bool) -> Result<(GenSpec, bool), ServeError> {
    let req: OpenAiRequest = serde_json::from_slice(body)
        .map_err(|e| ServeError::Invalid(format!("invalid request body: {e}")))?;
    let prompt = match (chat, req.prompt.clone(), req.messages.clone()) {
        (false, Some(protocol::Prompt::Text(t)), None) => PromptSpec::Text(t),
        (false, Some(protocol::Prompt::Ids(ids)), None) => PromptSpec::Ids(ids),
        (true, None, Some(m)) => PromptSpec::Chat(m),
        (false, _, _) => {
            return Err(ServeError::Invalid(
                "/v1/completions needs `prompt` (and no `messages`)".into(),
            ));
        }
        (true, _, _) => {
            return Err(ServeError::Invalid(
                "/v1/chat/completions needs `messages` (and no `prompt`)".into(),
            ));
        }
    };
    let spec = req
        .options()
        .and_then(|o| o.validate(prompt, false, limits))
        .map_err(ServeError::Invalid)?;
    Ok((spec, req.stream))
}

async fn completions(State(s): State<Shared>, body: Bytes) -> Response {
    openai(s, body, false).await
}

async fn chat_completions(State(s): State<Shared>, body: Bytes) -> Response {
    openai(s, body, true).await
}

async fn openai(s: Shared, body: Bytes, chat: bool) -> Response {
    let (spec, stream) = match parse_openai(&body, &s.limits, chat) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let id = format!("{}-{:x}", if chat { "chatcmpl" } else { "cmpl" }, rand_id());
    let (object, chunk_object) = if chat {
        ("chat.completion", "chat.completion.chunk")
    } else {
        ("text_completion", "text_completion")
    };
    let created = now();
    let model = s.model_name.clone();
    let mut rx = start(&s, spec, Arc::new(AtomicBool::new(false)));
    if !stream {
        let mut text = String::new();
        loop {
            match rx.recv().await {
                Some(Ok(GenEvent::Delta { text: t, .. })) => text.push_str(&t),
                Some(Ok(GenEvent::Done(f))) => {
                    let choice = if chat {
                        serde_json::json!({"index": 0, "finish_reason": f.finish_reason,
                            "message": {"role": "assistant", "content": text}})
                    } else {
                        serde_json::json!({"index": 0, "finish_reason": f.finish_reason,
                            "text": text, "logprobs": null})
                    };
                    return axum::Json(serde_json::json!({
                        "id": id, "object": object, "created": created, "model": model,
                        "choices": [choice], "usage": f.usage,
                    }))
                    .into_response();
                }
                Some(Err(e)) => return e.into_response(),
                None => {
                    return ServeError::Internal("the generation stopped".into()).into_response();
                }
            }
        }
    }
    // Streaming: the first event decides between an SSE stream and an error status.
    let first = rx.recv().await;
    if let Some(Err(e)) = first {
        return e.into_response();
    }
    let chunk = move |delta: Option<&str>, finish: Option<&str>, first: bool| {
        let choice = if chat {
            let mut d = serde_json::Map::new();
            if first {
                d.insert("role".into(), "assistant".into());
            }
            if let Some(t) = delta {
                d.insert("content".into(), t.into());
            }
            serde_json::json!({"index": 0, "delta": d, "finish_reason": finish})
        } else {
            serde_json::json!({"index": 0, "text": delta.unwrap_or(""), "finish_reason": finish,
                "logprobs": null})
        };
        serde_json::json!({"id": id, "object": chunk_object, "created": created,
            "model": model, "choices": [choice]})
    };
    // States: events still to come from the generator, then the final chunk, then `[DONE]`.
    let events = futures_util::stream::unfold(
        (Some(first), Some(rx), chunk, true),
        |(mut pending, rx, chunk, mut first)| async move {
            let mut rx = rx?;
            let next = match pending.take() {
                Some(e) => e,
                None => rx.recv().await,
            };
            let done = || Event::default().data("[DONE]");
            let (events, more) = match next {
                Some(Ok(GenEvent::Delta { text, .. })) => {
                    let c = chunk(Some(&text), None, first);
                    first = false;
                    (vec![Event::default().data(c.to_string())], true)
                }
                Some(Ok(GenEvent::Done(f))) => {
                    let c = chunk(None, Some(f.finish_reason), first);
                    (vec![Event::default().data(c.to_string()), done()], false)
                }
                Some(Err(e)) => {
                    let body = serde_json::json!({"error": {"message": e.to_string(),
                        "type": e.code(), "code": e.code()}});
                    (vec![Event::default().data(body.to_string()), done()], false)
                }
                None => (vec![done()], false),
            };
            let items = futures_util::stream::iter(
                events.into_iter().map(Ok::<_, std::convert::Infallible>),
            );
            Some((items, (None, more.then_some(rx), chunk, first)))
        },
    )
    .flatten();
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now());
    h.finish()
}

async fn ws(State(s): State<Shared>, up: WebSocketUpgrade) -> Response {
    let max = s.limits.max_message_bytes;
    up.max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| connection(socket, s))
}

/// One WebSocket connection: any number of requests, each streamed under its `id`.
async fn connection(socket: WebSocket, s: Shared) {
    let (mut sink, mut stream) = socket.split();
    let (out, mut out_rx) = mpsc::channel::<ServerMsg>(256);
    let writer = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            let text = serde_json::to_string(&m).expect("messages serialise");
            if sink.send(Message::Text(text.into())).await.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    });
    let running: Arc<Mutex<HashMap<String, Arc<AtomicBool>>>> = Arc::default();
    let error = |id: Option<String>, code: &str, message: String| ServerMsg::Error {
        id,
        code: code.into(),
        message,
    };
    while let Some(frame) = stream.next().await {
        let text = match frame {
            Ok(Message::Text(t)) => t,
            Ok(Message::Binary(_)) => {
                let e = error(
                    None,
                    "invalid_request",
                    "binary frames are not accepted; send JSON text".into(),
                );
                if out.send(e).await.is_err() {
                    break;
                }
                continue;
            }
            Ok(Message::Close(_)) | Err(_) => break,
            Ok(_) => continue, // ping/pong are answered by the library
        };
        let msg = match ClientMsg::parse(text.as_str(), &s.limits) {
            Ok(m) => m,
            Err((code, message)) => {
                if out.send(error(None, &code, message)).await.is_err() {
                    break;
                }
                continue;
            }
        };
        match msg {
            ClientMsg::Cancel { id } => {
                let flag = running.lock().ok().and_then(|r| r.get(&id).cloned());
                match flag {
                    Some(f) => f.store(true, Ordering::SeqCst),
                    None => {
                        let e = error(
                            Some(id.clone()),
                            "unknown_request",
                            format!("no request `{id}` is running on this connection"),
                        );
                        if out.send(e).await.is_err() {
                            break;
                        }
                    }
                }
            }
            ClientMsg::Generate {
                id,
                prompt,
                messages,
                max_tokens,
                temperature,
                top_k,
                top_p,
                repetition_penalty,
                seed,
                stop,
                token_ids,
                ignore_eos,
            } => {
                let prompt = match (prompt, messages) {
                    (Some(protocol::Prompt::Text(t)), None) => Ok(PromptSpec::Text(t)),
                    (Some(protocol::Prompt::Ids(i)), None) => Ok(PromptSpec::Ids(i)),
                    (None, Some(m)) => Ok(PromptSpec::Chat(m)),
                    _ => Err("give exactly one of `prompt` and `messages`".to_string()),
                };
                let options = Options {
                    max_tokens,
                    temperature,
                    top_k,
                    top_p,
                    repetition_penalty,
                    seed,
                    stop,
                    ignore_eos,
                };
                let spec = prompt.and_then(|p| options.validate(p, token_ids, &s.limits));
                let spec = match spec {
                    Ok(spec) => spec,
                    Err(m) => {
                        if out
                            .send(error(Some(id), "invalid_request", m))
                            .await
                            .is_err()
                        {
                            break;
                        }
                        continue;
                    }
                };
                let cancel = Arc::new(AtomicBool::new(false));
                let duplicate = match running.lock() {
                    Ok(r) if r.contains_key(&id) => true,
                    Ok(mut r) => {
                        r.insert(id.clone(), cancel.clone());
                        false
                    }
                    Err(_) => break,
                };
                if duplicate {
                    let e = error(
                        Some(id.clone()),
                        "invalid_request",
                        format!("request `{id}` is already running on this connection"),
                    );
                    if out.send(e).await.is_err() {
                        break;
                    }
                    continue;
                }
                let mut rx = start(&s, spec, cancel);
                let (out, running, with_ids) = (out.clone(), running.clone(), token_ids);
                tokio::spawn(async move {
                    while let Some(e) = rx.recv().await {
                        let m = match e {
                            Ok(GenEvent::Delta { text, token_ids }) => ServerMsg::Delta {
                                id: id.clone(),
                                text,
                                token_ids: with_ids.then_some(token_ids),
                            },
                            Ok(GenEvent::Done(f)) => ServerMsg::Done {
                                id: id.clone(),
                                finish_reason: f.finish_reason.into(),
                                usage: f.usage,
                                timing: f.timing,
                            },
                            Err(e) => ServerMsg::Error {
                                id: Some(id.clone()),
                                code: e.code().into(),
                                message: e.to_string(),
                            },
                        };
                        if out.send(m).await.is_err() {
                            break;
                        }
                    }
                    if let Ok(mut r) = running.lock() {
                        r.remove(&id);
                    }
                });
            }
        }
    }
    // The client is gone: stop its generations within one token.
    if let Ok(r) = running.lock() {
        for f in r.values() {
            f.store(true, Ordering::SeqCst);
        }
    }
    drop(out);
    let _ = writer.await;
}
