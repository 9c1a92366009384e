//! A fast path for encoding ASCII text with a GPT-2-style byte-level BPE.
//!
//! The general pipeline (`tokenizers::Tokenizer::encode`) allocates per token (token strings,
//! offsets, alignments), which dominates the cost of `nsactor data prepare` on English text.
//! For text that is plain printable ASCII (plus `\t`, `\n`, `\r`) and contains no added token,
//! every Unicode normal form is the identity, the GPT-2 split regex reduces to the byte classes
//! below, and the result is the concatenation of the BPE of each piece. This module computes
//! exactly that with a per-thread word cache, and declines (returns `None`) for anything else.
//! [`can_cut`] says where other text may be cut so that only the stretches around the
//! characters it declines go the general way (`Tokenizer::encode`).
//! Tests compare it with the full pipeline on the bundled corpus and on random tricky strings.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use tokenizers::{
    Model, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
};

/// Whether a tokenizer qualifies, and what to watch for in the text.
#[derive(Debug, Clone)]
pub(crate) struct AsciiBpe {
    /// Contents of the added tokens; text containing one goes the general way.
    added: Vec<String>,
    /// Identifies the tokenizer's word cache (clones share it: same content).
    id: u64,
}

/// Bytes the fast path takes: printable ASCII, `\t`, `\n`, `\r`.
pub(crate) fn fast_byte(b: u8) -> bool {
    (0x20..0x7f).contains(&b) || matches!(b, b'\t' | b'\n' | b'\r')
}

