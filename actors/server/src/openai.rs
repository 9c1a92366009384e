//! The OpenAI-compatible front end: `POST /v1/completions`, `POST /v1/chat/completions` (plain
//! JSON or server-sent events ending in `data: [DONE]`) and `GET /v1/models`.

use crate::error::ServeError;
use crate::generate::GenEvent;
use crate::protocol::{GenSpec, Limits, OpenAiRequest, PromptSpec};
use crate::state::{Shared, now, start};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

pub async fn models(State(s): State<Shared>) -> impl IntoResponse {
    axum::Json(serde_json::json!({"object": "list", "data": [{
        "id": s.model_name, "object": "model", "created": now(), "owned_by": "nsactor",
    }]}))
}

pub fn parse_openai(
    body: &Bytes,
    limits: &Limits,
    chat: bool,
) -> Result<(GenSpec, bool), ServeError> {
    let req: OpenAiRequest = serde_json::from_slice(body)
        .map_err(|e| ServeError::Invalid(format!("invalid request body: {e}")))?;
    let prompt = match (chat, req.prompt.clone(), req.messages.clone()) {
        (false, Some(crate::protocol::Prompt::Text(t)), None) => PromptSpec::Text(t),
        (false, Some(crate::protocol::Prompt::Ids(ids)), None) => PromptSpec::Ids(ids),
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
        .and_then(|o| o.validate(prompt, false, limits))?;
    Ok((spec, req.stream))
}

pub async fn completions(State(s): State<Shared>, body: Bytes) -> Response {
    openai(s, body, false).await
}

pub async fn chat_completions(State(s): State<Shared>, body: Bytes) -> Response {
    openai(s, body, true).await
}

pub async fn openai(s: Shared, body: Bytes, chat: bool) -> Response {
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
                    let body = e.openai_body();
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

pub fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now());
    h.finish()
}
