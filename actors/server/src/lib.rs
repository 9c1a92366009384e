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

pub mod error;
pub mod generate;
pub mod metrics;
pub mod openai;
pub mod protocol;
pub mod state;
pub mod ws;

pub use error::ServeError;
pub use metrics::Metrics;
pub use state::ServerState;

use crate::state::Shared;
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header;
use axum::response::{Html, IntoResponse};
use axum::routing::{get, post};

/// The router of the server.
pub fn router(state: Shared) -> Router {
    let limit = state.limits.max_message_bytes;
    Router::new()
        .route("/", get(index))
        .route("/ws", get(ws::ws))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
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
