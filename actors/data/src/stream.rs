//! Documents read a batch at a time, with bounded memory: how `nsactor data prepare` reads.
//!
//! Plain text and JSONL files, compressed or not, go through their decoder a line at a time;
//! Parquet files a few thousand rows of the text column at a time
//! ([`crate::parquet_docs::read_strings`]). Either way the caller gets batches of about
//! [`BATCH_BYTES`] of documents, in file order, with how much of the file on disk has been read
//! (for a progress bar). A JSON array is one value and is read whole. The documents are exactly
//! those of [`corpus::documents`] on the whole file: a paragraph of text, a JSONL record's or a
//! Parquet row's text; empty and whitespace-only ones dropped.

use crate::corpus::{self, Compression, Format};
use crate::error::{DataError, Result};
use std::cell::Cell;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// A batch closes at the first document past this many bytes of text.
pub const BATCH_BYTES: usize = 4 << 20;

/// The longest line of a text or JSONL file read (its newline aside): a longer one is refused
/// rather than held in memory whole (a device or a binary file without newlines would
/// otherwise be read until memory runs out).
pub const MAX_LINE_BYTES: usize = 256 << 20;

/// Documents of one file, in file order.
#[derive(Debug, Default)]
pub struct Batch {
    pub docs: Vec<String>,
    /// Bytes of text in `docs`.
    pub bytes: usize,
    /// Bytes of the file on disk read so far (compressed bytes of a compressed file; for
    /// Parquet, the file's size times the fraction of its rows read).
    pub file_read: u64,
}

/// What one file held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileStats {
    /// Bytes of (decompressed) text: the whole file's for text, JSONL and JSON, the text
    /// column's values for Parquet.
    pub text_bytes: u64,
    /// Documents passed on (empty ones left out).
    pub documents: u64,
    /// Size on disk.
    pub file_bytes: u64,
}

/// Collects documents into batches of [`BATCH_BYTES`] and hands them on.
struct Batcher<'a> {
    batch: Batch,
    documents: u64,
    sink: &'a mut dyn FnMut(Batch) -> Result<()>,
}

impl Batcher<'_> {
    fn push(&mut self, doc: String, file_read: u64) -> Result<()> {
        if doc.trim().is_empty() {
            return Ok(());
        }
        self.documents += 1;
        self.batch.bytes += doc.len();
        self.batch.docs.push(doc);
        if self.batch.bytes >= BATCH_BYTES {
            self.flush(file_read)?;
        }
        Ok(())
    }

    fn flush(&mut self, file_read: u64) -> Result<()> {
        if self.batch.docs.is_empty() {
            return Ok(());
        }
        let mut b = std::mem::take(&mut self.batch);
        b.file_read = file_read;
        (self.sink)(b)
    }
}

/// Counts the bytes read through it.
struct Counting<R> {
    inner: R,
    n: Rc<Cell<u64>>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let k = self.inner.read(buf)?;
        self.n.set(self.n.get() + k as u64);
        Ok(k)
    }
}

/// Reads the documents of `path` (its records' `text_field`, or its Parquet column of that
/// name) and calls `sink` with them a batch at a time.
pub fn read_documents(
    path: &Path,
    text_field: &str,
    sink: &mut dyn FnMut(Batch) -> Result<()>,
) -> Result<FileStats> {
    let file_bytes = std::fs::metadata(path)
        .map_err(|e| DataError::read(path, e))?
        .len();
    let mut b = Batcher {
        batch: Batch::default(),
        documents: 0,
        sink,
    };
    let (comp, format) = corpus::detect(path);
    let text_bytes = match format {
        Format::Parquet => {
            let read = crate::parquet_docs::read_strings(path, text_field, &mut |docs, frac| {
                let at = (file_bytes as f64 * frac) as u64;
                docs.into_iter().try_for_each(|d| b.push(d, at))
            })?;
            b.flush(file_bytes)?;
            read.bytes
        }
        _ => {
            let f = std::fs::File::open(path).map_err(|e| DataError::read(path, e))?;
            let n = Rc::new(Cell::new(0));
            let counted = Counting {
                inner: f,
                n: n.clone(),
            };
            let mut r = BufReader::with_capacity(1 << 20, corpus::decoder(path, comp, counted)?);
            let text_bytes = match format {
                Format::Json => {
                    let mut raw = Vec::new();
                    r.read_to_end(&mut raw).map_err(|e| io_err(path, comp, e))?;
                    let text = corpus::text_from_bytes(path, comp, raw)?;
                    for d in corpus::documents(path, &text, text_field)? {
                        b.push(d.into_owned(), n.get())?;
                    }
                    text.len() as u64
                }
                _ => {
                    let lines = Lines {
                        path,
                        comp,
                        format,
                        max_line: MAX_LINE_BYTES,
                    };
                    lines.read(text_field, &mut r, &mut b, &n)?
                }
            };
            b.flush(n.get())?;
            text_bytes
        }
    };
    Ok(FileStats {
        text_bytes,
        documents: b.documents,
        file_bytes,
    })
}

/// An error reading through the decoder of `comp`.
fn io_err(path: &Path, comp: Compression, e: std::io::Error) -> DataError {
    if comp == Compression::None {
        DataError::read(path, e)
    } else {
        DataError::decompress(path, comp.name(), e)
    }
}

