//! OpenAI's response bodies: whole answers, streamed chunks and the final usage chunk, for
//! completions and chat, with log-probabilities in each endpoint's own shape
//! (`tokens`/`token_logprobs`/`top_logprobs`/`text_offset` on completions, `content` entries
//! with `bytes` on chat).

use crate::logprobs::TokenLogprob;
use crate::protocol::Usage;
use nsactor_data::Tokenizer;
use serde_json::{Map, Value, json};
use std::sync::Arc;

/// OpenAI cannot carry −∞ in JSON: vLLM's stand-in for a token the model rules out.
const NEG_INF_LOGPROB: f32 = -9999.0;

/// A piece of one choice: text and the tokens behind it with their log-probabilities (the
/// prompt's first token has none).
#[derive(Debug, Default)]
pub struct Piece {
    pub text: String,
    pub tokens: Vec<(i64, Option<TokenLogprob>)>,
    /// The generated tokens behind `text` (streams; vLLM's `token_ids`).
    pub ids: Vec<i64>,
}

/// A whole choice: its text and tokens, why it ended, its scored prompt (vLLM's
/// `prompt_logprobs`), and its prompt's and generated token ids (vLLM's `return_token_ids`).
pub struct Answered<'a> {
    pub piece: Piece,
    pub finish: &'a str,
    pub scored: Option<Scored>,
    pub prompt_ids: Option<Vec<i64>>,
    pub token_ids: Vec<i64>,
    /// The stop string or token id of the request's that ended it (vLLM's `stop_reason`).
    pub stop_reason: Value,
}

/// vLLM's token ids on a streamed chunk (`return_token_ids`): the prompt's on a choice's
/// first chunk, and the chunk's own tokens.
#[derive(Debug, Default, Clone, Copy)]
pub struct ChunkIds<'a> {
    pub prompt: Option<&'a [i64]>,
    pub tokens: &'a [i64],
}

/// A scored prompt: its tokens, each with its log-probability (the first has none).
pub type Scored = Vec<(i64, Option<TokenLogprob>)>;

/// What every body of one request shares.
pub struct Shape {
    pub chat: bool,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Requests with `logprobs`: every choice carries them.
    pub logprobs: bool,
    /// Requests with vLLM's `prompt_logprobs`: each choice carries the prompt's (the answer
    /// on chat).
    pub prompt_logprobs: bool,
    /// Requests with vLLM's `return_token_ids`.
    pub return_token_ids: bool,
    /// Streamed with `include_usage`: chunks carry `"usage": null`, a last one the usage.
    pub include_usage: bool,
    pub tokenizer: Arc<Tokenizer>,
}

