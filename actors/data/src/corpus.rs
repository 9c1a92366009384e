//! Reading corpora: plain text, JSONL with a text field, or a JSON array, optionally `.xz`/`.gz`/
//! `.zst` compressed, and Parquet files (one string column); split into documents. A folder
//! given as a corpus stands for the data files under it ([`expand`]).
//!
//! A *document* is the unit the samplers see: a non-empty record of a JSON/JSONL file or row of
//! a Parquet file, or a paragraph of a plain-text file (lines up to the next blank line;
//! internal newlines kept). This module reads whole files; [`crate::stream`] reads the same
//! documents a batch at a time, with bounded memory, for `nsactor data prepare`.

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
    Zstd,
}

impl Compression {
    /// The codec's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Xz => "xz",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }
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
    /// Apache Parquet: documents are the rows' values of one string column (compressed inside,
    /// by column chunk; never with a suffix).
    Parquet,
}

/// How `path` is stored and laid out, by its name: `x.jsonl.xz` is xz-compressed JSONL,
/// `x.jsonl.zst` zstd-compressed JSONL, `train-00000-of-00004.parquet` Parquet.
pub fn detect(path: &Path) -> (Compression, Format) {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let (comp, rest) = if let Some(r) = name.strip_suffix(".xz") {
        (Compression::Xz, r)
    } else if let Some(r) = name.strip_suffix(".gz") {
        (Compression::Gzip, r)
    } else if let Some(r) = name.strip_suffix(".zst") {
        (Compression::Zstd, r)
    } else {
        (Compression::None, name.as_str())
    };
    if comp == Compression::None && rest.ends_with(".parquet") {
        return (comp, Format::Parquet);
    }
    let format = if rest.ends_with(".jsonl") {
        Format::Jsonl
    } else if rest.ends_with(".json") {
        Format::Json
    } else {
        Format::Text
    };
    (comp, format)
}

/// `inner` read through the decoder of `comp` (itself when `None`); `path` is for messages.
/// Concatenated xz streams, gzip members and zstd frames are read one after the other.
pub fn decoder<'a>(
    path: &Path,
    comp: Compression,
    inner: impl Read + 'a,
) -> Result<Box<dyn Read + 'a>> {
    Ok(match comp {
        Compression::None => Box::new(inner),
        Compression::Xz => Box::new(liblzma::read::XzDecoder::new_multi_decoder(inner)),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(inner)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::new(inner)
                .map_err(|e| DataError::decompress(path, comp.name(), e))?,
        ),
    })
}

/// Decompresses `bytes` as stored by `comp`; `path` is for messages.
pub fn decompress(path: &Path, comp: Compression, bytes: Vec<u8>) -> Result<Vec<u8>> {
    if comp == Compression::None {
        return Ok(bytes);
    }
    let mut out = Vec::with_capacity(bytes.len() * 4);
    decoder(path, comp, &bytes[..])?
        .read_to_end(&mut out)
        .map_err(|e| DataError::decompress(path, comp.name(), e))?;
    Ok(out)
}

