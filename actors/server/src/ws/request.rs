//! The requests running on one WebSocket connection: `generate` starts one under the client's
//! id (refused while that id runs), `cancel` stops it within one token, and each streams its
//! events to the connection's writer from a task of its own that ends with its generation.

use crate::error::ServeError;
use crate::generate::GenEvent;
use crate::messages::{ClientMsg, ServerMsg};
use crate::protocol::{ExtraFields, Prompt, PromptSpec, SamplingOptions, logit_bias_pairs};
use crate::state::{Shared, start};
use crate::ws::conversation::Conversations;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::{Notify, mpsc};

/// The requests running on one connection, by client id, with their cancel flags.
#[derive(Clone, Default)]
pub struct Requests(Arc<Inner>);

#[derive(Default)]
struct Inner {
    running: Mutex<HashMap<String, Arc<AtomicBool>>>,
    conversations: Conversations,
    /// Told whenever the last running request ends.
    emptied: Notify,
}

impl Requests {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<AtomicBool>>> {
        self.0
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    /// Resolves once no request runs on the connection.
    pub async fn wait_empty(&self) {
        loop {
            // Created before the check: it receives every wake-up from then on.
            let emptied = self.0.emptied.notified();
            if self.is_empty() {
                return;
            }
            emptied.await;
        }
    }

    /// Stops every running request within one token (the connection is ending).
    pub fn cancel_all(&self) {
        for f in self.map().values() {
            f.store(true, Ordering::SeqCst);
        }
    }

    /// Frees `id` if it still names the request whose flag is `mine`: once freed, the client
    /// may already have started a new request under the same id, which is not this one's.
    fn release(&self, id: &str, mine: &Arc<AtomicBool>) {
        let mut r = self.map();
        if r.get(id).is_some_and(|f| Arc::ptr_eq(f, mine)) {
            r.remove(id);
            if r.is_empty() {
                self.0.emptied.notify_waiters();
            }
        }
    }

    /// Acts on one client message; the event to answer it with at once, if any.
    pub fn handle(
        &self,
        msg: ClientMsg,
        s: &Shared,
        out: &mpsc::Sender<ServerMsg>,
    ) -> Option<ServerMsg> {
        match msg {
            // Authenticated already (by header or first message), or no key is needed.
            ClientMsg::Auth { .. } => None,
            ClientMsg::Cancel { id } => {
                let flag = self.map().get(&id).cloned();
                match flag {
                    Some(f) => {
                        f.store(true, Ordering::SeqCst);
                        None
                    }
                    None => {
                        let why = format!("no request `{id}` is running on this connection");
                        Some(ServerMsg::error(Some(id), &ServeError::UnknownRequest(why)))
                    }
                }
            }
            generate @ ClientMsg::Generate { .. } => self.generate(generate, s, out),
            ClientMsg::Export { id, conversation } => {
                self.0.conversations.carry((id, conversation, None), s, out)
            }
            ClientMsg::Import {
                id,
                conversation,
                state,
            } => self
                .0
                .conversations
                .carry((id, conversation, Some(state)), s, out),
            ClientMsg::Forget { id, conversation } => {
                match self.0.conversations.forget(&conversation) {
                    Ok(true) => None,
                    Ok(false) => {
                        let why =
                            format!("no conversation `{conversation}` is kept on this connection");
                        Some(ServerMsg::error(id, &ServeError::UnknownRequest(why)))
                    }
                    Err(e) => Some(ServerMsg::error(id, &e)),
                }
            }
        }
    }