impl Shape {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), self.id.clone().into());
        m.insert("object".into(), self.object(chunk).into());
        m.insert("created".into(), self.created.into());
        m.insert("model".into(), self.model.clone().into());
        m.insert("choices".into(), choices.into());
        m
    }

    /// A whole answer: its choices in index order.
    pub fn answer(&self, choices: Vec<Answered>, usage: Usage) -> Value {
        let mut prompt = Value::Null;
        let mut prompt_ids = Value::Null;
        let choices = choices
            .into_iter()
            .enumerate()
            .map(|(i, a)| {
                let (p, finish, scored) = (a.piece, a.finish, a.scored);
                let lp = self.logprobs_json(&p.tokens, &mut TextOffset::default());
                let mut c = json!({"index": i, "finish_reason": finish, "logprobs": lp,
                    "stop_reason": a.stop_reason});
                if self.chat {
                    c["message"] = json!({"role": "assistant", "content": p.text});
                } else {
                    c["text"] = p.text.into();
                }
                if self.return_token_ids {
                    c["token_ids"] = json!(a.token_ids);
                    // vLLM's: each choice's on completions, the answer's on chat.
                    if self.chat {
                        prompt_ids = json!(a.prompt_ids);
                    } else {
                        c["prompt_token_ids"] = json!(a.prompt_ids);
                    }
                }
                if self.prompt_logprobs {
                    let v = scored.map_or(Value::Null, |t| self.vllm_prompt_logprobs(&t));
                    // vLLM puts a chat's on the answer (its one prompt), a completion's on
                    // each choice.
                    if self.chat {
                        prompt = v;
                    } else {
                        c["prompt_logprobs"] = v;
                    }
                }
                c
            })
            .collect();
        let mut m = self.envelope(false, choices);
        m.insert("usage".into(), json!(usage));
        if self.prompt_logprobs && self.chat {
            m.insert("prompt_logprobs".into(), prompt);
        }
        if self.return_token_ids && self.chat {
            m.insert("prompt_token_ids".into(), prompt_ids);
        }
        Value::Object(m)
    }

    /// vLLM's `prompt_logprobs`: `null` for the first token, then at each position a map from
    /// token id to `{logprob, rank, decoded_token}` holding the prompt's token and the most
    /// likely alternatives.
    fn vllm_prompt_logprobs(&self, tokens: &[(i64, Option<TokenLogprob>)]) -> Value {
        let lp = |l: f32| if l.is_finite() { l } else { NEG_INF_LOGPROB };
        let entry = |id: i64, l: f32, rank: usize| json!({"logprob": lp(l), "rank": rank, "decoded_token": self.token_text(id)});
        tokens
            .iter()
            .map(|(_, l)| {
                l.as_ref().map_or(Value::Null, |l| {
                    let mut m = Map::new();
                    m.insert(
                        l.token_id.to_string(),
                        entry(l.token_id, l.logprob, l.rank as usize),
                    );
                    for (i, &(id, p)) in l.top.iter().enumerate() {
                        // Every token more likely than an alternative is an alternative too
                        // (most likely first), so its rank is counted among them: ties share.
                        let rank = 1 + l.top[..i].iter().filter(|t| t.1 > p).count();
                        m.entry(id.to_string())
                            .or_insert_with(|| entry(id, p, rank));
                    }
                    Value::Object(m)
                })
            })
            .collect()
    }

    /// One streamed chunk of choice `index`: its new piece (the chat role on its first), or
    /// its finish reason. `offset` is the choice's text offset so far (completions); `ids`
    /// go on it where `return_token_ids` asked for them.
    pub fn chunk(
        &self,
        index: usize,
        piece: Option<&Piece>,
        finish: Option<&str>,
        first: bool,
        offset: &mut TextOffset,
        ids: ChunkIds,
    ) -> Value {
        let lp = piece.map_or(Value::Null, |p| self.logprobs_json(&p.tokens, offset));
        let text = piece.map(|p| p.text.as_str());
        let mut choice = if self.chat {
            let mut d = Map::new();
            if first {
                d.insert("role".into(), "assistant".into());
            }
            if let Some(t) = text {
                d.insert("content".into(), t.into());
            }
            json!({"index": index, "delta": d, "finish_reason": finish, "logprobs": lp})
        } else {
            json!({"index": index, "text": text.unwrap_or(""), "finish_reason": finish,
                "logprobs": lp})
        };
        if self.return_token_ids {
            choice["token_ids"] = json!(ids.tokens);
            if let (false, Some(p)) = (self.chat, ids.prompt) {
                choice["prompt_token_ids"] = json!(p);
            }
        }
        let mut m = self.envelope(true, vec![choice]);
        if let (true, true, Some(p)) = (self.return_token_ids, self.chat, ids.prompt) {
            m.insert("prompt_token_ids".into(), json!(p));
        }
        if self.include_usage {
            m.insert("usage".into(), Value::Null);
        }
        Value::Object(m)
    }

    /// The last chunk of a stream with `include_usage`: no choices, the usage.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut m = self.envelope(true, Vec::new());
        m.insert("usage".into(), json!(usage));
        Value::Object(m)
    }

    /// The token's own bytes (a piece of a character too), else those of its text `t`.
    fn token_bytes(&self, id: i64, t: &str) -> Vec<u8> {
        u32::try_from(id)
            .ok()
            .and_then(|id| self.tokenizer.token_bytes(id))
            .unwrap_or_else(|| t.as_bytes().to_vec())
    }

    fn token_text(&self, id: i64) -> String {
        u32::try_from(id)
            .ok()
            .and_then(|id| self.tokenizer.decode(&[id], false).ok())
            .unwrap_or_default()
    }

    /// The endpoint's log-probability object for `tokens` (null when not asked for);
    /// `offset` advances over the tokens' text (completions' `text_offset`).
    fn logprobs_json(
        &self,
        tokens: &[(i64, Option<TokenLogprob>)],
        offset: &mut TextOffset,
    ) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let lp = |l: f32| if l.is_finite() { l } else { NEG_INF_LOGPROB };
        if self.chat {
            // `bytes` are the token's own (a piece of a character too), `token` its text.
            let entry = |id: i64, l: f32| {
                let t = self.token_text(id);
                json!({"token": t, "logprob": lp(l), "bytes": self.token_bytes(id, &t)})
            };
            let content: Vec<Value> = tokens
                .iter()
                .filter_map(|(_, l)| l.as_ref())
                .map(|l| {
                    let mut e = entry(l.token_id, l.logprob);
                    let top: Vec<Value> = l.top.iter().map(|&(id, l)| entry(id, l)).collect();
                    e["top_logprobs"] = top.into();
                    e
                })
                .collect();
            return json!({ "content": content });
        }
        let (mut text, mut logp, mut top, mut offsets) = (vec![], vec![], vec![], vec![]);
        for (id, l) in tokens {
            let t = self.token_text(*id);
            offsets.push(offset.chars);
            offset.advance(&self.token_bytes(*id, &t));
            text.push(Value::from(t));
            logp.push(l.as_ref().map_or(Value::Null, |l| lp(l.logprob).into()));
            // The `logprobs` most likely tokens and, as OpenAI's and vLLM's do, the chosen one
            // (up to `logprobs` + 1 entries; at `logprobs: 0`, the chosen token alone).
            top.push(l.as_ref().map_or(Value::Null, |l| {
                let mut m: Map<String, Value> = l
                    .top
                    .iter()
                    .map(|&(id, l)| (self.token_text(id), lp(l).into()))
                    .collect();
                m.entry(self.token_text(l.token_id))
                    .or_insert_with(|| lp(l.logprob).into());
                Value::Object(m)
            }));
        }
        json!({"tokens": text, "token_logprobs": logp, "top_logprobs": top, "text_offset": offsets})
    }
}
/// Where the next token starts in a choice's text, in characters (OpenAI's `text_offset`):
/// the tokens' own bytes are joined, so a token that ends inside a character leaves the count
/// where that character starts, and the next token's offset is past it once it is whole.
#[derive(Debug, Default, Clone)]
pub struct TextOffset {
    pub chars: usize,
    /// The bytes of a character not whole yet.
    pending: Vec<u8>,
}

