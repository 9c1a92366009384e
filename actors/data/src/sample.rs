//! Building training rows (SPEC §8): reference pretraining rows, packed windows, and SFT rows.
//!
//! A *row* holds `ctx = seq_len + 1` token ids and a mask of the same length; [`shift`] turns
//! rows into a [`Batch`] (`inputs = ids[..ctx-1]`, `targets = ids[1..]`, `loss_mask = mask[1..]`).

use crate::corpus;
use crate::error::{DataError, Result};
use crate::tokenizer::{Message, PAD_ID, Tokenizer, chat_template};
use nsactor_plugin_api::Batch;
use std::path::Path;

/// One training row before the shift: `ids.len() == mask.len() == ctx`.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub ids: Vec<i64>,
    pub mask: Vec<f32>,
}

/// The reference pretraining row: `doc` (BOS already first) truncated to `ctx`, right-padded
/// with 0, mask 1 on real tokens and 0 on padding.
pub fn padded_row(doc: &[i64], ctx: usize) -> Row {
    let n = doc.len().min(ctx);
    let mut ids = Vec::with_capacity(ctx);
    ids.extend_from_slice(&doc[..n]);
    ids.resize(ctx, PAD_ID as i64);
    let mut mask = vec![1.0; n];
    mask.resize(ctx, 0.0);
    Row { ids, mask }
}

/// A packed window: `ctx` consecutive ids of the document stream; every non-pad id counts.
pub fn packed_row(window: &[i64]) -> Row {
    Row {
        ids: window.to_vec(),
        mask: window
            .iter()
            .map(|&t| if t == PAD_ID as i64 { 0.0 } else { 1.0 })
            .collect(),
    }
}

/// SFT row: the ChatML text of `messages`, tokenized, truncated to `ctx`, padded with 0; the
/// mask covers each assistant reply and its `<|im_end|>` (SPEC §8 step 3).
pub fn sft_row(tok: &Tokenizer, messages: &[Message], ctx: usize) -> Result<Row> {
    let full = conversation_ids(tok, messages)?;
    Ok(right_truncated(
        &full,
        &assistant_opener(tok)?,
        tok.eos_id() as i64,
        ctx,
    ))
}

/// The ChatML tokens of a whole conversation.
fn conversation_ids(tok: &Tokenizer, messages: &[Message]) -> Result<Vec<i64>> {
    let text = chat_template(messages, false);
    Ok(tok.encode(&text)?.into_iter().map(i64::from).collect())
}

/// The reference's SFT row of a conversation's tokens `full`: its first `ctx`, padded with 0,
/// the mask over each reply that ends inside them.
fn right_truncated(full: &[i64], opener: &[i64], eos: i64, ctx: usize) -> Row {
    let ids = &full[..full.len().min(ctx)];
    let mut row = Row {
        ids: ids.to_vec(),
        mask: assistant_mask(ids, opener, eos),
    };
    row.ids.resize(ctx, PAD_ID as i64);
    row.mask.resize(ctx, 0.0);
    row
}

/// What [`sft_rows`] does with a conversation whose assistant replies do not fit the window
/// (`[data] sft_overflow`): at `T = 64` most alpaca replies end past the window, and the
/// reference's right truncation then leaves rows that score no token at all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SftOverflow {
    /// Keep the start of the conversation and cut the rest (SPEC §8, the reference): a reply
    /// cut before its `<|im_end|>` is not scored, so such a row scores nothing.
    Keep,
    /// Cut from the left instead, so that the row ends with the first reply's `<|im_end|>`
    /// and scores that reply whole; a conversation whose first reply alone (with its
    /// `<|im_start|>assistant` line) is longer than the window is left out.
    #[default]
    TruncateLeft,
    /// Leave out every conversation whose right-truncated row scores nothing.
    Skip,
}

/// How the conversations of an SFT set fitted the window, for the report at the start of a
/// run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SftReport {
    /// Conversations read.
    pub conversations: usize,
    /// Of them, those whose right-truncated row scores no token.
    pub unscored: usize,
    /// Of those, kept by cutting their prompt from the left ([`SftOverflow::TruncateLeft`]).
    pub truncated_left: usize,
    /// Of those, left out.
    pub skipped: usize,
    /// `T + 1`, the row length.
    pub ctx: usize,
}

impl std::fmt::Display for SftReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} conversations have no scored token at T = {}",
            self.unscored,
            self.conversations,
            self.ctx - 1
        )?;
        if self.unscored > 0 {
            let kept = self.unscored - self.truncated_left - self.skipped;
            write!(
                f,
                ": {} kept by truncating their prompt from the left, {} skipped, {} kept \
                 unscored",
                self.truncated_left, self.skipped, kept
            )?;
        }
        Ok(())
    }
}

/// How one conversation fitted: [`sft_fitted`]'s verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Its right-truncated row scores some token.
    Scored,
    /// Cut from the left to score its first reply.
    TruncatedLeft,
    /// Scores nothing and was kept ([`SftOverflow::Keep`]).
    Unscored,
    /// Left out.
    Skipped,
}

