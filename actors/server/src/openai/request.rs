//! The bodies of `POST /v1/completions` and `POST /v1/chat/completions`, parsed and checked
//! into one [`OpenAiCall`]. Every OpenAI field is implemented, accepted with a neutral value
//! and ignored, or refused by name (the table in the README); anything else is an unknown
//! field, also refused by name. Errors name the field (`param`).

use crate::error::ServeError;
use crate::prompts::{Prompt, Prompts};
use crate::protocol::{
    ChatMessage, ExtraFields, GenSpec, LengthParam, Limits, PromptSpec, SamplingOptions, Stop,
    logit_bias_pairs,
};
use serde::Deserialize;
use std::collections::BTreeMap;

/// One request body, as clients send it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiRequest {
    pub model: Option<String>,
    /// One prompt or a batch ([`Prompts`]).
    pub prompt: Option<Prompts>,
    pub messages: Option<Vec<OpenAiMessage>>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    #[serde(default, deserialize_with = "crate::protocol::top_k")]
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    #[serde(default, deserialize_with = "crate::protocol::null_is_false")]
    pub ignore_eos: bool,
    #[serde(default, deserialize_with = "crate::protocol::null_is_false")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<usize>,
    pub best_of: Option<usize>,
    /// An integer (alternatives per token) on `/v1/completions`, a boolean on chat.
    pub logprobs: Option<Logprobs>,
    pub top_logprobs: Option<usize>,
    #[serde(default, deserialize_with = "crate::protocol::null_is_false")]
    pub echo: bool,
    /// The BOS before a text prompt (vLLM's field; default true).
    pub add_special_tokens: Option<bool>,
    /// Start from the prefix cache and keep snapshots of this request (llama-server's field;
    /// default true).
    pub cache_prompt: Option<bool>,
    /// vLLM's extra sampling parameters ([`Extras`](crate::protocol::Extras)).
    pub stop_token_ids: Option<Vec<i64>>,
    pub min_tokens: Option<usize>,
    pub skip_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    /// `-1` or a count ≥ 1.
    pub truncate_prompt_tokens: Option<i64>,
    pub allowed_token_ids: Option<Vec<i64>>,
    pub min_p: Option<f32>,
    /// The prompt tokens' log-probabilities with this many alternatives each, in vLLM's
    /// shape (not streamed).
    pub prompt_logprobs: Option<i64>,
    /// The prompt's token ids and each choice's generated ones beside the text (vLLM's).
    #[serde(default, deserialize_with = "crate::protocol::null_is_false")]
    pub return_token_ids: bool,
    pub suffix: Option<String>,
    /// Accepted and ignored.
    pub user: Option<String>,
    pub response_format: Option<ResponseFormat>,
    pub tools: Option<Vec<serde_json::Value>>,
    pub tool_choice: Option<serde_json::Value>,
    /// Accepted and ignored (no tools are run).
    pub parallel_tool_calls: Option<bool>,
    /// Accepted and ignored (nothing is stored).
    pub store: Option<bool>,
    pub metadata: Option<serde_json::Value>,
    pub service_tier: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Logprobs {
    Flag(bool),
    Count(usize),
}

impl<'de> Deserialize<'de> for Logprobs {
    /// `true`/`false` (chat) or a count of alternatives (completions); anything else is
    /// refused in those words.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde_json::Value;
        match Value::deserialize(d)? {
            Value::Bool(b) => Ok(Logprobs::Flag(b)),
            Value::Number(n) if n.as_u64().is_some() => Ok(Logprobs::Count(
                usize::try_from(n.as_u64().unwrap_or(u64::MAX)).unwrap_or(usize::MAX),
            )),
            other => Err(serde::de::Error::custom(format!(
                "got {other}; expected true or false (/v1/chat/completions) or a number of \
                 alternatives per token, 0 or more (/v1/completions)"
            ))),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
}

/// A chat message as OpenAI clients send it: `content` a string or a list of text parts.
/// An answer appended to the history as the client library gave it (`message.model_dump()`)
/// carries more: accepted while they say nothing (null or empty).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiMessage {
    pub role: String,
    pub content: Option<serde_json::Value>,
    /// Accepted and ignored.
    pub name: Option<String>,
    /// Accepted when empty (assistant turns echoed back by clients).
    pub refusal: Option<String>,
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// Accepted when empty or null (an echoed answer's).
    pub annotations: Option<Vec<serde_json::Value>>,
    pub audio: Option<serde_json::Value>,
    pub function_call: Option<serde_json::Value>,
    /// A `tool` message's; refused with its role (no tools are run).
    pub tool_call_id: Option<String>,
}

