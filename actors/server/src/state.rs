//! What every handler shares ([`ServerState`]), and starting a generation task for a validated
//! request ([`start`]).

use crate::auth::ApiKeys;
use crate::error::ServeError;
use crate::generate::{GenEvent, Generator};
use crate::protocol::{GenSpec, Limits};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use tokio::sync::mpsc;

/// Everything a request handler needs.
pub struct ServerState {
    pub generator: Generator,
    pub model_name: String,
    pub limits: Limits,
    /// API keys clients must present (none: open).
    pub keys: ApiKeys,
    /// Browser origins other than the server's own that may call it.
    pub cors: crate::cors::Cors,
    /// Signs the state files it exports and checks those it imports ([`crate::state_key`]).
    pub state_key: crate::state_key::StateKey,
}

pub type Shared = Arc<ServerState>;

/// Who may call a server: its API keys, the browser origins beside its own, and whose state
/// files it trusts (the key they are signed with).
pub type Callers = (ApiKeys, crate::cors::Cors, crate::state_key::StateKey);

impl ServerState {
    /// A server over `decoder` with `tokenizer` and its prefix cache's budgets: `(sessions
    /// decoding, queue places)`, its model's name, who may call it, its limits and its
    /// readiness.
    pub fn new(
        (decoder, tokenizer, prefix): (
            nsactor_decoding::AsyncDecoder,
            Arc<nsactor_data::Tokenizer>,
            nsactor_decoding::prefix::PrefixConfig,
        ),
        (max_sessions, max_queue): (usize, usize),
        model_name: String,
        (keys, cors, state_key): Callers,
        (limits, ready): (Limits, Arc<crate::ready::Readiness>),
    ) -> Shared {
        use crate::generate::Admission;
        Arc::new(ServerState {
            generator: Generator {
                decoder,
                prefix: Arc::new(nsactor_decoding::prefix::PrefixCache::new(
                    nsactor_decoding::prefix::PrefixConfig {
                        boundary: Some(i64::from(tokenizer.bos_id())),
                        ..prefix
                    },
                )),
                tokenizer,
                admission: Admission::new(max_sessions.max(1), max_queue),
                metrics: Arc::default(),
                max_prompt_tokens: limits.max_prompt_tokens,
                drain: Arc::default(),
                ready,
            },
            model_name,
            limits,
            keys,
            cors,
            state_key,
        })
    }
}

pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A random id (responses' `id`, request ids).
pub fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now());
    h.finish()
}

/// Starts a generation task; its events arrive on the returned receiver.
pub fn start(
    s: &Shared,
    spec: GenSpec,
    cancel: Arc<AtomicBool>,
) -> mpsc::Receiver<Result<GenEvent, ServeError>> {
    let (tx, mut rx_gen) = mpsc::channel::<GenEvent>(64);
    let (out, rx) = mpsc::channel(64);
    s.generator.metrics.requests.inc();
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
                m.requests_busy.inc();
            } else {
                m.requests_failed.inc();
            }
            let _ = out.send(Err(e)).await;
        }
    });
    rx
}