/// Where text may be cut so that the pipeline's ids of the whole are those of the two parts
/// put together: at a space between two printable ASCII characters that are not spaces
/// (`"a| b"`). No pre-tokenizer piece of the GPT-2 regex spans a non-space followed by a space
/// (`\s+(?!\S)` looks ahead only, and only from whitespace), and a Unicode normal form composes
/// nothing across an ASCII space, so both parts are normalized and split as within the whole.
pub(crate) fn can_cut(b: &[u8], i: usize) -> bool {
    i > 0
        && i + 1 < b.len()
        && b[i] == b' '
        && b[i - 1].is_ascii_graphic()
        && b[i + 1].is_ascii_graphic()
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// Words cached per thread before the cache is cleared.
const CACHE_CAP: usize = 1 << 19;

/// Pieces of up to 16 bytes keyed by their bytes as one zero-padded integer (no piece holds a
/// zero byte, so the padding is unambiguous): a hit is two multiplies and one compare, where a
/// byte-slice key costs a hash over the bytes and a `memcmp` (most of the encoding's time).
/// Longer pieces keep their bytes as the key.
#[derive(Default)]
struct Cache {
    short: HashMap<u128, Box<[u32]>, BuildHasherDefault<FxHasher>>,
    long: HashMap<Box<[u8]>, Box<[u32]>, BuildHasherDefault<FxHasher>>,
}

impl Cache {
    fn len(&self) -> usize {
        self.short.len() + self.long.len()
    }

    fn clear(&mut self) {
        self.short.clear();
        self.long.clear();
    }

    /// The short key of `piece`, if it has one.
    fn key(piece: &[u8]) -> Option<u128> {
        (piece.len() <= 16).then(|| {
            let mut w = [0u8; 16];
            w[..piece.len()].copy_from_slice(piece);
            u128::from_le_bytes(w)
        })
    }

    fn get(&self, piece: &[u8]) -> Option<&[u32]> {
        match Self::key(piece) {
            Some(k) => self.short.get(&k),
            None => self.long.get(piece),
        }
        .map(|ids| &ids[..])
    }

    fn insert(&mut self, piece: &[u8], ids: Box<[u32]>) {
        match Self::key(piece) {
            Some(k) => self.short.insert(k, ids),
            None => self.long.insert(piece.into(), ids),
        };
    }
}

/// Stretches cached per thread before the cache is cleared, and the longest one cached.
const STRETCH_CAP: usize = 1 << 16;
const STRETCH_MAX: usize = 64;

type StretchCache = HashMap<Box<str>, Box<[u32]>, BuildHasherDefault<FxHasher>>;

thread_local! {
    static CACHE: RefCell<(u64, Cache)> = RefCell::new((0, Cache::default()));
    static STRETCHES: RefCell<(u64, StretchCache)> = RefCell::new((0, StretchCache::default()));
}

impl AsciiBpe {
    /// `Some` when `tk` is a byte-level BPE this path reproduces: normalizer absent or a Unicode
    /// normal form, `ByteLevel` pre-tokenizer with the GPT-2 regex and no prefix space, a BPE
    /// without dropout, and no post-processor (or a `ByteLevel` one, which only trims offsets).
    pub(crate) fn new(tk: &tokenizers::Tokenizer) -> Option<Self> {
        let norm_ok = matches!(
            tk.get_normalizer(),
            None | Some(
                NormalizerWrapper::NFC(_)
                    | NormalizerWrapper::NFD(_)
                    | NormalizerWrapper::NFKC(_)
                    | NormalizerWrapper::NFKD(_)
            )
        );
        let pre_ok = matches!(tk.get_pre_tokenizer(),
            Some(PreTokenizerWrapper::ByteLevel(b)) if !b.add_prefix_space && b.use_regex);
        let model_ok = matches!(tk.get_model(), ModelWrapper::BPE(b) if b.dropout.is_none());
        let post_ok = matches!(
            tk.get_post_processor(),
            None | Some(PostProcessorWrapper::ByteLevel(_))
        );
        let added: Vec<String> = tk
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect();
        (norm_ok && pre_ok && model_ok && post_ok && added.len() <= 64).then(|| AsciiBpe {
            added,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Appends the ids of `text` to `out`, or returns `None` (leaving `out` as it was) when the
    /// text needs the general pipeline.
    /// Whether `text` holds one of the tokenizer's added tokens (which the fast path leaves to
    /// the general one), or an added token could straddle a split at a space.
    pub(crate) fn has_added(&self, text: &str) -> bool {
        self.added
            .iter()
            .any(|a| text.contains(a.as_str()) || a.contains(char::is_whitespace))
    }

    /// Appends the ids of `stretch`, text between two cuts ([`can_cut`]) that the fast path
    /// declines: from a per-thread cache (web text repeats its ` don’t` and ` —`), or from
    /// `encode`, the full pipeline, then cached when short.
    pub(crate) fn stretch<E>(
        &self,
        stretch: &str,
        out: &mut Vec<u32>,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, E>,
    ) -> Result<(), E> {
        let short = stretch.len() <= STRETCH_MAX;
        let hit = short
            && STRETCHES.with(|c| {
                let mut c = c.borrow_mut();
                let (owner, cache) = &mut *c;
                if *owner != self.id || cache.len() > STRETCH_CAP {
                    cache.clear();
                    *owner = self.id;
                }
                cache
                    .get(stretch)
                    .map(|ids| out.extend_from_slice(ids))
                    .is_some()
            });
        if hit {
            return Ok(());
        }
        // Encoded outside the cache's borrow: nothing the pipeline runs can find it taken.
        let ids = encode(stretch)?;
        out.extend_from_slice(&ids);
        if short {
            STRETCHES.with(|c| c.borrow_mut().1.insert(stretch.into(), ids.into()));
        }
        Ok(())
    }

    pub(crate) fn encode(
        &self,
        model: &ModelWrapper,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Option<tokenizers::Result<()>> {
        let bytes = text.as_bytes();
        if !bytes.iter().all(|&b| fast_byte(b))
            || self.added.iter().any(|a| text.contains(a.as_str()))
        {
            return None;
        }
        CACHE.with(|c| {
            let mut c = c.borrow_mut();
            let (owner, cache) = &mut *c;
            if *owner != self.id || cache.len() > CACHE_CAP {
                cache.clear();
                *owner = self.id;
            }
            let mut mapped = String::new();
            for piece in (Pieces { b: bytes, i: 0 }) {
                if let Some(ids) = cache.get(piece) {
                    out.extend_from_slice(ids);
                    continue;
                }
                mapped.clear();
                mapped.extend(piece.iter().map(|&b| byte_char(b)));
                let ids: Box<[u32]> = match model.tokenize(&mapped) {
                    Ok(toks) => toks.iter().map(|t| t.id).collect(),
                    Err(e) => return Some(Err(e)),
                };
                out.extend_from_slice(&ids);
                cache.insert(piece, ids);
            }
            Some(Ok(()))
        })
    }
}

/// GPT-2's byte → printable char map, for the ASCII bytes this path admits.
fn byte_char(b: u8) -> char {
    match b {
        b'!'..=b'~' => b as char,
        // Bytes 0..=32 are the first unprintables, numbered from U+0100 in order.
        0..=32 => char::from_u32(0x100 + u32::from(b)).expect("a valid char"),
        _ => unreachable!("only printable ASCII, \\t, \\n and \\r reach the fast path"),
    }
}

fn is_letter(b: u8) -> bool {
    b.is_ascii_alphabetic()
}
fn is_digit(b: u8) -> bool {
    b.is_ascii_digit()
}
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}
fn is_other(b: u8) -> bool {
    !is_letter(b) && !is_digit(b) && !is_space(b)
}

/// The pieces of the GPT-2 regex
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
/// on ASCII, where `\p{L}` is `[A-Za-z]`, `\p{N}` is `[0-9]` and `\s` is `[ \t\n\r]`;
/// alternatives are tried in order at each position, as the regex engine does.
struct Pieces<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Iterator for Pieces<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let (b, i, n) = (self.b, self.i, self.b.len());
        if i >= n {
            return None;
        }
        let run = |from: usize, class: fn(u8) -> bool| {
            let mut k = from;
            while k < n && class(b[k]) {
                k += 1;
            }
            k
        };
        let end = 'end: {
            if b[i] == b'\'' {
                for suf in [&b"s"[..], b"t", b"re", b"ve", b"m", b"ll", b"d"] {
                    if b[i + 1..].starts_with(suf) {
                        break 'end i + 1 + suf.len();
                    }
                }
            }
            let j = if b[i] == b' ' { i + 1 } else { i };
            if j < n {
                for class in [is_letter as fn(u8) -> bool, is_digit, is_other] {
                    if class(b[j]) {
                        break 'end run(j, class);
                    }
                }
            }
            // Whitespace: `\s+(?!\S)` keeps the last space for the next word when a non-space
            // follows; a lone space before a non-space falls to `\s+`.
            let k = run(i, is_space);
            if k == n || k - i == 1 { k } else { k - 1 }
        };
        self.i = end;
        Some(&b[i..end])
    }
}

/// The Fx hash (rustc's): fast for short keys, and the cache holds no adversarial input.
#[derive(Default)]
pub(crate) struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.0 =
                (self.0.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn write_u64(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn write_u128(&mut self, w: u128) {
        self.write_u64(w as u64);
        self.write_u64((w >> 64) as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &str) -> Vec<&str> {
        Pieces {
            b: s.as_bytes(),
            i: 0,
        }
        .map(|p| std::str::from_utf8(p).unwrap())
        .collect()
    }

    #[test]
    fn pieces_follow_the_gpt2_regex() {
        assert_eq!(split("Hello, world!"), ["Hello", ",", " world", "!"]);
        assert_eq!(split("don't 'Tis"), ["don", "'t", " '", "Tis"]);
        assert_eq!(split("a  b"), ["a", " ", " b"]);
        assert_eq!(split("a\n\nB"), ["a", "\n", "\n", "B"]);
        assert_eq!(split("x  \n"), ["x", "  \n"]);
        assert_eq!(split(" 12ab ?!"), [" 12", "ab", " ?!"]);
        assert_eq!(split("'ll'"), ["'ll", "'"]);
        assert_eq!(split(""), Vec::<&str>::new());
    }
}
