//! The WebSocket protocol's messages: `generate`, `cancel` and `auth` in, `delta`, `done` and
//! `error` out, parsed at the edge. Unknown fields, wrong types and oversized messages are
//! errors whose message names the field.

use crate::error::ServeError;
use crate::logprobs::TokenLogprob;
use crate::protocol::{ChatMessage, GenTiming, Limits, Prompt, Stop, Usage};
use serde::{Deserialize, Serialize};

/// Client → server over the WebSocket.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientMsg {
    /// Start a generation: `prompt` (text or ids) or `messages` (rendered with ChatML).
    Generate {
        id: String,
        prompt: Option<Prompt>,
        messages: Option<Vec<ChatMessage>>,
        max_tokens: Option<usize>,
        temperature: Option<f32>,
        top_k: Option<usize>,
        top_p: Option<f32>,
        repetition_penalty: Option<f32>,
        presence_penalty: Option<f32>,
        frequency_penalty: Option<f32>,
        seed: Option<u64>,
        stop: Option<Stop>,
        /// Send each token's log-probability and this many alternatives with the deltas.
        logprobs: Option<usize>,
        /// Send each delta's token ids too.
        #[serde(default)]
        token_ids: bool,
        /// Neither stop at the end tokens nor keep the other special tokens out: the model's
        /// raw choices (vLLM's `ignore_eos`).
        #[serde(default)]
        ignore_eos: bool,
        /// Go on from this conversation of the connection: the prompt (text, without a BOS)
        /// or messages (after the last answer's end) are appended to its history, and only
        /// they are prefilled (`ws::conversation`). The first turn of a name starts it.
        conversation: Option<String>,
        /// Start from the prefix cache and keep snapshots of this request (default true).
        cache_prompt: Option<bool>,
    },
    /// Forgets a conversation of the connection.
    Forget { conversation: String },
    /// The state after a conversation's history, as a state file (`crate::saved`, base64):
    /// answered with a `state` event.
    Export { id: String, conversation: String },
    /// Starts (or replaces) a conversation from a state file (base64), as `export` gave it,
    /// here or on another server of the same model: answered with an `imported` event.
    Import {
        id: String,
        conversation: String,
        state: String,
    },
    /// Stop generation `id` within one token.
    Cancel { id: String },
    /// The API key, as the first message of a connection whose upgrade carried no
    /// `Authorization` header (browsers cannot set one); ignored afterwards.
    Auth { key: String },
}

/// Server → client over the WebSocket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMsg {
    /// New text (never a split UTF-8 character), with its token ids when asked for.
    Delta {
        id: String,
        text: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        token_ids: Option<Vec<i64>>,
        /// The delta's tokens' log-probabilities, when the request asked for them.
        #[serde(skip_serializing_if = "Option::is_none")]
        logprobs: Option<Vec<TokenLogprob>>,
    },
    Done {
        id: String,
        /// `stop` (end token or stop string), `length`, `cancelled`, `time_limit` or
        /// `shutdown`.
        finish_reason: String,
        usage: Usage,
        timing: GenTiming,
        /// Tokens in the conversation's history now, when the request named one.
        #[serde(skip_serializing_if = "Option::is_none")]
        conversation_tokens: Option<usize>,
    },
    /// A conversation's state file (base64), answering `export`.
    State {
        id: String,
        conversation: String,
        tokens: usize,
        state: String,
    },
    /// A conversation started from a state file, answering `import`.
    Imported {
        id: String,
        conversation: String,
        tokens: usize,
    },
    Error {
        #[serde(skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// [`ServeError::code`]: `invalid_json`, `invalid_request`, `unknown_request`, `busy`,
        /// `unavailable`, `internal`.
        code: String,
        message: String,
    },
}

impl ServerMsg {
    /// The `error` event of `e`, for request `id` (none when the message had no usable id).
    pub fn error(id: Option<String>, e: &ServeError) -> Self {
        ServerMsg::Error {
            id,
            code: e.code().into(),
            message: e.to_string(),
        }
    }
}

impl ClientMsg {
    /// Parses one WebSocket text message.
    pub fn parse(text: &str, limits: &Limits) -> Result<ClientMsg, ServeError> {
        if text.len() > limits.max_message_bytes {
            return Err(ServeError::Invalid(format!(
                "message of {} bytes exceeds {} bytes",
                text.len(),
                limits.max_message_bytes
            )));
        }
        serde_json::from_str(text).map_err(|e| {
            if e.is_syntax() || e.is_eof() {
                return ServeError::InvalidJson(crate::error::plain_json_error(&e));
            }
            // serde cannot name the field of a type error inside a tagged enum: find it.
            let named = serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .and_then(|v| wrong_field(&v));
            ServeError::Invalid(named.unwrap_or_else(|| crate::error::plain_json_error(&e)))
        })
    }
}

