//! A WebSocket connection's conversations: each one's history, the tokens its session saw
//! (its prompts, then its answers), kept between turns. A `generate` that names a
//! conversation goes on from its history: a text prompt is appended as it is (no BOS), chat
//! messages after the end of the last answer. The prefix cache holds the state after the
//! history (kept at each generation's end), so only the new tokens are prefilled; if the cache
//! has let it go, the history is prefilled again, and the numbers are the same.

use crate::error::ServeError;
use crate::generate::Generator;
use crate::messages::ServerMsg;
use crate::protocol::PromptSpec;
use crate::state::Shared;
use base64::Engine;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::mpsc;

/// Conversations one connection may keep; starting one more forgets the least recently used.
pub const MAX_CONVERSATIONS: usize = 16;

/// A connection's conversations, most recently used last.
#[derive(Clone, Default)]
pub struct Conversations(Arc<Mutex<Conversation>>);

#[derive(Default)]
struct Conversation {
    kept: Vec<(String, Vec<i64>)>,
    /// Names with a turn running.
    running: Vec<String>,
}

impl Conversations {
    fn lock(&self) -> std::sync::MutexGuard<'_, Conversation> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a turn of `name`: the prompt it goes on from and whether this turn starts the
    /// conversation, or an error if a turn of it is running or the conversation is not as
    /// `want` says (`Some(true)`: kept, `Some(false)`: not kept). The turn ends with
    /// [`end`](Self::end).
    pub fn begin(
        &self,
        name: &str,
        want: Option<bool>,
        g: &Generator,
        prompt: &PromptSpec,
        bos: bool,
    ) -> Result<(PromptSpec, bool), ServeError> {
        let mut c = self.lock();
        if c.running.iter().any(|r| r == name) {
            return Err(ServeError::Invalid(format!(
                "conversation `{name}` has a turn running; wait for its `done`"
            )));
        }
        let history = c.kept.iter().find(|(n, _)| n == name).map(|(_, h)| h);
        match (want, history) {
            (Some(true), None) => {
                return Err(ServeError::UnknownRequest(format!(
                    "no conversation `{name}` is kept on this connection (`conversation_continue`: \
                     true); a connection keeps its {MAX_CONVERSATIONS} most recently used, and \
                     `import` brings one back from its state file"
                )));
            }
            (Some(false), Some(_)) => {
                return Err(ServeError::field(
                    "conversation_continue",
                    format!(
                        "conversation `{name}` is kept on this connection (`conversation_continue`: \
                         false); `forget` it first to start it afresh"
                    ),
                ));
            }
            _ => {}
        }
        let started = history.is_none();
        let ids = match history {
            None => g.token_ids(prompt, bos, true)?,
            Some(h) => {
                let mut ids = h.clone();
                ids.extend(continuation(g, prompt)?);
                ids
            }
        };
        c.running.push(name.to_string());
        Ok((PromptSpec::Ids(ids), started))
    }

    /// Ends the running turn of `name`; with `history`, it is the conversation's history now.
    pub fn end(&self, name: &str, history: Option<Vec<i64>>) {
        self.lock().running.retain(|r| r != name);
        if let Some(h) = history {
            self.keep(name, h);
        }
    }

    /// `history` is `name`'s history now.
    fn keep(&self, name: &str, history: Vec<i64>) {
        let mut c = self.lock();
        c.kept.retain(|(n, _)| n != name);
        if c.kept.len() >= MAX_CONVERSATIONS {
            c.kept.remove(0);
        }
        c.kept.push((name.to_string(), history));
    }

    /// An error if a turn of `name` is running.
    fn idle(&self, name: &str) -> Result<(), ServeError> {
        if self.lock().running.iter().any(|r| r == name) {
            return Err(ServeError::Invalid(format!(
                "conversation `{name}` has a turn running; wait for its `done`"
            )));
        }
        Ok(())
    }

    /// The history of `name`, if kept and no turn of it runs.
    fn history(&self, name: &str) -> Result<Vec<i64>, ServeError> {
        self.idle(name)?;
        self.lock()
            .kept
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, h)| h.clone())
            .ok_or_else(|| {
                ServeError::UnknownRequest(format!(
                    "no conversation `{name}` is kept on this connection"
                ))
            })
    }

    /// Answers `export` (`state` is `None`) or `import` of `name` from a task of its own: the
    /// event goes to `out`. An error found at once is the answer.
    pub fn carry(
        &self,
        (id, name, state): (String, String, Option<String>),
        s: &Shared,
        out: &mpsc::Sender<ServerMsg>,
    ) -> Option<ServerMsg> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let (me, s, out) = (self.clone(), s.clone(), out.clone());
        let answer = match state {
            None => {
                let history = match self.history(&name) {
                    Ok(h) => h,
                    Err(e) => return Some(ServerMsg::error(Some(id), &e)),
                };
                tokio::spawn(async move {
                    let tokens = history.len();
                    match crate::carry::export_tokens(&s, history).await {
                        Ok(file) => ServerMsg::State {
                            id,
                            conversation: name,
                            tokens,
                            state: b64.encode(file),
                        },
                        Err(e) => ServerMsg::error(Some(id), &e),
                    }
                })
            }
            Some(text) => {
                if let Err(e) = self.idle(&name) {
                    return Some(ServerMsg::error(Some(id), &e));
                }
                let bytes = match b64.decode(text.trim()) {
                    Ok(b) => b,
                    Err(e) => {
                        let e = ServeError::Invalid(format!("`state` is not base64: {e}"));
                        return Some(ServerMsg::error(Some(id), &e));
                    }
                };
                tokio::spawn(async move {
                    match crate::carry::import_bytes(&s, &bytes).await {
                        Ok(tokens) => {
                            let n = tokens.len();
                            me.keep(&name, tokens);
                            ServerMsg::Imported {
                                id,
                                conversation: name,
                                tokens: n,
                            }
                        }
                        Err(e) => ServerMsg::error(Some(id), &e),
                    }
                })
            }
        };
        tokio::spawn(async move {
            if let Ok(m) = answer.await {
                let _ = out.send(m).await;
            }
        });
        None
    }

    /// Forgets `name`; whether it was kept.
    pub fn forget(&self, name: &str) -> bool {
        let mut c = self.lock();
        let before = c.kept.len();
        c.kept.retain(|(n, _)| n != name);
        c.kept.len() < before
    }
}

/// The tokens a turn appends to a history: a text as it is, chat messages after the end token
/// that closes the last answer (the model stopped before feeding it), then the assistant's
/// turn opening; token ids as they are.
fn continuation(g: &Generator, prompt: &PromptSpec) -> Result<Vec<i64>, ServeError> {
    Ok(match prompt {
        PromptSpec::Text(_) | PromptSpec::Ids(_) => g.token_ids(prompt, false, false)?,
        PromptSpec::Chat(m) => {
            let msgs: Vec<nsactor_data::Message> = m
                .iter()
                .map(|m| nsactor_data::Message::new(&m.role, &m.content))
                .collect();
            let text = format!(
                "{}\n{}",
                nsactor_data::EOS_TOKEN,
                nsactor_data::chat_template(&msgs, true)
            );
            g.token_ids(&PromptSpec::Text(text), false, false)?
        }
    })
}
