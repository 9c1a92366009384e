//! Stop strings in a generation's growing text: where the first one starts, and how much of
//! the text's end must wait because a stop string may begin there.

/// Where the first stop string in `text` starts and its length, given that none was in its
/// first `grown` bytes: only a match ending past them is new, so only the tail is searched.
/// Of two starting at one place, the longer.
pub(super) fn first_stop(text: &str, stop: &[String], grown: usize) -> Option<(usize, usize)> {
    stop.iter()
        .filter_map(|s| {
            let from = text.floor_char_boundary(grown.saturating_sub(s.len().saturating_sub(1)));
            text[from..].find(s.as_str()).map(|p| (from + p, s.len()))
        })
        .min_by_key(|&(at, len)| (at, std::cmp::Reverse(len)))
}

/// Longest suffix of `text` that is a proper prefix of a stop string (held back: it may be the
/// start of one).
pub(super) fn held_back(text: &str, stop: &[String]) -> usize {
    let mut hold = 0;
    for s in stop {
        for (i, _) in s.char_indices().skip(1) {
            if text.ends_with(&s[..i]) {
                hold = hold.max(i);
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::{first_stop, held_back};

    /// Searching the tail finds what searching the whole text finds, as the text grows a piece
    /// at a time (pieces of several bytes, stop strings spanning pieces and characters).
    #[test]
    fn the_tail_search_finds_the_first_stop_string_as_the_whole_search_does() {
        let stop = vec!["\n\n".to_string(), "é!".to_string(), "東京".to_string()];
        let pieces = [
            "Hello", " wor", "ld\n", "\nmore", "caf", "é", "! ", "東", "京", "x\n\n",
        ];
        for skip in 0..pieces.len() {
            let mut text = String::new();
            for p in pieces.iter().skip(skip) {
                let grown = text.len();
                text.push_str(p);
                let whole = stop.iter().filter_map(|s| text.find(s.as_str())).min();
                let found = first_stop(&text, &stop, grown);
                assert_eq!(found.map(|(at, _)| at), whole, "{text:?}");
                if let Some((at, len)) = found {
                    assert!(stop.iter().any(|s| text[at..at + len] == *s));
                }
                if whole.is_some() {
                    break;
                }
            }
        }
    }

    #[test]
    fn only_possible_stop_string_starts_are_held_back() {
        let stop = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(held_back("hello\n", &stop), 1);
        assert_eq!(held_back("hello EN", &stop), 2);
        assert_eq!(held_back("hello E", &stop), 1);
        assert_eq!(held_back("hello", &stop), 0);
        assert_eq!(held_back("héllo", &["é!".to_string()]), 0);
    }
}