/// The whole (decompressed) text of `path`, checked to be UTF-8. Parquet files are not text:
/// read them with [`crate::stream`] or [`crate::parquet_docs`].
pub fn read_text(path: &Path) -> Result<String> {
    let (comp, format) = detect(path);
    if format == Format::Parquet {
        return Err(DataError::Invalid(format!(
            "{}: a Parquet file is not text",
            path.display()
        )));
    }
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

/// The string `text_field` of JSON record `v` (`what` names the record in messages).
pub(crate) fn text_of(
    path: &Path,
    mut v: serde_json::Value,
    text_field: &str,
    what: &dyn Fn() -> String,
) -> Result<String> {
    let msg = match v.get_mut(text_field).map(serde_json::Value::take) {
        Some(serde_json::Value::String(s)) => return Ok(s),
        Some(_) => format!("field `{text_field}` is not a string"),
        None => format!("no field `{text_field}` (set --text-field)"),
    };
    Err(DataError::Json {
        path: path.to_path_buf(),
        what: what(),
        msg,
    })
}

/// The documents of one corpus file's text.
///
/// JSON records without `text_field` or with a non-string value are errors (with the line or
/// record number); empty or whitespace-only documents are dropped.
pub fn documents<'a>(path: &Path, text: &'a str, text_field: &str) -> Result<Vec<Cow<'a, str>>> {
    let (_, format) = detect(path);
    let mut docs = Vec::new();
    match format {
        Format::Parquet => {
            return Err(DataError::Invalid(format!(
                "{}: a Parquet file is not text",
                path.display()
            )));
        }
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
                docs.push(Cow::Owned(text_of(path, v, text_field, &what)?));
            }
        }
        Format::Json => {
            let v: serde_json::Value = serde_json::from_str(text).map_err(|e| DataError::Json {
                path: path.to_path_buf(),
                what: "JSON".into(),
                msg: e.to_string(),
            })?;
            let serde_json::Value::Array(items) = v else {
                return Err(DataError::Json {
                    path: path.to_path_buf(),
                    what: "JSON".into(),
                    msg: "expected an array of objects".into(),
                });
            };
            for (i, item) in items.into_iter().enumerate() {
                let what = || format!("record {i}");
                docs.push(Cow::Owned(text_of(path, item, text_field, &what)?));
            }
        }
    }
    docs.retain(|d| !d.trim().is_empty());
    Ok(docs)
}

/// Whether a file's name is that of a data file in a folder: `.parquet`, or `.jsonl`, `.json`
/// or `.txt`, each optionally `.xz`/`.gz`/`.zst`.
fn is_data_file(path: &Path) -> bool {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let rest = [".xz", ".gz", ".zst"]
        .iter()
        .find_map(|c| name.strip_suffix(c))
        .unwrap_or(&name);
    name.ends_with(".parquet")
        || [".jsonl", ".json", ".txt"]
            .iter()
            .any(|e| rest.ends_with(e))
}

/// The files under `dir` at any depth, hidden entries (`.cache`, `.gitattributes`) left out.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| DataError::read(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| DataError::read(dir, e))?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        // Follows links, as a user naming the folder expects.
        let meta = std::fs::metadata(&path).map_err(|e| DataError::read(&path, e))?;
        if meta.is_dir() {
            walk(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// The corpus files that `paths` stand for, failing on the first that cannot be read.
///
/// A file stands for itself, whatever its name. A folder stands for the data files under it at
/// any depth, in path order, as `datasets` and the Hub lay out shards
/// (`data/train-00000-of-00004.parquet`…): `.parquet`, `.jsonl`, `.json` and `.txt`, each but
/// Parquet optionally `.xz`/`.gz`/`.zst`; hidden entries are skipped. When a folder holds Parquet
/// files, only they are taken: a dataset's folder also holds JSON metadata and a README.
pub fn expand(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for p in paths {
        let meta = std::fs::metadata(p).map_err(|e| DataError::read(p, e))?;
        if !meta.is_dir() {
            files.push(p.clone());
            continue;
        }
        let mut all = Vec::new();
        walk(p, &mut all)?;
        all.sort();
        let mut data: Vec<PathBuf> = all.iter().filter(|f| is_data_file(f)).cloned().collect();
        if data.iter().any(|f| detect(f).1 == Format::Parquet) {
            data.retain(|f| detect(f).1 == Format::Parquet);
        }
        if data.is_empty() {
            let arrow = all
                .iter()
                .any(|f| f.extension().is_some_and(|e| e == "arrow"));
            return Err(DataError::Invalid(format!(
                "{}: no data file in this folder (.parquet, or .jsonl, .json, .txt, optionally \
                 .xz/.gz/.zst){}",
                p.display(),
                if arrow {
                    "; its .arrow files are what `datasets` save_to_disk writes: write Parquet \
                     with Dataset.to_parquet, or pass the dataset's Parquet files"
                } else {
                    ""
                }
            )));
        }
        files.extend(data);
    }
    if files.is_empty() {
        return Err(DataError::EmptyCorpus("(no files given)".into()));
    }
    Ok(files)
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
