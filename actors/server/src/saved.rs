//! A conversation's state as a file, to take to another server or past a restart: the tokens
//! the state has seen and the neurons' membranes after them (one snapshot,
//! `nsactor_decoding::snapshot::HostSnapshot`), with what it belongs to.
//!
//! ```text
//! "NSSTATE\0"  u32 version  u32 header length  header (JSON)
//! tokens (i64 LE)  state fields (f32 LE: the edge's, then each layer's, as the header's shapes)
//! SHA-256 of everything before it (32 bytes)
//! HMAC-SHA256 of the same bytes under the server's state key (32 bytes)
//! ```
//!
//! The header names the model (its served name and vocabulary), the tokenizer (its hash) and
//! the shapes. A file is refused, saying why, when its magic, version or checksum is wrong,
//! when it is cut short, when it is not signed with this server's key
//! ([`crate::state_key`]: its membranes would reach other clients' requests through the
//! prefix cache), or when it belongs to another model or tokenizer.

use crate::error::ServeError;
use crate::state_key::StateKey;
use nsactor_decoding::snapshot::HostSnapshot;
use nsactor_plugin_api::HostTensor;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const MAGIC: &[u8; 8] = b"NSSTATE\0";
/// The format this server writes and reads (1 had no signature).
pub const VERSION: u32 = 2;
/// Widest state field a file may hold (the 0.9B's widest is 2 · D_ff = 5,376).
const MAX_WIDTH: usize = 1 << 20;

/// What a state file holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
    /// The model's served name and vocabulary.
    pub model: String,
    pub vocab: usize,
    /// The tokenizer's hash (`Tokenizer::hash`).
    pub tokenizer: String,
    pub tokens: Vec<i64>,
    pub state: HostSnapshot,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    model: String,
    vocab: usize,
    tokenizer: String,
    tokens: usize,
    edge: Vec<Vec<usize>>,
    layers: Vec<Vec<Vec<usize>>>,
}

fn bad(why: impl std::fmt::Display) -> ServeError {
    ServeError::Invalid(format!("the state file {why}"))
}

