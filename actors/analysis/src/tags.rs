//! Token categories without a trained English tagger. A sentence is cut into words and tagged
//! by jieba (its dictionary and HMM, the segmenter and part-of-speech tags the paper's authors
//! used for Chinese); Chinese words take their category from jieba's tag, English words
//! (jieba's `eng`) from a closed-class word list: function word if listed, content word
//! otherwise. Punctuation and numbers are recognised by their characters. A token takes the
//! category of the word its first non-space character belongs to. For English this is a
//! heuristic stand-in for part-of-speech tagging, and says so in the README.

use jieba_rs::Jieba;
use serde::Serialize;
use std::ops::Range;
use std::sync::OnceLock;

/// What a token is, for the E[K]-by-category figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// The beginning-of-sequence sentinel every analysed sentence starts with.
    Bos,
    /// Another special token written in the text.
    Special,
    Punctuation,
    Number,
    /// Closed-class words: determiners, pronouns, prepositions, conjunctions, auxiliaries,
    /// particles (English list; jieba's p, c, u*, r*, y, e, o, q, f, k tags).
    Function,
    /// Chinese nouns (jieba n*).
    Noun,
    /// Chinese verbs (jieba v*).
    Verb,
    /// Chinese adjectives (jieba a*).
    Adjective,
    /// Other content words: every English open-class word (no tagger tells noun from verb)
    /// and Chinese words with other tags (adverbs, idioms, times, places, …).
    Content,
    /// Whitespace and anything else.
    Other,
}

impl Category {
    pub const ALL: [Category; 10] = [
        Category::Bos,
        Category::Special,
        Category::Punctuation,
        Category::Number,
        Category::Function,
        Category::Noun,
        Category::Verb,
        Category::Adjective,
        Category::Content,
        Category::Other,
    ];

    /// The name used in `analysis.json` and on the charts.
    pub fn name(self) -> &'static str {
        match self {
            Category::Bos => "bos",
            Category::Special => "special",
            Category::Punctuation => "punctuation",
            Category::Number => "number",
            Category::Function => "function",
            Category::Noun => "noun",
            Category::Verb => "verb",
            Category::Adjective => "adjective",
            Category::Content => "content",
            Category::Other => "other",
        }
    }
}

/// English closed-class words (lower case).
const EN_FUNCTION: &[&str] = &[
    "a",
    "an",
    "the",
    "this",
    "that",
    "these",
    "those",
    "some",
    "any",
    "each",
    "every",
    "no",
    "all",
    "both",
    "either",
    "neither",
    "such",
    "what",
    "which",
    "whose",
    "i",
    "me",
    "my",
    "mine",
    "we",
    "us",
    "our",
    "ours",
    "you",
    "your",
    "yours",
    "he",
    "him",
    "his",
    "she",
    "her",
    "hers",
    "it",
    "its",
    "they",
    "them",
    "their",
    "theirs",
    "myself",
    "yourself",
    "himself",
    "herself",
    "itself",
    "ourselves",
    "themselves",
    "who",
    "whom",
    "there",
    "here",
    "of",
    "in",
    "on",
    "at",
    "by",
    "for",
    "with",
    "about",
    "against",
    "between",
    "into",
    "through",
    "during",
    "before",
    "after",
    "above",
    "below",
    "to",
    "from",
    "up",
    "down",
    "out",
    "off",
    "over",
    "under",
    "again",
    "than",
    "as",
    "until",
    "while",
    "since",
    "upon",
    "within",
    "without",
    "across",
    "along",
    "among",
    "around",
    "behind",
    "beyond",
    "near",
    "toward",
    "towards",
    "via",
    "and",
    "or",
    "but",
    "nor",
    "so",
    "yet",
    "if",
    "because",
    "although",
    "though",
    "unless",
    "whether",
    "when",
    "where",
    "why",
    "how",
    "then",
    "be",
    "am",
    "is",
    "are",
    "was",
    "were",
    "been",
    "being",
    "have",
    "has",
    "had",
    "having",
    "do",
    "does",
    "did",
    "will",
    "would",
    "shall",
    "should",
    "can",
    "could",
    "may",
    "might",
    "must",
    "not",
    "n't",
    "'s",
    "'re",
    "'ve",
    "'ll",
    "'d",
    "'m",
    "just",
    "very",
    "too",
    "also",
    "only",
    "own",
    "same",
    "other",
    "more",
    "most",
    "much",
    "many",
    "few",
    "less",
    "least",
];

/// jieba tags of closed-class words.
fn jieba_function(tag: &str) -> bool {
    matches!(
        tag.as_bytes().first(),
        Some(b'p' | b'c' | b'u' | b'r' | b'y' | b'e' | b'o')
    ) || matches!(tag, "q" | "f" | "k")
}

