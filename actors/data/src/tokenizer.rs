//! The byte-level BPE tokenizer (HF `tokenizers`, `tokenizer.json` format): loading, training,
//! a content hash, and the ChatML template (SPEC §9).

mod added;
mod ascii;
mod bytes;
mod stream;

pub use stream::TextStream;

use crate::error::{DataError, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::Path;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::normalizers::unicode::NFKC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper};

/// The reference's special tokens, ids 0–4 in this order (SPEC §9).
pub const SPECIALS: [&str; 5] = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"];
/// Pretraining BOS and ChatML turn opener (id 3 in the reference).
pub const BOS_TOKEN: &str = "<|im_start|>";
/// End of a turn or document (id 4 in the reference).
pub const EOS_TOKEN: &str = "<|im_end|>";
/// Datasets pad with id 0 (`<unk>`), which the loss never scores (SPEC §8).
pub const PAD_ID: u32 = 0;
/// Default vocabulary of `nsactor tokenizer train`: the reference's size.
pub const DEFAULT_VOCAB_SIZE: usize = 6144;

/// The tokenizer bundled with the repository: 2048 tokens trained on the bundled corpus.
pub const BUNDLED_TOKENIZER_JSON: &str = include_str!("../assets/tokenizer.json");

/// A loaded tokenizer with its content hash and special ids.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    origin: String,
    hash: String,
    bos: u32,
    eos: u32,
    /// The ASCII fast path, when this tokenizer qualifies (see [`ascii`]).
    ascii: Option<ascii::AsciiBpe>,
    /// Cuts at added tokens, when they allow the fast path between them (see [`added`]).
    added: Option<added::AddedSplit>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size())
            .field("hash", &self.hash)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `path`, or the bundled tokenizer when `None`.
    pub fn load_or_bundled(path: Option<&Path>) -> Result<Self> {
        match path {
            Some(p) => Tokenizer::load(p),
            None => Ok(Tokenizer::bundled()),
        }
    }

    /// Loads a `tokenizer.json`.
    pub fn load(path: &Path) -> Result<Self> {
        let json = std::fs::read_to_string(path).map_err(|e| DataError::read(path, e))?;
        Self::from_json(&json, &path.display().to_string())
    }

    /// Parses `tokenizer.json` text; `origin` names it in messages.
    pub fn from_json(json: &str, origin: &str) -> Result<Self> {
        let inner: tokenizers::Tokenizer =
            json.parse()
                .map_err(
                    |e: Box<dyn std::error::Error + Send + Sync>| DataError::Tokenizer {
                        origin: origin.into(),
                        msg: format!("not a valid tokenizer.json: {e}"),
                    },
                )?;
        Self::wrap(inner, origin)
    }

    /// The bundled 2048-token tokenizer.
    pub fn bundled() -> Self {
        Self::from_json(BUNDLED_TOKENIZER_JSON, "bundled tokenizer.json")
            .expect("the bundled tokenizer.json is valid and has the ChatML specials")
    }

    fn wrap(inner: tokenizers::Tokenizer, origin: &str) -> Result<Self> {
        let id = |t: &str| {
            inner.token_to_id(t).ok_or_else(|| DataError::Tokenizer {
                origin: origin.into(),
                msg: format!("has no `{t}` token (needed as BOS/EOS)"),
            })
        };
        let (bos, eos) = (id(BOS_TOKEN)?, id(EOS_TOKEN)?);
        // The library's own serialisation is canonical (ordered vocab, merges, added tokens), so
        // equal tokenizers hash equal however their files were formatted.
        let canonical = inner.to_string(false).map_err(|e| DataError::Tokenizer {
            origin: origin.into(),
            msg: format!("cannot serialise: {e}"),
        })?;
        let hash = format!("{:x}", Sha256::digest(canonical.as_bytes()));
        let ascii = ascii::AsciiBpe::new(&inner);
        let added = added::AddedSplit::new(&inner);
        Ok(Tokenizer {
            inner,
            origin: origin.into(),
            hash,
            bos,
            eos,
            ascii,
            added,
        })
    }

    /// Where this tokenizer came from (a path or "bundled …").
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// sha256 (hex) of the canonical JSON; recorded in shard manifests.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// Number of ids, added tokens included (6144 for the reference).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn bos_id(&self) -> u32 {
        self.bos
    }

    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary's own string for `id` (`transformers`' `convert_ids_to_tokens`: a
    /// byte-level token's bytes in the byte-to-character alphabet, `Ġc` for " c"), where
    /// decoding one token of a multi-byte character alone gives U+FFFD.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// What a Hugging Face `tokenizer_config.json` says of this tokenizer, and what vLLM's
    /// `GET /tokenizer_info` answers: the BOS, EOS and pad tokens (with their ids), the ChatML
    /// chat template ([`CHAT_TEMPLATE_JINJA`]) and the longest input, `model_max_length`. No
    /// token is added by the tokenizer itself (`add_bos_token: false`): a server or trainer
    /// puts the BOS in front where the model reads one.
    pub fn hf_tokenizer_config(&self, model_max_length: usize) -> serde_json::Value {
        let token = |id: u32| self.inner.id_to_token(id).unwrap_or_default();
        serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token(self.bos),
            "eos_token": token(self.eos),
            "pad_token": token(PAD_ID),
            "unk_token": token(PAD_ID),
            "bos_token_id": self.bos,
            "eos_token_id": self.eos,
            "pad_token_id": PAD_ID,
            "add_bos_token": false,
            "add_eos_token": false,
            "clean_up_tokenization_spaces": false,
            "chat_template": CHAT_TEMPLATE_JINJA,
            "model_max_length": model_max_length,
        })
    }

    /// `encode(text, add_special_tokens=false)` ids; special tokens written in `text` are
    /// recognised (the ChatML template relies on it).
    ///
    /// Text in printable ASCII takes the fast path ([`ascii`]); other text is cut at spaces
    /// where cutting changes no id ([`ascii::can_cut`]) and only the stretches around the
    /// characters the fast path declines go through the full pipeline (web text's curly
    /// apostrophes and dashes would otherwise send whole documents there). Text holding added
    /// tokens is cut at them first ([`added`]), so a ChatML prompt of 2,000 tokens takes the
    /// fast path too (0.11 ms against 3.4 ms through the full pipeline on a 2-core VM,
    /// `nsactor bench host`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let Some(fast) = &self.ascii else {
            return self.encode_unoptimised(text);
        };
        let mut ids = Vec::with_capacity(text.len() / 3);
        if let Some(r) = fast.encode(self.inner.get_model(), text, &mut ids) {
            r.map_err(|e| self.err(format!("cannot encode: {e}")))?;
            return Ok(ids);
        }
        if fast.has_added(text) {
            // A ChatML text: the pieces between its added tokens go the fast way.
            let Some(split) = &self.added else {
                return self.encode_unoptimised(text);
            };
            for piece in split.pieces(text) {
                match piece {
                    added::Piece::Text(t) => self.encode_plain(fast, t, &mut ids)?,
                    added::Piece::Added(id) => ids.push(id),
                }
            }
            return Ok(ids);
        }
        self.encode_stretches(fast, text, &mut ids)?;
        Ok(ids)
    }

    /// Appends the ids of `text`, which holds no added token: the fast way where it is all
    /// ASCII, else [`encode_stretches`](Self::encode_stretches).
    fn encode_plain(&self, fast: &ascii::AsciiBpe, text: &str, ids: &mut Vec<u32>) -> Result<()> {
        match fast.encode(self.inner.get_model(), text, ids) {
            Some(r) => r.map_err(|e| self.err(format!("cannot encode: {e}"))),
            None => self.encode_stretches(fast, text, ids),
        }
    }

    /// Appends the ids of `text`, which holds no added token and some character the fast path
    /// declines: ASCII stretches the fast way, the stretches around the others through the
    /// full pipeline.
    fn encode_stretches(
        &self,
        fast: &ascii::AsciiBpe,
        text: &str,
        ids: &mut Vec<u32>,
    ) -> Result<()> {
        let b = text.as_bytes();
        let (mut start, mut pos) = (0, 0);
        while let Some(k) = b[pos..].iter().position(|&c| !ascii::fast_byte(c)) {
            let mut bad = pos + k;
            // From the last cut before the declined byte to the first cut after the last
            // declined byte before it.
            let lo = (start..=bad)
                .rev()
                .find(|&i| ascii::can_cut(b, i))
                .unwrap_or(start);
            let hi = loop {
                let cut = (bad + 1..b.len())
                    .find(|&i| ascii::can_cut(b, i))
                    .unwrap_or(b.len());
                match b[bad + 1..cut].iter().rposition(|&c| !ascii::fast_byte(c)) {
                    Some(j) => bad += 1 + j,
                    None => break cut,
                }
            };
            // Cuts are at ASCII spaces: char boundaries.
            self.encode_part(fast, &text[start..lo], ids)?;
            fast.stretch(&text[lo..hi], ids, |t| self.encode_unoptimised(t))?;
            (start, pos) = (hi, hi);
        }
        self.encode_part(fast, &text[start..], ids)
    }

    /// `part`'s ids appended to `ids`, the fast way when it takes it.
    fn encode_part(&self, fast: &ascii::AsciiBpe, part: &str, ids: &mut Vec<u32>) -> Result<()> {
        match fast.encode(self.inner.get_model(), part, ids) {
            Some(r) => r.map_err(|e| self.err(format!("cannot encode: {e}"))),
            None => {
                ids.extend(self.encode_unoptimised(part)?);
                Ok(())
            }
        }
    }

    /// Whether [`encode`](Self::encode) has the ASCII fast path for this tokenizer.
    pub fn has_fast_path(&self) -> bool {
        self.ascii.is_some()
    }

    /// Text of `ids`; with `skip_special_tokens` the specials are dropped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.err(format!("cannot decode: {e}")))
    }

    /// Decodes generated tokens one at a time, at the same cost at any length
    /// ([`TextStream`]).
    pub fn text_stream(&self, skip_special_tokens: bool) -> TextStream<'_> {
        TextStream::new(self, skip_special_tokens)
    }

    /// The `tokenizer.json` text.
    pub fn to_json(&self, pretty: bool) -> Result<String> {
        self.inner
            .to_string(pretty)
            .map_err(|e| self.err(format!("cannot serialise: {e}")))
    }

    /// Writes the `tokenizer.json` (pretty-printed, as the reference file is).
    pub fn save(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_json(true)?).map_err(|e| DataError::write(path, e))
    }

    /// Encoding through the full pipeline, normalizer included (the reference path; tests
    /// compare it with [`encode`](Self::encode)).
    pub fn encode_unoptimised(&self, text: &str) -> Result<Vec<u32>> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| self.err(format!("cannot encode: {e}")))
    }

    /// [`encode`](Self::encode)'s ids, each with the characters of `text` it stands for
    /// (`start..end`, counted in `char`s; a byte-level piece of a character spans all of it).
    /// Through the full pipeline, so slower than `encode`: for analysis, not for data.
    pub fn encode_with_spans(&self, text: &str) -> Result<Vec<(u32, std::ops::Range<usize>)>> {
        let e = self
            .inner
            .encode_char_offsets(text, false)
            .map_err(|e| self.err(format!("cannot encode: {e}")))?;
        Ok(e.get_ids()
            .iter()
            .zip(e.get_offsets())
            .map(|(&id, &(a, b))| (id, a..b))
            .collect())
    }

    fn err(&self, msg: String) -> DataError {
        DataError::Tokenizer {
            origin: self.origin.clone(),
            msg,
        }
    }
}

