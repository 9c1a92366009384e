//! API keys: with any configured, `/v1/*`, `/ws` (and `/metrics` or the tokenizer's routes
//! when asked) need `Authorization: Bearer KEY`. A browser cannot set that header on a WebSocket, so a `/ws`
//! connection without it must send `{"type":"auth","key":…}` first ([`crate::ws`]). A wrong or
//! missing key is a 401 with OpenAI's error body; keys are compared in constant time and never
//! logged or echoed.

use crate::error::ServeError;
use axum::http::{HeaderMap, header};

/// The keys a server accepts; none means every client is let in.
#[derive(Clone, Default)]
pub struct ApiKeys {
    keys: Vec<Vec<u8>>,
    /// `/metrics` needs a key too.
    pub metrics: bool,
    /// `/tokenize`, `/detokenize` and `/tokenizer_info` need a key too. Open by default, as
    /// vLLM leaves them: they tell only what the served tokenizer does, and
    /// lm-evaluation-harness's remote tokenizer calls them without the completions' key.
    pub tokenizer: bool,
}

impl std::fmt::Debug for ApiKeys {
    /// The count, never the keys.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ApiKeys({} keys, metrics keyed: {}, tokenizer keyed: {})",
            self.keys.len(),
            self.metrics,
            self.tokenizer
        )
    }
}

impl ApiKeys {
    /// `keys` (surrounding white space trimmed; duplicates kept once). An empty key or one with
    /// characters an HTTP header cannot carry is refused.
    pub fn new(keys: impl IntoIterator<Item = String>, metrics: bool) -> Result<Self, ServeError> {
        let mut out: Vec<Vec<u8>> = Vec::new();
        for (i, k) in keys.into_iter().enumerate() {
            let k = k.trim();
            if k.is_empty() {
                return Err(ServeError::Invalid(format!("API key {} is empty", i + 1)));
            }
            if !k.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ServeError::Invalid(format!(
                    "API key {} has characters other than visible ASCII",
                    i + 1
                )));
            }
            if !out.iter().any(|o| o == k.as_bytes()) {
                out.push(k.as_bytes().to_vec());
            }
        }
        Ok(ApiKeys {
            keys: out,
            metrics,
            tokenizer: false,
        })
    }

    /// Whether clients must present a key.
    pub fn required(&self) -> bool {
        !self.keys.is_empty()
    }

    /// How many keys are accepted.
    pub fn count(&self) -> usize {
        self.keys.len()
    }

    /// Whether `key` is one of the keys (or none are required). Every key is compared over
    /// its whole length, so the time taken does not say how much of a guess was right.
    pub fn accepts(&self, key: &str) -> bool {
        if !self.required() {
            return true;
        }
        let k = key.as_bytes();
        let mut any = 0u8;
        for want in &self.keys {
            let mut diff = u8::from(want.len() != k.len());
            for (i, w) in want.iter().enumerate() {
                diff |= w ^ k.get(i).copied().unwrap_or(0);
            }
            any |= u8::from(diff == 0);
        }
        any == 1
    }

    /// Checks the request's `Authorization: Bearer KEY`. `Ok(false)`: no header (a WebSocket
    /// may still authenticate in its first message); `Ok(true)`: a good key or none needed.
    pub fn check(&self, headers: &HeaderMap) -> Result<bool, ServeError> {
        if !self.required() {
            return Ok(true);
        }
        let Some(v) = headers.get(header::AUTHORIZATION) else {
            return Ok(false);
        };
        let key = v
            .to_str()
            .ok()
            .and_then(|v| {
                let (scheme, key) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then_some(key.trim())
            })
            .ok_or_else(|| {
                ServeError::Unauthorized(
                    "the Authorization header must be `Bearer <API key>`".into(),
                )
            })?;
        if self.accepts(key) {
            Ok(true)
        } else {
            Err(wrong_key())
        }
    }
}

/// The answer to a key that is not one of the server's.
pub fn wrong_key() -> ServeError {
    ServeError::Unauthorized("incorrect API key provided".into())
}

/// The answer to a request without a key.
pub fn missing_key() -> ServeError {
    ServeError::Unauthorized(
        "this server needs an API key: send `Authorization: Bearer <API key>` (on a WebSocket \
         without that header, `{\"type\":\"auth\",\"key\":\"<API key>\"}` as the first message)"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn keys_are_checked_whole_and_bad_keys_are_refused_at_configuration() {
        let k = ApiKeys::new(["sk-one".to_string(), " sk-two ".into()], false).unwrap();
        assert!(k.required());
        assert_eq!(k.count(), 2);
        for good in ["sk-one", "sk-two"] {
            assert!(k.accepts(good));
            assert_eq!(k.check(&headers(&format!("Bearer {good}"))), Ok(true));
        }
        assert_eq!(k.check(&headers("bearer sk-two")), Ok(true));
        for bad in ["sk-on", "sk-one2", "", "sk-two "] {
            assert!(!k.accepts(bad), "{bad:?}");
        }
        assert_eq!(k.check(&HeaderMap::new()), Ok(false));
        assert!(matches!(
            k.check(&headers("Bearer sk-three")),
            Err(ServeError::Unauthorized(_))
        ));
        assert!(matches!(
            k.check(&headers("Basic sk-one")),
            Err(ServeError::Unauthorized(_))
        ));
        assert!(!format!("{k:?}").contains("sk-"), "keys stay out of logs");
        assert!(ApiKeys::new(["".to_string()], false).is_err());
        assert!(ApiKeys::new(["a b".to_string()], false).is_err());
        let open = ApiKeys::default();
        assert!(!open.required() && open.accepts("anything"));
        assert_eq!(open.check(&HeaderMap::new()), Ok(true));
    }
}