fn is_punctuation(c: char) -> bool {
    c.is_ascii_punctuation()
        || matches!(c,
            '\u{2000}'..='\u{206f}' // general punctuation: dashes, quotes, ellipsis
            | '\u{3000}'..='\u{303f}' // CJK punctuation: 。、「」
            | '\u{ff01}'..='\u{ff0f}' | '\u{ff1a}'..='\u{ff20}' | '\u{ff3b}'..='\u{ff40}'
            | '\u{ff5b}'..='\u{ff65}' // full-width forms: ，！？：；（）
            | '\u{00a1}'..='\u{00bf}')
}

fn jieba() -> &'static Jieba {
    static J: OnceLock<Jieba> = OnceLock::new();
    J.get_or_init(Jieba::new)
}

/// The category of one word (as jieba cut it) with jieba's `tag`.
pub fn word_category(word: &str, tag: &str) -> Category {
    let visible: Vec<char> = word.chars().filter(|c| !c.is_whitespace()).collect();
    if visible.is_empty() {
        return Category::Other;
    }
    if visible.iter().all(|&c| is_punctuation(c)) {
        return Category::Punctuation;
    }
    if visible
        .iter()
        .all(|c| c.is_numeric() || matches!(c, '.' | ',' | '%'))
        || tag == "m" && visible.iter().any(|c| c.is_numeric())
    {
        return Category::Number;
    }
    if tag == "eng" || visible.iter().all(|c| c.is_ascii()) {
        let lower = word.trim().to_lowercase();
        return if EN_FUNCTION.contains(&lower.as_str()) {
            Category::Function
        } else if visible.iter().any(|c| c.is_alphabetic()) {
            Category::Content
        } else {
            Category::Other
        };
    }
    if jieba_function(tag) {
        return Category::Function;
    }
    match tag.as_bytes().first() {
        Some(b'n') => Category::Noun,
        Some(b'v') => Category::Verb,
        Some(b'a') => Category::Adjective,
        Some(b'm') => Category::Number,
        Some(b'x' | b'w') => Category::Other,
        _ => Category::Content,
    }
}

/// The words of `text` as `(characters, category)`, in order, covering all of it.
pub fn words(text: &str) -> Vec<(Range<usize>, Category)> {
    let mut at = 0;
    jieba()
        .tag(text, true)
        .into_iter()
        .map(|t| {
            let n = t.word.chars().count();
            let span = at..at + n;
            at += n;
            (span, word_category(t.word, t.tag))
        })
        .collect()
}

/// The category of each token of `text` from its character span (`spans` as
/// [`nsactor_data::Tokenizer::encode_with_spans`] gives them); `special` says whether a token
/// id is a special token.
pub fn token_categories(text: &str, spans: &[Range<usize>], special: &[bool]) -> Vec<Category> {
    let words = words(text);
    let chars: Vec<char> = text.chars().collect();
    spans
        .iter()
        .zip(special)
        .map(|(span, &is_special)| {
            if is_special {
                return Category::Special;
            }
            let first = (span.start..span.end).find(|&i| !chars[i].is_whitespace());
            let Some(first) = first else {
                return Category::Other;
            };
            words
                .iter()
                .find(|(w, _)| w.contains(&first))
                .map_or(Category::Other, |(_, c)| *c)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn english_words_are_function_or_content_and_marks_are_punctuation() {
        let cats: Vec<_> = words("The cat sat on 3 mats.")
            .into_iter()
            .map(|(_, c)| c)
            .filter(|&c| c != Category::Other)
            .collect();
        use Category::*;
        assert_eq!(
            cats,
            [
                Function,
                Content,
                Content,
                Function,
                Number,
                Content,
                Punctuation
            ]
        );
    }

    #[test]
    fn chinese_words_take_jieba_part_of_speech() {
        let w = words("我们在学校里学习了很多有趣的科学知识。");
        let text: Vec<char> = "我们在学校里学习了很多有趣的科学知识。".chars().collect();
        let get = |word: &str| {
            w.iter()
                .find(|(s, _)| text[s.clone()].iter().collect::<String>() == word)
                .map(|(_, c)| *c)
        };
        assert_eq!(get("我们"), Some(Category::Function));
        assert_eq!(get("学校"), Some(Category::Noun));
        assert_eq!(get("学习"), Some(Category::Verb));
        assert_eq!(get("有趣"), Some(Category::Adjective));
        assert_eq!(get("的"), Some(Category::Function));
        assert_eq!(get("。"), Some(Category::Punctuation));
        assert_eq!(w.last().unwrap().0.end, text.len());
    }

    #[test]
    fn a_token_takes_the_word_of_its_first_visible_character() {
        let text = "The cat, 的";
        let spans = [0..3, 3..7, 7..8, 8..10, 0..0];
        let special = [false, false, false, false, true];
        use Category::*;
        assert_eq!(
            token_categories(text, &spans, &special),
            [Function, Content, Punctuation, Function, Special]
        );
    }
}