impl TextOffset {
    /// Past `bytes`: the whole characters they end are counted (a byte that can never be part
    /// of one counts as one, as the text's U+FFFD does).
    pub fn advance(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
        let mut at = 0;
        loop {
            match std::str::from_utf8(&self.pending[at..]) {
                Ok(s) => {
                    self.chars += s.chars().count();
                    at = self.pending.len();
                    break;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    let s = std::str::from_utf8(&self.pending[at..at + good]).expect("valid");
                    self.chars += s.chars().count();
                    at += good;
                    match e.error_len() {
                        Some(bad) => {
                            self.chars += 1;
                            at += bad;
                        }
                        None => break, // a character still to be completed
                    }
                }
            }
        }
        self.pending.drain(..at);
    }
}

#[cfg(test)]
mod tests {
    use super::TextOffset;

    #[test]
    fn offsets_count_characters_and_wait_for_a_split_one() {
        let mut o = TextOffset::default();
        let mut at = Vec::new();
        // "café au" with é (C3 A9) split over two tokens, then 日 (E6 97 A5) over three.
        for t in [
            &b"caf"[..],
            b"\xC3",
            b"\xA9",
            b" au",
            b"\xE6",
            b"\x97",
            b"\xA5",
            b"!",
        ] {
            at.push(o.chars);
            o.advance(t);
        }
        assert_eq!(at, [0, 3, 3, 4, 7, 7, 7, 8]);
        assert_eq!(o.chars, "café au日!".chars().count());
        // A byte that can never start a character counts as the U+FFFD the text shows.
        let mut bad = TextOffset::default();
        bad.advance(b"a\xFFb");
        assert_eq!(bad.chars, 3);
    }
}
