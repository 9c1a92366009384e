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
    /// Names with a turn or an import running, and which.
    busy: Vec<(String, Busy)>,
}

/// What holds a conversation until it ends: the messages after it on the connection see its
/// outcome, so they are refused meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Busy {
    Turn,
    Import,
}

/// Conversation names are the client's; an empty one is refused (it names nothing a later
/// message could find apart from a mistake).
const MAX_NAME: usize = 256;

fn check_name(name: &str) -> Result<(), ServeError> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(ServeError::field(
            "conversation",
            format!("a conversation's name has 1 to {MAX_NAME} bytes"),
        ));
    }
    Ok(())
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
        check_name(name)?;
        let mut c = self.lock();
        c.idle(name)?;
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
                ids.extend(continuation(g, prompt, h)?);
                ids
            }
        };
        c.busy.push((name.to_string(), Busy::Turn));
        Ok((PromptSpec::Ids(ids), started))
    }

    /// Ends the running turn (or import) of `name`; with `history`, it is the conversation's
    /// history now.
    pub fn end(&self, name: &str, history: Option<Vec<i64>>) {
        let mut c = self.lock();
        c.busy.retain(|(n, _)| n != name);
        if let Some(h) = history {
            c.keep(name, h);
        }
    }

    /// The history of `name`, if kept and nothing of it runs.
    fn history(&self, name: &str) -> Result<Vec<i64>, ServeError> {
        check_name(name)?;
        let c = self.lock();
        c.idle(name)?;
        c.kept
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
                let bytes = match b64.decode(text.trim()) {
                    Ok(b) => b,
                    Err(e) => {
                        let e = ServeError::Invalid(format!("`state` is not base64: {e}"));
                        return Some(ServerMsg::error(Some(id), &e));
                    }
                };
                // Held from now until the file is in: a `generate`, `export` or `forget` sent
                // right after this message must not act on the conversation as it was.
                if let Err(e) = self.hold(&name, Busy::Import) {
                    return Some(ServerMsg::error(Some(id), &e));
                }
                let release = Release(Some((me.clone(), name.clone())));
                tokio::spawn(async move {
                    let r = crate::carry::import_bytes(&s, &bytes).await;
                    release.done(r.as_ref().ok().cloned());
                    match r {
                        Ok(tokens) => ServerMsg::Imported {
                            id,
                            conversation: name,
                            tokens: tokens.len(),
                        },
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

    /// Marks `name` as held by `what` (an error if something of it runs already).
    fn hold(&self, name: &str, what: Busy) -> Result<(), ServeError> {
        check_name(name)?;
        let mut c = self.lock();
        c.idle(name)?;
        c.busy.push((name.to_string(), what));
        Ok(())
    }

    /// Forgets `name`: whether it was kept, or an error while a turn or an import of it runs
    /// (its end would keep a history again).
    pub fn forget(&self, name: &str) -> Result<bool, ServeError> {
        check_name(name)?;
        let mut c = self.lock();
        c.idle(name)?;
        let before = c.kept.len();
        c.kept.retain(|(n, _)| n != name);
        Ok(c.kept.len() < before)
    }
}

impl Conversation {
    /// An error if a turn or an import of `name` is running.
    fn idle(&self, name: &str) -> Result<(), ServeError> {
        match self.busy.iter().find(|(n, _)| n == name).map(|(_, b)| *b) {
            None => Ok(()),
            Some(Busy::Turn) => Err(ServeError::Invalid(format!(
                "conversation `{name}` has a turn running; wait for its `done`"
            ))),
            Some(Busy::Import) => Err(ServeError::Invalid(format!(
                "conversation `{name}` is being imported; wait for its `imported`"
            ))),
        }
    }

    /// `history` is `name`'s history now.
    fn keep(&mut self, name: &str, history: Vec<i64>) {
        self.kept.retain(|(n, _)| n != name);
        if self.kept.len() >= MAX_CONVERSATIONS {
            self.kept.remove(0);
        }
        self.kept.push((name.to_string(), history));
    }
}

/// Ends an import's hold on its conversation: with the tokens it brought when it succeeded,
/// with nothing when it failed or its task went away (a connection closed mid-import).
struct Release(Option<(Conversations, String)>);

impl Release {
    fn done(mut self, history: Option<Vec<i64>>) {
        if let Some((c, name)) = self.0.take() {
            c.end(&name, history);
        }
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        if let Some((c, name)) = self.0.take() {
            c.end(&name, None);
        }
    }
}

/// The tokens a turn appends to `history`: a text as it is; chat messages after whatever of
/// the end token and newline that close the last message `history` lacks (an answer the model
/// ended stops before its end token is fed; a state exported from `messages` holds both),
/// then the assistant's turn opening; token ids as they are.
fn continuation(
    g: &Generator,
    prompt: &PromptSpec,
    history: &[i64],
) -> Result<Vec<i64>, ServeError> {
    Ok(match prompt {
        PromptSpec::Text(_) | PromptSpec::Ids(_) => g.token_ids(prompt, false, false)?,
        PromptSpec::Chat(m) => {
            let msgs: Vec<nsactor_data::Message> = m
                .iter()
                .map(|m| nsactor_data::Message::new(&m.role, &m.content))
                .collect();
            let eos = nsactor_data::EOS_TOKEN;
            let close = g.token_ids(&PromptSpec::Text(format!("{eos}\n")), false, false)?;
            let open = if history.ends_with(&close) {
                String::new()
            } else if close.first().is_some_and(|e| history.last() == Some(e)) {
                "\n".to_string()
            } else {
                format!("{eos}\n")
            };
            let text = format!("{open}{}", nsactor_data::chat_template(&msgs, true));
            g.token_ids(&PromptSpec::Text(text), false, false)?
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(r: Result<impl std::fmt::Debug, ServeError>) -> String {
        r.expect_err("refused").to_string()
    }

    #[test]
    fn an_import_holds_its_conversation_until_it_ends() {
        let c = Conversations::default();
        c.hold("p", Busy::Import).unwrap();
        // Whatever comes behind the import on the connection waits for its outcome.
        assert!(message(c.forget("p")).contains("is being imported"));
        assert!(message(c.history("p")).contains("is being imported"));
        assert!(message(c.hold("p", Busy::Import)).contains("is being imported"));
        // Another conversation is free.
        assert!(!c.forget("q").unwrap());
        // A failed (or abandoned) import leaves nothing kept and frees the name.
        drop(Release(Some((c.clone(), "p".into()))));
        assert!(message(c.history("p")).contains("no conversation `p` is kept"));
        c.hold("p", Busy::Import).unwrap();
        Release(Some((c.clone(), "p".into()))).done(Some(vec![1, 2, 3]));
        assert_eq!(c.history("p").unwrap(), vec![1, 2, 3]);
    }

    #[test]
    fn a_running_turn_is_not_forgotten_and_names_are_checked() {
        let c = Conversations::default();
        c.end("c", Some(vec![7]));
        c.hold("c", Busy::Turn).unwrap();
        assert!(message(c.forget("c")).contains("has a turn running"));
        c.end("c", Some(vec![7, 8]));
        assert_eq!(c.history("c").unwrap(), vec![7, 8]);
        assert!(c.forget("c").unwrap());
        assert!(message(c.forget("")).contains("1 to 256 bytes"));
        assert!(message(c.hold(&"x".repeat(257), Busy::Turn)).contains("1 to 256 bytes"));
    }
}