/// The file's bytes, signed with `key`.
pub fn encode(s: &Saved, key: &StateKey) -> Vec<u8> {
    let shapes = |f: &[HostTensor]| f.iter().map(|t| t.shape.clone()).collect::<Vec<_>>();
    let header = Header {
        model: s.model.clone(),
        vocab: s.vocab,
        tokenizer: s.tokenizer.clone(),
        tokens: s.tokens.len(),
        edge: shapes(&s.state.edge),
        layers: s.state.layers.iter().map(|l| shapes(l)).collect(),
    };
    let header = serde_json::to_vec(&header).expect("a header always serialises");
    let mut out = Vec::with_capacity(64 + header.len() + 8 * s.tokens.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    for t in &s.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    for t in s.state.edge.iter().chain(s.state.layers.iter().flatten()) {
        for x in &t.data {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    let tag = key.sign(&out);
    let sum = Sha256::digest(&out);
    out.extend_from_slice(&sum);
    out.extend_from_slice(&tag);
    out
}

/// Reads a file, checking its magic, version, checksum and lengths.
pub fn decode(bytes: &[u8], key: &StateKey) -> Result<Saved, ServeError> {
    if bytes.is_empty() {
        return Err(bad("is empty"));
    }
    let head = &bytes[..bytes.len().min(MAGIC.len())];
    if !MAGIC.starts_with(head) {
        return Err(bad(
            "is not an nsactor state file (its first bytes are not `NSSTATE`)",
        ));
    }
    if bytes.len() < 16 {
        return Err(bad(format!("is cut short ({} bytes)", bytes.len())));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version == 1 {
        return Err(bad(
            "has format version 1, which carries no signature; this server reads version 2: \
             export the state again from a server of this version",
        ));
    }
    if version != VERSION {
        return Err(bad(format!(
            "has format version {version}; this server reads version {VERSION}"
        )));
    }
    if bytes.len() < 16 + 64 {
        return Err(bad("is cut short"));
    }
    let (signed, tag) = bytes.split_at(bytes.len() - 32);
    let (body, sum) = signed.split_at(signed.len() - 32);
    if Sha256::digest(body).as_slice() != sum {
        return Err(bad(
            "is corrupt or cut short: its SHA-256 does not match its contents",
        ));
    }
    if !key.verify(body, tag) {
        return Err(bad(
            "is not signed with this server's state key: servers that exchange state files \
             share one (`$NSACTOR_STATE_KEY` or `nsactor serve --state-key-file`)",
        ));
    }
    let header_len = u32::from_le_bytes(body[12..16].try_into().expect("4 bytes")) as usize;
    let rest = &body[16..];
    if rest.len() < header_len {
        return Err(bad("is cut short inside its header"));
    }
    let h: Header = serde_json::from_slice(&rest[..header_len])
        .map_err(|e| bad(format!("has a header this server cannot read: {e}")))?;
    let mut at = &rest[header_len..];
    let mut take = |n: usize, what: &str| -> Result<&[u8], ServeError> {
        if at.len() < n {
            return Err(bad(format!("is cut short in its {what}")));
        }
        let (now, later) = at.split_at(n);
        at = later;
        Ok(now)
    };
    let tokens = take(h.tokens.saturating_mul(8), "tokens")?
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let mut field = |shape: &Vec<usize>| -> Result<HostTensor, ServeError> {
        // One session's row of one state field: `[1, 1, width]`.
        let n = match shape[..] {
            [1, 1, w] if w > 0 && w <= MAX_WIDTH => w,
            _ => {
                return Err(bad(format!(
                    "has a state field of shape {shape:?}; one session's fields are [1, 1, width]"
                )));
            }
        };
        let data: Vec<f32> = take(4 * n, "states")?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        if let Some(x) = data.iter().find(|x| !x.is_finite()) {
            return Err(bad(format!("holds a state value of {x}")));
        }
        Ok(HostTensor {
            data,
            shape: shape.clone(),
        })
    };
    let edge = h.edge.iter().map(&mut field).collect::<Result<_, _>>()?;
    let layers = h
        .layers
        .iter()
        .map(|l| l.iter().map(&mut field).collect::<Result<_, _>>())
        .collect::<Result<_, _>>()?;
    if !at.is_empty() {
        return Err(bad(format!("has {} bytes past its states", at.len())));
    }
    Ok(Saved {
        model: h.model,
        vocab: h.vocab,
        tokenizer: h.tokenizer,
        tokens,
        state: HostSnapshot { edge, layers },
    })
}

impl Saved {
    /// Refuses a state of another model or tokenizer than the server's.
    pub fn check(&self, model: &str, vocab: usize, tokenizer: &str) -> Result<(), ServeError> {
        if self.model != model || self.vocab != vocab {
            return Err(bad(format!(
                "belongs to model `{}` (vocabulary {}); this server serves `{model}` (vocabulary {vocab})",
                self.model, self.vocab
            )));
        }
        if self.tokenizer != tokenizer {
            return Err(bad(format!(
                "was made with tokenizer {}; this server's is {tokenizer}",
                self.tokenizer
            )));
        }
        if self.tokens.is_empty() {
            return Err(bad("holds no tokens"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved() -> Saved {
        let t = |n: usize, x: f32| HostTensor {
            data: (0..n).map(|i| x + i as f32).collect(),
            shape: vec![1, 1, n],
        };
        Saved {
            model: "tiny".into(),
            vocab: 512,
            tokenizer: "abc".into(),
            tokens: vec![1, 7, 300],
            state: HostSnapshot {
                edge: vec![t(4, 0.5)],
                layers: vec![vec![t(4, 1.0), t(8, -2.0)], vec![t(4, 3.0), t(8, 1e-9)]],
            },
        }
    }

    #[test]
    fn a_file_reads_back_as_written_and_every_damage_is_named() {
        let s = saved();
        let key = StateKey::from_secret(b"this server's secret");
        let bytes = encode(&s, &key);
        assert_eq!(decode(&bytes, &key).unwrap(), s);
        let err = |b: &[u8]| decode(b, &key).unwrap_err().to_string();
        assert!(err(b"hello world, this is json").contains("not an nsactor state file"));
        let mut v3 = bytes.clone();
        v3[8] = 3;
        assert!(err(&v3).contains("format version 3"));
        let mut v1 = bytes.clone();
        v1[8] = 1;
        assert!(err(&v1).contains("carries no signature"), "{}", err(&v1));
        // A good file under another key: not trusted, and said so (not "corrupt").
        let other = encode(&s, &StateKey::from_secret(b"another server's secret"));
        let e = err(&other);
        assert!(e.contains("not signed with this server's state key"), "{e}");
        // A client that forges membranes and fixes the checksum cannot sign them.
        let mut forged = bytes.clone();
        let n = forged.len();
        forged[n - 80] ^= 1;
        let sum = Sha256::digest(&forged[..n - 64]);
        forged[n - 64..n - 32].copy_from_slice(&sum);
        assert!(err(&forged).contains("not signed with this server's state key"));
        let mut flipped = bytes.clone();
        let mid = bytes.len() / 2;
        flipped[mid] ^= 1;
        assert!(err(&flipped).contains("SHA-256"));
        assert!(err(&bytes[..bytes.len() - 10]).contains("SHA-256"));
        assert!(err(&bytes[..20]).contains("cut short"));
        assert!(err(&bytes[..10]).contains("is cut short (10 bytes)"));
        assert!(err(&bytes[..3]).contains("is cut short (3 bytes)"));
        assert!(err(b"").contains("is empty"));
        assert!(err(b"NSX").contains("not an nsactor state file"));
        // A hostile header with a good checksum: no overflow, no huge allocation, no panic.
        let forge = |header: &str, body: &[u8]| {
            let mut out = MAGIC.to_vec();
            out.extend_from_slice(&VERSION.to_le_bytes());
            out.extend_from_slice(&(header.len() as u32).to_le_bytes());
            out.extend_from_slice(header.as_bytes());
            out.extend_from_slice(body);
            let tag = key.sign(&out);
            let sum = Sha256::digest(&out);
            out.extend_from_slice(&sum);
            out.extend_from_slice(&tag);
            out
        };
        let head = |tokens: usize, edge: &str| {
            format!(
                r#"{{"model":"tiny","vocab":512,"tokenizer":"abc","tokens":{tokens},"edge":{edge},"layers":[]}}"#
            )
        };
        let huge = forge(&head(usize::MAX / 2, "[]"), &[0; 16]);
        assert!(err(&huge).contains("cut short in its tokens"));
        let rows = forge(&head(0, "[[1, 18014398509481984, 1024]]"), &[]);
        assert!(err(&rows).contains("[1, 1, width]"));
        let nan = forge(&head(0, "[[1, 1, 2]]"), &[0, 0, 0, 0, 0, 0, 0xc0, 0x7f]);
        assert!(err(&nan).contains("state value of NaN"), "{}", err(&nan));
        // Checked against the server's model and tokenizer.
        s.check("tiny", 512, "abc").unwrap();
        let other = s.check("big", 512, "abc").unwrap_err().to_string();
        assert!(other.contains("belongs to model `tiny`"), "{other}");
        let tok = s.check("tiny", 512, "xyz").unwrap_err().to_string();
        assert!(tok.contains("tokenizer abc"), "{tok}");
    }
}
