//! What every front end shares: the request limits, prompts and sampling options, and their
//! validation into the generator's [`GenSpec`] (an out-of-range value is an error naming the
//! field). The WebSocket messages are in [`messages`](crate::messages), the OpenAI bodies in
//! [`openai::request`](crate::openai::request).

use crate::error::ServeError;
use nsactor_engine::decode::SamplingParams;
use serde::{Deserialize, Serialize};
use std::time::Duration;

mod extras;
pub use extras::{ExtraFields, Extras, logit_bias_pairs};

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
    /// Choices one OpenAI request may ask for (`n`).
    pub max_n: usize,
    /// Alternatives per token a request may ask for (`logprobs`, `top_logprobs`).
    pub max_logprobs: usize,
    /// Wall-clock time one generation may take; past it, it ends with finish reason
    /// `time_limit` (`None`: no limit).
    pub request_time_limit: Option<Duration>,
    /// Open connections; past it, a new one gets a 503 and is closed.
    pub max_connections: usize,
    /// Time a connection has to send a request's headers, from its opening or the end of its
    /// previous response (an idle keep-alive connection is closed then).
    pub header_timeout: Duration,
    /// Time a WebSocket connection may stay silent with nothing running before it is closed.
    pub ws_idle_timeout: Duration,
}

/// Prompt tokens a request may send by default: far past the 512-token windows the model
/// trained on, as its state is the same size after any number of tokens (a prompt is fed a
/// pass at a time, so a long one holds no more device memory than a short one).
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 131_072;

/// Tokens one request may generate by default (`nsactor serve --max-new-tokens`).
pub const DEFAULT_MAX_NEW_TOKENS: usize = 4096;

/// Largest request body or WebSocket message by default: a prompt of
/// [`DEFAULT_MAX_PROMPT_TOKENS`] as text or token ids fits.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 << 20;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_prompt_tokens: DEFAULT_MAX_PROMPT_TOKENS,
            max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_stop: 8,
            max_stop_bytes: 128,
            max_n: 16,
            max_logprobs: 20,
            request_time_limit: Some(Duration::from_secs(600)),
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            ws_idle_timeout: Duration::from_secs(300),
        }
    }
}

pub use crate::prompts::Prompt;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A flag that may also be `null` (not given, as for every other optional field).
pub(crate) fn null_is_false<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// `top_k`, as vLLM reads it: `-1` (or `0`) is no limit, which this server spells `0`.
pub(crate) fn top_k<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    match Option::<i64>::deserialize(d)? {
        None => Ok(None),
        Some(-1) => Ok(Some(0)),
        Some(k) => usize::try_from(k).map(Some).map_err(|_| {
            serde::de::Error::custom(format!(
                "expected -1 or 0 (no limit) or a positive integer, got {k}"
            ))
        }),
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl<'de> Deserialize<'de> for Stop {
    /// One string or a list of strings; anything else is refused in those words (an
    /// untagged enum's error would name the Rust type).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde_json::Value;
        let want = "expected a string or a list of strings";
        match Value::deserialize(d)? {
            Value::String(s) => Ok(Stop::One(s)),
            Value::Array(items) => items
                .into_iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s),
                    other => Err(serde::de::Error::custom(format!(
                        "[{i}] is {other}; {want}"
                    ))),
                })
                .collect::<Result<_, _>>()
                .map(Stop::Many),
            other => Err(serde::de::Error::custom(format!("got {other}; {want}"))),
        }
    }
}

impl Stop {
    fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// The field a client named its length limit with: errors name it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LengthParam {
    #[default]
    MaxTokens,
    /// OpenAI's newer name on `/v1/chat/completions`.
    MaxCompletionTokens,
}

impl LengthParam {
    pub fn name(self) -> &'static str {
        match self {
            LengthParam::MaxTokens => "max_tokens",
            LengthParam::MaxCompletionTokens => "max_completion_tokens",
        }
    }
}