/// Choices one request may ask for in all (its prompts × `n`).
pub const MAX_CHOICES: usize = 1024;

/// A checked request: the generation spec of each prompt and how to answer.
#[derive(Debug, Clone)]
pub struct OpenAiCall {
    /// One per prompt (a chat has one; `/v1/completions` one or a batch).
    pub specs: Vec<GenSpec>,
    /// Choices per prompt (`n`): each its own session, seeded `seed + j` for the prompt's
    /// `j`-th; choice `index` = prompt × `n` + `j`, as OpenAI numbers a batch's.
    pub n: usize,
    pub chat: bool,
    pub stream: bool,
    /// A last chunk with the usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// `/v1/completions` `echo`: the prompt's text starts each choice.
    pub echo: bool,
    /// vLLM's `prompt_logprobs` was asked for: the answer carries the prompt's
    /// log-probabilities in vLLM's shape (each choice's on completions, the answer's on chat).
    pub prompt_logprobs: bool,
    /// vLLM's `return_token_ids`: `prompt_token_ids` (each choice's on completions, the
    /// answer's on chat; a stream's first chunk of each choice) and `token_ids` (the
    /// choice's generated tokens, the end token that stopped it included; a stream's chunk,
    /// its own).
    pub return_token_ids: bool,
}

fn refuse(param: &str, message: impl Into<String>) -> ServeError {
    ServeError::field(param, message)
}

/// Reads a JSON body into `T`; a wrong field is named (`param`), broken JSON is
/// `invalid_json`.
pub fn read_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ServeError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|&b| b != b'{')
        && serde_json::from_slice::<serde_json::Value>(body).is_ok()
    {
        return Err(ServeError::Invalid(
            "the request body must be a JSON object".into(),
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let words = crate::error::plain_json_error(&inner);
        if inner.is_syntax() || inner.is_eof() {
            ServeError::InvalidJson(format!("invalid JSON: {words}"))
        } else if path == "." {
            // serde says which key came twice, not where: the key is the field.
            match words
                .strip_prefix("duplicate field `")
                .and_then(|r| r.split_once('`'))
            {
                Some((field, _)) => refuse(field, format!("`{field}` is given twice")),
                None => ServeError::Invalid(format!("invalid request body: {words}")),
            }
        } else {
            let field = path.split(['.', '[']).next().unwrap_or(&path).to_string();
            refuse(&field, format!("`{path}`: {words}"))
        }
    })?;
    // One JSON value and nothing after it (whitespace aside).
    de.end().map_err(|_| {
        ServeError::InvalidJson("invalid JSON: more after the body's object".into())
    })?;
    Ok(value)
}

/// Parses and checks a body for the server of model `served`.
pub fn parse(
    body: &[u8],
    limits: &Limits,
    served: &str,
    chat: bool,
) -> Result<OpenAiCall, ServeError> {
    read_json::<OpenAiRequest>(body)?.check(limits, served, chat)
}

