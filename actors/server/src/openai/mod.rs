//! The OpenAI-compatible front end: `POST /v1/completions`, `POST /v1/chat/completions` (plain
//! JSON or server-sent events ending in `data: [DONE]`), `GET /v1/models`, and vLLM's
//! `POST /tokenize` and `POST /detokenize` ([`tokenize`]).
//!
//! A request with `n` > 1 runs one session per choice (the batcher decodes them together),
//! seeded `seed + j` for a prompt's `j`-th; the usage counts each prompt once. A batch of
//! prompts (`/v1/completions`) gives each its `n` choices, `index` = prompt × `n` + `j`. A
//! client that goes away cancels every choice within one token.

pub mod request;
pub mod response;
pub mod tokenize;

use crate::error::ServeError;
use crate::generate::GenEvent;
use crate::protocol::{PromptSpec, StopReason, Usage};
use crate::state::{Shared, now, rand_id, start};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use request::OpenAiCall;
use response::{Piece, Shape};
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::mpsc;

pub async fn models(State(s): State<Shared>) -> impl IntoResponse {
    axum::Json(serde_json::json!({"object": "list", "data": [model_card(&s)]}))
}

/// `GET /v1/models/{model}`: the served model, or OpenAI's `model_not_found`.
pub async fn model(
    State(s): State<Shared>,
    axum::extract::Path(model): axum::extract::Path<String>,
) -> Response {
    if model != s.model_name {
        return ServeError::ModelNotFound(format!(
            "the model `{model}` does not exist; this server serves `{}`",
            s.model_name
        ))
        .into_response();
    }
    axum::Json(model_card(&s)).into_response()
}

/// The served model as `/v1/models` lists it.
fn model_card(s: &Shared) -> serde_json::Value {
    serde_json::json!({
        "id": s.model_name, "object": "model", "created": now(), "owned_by": "nsactor",
        "max_model_len": s.generator.max_prompt_tokens,
    })
}

pub async fn completions(State(s): State<Shared>, body: Bytes) -> Response {
    openai(s, body, false).await
}

pub async fn chat_completions(State(s): State<Shared>, body: Bytes) -> Response {
    openai(s, body, true).await
}

/// Cancels the request's generations when dropped: the answer was sent or the client left.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// An event of choice `index`.
type Tagged = (usize, Result<GenEvent, ServeError>);

/// Starts the call's generations, `n` per prompt; their events arrive tagged with the choice
/// index.
fn launch(s: &Shared, call: &OpenAiCall, cancel: &Arc<AtomicBool>) -> mpsc::Receiver<Tagged> {
    let (tx, rx) = mpsc::channel(64);
    for (p, prompt_spec) in call.specs.iter().enumerate() {
        for j in 0..call.n {
            let i = p * call.n + j;
            let mut spec = prompt_spec.clone();
            spec.sampling.seed = spec.sampling.seed.wrapping_add(j as u64);
            let mut events = start(s, spec, cancel.clone());
            let tx = tx.clone();
            tokio::spawn(async move {
                while let Some(e) = events.recv().await {
                    if tx.send((i, e)).await.is_err() {
                        break;
                    }
                }
            });
        }
    }
    rx
}

/// Where one choice stands.
#[derive(Default)]
struct Choice {
    /// Its text so far (whole answers only).
    whole: Piece,
    finish: Option<&'static str>,
    /// Nothing sent yet (the chat role goes with the first chunk; echo text first).
    fresh: bool,
    /// Its completions `text_offset` so far.
    offset: response::TextOffset,
    /// The prompt's tokens and log-probabilities, for vLLM's `prompt_logprobs`.
    prompt: Option<response::Scored>,
    /// The prompt's token ids, for vLLM's `return_token_ids` (a stream sends them once).
    prompt_ids: Option<Vec<i64>>,
    /// vLLM's `stop_reason` (whole answers).
    stop_reason: serde_json::Value,
}

/// A choice's echoed prompt (`echo`): its text, and how many tokens the server put in front
/// of it (the BOS before a text prompt), which are context and not echoed, so the echoed
/// tokens and their log-probabilities line up with what the client sent.
#[derive(Debug, Clone, Default)]
struct Echo {
    text: String,
    lead: usize,
}

