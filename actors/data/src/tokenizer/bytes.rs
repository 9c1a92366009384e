//! A token's own bytes. A byte-level BPE (GPT-2's, the bundled tokenizer's and NeuronSpark's)
//! writes each byte as one printable character; a token that holds part of a multi-byte
//! character decodes alone to U+FFFD, but its bytes are exact, and a client that joins them
//! (OpenAI's `bytes` in chat log-probabilities) gets the character back.

use super::Tokenizer;
use tokenizers::DecoderWrapper;

/// GPT-2's byte for each character of the byte-level alphabet: printable Latin-1 stands for
/// itself, and the other 68 bytes, in order, for U+0100 onwards.
fn byte_of(c: char) -> Option<u8> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let c = c as u32;
    if printable(c) {
        return u8::try_from(c).ok();
    }
    let n = c.checked_sub(0x100)?;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .and_then(|b| u8::try_from(b).ok())
}

impl Tokenizer {
    /// The bytes token `id` stands for: a byte-level token's bytes, an added token's text.
    /// `None` for an id outside the vocabulary, or a tokenizer whose decoder is not byte-level
    /// (then only the decoded text is known).
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        if self.inner.get_added_tokens_decoder().contains_key(&id) {
            return Some(piece.into_bytes());
        }
        if !matches!(self.inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        piece.chars().map(byte_of).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alphabet_maps_back_to_every_byte_once() {
        let alphabet = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
        let mut bytes: Vec<u8> = alphabet.iter().map(|&c| byte_of(c).unwrap()).collect();
        bytes.sort_unstable();
        assert_eq!(bytes, (0..=255).collect::<Vec<u8>>());
        assert_eq!(byte_of('Ġ'), Some(b' '));
        assert_eq!(byte_of('Ċ'), Some(b'\n'));
        assert_eq!(byte_of('a'), Some(b'a'));
    }

    #[test]
    fn a_texts_tokens_give_back_its_bytes_even_inside_a_character() {
        let t = Tokenizer::bundled();
        let text = "Emma 日本 café — ok\n";
        let ids = t.encode(text).unwrap();
        let joined: Vec<u8> = ids
            .iter()
            .flat_map(|&id| t.token_bytes(id).unwrap())
            .collect();
        assert_eq!(joined, text.as_bytes());
        // Some token of the text holds part of a character (the bundled vocabulary is small):
        // alone it decodes to U+FFFD, its bytes are not those of U+FFFD.
        let partial = ids
            .iter()
            .find(|&&id| std::str::from_utf8(&t.token_bytes(id).unwrap()).is_err())
            .expect("a token inside a character");
        assert_ne!(t.token_bytes(*partial).unwrap(), "\u{fffd}".as_bytes());
        // Special tokens are their text; ids past the vocabulary have none.
        assert_eq!(
            t.token_bytes(t.eos_id()).unwrap(),
            t.decode(&[t.eos_id()], false).unwrap().as_bytes()
        );
        assert_eq!(t.token_bytes(u32::MAX), None);
    }
}
