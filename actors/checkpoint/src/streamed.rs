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
//! thousand tensors) is written in a larger one once the data is in: the data is moved up in
//! place, last piece first (`shift`), instead of the stages being held for a second pass.

use crate::disk::DiskMode;
use crate::weights::{
    OPTIMIZER_PREFIX, WRITE_PIECE, WRITERS, write_at_parallel, write_atomic_with,
};
use nsactor_engine::error::RuntimeError;
use safetensors::SafeTensors;
use safetensors::tensor::{Metadata, TensorInfo};
use std::path::Path;

/// Bytes kept for the header before the data: room for ~10,000 tensors' entries.
pub const RESERVED: usize = 1 << 20;

/// Why the streamed file was given up (its temporary file removed, nothing renamed): fewer
/// stages came than asked for (their reading failed).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Incomplete;

impl std::fmt::Display for Incomplete {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the stages stopped coming")
    }
}

impl std::error::Error for Incomplete {}

/// Writes the parameters of the `n` stages `stages` yields, in that order, as one safetensors
/// file at `path` (atomically), each stage's as it arrives; the file's size in bytes, or
/// `None` (and no file) when fewer than `n` came (their reading failed). No stage is kept once
/// written: a header that outgrows its place moves the data after it ([`shift`]).
pub fn write_streamed<B: AsRef<[u8]>>(
    path: &Path,
    n: usize,
    stages: impl Iterator<Item = B>,
    mode: DiskMode,
) -> Result<Option<u64>, RuntimeError> {
    let io = |e: std::io::Error| RuntimeError::Io(path.to_path_buf(), e);
    let written = write_atomic_with(path, |f| {
        let (mut infos, mut names, mut end, mut came) =
            (Vec::new(), std::collections::HashSet::new(), 0, 0);
        for (i, b) in stages.enumerate() {
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
            write_at_parallel(f, pieces, WRITERS, WRITE_PIECE, mode)?;
            came += 1;
        }
        if came < n {
            return Err(std::io::Error::other(Incomplete));
        }
        let metadata = Metadata::new(None, infos).map_err(|e| invalid(e.to_string()))?;
        let mut json = serde_json::to_vec(&metadata).map_err(|e| invalid(e.to_string()))?;
        let room = json.len().next_multiple_of(8).max(RESERVED);
        if room > RESERVED {
            shift(
                f,
                (8 + RESERVED) as u64,
                end as u64,
                (room - RESERVED) as u64,
            )?;
        }
        json.resize(room, b' ');
        let mut header = (room as u64).to_le_bytes().to_vec();
        header.extend(json);
        let len = (8 + room + end) as u64;
        f.set_len(len)?;
        write_at_parallel(f, [(0u64, header.as_slice())], 1, WRITE_PIECE, mode)?;
        Ok(len)
    });
    match written {
        Ok(len) => Ok(Some(len)),
        Err(e) if e.get_ref().is_some_and(|x| x.is::<Incomplete>()) => Ok(None),
        Err(e) => Err(io(e)),
    }
}

/// Moves the `len` bytes at `from` in `f` up by `by` bytes (the data, for a header longer than
/// its reserved place: a model of some ten thousand tensors), last piece first so nothing is
/// overwritten before it moved.
fn shift(f: &std::fs::File, from: u64, len: u64, by: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; WRITE_PIECE.min(len as usize).max(1)];
    let mut left = len;
    while left > 0 {
        let take = (buf.len() as u64).min(left);
        left -= take;
        let piece = &mut buf[..take as usize];
        f.read_exact_at(piece, from + left)?;
        f.write_all_at(piece, from + left + by)?;
    }
    Ok(())
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
        let n = write_streamed(&path, 2, [&a, &b].into_iter(), DiskMode::Buffered)
            .unwrap()
            .unwrap();
        let streamed = std::fs::read(&path).unwrap();
        assert_eq!(n, streamed.len() as u64);
        // Past the page cache: the same file.
        let direct = dir.path().join("direct.safetensors");
        write_streamed(&direct, 2, [&a, &b].into_iter(), DiskMode::Direct).unwrap();
        assert_eq!(std::fs::read(&direct).unwrap(), streamed);
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
        let dup = write_streamed(&path, 2, [&a, &a].into_iter(), DiskMode::Buffered).unwrap_err();
        assert!(dup.to_string().contains("two stage shards"), "{dup}");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            write_streamed(&path, 3, [&a, &b].into_iter(), DiskMode::Buffered).unwrap(),
            None
        );
        assert!(!path.exists(), "an incomplete set leaves no file");
    }

    /// A header past [`RESERVED`] (thousands of long names) gets more room: the file holds
    /// every tensor with its bytes and safetensors reads it.
    #[test]
    fn a_header_past_its_place_moves_the_data_after_it() {
        let data: Vec<Vec<u8>> = (0..9_000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let names: Vec<String> = (0..9_000)
            .map(|i| format!("{}{i}", "x".repeat(120)))
            .collect();
        let views: Vec<_> = names
            .iter()
            .zip(&data)
            .map(|(n, d)| {
                let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], d);
                (n.clone(), v.unwrap())
            })
            .collect();
        let big = safetensors::serialize(views, None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let n = write_streamed(&path, 1, std::iter::once(&big), DiskMode::Direct)
            .unwrap()
            .unwrap();
        let file = std::fs::read(&path).unwrap();
        assert_eq!(n, file.len() as u64);
        let header = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
        assert!(header > RESERVED, "{header}");
        let (got, want) = (
            SafeTensors::deserialize(&file).unwrap(),
            SafeTensors::deserialize(&big).unwrap(),
        );
        assert_eq!(got.len(), names.len());
        for name in &names {
            assert_eq!(
                got.tensor(name).unwrap().data(),
                want.tensor(name).unwrap().data()
            );
        }
    }
}
