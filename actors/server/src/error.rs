//! `ServeError`: why a request failed, and the one place it becomes a wire answer: an HTTP
//! status with OpenAI's error body, the same body as a server-sent event, or the fields of a
//! WebSocket `error` event ([`ServeError::code`], [`ServeError::to_string`]).
//!
//! A client's mistake is a 4xx, a full server or one shutting down a 503 with `Retry-After`;
//! only a fault of the server itself is a 500.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use nsactor_engine::RuntimeError;
use nsactor_plugin_api::EngineError;

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServeError {
    /// The request body or message is not JSON.
    #[error("{0}")]
    InvalidJson(String),
    /// A field is missing, of the wrong type or out of range (the message names it).
    #[error("{0}")]
    Invalid(String),
    /// Request field `param` is wrong (OpenAI's `param`).
    #[error("{message}")]
    Field { param: String, message: String },
    /// The body or message is over the size limit.
    #[error("{0}")]
    TooLarge(String),
    /// The request names a model this server does not serve.
    #[error("{0}")]
    ModelNotFound(String),
    /// A missing or wrong API key.
    #[error("{0}")]
    Unauthorized(String),
    /// A `cancel` names no request running on its connection.
    #[error("{0}")]
    UnknownRequest(String),
    /// No route has this path.
    #[error("{0}")]
    NotFound(String),
    /// The path's route takes other methods.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// Every session and queue place is taken.
    #[error("{0}")]
    Busy(String),
    /// The server cannot take work now (shutting down, its pipeline is being rebuilt).
    #[error("{0}")]
    Unavailable(String),
    /// A fault of the server.
    #[error("{0}")]
    Internal(String),
}

impl ServeError {
    /// The machine-readable code: OpenAI's `type`/`code`, the WebSocket event's `code`.
    pub fn code(&self) -> &'static str {
        match self {
            ServeError::InvalidJson(_) => "invalid_json",
            ServeError::Invalid(_) | ServeError::Field { .. } => "invalid_request",
            ServeError::TooLarge(_) => "request_too_large",
            ServeError::ModelNotFound(_) => "model_not_found",
            ServeError::Unauthorized(_) => "invalid_api_key",
            ServeError::UnknownRequest(_) => "unknown_request",
            ServeError::NotFound(_) => "not_found",
            ServeError::MethodNotAllowed(_) => "method_not_allowed",
            ServeError::Busy(_) => "busy",
            ServeError::Unavailable(_) => "unavailable",
            ServeError::Internal(_) => "internal",
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ServeError::InvalidJson(_) | ServeError::Invalid(_) | ServeError::Field { .. } => {
                StatusCode::BAD_REQUEST
            }
            ServeError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ServeError::UnknownRequest(_)
            | ServeError::ModelNotFound(_)
            | ServeError::NotFound(_) => StatusCode::NOT_FOUND,
            ServeError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ServeError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ServeError::Busy(_) | ServeError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ServeError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The request field at fault, where one is.
    pub fn param(&self) -> Option<&str> {
        match self {
            ServeError::Field { param, .. } => Some(param),
            ServeError::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }

    /// A 400 naming request field `param`.
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        ServeError::Field {
            param: param.into(),
            message: message.into(),
        }
    }

    /// OpenAI's error `type`: the class of the status.
    pub fn kind(&self) -> &'static str {
        match self {
            ServeError::Unauthorized(_) => "authentication_error",
            ServeError::Busy(_) | ServeError::Unavailable(_) | ServeError::Internal(_) => {
                "server_error"
            }
            _ => "invalid_request_error",
        }
    }

    /// OpenAI's error body `{"error": {message, type, param, code}}`, for HTTP answers,
    /// server-sent events and the server's own refusals (connection cap, body limit).
    pub fn openai_body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.to_string(), "type": self.kind(), "param": self.param(),
            "code": self.code(),
        }})
    }
}

impl From<RuntimeError> for ServeError {
    /// A request the stages refused as invalid stays the client's error; a pipeline that
    /// cannot take work is unavailable; the rest is the server's fault.
    fn from(e: RuntimeError) -> Self {
        match &e {
            RuntimeError::Engine(EngineError::InvalidInput(m))
            | RuntimeError::Stage {
                error: EngineError::InvalidInput(m),
                ..
            } => ServeError::Invalid(m.clone()),
            RuntimeError::Invalid(m) => ServeError::Invalid(m.clone()),
            RuntimeError::Broken(_) | RuntimeError::Runtime(_) | RuntimeError::Recovered { .. } => {
                ServeError::Unavailable(e.to_string())
            }
            _ => ServeError::Internal(e.to_string()),
        }
    }
}