/// The pieces an event adds to its choice: the echoed prompt first when asked for (with its
/// tokens when the prompt was scored, as its own text otherwise).
fn pieces(e: GenEvent, choice: &Choice, echo: Option<&Echo>) -> Vec<Piece> {
    let mut out = Vec::new();
    let echoing = echo.filter(|_| choice.fresh);
    let (echo, lead) = match echoing {
        Some(e) => (e.text.as_str(), e.lead),
        None => ("", 0),
    };
    match e {
        // Scored for vLLM's `prompt_logprobs` alone: nothing of it in the choice's text.
        GenEvent::Prompt { .. } if echoing.is_none() => return out,
        GenEvent::Prompt { ids, logprobs } => {
            return vec![Piece {
                text: echo.to_string(),
                tokens: ids.into_iter().zip(logprobs).skip(lead).collect(),
                ids: Vec::new(),
            }];
        }
        _ if !echo.is_empty() => out.push(Piece {
            text: echo.to_string(),
            ..Piece::default()
        }),
        _ => {}
    }
    if let GenEvent::Delta {
        text,
        token_ids,
        logprobs,
    } = e
    {
        let tokens = if logprobs.is_empty() {
            Vec::new()
        } else {
            token_ids
                .iter()
                .copied()
                .zip(logprobs.into_iter().map(Some))
                .collect()
        };
        out.push(Piece {
            text,
            tokens,
            ids: token_ids,
        });
    }
    out
}

