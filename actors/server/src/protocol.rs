//! The server's wire formats, validated at the edge: the WebSocket protocol (JSON messages) and
//! the OpenAI-compatible HTTP request bodies. Unknown fields, wrong types and out-of-range
//! values are errors with a message that names the field.

use crate::error::ServeError;
use nsactor_runtime::decode::SamplingParams;
use serde::{Deserialize, Serialize};

/// Limits every request is checked against.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Prompt tokens a request may bring.
    pub max_prompt_tokens: usize,
    /// Tokens a request may ask for.
    pub max_new_tokens: usize,
    /// Size of one WebSocket message or HTTP body, bytes.
    pub max_message_bytes: usize,
    /// Stop strings per request, and their length in bytes.
    pub max_stop: usize,
    pub max_stop_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_prompt_tokens: 4096,
            max_new_tokens: 4096,
            max_message_bytes: 1 << 20,
            max_stop: 8,
            max_stop_bytes: 128,
        }
    }
}

/// A prompt: text, or token ids (as OpenAI's `prompt` accepts).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<i64>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// Sampling and length fields shared by every request kind.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingOptions {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub ignore_eos: bool,
}

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
        seed: Option<u64>,
        stop: Option<Stop>,
        /// Send each delta's token ids too.
        #[serde(default)]
        token_ids: bool,
        /// Neither stop at the end tokens nor keep the other special tokens out: the model's
        /// raw choices (vLLM's `ignore_eos`).
        #[serde(default)]
        ignore_eos: bool,
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
    },
    Done {
        id: String,
        /// `stop` (end token or stop string), `length` or `cancelled`.
        finish_reason: String,
        usage: Usage,
        timing: GenTiming,
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

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GenTiming {
    /// Request received → first token chosen.
    pub time_to_first_token_ms: f64,
    pub total_ms: f64,
    /// Completion tokens per second after the first.
    pub tokens_per_s: f64,
}

/// `POST /v1/completions` (`prompt`) and `POST /v1/chat/completions` (`messages`). OpenAI
/// fields this server does not implement are accepted only with their neutral values.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiRequest {
    pub model: Option<String>,
    pub prompt: Option<Prompt>,
    pub messages: Option<Vec<ChatMessage>>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub stream: bool,
    /// Must be 1.
    pub n: Option<u32>,
    /// Accepted and ignored.
    pub user: Option<String>,
    pub stream_options: Option<serde_json::Value>,
}

