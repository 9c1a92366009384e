//! Whole-model weight files built from stage shards (burn-free: safetensors bytes only).

use crate::disk::DiskMode;
use nsactor_engine::error::RuntimeError;
use safetensors::SafeTensors;
use safetensors::tensor::{Metadata, TensorInfo};
use std::io::Write;

/// Prefix of optimizer-state tensors inside a stage shard.
pub(crate) const OPTIMIZER_PREFIX: &str = "adam.";

/// Writers of a whole-model file (the H200's disk took 1.3 GB/s from one, 2 GB/s from eight).
pub(crate) const WRITERS: usize = 8;

/// Bytes per positioned write of a whole-model file.
pub(crate) const WRITE_PIECE: usize = 8 << 20;

/// Every stage's parameters laid out as one safetensors file, borrowing the shards' bytes: the
/// header, then the tensors' bytes in file order. Written out piece by piece
/// ([`write_file`](Self::write_file)), a whole-model file costs no merged copy in memory.
pub struct MergedParams<'a> {
    header: Vec<u8>,
    pieces: Vec<&'a [u8]>,
}

impl<'a> MergedParams<'a> {
    /// The parameters of `shards` (optimizer state dropped) under the reference names with
    /// `prefix` before each (`model.` for a Hugging Face export, else empty), in the order
    /// and with the header `safetensors::serialize` gives them (dtype alignment descending,
    /// then name), so the file is byte for byte the one it would write.
    pub fn new<B: AsRef<[u8]>>(shards: &'a [B], prefix: &str) -> Result<Self, RuntimeError> {
        let mut tensors: Vec<(String, TensorInfo, &'a [u8])> = Vec::new();
        for (i, b) in shards.iter().enumerate() {
            let st = SafeTensors::deserialize(b.as_ref())
                .map_err(|e| RuntimeError::Weights(format!("stage shard {i}: {e}")))?;
            for (name, view) in st.tensors() {
                if name.starts_with(OPTIMIZER_PREFIX) {
                    continue;
                }
                if tensors.iter().any(|(n, ..)| n[prefix.len()..] == name) {
                    return Err(RuntimeError::Weights(format!(
                        "tensor `{name}` appears in two stage shards"
                    )));
                }
                let info = TensorInfo {
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    data_offsets: (0, 0),
                };
                tensors.push((format!("{prefix}{name}"), info, view.data()));
            }
        }
        tensors.sort_by(|(ln, li, _), (rn, ri, _)| ri.dtype.cmp(&li.dtype).then(ln.cmp(rn)));
        let mut offset = 0;
        let mut infos = Vec::with_capacity(tensors.len());
        let mut pieces = Vec::with_capacity(tensors.len());
        for (name, mut info, data) in tensors {
            info.data_offsets = (offset, offset + data.len());
            offset += data.len();
            infos.push((name, info));
            pieces.push(data);
        }
        let bad = |e: &dyn std::fmt::Display| RuntimeError::Weights(format!("serialise: {e}"));
        let metadata = Metadata::new(None, infos).map_err(|e| bad(&e))?;
        let mut json = serde_json::to_vec(&metadata).map_err(|e| bad(&e))?;
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut header = (json.len() as u64).to_le_bytes().to_vec();
        header.extend(json);
        Ok(MergedParams { header, pieces })
    }

    /// The file's size in bytes.
    pub fn file_len(&self) -> u64 {
        (self.header.len() + self.pieces.iter().map(|p| p.len()).sum::<usize>()) as u64
    }

    /// Writes the file atomically at `path` by eight writers in 8 MB pieces
    /// ([`write_at_parallel`](Self::write_at_parallel)); its size in bytes.
    pub fn write_file(&self, path: &std::path::Path) -> std::io::Result<u64> {
        write_atomic_with(path, |f| {
            self.write_at_parallel(f, WRITERS, WRITE_PIECE, DiskMode::Buffered)
        })
    }

    /// Writes the file into `f` (set to its length first) in pieces of at most `piece` bytes
    /// at their offsets by up to `threads` writers ([`write_at_parallel`]); the caller syncs
    /// it.
    pub fn write_at_parallel(
        &self,
        f: &std::fs::File,
        threads: usize,
        piece: usize,
        mode: DiskMode,
    ) -> std::io::Result<u64> {
        let len = self.file_len();
        f.set_len(len)?;
        let mut at = 0u64;
        let spans = std::iter::once(self.header.as_slice())
            .chain(self.pieces.iter().copied())
            .map(|p| {
                let span = (at, p);
                at += p.len() as u64;
                span
            });
        write_at_parallel(f, spans, threads, piece, mode)?;
        Ok(len)
    }

    /// Writes the file to `w`, piece after piece.
    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<u64> {
        w.write_all(&self.header)?;
        for p in &self.pieces {
            w.write_all(p)?;
        }
        Ok(self.file_len())
    }
}

/// Writes each `(offset, bytes)` of `spans` into `f` at its offset, cut into pieces of at most
/// `piece` bytes taken in turn by up to `threads` writers (a single writer reached 1.3 GB/s on
/// the H200's disk, eight 2 GB/s), each piece's write-out started as it is written
/// ([`crate::disk`]). In [`DiskMode::Direct`] the pieces are cut at the file's 8 MB marks
/// instead, and each goes past the page cache but for an unaligned head or tail
/// ([`crate::disk::write_span`]).
pub fn write_at_parallel<'a>(
    f: &std::fs::File,
    spans: impl IntoIterator<Item = (u64, &'a [u8])>,
    threads: usize,
    piece: usize,
    mode: DiskMode,
) -> std::io::Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let twin = crate::disk::DirectTwin::for_mode(f, mode);
    let mut chunks: Vec<(u64, &[u8])> = Vec::new();
    for (mut at, mut p) in spans {
        while !p.is_empty() {
            let n = match twin {
                // Up to the next 8 MB mark of the file.
                Some(_) => (crate::disk::BLOCK as u64 - at % crate::disk::BLOCK as u64) as usize,
                None => piece.max(1),
            }
            .min(p.len());
            chunks.push((at, &p[..n]));
            (at, p) = (at + n as u64, &p[n..]);
        }
    }
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..threads.clamp(1, chunks.len().max(1)))
            .map(|_| {
                s.spawn(|| {
                    while let Some(&(at, c)) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
                        crate::disk::write_span(f, twin.as_ref(), c, at)?;
                    }
                    Ok::<_, std::io::Error>(())
                })
            })
            .collect();
        writers
            .into_iter()
            .try_for_each(|w| w.join().expect("an export writer does not panic"))
    })
}

