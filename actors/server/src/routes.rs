//! The server's routes: which handler answers each path, the API-key middleware of the keyed
//! ones, and the small handlers that need no room of their own (the chat page, `/health`,
//! `/metrics`).

use crate::state::Shared;
use crate::{auth, carry, edge, openai, ws};
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::middleware;
use axum::response::{Html, IntoResponse};
use axum::routing::{get, post};
use nsactor_decoding::heal::Health;
use nsactor_telemetry::serving::DecoderState;

/// The router of the server. With API keys, `/v1/*` (and `/metrics` and the tokenizer's routes
/// when keyed) answer 401 without one, `/ws` checks its own ([`crate::ws::ws`]); `/`, `/health`
/// stay open.
pub fn router(state: Shared) -> Router {
    let key = || middleware::from_fn_with_state(state.clone(), require_key);
    let keyed = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{model}", get(openai::model))
        .route("/v1/state/export", post(carry::export))
        .route("/v1/state/import", post(carry::import))
        .route_layer(key());
    let mut metrics_route = Router::new().route("/metrics", get(metrics));
    if state.keys.metrics {
        metrics_route = metrics_route.route_layer(key());
    }
    let mut tokenizer_routes = Router::new()
        .route("/tokenize", post(openai::tokenize::tokenize))
        .route("/detokenize", post(openai::tokenize::detokenize))
        .route("/tokenizer_info", get(openai::tokenize::tokenizer_info));
    if state.keys.tokenizer {
        tokenizer_routes = tokenizer_routes.route_layer(key());
    }
    let cors = state.cors.layer(edge::REQUEST_ID);
    let router = Router::new()
        .route("/", get(index))
        .route("/ws", get(ws::ws))
        .route("/health", get(health))
        .merge(keyed)
        .merge(metrics_route)
        .merge(tokenizer_routes)
        // Paths and methods no route takes get OpenAI's error body too, not an empty one.
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), edge::edge))
        // The edge reads bodies within the limit itself (413 with OpenAI's error body).
        .layer(DefaultBodyLimit::disable())
        .with_state(state);
    // Outermost: a browser's preflight is answered before the key check.
    match cors {
        Some(c) => router.layer(c),
        None => router,
    }
}

/// Middleware for the keyed routes: a request without a good key gets a 401.
async fn require_key(
    State(s): State<Shared>,
    req: axum::extract::Request,
    next: middleware::Next,
) -> axum::response::Response {
    match s.keys.check(req.headers()) {
        Ok(true) => next.run(req).await,
        Ok(false) => auth::missing_key().into_response(),
        Err(e) => e.into_response(),
    }
}

async fn not_found(uri: axum::http::Uri) -> axum::response::Response {
    let path = uri.path();
    crate::error::ServeError::NotFound(format!("no route `{path}` on this server (the routes: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /tokenizer_info, /v1/state/export, /v1/state/import, /ws, /health, /metrics, /)")).into_response()
}

async fn method_not_allowed(
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> axum::response::Response {
    let path = uri.path();
    crate::error::ServeError::MethodNotAllowed(format!("`{path}` does not take {method}"))
        .into_response()
}

async fn index() -> Html<&'static str> {
    Html(include_str!("chat.html"))
}

/// Readiness (503 `draining` from the first shutdown signal; 503 `warming` until the warm-up
/// is done, [`crate::ready`]; then the decoder's health:
/// 503 `recovering` while it rebuilds after a lost stage, `failed` when it cannot), and
/// whether clients need an API key (the chat page asks for one then).
async fn health(State(s): State<Shared>) -> impl IntoResponse {
    let (mut status, mut body) = s.generator.ready.health();
    let failed = matches!(s.generator.decoder.health(), Health::Failed { .. });
    if s.generator.drain.draining() && !failed {
        // From the first signal: a load balancer stops sending what would be refused.
        status = StatusCode::SERVICE_UNAVAILABLE;
        body = serde_json::json!({"status": "draining"});
    } else if status.is_success() {
        match s.generator.decoder.health() {
            Health::Serving => {}
            Health::Recovering { cause } => {
                status = StatusCode::SERVICE_UNAVAILABLE;
                body = serde_json::json!({"status": "recovering", "error": cause});
            }
            Health::Failed { cause } => {
                status = StatusCode::SERVICE_UNAVAILABLE;
                body = serde_json::json!({"status": "failed", "error": cause});
            }
        }
    }
    body["api_key_required"] = s.keys.required().into();
    (status, axum::Json(body))
}

async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, nsactor_telemetry::CONTENT_TYPE)],
        s.generator.metrics.render(DecoderState {
            queued: s.generator.admission.queued() as u64,
            open_sessions: s.generator.decoder.open_sessions(),
            batches: s.generator.decoder.batch_counts().0,
            batch_inputs: s.generator.decoder.batch_counts().1,
            window_launches: s.generator.decoder.window_launches(),
            recoveries: s.generator.decoder.recoveries(),
            healthy: s.generator.decoder.health() == Health::Serving,
            chunk_tokens: s.generator.decoder.chunk_tokens() as u64,
            step_seconds: s.generator.decoder.pacer().step_seconds().unwrap_or(0.0),
            prefix: prefix_state(s.generator.prefix.report()),
        }),
    )
}

/// The prefix cache's report as `/metrics` takes it.
fn prefix_state(r: nsactor_decoding::prefix::PrefixReport) -> nsactor_telemetry::PrefixCacheState {
    nsactor_telemetry::PrefixCacheState {
        hits: r.hits,
        misses: r.misses,
        tokens_saved: r.tokens_saved,
        evictions: r.evicted,
        to_host: r.to_host,
        device_bytes: r.usage.device_bytes,
        host_bytes: r.usage.host_bytes,
        entries: r.usage.entries,
        score_bytes: r.usage.score_bytes,
    }
}
