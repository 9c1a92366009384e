//! `nsactor serve`: streaming generation over WebSocket and OpenAI-compatible HTTP (axum on the
//! pipeline's tokio runtime). NeuronSpark needs no KV cache: each session's neuron membranes,
//! held by the layer actors, carry the context, so every new token costs the same whatever the
//! prompt length.
//!
//! * `GET /ws`: JSON messages — `generate` (prompt or ChatML messages, sampling options, stop
//!   strings; a named conversation goes on from its state), `cancel`, `forget`, `export`,
//!   `import`; events `delta`, `done` (finish reason, usage, timing), `state`, `imported`,
//!   `error`; several requests per connection, each with its own `id`.
//! * The prefix state cache (`nsactor_decoding::prefix`): every request starts from the
//!   deepest snapshot of its prompt's prefix; `POST /v1/state/export` and `/v1/state/import`
//!   carry a conversation's state between servers ([`carry`], [`saved`]).
//! * `POST /v1/completions`, `POST /v1/chat/completions` (with and without `stream: true`,
//!   server-sent events ending in `data: [DONE]`; `n`, log-probabilities, `echo`, usage
//!   chunks), `GET /v1/models`, `POST /tokenize`, `POST /detokenize`, `GET /health` (503
//!   `draining` once a shutdown began; 503
//!   `warming` until the warm-up is done: [`ready`]; 503 `recovering` while decoding rebuilds
//!   after a lost stage, `failed` when it cannot), `GET /metrics` (Prometheus text).
//! * API keys ([`auth`]): with any configured, `/v1/*`, `/ws` and optionally `/metrics` need
//!   `Authorization: Bearer KEY` (or, on `/ws`, an `auth` message first).
//! * `GET /`: a small chat page that talks to `/ws`.
//!
//! * Every response carries an `x-request-id` ([`edge`]); bodies have a size limit (413),
//!   connections a cap, a header timeout and an idle timeout ([`listen`]).
//!
//! Bad input never crashes the server and always gets an error naming what was wrong.

pub mod auth;
pub mod carry;
pub mod cors;
pub mod drain;
pub mod edge;
pub mod error;
pub mod front;
pub mod generate;
pub mod listen;
pub mod messages;
pub mod openai;
pub mod persist;
pub mod prompts;
pub mod protocol;
pub mod ready;
pub mod routes;
pub mod saved;
pub mod slot;
pub mod state;
pub mod state_key;
pub mod ws;

pub use error::ServeError;
pub use listen::serve;
/// Token log-probabilities (computed where prompts are scored, in the decoding crate).
pub use nsactor_decoding::logprobs;
pub use nsactor_telemetry::ServingMetrics;
pub use routes::router;
pub use state::ServerState;
