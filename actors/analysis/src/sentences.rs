//! The sentences to analyse: a bundled set of 20 English and 20 Chinese sentences (science,
//! daily life, education, economics, multi-clause constructions; written for nsactor), or a
//! text file (one sentence per line) or a JSONL file (`{"text": …, "category": …}` per line,
//! `category` optional: E[K] is then also reported per category, as the paper does for its
//! question types).

use crate::error::{AnalysisError, Result};
use std::path::Path;

/// One sentence and the group it is reported under (`en`/`zh` for the bundled set, the
/// JSONL `category`, or `text`).
#[derive(Debug, Clone, PartialEq)]
pub struct Sentence {
    pub text: String,
    pub group: String,
}

fn lines(text: &str, group: &str) -> Vec<Sentence> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| Sentence {
            text: l.to_string(),
            group: group.to_string(),
        })
        .collect()
}

/// The bundled English and Chinese sentences.
pub fn bundled() -> Vec<Sentence> {
    let mut s = lines(include_str!("../sentences/en.txt"), "en");
    s.extend(lines(include_str!("../sentences/zh.txt"), "zh"));
    s
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| AnalysisError::Io(path.to_path_buf(), e))
}

fn nonempty(s: Vec<Sentence>, path: &Path) -> Result<Vec<Sentence>> {
    if s.is_empty() {
        return Err(AnalysisError::Invalid(format!(
            "{}: no sentence to analyse",
            path.display()
        )));
    }
    Ok(s)
}

/// One sentence per non-empty line of a text file.
pub fn from_text(path: &Path) -> Result<Vec<Sentence>> {
    nonempty(lines(&read(path)?, "text"), path)
}

/// One `{"text": …, "category": …}` object per non-empty line; a bad line is an error naming it.
pub fn from_jsonl(path: &Path) -> Result<Vec<Sentence>> {
    let mut out = Vec::new();
    for (i, line) in read(path)?.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |m: String| AnalysisError::Invalid(format!("{}:{}: {m}", path.display(), i + 1));
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let text = v
            .get("text")
            .and_then(|t| t.as_str())
            .filter(|t| !t.trim().is_empty())
            .ok_or_else(|| bad("needs a non-empty string \"text\"".into()))?;
        let group = match v.get("category") {
            None | Some(serde_json::Value::Null) => "text".to_string(),
            Some(serde_json::Value::String(c)) => c.clone(),
            Some(other) => return Err(bad(format!("\"category\" must be a string, got {other}"))),
        };
        out.push(Sentence {
            text: text.trim().to_string(),
            group,
        });
    }
    nonempty(out, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundled_set_has_both_languages() {
        let s = bundled();
        assert_eq!(s.iter().filter(|s| s.group == "en").count(), 20);
        assert_eq!(s.iter().filter(|s| s.group == "zh").count(), 20);
    }

    #[test]
    fn jsonl_lines_are_checked_and_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("q.jsonl");
        std::fs::write(
            &p,
            "{\"text\": \"2+2?\", \"category\": \"arithmetic\"}\n\n{\"text\": \"Hi\"}\n",
        )
        .unwrap();
        let s = from_jsonl(&p).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].group.as_str(), s[1].group.as_str()),
            ("arithmetic", "text")
        );
        std::fs::write(&p, "{\"text\": \"ok\"}\n{\"txt\": \"typo\"}\n").unwrap();
        let e = from_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains("q.jsonl:2") && e.contains("\"text\""), "{e}");
        std::fs::write(&p, "\n").unwrap();
        assert!(
            from_jsonl(&p)
                .unwrap_err()
                .to_string()
                .contains("no sentence")
        );
    }
}
