//! A WebSocket connection's writer: sends the connection's events in order, then ends the
//! connection the way its reader decided ([`Ending`]) and closes the sink, so the socket goes
//! once the reader lets go of its half too. It never waits on anything the reader may no longer
//! hold: the end arrives on a one-shot channel that the reader always sends on or drops.

use crate::messages::ServerMsg;
use axum::extract::ws::{CloseFrame, Message};
use futures_util::{Sink, SinkExt};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// How long the events still queued may take to reach a client before the server's Close.
const FLUSH_WAIT: Duration = Duration::from_secs(5);

/// How long closing the sink may take (a client that reads nothing never lets it finish).
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// How a connection ends.
#[derive(Debug)]
pub enum Ending {
    /// The server ends it: the events still queued go out, then this Close frame.
    Flush(CloseFrame),
    /// The client sent a Close: it is answered (the library queued the answer) at once.
    Answer,
    /// The connection is gone (reset, end of stream, a failed write): nothing more to send.
    Gone,
}

impl Ending {
    /// The server ends the connection with `code` and `reason`.
    pub fn server(code: u16, reason: impl Into<String>) -> Self {
        Ending::Flush(CloseFrame {
            code,
            reason: reason.into().into(),
        })
    }
}

/// Writes `out`'s events to `sink` until the connection's end is known on `end`, then ends it.
/// A client that takes no event for `stall` (it stopped reading) is gone: the writer ends, and
/// with it every task that writes here.
pub async fn write<Tx>(
    mut sink: Tx,
    mut out: mpsc::Receiver<ServerMsg>,
    mut end: oneshot::Receiver<Ending>,
    stall: Duration,
) where
    Tx: Sink<Message> + Unpin,
{
    let ending = loop {
        tokio::select! {
            biased;
            e = &mut end => break e.unwrap_or(Ending::Gone),
            m = out.recv() => match m {
                // A client that stops reading blocks this send; its end must still get through.
                Some(m) => tokio::select! {
                    r = tokio::time::timeout(stall, send(&mut sink, &m)) => {
                        if !matches!(r, Ok(Ok(()))) {
                            break Ending::Gone;
                        }
                    }
                    e = &mut end => break e.unwrap_or(Ending::Gone),
                },
                // Every sender is gone, the reader's among them: its verdict is on its way.
                None => break (&mut end).await.unwrap_or(Ending::Gone),
            },
        }
    };
    if let Ending::Flush(frame) = ending {
        let flushed = tokio::time::timeout(FLUSH_WAIT, async {
            while let Some(m) = out.recv().await {
                if send(&mut sink, &m).await.is_err() {
                    return Err(());
                }
            }
            Ok(())
        })
        .await;
        // The Close goes out even when the last events could not all be sent in time.
        if !matches!(flushed, Ok(Err(_))) {
            let close = sink.send(Message::Close(Some(frame)));
            let _ = tokio::time::timeout(CLOSE_WAIT, close).await;
        }
    }
    // Flushes a queued answer to the client's Close; the socket closes when both halves drop.
    drop(out);
    let _ = tokio::time::timeout(CLOSE_WAIT, sink.close()).await;
}

async fn send<Tx: Sink<Message> + Unpin>(sink: &mut Tx, m: &ServerMsg) -> Result<(), Tx::Error> {
    let text = serde_json::to_string(m).expect("messages serialise");
    sink.send(Message::Text(text.into())).await
}
