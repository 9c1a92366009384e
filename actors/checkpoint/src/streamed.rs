//! The run's weights file written while its checkpoint is still being read: each stage's
//! parameters go to the file as soon as that stage comes off the device, instead of after the
//! last one (when the order by name, and so every offset, is known).
//!
//! The tensors lie in the file in the order the stages arrive (within a stage, by name); the
//! header, written last, names every tensor's offsets. Its place is reserved up front
//! ([`RESERVED`] bytes) and its JSON padded with spaces to fill it, as the safetensors format
//! allows, so the data need not move once the header is known. Any safetensors reader loads
//! the file; it is not byte for byte what `safetensors::serialize` would write for the same
//! tensors (that orders the data by name: `nsactor export` still writes that form,
//! [`crate::weights::MergedParams`]). A header that outgrows its place (a model of some ten
//! thousand tensors) is written the whole-file way from the stages held.

use crate::weights::{
    MergedParams, OPTIMIZER_PREFIX, WRITE_PIECE, WRITERS, write_at_parallel, write_atomic_with,
};
use nsactor_engine::error::RuntimeError;
use safetensors::SafeTensors;
use safetensors::tensor::{Metadata, TensorInfo};
use std::path::Path;

/// Bytes kept for the header before the data: room for ~10,000 tensors' entries.
pub const RESERVED: usize = 1 << 20;

/// Why the streamed file was given up (its temporary file removed, nothing renamed).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Abandoned {
    /// Fewer stages came than asked for: their reading failed.
    Incomplete,
    /// The header is longer than [`RESERVED`].
    HeaderTooLong,
}

impl std::fmt::Display for Abandoned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Abandoned::Incomplete => "the stages stopped coming",
            Abandoned::HeaderTooLong => "the header outgrew its reserved place",
        })
    }
}

impl std::error::Error for Abandoned {}

/// Writes the parameters of the `n` stages `stages` yields, in that order, as one safetensors
/// file at `path` (atomically), each stage's as it arrives; the file's size in bytes, or
/// `None` (and no file) when fewer than `n` came (their reading failed). Every stage's bytes
/// are kept until the end for the rare header that does not fit [`RESERVED`].
pub fn write_streamed<B: AsRef<[u8]>>(
    path: &Path,
    n: usize,
    stages: impl Iterator<Item = B>,
) -> Result<Option<u64>, RuntimeError> {
    let io = |e: std::io::Error| RuntimeError::Io(path.to_path_buf(), e);
    let mut held = Vec::new();
    let written = write_atomic_with(path, |f| {
        let (mut infos, mut names, mut end) = (Vec::new(), std::collections::HashSet::new(), 0);
        for (i, b) in stages.enumerate() {
            {
                let st = SafeTensors::deserialize(b.as_ref())
                    .map_err(|e| invalid(format!("stage shard {i}: {e}")))?;
                let mut tensors: Vec<_> = st
                    .tensors()
                    .into_iter()
                    .filter(|(name, _)| !name.starts_with(OPTIMIZER_PREFIX))
                    .collect();
                tensors.sort_by(|a, b| a.0.cmp(&b.0));
                let mut pieces = Vec::with_capacity(tensors.len());
                for (name, view) in tensors {
                    if !names.insert(name.clone()) {
                        return Err(invalid(format!(
                            "tensor `{name}` appears in two stage shards"
                        )));
                    }
                    let data = view.data();
                    let info = TensorInfo {
                        dtype: view.dtype(),
                        shape: view.shape().to_vec(),
                        data_offsets: (end, end + data.len()),
                    };
                    infos.push((name, info));
                    pieces.push(((8 + RESERVED + end) as u64, data));
                    end += data.len();
                }
                write_at_parallel(f, pieces, WRITERS, WRITE_PIECE)?;
            }
            held.push(b);
        }
        if held.len() < n {
            return Err(std::io::Error::other(Abandoned::Incomplete));
        }
        let metadata = Metadata::new(None, infos).map_err(|e| invalid(e.to_string()))?;
        let mut json = serde_json::to_vec(&metadata).map_err(|e| invalid(e.to_string()))?;
        if json.len() > RESERVED {
            return Err(std::io::Error::other(Abandoned::HeaderTooLong));
        }
        json.resize(RESERVED, b' ');
        let mut header = (RESERVED as u64).to_le_bytes().to_vec();
        header.extend(json);
        let len = (8 + RESERVED + end) as u64;
        f.set_len(len)?;
        write_at_parallel(f, [(0u64, header.as_slice())], 1, WRITE_PIECE)?;
        Ok(len)
    });
    let abandoned = |e: &std::io::Error| {
        e.get_ref()
            .and_then(|x| x.downcast_ref::<Abandoned>())
            .copied()
    };
    match written {
        Ok(len) => Ok(Some(len)),
        Err(e) => match abandoned(&e) {
            Some(Abandoned::Incomplete) => Ok(None),
            // The by-name layout, from the stages held: its header is known before the data.
            Some(Abandoned::HeaderTooLong) => {
                let views: Vec<&[u8]> = held.iter().map(|b| b.as_ref()).collect();
                let len = MergedParams::new(&views, "")?
                    .write_file(path)
                    .map_err(io)?;
                Ok(Some(len))
            }
            None => Err(io(e)),
        },
    }
}

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::tests::two_stages;

    /// The streamed file holds the same tensors, with the same bytes, as the file ordered by
    /// name (optimizer state left out, mixed dtypes), and safetensors reads it.
    #[test]
    fn streamed_weights_hold_the_merged_files_tensors() {
        let (a, b) = two_stages();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let n = write_streamed(&path, 2, [&a, &b].into_iter())
            .unwrap()
            .unwrap();
        let streamed = std::fs::read(&path).unwrap();
        assert_eq!(n, streamed.len() as u64);
        let merged = crate::weights::merge_params(&[&a, &b]).unwrap();
        let (s, m) = (
            SafeTensors::deserialize(&streamed).unwrap(),
            SafeTensors::deserialize(&merged).unwrap(),
        );
        let mut names = s.names();
        names.sort();
        let mut want = m.names();
        want.sort();
        assert_eq!(names, want);
        for name in names {
            let (x, y) = (s.tensor(name).unwrap(), m.tensor(name).unwrap());
            assert_eq!(
                (x.dtype(), x.shape(), x.data()),
                (y.dtype(), y.shape(), y.data()),
                "{name}"
            );
        }
        let dup = write_streamed(&path, 2, [&a, &a].into_iter()).unwrap_err();
        assert!(dup.to_string().contains("two stage shards"), "{dup}");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            write_streamed(&path, 3, [&a, &b].into_iter()).unwrap(),
            None
        );
        assert!(!path.exists(), "an incomplete set leaves no file");
    }

    /// A header past [`RESERVED`] (thousands of long names) gives the by-name file instead.
    #[test]
    fn a_header_past_its_place_falls_back_to_the_by_name_file() {
        let data = vec![3u8; 4];
        let names: Vec<String> = (0..9_000)
            .map(|i| format!("{}{i}", "x".repeat(120)))
            .collect();
        let views: Vec<_> = names
            .iter()
            .map(|n| {
                let v =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &data);
                (n.clone(), v.unwrap())
            })
            .collect();
        let big = safetensors::serialize(views, None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let n = write_streamed(&path, 1, std::iter::once(&big))
            .unwrap()
            .unwrap();
        let file = std::fs::read(&path).unwrap();
        assert_eq!(n, file.len() as u64);
        assert_eq!(file, crate::weights::merge_params(&[&big]).unwrap());
    }
}