    /// Validates a `generate` message and starts its generation.
    fn generate(
        &self,
        msg: ClientMsg,
        s: &Shared,
        out: &mpsc::Sender<ServerMsg>,
    ) -> Option<ServerMsg> {
        let (id, mut spec, conversation, want) = match validate(msg, s) {
            Ok(v) => v,
            Err((id, e)) => return Some(ServerMsg::error(id, &e)),
        };
        let with_ids = spec.token_ids;
        let with_logprobs = spec.logprobs.is_some();
        let cancel = Arc::new(AtomicBool::new(false));
        let mut started = None;
        {
            let mut r = self.map();
            if r.contains_key(&id) {
                let why = format!("request `{id}` is already running on this connection");
                return Some(ServerMsg::error(Some(id), &ServeError::Invalid(why)));
            }
            if let Some(c) = &conversation {
                let conv = &self.0.conversations;
                let bos = spec.add_special_tokens;
                match conv.begin(c, want, &s.generator, &spec.prompt, bos) {
                    Ok((p, new)) => {
                        spec.prompt = p;
                        started = Some(new);
                    }
                    Err(e) => return Some(ServerMsg::error(Some(id), &e)),
                }
            }
            r.insert(id.clone(), cancel.clone());
        }
        let mut rx = start(s, spec, cancel.clone());
        let (out, requests) = (out.clone(), self.clone());
        tokio::spawn(async move {
            while let Some(e) = rx.recv().await {
                // The id is free again once its last event is on its way: a client that has
                // read `done` (or the error) may reuse it at once.
                if matches!(e, Ok(GenEvent::Done(_)) | Err(_)) {
                    if let Some(c) = &conversation {
                        let history = match &e {
                            Ok(GenEvent::Done(f)) => Some(f.tokens.clone()),
                            _ => None,
                        };
                        requests.0.conversations.end(c, history);
                    }
                    requests.release(&id, &cancel);
                }
                let m = match e {
                    Ok(GenEvent::Delta {
                        text,
                        token_ids,
                        logprobs,
                    }) => ServerMsg::Delta {
                        id: id.clone(),
                        text,
                        token_ids: with_ids.then_some(token_ids),
                        logprobs: with_logprobs.then_some(logprobs),
                    },
                    Ok(GenEvent::Prompt { ids, logprobs }) => ServerMsg::Prompt {
                        id: id.clone(),
                        token_ids: ids,
                        logprobs,
                    },
                    Ok(GenEvent::Done(f)) => ServerMsg::Done {
                        id: id.clone(),
                        finish_reason: f.finish_reason.into(),
                        usage: f.usage,
                        timing: f.timing,
                        conversation_tokens: conversation.as_ref().map(|_| f.tokens.len()),
                        conversation_started: started,
                    },
                    Err(e) => ServerMsg::error(Some(id.clone()), &e),
                };
                if out.send(m).await.is_err() {
                    // The connection is gone: stop the generation.
                    cancel.store(true, Ordering::SeqCst);
                    break;
                }
            }
            requests.release(&id, &cancel);
        });
        None
    }
}

/// A valid `generate`: its id, spec, conversation and `conversation_continue`.
type Valid = (
    String,
    crate::protocol::GenSpec,
    Option<String>,
    Option<bool>,
);

/// A `generate` message's id and validated spec, or the error to answer it with.
fn validate(msg: ClientMsg, s: &Shared) -> Result<Valid, (Option<String>, ServeError)> {
    let ClientMsg::Generate {
        id,
        prompt,
        messages,
        max_tokens,
        temperature,
        top_k,
        top_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed,
        stop,
        logprobs,
        token_ids,
        ignore_eos,
        conversation,
        conversation_continue,
        cache_prompt,
        add_special_tokens,
        logit_bias,
        prompt_logprobs,
        min_p,
        stop_token_ids,
        min_tokens,
        skip_special_tokens,
        include_stop_str_in_output,
        truncate_prompt_tokens,
        allowed_token_ids,
    } = msg
    else {
        unreachable!("only generate messages are validated")
    };
    if conversation.is_none() && conversation_continue.is_some() {
        let e = ServeError::field(
            "conversation_continue",
            "`conversation_continue` goes with `conversation` (the name of the conversation)",
        );
        return Err((Some(id), e));
    }
    let prompt = match (prompt, messages) {
        (Some(Prompt::Text(t)), None) => PromptSpec::Text(t),
        (Some(Prompt::Ids(i)), None) => PromptSpec::Ids(i),
        (None, Some(m)) => PromptSpec::Chat(m),
        _ => {
            let e = ServeError::Invalid("give exactly one of `prompt` and `messages`".into());
            return Err((Some(id), e));
        }
    };
    let extras = ExtraFields {
        stop_token_ids,
        min_tokens,
        skip_special_tokens,
        include_stop_str_in_output,
        truncate_prompt_tokens,
        allowed_token_ids,
    };
    let (extras, logit_bias) = match extras
        .read()
        .and_then(|x| Ok((x, logit_bias_pairs(logit_bias)?)))
    {
        Ok(v) => v,
        Err(e) => return Err((Some(id), e)),
    };
    let options = SamplingOptions {
        max_tokens,
        min_p,
        logit_bias,
        prompt_logprobs,
        extras,
        temperature,
        top_k,
        top_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed,
        stop,
        ignore_eos,
        logprobs,
        ..SamplingOptions::default()
    };
    match options.validate(prompt, token_ids, &s.limits) {
        Ok(mut spec) => {
            spec.cache_prompt = cache_prompt.unwrap_or(true);
            spec.add_special_tokens = add_special_tokens.unwrap_or(true);
            Ok((id, spec, conversation, conversation_continue))
        }
        Err(e) => Err((Some(id), e)),
    }
}