pub async fn openai(s: Shared, body: Bytes, chat: bool) -> Response {
    let call = match request::parse(&body, &s.limits, &s.model_name, chat) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    // More choices than the server ever holds at once would be "busy" however long the
    // client waited: its mistake, not a passing state.
    let holds = s.generator.admission.capacity();
    let choices = call.n * call.specs.len();
    if choices > holds {
        let param = if call.n > 1 { "n" } else { "prompt" };
        return ServeError::field(
            param,
            format!(
                "{} prompt(s) × n = {} make {choices} choices; this server holds at most {holds} \
                 sessions at once, running and queued (`--max-sessions`, `--max-queue`)",
                call.specs.len(),
                call.n
            ),
        )
        .into_response();
    }
    // Each prompt's echoed text (`echo`), by choice: choice `i` echoes prompt `i / n`.
    let echo: Vec<Option<Echo>> = call
        .specs
        .iter()
        .flat_map(|spec| {
            let echo = call.echo.then(|| match &spec.prompt {
                PromptSpec::Text(t) => Echo {
                    text: t.clone(),
                    lead: s.generator.leading_tokens(t, spec.add_special_tokens),
                },
                PromptSpec::Ids(ids) => {
                    let ids: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
                    // Special tokens written out, as the echoed tokens and their offsets are.
                    let text = s
                        .generator
                        .tokenizer
                        .decode(&ids, false)
                        .unwrap_or_default();
                    Echo { text, lead: 0 }
                }
                PromptSpec::Chat(_) => Echo::default(),
            });
            std::iter::repeat_n(echo, call.n)
        })
        .collect();
    let shape = Shape {
        chat,
        id: format!("{}-{:x}", if chat { "chatcmpl" } else { "cmpl" }, rand_id()),
        created: now(),
        model: s.model_name.clone(),
        logprobs: call.specs[0].logprobs.is_some(),
        prompt_logprobs: call.prompt_logprobs,
        return_token_ids: call.return_token_ids,
        include_usage: call.include_usage,
        tokenizer: s.generator.tokenizer.clone(),
    };
    // A batch's prompts are all read and checked before any generation starts: a bad one
    // must not leave the others' sessions started (and counted) for nothing. Token ids to
    // return are known before the first chunk the same way.
    let mut call = call;
    if call.specs.len() > 1 || call.return_token_ids {
        for spec in &mut call.specs {
            match s.generator.prompt_ids(spec) {
                Ok(ids) => spec.prompt = PromptSpec::Ids(ids),
                Err(e) => return e.into_response(),
            }
        }
    }
    // Prompts of one request that share a context (a question's answers, a few-shot prefix)
    // keep it once in the prefix cache, and the others start from it.
    if call.specs.len() > 1 {
        let parts = {
            let ids: Vec<&[i64]> = call
                .specs
                .iter()
                .map(|s| match &s.prompt {
                    PromptSpec::Ids(ids) => ids.as_slice(),
                    _ => &[],
                })
                .collect();
            nsactor_decoding::prefix::parting_depths(&ids)
        };
        for (spec, parts) in call.specs.iter_mut().zip(parts) {
            spec.parts = parts;
        }
    }
    let cancel = Arc::new(AtomicBool::new(false));
    let mut rx = launch(&s, &call, &cancel);
    let guard = CancelOnDrop(cancel);
    let choices = (0..call.n * call.specs.len())
        .map(|i| Choice {
            fresh: true,
            prompt_ids: match &call.specs[i / call.n].prompt {
                PromptSpec::Ids(ids) if call.return_token_ids => Some(ids.clone()),
                _ => None,
            },
            ..Choice::default()
        })
        .collect();
    let prompts = PromptTokens::new(call.n, call.specs.len());
    if !call.stream {
        return whole(rx, shape, choices, echo, prompts).await;
    }
    // The first event decides between an SSE stream and an error status.
    let first = rx.recv().await;
    if let Some((_, Err(e))) = first {
        return e.into_response();
    }
    let st = Streamer {
        rx,
        pending: first,
        shape,
        choices,
        echo,
        prompts,
        usage: Usage {
            prompt_tokens: 0,
            completion_tokens: 0,
            total_tokens: 0,
        },
        finished: false,
        _guard: guard,
    };
    let events = futures_util::stream::unfold(st, |mut st| async move {
        let events = st.next_events().await?;
        let items = events.into_iter().map(Ok::<_, std::convert::Infallible>);
        Some((futures_util::stream::iter(items), st))
    })
    .flatten();
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Waits for every choice and answers with one JSON body, as soon as the last one is done: a
/// generation's states are freed after its final event (`Generator::run`), and the answer does
/// not wait for that (an echo-scored prompt's answer waited ~15 ms for it on an H200).
async fn whole(
    mut rx: mpsc::Receiver<Tagged>,
    shape: Shape,
    mut choices: Vec<Choice>,
    echo: Vec<Option<Echo>>,
    mut prompts: PromptTokens,
) -> Response {
    let mut completion = 0;
    while let Some((i, e)) = rx.recv().await {
        let c = &mut choices[i];
        let e = match e {
            Ok(e) => e,
            Err(e) => return e.into_response(),
        };
        if let GenEvent::Done(f) = &e {
            c.finish = Some(openai_finish(f.finish_reason));
            c.stop_reason = f.stop_reason.as_ref().map_or(Value::Null, StopReason::json);
            prompts.record(i, f.usage.prompt_tokens);
            completion += f.usage.completion_tokens;
            if shape.return_token_ids {
                // The generated tokens, and the end token that stopped them, as vLLM's.
                let generated = f.tokens.get(f.usage.prompt_tokens..).unwrap_or(&[]);
                c.whole.ids = generated.iter().copied().chain(f.end_token).collect();
            }
            // The end token's log-probability closes the list, as `usage` counts it.
            if let (Some(end), Some(lp)) = (f.end_token, &f.end_logprob) {
                c.whole.tokens.push((end, Some(lp.clone())));
            }
        }
        if let (true, GenEvent::Prompt { ids, logprobs }) = (shape.prompt_logprobs, &e) {
            c.prompt = Some(ids.iter().copied().zip(logprobs.iter().cloned()).collect());
        }
        for p in pieces(e, c, echo[i].as_ref()) {
            c.whole.text.push_str(&p.text);
            c.whole.tokens.extend(p.tokens);
        }
        c.fresh = false;
        if choices.iter().all(|c| c.finish.is_some()) {
            break;
        }
    }
    let mut done = Vec::with_capacity(choices.len());
    for mut c in choices {
        match c.finish {
            Some(f) => {
                let token_ids = std::mem::take(&mut c.whole.ids);
                done.push(response::Answered {
                    piece: c.whole,
                    finish: f,
                    scored: c.prompt,
                    prompt_ids: c.prompt_ids,
                    token_ids,
                    stop_reason: c.stop_reason,
                });
            }
            None => return ServeError::Internal("a generation stopped".into()).into_response(),
        }
    }
    let prompt = prompts.total();
    let usage = Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: prompt + completion,
    };
    axum::Json(shape.answer(done, usage)).into_response()
}

/// The usage's prompt tokens: each prompt of the request counted once, from any of its
/// choices' reports (choice `i` is of prompt `i / n`).
struct PromptTokens {
    n: usize,
    per_prompt: Vec<usize>,
}

