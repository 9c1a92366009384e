//! Reading corpora: plain text, JSONL with a text field, or a JSON array, optionally `.xz`/`.gz`
//! compressed; split into documents.
//!
//! A *document* is the unit the samplers see: a non-empty record of a JSON/JSONL file, or a
//! paragraph of a plain-text file (lines up to the next blank line; internal newlines kept).

use crate::error::{DataError, Result};
use std::borrow::Cow;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Compression, from the file name's last extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Xz,
    Gzip,
}

/// Layout, from the extension before any compression suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Paragraphs separated by blank lines.
    Text,
    /// One JSON object per line.
    Jsonl,
    /// One JSON array of objects.
    Json,
}

/// How `path` is stored and laid out, by its name: `x.jsonl.xz` is xz-compressed JSONL.
pub fn detect(path: &Path) -> (Compression, Format) {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let (comp, rest) = if let Some(r) = name.strip_suffix(".xz") {
        (Compression::Xz, r)
    } else if let Some(r) = name.strip_suffix(".gz") {
        (Compression::Gzip, r)
    } else {
        (Compression::None, name.as_str())
    };
    let format = if rest.ends_with(".jsonl") {
        Format::Jsonl
    } else if rest.ends_with(".json") {
        Format::Json
    } else {
        Format::Text
    };
    (comp, format)
}

/// Decompresses `bytes` as stored by `comp`; `path` is for messages.
pub fn decompress(path: &Path, comp: Compression, bytes: Vec<u8>) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let res = match comp {
        Compression::None => return Ok(bytes),
        Compression::Xz => {
            out.reserve(bytes.len() * 4);
            liblzma::read::XzDecoder::new_multi_decoder(&bytes[..]).read_to_end(&mut out)
        }
        Compression::Gzip => {
            out.reserve(bytes.len() * 4);
            flate2::read::MultiGzDecoder::new(&bytes[..]).read_to_end(&mut out)
        }
    };
    res.map_err(|e| DataError::read(path, e))?;
    Ok(out)
}

/// The whole (decompressed) text of `path`, checked to be UTF-8.
pub fn read_text(path: &Path) -> Result<String> {
    let (comp, _) = detect(path);
    let raw = std::fs::read(path).map_err(|e| DataError::read(path, e))?;
    let bytes = decompress(path, comp, raw)?;
    text_from_bytes(path, comp, bytes)
}

/// `bytes` as a `String`, or an error with the byte offset of the first invalid sequence.
pub fn text_from_bytes(path: &Path, comp: Compression, bytes: Vec<u8>) -> Result<String> {
    String::from_utf8(bytes).map_err(|e| DataError::Utf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
        note: if comp == Compression::None {
            ""
        } else {
            " of the decompressed text"
        },
    })
}

/// Paragraphs of plain text: maximal runs of non-blank lines, without their final newline.
pub fn paragraphs(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        loop {
            if rest.is_empty() {
                return None;
            }
            // Skip blank lines.
            let line_end = rest.find('\n').map_or(rest.len(), |i| i + 1);
            if rest[..line_end].trim().is_empty() {
                rest = &rest[line_end..];
                continue;
            }
            // Extend to the first blank line.
            let mut end = line_end;
            while end < rest.len() {
                let next = rest[end..].find('\n').map_or(rest.len(), |i| end + i + 1);
                if rest[end..next].trim().is_empty() {
                    break;
                }
                end = next;
            }
            let para = rest[..end].trim_end_matches(['\n', '\r']);
            rest = &rest[end..];
            return Some(para);
        }
    })
}

