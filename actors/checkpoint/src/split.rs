//! Format 2 of a checkpoint: a stage's parameters live in the checkpoint's one whole-model
//! weights file ([`WEIGHTS_FILE`], the same file a run exports), its optimizer state and
//! metadata in the stage's own shard. A run's final weights are then written once: the
//! checkpoint's weights file is linked as the run's `model.safetensors` instead of the same
//! 3.5 GB (0.9B) being written a second time beside it.
//!
//! This file splits a stage's bytes into the two parts on the way to disk and puts them back
//! together on the way in, byte for byte the bytes the stage gave (both are what
//! `safetensors::serialize` makes of the tensors and metadata). A stage's parameters are
//! verified by a sha256 over each one's name, dtype, shape and data, in name order, recorded
//! in the manifest: it does not depend on where the weights file puts them. The weights file
//! is read with positioned reads, never mapped, so a file another program truncates under a
//! reader gives an error, not a crash.

use crate::weights::OPTIMIZER_PREFIX;
use nsactor_engine::error::RuntimeError;
use safetensors::SafeTensors;
use safetensors::tensor::{Metadata, TensorInfo, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The whole-model weights file in a format-2 checkpoint directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// A stage's parameters as a format-2 manifest records them: their names in the weights file
/// (in name order) and the sha256 of each one's name, dtype, shape and data in that order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageParams {
    pub names: Vec<String>,
    pub sha256: String,
}

/// The weights file of a format-2 checkpoint, as its manifest records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightsEntry {
    pub file: String,
    pub bytes: u64,
}

/// A stage's bytes split: its shard (its optimizer tensors and metadata) as the header and the
/// data pieces to write one after another, and its parameters (sorted by name), which go to
/// the weights file.
pub struct Split<'a> {
    /// The shard's first bytes: its header's length and the header, as `safetensors::serialize`
    /// writes them.
    pub header: Vec<u8>,
    /// The shard's data, tensor after tensor.
    pub pieces: Vec<&'a [u8]>,
    pub params: Vec<(String, TensorView<'a>)>,
}

impl Split<'_> {
    /// The record of the stage's parameters (a pass over their bytes).
    pub fn record(&self) -> StageParams {
        record(&self.params)
    }
}

/// Splits a stage's bytes without copying them: the shard is laid out as
/// `safetensors::serialize` lays out the same tensors and metadata (by dtype, largest
/// alignment first, then by name), so putting it back together gives the stage's bytes.
pub fn split(stage: &[u8]) -> Result<Split<'_>, String> {
    let (_, meta) =
        SafeTensors::read_metadata(stage).map_err(|e| format!("not a stage's bytes: {e}"))?;
    let st = SafeTensors::deserialize(stage).map_err(|e| format!("not a stage's bytes: {e}"))?;
    let (mut params, mut optimizer): (Vec<_>, Vec<_>) = st
        .tensors()
        .into_iter()
        .partition(|(name, _)| !name.starts_with(OPTIMIZER_PREFIX));
    params.sort_by(|a, b| a.0.cmp(&b.0));
    optimizer.sort_by(|(a, x), (b, y)| y.dtype().cmp(&x.dtype()).then(a.cmp(b)));
    let mut at = 0;
    let mut infos = Vec::with_capacity(optimizer.len());
    let mut pieces = Vec::with_capacity(optimizer.len());
    for (name, v) in optimizer {
        let data = v.data();
        let info = TensorInfo {
            dtype: v.dtype(),
            shape: v.shape().to_vec(),
            data_offsets: (at, at + data.len()),
        };
        at += data.len();
        infos.push((name, info));
        pieces.push(data);
    }
    let metadata = Metadata::new(meta.metadata().clone(), infos)
        .map_err(|e| format!("the optimizer shard: {e}"))?;
    let mut json =
        serde_json::to_vec(&metadata).map_err(|e| format!("the optimizer shard: {e}"))?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut header = (json.len() as u64).to_le_bytes().to_vec();
    header.extend(json);
    Ok(Split {
        header,
        pieces,
        params,
    })
}