/// Sampling, length and report fields shared by every request kind.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SamplingOptions {
    pub max_tokens: Option<usize>,
    /// The name the client gave `max_tokens`.
    pub length_param: LengthParam,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    /// Only tokens at least this fraction as likely as the most likely one (vLLM's `min_p`).
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Added to the logits of token ids before sampling (OpenAI's `logit_bias`, −100..100).
    pub logit_bias: Vec<(i64, f32)>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Report the prompt tokens' log-probabilities too, with this many alternatives each
    /// (OpenAI's `echo` with `logprobs`, vLLM's `prompt_logprobs`); `max_tokens` may then be
    /// 0 (score the prompt, generate nothing).
    pub prompt_logprobs: Option<usize>,
    pub extras: Extras,
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

/// A validated request, ready for the generator.
#[derive(Debug, Clone, PartialEq)]
pub struct GenSpec {
    pub prompt: PromptSpec,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Every token in its own delta with its id, its text empty while held back (a WebSocket
    /// client's `token_ids`, every OpenAI stream).
    pub token_ids: bool,
    pub ignore_eos: bool,
    /// `(token id, bias)` added to the logits before sampling.
    pub logit_bias: Vec<(usize, f32)>,
    /// Alternatives to report per generated token (`None`: no log-probabilities).
    pub logprobs: Option<usize>,
    /// Report the prompt's log-probabilities first, with this many alternatives a token
    /// ([`GenEvent::Prompt`]).
    ///
    /// [`GenEvent::Prompt`]: crate::generate::GenEvent::Prompt
    pub prompt_logprobs: Option<usize>,
    /// The BOS before a text prompt (`add_special_tokens`, on by default: the model was trained
    /// with one in front). Token ids and chat messages are read as they come.
    pub add_special_tokens: bool,
    /// Start from the prefix cache's deepest snapshot of the prompt and keep snapshots of this
    /// request (`cache_prompt`, on by default; llama-server's name).
    pub cache_prompt: bool,
    /// Wall-clock budget of the generation.
    pub time_limit: Option<Duration>,
    pub extras: Extras,
    /// Depths where the prompt parts from the other prompts of its request (set by the front
    /// end): the prefix cache keeps a snapshot there (with the scores, when scored), so those
    /// prompts start from it.
    pub parts: Vec<usize>,
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
    /// Checks ranges and builds the generator's spec; an error names the field.
    pub fn validate(
        self,
        prompt: PromptSpec,
        token_ids: bool,
        limits: &Limits,
    ) -> Result<GenSpec, ServeError> {
        let max_tokens = self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
        // Scoring a prompt (echo with logprobs) may generate nothing.
        let least = usize::from(self.prompt_logprobs.is_none());
        if max_tokens < least || max_tokens > limits.max_new_tokens {
            let param = self.length_param.name();
            return Err(ServeError::field(
                param,
                format!(
                    "{param} must be in {least}..={} (the server's --max-new-tokens), got {max_tokens}",
                    limits.max_new_tokens
                ),
            ));
        }
        let sampling = SamplingParams {
            // OpenAI's default temperature is 1.
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed.unwrap_or_else(rand_seed),
        };
        check_sampling(&sampling)?;
        for (field, k) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if let Some(k) = k.filter(|&k| k > limits.max_logprobs) {
                return Err(ServeError::field(
                    field,
                    format!(
                        "{field}: at most {} alternatives per token, got {k}",
                        limits.max_logprobs
                    ),
                ));
            }
        }
        let extras = self.extras.validate(max_tokens, self.length_param)?;
        let logit_bias = logit_biases(self.logit_bias)?;
        let stop = stop_strings(self.stop, limits)?;
        check_prompt(&prompt)?;
        Ok(GenSpec {
            prompt,
            max_tokens,
            sampling,
            stop,
            token_ids,
            ignore_eos: self.ignore_eos,
            logit_bias,
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs,
            add_special_tokens: true,
            cache_prompt: true,
            time_limit: limits.request_time_limit,
            extras,
            parts: Vec::new(),
        })
    }
}

/// The sampling parameters' ranges, each error naming its field; then the sampler's own check.
fn check_sampling(p: &SamplingParams) -> Result<(), ServeError> {
    let checks = [
        (
            "temperature",
            p.temperature,
            (0.0..=100.0).contains(&p.temperature),
            "[0, 100]",
        ),
        ("top_p", p.top_p, p.top_p > 0.0 && p.top_p <= 1.0, "(0, 1]"),
        ("min_p", p.min_p, (0.0..=1.0).contains(&p.min_p), "[0, 1]"),
        (
            "repetition_penalty",
            p.repetition_penalty,
            p.repetition_penalty.is_finite() && p.repetition_penalty > 0.0,
            "(0, ∞)",
        ),
        (
            "presence_penalty",
            p.presence_penalty,
            (-2.0..=2.0).contains(&p.presence_penalty),
            "[-2, 2]",
        ),
        (
            "frequency_penalty",
            p.frequency_penalty,
            (-2.0..=2.0).contains(&p.frequency_penalty),
            "[-2, 2]",
        ),
    ];
    if let Some((f, v, _, range)) = checks.iter().find(|c| !c.2) {
        return Err(ServeError::field(
            f,
            format!("{f} must be in {range}, got {v}"),
        ));
    }
    // The sampler's own check stays the last word on what it accepts.
    p.validate().map_err(|e| ServeError::Invalid(e.to_string()))
}

/// `logit_bias` as the generator takes it: each bias in [-100, 100], each token id ≥ 0.
fn logit_biases(biases: Vec<(i64, f32)>) -> Result<Vec<(usize, f32)>, ServeError> {
    let mut logit_bias = Vec::with_capacity(biases.len());
    for (id, bias) in biases {
        if !(-100.0..=100.0).contains(&bias) {
            return Err(ServeError::field(
                "logit_bias",
                format!("biases must be in [-100, 100], got {bias} for token {id}"),
            ));
        }
        let id = usize::try_from(id)
            .map_err(|_| ServeError::field("logit_bias", format!("token id {id} is negative")))?;
        logit_bias.push((id, bias));
    }
    Ok(logit_bias)
}

/// `stop` as a list, within the limits on how many and how long.
fn stop_strings(stop: Option<Stop>, limits: &Limits) -> Result<Vec<String>, ServeError> {
    let stop = stop.map(Stop::into_vec).unwrap_or_default();
    if stop.len() > limits.max_stop {
        return Err(ServeError::field(
            "stop",
            format!(
                "at most {} stop strings, got {}",
                limits.max_stop,
                stop.len()
            ),
        ));
    }
    if let Some(s) = stop
        .iter()
        .find(|s| s.is_empty() || s.len() > limits.max_stop_bytes)
    {
        return Err(ServeError::field(
            "stop",
            format!(
                "stop strings must be 1..={} bytes, got {:?}",
                limits.max_stop_bytes, s
            ),
        ));
    }
    Ok(stop)
}

/// A prompt is not empty; a chat's messages have known roles.
fn check_prompt(prompt: &PromptSpec) -> Result<(), ServeError> {
    match prompt {
        PromptSpec::Text(t) if t.is_empty() => {
            return Err(ServeError::field("prompt", "the prompt is empty"));
        }
        PromptSpec::Ids(ids) if ids.is_empty() => {
            return Err(ServeError::field("prompt", "the prompt is empty"));
        }
        PromptSpec::Chat(m) if m.is_empty() => {
            return Err(ServeError::field("messages", "`messages` is empty"));
        }
        PromptSpec::Chat(m) => {
            if let Some(bad) = m
                .iter()
                .find(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant"))
            {
                return Err(ServeError::field(
                    "messages",
                    format!(
                        "message role must be system, user or assistant, got {:?}",
                        bad.role
                    ),
                ));
            }
        }
        _ => {}
    }
    Ok(())
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
    /// The prompt's tokens, then the generated ones (without an end token): the history a
    /// conversation's next turn goes on from.
    pub tokens: Vec<i64>,
    /// The end token that stopped the generation (generated, counted, never shown).
    pub end_token: Option<i64>,
    /// Its log-probability, when the request asked for the tokens' (the OpenAI answers list
    /// it with the end token, as vLLM's do).
    pub end_logprob: Option<crate::logprobs::TokenLogprob>,
    /// The request's stop string or stop token id that ended it (vLLM's `stop_reason`; none
    /// for an end token or any other ending).
    pub stop_reason: Option<StopReason>,
}

/// What of the request's own stops ended a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    Text(String),
    Token(i64),
}

impl StopReason {
    /// As vLLM writes it: the string, or the token id.
    pub fn json(&self) -> serde_json::Value {
        match self {
            StopReason::Text(t) => t.clone().into(),
            StopReason::Token(id) => (*id).into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits::default()
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
}
