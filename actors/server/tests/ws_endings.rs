//! Every way a WebSocket connection ends, driven through channels instead of a socket
//! (`ws::connection` takes any sink and stream): the client's Close, the end of its stream
//! mid-generation, idleness (fresh, and after a request), a client that stopped reading (and
//! then sent its Close, or said nothing more), a protocol violation and the server's shutdown. In each, `connection` returns (its tasks have ended, so the
//! socket would be dropped), the server's own endings send a Close frame with their code after
//! their last event, and the connection's generations stop.

mod common;

use axum::extract::ws::{Message, close_code};
use common::serve_limited;
use futures_util::{Sink, Stream};
use nsactor_server::protocol::Limits;
use nsactor_server::ws::connection;
use std::pin::Pin;
use std::time::Duration;
use tokio::sync::mpsc;

type ClientTx = mpsc::Sender<Result<Message, axum::Error>>;
type SinkOf = Pin<Box<dyn Sink<Message, Error = &'static str> + Send>>;
type StreamOf = Pin<Box<dyn Stream<Item = Result<Message, axum::Error>> + Send>>;

/// A connection's two ends as channels: what the client sends, and what the server writes
/// (`capacity` frames before its writes block).
fn channels(capacity: usize) -> (ClientTx, StreamOf, SinkOf, mpsc::Receiver<Message>) {
    let (client, from_client) = mpsc::channel(16);
    let stream = futures_util::stream::unfold(from_client, |mut rx| async move {
        rx.recv().await.map(|m| (m, rx))
    });
    let (to_client, written) = mpsc::channel(capacity);
    let sink = futures_util::sink::unfold(to_client, |tx, m: Message| async move {
        tx.send(m).await.map_err(|_| "the client is gone")?;
        Ok(tx)
    });
    (client, Box::pin(stream), Box::pin(sink), written)
}

fn text(s: &str) -> Result<Message, axum::Error> {
    Ok(Message::Text(s.to_string().into()))
}

const LONG: &str =
    r#"{"type":"generate","id":"a","prompt":[1,2,3],"max_tokens":4000,"ignore_eos":true}"#;

/// The next text event of `kind` (others skipped); panics on a Close or the end.
async fn until(written: &mut mpsc::Receiver<Message>, kind: &str) -> serde_json::Value {
    loop {
        match tokio::time::timeout(Duration::from_secs(30), written.recv()).await {
            Ok(Some(Message::Text(t))) => {
                let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap();
                if v["type"] == kind {
                    return v;
                }
            }
            Ok(Some(_)) => {}
            other => panic!("waiting for `{kind}`: {other:?}"),
        }
    }
}

/// Everything written after now, up to the end: `(text events, the Close frame's code)`.
async fn rest(written: &mut mpsc::Receiver<Message>) -> (Vec<serde_json::Value>, Option<u16>) {
    let (mut events, mut close) = (Vec::new(), None);
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(30), written.recv()).await {
        match m {
            Message::Text(t) => events.push(serde_json::from_str(t.as_str()).unwrap()),
            Message::Close(f) => close = f.map(|f| f.code),
            _ => {}
        }
    }
    (events, close)
}