impl IntoResponse for ServeError {
    /// The status and OpenAI's error body; `Retry-After: 1` when the server is full.
    fn into_response(self) -> Response {
        let mut r = (self.status(), axum::Json(self.openai_body())).into_response();
        if matches!(self, ServeError::Unauthorized(_)) {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        if matches!(self, ServeError::Busy(_) | ServeError::Unavailable(_)) {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        r
    }
}

/// A JSON error in a client's words: no parser position (`at line 1 column 20`: a request is
/// not a file the client edits by line), Rust's integer and float type names as what they
/// accept (`usize` is "a non-negative integer"), and "got" for serde's "invalid type/value".
pub fn plain_json_error(e: &serde_json::Error) -> String {
    let mut s = e.to_string();
    if e.line() > 0
        && let Some(at) = s.rfind(" at line ")
    {
        s.truncate(at);
    }
    s = nsactor_model_config::words::plain(&s);
    if s.contains("hex escape") || s.contains("surrogate") {
        s.push_str(
            " (a string's `\\uXXXX` escapes must make whole characters; a lone surrogate such \
             as `\\ud800` is not one)",
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each runtime failure reaches an HTTP client with the status its cause deserves: a
    /// refused input is the client's 400, a pipeline that cannot take work a 503, and only a
    /// fault of the backend a 500.
    #[test]
    fn runtime_errors_map_to_the_status_their_cause_deserves() {
        let status = |e: RuntimeError| ServeError::from(e).status();
        assert_eq!(
            status(RuntimeError::Invalid("top_p must be in (0, 1]".into())),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            status(RuntimeError::Engine(EngineError::InvalidInput("id".into()))),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            status(RuntimeError::Stage {
                who: "layer 3".into(),
                error: EngineError::InvalidInput("shape".into()),
            }),
            StatusCode::BAD_REQUEST
        );
        // A cohort's failure copied to each of its sessions keeps its status.
        assert_eq!(
            status(RuntimeError::Invalid("x".into()).for_each_session()),
            StatusCode::BAD_REQUEST
        );
        for e in [
            RuntimeError::Broken("layer 2 died".into()),
            RuntimeError::Runtime("mailbox closed".into()),
            RuntimeError::Recovered {
                cause: "panic".into(),
                to_step: 4,
                seconds: 0.5,
            },
        ] {
            assert_eq!(status(e), StatusCode::SERVICE_UNAVAILABLE);
        }
        assert_eq!(
            status(RuntimeError::Engine(EngineError::Backend("cuda".into()))),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        let auth = ServeError::Unauthorized("key".into()).into_response();
        assert_eq!(auth.status(), StatusCode::UNAUTHORIZED);
        let big = ServeError::TooLarge("body".into());
        assert_eq!(big.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let f = ServeError::field("top_p", "top_p must be in (0, 1]").openai_body();
        assert_eq!(f["error"]["param"], "top_p");
        assert_eq!(f["error"]["type"], "invalid_request_error");
        assert_eq!(f["error"]["code"], "invalid_request");
        let busy = ServeError::Busy("full".into()).into_response();
        assert_eq!(busy.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(busy.headers()[header::RETRY_AFTER], "1");
    }

    #[test]
    fn json_errors_reach_the_client_in_its_words() {
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct R {
            max_tokens: Option<usize>,
            top_p: Option<f32>,
            seed: Option<i64>,
        }
        let plain = |t: &str| plain_json_error(&serde_json::from_str::<R>(t).unwrap_err());
        assert_eq!(
            plain(r#"{"max_tokens": -1}"#),
            "got integer `-1`, expected a non-negative integer"
        );
        assert_eq!(
            plain(r#"{"max_tokens": 2.5}"#),
            "got floating point `2.5`, expected a non-negative integer"
        );
        assert_eq!(
            plain(r#"{"top_p": "x"}"#),
            r#"got string "x", expected a number"#
        );
        assert_eq!(
            plain(r#"{"seed": true}"#),
            "got boolean `true`, expected an integer"
        );
        let unknown = plain(r#"{"frobnicate": 1}"#);
        assert!(
            unknown.starts_with("unknown field `frobnicate`, expected one of"),
            "{unknown}"
        );
        assert!(!unknown.contains("line"), "{unknown}");
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Format {
            kind: String,
        }
        let shape = serde_json::from_str::<Format>(r#""text""#).unwrap_err();
        assert_eq!(
            plain_json_error(&shape),
            r#"got string "text", expected an object"#
        );
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Text {
            text: String,
        }
        let list = serde_json::from_str::<Text>(r#"{"text": [1]}"#).unwrap_err();
        assert_eq!(plain_json_error(&list), "got a list, expected a string");
        let lone = serde_json::from_str::<Text>(r#"{"text": "\ud800"}"#).unwrap_err();
        assert!(
            plain_json_error(&lone).contains("a lone surrogate"),
            "{}",
            plain_json_error(&lone)
        );
        // Broken JSON keeps its words, without the position either.
        assert_eq!(plain("{"), "EOF while parsing an object");
    }
}
