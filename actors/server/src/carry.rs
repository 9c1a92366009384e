//! A conversation's state out of the server and into another (or the same one after a
//! restart): `POST /v1/state/export` answers the state after a prompt's tokens as a state file
//! ([`crate::saved`]); `POST /v1/state/import` takes one and keeps it in the prefix cache, so
//! the next request that starts with its tokens prefills only what follows. The WebSocket's
//! `export` and `import` messages do the same for a connection's conversation.

use crate::error::ServeError;
use crate::openai::request::{OpenAiMessage, chat_messages, check_model, read_json};
use crate::protocol::PromptSpec;
use crate::saved::{self, Saved};
use crate::state::Shared;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExportRequest {
    model: Option<String>,
    /// Text or token ids.
    prompt: Option<crate::prompts::Prompt>,
    /// A conversation (its template without the assistant's turn opening).
    messages: Option<Vec<OpenAiMessage>>,
    /// The BOS before a text prompt (default true).
    add_special_tokens: Option<bool>,
}

/// The state file of the states after `tokens`. It may run a session, so it waits for a
/// place among the sessions as a generation does, and runs in a task of its own: a client
/// that goes away meanwhile leaves no session, pin or snapshot behind.
pub async fn export_tokens(s: &Shared, tokens: Vec<i64>) -> Result<Vec<u8>, ServeError> {
    let s = s.clone();
    let work = tokio::spawn(async move {
        let g = &s.generator;
        g.ready.check()?;
        let _running = g.drain.enter()?;
        let _permit = g.admission.enter().await?;
        let state = g.prefix.state_after(&g.decoder, &tokens).await?;
        Ok(saved::encode(
            &Saved {
                model: s.model_name.clone(),
                vocab: g.decoder.vocab(),
                tokenizer: g.tokenizer.hash().to_string(),
                tokens,
                state,
            },
            &s.state_key,
        ))
    });
    work.await
        .map_err(|e| ServeError::Internal(format!("exporting a state failed: {e}")))?
}

/// Reads, checks and keeps a state file; its tokens.
pub async fn import_bytes(s: &Shared, bytes: &[u8]) -> Result<Vec<i64>, ServeError> {
    let g = &s.generator;
    g.ready.check()?;
    let f = saved::decode(bytes, &s.state_key)?;
    f.check(&s.model_name, g.decoder.vocab(), g.tokenizer.hash())?;
    if let Some(why) = g.outside_vocab(&f.tokens) {
        return Err(ServeError::Invalid(format!("the state file's {why}")));
    }
    if f.tokens.len() > g.max_prompt_tokens {
        return Err(ServeError::Invalid(format!(
            "the state file holds {} tokens; the prompt limit is {}",
            f.tokens.len(),
            g.max_prompt_tokens
        )));
    }
    g.prefix.import(&g.decoder, &f.tokens, &f.state).await?;
    Ok(f.tokens)
}

pub async fn export(State(s): State<Shared>, bytes: Bytes) -> Response {
    let run = async {
        let r: ExportRequest = read_json(&bytes)?;
        check_model(r.model.as_deref(), &s.model_name)?;
        let prompt = match (r.prompt, r.messages) {
            (Some(crate::prompts::Prompt::Text(t)), None) => PromptSpec::Text(t),
            (Some(crate::prompts::Prompt::Ids(i)), None) => PromptSpec::Ids(i),
            (None, Some(m)) => PromptSpec::Chat(chat_messages(m)?),
            _ => {
                return Err(ServeError::field(
                    "prompt",
                    "give exactly one of `prompt` (text or token ids) and `messages`",
                ));
            }
        };
        let bos = r.add_special_tokens.unwrap_or(true);
        let tokens = s.generator.token_ids(&prompt, bos, false)?;
        if tokens.is_empty() {
            // A state is the states after some token: none to take before the first.
            return Err(ServeError::field(
                "prompt",
                "the prompt is empty (no tokens, so no state to export)",
            ));
        }
        let g = &s.generator;
        if tokens.len() > g.max_prompt_tokens {
            return Err(ServeError::field(
                "prompt",
                format!(
                    "{} tokens; the limit is {}",
                    tokens.len(),
                    g.max_prompt_tokens
                ),
            ));
        }
        let vocab = g.decoder.vocab() as i64;
        if let Some(bad) = tokens.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(ServeError::field(
                "prompt",
                format!("token id {bad} is outside the vocabulary (0..{vocab})"),
            ));
        }
        export_tokens(&s, tokens).await
    };
    match run.await {
        Ok(file) => ([(header::CONTENT_TYPE, "application/octet-stream")], file).into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn import(State(s): State<Shared>, bytes: Bytes) -> Response {
    match import_bytes(&s, &bytes).await {
        Ok(tokens) => axum::Json(serde_json::json!({
            "model": s.model_name, "tokens": tokens.len(),
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}
