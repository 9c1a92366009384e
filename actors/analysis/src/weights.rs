//! The neurons' static decay parameters, read from the weights file itself (a checkpoint's
//! shards or a Hugging Face `model.safetensors`) before the model is loaded: σ(b_β) of every
//! selective hidden neuron and σ(w) of every row-parameter neuron (input, FFN gate/up, output).

use crate::error::{AnalysisError, Result};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::Path;

/// The static β of one layer's neurons.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerBetas {
    /// σ(b_β) of the SNNBlock's `D·N` selective hidden neurons (their β(t) at zero input drive).
    pub hidden: Vec<f64>,
    /// σ(w) of the two input neurons (`D` each).
    pub input1: Vec<f64>,
    pub input2: Vec<f64>,
    /// σ(w) of the SNNFFN's gate and up neurons (`D_ff` each).
    pub ffn_gate: Vec<f64>,
    pub ffn_up: Vec<f64>,
}

/// Every layer's static β and the output neuron's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StaticBetas {
    pub layers: Vec<LayerBetas>,
    pub output: Vec<f64>,
}

fn sigmoid(x: f32) -> f64 {
    1.0 / (1.0 + (-f64::from(x)).exp())
}

/// The values of a stored tensor as f32 (F32, BF16 and F16 storage).
fn values(view: &safetensors::tensor::TensorView<'_>) -> Option<Vec<f32>> {
    let b = view.data();
    Some(match view.dtype() {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        _ => return None,
    })
}

/// IEEE binary16 to f32.
fn half_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let frac = f32::from(h & 0x3ff);
    sign * match exp {
        0 => frac * 2f32.powi(-24),
        31 if frac == 0.0 => f32::INFINITY,
        31 => f32::NAN,
        e => (1.0 + frac / 1024.0) * 2f32.powi(e - 15),
    }
}

/// The tensors of `files` whose names (without the Hugging Face `model.` prefix) `want`s.
fn gather(files: &[Vec<u8>], want: impl Fn(&str) -> bool) -> Result<BTreeMap<String, Vec<f32>>> {
    let mut out = BTreeMap::new();
    for bytes in files {
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| AnalysisError::Invalid(format!("weights: {e}")))?;
        for (name, view) in st.tensors() {
            let bare = name.strip_prefix("model.").unwrap_or(&name);
            if want(bare) {
                let v = values(&view).ok_or_else(|| {
                    AnalysisError::Invalid(format!(
                        "weights: {name} is stored as {:?}",
                        view.dtype()
                    ))
                })?;
                out.insert(bare.to_string(), v);
            }
        }
    }
    Ok(out)
}

/// The static β of a `layers`-layer model in the checkpoint, run directory or Hugging Face
/// directory at `path`.
pub fn read(path: &Path, layers: usize) -> Result<StaticBetas> {
    let files = if nsactor_checkpoint::export::is_hf_dir(path) {
        vec![nsactor_checkpoint::export::read_hf_weights(path)?]
    } else {
        nsactor_checkpoint::checkpoint::find_checkpoint(path)?.shards
    };
    // Parameters only: optimizer moments (`adam.…`) end in the same names.
    let neuron = |n: &str| {
        !n.starts_with("adam.")
            && (n.ends_with(".b_beta")
                || n.ends_with("neuron1.w")
                || n.ends_with("neuron2.w")
                || n.ends_with("gate_neuron.w")
                || n.ends_with("up_neuron.w")
                || n == "output_neuron.w")
    };
    let mut t = gather(&files, neuron)?;
    let mut take = |name: String| {
        t.remove(&name)
            .map(|v| v.into_iter().map(sigmoid).collect())
            .ok_or_else(|| AnalysisError::Invalid(format!("weights: no tensor {name}")))
    };
    let layers = (0..layers)
        .map(|i| {
            Ok(LayerBetas {
                hidden: take(format!("layers.{i}.snn_block.b_beta"))?,
                input1: take(format!("layers.{i}.input_neuron1.w"))?,
                input2: take(format!("layers.{i}.input_neuron2.w"))?,
                ffn_gate: take(format!("layers.{i}.snn_ffn.gate_neuron.w"))?,
                ffn_up: take(format!("layers.{i}.snn_ffn.up_neuron.w"))?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(StaticBetas {
        layers,
        output: take("output_neuron.w".into())?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_floats_decode() {
        assert_eq!(half_to_f32(0x3c00), 1.0);
        assert_eq!(half_to_f32(0xc000), -2.0);
        assert_eq!(half_to_f32(0x3555), 0.333_251_95);
        assert_eq!(half_to_f32(0x0001), 2f32.powi(-24));
    }
}
