//! Parquet corpora: the documents of one string column, read a few thousand rows at a time, and
//! whole rows as JSON for SFT.
//!
//! Files as `datasets` (`Dataset.to_parquet`, `push_to_hub`) and the Hub write them: any number
//! of row groups, compressed by column chunk (snappy, zstd, gzip, lz4 or uncompressed; brotli is
//! not built in and is refused by name). For pretraining text, only the chosen column is decoded,
//! page by page through the low-level column reader, so memory stays at a page and a batch
//! whatever the size of a row group. Null values are skipped like empty documents. For SFT rows
//! ([`records`]), each row becomes the JSON object a JSONL line would hold (a `messages` list of
//! `{role, content}` structs becomes an array of objects), so the conversation layouts of
//! [`crate::sample::read_conversations`] apply unchanged.

use crate::error::{DataError, Result};
use parquet::basic::{ConvertedType, LogicalType, Type as PhysicalType};
use parquet::column::reader::ColumnReader;
use parquet::data_type::ByteArray;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::schema::types::Type;
use std::path::Path;

/// Rows decoded per read of the text column.
const ROWS_PER_READ: usize = 1024;

/// `path` opened as Parquet (its footer read and checked).
pub fn open(path: &Path) -> Result<SerializedFileReader<std::fs::File>> {
    let f = std::fs::File::open(path).map_err(|e| DataError::read(path, e))?;
    SerializedFileReader::new(f)
        .map_err(|e| DataError::parquet(path, format!("not a readable Parquet file: {e}")))
}

/// Whether `t` is a string column: UTF-8 byte arrays, not repeated.
fn is_string(t: &Type) -> bool {
    let info = t.get_basic_info();
    t.is_primitive()
        && t.get_physical_type() == PhysicalType::BYTE_ARRAY
        && (matches!(info.logical_type_ref(), Some(LogicalType::String))
            || info.converted_type() == ConvertedType::UTF8)
        && info.repetition() != parquet::basic::Repetition::REPEATED
}

/// A column's type in words, for messages: `string`, `int64`, `byte_array`, `a nested …`.
fn describe(t: &Type) -> String {
    if !t.is_primitive() {
        return "a nested (group, list or map) column".into();
    }
    if is_string(t) {
        return "string".into();
    }
    let info = t.get_basic_info();
    let mut s = format!("{:?}", t.get_physical_type()).to_lowercase();
    if info.repetition() == parquet::basic::Repetition::REPEATED {
        s = format!("repeated {s}");
    }
    if let Some(l) = info.logical_type_ref() {
        s = format!("{s} ({l:?})");
    } else if info.converted_type() != ConvertedType::NONE {
        s = format!("{s} ({})", info.converted_type());
    }
    s
}

/// The leaf index of top-level column `name` of `reader`, checked to be a string column (UTF-8
/// byte arrays, not repeated).
pub fn string_column(
    reader: &SerializedFileReader<std::fs::File>,
    path: &Path,
    name: &str,
) -> Result<usize> {
    let schema = reader.metadata().file_metadata().schema_descr();
    let fields = schema.root_schema().get_fields();
    let Some(root) = fields.iter().position(|f| f.name() == name) else {
        let names: Vec<String> = fields
            .iter()
            .map(|f| format!("`{}` ({})", f.name(), describe(f)))
            .collect();
        return Err(DataError::parquet(
            path,
            format!(
                "no column `{name}`; its columns: {}; choose one with --text-column",
                names.join(", ")
            ),
        ));
    };
    let field = &fields[root];
    if !is_string(field) {
        return Err(DataError::parquet(
            path,
            format!(
                "column `{name}` is {}, not a string column; choose one with --text-column",
                describe(field)
            ),
        ));
    }
    (0..schema.num_columns())
        .find(|&i| schema.get_column_root_idx(i) == root)
        .ok_or_else(|| DataError::parquet(path, format!("column `{name}` has no data")))
}

/// What [`read_strings`] read of one file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StringsRead {
    pub rows: u64,
    /// Bytes of the non-null values.
    pub bytes: u64,
}