/// A validated request, ready for the generator.
#[derive(Debug, Clone, PartialEq)]
pub struct GenSpec {
    pub prompt: PromptSpec,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub token_ids: bool,
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum PromptSpec {
    Text(String),
    Ids(Vec<i64>),
    Chat(Vec<ChatMessage>),
}

/// Default tokens to generate when a request names none.
pub const DEFAULT_MAX_TOKENS: usize = 128;

impl SamplingOptions {
    /// Checks ranges and builds the generator's spec.
    pub fn validate(
        self,
        prompt: PromptSpec,
        token_ids: bool,
        limits: &Limits,
    ) -> Result<GenSpec, ServeError> {
        let max_tokens = self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
        if max_tokens == 0 || max_tokens > limits.max_new_tokens {
            return Err(ServeError::Invalid(format!(
                "max_tokens must be in 1..={}, got {max_tokens}",
                limits.max_new_tokens
            )));
        }
        let sampling = SamplingParams {
            // OpenAI's default temperature is 1.
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
            top_p: self.top_p.unwrap_or(1.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            seed: self.seed.unwrap_or_else(rand_seed),
        };
        if sampling.temperature > 100.0 {
            return Err(ServeError::Invalid(format!(
                "temperature must be in [0, 100], got {}",
                sampling.temperature
            )));
        }
        sampling
            .validate()
            .map_err(|e| ServeError::Invalid(e.to_string()))?;
        let stop = self.stop.map(Stop::into_vec).unwrap_or_default();
        if stop.len() > limits.max_stop {
            return Err(ServeError::Invalid(format!(
                "at most {} stop strings",
                limits.max_stop
            )));
        }
        if let Some(s) = stop
            .iter()
            .find(|s| s.is_empty() || s.len() > limits.max_stop_bytes)
        {
            return Err(ServeError::Invalid(format!(
                "stop strings must be 1..={} bytes, got {:?}",
                limits.max_stop_bytes, s
            )));
        }
        match &prompt {
            PromptSpec::Text(t) if t.is_empty() => {
                return Err(ServeError::Invalid("the prompt is empty".into()));
            }
            PromptSpec::Ids(ids) if ids.is_empty() => {
                return Err(ServeError::Invalid("the prompt is empty".into()));
            }
            PromptSpec::Chat(m) if m.is_empty() => {
                return Err(ServeError::Invalid("`messages` is empty".into()));
            }
            PromptSpec::Chat(m) => {
                if let Some(bad) = m
                    .iter()
                    .find(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant"))
                {
                    return Err(ServeError::Invalid(format!(
                        "message role must be system, user or assistant, got {:?}",
                        bad.role
                    )));
                }
            }
            _ => {}
        }
        Ok(GenSpec {
            prompt,
            max_tokens,
            sampling,
            stop,
            token_ids,
            ignore_eos: self.ignore_eos,
        })
    }
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// How a generation ended: why, what it cost, how long it took.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub finish_reason: &'static str,
    pub usage: Usage,
    pub timing: GenTiming,
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
                return ServeError::InvalidJson(e.to_string());
            }
            // serde cannot name the field of a type error inside a tagged enum: find it.
            let named = serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .and_then(|v| wrong_field(&v));
            ServeError::Invalid(named.unwrap_or_else(|| e.to_string()))
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
    let checks: [Check; 12] = [
        ("id", &string, "a string"),
        ("prompt", &prompt, "a string or a list of token ids"),
        ("messages", &messages, "a list of {role, content} objects"),
        ("max_tokens", &uint, "a non-negative integer"),
        ("temperature", &num, "a number"),
        ("top_k", &uint, "a non-negative integer"),
        ("top_p", &num, "a number"),
        ("repetition_penalty", &num, "a number"),
        ("seed", &uint, "a non-negative integer"),
        ("stop", &stop, "a string or a list of strings"),
        ("token_ids", &boolean, "true or false"),
        ("ignore_eos", &boolean, "true or false"),
    ];
    checks.iter().find_map(|(name, ok, want)| {
        let v = obj.get(*name)?;
        (!v.is_null() && !ok(v)).then(|| format!("`{name}` must be {want}, got {v}"))
    })
}

impl OpenAiRequest {
    pub fn options(&self) -> Result<SamplingOptions, ServeError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ServeError::Invalid("only n = 1 is supported".into()));
        }
        if self.max_tokens.is_some() && self.max_completion_tokens.is_some() {
            return Err(ServeError::Invalid(
                "give max_tokens or max_completion_tokens, not both".into(),
            ));
        }
        Ok(SamplingOptions {
            max_tokens: self.max_tokens.or(self.max_completion_tokens),
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let big = format!(r#"{{"type":"cancel","id":"{}"}}"#, "x".repeat(2 << 20));
        assert!(
            ClientMsg::parse(&big, &limits())
                .unwrap_err()
                .to_string()
                .contains("exceeds")
        );
    }

    #[test]
    fn out_of_range_values_are_refused() {
        let spec = |o: SamplingOptions| o.validate(PromptSpec::Text("hi".into()), false, &limits());
        let o = |f: &dyn Fn(&mut SamplingOptions)| {
            let mut o = SamplingOptions::default();
            f(&mut o);
            o
        };
        assert!(
            spec(o(&|o| o.max_tokens = Some(0)))
                .unwrap_err()
                .to_string()
                .contains("max_tokens")
        );
        assert!(
            spec(o(&|o| o.max_tokens = Some(1 << 20)))
                .unwrap_err()
                .to_string()
                .contains("max_tokens")
        );
        assert!(
            spec(o(&|o| o.temperature = Some(-1.0)))
                .unwrap_err()
                .to_string()
                .contains("temperature")
        );
        assert!(
            spec(o(&|o| o.top_p = Some(1.5)))
                .unwrap_err()
                .to_string()
                .contains("top_p")
        );
        assert!(
            spec(o(&|o| o.repetition_penalty = Some(0.0)))
                .unwrap_err()
                .to_string()
                .contains("repetition_penalty")
        );
        assert!(
            spec(o(&|o| o.stop = Some(Stop::One(String::new()))))
                .unwrap_err()
                .to_string()
                .contains("stop")
        );
        assert!(
            SamplingOptions::default()
                .validate(PromptSpec::Text(String::new()), false, &limits())
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        let bad_role = PromptSpec::Chat(vec![ChatMessage {
            role: "robot".into(),
            content: "x".into(),
        }]);
        assert!(
            SamplingOptions::default()
                .validate(bad_role, false, &limits())
                .unwrap_err()
                .to_string()
                .contains("robot")
        );
        assert_eq!(
            spec(SamplingOptions::default()).unwrap().max_tokens,
            DEFAULT_MAX_TOKENS
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
                let o = SamplingOptions { max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop, ignore_eos: false };
                let _ = o.validate(PromptSpec::Text("x".into()), false, &limits());
            }
        }
    }
}
