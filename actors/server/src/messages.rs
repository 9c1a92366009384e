//! The WebSocket protocol's messages: `generate`, `cancel` and `auth` in, `delta`, `done` and
//! `error` out, parsed at the edge. Unknown fields, wrong types and oversized messages are
//! errors whose message names the field.

use crate::error::ServeError;
use crate::logprobs::TokenLogprob;
use crate::protocol::{ChatMessage, GenTiming, Limits, Prompt, Stop, Usage};
use serde::{Deserialize, Serialize};

/// Client → server over the WebSocket.
///
/// On the wire a message is one JSON object whose `type` names the variant
/// (`{"type":"cancel","id":"a"}`); [`ClientMsg::parse`] reads the `type` and then the variant's
/// fields, so that an error names the field it is about.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
// A message is parsed and consumed at once, one at a time: `generate`'s size costs nothing,
// and a box would only add an allocation to every message.
#[allow(clippy::large_enum_variant)]
pub enum ClientMsg {
    /// Start a generation: `prompt` (text or ids) or `messages` (rendered with ChatML).
    Generate {
        id: String,
        prompt: Option<Prompt>,
        messages: Option<Vec<ChatMessage>>,
        max_tokens: Option<usize>,
        temperature: Option<f32>,
        #[serde(default, deserialize_with = "crate::protocol::top_k")]
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
        #[serde(default, deserialize_with = "crate::protocol::null_is_false")]
        token_ids: bool,
        /// Neither stop at the end tokens nor keep the other special tokens out: the model's
        /// raw choices (vLLM's `ignore_eos`).
        #[serde(default, deserialize_with = "crate::protocol::null_is_false")]
        ignore_eos: bool,
        /// Go on from this conversation of the connection: the prompt (text, without a BOS)
        /// or messages (after the last answer's end) are appended to its history, and only
        /// they are prefilled (`ws::conversation`). The first turn of a name starts it.
        conversation: Option<String>,
        /// With `conversation`: `true` refuses the turn when the connection keeps no such
        /// conversation (never kept, forgotten, or let go for a newer one) instead of starting
        /// it afresh; `false` refuses it when one is kept. Absent: either.
        conversation_continue: Option<bool>,
        /// Start from the prefix cache and keep snapshots of this request (default true).
        cache_prompt: Option<bool>,
        /// The BOS before a text prompt (default true), as on `/v1/completions`.
        add_special_tokens: Option<bool>,
        /// Added to the logits of token ids (keys) before sampling, −100..100.
        logit_bias: Option<std::collections::BTreeMap<String, f32>>,
        /// Send the prompt's log-probabilities first (a `prompt` event), with this many
        /// alternatives a token; `max_tokens` may then be 0 (score the prompt).
        prompt_logprobs: Option<usize>,
        /// vLLM's extra sampling parameters, as on the OpenAI endpoints.
        min_p: Option<f32>,
        stop_token_ids: Option<Vec<i64>>,
        min_tokens: Option<usize>,
        skip_special_tokens: Option<bool>,
        include_stop_str_in_output: Option<bool>,
        truncate_prompt_tokens: Option<i64>,
        allowed_token_ids: Option<Vec<i64>>,
    },
    /// Forgets a conversation of the connection; an error (for a name not kept) carries `id`.
    Forget {
        id: Option<String>,
        conversation: String,
    },
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
    /// The prompt's tokens as the model read them (the BOS put before a text prompt first)
    /// and their log-probabilities (the first has none), before any delta, when the
    /// request asked for `prompt_logprobs`.
    Prompt {
        id: String,
        token_ids: Vec<i64>,
        logprobs: Vec<Option<TokenLogprob>>,
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
        /// When the request named a conversation: whether this turn started it (no history
        /// was kept under its name), so a client that meant to go on can tell.
        #[serde(skip_serializing_if = "Option::is_none")]
        conversation_started: Option<bool>,
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

/// A JSON value in which no object names a key twice (`serde_json::Value` keeps the last
/// silently, where a message read straight into its type is refused).
struct Strict(serde_json::Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(items.into())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if fields.contains_key(&key) {
                return Err(serde::de::Error::custom(format!("duplicate field `{key}`")));
            }
            let Strict(v) = map.next_value()?;
            fields.insert(key, v);
        }
        Ok(fields.into())
    }
}