/// [`sft_row`] under an overflow policy: the row (none when left out) and how it fitted.
pub fn sft_fitted(
    tok: &Tokenizer,
    messages: &[Message],
    ctx: usize,
    overflow: SftOverflow,
) -> Result<(Option<Row>, Fit)> {
    let full = conversation_ids(tok, messages)?;
    let (opener, eos) = (assistant_opener(tok)?, tok.eos_id() as i64);
    let row = right_truncated(&full, &opener, eos, ctx);
    if row.mask.iter().any(|&m| m > 0.0) {
        return Ok((Some(row), Fit::Scored));
    }
    match overflow {
        SftOverflow::Keep => Ok((Some(row), Fit::Unscored)),
        SftOverflow::Skip => Ok((None, Fit::Skipped)),
        SftOverflow::TruncateLeft => {
            let mask = assistant_mask(&full, &opener, eos);
            // The first reply: its first scored token and its `<|im_end|>`.
            let Some(start) = mask.iter().position(|&m| m > 0.0) else {
                return Ok((None, Fit::Skipped));
            };
            let end = start + mask[start..].iter().take_while(|&&m| m > 0.0).count();
            if end - (start - opener.len()) > ctx {
                return Ok((None, Fit::Skipped));
            }
            let ids = full[end - ctx..end].to_vec();
            let mask = assistant_mask(&ids, &opener, eos);
            Ok((Some(Row { ids, mask }), Fit::TruncatedLeft))
        }
    }
}

/// The tokens that open an assistant reply: `<|im_start|>assistant\n`.
fn assistant_opener(tok: &Tokenizer) -> Result<Vec<i64>> {
    Ok(tok
        .encode(&format!("{}assistant\n", crate::tokenizer::BOS_TOKEN))?
        .into_iter()
        .map(i64::from)
        .collect())
}

/// The reference scan: after each occurrence of `opener`, mark from the next token up to and
/// including the first `eos`; a reply whose `eos` was truncated away gets no mask.
pub fn assistant_mask(ids: &[i64], opener: &[i64], eos: i64) -> Vec<f32> {
    let mut mask = vec![0.0; ids.len()];
    let m = opener.len();
    let mut i = 0;
    while i < ids.len() {
        if m > 0 && ids[i..].starts_with(opener) {
            let start = i + m;
            if let Some(off) = ids[start..].iter().position(|&t| t == eos) {
                mask[start..=start + off].fill(1.0);
            }
            i += m;
        } else {
            i += 1;
        }
    }
    mask
}

/// Stacks rows of equal length into a shifted [`Batch`].
pub fn shift(rows: &[Row]) -> Batch {
    let ctx = rows.first().map_or(1, |r| r.ids.len());
    let seq_len = ctx - 1;
    let mut b = Batch {
        batch: rows.len(),
        seq_len,
        inputs: Vec::with_capacity(rows.len() * seq_len),
        targets: Vec::with_capacity(rows.len() * seq_len),
        loss_mask: Vec::with_capacity(rows.len() * seq_len),
    };
    for r in rows {
        assert_eq!(r.ids.len(), ctx, "rows of one batch share one length");
        b.inputs.extend_from_slice(&r.ids[..seq_len]);
        b.targets.extend_from_slice(&r.ids[1..]);
        b.loss_mask.extend_from_slice(&r.mask[1..]);
    }
    b
}

