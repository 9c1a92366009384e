//! What every HTTP request passes first: its `x-request-id` (the client's, or a new one),
//! echoed on the response, and the body limit. A body over the limit gets a 413 with
//! OpenAI's error body; the rest of it is read and thrown away in the background (a lingering
//! close, as nginx does) so that a client still uploading reads the answer instead of a
//! broken pipe.

use crate::error::ServeError;
use crate::state::Shared;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use std::time::Duration;

/// The header that names a request.
pub const REQUEST_ID: &str = "x-request-id";

/// How long, and how much, an oversized body is read and dropped after its 413.
const LINGER: Duration = Duration::from_secs(10);
const LINGER_BYTES: u64 = 1 << 30;

/// The client's request id when it is short printable ASCII; otherwise a new one.
fn request_id(req: &Request) -> HeaderValue {
    req.headers()
        .get(REQUEST_ID)
        .filter(|v| {
            v.len() <= 128
                && v.as_bytes()
                    .iter()
                    .all(|b| b.is_ascii_graphic() || *b == b' ')
        })
        .cloned()
        .unwrap_or_else(|| {
            HeaderValue::from_str(&format!("req-{:016x}", crate::state::rand_id()))
                .expect("hex is a header value")
        })
}

/// The middleware: the request id and the body limit.
pub async fn edge(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let id = request_id(&req);
    let mut resp = match buffer(req, s.limits.max_message_bytes).await {
        Ok(req) => next.run(req).await,
        Err(e) => {
            if matches!(e, ServeError::TooLarge(_)) {
                s.generator.metrics.requests_too_large.inc();
            }
            let mut r = e.into_response();
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            r
        }
    };
    resp.headers_mut().insert(REQUEST_ID, id);
    resp
}

/// Reads the body (up to `limit` bytes) so handlers get it whole; bodiless requests (GET,
/// the WebSocket upgrade) pass as they are.
async fn buffer(req: Request, limit: usize) -> Result<Request, ServeError> {
    if matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return Ok(req);
    }
    let too_large = |n: &dyn std::fmt::Display| {
        ServeError::TooLarge(format!(
            "the request body of {n} bytes is over the limit of {limit} bytes"
        ))
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let (parts, mut body) = req.into_parts();
    if let Some(n) = declared.filter(|&n| n > limit as u64) {
        linger(body);
        return Err(too_large(&n));
    }
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame
            .map_err(|e| ServeError::Invalid(format!("the request body could not be read: {e}")))?;
        if let Ok(data) = frame.into_data() {
            bytes.extend_from_slice(&data);
            if bytes.len() > limit {
                linger(body);
                return Err(too_large(&format!("more than {limit}")));
            }
        }
    }
    Ok(Request::from_parts(parts, Body::from(bytes)))
}

/// Reads and drops the rest of a refused body in the background, within bounds.
fn linger(mut body: Body) {
    tokio::spawn(async move {
        let mut read = 0u64;
        let _ = tokio::time::timeout(LINGER, async {
            while let Some(Ok(frame)) = body.frame().await {
                if let Ok(d) = frame.into_data() {
                    read += d.len() as u64;
                    if read > LINGER_BYTES {
                        break;
                    }
                }
            }
        })
        .await;
    });
}
