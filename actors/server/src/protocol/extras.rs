//! vLLM's extra sampling parameters ([`Extras`]) as both front ends read them: the OpenAI
//! bodies and the WebSocket's `generate` name the same fields ([`ExtraFields`]), and OpenAI's
//! `logit_bias` map is read into pairs the same way ([`logit_bias_pairs`]).

use super::LengthParam;
use crate::error::ServeError;

/// vLLM's extra sampling parameters, by its names.
#[derive(Debug, Clone, PartialEq)]
pub struct Extras {
    /// Tokens that end the generation when chosen (`stop_token_ids`); the text shows the
    /// token unless it is a special one, as vLLM's does.
    pub stop_token_ids: Vec<i64>,
    /// End tokens, `stop_token_ids` and stop strings take effect only once this many tokens
    /// are generated (`min_tokens`; the end tokens are banned until then).
    pub min_tokens: usize,
    /// Special tokens are left out of the text (`skip_special_tokens`, default true).
    pub skip_special_tokens: bool,
    /// The stop string that ended a generation stays at the end of its text
    /// (`include_stop_str_in_output`).
    pub include_stop_str_in_output: bool,
    /// Only the prompt's last this many tokens are read (`truncate_prompt_tokens`; the BOS
    /// put in front of a text prompt counts among them).
    pub truncate_prompt_tokens: Option<usize>,
    /// Only these tokens may be chosen (`allowed_token_ids`).
    pub allowed_token_ids: Option<Vec<i64>>,
}

impl Default for Extras {
    fn default() -> Self {
        Extras {
            stop_token_ids: Vec::new(),
            min_tokens: 0,
            skip_special_tokens: true,
            include_stop_str_in_output: false,
            truncate_prompt_tokens: None,
            allowed_token_ids: None,
        }
    }
}

/// vLLM's extra fields as a request names them (the OpenAI bodies and the WebSocket's
/// `generate` alike), before [`ExtraFields::read`] makes them [`Extras`].
#[derive(Debug, Clone, Default)]
pub struct ExtraFields {
    pub stop_token_ids: Option<Vec<i64>>,
    pub min_tokens: Option<usize>,
    pub skip_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    /// `-1` or a count ≥ 1.
    pub truncate_prompt_tokens: Option<i64>,
    pub allowed_token_ids: Option<Vec<i64>>,
}

impl ExtraFields {
    /// The extras with their defaults; `truncate_prompt_tokens` other than `-1` or a count is
    /// refused by name (the rest is checked with the request's length, in [`SamplingOptions::validate`](super::SamplingOptions::validate)).
    pub fn read(self) -> Result<Extras, ServeError> {
        let truncate_prompt_tokens = match self.truncate_prompt_tokens {
            None | Some(-1) => None,
            Some(k) if k >= 1 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
            Some(k) => {
                return Err(ServeError::field(
                    "truncate_prompt_tokens",
                    format!("truncate_prompt_tokens must be -1 or at least 1, got {k}"),
                ));
            }
        };
        Ok(Extras {
            stop_token_ids: self.stop_token_ids.unwrap_or_default(),
            min_tokens: self.min_tokens.unwrap_or(0),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            truncate_prompt_tokens,
            allowed_token_ids: self.allowed_token_ids,
        })
    }
}

/// OpenAI's `logit_bias` (token ids written as strings, each with its bias) as pairs; a key
/// that is not a token id is refused by name.
pub fn logit_bias_pairs(
    map: Option<std::collections::BTreeMap<String, f32>>,
) -> Result<Vec<(i64, f32)>, ServeError> {
    map.unwrap_or_default()
        .into_iter()
        .map(|(k, v)| {
            let id: i64 = k.parse().map_err(|_| {
                ServeError::field(
                    "logit_bias",
                    format!("logit_bias keys are token ids, got {k:?}"),
                )
            })?;
            Ok((id, v))
        })
        .collect()
}

impl Extras {
    /// Checks what can be checked without the model: `max_tokens` is the request's.
    pub(super) fn validate(
        self,
        max_tokens: usize,
        length_param: LengthParam,
    ) -> Result<Self, ServeError> {
        if self.min_tokens > max_tokens {
            return Err(ServeError::field(
                "min_tokens",
                format!(
                    "min_tokens ({}) must be at most {} ({max_tokens})",
                    self.min_tokens,
                    length_param.name()
                ),
            ));
        }
        if self.truncate_prompt_tokens == Some(0) {
            return Err(ServeError::field(
                "truncate_prompt_tokens",
                "truncate_prompt_tokens must be at least 1 (or -1: no truncation)",
            ));
        }
        if self.allowed_token_ids.as_ref().is_some_and(Vec::is_empty) {
            return Err(ServeError::field(
                "allowed_token_ids",
                "allowed_token_ids must name at least one token",
            ));
        }
        for (field, ids) in [
            ("stop_token_ids", &self.stop_token_ids[..]),
            (
                "allowed_token_ids",
                self.allowed_token_ids.as_deref().unwrap_or(&[]),
            ),
        ] {
            if let Some(id) = ids.iter().find(|&&id| id < 0) {
                return Err(ServeError::field(
                    field,
                    format!("token id {id} is negative"),
                ));
            }
        }
        Ok(self)
    }
}