/// "a" or "an" before a message type's name.
fn article(kind: &str) -> &'static str {
    if kind.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

/// The message types, as `type` names them.
const TYPES: &str = "generate, cancel, export, import, forget or auth";

/// A message refused at the edge: why, and the request it was about when it named one (a
/// string `id`), so that a client waiting for that request's end gets it.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub id: Option<String>,
    pub error: ServeError,
}

impl Refused {
    fn new(id: Option<String>, error: ServeError) -> Self {
        Refused { id, error }
    }
}

impl ClientMsg {
    /// Parses one WebSocket text message. An error names the field it is about (a wrong
    /// type, an unknown or missing field) in the client's words, and keeps the message's
    /// `id` when it has one.
    pub fn parse(text: &str, limits: &Limits) -> Result<ClientMsg, Refused> {
        use serde_json::Value;
        if text.len() > limits.max_message_bytes {
            return Err(Refused::new(
                None,
                ServeError::Invalid(format!(
                    "message of {} bytes exceeds {} bytes",
                    text.len(),
                    limits.max_message_bytes
                )),
            ));
        }
        let v = serde_json::from_str::<Strict>(text).map_err(|e| {
            let words = crate::error::plain_json_error(&e);
            let error = if e.is_data() {
                ServeError::Invalid(words)
            } else {
                ServeError::InvalidJson(words)
            };
            // Valid JSON refused for a key given twice still names its request.
            let id = serde_json::from_str::<Value>(text)
                .ok()
                .and_then(|v| v.get("id")?.as_str().map(str::to_owned));
            Refused::new(id, error)
        })?;
        let Value::Object(mut fields) = v.0 else {
            let why = format!("a message is a JSON object with a `type` ({TYPES})");
            return Err(Refused::new(None, ServeError::Invalid(why)));
        };
        let id = fields.get("id").and_then(Value::as_str).map(str::to_owned);
        let refuse =
            |param: &str, why: String| Refused::new(id.clone(), ServeError::field(param, why));
        let kind = match fields.remove("type") {
            Some(Value::String(t)) => t,
            Some(other) => {
                return Err(refuse(
                    "type",
                    format!("`type` must be a string ({TYPES}), got {other}"),
                ));
            }
            None => return Err(refuse("type", format!("`type` is missing ({TYPES})"))),
        };
        // The variant's fields under its name: serde's externally tagged form, through which
        // `serde_path_to_error` follows the fields (an internally tagged enum hides them).
        let tagged = Value::Object(serde_json::Map::from_iter([(
            kind.clone(),
            Value::Object(fields),
        )]));
        serde_path_to_error::deserialize::<_, ClientMsg>(tagged).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "." && inner.to_string().starts_with("unknown variant") {
                return refuse(
                    "type",
                    format!("unknown message type `{kind}` (the types: {TYPES})"),
                );
            }
            let words = crate::error::plain_json_error(&inner);
            match path.split_once('.') {
                Some((_, field)) => {
                    let param = field.split(['.', '[']).next().unwrap_or(field);
                    refuse(param, format!("`{field}`: {words}"))
                }
                None => Refused::new(
                    id.clone(),
                    ServeError::Invalid(format!("{} `{kind}` message: {words}", article(&kind))),
                ),
            }
        })
    }
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
            let e = ClientMsg::parse(text, &limits()).unwrap_err().error;
            let (c, m) = (e.code(), e.to_string());
            assert_eq!(c, code, "{text}: {m}");
            assert!(m.contains(needle), "{text}: {m}");
        }
        // Past the default limit (4 MiB).
        let big = format!(r#"{{"type":"cancel","id":"{}"}}"#, "x".repeat(5 << 20));
        assert!(
            ClientMsg::parse(&big, &limits())
                .unwrap_err()
                .error
                .to_string()
                .contains("exceeds")
        );
    }

    /// Whatever is wrong with a message, the error names the field in the client's words (no
    /// serde type names, no parser position) and keeps the message's `id`, so a client
    /// waiting for that request's end gets one.
    #[test]
    fn a_refused_message_names_its_field_and_keeps_its_id() {
        let refused = |t: &str| ClientMsg::parse(t, &limits()).unwrap_err();
        for (text, id, param, needle) in [
            (
                r#"{"type":"generate","id":"a","prompt":"hi","temperature":"hot"}"#,
                Some("a"),
                Some("temperature"),
                r#"`temperature`: got string "hot", expected a number"#,
            ),
            (
                r#"{"type":"generate","id":"a","prompt":"hi","max_tokens":-1}"#,
                Some("a"),
                Some("max_tokens"),
                "expected a non-negative integer",
            ),
            (
                r#"{"type":"import","id":"x","conversation":"c","state":5}"#,
                Some("x"),
                Some("state"),
                "`state`: got integer `5`, expected a string",
            ),
            (
                r#"{"type":"generate","id":"b","messages":[{"role":"user","content":1}]}"#,
                Some("b"),
                Some("messages"),
                "`messages[0].content`",
            ),
            (
                r#"{"type":"generate","id":"b","prompt":"x","stop":5}"#,
                Some("b"),
                Some("stop"),
                "expected a string or a list of strings",
            ),
            (
                r#"{"type":"explode","id":"e"}"#,
                Some("e"),
                Some("type"),
                "unknown message type `explode` (the types: generate, cancel",
            ),
            (
                r#"{"type":5}"#,
                None,
                Some("type"),
                "`type` must be a string",
            ),
            (
                r#"{"id":"q"}"#,
                Some("q"),
                Some("type"),
                "`type` is missing",
            ),
            (
                r#"{"type":"cancel"}"#,
                None,
                None,
                "a `cancel` message: missing field `id`",
            ),
            (
                r#"null"#,
                None,
                None,
                "a message is a JSON object with a `type`",
            ),
            (
                r#"[1,2]"#,
                None,
                None,
                "a message is a JSON object with a `type`",
            ),
            (
                r#"{"type":"auth","key":5}"#,
                None,
                Some("key"),
                "`key`: got integer `5`",
            ),
            (
                r#"{"type":"generate","id":"a","prompt":"x","prompt":"y"}"#,
                Some("a"),
                None,
                "duplicate field `prompt`",
            ),
            (
                r#"{"type":"import","id":"i","conversation":"c"}"#,
                Some("i"),
                None,
                "an `import` message: missing field `state`",
            ),
        ] {
            let r = refused(text);
            assert_eq!(r.id.as_deref(), id, "{text}");
            assert_eq!(r.error.param(), param, "{text}");
            let m = r.error.to_string();
            assert!(m.contains(needle), "{text}: {m}");
            for serde_words in [
                "line 1",
                "usize",
                "f32",
                "variant identifier",
                "untagged",
                "invalid type",
            ] {
                assert!(!m.contains(serde_words), "{text}: {m}");
            }
        }
        // `null` is "not given" for every optional field, the flags too.
        let ok = ClientMsg::parse(
            r#"{"type":"generate","id":"n","prompt":"hi","token_ids":null,"ignore_eos":null,"temperature":null}"#,
            &limits(),
        );
        assert!(
            matches!(
                ok,
                Ok(ClientMsg::Generate {
                    token_ids: false,
                    ignore_eos: false,
                    temperature: None,
                    ..
                })
            ),
            "{ok:?}"
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
                let m = r.expect_err(&name).error.to_string();
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