/// Trains a byte-level BPE the way the reference's was (SPEC §9): NFKC, GPT-2 byte-level
/// pre-tokenizer (no prefix space), byte-level decoder, no post-processor, `min_frequency` 2, the
/// full 256-byte alphabet, and [`SPECIALS`] as ids 0–4.
pub fn train<I, S>(documents: I, vocab_size: usize) -> Result<Tokenizer>
where
    I: Iterator<Item = S> + Send,
    S: AsRef<str> + Send,
{
    let alphabet = 256 + SPECIALS.len();
    if vocab_size < alphabet {
        return Err(DataError::Invalid(format!(
            "--vocab-size {vocab_size} is below the {alphabet} ids of the byte alphabet and specials"
        )));
    }
    let err = |e: Box<dyn std::error::Error + Send + Sync>| DataError::Tokenizer {
        origin: "training".into(),
        msg: e.to_string(),
    };
    let model = BPE::builder()
        .unk_token(SPECIALS[0].into())
        .build()
        .map_err(err)?;
    let mut tk = tokenizers::Tokenizer::new(model);
    tk.with_normalizer(Some(NormalizerWrapper::from(NFKC)));
    tk.with_pre_tokenizer(Some(PreTokenizerWrapper::from(ByteLevel::new(
        false, true, true,
    ))));
    tk.with_decoder(Some(DecoderWrapper::from(ByteLevel::default())));
    let trainer = BpeTrainer::builder()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(
            SPECIALS
                .iter()
                .map(|s| AddedToken::from(*s, true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut trainer = TrainerWrapper::from(trainer);
    tk.train(&mut trainer, documents).map_err(err)?;
    for (id, s) in SPECIALS.iter().enumerate() {
        if tk.token_to_id(s) != Some(id as u32) {
            return Err(DataError::Invalid(format!(
                "trained tokenizer put {s} at {:?}, expected {id}",
                tk.token_to_id(s)
            )));
        }
    }
    Tokenizer::wrap(tk, "trained tokenizer")
}

/// One chat message; `role` is `system`, `user` or `assistant`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// [`chat_template`] as the Jinja template of a Hugging Face `tokenizer_config.json`
/// (`transformers`' `apply_chat_template`, vLLM, lm-evaluation-harness read it): the same text
/// for the same messages.
pub const CHAT_TEMPLATE_JINJA: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The reference's ChatML template (SPEC §9): `<|im_start|>{role}\n{content}<|im_end|>\n` per
/// message, then `<|im_start|>assistant\n` if `add_generation_prompt`.
pub fn chat_template(messages: &[Message], add_generation_prompt: bool) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str(BOS_TOKEN);
        s.push_str(&m.role);
        s.push('\n');
        s.push_str(&m.content);
        s.push_str(EOS_TOKEN);
        s.push('\n');
    }
    if add_generation_prompt {
        s.push_str(BOS_TOKEN);
        s.push_str("assistant\n");
    }
    s
}