/// The record of `params` (sorted by name): a tensor's name, dtype and shape are hashed with
/// its data, so a header changed in the weights file is caught as a changed value is.
fn record(params: &[(String, TensorView<'_>)]) -> StageParams {
    let mut h = Sha256::new();
    for (name, v) in params {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(format!("{:?}", v.dtype()).as_bytes());
        h.update((v.shape().len() as u64).to_le_bytes());
        for &d in v.shape() {
            h.update((d as u64).to_le_bytes());
        }
        h.update(v.data());
    }
    StageParams {
        names: params.iter().map(|(n, _)| n.clone()).collect(),
        sha256: format!("{:x}", h.finalize()),
    }
}

/// A format-2 checkpoint's weights file opened for reading: its header parsed and checked
/// against the file's length; tensors are read with positioned reads ([`Self::read`]).
pub struct WeightsFile {
    file: std::fs::File,
    /// Where the data starts: the header's length and the header.
    data_start: u64,
    meta: Metadata,
}

impl WeightsFile {
    /// Opens `path`, which the manifest says holds `bytes` bytes; errors name the file.
    pub fn open(path: &Path, bytes: u64) -> Result<Self, RuntimeError> {
        let io = |e| RuntimeError::CheckpointIo(path.into(), e);
        let file = std::fs::File::open(path).map_err(|e| listed_io(path, e))?;
        let len = file.metadata().map_err(io)?.len();
        let bad = |m: String| RuntimeError::Checkpoint(path.into(), m);
        if len != bytes {
            return Err(bad(format!(
                "{len} bytes, the manifest says {bytes} (truncated?)"
            )));
        }
        let unreadable = |e: String| bad(format!("unreadable weights file: {e}"));
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(|e| unreadable(format!("its header's length: {e}")))?;
        let n = u64::from_le_bytes(n);
        if n > len.saturating_sub(8) || n > 100 << 20 {
            return Err(unreadable(format!(
                "a header of {n} bytes in a file of {len}"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|e| unreadable(format!("its header: {e}")))?;
        let meta: Metadata =
            serde_json::from_slice(&header).map_err(|e| unreadable(e.to_string()))?;
        let data_start = 8 + n;
        if data_start + meta.data_len() as u64 != len {
            return Err(unreadable(format!(
                "its header covers {} bytes of data, the file has {}",
                meta.data_len(),
                len - data_start
            )));
        }
        Ok(WeightsFile {
            file,
            data_start,
            meta,
        })
    }

    /// The tensors `names` as `(name, info, bytes)`, each read from the file.
    fn read(&self, names: &[String]) -> Result<Vec<(String, TensorInfo, Vec<u8>)>, String> {
        names
            .iter()
            .map(|name| {
                let info = self
                    .meta
                    .info(name)
                    .ok_or_else(|| format!("the weights file has no tensor `{name}`"))?;
                let (a, b) = info.data_offsets;
                let mut data = vec![0u8; b - a];
                self.file
                    .read_exact_at(&mut data, self.data_start + a as u64)
                    .map_err(|e| format!("reading `{name}`: {e}"))?;
                Ok((name.clone(), info.clone(), data))
            })
            .collect()
    }
}

/// A stage's bytes put back together from its shard and its parameters in `weights`, after
/// checking them against `params`.
pub fn rebuild(
    weights: &WeightsFile,
    shard: &[u8],
    params: &StageParams,
) -> Result<Vec<u8>, String> {
    let (_, meta) = SafeTensors::read_metadata(shard).map_err(|e| format!("the shard: {e}"))?;
    let st = SafeTensors::deserialize(shard).map_err(|e| format!("the shard: {e}"))?;
    let mut views = st.tensors();
    let read = weights.read(&params.names)?;
    let mut own = Vec::with_capacity(read.len());
    for (name, info, data) in &read {
        let v = TensorView::new(info.dtype, info.shape.clone(), data)
            .map_err(|e| format!("the weights file's `{name}`: {e}"))?;
        own.push((name.clone(), v));
    }
    if record(&own).sha256 != params.sha256 {
        return Err(
            "checksum mismatch: the weights file's parameters of this stage are corrupt".into(),
        );
    }
    views.extend(own);
    safetensors::serialize(views, meta.metadata().clone()).map_err(|e| e.to_string())
}

/// The error for a file a manifest lists that could not be opened: one that is not there
/// makes the checkpoint damaged (refused input, as a truncated or corrupt one), any other
/// failure is the disk's.
pub(crate) fn listed_io(path: &Path, e: std::io::Error) -> RuntimeError {
    if e.kind() == std::io::ErrorKind::NotFound {
        RuntimeError::Checkpoint(
            path.into(),
            "missing: the manifest lists this file, but it is not there".into(),
        )
    } else {
        RuntimeError::CheckpointIo(path.into(), e)
    }
}

/// Makes `to` hold the same file as `from` (a finished checkpoint's weights file): a hard
/// link when both are on one file system (no bytes written), else a copy; atomically either
/// way (a temporary name renamed over `to`). Returns whether it linked.
pub fn link_or_copy(from: &Path, to: &Path) -> std::io::Result<bool> {
    let dir = to
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = to
        .file_name()
        .ok_or_else(|| std::io::Error::other("no file name"))?;
    // One fixed name, so a link a crashed process left half-made is replaced, not kept.
    let tmp = dir.join(format!(".{}.link", name.to_string_lossy()));
    let _ = std::fs::remove_file(&tmp);
    let linked = match std::fs::hard_link(from, &tmp) {
        Ok(()) => true,
        Err(_) => {
            let copied = (|| {
                std::fs::copy(from, &tmp)?;
                std::fs::File::open(&tmp)?.sync_all()
            })();
            if let Err(e) = copied {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            false
        }
    };
    if let Err(e) = std::fs::rename(&tmp, to) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(linked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::tests::two_stages;

    /// [`split`], the shard's bytes in one buffer.
    fn optimizer_part(stage: &[u8]) -> Result<(Vec<u8>, StageParams), String> {
        let s = split(stage)?;
        let mut shard = s.header.clone();
        for p in &s.pieces {
            shard.extend_from_slice(p);
        }
        Ok((shard, s.record()))
    }

    /// A stage split into its shard and its parameters, the parameters written as the weights
    /// file is, comes back byte for byte; a changed parameter is caught.
    #[test]
    fn a_split_stage_comes_back_byte_for_byte_and_a_changed_parameter_is_caught() {
        let (a, b) = two_stages();
        let weights = crate::weights::merge_params(&[&a, &b]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let open = |bytes: &[u8], name: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, bytes).unwrap();
            WeightsFile::open(&p, bytes.len() as u64).unwrap()
        };
        let w = open(&weights, "w");
        for stage in [&a, &b] {
            let (shard, params) = optimizer_part(stage).unwrap();
            let st = SafeTensors::deserialize(stage).unwrap();
            let (_, meta) = SafeTensors::read_metadata(stage).unwrap();
            let own: Vec<_> = st
                .tensors()
                .into_iter()
                .filter(|(n, _)| n.starts_with(OPTIMIZER_PREFIX))
                .collect();
            let want = safetensors::serialize(own, meta.metadata().clone()).unwrap();
            assert_eq!(shard, want, "the shard is safetensors' own layout");
            assert!(!params.names.is_empty());
            let st = SafeTensors::deserialize(&shard).unwrap();
            assert!(st.names().iter().all(|n| n.starts_with(OPTIMIZER_PREFIX)));
            assert_eq!(&rebuild(&w, &shard, &params).unwrap(), stage);
        }
        let (shard, params) = optimizer_part(&a).unwrap();
        let mut bad = weights.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        // The flipped byte is the last tensor's: whichever stage holds it fails.
        let wb = open(&bad, "bad");
        let (shard_b, params_b) = optimizer_part(&b).unwrap();
        let errs = [
            rebuild(&wb, &shard, &params).err(),
            rebuild(&wb, &shard_b, &params_b).err(),
        ];
        assert_eq!(errs.iter().flatten().count(), 1, "{errs:?}");
        assert!(errs.iter().flatten().all(|e| e.contains("corrupt")));
        let mut missing = params.clone();
        missing.names.push("nope".into());
        assert!(
            rebuild(&w, &shard, &missing)
                .unwrap_err()
                .contains("`nope`")
        );
        assert!(optimizer_part(b"not safetensors").is_err());
        // A header changed without changing the data (a tensor's shape permuted) is caught.
        let st = SafeTensors::deserialize(&weights).unwrap();
        let mut tensors = st.tensors();
        let (_, v) = tensors
            .iter_mut()
            .find(|(n, v)| params.names.contains(n) && v.shape() == [2, 3])
            .expect("stage a has a 2 × 3 parameter");
        *v = TensorView::new(v.dtype(), vec![3, 2], v.data()).unwrap();
        let permuted = safetensors::serialize(tensors, None).unwrap();
        let e = rebuild(&open(&permuted, "permuted"), &shard, &params).unwrap_err();
        assert!(e.contains("corrupt"), "{e}");
        // A file whose length is not the manifest's, or whose header is not safetensors'.
        let p = dir.path().join("w");
        let short = WeightsFile::open(&p, weights.len() as u64 + 1)
            .err()
            .unwrap();
        assert!(matches!(short, RuntimeError::Checkpoint(_, m) if m.contains("truncated")));
        std::fs::write(&p, b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk").unwrap();
        assert!(matches!(
            WeightsFile::open(&p, 12),
            Err(RuntimeError::Checkpoint(..))
        ));
        // A weights file the manifest lists and the directory lacks: a damaged checkpoint.
        assert!(matches!(
            WeightsFile::open(&dir.path().join("absent"), 0),
            Err(RuntimeError::Checkpoint(_, m)) if m.starts_with("missing")
        ));
    }

    #[test]
    fn the_link_replaces_an_older_file_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&from, b"new weights").unwrap();
        std::fs::write(&to, b"old").unwrap();
        assert!(link_or_copy(&from, &to).unwrap());
        assert_eq!(std::fs::read(&to).unwrap(), b"new weights");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "no temporary file is left");
        assert!(link_or_copy(&dir.path().join("absent"), &to).is_err());
        assert_eq!(std::fs::read(&to).unwrap(), b"new weights");
    }
}