impl OpenAiRequest {
    fn check(self, limits: &Limits, served: &str, chat: bool) -> Result<OpenAiCall, ServeError> {
        check_model(self.model.as_deref(), served)?;
        let prompts: Vec<PromptSpec> = match (chat, self.prompt, self.messages) {
            (false, Some(Prompts(p)), None) => p
                .into_iter()
                .map(|p| match p {
                    Prompt::Text(t) => PromptSpec::Text(t),
                    Prompt::Ids(ids) => PromptSpec::Ids(ids),
                })
                .collect(),
            (true, None, Some(m)) => vec![PromptSpec::Chat(chat_messages(m)?)],
            (false, _, _) => {
                return Err(refuse(
                    "prompt",
                    "/v1/completions needs `prompt` (and no `messages`)",
                ));
            }
            (true, _, _) => {
                return Err(refuse(
                    "messages",
                    "/v1/chat/completions needs `messages` (and no `prompt`)",
                ));
            }
        };
        let n = self.n.unwrap_or(1);
        if n == 0 || n > limits.max_n {
            return Err(refuse(
                "n",
                format!("n must be in 1..={}, got {n}", limits.max_n),
            ));
        }
        if prompts.len() * n > MAX_CHOICES {
            return Err(refuse(
                "prompt",
                format!(
                    "{} prompts × n = {n} make {} choices; a request may ask for {MAX_CHOICES}",
                    prompts.len(),
                    prompts.len() * n
                ),
            ));
        }
        if self.best_of.is_some_and(|b| b != n) {
            return Err(refuse(
                "best_of",
                "best_of is not supported (only best_of = n)",
            ));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(refuse("suffix", "suffix (insertion) is not supported"));
        }
        if let Some(f) = self.response_format.filter(|f| f.kind != "text") {
            return Err(refuse(
                "response_format",
                format!(
                    "response_format `{}` is not supported (only `text`)",
                    f.kind
                ),
            ));
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(refuse("tools", "tools are not supported"));
        }
        if let Some(c) = self.tool_choice.filter(|c| *c != "none") {
            return Err(refuse(
                "tool_choice",
                format!("tool_choice must be \"none\", got {c}"),
            ));
        }
        if self.stream_options.is_some() && !self.stream {
            return Err(refuse(
                "stream_options",
                "stream_options needs stream: true",
            ));
        }
        let logprobs = match (chat, self.logprobs, self.top_logprobs) {
            (_, None | Some(Logprobs::Flag(false)), None) => None,
            (false, Some(Logprobs::Count(k)), None) => Some(k),
            (true, Some(Logprobs::Flag(true)), Some(top)) if top > limits.max_logprobs => {
                return Err(refuse(
                    "top_logprobs",
                    format!(
                        "at most {} alternatives per token, got {top}",
                        limits.max_logprobs
                    ),
                ));
            }
            (true, Some(Logprobs::Flag(true)), top) => Some(top.unwrap_or(0)),
            (true, _, Some(_)) => {
                return Err(refuse("top_logprobs", "top_logprobs needs logprobs: true"));
            }
            (true, Some(Logprobs::Count(_)), None) => {
                return Err(refuse(
                    "logprobs",
                    "on /v1/chat/completions logprobs is true or false (top_logprobs counts)",
                ));
            }
            (false, _, Some(_)) => {
                return Err(refuse(
                    "top_logprobs",
                    "top_logprobs belongs to /v1/chat/completions; here logprobs counts",
                ));
            }
            (false, Some(Logprobs::Flag(true)), None) => {
                return Err(refuse(
                    "logprobs",
                    "on /v1/completions logprobs is the number of alternatives (0..=20)",
                ));
            }
        };
        if chat && self.echo {
            return Err(refuse("echo", "echo belongs to /v1/completions"));
        }
        if self.max_tokens.is_some() && self.max_completion_tokens.is_some() {
            return Err(refuse(
                "max_completion_tokens",
                "give max_tokens or max_completion_tokens, not both",
            ));
        }
        let prompt_logprobs = match self.prompt_logprobs {
            None => None,
            Some(_) if self.stream => {
                return Err(refuse(
                    "prompt_logprobs",
                    "prompt_logprobs is not streamed (as in vLLM): ask without stream, or with \
                     echo and logprobs",
                ));
            }
            Some(k) => Some(usize::try_from(k).map_err(|_| {
                refuse(
                    "prompt_logprobs",
                    format!(
                        "prompt_logprobs is a number of alternatives per token, 0..={}, got {k}",
                        limits.max_logprobs
                    ),
                )
            })?),
        };
        let extras = ExtraFields {
            stop_token_ids: self.stop_token_ids,
            min_tokens: self.min_tokens,
            skip_special_tokens: self.skip_special_tokens,
            include_stop_str_in_output: self.include_stop_str_in_output,
            truncate_prompt_tokens: self.truncate_prompt_tokens,
            allowed_token_ids: self.allowed_token_ids,
        }
        .read()?;
        let logit_bias = logit_bias_pairs(self.logit_bias)?;
        let length_param = if self.max_completion_tokens.is_some() {
            LengthParam::MaxCompletionTokens
        } else {
            LengthParam::MaxTokens
        };
        let options = SamplingOptions {
            max_tokens: self.max_tokens.or(self.max_completion_tokens),
            length_param,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias,
            // Negative seeds (allowed by OpenAI's schema) keep their bits.
            seed: self.seed.map(|s| s as u64),
            stop: self.stop,
            ignore_eos: self.ignore_eos,
            logprobs,
            // A prompt echoed with nothing generated (`max_tokens: 0`) is scored, as with
            // logprobs, so the request runs the one pass OpenAI's legacy endpoint and vLLM
            // run for it; its log-probabilities are sent only where asked for. vLLM's
            // `prompt_logprobs` names the alternatives itself (the echo's too, as in vLLM).
            prompt_logprobs: prompt_logprobs.or_else(|| {
                (self.echo
                    && (logprobs.is_some()
                        || self.max_tokens.or(self.max_completion_tokens) == Some(0)))
                .then(|| logprobs.unwrap_or(0))
            }),
            extras,
        };
        // A stream gets a chunk per generated token, as vLLM's does: a token whose text is held
        // back (an incomplete character, a possible stop string) comes with empty text, and the
        // text follows in a later chunk. So the first chunk marks the first token.
        let bos = self.add_special_tokens.unwrap_or(true);
        let specs = prompts
            .into_iter()
            .map(|p| {
                let mut spec = options.clone().validate(p, self.stream, limits)?;
                spec.add_special_tokens = bos;
                spec.cache_prompt = self.cache_prompt.unwrap_or(true);
                Ok(spec)
            })
            .collect::<Result<_, ServeError>>()?;
        Ok(OpenAiCall {
            specs,
            n,
            chat,
            stream: self.stream,
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
            echo: self.echo,
            prompt_logprobs: prompt_logprobs.is_some(),
            return_token_ids: self.return_token_ids,
        })
    }
}