/// How a text or JSONL stream is read a line at a time.
struct Lines<'a> {
    path: &'a Path,
    comp: Compression,
    format: Format,
    /// [`MAX_LINE_BYTES`], smaller in tests.
    max_line: usize,
}

impl Lines<'_> {
    /// The documents of the stream; returns the bytes of text read.
    fn read(
        &self,
        text_field: &str,
        r: &mut impl BufRead,
        b: &mut Batcher<'_>,
        file_read: &Cell<u64>,
    ) -> Result<u64> {
        let Lines {
            path,
            comp,
            format,
            max_line,
        } = *self;
        let (mut buf, mut para, mut offset, mut line_no) =
            (Vec::new(), String::new(), 0u64, 0usize);
        loop {
            buf.clear();
            let k = (r.by_ref().take(max_line as u64 + 1))
                .read_until(b'\n', &mut buf)
                .map_err(|e| io_err(path, comp, e))?;
            if k == 0 {
                break;
            }
            line_no += 1;
            if k > max_line && buf.last() != Some(&b'\n') {
                return Err(DataError::LineTooLong {
                    path: path.to_path_buf(),
                    line: line_no,
                    limit: max_line,
                });
            }
            let line = std::str::from_utf8(&buf).map_err(|e| DataError::Utf8 {
                path: path.to_path_buf(),
                offset: offset as usize + e.valid_up_to(),
                note: if comp == Compression::None {
                    ""
                } else {
                    " of the decompressed text"
                },
            })?;
            offset += k as u64;
            if format == Format::Text {
                // A paragraph: lines up to the next blank one, without its final newline.
                if line.trim().is_empty() {
                    if !para.is_empty() {
                        let p = std::mem::take(&mut para);
                        b.push(p.trim_end_matches(['\n', '\r']).to_owned(), file_read.get())?;
                    }
                } else {
                    para.push_str(line);
                }
                continue;
            }
            let line = line.strip_suffix('\n').unwrap_or(line);
            let line = line.strip_suffix('\r').unwrap_or(line);
            if line.trim().is_empty() {
                continue;
            }
            let what = || format!("line {line_no}");
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| DataError::Json {
                path: path.to_path_buf(),
                what: what(),
                msg: e.to_string(),
            })?;
            let text = corpus::text_of(path, v, text_field, &what)?;
            b.push(text, file_read.get())?;
        }
        if !para.is_empty() {
            b.push(
                para.trim_end_matches(['\n', '\r']).to_owned(),
                file_read.get(),
            )?;
        }
        Ok(offset)
    }
}

/// Every document of `paths` (folders expanded, [`corpus::expand`]), in order, in memory: for
/// tokenizer training and the in-memory `--corpus` of a run.
pub fn read_all_documents(paths: &[PathBuf], text_field: &str) -> Result<Vec<String>> {
    let files = corpus::expand(paths)?;
    let mut docs = Vec::new();
    for f in &files {
        read_documents(f, text_field, &mut |b| {
            docs.extend(b.docs);
            Ok(())
        })?;
    }
    if docs.is_empty() {
        return Err(DataError::EmptyCorpus(corpus::list(&files)));
    }
    Ok(docs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The documents of `text` read with lines of at most `max_line` bytes.
    fn read(text: &str, format: Format, max_line: usize) -> Result<Vec<String>> {
        let mut docs = Vec::new();
        let mut sink = |b: Batch| {
            docs.extend(b.docs);
            Ok(())
        };
        let mut b = Batcher {
            batch: Batch::default(),
            documents: 0,
            sink: &mut sink,
        };
        let lines = Lines {
            path: Path::new("c.txt"),
            comp: Compression::None,
            format,
            max_line,
        };
        let mut r = std::io::Cursor::new(text.as_bytes());
        lines.read("text", &mut r, &mut b, &Cell::new(0))?;
        b.flush(0)?;
        Ok(docs)
    }

    #[test]
    fn a_line_past_the_limit_is_refused_naming_it_and_one_at_it_is_read() {
        // Lines of exactly the limit's bytes (their newline aside), the last one without one.
        let text = "12345678\nabcdefgh\n\nlast5678";
        assert_eq!(
            read(text, Format::Text, 8).unwrap(),
            ["12345678\nabcdefgh", "last5678"]
        );
        let jsonl = "{\"text\":\"ab\"}\n{\"text\":\"abcdef\"}\n"; // lines of 13 and 17 bytes
        assert_eq!(read(jsonl, Format::Jsonl, 17).unwrap(), ["ab", "abcdef"]);
        for (text, format, max_line, line) in [
            ("12345678\n123456789\n", Format::Text, 8, 2),
            ("1234\n\n123456789", Format::Text, 8, 3),
            (jsonl, Format::Jsonl, 16, 2),
        ] {
            let e = read(text, format, max_line).unwrap_err();
            assert!(
                matches!(e, DataError::LineTooLong { line: l, limit, .. } if l == line && limit == max_line),
                "{text:?}: {e}"
            );
            assert!(
                e.to_string()
                    .starts_with(&format!("c.txt: line {line} is longer than"))
            );
        }
    }
}
