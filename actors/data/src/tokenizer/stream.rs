//! Text of generated tokens one token at a time ([`TextStream`]), for a server's deltas.
//!
//! Decoding the whole generation again at every token costs O(n) a token, O(n²) a generation.
//! HF `tokenizers`' `DecodeStream` decodes only a short window of recent tokens (the text
//! before them kept as the prefix to strip), the incremental detokenizing vLLM and TGI do, so
//! a token costs the same at any length. Its pieces concatenate to the whole decode; a
//! character still incomplete at the end is held back until [`TextStream::finish`].

use super::Tokenizer;
use crate::error::Result;
use tokenizers::{
    DecodeStream, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    PreTokenizerWrapper,
};

type Window<'a> = DecodeStream<
    'a,
    ModelWrapper,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

/// Generated tokens in, their text out piece by piece ([`Tokenizer::text_stream`]).
pub struct TextStream<'a> {
    tok: &'a Tokenizer,
    skip_special_tokens: bool,
    /// The window decoder; `None` after it failed, when every step decodes the whole sequence.
    window: Option<Window<'a>>,
    /// Every id stepped, for [`finish`](Self::finish) and the whole-sequence fallback.
    ids: Vec<u32>,
    /// Bytes of text returned so far.
    returned: usize,
}

impl<'a> TextStream<'a> {
    pub(super) fn new(tok: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        TextStream {
            tok,
            skip_special_tokens,
            window: Some(tok.inner.decode_stream(skip_special_tokens)),
            ids: Vec::new(),
            returned: 0,
        }
    }

    /// The text `id` adds: `None` while nothing new is complete (a character still missing
    /// bytes, or a token that decodes to nothing).
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        if let Some(w) = &mut self.window {
            match w.step(id) {
                Ok(piece) => {
                    self.returned += piece.as_ref().map_or(0, String::len);
                    return Ok(piece);
                }
                // Its pieces no longer line up (a decoder that rewrites earlier text): the
                // whole sequence from here on, as before the stream existed.
                Err(e) => {
                    tracing::debug!("incremental detokenizing gave up ({e}); decoding whole");
                    self.window = None;
                }
            }
        }
        let text = self.tok.decode(&self.ids, self.skip_special_tokens)?;
        if text.ends_with('\u{FFFD}') || text.len() <= self.returned {
            return Ok(None);
        }
        let Some(piece) = text.get(self.returned..) else {
            return Ok(None);
        };
        let piece = piece.to_string();
        self.returned = text.len();
        Ok(Some(piece))
    }

    /// What the tokens stepped decode to beyond the text returned: a character left
    /// incomplete at the end (as the replacement character), or nothing. One decode of the
    /// whole sequence.
    pub fn finish(&self) -> Result<String> {
        let text = self.tok.decode(&self.ids, self.skip_special_tokens)?;
        Ok(text.get(self.returned..).unwrap_or("").to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces of every prefix of `ids`, concatenated, equal the whole decode once finished:
    /// through the window, and through the whole-sequence fallback.
    fn check(tok: &Tokenizer, ids: &[u32]) {
        for (skip, window) in [(true, true), (false, true), (true, false), (false, false)] {
            let mut s = tok.text_stream(skip);
            if !window {
                s.window = None;
            }
            let mut text = String::new();
            for &id in ids {
                if let Some(p) = s.step(id).unwrap() {
                    assert!(!p.is_empty());
                    text.push_str(&p);
                }
            }
            text.push_str(&s.finish().unwrap());
            let whole = tok.decode(ids, skip).unwrap();
            assert_eq!(text, whole, "{ids:?} skip {skip} window {window}");
        }
    }

    #[test]
    fn pieces_add_up_to_the_whole_decode() {
        let tok = Tokenizer::bundled();
        let text = "Emma Woodhouse, handsome, clever, and rich — «café» 東京 🙂\n\n<|im_end|> end";
        let ids = tok.encode(text).unwrap();
        check(&tok, &ids);
        // Every id of the vocabulary in a pseudo-random order: byte pieces that do not form
        // characters, specials, spaces.
        let n = tok.vocab_size() as u64;
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let ids: Vec<u32> = (0..3 * n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % n) as u32
            })
            .collect();
        check(&tok, &ids);
    }

    #[test]
    fn an_incomplete_character_is_held_back_until_finish() {
        let tok = Tokenizer::bundled();
        let ids = tok.encode("東").unwrap();
        assert!(
            ids.len() > 1,
            "the bundled tokenizer spells 東 in byte pieces: {ids:?}"
        );
        let mut s = tok.text_stream(true);
        for &id in &ids[..ids.len() - 1] {
            assert_eq!(s.step(id).unwrap(), None);
        }
        assert_eq!(s.finish().unwrap(), "\u{FFFD}");
        assert_eq!(s.step(*ids.last().unwrap()).unwrap().as_deref(), Some("東"));
        assert_eq!(s.finish().unwrap(), "");
    }
}
