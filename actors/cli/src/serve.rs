//! `nsactor serve`: the server over a checkpoint.

use crate::args::ModelArgs;
use nsactor_runtime::launch::{self, Loaded};
use std::sync::Arc;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// Sessions decoding at once; more wait in the queue.
    #[arg(long, default_value_t = 64)]
    max_sessions: usize,
    /// Requests that may wait for a session; past it the answer is "busy".
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Name reported by /v1/models (default: the checkpoint directory's name).
    #[arg(long)]
    model_name: Option<String>,
}

pub fn run(a: ServeArgs) -> crate::CliResult {
    let l = launch::load_checkpoint(&a.model.options())?;
    let state = crate::serve::server_state(
        &l,
        a.max_sessions,
        a.max_queue,
        a.model_name.clone().unwrap_or_else(|| l.name.clone()),
    );
    l.pipeline.block_on(async {
        let listener = tokio::net::TcpListener::bind(&a.addr)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", a.addr))?;
        tracing::info!(
            "serving on http://{} (WebSocket /ws, OpenAI /v1/completions and /v1/chat/completions, chat page /)",
            listener.local_addr()?
        );
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("shutting down");
        };
        nsactor_server::serve(listener, state, shutdown).await?;
        Ok::<_, crate::CliError>(())
    })
}

pub fn server_state(
    l: &Loaded,
    max_sessions: usize,
    max_queue: usize,
    name: String,
) -> Arc<nsactor_server::ServerState> {
    use nsactor_server::generate::{Admission, Generator};
    let limits = nsactor_server::protocol::Limits::default();
    Arc::new(nsactor_server::ServerState {
        generator: Generator {
            decoder: l.pipeline.decoder(l.vocab),
            tokenizer: l.tokenizer.clone(),
            admission: Admission::new(max_sessions.max(1), max_queue),
            metrics: Arc::default(),
            max_prompt_tokens: limits.max_prompt_tokens,
        },
        model_name: name,
        limits,
    })
}
