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
    let text = chat_template(messages, false);
    let mut ids: Vec<i64> = tok.encode(&text)?.into_iter().map(i64::from).collect();
    ids.truncate(ctx);
    let opener: Vec<i64> = tok
        .encode(&format!("{}assistant\n", crate::tokenizer::BOS_TOKEN))?
        .into_iter()
        .map(i64::from)
        .collect();
    let mask = assistant_mask(&ids, &opener, tok.eos_id() as i64);
    let mut row = Row { ids, mask };
    row.ids.resize(ctx, PAD_ID as i64);
    row.mask.resize(ctx, 0.0);
    Ok(row)
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
/// `.json` files hold an array of records, `.jsonl` one per line; `.xz`/`.gz` are read through.
/// `system`, when given, is prepended to conversations that have no system message.
pub fn read_conversations(path: &Path, system: Option<&str>) -> Result<Vec<Vec<Message>>> {
    let text = corpus::read_text(path)?;
    let (_, format) = corpus::detect(path);
    let jerr = |what: String, msg: String| DataError::Json {
        path: path.to_path_buf(),
        what,
        msg,
    };
    let records: Vec<(String, serde_json::Value)> = match format {
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

/// SFT rows of every conversation in `files` (see [`read_conversations`]), built in parallel.
pub fn sft_rows(
    tok: &Tokenizer,
    files: &[std::path::PathBuf],
    system: Option<&str>,
    ctx: usize,
) -> Result<Vec<Row>> {
    use rayon::prelude::*;
    let mut convs = Vec::new();
    for f in files {
        convs.extend(read_conversations(f, system)?);
    }
    convs.par_iter().map(|c| sft_row(tok, c, ctx)).collect()
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