impl PromptTokens {
    fn new(n: usize, prompts: usize) -> Self {
        PromptTokens {
            n,
            per_prompt: vec![0; prompts],
        }
    }

    fn record(&mut self, choice: usize, tokens: usize) {
        self.per_prompt[choice / self.n] = tokens;
    }

    fn total(&self) -> usize {
        self.per_prompt.iter().sum()
    }
}

/// A streamed answer: chunks as the choices' events come, then the usage chunk when asked
/// for, then `[DONE]`; an error ends it with an error event and `[DONE]`.
struct Streamer {
    rx: mpsc::Receiver<Tagged>,
    pending: Option<Tagged>,
    shape: Shape,
    choices: Vec<Choice>,
    /// Each choice's echoed prompt (`echo`).
    echo: Vec<Option<Echo>>,
    prompts: PromptTokens,
    usage: Usage,
    finished: bool,
    _guard: CancelOnDrop,
}

impl Streamer {
    async fn next_events(&mut self) -> Option<Vec<Event>> {
        if self.finished {
            return None;
        }
        let data = |v: serde_json::Value| Event::default().data(v.to_string());
        let done = || Event::default().data("[DONE]");
        let next = match self.pending.take() {
            Some(t) => Some(t),
            None => self.rx.recv().await,
        };
        let Some((i, e)) = next else {
            self.finished = true;
            return Some(vec![done()]);
        };
        let e = match e {
            Ok(e) => e,
            Err(e) => {
                self.finished = true;
                return Some(vec![data(e.openai_body()), done()]);
            }
        };
        let c = &mut self.choices[i];
        let finish = match &e {
            GenEvent::Done(f) => {
                self.prompts.record(i, f.usage.prompt_tokens);
                self.usage.prompt_tokens = self.prompts.total();
                self.usage.completion_tokens += f.usage.completion_tokens;
                let why = f.stop_reason.as_ref().map_or(Value::Null, StopReason::json);
                let end_lp = f.end_token.zip(f.end_logprob.clone());
                Some((openai_finish(f.finish_reason), f.end_token, why, end_lp))
            }
            _ => None,
        };
        let mut out = Vec::new();
        for p in pieces(e, c, self.echo[i].as_ref()) {
            // The prompt's ids go with the choice's first chunk.
            let prompt = c.prompt_ids.take();
            let ids = response::ChunkIds {
                prompt: prompt.as_deref(),
                tokens: &p.ids,
            };
            out.push(data(self.shape.chunk(
                i,
                Some(&p),
                None,
                c.fresh,
                &mut c.offset,
                ids,
            )));
            c.fresh = false;
        }
        if let Some((f, end, why, end_lp)) = finish {
            c.finish = Some(f);
            // The end token that stopped the choice is its last chunk's (vLLM's), with its
            // log-probability when they are asked for.
            let prompt = c.prompt_ids.take();
            let end: Vec<i64> = end.into_iter().collect();
            let ids = response::ChunkIds {
                prompt: prompt.as_deref(),
                tokens: &end,
            };
            let piece = end_lp.map(|(id, lp)| Piece {
                tokens: vec![(id, Some(lp))],
                ..Piece::default()
            });
            let mut chunk =
                self.shape
                    .chunk(i, piece.as_ref(), Some(f), c.fresh, &mut c.offset, ids);
            chunk["choices"][0]["stop_reason"] = why;
            out.push(data(chunk));
            c.fresh = false;
            if self.choices.iter().all(|c| c.finish.is_some()) {
                if self.shape.include_usage {
                    self.usage.total_tokens =
                        self.usage.prompt_tokens + self.usage.completion_tokens;
                    out.push(data(self.shape.usage_chunk(self.usage)));
                }
                out.push(done());
                self.finished = true;
            }
        }
        Some(out)
    }
}
/// A generation's finish reason as OpenAI's endpoints say it. Their reasons are a closed set
/// (`stop`, `length`, …; typed clients such as async-openai refuse others), so a generation
/// cut by the server's time limit or its shutdown ends as `length`: cut before its natural
/// end. The WebSocket and `/metrics` keep the server's own reason.
fn openai_finish(reason: &'static str) -> &'static str {
    match reason {
        crate::generate::FINISH_TIME_LIMIT | crate::drain::FINISH_SHUTDOWN => "length",
        other => other,
    }
}
