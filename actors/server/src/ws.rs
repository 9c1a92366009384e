//! The WebSocket front end on `/ws`: `auth` (first, on a keyed server, when the upgrade had no
//! `Authorization` header), `generate`, `cancel` and `forget` messages in, `delta`, `done` and
//! `error` events out, many requests and conversations ([`conversation`]) per connection.
//!
//! Every way a connection ends closes its socket and ends its tasks ([`connection`]): the
//! client's Close is answered with one, a reset or end of stream drops the socket, and the
//! server's own endings (idle, a protocol violation, shutdown) send their events first and then
//! a Close frame with the code that says why. The connection holds its [`ConnSlot`] (a place
//! under `--max-connections`, counted in `nsactor_connections`) until its socket is closed.

pub mod conversation;
mod request;
mod writer;

use crate::auth;
use crate::error::ServeError;
use crate::messages::{ClientMsg, ServerMsg};
use crate::slot::ConnSlot;
use crate::state::Shared;
use axum::Extension;
use axum::extract::State;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use futures_util::{Sink, SinkExt, Stream, StreamExt};
use request::Requests;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use writer::Ending;

pub async fn ws(
    State(s): State<Shared>,
    slot: Option<Extension<Arc<ConnSlot>>>,
    headers: HeaderMap,
    up: WebSocketUpgrade,
) -> Response {
    let authed = match s.keys.check(&headers) {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    let max = s.limits.max_message_bytes;
    up.max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| async move {
            // Held until the socket is closed: the connection counts until then.
            let _slot = slot;
            if let Some(socket) = authenticate(socket, &s, authed).await {
                let (sink, stream) = socket.split();
                connection(sink, stream, s).await;
            }
        })
}

/// Seconds a keyless connection has to send its `auth` message.
const AUTH_WAIT_S: u64 = 10;

/// How long the server waits for the client's answer to its own Close frame.
const CLOSE_ANSWER_WAIT: Duration = Duration::from_secs(2);

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
            // An `auth` message that is not right says what is wrong with it.
            Err(r) if r.error.param() == Some("key") => r.error,
            _ => auth::missing_key(),
        },
        // The client closed or broke the connection: answer its Close, if any, and go.
        Ok(_) => {
            let _ = socket.close().await;
            return None;
        }
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

/// One WebSocket connection over any message sink and stream (axum's socket halves, or
/// channels in tests): any number of requests, each streamed under its `id`. Returns once the
/// connection is over and every task it started has ended.
pub async fn connection<Tx, Rx>(sink: Tx, mut stream: Rx, s: Shared)
where
    Tx: Sink<Message> + Send + Unpin + 'static,
    Rx: Stream<Item = Result<Message, axum::Error>> + Send + Unpin,
{
    let (out, out_rx) = mpsc::channel::<ServerMsg>(256);
    let (end_tx, end_rx) = oneshot::channel::<Ending>();
    let writer = tokio::spawn(writer::write(
        sink,
        out_rx,
        end_rx,
        s.limits.ws_idle_timeout,
    ));
    let requests = Requests::default();
    let ending = read(&mut stream, &s, &out, &requests).await;
    // Whatever ended it, the connection's generations stop within one token.
    requests.cancel_all();
    drop(out);
    let server_closed = matches!(ending, Ending::Flush(_));
    let _ = end_tx.send(ending);
    let _ = writer.await;
    if server_closed {
        // The server sent its Close: read (and drop) until the client answers, briefly.
        let _ = tokio::time::timeout(CLOSE_ANSWER_WAIT, async {
            while let Some(Ok(m)) = stream.next().await {
                if matches!(m, Message::Close(_)) {
                    break;
                }
            }
        })
        .await;
    }
}

/// Reads the client's messages until the connection ends; how it ends.
async fn read<Rx>(
    stream: &mut Rx,
    s: &Shared,
    out: &mpsc::Sender<ServerMsg>,
    requests: &Requests,
) -> Ending
where
    Rx: Stream<Item = Result<Message, axum::Error>> + Unpin,
{
    let mut draining = s.generator.drain.draining_changes();
    loop {
        // A connection with nothing running may stay silent only so long (from the moment its
        // last request ended).
        let idle = requests.is_empty();
        let shutting_down = *draining.borrow();
        let limit = if idle {
            s.limits.ws_idle_timeout
        } else {
            Duration::MAX
        };
        let frame = tokio::select! {
            f = tokio::time::timeout(limit, stream.next()) => f,
            // The server is shutting down: once nothing runs here, say goodbye.
            () = requests.wait_empty(), if shutting_down => {
                return Ending::server(close_code::AWAY, "the server is shutting down");
            }
            // The last request ended: the idle clock starts now.
            () = requests.wait_empty(), if !idle && !shutting_down => continue,
            _ = draining.changed(), if !shutting_down => continue,
        };
        let frame = match frame {
            Ok(Some(f)) => f,
            Ok(None) => return Ending::Gone,
            Err(_) => {
                let why = format!(
                    "closing a connection idle for {} s",
                    s.limits.ws_idle_timeout.as_secs_f64()
                );
                let _ = out
                    .send(ServerMsg::error(None, &ServeError::Invalid(why.clone())))
                    .await;
                return Ending::server(close_code::AWAY, why);
            }
        };
        let text = match frame {
            Ok(Message::Text(t)) => t,
            Ok(Message::Binary(_)) => {
                let e =
                    ServeError::Invalid("binary frames are not accepted; send JSON text".into());
                if out.send(ServerMsg::error(None, &e)).await.is_err() {
                    return Ending::Gone;
                }
                continue;
            }
            // The client's Close is answered with one (the library queued it), at once.
            Ok(Message::Close(_)) => return Ending::Answer,
            Err(e) => return violation(e),
            Ok(_) => continue, // ping/pong are answered by the library
        };
        let reply = match ClientMsg::parse(text.as_str(), &s.limits) {
            Ok(msg) => requests.handle(msg, s, out),
            Err(r) => Some(ServerMsg::error(r.id, &r.error)),
        };
        if let Some(reply) = reply
            && out.send(reply).await.is_err()
        {
            return Ending::Gone;
        }
    }
}

/// How a read error ends the connection: a protocol violation gets the close code that names
/// it; anything else means the connection is gone.
fn violation(e: axum::Error) -> Ending {
    let e = e.into_inner();
    match e.downcast_ref::<tungstenite::Error>() {
        Some(tungstenite::Error::Capacity(c)) => {
            Ending::server(close_code::SIZE, format!("message too big: {c}"))
        }
        Some(tungstenite::Error::Utf8(_)) => {
            Ending::server(close_code::INVALID, "text frame is not UTF-8")
        }
        Some(tungstenite::Error::Protocol(p)) => {
            Ending::server(close_code::PROTOCOL, format!("protocol error: {p}"))
        }
        _ => Ending::Gone,
    }
}