/// The first field of a `generate` message whose JSON type is wrong, described.
fn wrong_field(v: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    let obj = v.as_object()?;
    let uint = |v: &Value| v.as_u64().is_some();
    let num = |v: &Value| v.is_number();
    let string = |v: &Value| v.is_string();
    let boolean = |v: &Value| v.is_boolean();
    let prompt = |v: &Value| {
        v.is_string()
            || v.as_array()
                .is_some_and(|a| a.iter().all(|x| x.as_i64().is_some()))
    };
    let stop =
        |v: &Value| v.is_string() || v.as_array().is_some_and(|a| a.iter().all(Value::is_string));
    let messages = |v: &Value| {
        v.as_array().is_some_and(|a| {
            a.iter().all(|m| {
                m.as_object().is_some_and(|o| {
                    o.len() == 2
                        && o.get("role").is_some_and(Value::is_string)
                        && o.get("content").is_some_and(Value::is_string)
                })
            })
        })
    };
    type Check<'a> = (&'a str, &'a dyn Fn(&Value) -> bool, &'a str);
    let checks: [Check; 17] = [
        ("id", &string, "a string"),
        ("prompt", &prompt, "a string or a list of token ids"),
        ("messages", &messages, "a list of {role, content} objects"),
        ("max_tokens", &uint, "a non-negative integer"),
        ("temperature", &num, "a number"),
        ("top_k", &uint, "a non-negative integer"),
        ("top_p", &num, "a number"),
        ("repetition_penalty", &num, "a number"),
        ("presence_penalty", &num, "a number"),
        ("frequency_penalty", &num, "a number"),
        ("seed", &uint, "a non-negative integer"),
        ("logprobs", &uint, "a non-negative integer"),
        ("stop", &stop, "a string or a list of strings"),
        ("token_ids", &boolean, "true or false"),
        ("ignore_eos", &boolean, "true or false"),
        ("conversation", &string, "a string"),
        ("cache_prompt", &boolean, "true or false"),
    ];
    checks.iter().find_map(|(name, ok, want)| {
        let v = obj.get(*name)?;
        (!v.is_null() && !ok(v)).then(|| format!("`{name}` must be {want}, got {v}"))
    })
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{PromptSpec, SamplingOptions};
    use proptest::prelude::*;

    fn limits() -> Limits {
        Limits::default()
    }

    #[test]
    fn requests_parse_and_bad_ones_name_the_problem() {
        let ok = ClientMsg::parse(
            r#"{"type":"generate","id":"a","prompt":"hi","max_tokens":3,"stop":"x"}"#,
            &limits(),
        )
        .unwrap();
        assert!(matches!(ok, ClientMsg::Generate { ref id, .. } if id == "a"));
        let ids = ClientMsg::parse(
            r#"{"type":"generate","id":"b","prompt":[1,2,3]}"#,
            &limits(),
        )
        .unwrap();
        assert!(matches!(
            ids,
            ClientMsg::Generate {
                prompt: Some(Prompt::Ids(_)),
                ..
            }
        ));
        let cases = [
            ("{", "invalid_json", "EOF"),
            (
                r#"{"type":"generate","id":"a","promt":"x"}"#,
                "invalid_request",
                "promt",
            ),
            (
                r#"{"type":"generate","id":"a","max_tokens":"5"}"#,
                "invalid_request",
                "max_tokens",
            ),
            (r#"{"type":"explode"}"#, "invalid_request", "explode"),
            (r#"[1,2]"#, "invalid_request", ""),
        ];
        for (text, code, needle) in cases {
            let e = ClientMsg::parse(text, &limits()).unwrap_err();
            let (c, m) = (e.code(), e.to_string());
            assert_eq!(c, code, "{text}: {m}");
            assert!(m.contains(needle), "{text}: {m}");
        }
        // Past the default limit (4 MiB).
        let big = format!(r#"{{"type":"cancel","id":"{}"}}"#, "x".repeat(5 << 20));
        assert!(
            ClientMsg::parse(&big, &limits())
                .unwrap_err()
                .to_string()
                .contains("exceeds")
        );
    }

    /// The kept corpus (`fuzz-corpus/`): every `ok-*` input parses, every `bad-*` one is
    /// refused with a message; none panics. proptest keeps failing cases it finds in
    /// `proptest-regressions/` beside this file.
    #[test]
    fn the_corpus_parses_as_labelled() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/fuzz-corpus");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            let text = String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let r = ClientMsg::parse(&text, &limits());
            if name.starts_with("ok-") {
                assert!(r.is_ok(), "{name}: {r:?}");
            } else {
                let m = r.expect_err(&name).to_string();
                assert!(!m.is_empty(), "{name}");
            }
            n += 1;
        }
        assert!(n >= 12, "corpus went missing: {n} files");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"))),
            ..ProptestConfig::default() })]

        /// Arbitrary text never panics the parser, and whatever parses validates or is refused
        /// with a message.
        #[test]
        fn the_parser_never_panics(text in ".{0,300}") {
            if let Ok(ClientMsg::Generate { max_tokens, temperature, top_p, .. }) = ClientMsg::parse(&text, &limits()) {
                let o = SamplingOptions { max_tokens, temperature, top_p, ..SamplingOptions::default() };
                let _ = o.validate(PromptSpec::Text("x".into()), false, &limits());
            }
        }

        /// JSON-shaped mutations of a valid request never panic either.
        #[test]
        fn mutated_requests_never_panic(
            key in "(type|id|prompt|max_tokens|temperature|top_p|top_k|seed|stop|messages|x)",
            value in prop_oneof![
                Just("null".to_string()), Just("-1".to_string()), Just("1e309".to_string()),
                Just("\"\"".to_string()), Just("[]".to_string()), Just("{}".to_string()),
                Just("[1,-5]".to_string()), "\"[^\"\\\\]{0,20}\"", "-?[0-9]{1,20}(\\.[0-9]{1,5})?",
            ],
        ) {
            let text = format!(r#"{{"type":"generate","id":"q","prompt":"hi","{key}":{value}}}"#);
            if let Ok(ClientMsg::Generate { max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, .. }) = ClientMsg::parse(&text, &limits()) {
                let o = SamplingOptions { max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, ..SamplingOptions::default() };
                let _ = o.validate(PromptSpec::Text("x".into()), false, &limits());
            }
        }
    }
}