/// Calls `on_values` with the non-null values of string column `column` of `path`, in row
/// order, a few thousand rows at a time, with the fraction of the file's rows read so far.
/// Invalid UTF-8 is an error naming its row.
pub fn read_strings(
    path: &Path,
    column: &str,
    on_values: &mut dyn FnMut(Vec<String>, f64) -> Result<()>,
) -> Result<StringsRead> {
    let reader = open(path)?;
    let idx = string_column(&reader, path, column)?;
    let max_def = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .column(idx)
        .max_def_level();
    let total = reader.metadata().file_metadata().num_rows().max(1) as f64;
    let perr = |rg: usize, e: parquet::errors::ParquetError| {
        DataError::parquet(path, format!("row group {rg}: {e}"))
    };
    let mut read = StringsRead::default();
    let (mut defs, mut values): (Vec<i16>, Vec<ByteArray>) = (Vec::new(), Vec::new());
    for rg in 0..reader.num_row_groups() {
        let group = reader.get_row_group(rg).map_err(|e| perr(rg, e))?;
        let ColumnReader::ByteArrayColumnReader(mut col) =
            group.get_column_reader(idx).map_err(|e| perr(rg, e))?
        else {
            return Err(DataError::parquet(
                path,
                format!("column `{column}` is not of byte arrays"),
            ));
        };
        loop {
            defs.clear();
            values.clear();
            let (rows, _, _) = col
                .read_records(ROWS_PER_READ, Some(&mut defs), None, &mut values)
                .map_err(|e| perr(rg, e))?;
            if rows == 0 {
                break;
            }
            let mut out = Vec::with_capacity(values.len());
            let mut vals = values.iter();
            for k in 0..rows {
                if max_def > 0 && defs.get(k).is_none_or(|&d| d < max_def) {
                    continue;
                }
                let Some(v) = vals.next() else { break };
                let s = std::str::from_utf8(v.data()).map_err(|e| {
                    DataError::parquet(
                        path,
                        format!(
                            "row {} of column `{column}`: invalid UTF-8 at byte offset {}",
                            read.rows + k as u64,
                            e.valid_up_to()
                        ),
                    )
                })?;
                read.bytes += s.len() as u64;
                out.push(s.to_owned());
            }
            read.rows += rows as u64;
            on_values(out, read.rows as f64 / total)?;
        }
    }
    Ok(read)
}

/// Every row of `path` as a JSON object (`(what, value)`, `what` naming the row for messages).
pub fn records(path: &Path) -> Result<Vec<(String, serde_json::Value)>> {
    let reader = open(path)?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| DataError::parquet(path, e))?;
    rows.enumerate()
        .map(|(i, r)| {
            let row = r.map_err(|e| DataError::parquet(path, format!("row {i}: {e}")))?;
            Ok((format!("row {i}"), row.to_json_value()))
        })
        .collect()
}

/// Writes a Parquet file of one optional string column, a row group per
/// [`write_group`](Self::write_group): the test corpora and `nsactor bench prepare`'s.
pub struct StringsWriter {
    w: parquet::file::writer::SerializedFileWriter<std::fs::File>,
    path: std::path::PathBuf,
}

impl StringsWriter {
    /// Codecs by name: `snappy`, `zstd`, `gzip`, `lz4` (LZ4_RAW) and `none`.
    pub const CODECS: [&str; 5] = ["snappy", "zstd", "gzip", "lz4", "none"];

    /// Creates `path` with string column `column`, compressed by `codec` (see [`Self::CODECS`]).
    pub fn create(path: &Path, column: &str, codec: &str) -> Result<Self> {
        use parquet::basic::{Compression as C, GzipLevel, ZstdLevel};
        let codec = match codec {
            "snappy" => C::SNAPPY,
            "zstd" => C::ZSTD(ZstdLevel::default()),
            "gzip" => C::GZIP(GzipLevel::default()),
            "lz4" => C::LZ4_RAW,
            "none" => C::UNCOMPRESSED,
            other => {
                return Err(DataError::Invalid(format!(
                    "codec `{other}`: one of {}",
                    Self::CODECS.join(", ")
                )));
            }
        };
        let err = |e: parquet::errors::ParquetError| DataError::parquet(path, e);
        if column.is_empty() || !column.chars().all(|c| c.is_alphanumeric() || c == '_') {
            return Err(DataError::Invalid(format!(
                "column name `{column}`: letters, digits and _ only"
            )));
        }
        let schema = parquet::schema::parser::parse_message_type(&format!(
            "message corpus {{ optional binary {column} (UTF8); }}"
        ))
        .map_err(err)?;
        // Documents are unique: a dictionary would only be dropped again.
        let props = parquet::file::properties::WriterProperties::builder()
            .set_compression(codec)
            .set_dictionary_enabled(false)
            .build();
        let f = std::fs::File::create(path).map_err(|e| DataError::write(path, e))?;
        let w = parquet::file::writer::SerializedFileWriter::new(
            f,
            std::sync::Arc::new(schema),
            std::sync::Arc::new(props),
        )
        .map_err(err)?;
        Ok(StringsWriter {
            w,
            path: path.to_path_buf(),
        })
    }

    /// Writes `rows` (`None`: null) as one row group.
    pub fn write_group(&mut self, rows: &[Option<&str>]) -> Result<()> {
        let err = |e: parquet::errors::ParquetError| DataError::parquet(&self.path, e);
        let values: Vec<ByteArray> = rows.iter().flatten().map(|s| ByteArray::from(*s)).collect();
        let defs: Vec<i16> = rows.iter().map(|r| i16::from(r.is_some())).collect();
        let mut group = self.w.next_row_group().map_err(err)?;
        let mut col = group
            .next_column()
            .map_err(err)?
            .ok_or_else(|| DataError::parquet(&self.path, "no column to write"))?;
        col.typed::<parquet::data_type::ByteArrayType>()
            .write_batch(&values, Some(&defs), None)
            .map_err(err)?;
        col.close().map_err(err)?;
        group.close().map_err(err)?;
        Ok(())
    }

    /// Writes the footer; returns the file's size.
    pub fn close(self) -> Result<u64> {
        self.w
            .close()
            .map_err(|e| DataError::parquet(&self.path, e))?;
        std::fs::metadata(&self.path)
            .map(|m| m.len())
            .map_err(|e| DataError::read(&self.path, e))
    }
}