/// One safetensors file with every stage's parameters (optimizer state dropped), under the
/// reference names — the `model.safetensors` a run leaves behind — built in memory.
pub fn merge_params<B: AsRef<[u8]>>(shards: &[B]) -> Result<Vec<u8>, RuntimeError> {
    let m = MergedParams::new(shards, "")?;
    let mut out = Vec::with_capacity(m.file_len() as usize);
    m.write_to(&mut out)
        .expect("writing to a Vec does not fail");
    Ok(out)
}

pub use nsactor_plugin_api::files::{write_atomic, write_atomic_with};

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use safetensors::tensor::TensorView;
    use safetensors::{Dtype, serialize};

    /// A safetensors file of `tensors` (name, dtype, shape, bytes).
    pub(crate) fn shard(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let views: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        serialize(views, None).unwrap()
    }

    /// Two stage shards: a layer's (two dtypes, one optimizer tensor) and the edge's.
    pub(crate) fn two_stages() -> (Vec<u8>, Vec<u8>) {
        let a = shard(&[
            ("layers.0.w", Dtype::F32, vec![2, 3], (0..24).collect()),
            ("adam.layers.0.w.m", Dtype::F32, vec![6], vec![9; 24]),
            ("layers.0.b", Dtype::BF16, vec![3], vec![1, 2, 3, 4, 5, 6]),
        ]);
        (
            a,
            shard(&[("embed", Dtype::F32, vec![1, 1], vec![7, 7, 7, 7])]),
        )
    }

    /// The merged file equals what `safetensors::serialize` writes for the parameters alone
    /// (mixed dtypes, so the order by alignment shows), and refuses a name in two shards.
    #[test]
    fn merged_params_are_byte_for_byte_safetensors_own_file() {
        let (a, b) = two_stages();
        let merged = merge_params(&[&a, &b]).unwrap();
        let want = shard(&[
            ("layers.0.w", Dtype::F32, vec![2, 3], (0..24).collect()),
            ("layers.0.b", Dtype::BF16, vec![3], vec![1, 2, 3, 4, 5, 6]),
            ("embed", Dtype::F32, vec![1, 1], vec![7, 7, 7, 7]),
        ]);
        assert_eq!(merged, want);
        assert_eq!(
            MergedParams::new(&[&a, &b], "").unwrap().file_len(),
            want.len() as u64
        );
        let mut prefixed = Vec::new();
        MergedParams::new(&[&a, &b], "model.")
            .unwrap()
            .write_to(&mut prefixed)
            .unwrap();
        let want = shard(&[
            (
                "model.layers.0.w",
                Dtype::F32,
                vec![2, 3],
                (0..24).collect(),
            ),
            (
                "model.layers.0.b",
                Dtype::BF16,
                vec![3],
                vec![1, 2, 3, 4, 5, 6],
            ),
            ("model.embed", Dtype::F32, vec![1, 1], vec![7, 7, 7, 7]),
        ]);
        assert_eq!(prefixed, want);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        for mode in [DiskMode::Buffered, DiskMode::Direct] {
            let f = std::fs::File::create(&path).unwrap();
            let n = MergedParams::new(&[&a, &b], "")
                .unwrap()
                .write_at_parallel(&f, 3, 5, mode)
                .unwrap();
            assert_eq!(
                std::fs::read(&path).unwrap(),
                merged,
                "pieces of 5 bytes, three writers, {mode:?}"
            );
            assert_eq!(n, merged.len() as u64);
        }
        let e = merge_params(&[&b, &b]).unwrap_err().to_string();
        assert!(e.contains("`embed` appears in two"), "{e}");
    }
}
