//! The WebSocket front end on `/ws`: `auth` (first, on a keyed server, when the upgrade had no
//! `Authorization` header), `generate` and `cancel` messages in, `delta`, `done` and `error`
//! events out, many requests per connection.

use crate::auth;
use crate::error::ServeError;
use crate::generate::GenEvent;
use crate::messages::{ClientMsg, ServerMsg};
use crate::protocol::{PromptSpec, SamplingOptions};
use crate::state::{Shared, start};
use axum::extract::State;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, StreamExt};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

pub async fn ws(State(s): State<Shared>, headers: HeaderMap, up: WebSocketUpgrade) -> Response {
    let authed = match s.keys.check(&headers) {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    let max = s.limits.max_message_bytes;
    up.max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| async move {
            if let Some(socket) = authenticate(socket, &s, authed).await {
                connection(socket, s).await;
            }
        })
}

/// Seconds a keyless connection has to send its `auth` message.
const AUTH_WAIT_S: u64 = 10;

/// A connection that came without `Authorization` on a keyed server must send
/// `{"type":"auth","key":…}` first; otherwise it gets an `error` event and is closed with 1008
/// (policy violation).
async fn authenticate(mut socket: WebSocket, s: &Shared, authed: bool) -> Option<WebSocket> {
    if authed {
        return Some(socket);
    }
    let first = tokio::time::timeout(Duration::from_secs(AUTH_WAIT_S), socket.recv()).await;
    let verdict = match first {
        Ok(Some(Ok(Message::Text(t)))) => match ClientMsg::parse(t.as_str(), &s.limits) {
            Ok(ClientMsg::Auth { key }) if s.keys.accepts(&key) => return Some(socket),
            Ok(ClientMsg::Auth { .. }) => auth::wrong_key(),
            _ => auth::missing_key(),
        },
        Ok(_) => return None,
        Err(_) => auth::missing_key(),
    };
    let text = serde_json::to_string(&ServerMsg::error(None, &verdict)).expect("serialises");
    let _ = socket.send(Message::Text(text.into())).await;
    let _ = socket
        .send(Message::Close(Some(CloseFrame {
            code: close_code::POLICY,
            reason: "API key required".into(),
        })))
        .await;
    None
}