/// The documents of one corpus file's text.
///
/// JSON records without `text_field` or with a non-string value are errors (with the line or
/// record number); empty or whitespace-only documents are dropped.
pub fn documents<'a>(path: &Path, text: &'a str, text_field: &str) -> Result<Vec<Cow<'a, str>>> {
    let (_, format) = detect(path);
    let field = |v: &serde_json::Value, what: &dyn Fn() -> String| -> Result<Option<String>> {
        match v.get(text_field) {
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(DataError::Json {
                path: path.to_path_buf(),
                what: what(),
                msg: format!("field `{text_field}` is not a string"),
            }),
            None => Err(DataError::Json {
                path: path.to_path_buf(),
                what: what(),
                msg: format!("no field `{text_field}` (set --text-field)"),
            }),
        }
    };
    let mut docs = Vec::new();
    match format {
        Format::Text => docs.extend(paragraphs(text).map(Cow::Borrowed)),
        Format::Jsonl => {
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let what = || format!("line {}", i + 1);
                let v: serde_json::Value =
                    serde_json::from_str(line).map_err(|e| DataError::Json {
                        path: path.to_path_buf(),
                        what: what(),
                        msg: e.to_string(),
                    })?;
                if let Some(s) = field(&v, &what)? {
                    docs.push(Cow::Owned(s));
                }
            }
        }
        Format::Json => {
            let v: serde_json::Value = serde_json::from_str(text).map_err(|e| DataError::Json {
                path: path.to_path_buf(),
                what: "JSON".into(),
                msg: e.to_string(),
            })?;
            let items = v.as_array().ok_or_else(|| DataError::Json {
                path: path.to_path_buf(),
                what: "JSON".into(),
                msg: "expected an array of objects".into(),
            })?;
            for (i, item) in items.iter().enumerate() {
                if let Some(s) = field(item, &|| format!("record {i}"))? {
                    docs.push(Cow::Owned(s));
                }
            }
        }
    }
    docs.retain(|d| !d.trim().is_empty());
    Ok(docs)
}

/// Reads every file and returns `(path, text)` pairs; fails on the first unreadable file.
pub fn read_all(files: &[PathBuf]) -> Result<Vec<(PathBuf, String)>> {
    if files.is_empty() {
        return Err(DataError::EmptyCorpus("(no files given)".into()));
    }
    files
        .iter()
        .map(|p| Ok((p.clone(), read_text(p)?)))
        .collect()
}

/// Joins file names for messages.
pub(crate) fn list(files: &[PathBuf]) -> String {
    files
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paragraphs_split_at_blank_lines() {
        let t = "\n\nA b\nc d\n\n \n\nE\r\n\nF\n";
        let p: Vec<_> = paragraphs(t).collect();
        assert_eq!(p, ["A b\nc d", "E", "F"]);
        assert_eq!(paragraphs("x").collect::<Vec<_>>(), ["x"]);
        assert_eq!(paragraphs("\n \n").count(), 0);
    }

    #[test]
    fn formats_follow_the_name() {
        assert_eq!(
            detect(Path::new("a/b.jsonl.xz")),
            (Compression::Xz, Format::Jsonl)
        );
        assert_eq!(
            detect(Path::new("b.TXT.gz")),
            (Compression::Gzip, Format::Text)
        );
        assert_eq!(
            detect(Path::new("c.json")),
            (Compression::None, Format::Json)
        );
        assert_eq!(
            detect(Path::new("README")),
            (Compression::None, Format::Text)
        );
    }

    #[test]
    fn json_records_need_the_text_field() {
        let p = Path::new("x.jsonl");
        let d = documents(
            p,
            "{\"text\":\"a\"}\n\n{\"text\":\"  \"}\n{\"text\":\"b\"}\n",
            "text",
        )
        .unwrap();
        assert_eq!(d, ["a", "b"]);
        let e = documents(p, "{\"text\":\"a\"}\n{\"body\":\"b\"}\n", "text").unwrap_err();
        assert!(
            e.to_string().contains("x.jsonl: line 2: no field `text`"),
            "{e}"
        );
        let e = documents(p, "{\"text\":1}", "text").unwrap_err();
        assert!(e.to_string().contains("not a string"), "{e}");
        let e = documents(p, "{oops", "text").unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
        let d = documents(Path::new("y.json"), "[{\"t\":\"q\"}]", "t").unwrap();
        assert_eq!(d, ["q"]);
    }
}
