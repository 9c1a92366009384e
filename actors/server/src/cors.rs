//! Cross-origin access for browser clients on other origins (`--cors-origin`): none by
//! default; a list of origins, or `*` for any. Preflight requests are answered before the key
//! check; `Authorization`, `Content-Type` and the request-id header may be sent, and that header
//! read.

use crate::error::ServeError;
use axum::http::{HeaderName, HeaderValue, Method};
use std::time::Duration;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

/// Which origins may call the server from a browser.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Cors {
    /// Same origin only (no CORS headers).
    #[default]
    Off,
    Any,
    Origins(Vec<HeaderValue>),
}

impl Cors {
    /// From `--cors-origin` values: `*`, or origins like `https://app.example.com`.
    pub fn parse(origins: &[String]) -> Result<Cors, ServeError> {
        if origins.is_empty() {
            return Ok(Cors::Off);
        }
        if origins.iter().any(|o| o == "*") {
            return Ok(Cors::Any);
        }
        let list = origins
            .iter()
            .map(|o| {
                let ok = (o.starts_with("http://") || o.starts_with("https://"))
                    && !o.ends_with('/')
                    && o.len() > 8;
                ok.then(|| HeaderValue::from_str(o).ok())
                    .flatten()
                    .ok_or_else(|| {
                        ServeError::Invalid(format!(
                            "CORS origin {o:?} must be `*` or scheme://host[:port] with no path"
                        ))
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Cors::Origins(list))
    }

    /// The layer, or none when off; `request_id` is the header naming requests.
    pub fn layer(&self, request_id: &'static str) -> Option<CorsLayer> {
        let origin = match self {
            Cors::Off => return None,
            Cors::Any => AllowOrigin::any(),
            Cors::Origins(list) => AllowOrigin::list(list.clone()),
        };
        let id = HeaderName::from_static(request_id);
        Some(
            CorsLayer::new()
                .allow_origin(origin)
                .allow_methods([Method::GET, Method::POST])
                // Whatever headers the browser asks for: the origins are the gate, and the
                // OpenAI SDKs send their own (`x-stainless-*`), which a fixed list refused.
                .allow_headers(AllowHeaders::mirror_request())
                .expose_headers([id])
                .max_age(Duration::from_secs(600)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_parse_and_bad_ones_are_named() {
        assert_eq!(Cors::parse(&[]).unwrap(), Cors::Off);
        assert_eq!(Cors::parse(&["*".into()]).unwrap(), Cors::Any);
        let two = Cors::parse(&["https://a.example".into(), "http://localhost:3000".into()]);
        assert!(matches!(two.unwrap(), Cors::Origins(l) if l.len() == 2));
        for bad in ["a.example", "https://a.example/", "https://a.example\n"] {
            let e = Cors::parse(&[bad.into()]).unwrap_err().to_string();
            assert!(e.contains("CORS origin"), "{bad}: {e}");
        }
    }
}