/// A request naming a model must name the one served (an empty name is no name).
pub fn check_model(model: Option<&str>, served: &str) -> Result<(), ServeError> {
    match model {
        Some(m) if !m.is_empty() && m != served => Err(ServeError::ModelNotFound(format!(
            "the model `{m}` does not exist; this server serves `{served}`"
        ))),
        _ => Ok(()),
    }
}

/// OpenAI chat messages as the template's: text parts joined by newlines, `developer` read as
/// `system`.
pub fn chat_messages(m: Vec<OpenAiMessage>) -> Result<Vec<ChatMessage>, ServeError> {
    m.into_iter()
        .enumerate()
        .map(|(i, m)| {
            let at = |what: &str| refuse("messages", format!("messages[{i}]: {what}"));
            if m.tool_calls.as_ref().is_some_and(|t| !t.is_empty()) {
                return Err(at("tool_calls are not supported"));
            }
            if m.role == "tool" || m.tool_call_id.is_some() {
                return Err(at("tool messages are not supported (no tools are run)"));
            }
            if m.function_call.as_ref().is_some_and(|f| !f.is_null()) {
                return Err(at("function_call is not supported (no tools are run)"));
            }
            if m.audio.as_ref().is_some_and(|a| !a.is_null()) {
                return Err(at("audio is not supported"));
            }
            if m.annotations.as_ref().is_some_and(|a| !a.is_empty()) {
                return Err(at("annotations are not supported"));
            }
            let content = match m.content {
                Some(serde_json::Value::String(s)) => s,
                Some(serde_json::Value::Array(parts)) => {
                    // Text parts joined by a newline, as vLLM joins them for a text template.
                    let mut texts = Vec::with_capacity(parts.len());
                    for (j, p) in parts.iter().enumerate() {
                        match (p.get("type").and_then(|t| t.as_str()), p.get("text")) {
                            (Some("text"), Some(serde_json::Value::String(t))) => {
                                texts.push(t.as_str())
                            }
                            (kind, _) => {
                                return Err(at(&format!(
                                    "content[{j}] of type {} is not supported (only text parts)",
                                    kind.unwrap_or("?")
                                )));
                            }
                        }
                    }
                    texts.join("\n")
                }
                Some(serde_json::Value::Null) | None if m.role == "assistant" => String::new(),
                Some(other @ serde_json::Value::Null)
                | Some(other @ serde_json::Value::Bool(_))
                | Some(other @ serde_json::Value::Number(_))
                | Some(other @ serde_json::Value::Object(_)) => {
                    return Err(at(&format!("content must be text, got {other}")));
                }
                None => return Err(at("content is missing")),
            };
            let role = if m.role == "developer" {
                "system".to_string()
            } else {
                m.role
            };
            Ok(ChatMessage { role, content })
        })
        .collect()
}

#[cfg(test)]
mod tests;
