//! The HTTP endpoint a training run serves its registry on (`--metrics-addr`): `GET /metrics`
//! in the text exposition format, 404 for any other path, on hyper in a thread of its own so
//! the training loop never waits on a scrape. It stops when the [`Exporter`] is dropped.

use crate::registry::{CONTENT_TYPE, TelemetryError, render};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use prometheus::Registry;
use std::net::SocketAddr;

/// A running exporter; dropping it stops the listener.
pub struct Exporter {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Exporter {
    /// Listens on `addr` (port 0: any free port) and serves `registry` at `/metrics`. Fails at
    /// once when the address cannot be bound.
    pub fn start(addr: &str, registry: Registry) -> Result<Self, TelemetryError> {
        let listen_err = |source| TelemetryError::Listen {
            addr: addr.to_string(),
            source,
        };
        let std_listener = std::net::TcpListener::bind(addr).map_err(listen_err)?;
        std_listener.set_nonblocking(true).map_err(listen_err)?;
        let bound = std_listener.local_addr().map_err(listen_err)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(listen_err)?;
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("metrics-exporter".into())
            .spawn(move || {
                rt.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(std_listener) else {
                        return;
                    };
                    loop {
                        tokio::select! {
                            _ = &mut stopped => break,
                            accepted = listener.accept() => {
                                let Ok((stream, _)) = accepted else { continue };
                                let registry = registry.clone();
                                tokio::spawn(serve_one(stream, registry));
                            }
                        }
                    }
                })
            })
            .map_err(listen_err)?;
        tracing::info!("metrics on http://{bound}/metrics");
        Ok(Exporter {
            addr: bound,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves one connection's requests.
async fn serve_one(stream: tokio::net::TcpStream, registry: Registry) {
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let registry = registry.clone();
        async move {
            let response = match req.uri().path() {
                "/metrics" => Response::builder()
                    .header(hyper::header::CONTENT_TYPE, CONTENT_TYPE)
                    .body(Full::new(Bytes::from(render(&registry)))),
                _ => Response::builder()
                    .status(StatusCode::NOT_FOUND)
                    .body(Full::new(Bytes::from_static(
                        b"only /metrics is served here\n",
                    ))),
            };
            Ok::<_, std::convert::Infallible>(response.expect("a well-formed response"))
        }
    });
    let io = hyper_util::rt::TokioIo::new(stream);
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(io, service)
        .await;
}