/// `connection` returns within a few seconds, and no generation is left running.
async fn ends(conn: tokio::task::JoinHandle<()>, s: &common::Served) {
    tokio::time::timeout(Duration::from_secs(10), conn)
        .await
        .expect("the connection never ended")
        .unwrap();
    let t = std::time::Instant::now();
    while s.state.generator.drain.running() > 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "a generation ran on");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn every_ending_of_a_websocket_ends_its_tasks() {
    let limits = Limits {
        ws_idle_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let s = serve_limited(4, true, limits);
    s.pipeline.block_on(async {
        // The client's Close mid-generation: answered by the library; nothing more is sent.
        let (client, stream, sink, mut written) = channels(64);
        let conn = tokio::spawn(connection(sink, stream, s.state.clone()));
        client.send(text(LONG)).await.unwrap();
        until(&mut written, "delta").await;
        client.send(Ok(Message::Close(None))).await.unwrap();
        ends(conn, &s).await;
        let (_, close) = rest(&mut written).await;
        assert_eq!(
            close, None,
            "a client's Close is answered by the library, not repeated"
        );

        // The stream ends (a reset) mid-generation.
        let (client, stream, sink, mut written) = channels(64);
        let conn = tokio::spawn(connection(sink, stream, s.state.clone()));
        client.send(text(LONG)).await.unwrap();
        until(&mut written, "delta").await;
        drop(client);
        ends(conn, &s).await;

        // Idle: an error event, then Close 1001; the client's answer ends it.
        let (client, stream, sink, mut written) = channels(64);
        let conn = tokio::spawn(connection(sink, stream, s.state.clone()));
        let e = until(&mut written, "error").await;
        assert!(e["message"].as_str().unwrap().contains("idle"), "{e}");
        match written.recv().await {
            Some(Message::Close(Some(f))) => assert_eq!(f.code, close_code::AWAY),
            other => panic!("expected Close 1001, got {other:?}"),
        }
        client.send(Ok(Message::Close(None))).await.unwrap();
        ends(conn, &s).await;

        // Idle after a request: the idle clock starts when the last request ends.
        let (client, stream, sink, mut written) = channels(64);
        let conn = tokio::spawn(connection(sink, stream, s.state.clone()));
        let short = r#"{"type":"generate","id":"b","prompt":[1,2,3],"max_tokens":2}"#;
        client.send(text(short)).await.unwrap();
        until(&mut written, "done").await;
        let e = until(&mut written, "error").await;
        assert!(e["message"].as_str().unwrap().contains("idle"), "{e}");
        match written.recv().await {
            Some(Message::Close(Some(f))) => assert_eq!(f.code, close_code::AWAY),
            other => panic!("expected Close 1001 after the request, got {other:?}"),
        }
        client.send(Ok(Message::Close(None))).await.unwrap();
        ends(conn, &s).await;

        // A client that stops reading and says nothing more: gone once a write stalls past
        // the idle limit; its generation stops and the connection ends by itself.
        let (client, stream, sink, written) = channels(1);
        let conn = tokio::spawn(connection(sink, stream, s.state.clone()));
        client.send(text(LONG)).await.unwrap();
        ends(conn, &s).await;
        drop((client, written));

        // A protocol violation mid-generation: Close 1002 after the generation's last event.
        let (client, stream, sink, mut written) = channels(64);
        let conn = tokio::spawn(connection(sink, stream, s.state.clone()));
        client.send(text(LONG)).await.unwrap();
        until(&mut written, "delta").await;
        let bad =
            tungstenite::Error::Protocol(tungstenite::error::ProtocolError::NonZeroReservedBits);
        client.send(Err(axum::Error::new(bad))).await.unwrap();
        let (events, close) = rest(&mut written).await;
        assert_eq!(close, Some(close_code::PROTOCOL), "{events:?}");
        drop(client);
        ends(conn, &s).await;

        // A client that stopped reading (its window full) and then sent its Close.
        let (client, stream, sink, written) = channels(1);
        let conn = tokio::spawn(connection(sink, stream, s.state.clone()));
        client.send(text(LONG)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        client.send(Ok(Message::Close(None))).await.unwrap();
        ends(conn, &s).await;
        drop(written);

        // The server shuts down: the running generation's `done` (shutdown), then Close 1001.
        let (client, stream, sink, mut written) = channels(64);
        let conn = tokio::spawn(connection(sink, stream, s.state.clone()));
        client.send(text(LONG)).await.unwrap();
        until(&mut written, "delta").await;
        let drain = s.state.generator.drain.clone();
        let stopping = tokio::spawn(async move {
            drain
                .shutdown(Duration::from_millis(200), Duration::from_secs(5))
                .await
        });
        let (events, close) = rest(&mut written).await;
        let last = events.last().expect("events");
        assert_eq!(
            (last["type"].as_str(), last["finish_reason"].as_str()),
            (Some("done"), Some("shutdown")),
            "{last}"
        );
        assert_eq!(close, Some(close_code::AWAY));
        drop(client);
        ends(conn, &s).await;
        assert_eq!(stopping.await.unwrap().left, 0);
    });
}
