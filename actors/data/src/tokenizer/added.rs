//! Text cut at the tokenizer's added tokens, so that a ChatML prompt (which holds
//! `<|im_start|>` and `<|im_end|>`) still takes the ASCII fast path between them.
//!
//! The general pipeline first cuts the text at the added tokens it matches on the raw text
//! (leftmost, then longest, as an Aho–Corasick automaton in that mode does), then normalizes,
//! pre-tokenizes and encodes each piece between them on its own. For tokens without
//! `single_word`, `lstrip` or `rstrip` that are matched before normalization, the ids of the
//! whole are therefore the ids of each piece with each token's id between them; this module
//! makes those cuts. A tokenizer with any other kind of added token gets `None` from
//! [`AddedSplit::new`], and its texts with added tokens keep going the general way.
//! Tests compare the result with the full pipeline (`tests/tokenizer.rs`).

/// A piece of a text cut at added tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    /// Text between added tokens (never empty, holding no added token).
    Text(&'a str),
    /// An added token's id.
    Added(u32),
}

/// The added tokens a text may be cut at.
#[derive(Debug, Clone)]
pub(crate) struct AddedSplit {
    /// Contents and ids, longest first (so the first match at a position is the longest).
    tokens: Vec<(String, u32)>,
}

impl AddedSplit {
    /// `Some` when every added token is matched on the raw text with no neighbour rules: not
    /// normalized, no `single_word`, `lstrip` or `rstrip`, non-empty and without whitespace
    /// (the fast path cuts text at spaces, which must never split one).
    pub(crate) fn new(tk: &tokenizers::Tokenizer) -> Option<Self> {
        let mut tokens = Vec::new();
        for (id, t) in tk.get_added_tokens_decoder() {
            let plain = !t.normalized
                && !t.single_word
                && !t.lstrip
                && !t.rstrip
                && !t.content.is_empty()
                && !t.content.contains(char::is_whitespace);
            if !plain {
                return None;
            }
            tokens.push((t.content, id));
        }
        tokens.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        Some(AddedSplit { tokens })
    }

    /// The pieces of `text` in order: the text between matches and the matched tokens' ids.
    pub(crate) fn pieces<'a>(&'a self, text: &'a str) -> Pieces<'a> {
        Pieces {
            split: self,
            text,
            at: 0,
            next: vec![Next::Unknown; self.tokens.len()],
            pending: None,
        }
    }
}

/// Where a token next occurs at or after the cursor, as last searched.
#[derive(Debug, Clone, Copy)]
enum Next {
    Unknown,
    At(usize),
    Never,
}

/// Iterator over a text's [`Piece`]s (see [`AddedSplit::pieces`]). Each token's next
/// occurrence is searched again only once the cursor has passed it, so a text is scanned about
/// once per token whatever the number of matches.
pub(crate) struct Pieces<'a> {
    split: &'a AddedSplit,
    text: &'a str,
    at: usize,
    next: Vec<Next>,
    /// A matched token's id and end, to return after the text before it.
    pending: Option<(u32, usize)>,
}

impl<'a> Pieces<'a> {
    /// The leftmost match at or after the cursor (the longest there): start, end, id.
    fn find(&mut self) -> Option<(usize, usize, u32)> {
        let mut best: Option<(usize, usize, u32)> = None;
        for (i, (content, id)) in self.split.tokens.iter().enumerate() {
            let start = match self.next[i] {
                Next::At(p) if p >= self.at => p,
                Next::Never => continue,
                _ => match self.text[self.at..].find(content.as_str()) {
                    Some(p) => {
                        self.next[i] = Next::At(self.at + p);
                        self.at + p
                    }
                    None => {
                        self.next[i] = Next::Never;
                        continue;
                    }
                },
            };
            // Longest first: a later token wins only by starting earlier.
            if best.is_none_or(|(s, _, _)| start < s) {
                best = Some((start, start + content.len(), *id));
            }
        }
        best
    }
}

impl<'a> Iterator for Pieces<'a> {
    type Item = Piece<'a>;

    fn next(&mut self) -> Option<Piece<'a>> {
        if let Some((id, end)) = self.pending.take() {
            self.at = end;
            return Some(Piece::Added(id));
        }
        if self.at >= self.text.len() {
            return None;
        }
        match self.find() {
            Some((start, end, id)) if start == self.at => {
                self.at = end;
                Some(Piece::Added(id))
            }
            Some((start, end, id)) => {
                let before = &self.text[self.at..start];
                self.pending = Some((id, end));
                self.at = start;
                Some(Piece::Text(before))
            }
            None => {
                let rest = &self.text[self.at..];
                self.at = self.text.len();
                Some(Piece::Text(rest))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(tokens: &[(&str, u32)], text: &str) -> Vec<String> {
        let s = AddedSplit {
            tokens: {
                let mut t: Vec<(String, u32)> =
                    tokens.iter().map(|(c, i)| (c.to_string(), *i)).collect();
                t.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
                t
            },
        };
        s.pieces(text)
            .map(|p| match p {
                Piece::Text(t) => format!("t:{t}"),
                Piece::Added(id) => format!("#{id}"),
            })
            .collect()
    }

    #[test]
    fn cuts_leftmost_then_longest() {
        let toks = [
            ("<s>", 1),
            ("</s>", 2),
            ("<|im_start|>", 3),
            ("<|im_end|>", 4),
        ];
        assert_eq!(
            split(&toks, "<|im_start|>user\nhi<|im_end|>\n"),
            ["#3", "t:user\nhi", "#4", "t:\n"]
        );
        assert_eq!(split(&toks, "plain"), ["t:plain"]);
        assert_eq!(split(&toks, ""), Vec::<String>::new());
        assert_eq!(split(&toks, "<s><s></s>x"), ["#1", "#1", "#2", "t:x"]);
        assert_eq!(split(&toks, "<|im_<|im_end|>"), ["t:<|im_", "#4"]);
        // Overlapping candidates: the one starting first wins, then the longest there.
        assert_eq!(split(&[("ab", 1), ("bcd", 2)], "abcd"), ["#1", "t:cd"]);
        assert_eq!(
            split(&[("ab", 1), ("abc", 2)], "xabcab"),
            ["t:x", "#2", "#1"]
        );
        // A token found before the cursor moved past it is searched again.
        assert_eq!(
            split(&[("aa", 1), ("b", 2)], "aaab aa"),
            ["#1", "t:a", "#2", "t: ", "#1"]
        );
    }
}
