//! The accept loop: HTTP/1.1 connections (with upgrades, for `/ws`) under a cap on open
//! connections, a header timeout that also closes idle keep-alive connections, and a graceful
//! stop. A connection past the cap gets a 503 with `Retry-After` and is closed. Each
//! connection holds a [`ConnSlot`] until its socket is closed: an HTTP connection until hyper
//! lets go of it, one upgraded to a WebSocket until the WebSocket is over.

use crate::error::ServeError;
use crate::state::Shared;
use axum::extract::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tower::ServiceExt;

use crate::slot::ConnSlot;

/// How long connections get to finish their responses once the server stops.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Serves on `listener` until `shutdown` resolves; then closes idle connections, lets those
/// answering finish (at most [`CLOSE_WAIT`]) and returns.
pub async fn serve(
    listener: TcpListener,
    state: Shared,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = crate::routes::router(state.clone());
    let cap = state.limits.max_connections.max(1);
    let permits = Arc::new(Semaphore::new(cap));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(state.limits.header_timeout)
        .keep_alive(true);
    let metrics = state.generator.metrics.clone();
    tokio::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Tokens go out one small frame at a time: without TCP_NODELAY, Nagle's algorithm
        // holds a frame back until the client's delayed ACK (~40 ms on Linux).
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("TCP_NODELAY: {e}");
        }
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.connections_refused.inc();
            tokio::spawn(refuse(tcp, cap));
            continue;
        };
        let slot = ConnSlot::new(permit, metrics.clone());
        let for_requests = slot.clone();
        let service = router
            .clone()
            .map_request(move |mut req: Request<Incoming>| {
                req.extensions_mut().insert(for_requests.clone());
                req
            });
        let conn = http
            .serve_connection(TokioIo::new(tcp), TowerToHyperService::new(service))
            .with_upgrades();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = async { stop.wait_for(|s| *s).await.map(|_| ()) } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(slot);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection returns its permit when it ends.
    let all = u32::try_from(cap).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(CLOSE_WAIT, permits.acquire_many(all)).await;
    Ok(())
}

/// Answers a connection past the cap with a 503 and closes it, reading what the client sent
/// meanwhile so the close does not reset the answer away.
async fn refuse(mut tcp: TcpStream, cap: usize) {
    let e = ServeError::Busy(format!(
        "the server has {cap} connections open; try again shortly"
    ));
    let body = e.openai_body().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        tcp.write_all(head.as_bytes()).await?;
        tcp.write_all(body.as_bytes()).await?;
        tcp.shutdown().await?;
        let mut sink = [0u8; 4096];
        while tcp.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}
