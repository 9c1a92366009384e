//! vLLM's `POST /tokenize` (a prompt or chat messages to token ids, as the server would feed
//! them), `POST /detokenize` (token ids to text, special tokens written out) and `GET /tokenizer_info` (the tokenizer's
//! special tokens, chat template and the longest prompt: what lm-evaluation-harness's remote
//! tokenizer reads).

use super::request::{OpenAiMessage, chat_messages, check_model, read_json};
use crate::error::ServeError;
use crate::protocol::PromptSpec;
use crate::state::Shared;
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<OpenAiMessage>>,
    /// The beginning-of-text token before a prompt, as generation adds it (default true).
    add_special_tokens: Option<bool>,
    /// Chat: end with the assistant's turn opening, as generation does (default true).
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    return_token_strs: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<i64>,
}

pub async fn tokenize(State(s): State<Shared>, bytes: Bytes) -> Response {
    let run = || -> Result<serde_json::Value, ServeError> {
        let r: TokenizeRequest = read_json(&bytes)?;
        check_model(r.model.as_deref(), &s.model_name)?;
        let prompt = match (r.prompt, r.messages) {
            (Some(p), None) => PromptSpec::Text(p),
            (None, Some(m)) => PromptSpec::Chat(chat_messages(m)?),
            _ => {
                return Err(ServeError::field(
                    "prompt",
                    "give exactly one of `prompt` and `messages`",
                ));
            }
        };
        let g = &s.generator;
        let bos = r.add_special_tokens.unwrap_or(true);
        let ids = g.token_ids(&prompt, bos, r.add_generation_prompt.unwrap_or(true))?;
        let tok = &g.tokenizer;
        let mut out = serde_json::json!({
            "count": ids.len(), "max_model_len": s.generator.max_prompt_tokens, "tokens": ids,
        });
        if r.return_token_strs {
            let strs: Vec<String> = ids
                .iter()
                .map(|&t| tok.id_to_token(t as u32).unwrap_or_default())
                .collect();
            out["token_strs"] = strs.into();
        }
        Ok(out)
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn detokenize(State(s): State<Shared>, bytes: Bytes) -> Response {
    let run = || -> Result<serde_json::Value, ServeError> {
        let r: DetokenizeRequest = read_json(&bytes)?;
        check_model(r.model.as_deref(), &s.model_name)?;
        let vocab = s.generator.decoder.vocab() as i64;
        if let Some(bad) = r.tokens.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(ServeError::field(
                "tokens",
                format!("token id {bad} is outside the vocabulary (0..{vocab})"),
            ));
        }
        let ids: Vec<u32> = r.tokens.iter().map(|&t| t as u32).collect();
        // Lossless, as vLLM's: special tokens are written out, so the text tokenizes back to
        // the same ids (lm-evaluation-harness sends such text back as a prompt).
        let text = s
            .generator
            .tokenizer
            .decode(&ids, false)
            .map_err(|e| ServeError::Internal(e.to_string()))?;
        Ok(serde_json::json!({ "prompt": text }))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /tokenizer_info`: the served tokenizer as a Hugging Face `tokenizer_config.json` says
/// it ([`nsactor_data::Tokenizer::hf_tokenizer_config`]), with the prompt limit as
/// `model_max_length`.
pub async fn tokenizer_info(State(s): State<Shared>) -> Response {
    let g = &s.generator;
    Json(g.tokenizer.hf_tokenizer_config(g.max_prompt_tokens)).into_response()
}