/// Conversations of an SFT file, in any of three layouts, detected per record:
/// `{"messages":[{"role","content"}…]}`; ShareGPT `{"conversations":[{"from","value"}…]}`
/// (`human`/`user` → user, `gpt`/`assistant` → assistant, `system`); alpaca
/// `{"instruction","input","output"}` (user = instruction, plus `\n` + input when non-empty).
/// `.json` files hold an array of records, `.jsonl` one per line; `.xz`/`.gz`/`.zst` are read
/// through. A `.parquet` file's rows are records too, its columns their fields: a `messages`
/// column of lists of `{role, content}` structs (as `datasets` writes chat data), a
/// `conversations` column, or alpaca's string columns. `system`, when given, is prepended to
/// conversations that have no system message.
pub fn read_conversations(path: &Path, system: Option<&str>) -> Result<Vec<Vec<Message>>> {
    let (_, format) = corpus::detect(path);
    let jerr = |what: String, msg: String| DataError::Json {
        path: path.to_path_buf(),
        what,
        msg,
    };
    let text = match format {
        corpus::Format::Parquet => String::new(),
        _ => corpus::read_text(path)?,
    };
    let records: Vec<(String, serde_json::Value)> = match format {
        corpus::Format::Parquet => crate::parquet_docs::records(path)?,
        corpus::Format::Json => {
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| jerr("JSON".into(), e.to_string()))?;
            match v {
                serde_json::Value::Array(a) => a
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| (format!("record {i}"), v))
                    .collect(),
                _ => return Err(jerr("JSON".into(), "expected an array of records".into())),
            }
        }
        _ => text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                let what = format!("line {}", i + 1);
                serde_json::from_str(l)
                    .map(|v| (what.clone(), v))
                    .map_err(|e| jerr(what, e.to_string()))
            })
            .collect::<Result<_>>()?,
    };
    let mut out = Vec::with_capacity(records.len());
    for (what, v) in records {
        let str_of = |v: &serde_json::Value, key: &str| -> Result<String> {
            v.get(key)
                .and_then(|s| s.as_str())
                .map(str::to_owned)
                .ok_or_else(|| jerr(what.clone(), format!("`{key}` is missing or not a string")))
        };
        let mut msgs = Vec::new();
        if let Some(list) = v.get("messages").and_then(|m| m.as_array()) {
            for m in list {
                msgs.push(Message {
                    role: str_of(m, "role")?,
                    content: str_of(m, "content")?,
                });
            }
        } else if let Some(list) = v.get("conversations").and_then(|m| m.as_array()) {
            for m in list {
                let from = str_of(m, "from")?;
                let role = match from.as_str() {
                    "human" | "user" => "user",
                    "gpt" | "assistant" => "assistant",
                    "system" => "system",
                    other => return Err(jerr(what.clone(), format!("unknown speaker `{other}`"))),
                };
                msgs.push(Message::new(role, &str_of(m, "value")?));
            }
        } else if v.get("instruction").is_some() {
            let mut user = str_of(&v, "instruction")?;
            let input = v.get("input").and_then(|s| s.as_str()).unwrap_or("");
            if !input.is_empty() {
                user.push('\n');
                user.push_str(input);
            }
            if let Some(sys) = v
                .get("system")
                .and_then(|s| s.as_str())
                .filter(|s| !s.is_empty())
            {
                msgs.push(Message::new("system", sys));
            }
            msgs.push(Message::new("user", &user));
            msgs.push(Message::new("assistant", &str_of(&v, "output")?));
        } else {
            return Err(jerr(
                what,
                "expected `messages`, `conversations` or alpaca `instruction`/`output`".into(),
            ));
        }
        if let Some(sys) = system
            && msgs.first().is_none_or(|m| m.role != "system")
        {
            msgs.insert(0, Message::new("system", sys));
        }
        if msgs.iter().any(|m| m.role == "assistant") {
            out.push(msgs);
        }
    }
    if out.is_empty() {
        return Err(DataError::EmptyCorpus(format!(
            "{} (no conversation with an assistant turn)",
            path.display()
        )));
    }
    Ok(out)
}

/// SFT rows of every conversation in `files` (folders expanded by [`corpus::expand`]; see
/// [`read_conversations`]), built in parallel
/// under `overflow`, and how they fitted. No row scoring a token is an error.
pub fn sft_rows(
    tok: &Tokenizer,
    files: &[std::path::PathBuf],
    system: Option<&str>,
    ctx: usize,
    overflow: SftOverflow,
) -> Result<(Vec<Row>, SftReport)> {
    use rayon::prelude::*;
    let mut convs = Vec::new();
    for f in &corpus::expand(files)? {
        convs.extend(read_conversations(f, system)?);
    }
    let fitted = convs
        .par_iter()
        .map(|c| sft_fitted(tok, c, ctx, overflow))
        .collect::<Result<Vec<_>>>()?;
    let mut report = SftReport {
        conversations: convs.len(),
        ctx,
        ..SftReport::default()
    };
    let mut rows = Vec::with_capacity(fitted.len());
    for (row, fit) in fitted {
        report.unscored += usize::from(fit != Fit::Scored);
        report.truncated_left += usize::from(fit == Fit::TruncatedLeft);
        report.skipped += usize::from(fit == Fit::Skipped);
        rows.extend(row);
    }
    // Rows that score: the ones that fit, and the ones cut from the left.
    if report.conversations - report.unscored + report.truncated_left == 0 {
        return Err(DataError::EmptyCorpus(format!(
            "{} conversations, none with a scored token at T = {} ({report})",
            report.conversations,
            ctx - 1
        )));
    }
    Ok((rows, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_rows_truncate_and_pad() {
        let r = padded_row(&[3, 10, 11], 5);
        assert_eq!(r.ids, [3, 10, 11, 0, 0]);
        assert_eq!(r.mask, [1.0, 1.0, 1.0, 0.0, 0.0]);
        let r = padded_row(&[3, 10, 11, 12, 13, 14], 4);
        assert_eq!(r.ids, [3, 10, 11, 12]);
        assert_eq!(r.mask, [1.0; 4]);
        let b = shift(&[padded_row(&[3, 10, 11], 5)]);
        assert_eq!(b.inputs, [3, 10, 11, 0]);
        assert_eq!(b.targets, [10, 11, 0, 0]);
        assert_eq!(b.loss_mask, [1.0, 1.0, 0.0, 0.0]);
        b.validate().unwrap();
    }

    #[test]
    fn assistant_mask_follows_the_reference_scan() {
        // opener = [3, 9], eos = 4.
        let ids = [3, 8, 5, 4, 3, 9, 6, 7, 4, 1, 3, 9, 6];
        let m = assistant_mask(&ids, &[3, 9], 4);
        assert_eq!(
            m,
            [0., 0., 0., 0., 0., 0., 1., 1., 1., 0., 0., 0., 0.],
            "the last reply lost its eos to truncation, so it has no mask"
        );
    }
}