/// One WebSocket connection: any number of requests, each streamed under its `id`.
pub async fn connection(socket: WebSocket, s: Shared) {
    let (mut sink, mut stream) = socket.split();
    let (out, mut out_rx) = mpsc::channel::<ServerMsg>(256);
    // Why the server ends the connection, when it does: the close frame's code and reason.
    let (close_tx, close_rx) = oneshot::channel::<CloseFrame>();
    let writer = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            let text = serde_json::to_string(&m).expect("messages serialise");
            if sink.send(Message::Text(text.into())).await.is_err() {
                break;
            }
        }
        match close_rx.await {
            Ok(frame) => {
                let _ = sink.send(Message::Close(Some(frame))).await;
            }
            Err(_) => {
                let _ = sink.close().await;
            }
        }
    });
    let mut close_tx = Some(close_tx);
    let mut close = |code, reason: String| {
        if let Some(tx) = close_tx.take() {
            let _ = tx.send(CloseFrame {
                code,
                reason: reason.into(),
            });
        }
    };
    let running: Arc<Running> = Arc::default();
    loop {
        // A connection with nothing running may stay silent only so long.
        let idle = running.lock().map_or(true, |r| r.is_empty());
        let frame = if idle {
            match tokio::time::timeout(s.limits.ws_idle_timeout, stream.next()).await {
                Ok(f) => f,
                Err(_) => {
                    let why = format!(
                        "closing a connection idle for {} s",
                        s.limits.ws_idle_timeout.as_secs_f64()
                    );
                    let e = ServerMsg::error(None, &ServeError::Invalid(why.clone()));
                    let _ = out.send(e).await;
                    close(close_code::AWAY, why);
                    break;
                }
            }
        } else {
            stream.next().await
        };
        let Some(frame) = frame else { break };
        let text = match frame {
            Ok(Message::Text(t)) => t,
            Ok(Message::Binary(_)) => {
                let e = ServerMsg::error(
                    None,
                    &ServeError::Invalid("binary frames are not accepted; send JSON text".into()),
                );
                if out.send(e).await.is_err() {
                    break;
                }
                continue;
            }
            Ok(Message::Close(_)) => break,
            // A protocol violation gets the close code that names it.
            Err(e) => {
                let e = e.into_inner();
                match e.downcast_ref::<tungstenite::Error>() {
                    Some(tungstenite::Error::Capacity(c)) => {
                        close(close_code::SIZE, format!("message too big: {c}"));
                    }
                    Some(tungstenite::Error::Utf8(_)) => {
                        close(close_code::INVALID, "text frame is not UTF-8".into());
                    }
                    Some(tungstenite::Error::Protocol(p)) => {
                        close(close_code::PROTOCOL, format!("protocol error: {p}"));
                    }
                    _ => {} // the connection is gone
                }
                break;
            }
            Ok(_) => continue, // ping/pong are answered by the library
        };
        let msg = match ClientMsg::parse(text.as_str(), &s.limits) {
            Ok(m) => m,
            Err(e) => {
                if out.send(ServerMsg::error(None, &e)).await.is_err() {
                    break;
                }
                continue;
            }
        };
        match msg {
            // Authenticated already (by header or first message), or no key is needed.
            ClientMsg::Auth { .. } => {}
            ClientMsg::Cancel { id } => {
                let flag = running.lock().ok().and_then(|r| r.get(&id).cloned());
                match flag {
                    Some(f) => f.store(true, Ordering::SeqCst),
                    None => {
                        let e = ServerMsg::error(
                            Some(id.clone()),
                            &ServeError::UnknownRequest(format!(
                                "no request `{id}` is running on this connection"
                            )),
                        );
                        if out.send(e).await.is_err() {
                            break;
                        }
                    }
                }
            }
            ClientMsg::Generate {
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
            } => {
                let prompt = match (prompt, messages) {
                    (Some(crate::protocol::Prompt::Text(t)), None) => Ok(PromptSpec::Text(t)),
                    (Some(crate::protocol::Prompt::Ids(i)), None) => Ok(PromptSpec::Ids(i)),
                    (None, Some(m)) => Ok(PromptSpec::Chat(m)),
                    _ => Err(ServeError::Invalid(
                        "give exactly one of `prompt` and `messages`".into(),
                    )),
                };
                let options = SamplingOptions {
                    max_tokens,
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
                let spec = prompt.and_then(|p| options.validate(p, token_ids, &s.limits));
                let spec = match spec {
                    Ok(spec) => spec,
                    Err(e) => {
                        if out.send(ServerMsg::error(Some(id), &e)).await.is_err() {
                            break;
                        }
                        continue;
                    }
                };
                let cancel = Arc::new(AtomicBool::new(false));
                let duplicate = match running.lock() {
                    Ok(r) if r.contains_key(&id) => true,
                    Ok(mut r) => {
                        r.insert(id.clone(), cancel.clone());
                        false
                    }
                    Err(_) => break,
                };
                if duplicate {
                    let e = ServerMsg::error(
                        Some(id.clone()),
                        &ServeError::Invalid(format!(
                            "request `{id}` is already running on this connection"
                        )),
                    );
                    if out.send(e).await.is_err() {
                        break;
                    }
                    continue;
                }
                let mut rx = start(&s, spec, cancel.clone());
                let (out, running, with_ids) = (out.clone(), running.clone(), token_ids);
                let with_logprobs = logprobs.is_some();
                tokio::spawn(async move {
                    while let Some(e) = rx.recv().await {
                        // The id is free again once its last event is on its way: a client
                        // that has read `done` (or the error) may reuse it at once.
                        if matches!(e, Ok(GenEvent::Done(_)) | Err(_)) {
                            release(&running, &id, &cancel);
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
                            Ok(GenEvent::Prompt { .. }) => continue,
                            Ok(GenEvent::Done(f)) => ServerMsg::Done {
                                id: id.clone(),
                                finish_reason: f.finish_reason.into(),
                                usage: f.usage,
                                timing: f.timing,
                            },
                            Err(e) => ServerMsg::error(Some(id.clone()), &e),
                        };
                        if out.send(m).await.is_err() {
                            break;
                        }
                    }
                    release(&running, &id, &cancel);
                });
            }
        }
    }
    // The client is gone: stop its generations within one token.
    if let Ok(r) = running.lock() {
        for f in r.values() {
            f.store(true, Ordering::SeqCst);
        }
    }
    drop(out);
    let _ = writer.await;
}

/// The requests running on one connection, by client id, with their cancel flags.
type Running = Mutex<HashMap<String, Arc<AtomicBool>>>;

/// Frees `id` if it still names the request whose flag is `mine`: once freed, the client may
/// already have started a new request under the same id, which is not this task's to remove.
fn release(running: &Running, id: &str, mine: &Arc<AtomicBool>) {
    if let Ok(mut r) = running.lock()
        && r.get(id).is_some_and(|f| Arc::ptr_eq(f, mine))
    {
        r.remove(id);
    }
}
