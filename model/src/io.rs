//! safetensors import/export under the reference parameter names, plain
//! (`layers.0.snn_block.W_in.weight`) or in the HuggingFace layout (`model.` prefix, fp32).

use crate::ModelError;
use crate::params::{ParamMapper, ParamVisitor, Params};
use burn::tensor::{Tensor, backend::Backend};
use nsactor_kernels::SnnOps;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The HuggingFace export prefix.
pub const HF_PREFIX: &str = "model.";

/// Which names a file uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Reference `state_dict` names.
    Plain,
    /// `model.`-prefixed names (HF `model.safetensors`).
    HuggingFace,
}

impl Layout {
    fn prefix(self) -> &'static str {
        match self {
            Layout::Plain => "",
            Layout::HuggingFace => HF_PREFIX,
        }
    }
}

/// Reads a tensor of any float dtype the file may hold (f32, f16, bf16) as f32 values.
pub fn view_to_f32(name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, ModelError> {
    let bytes = view.data();
    let out = match view.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(ModelError::Weights(format!(
                "`{name}` has dtype {other:?}; expected F32, F16 or BF16"
            )));
        }
    };
    Ok(out)
}

/// `values` when every one is finite; else an error naming the tensor and the first bad index.
/// A NaN or infinite weight is never a model's (a diverged run's or a damaged file's): loading
/// it would run, print NaN losses or texts of one token, and exit 0.
pub fn finite(name: &str, values: Vec<f32>) -> Result<Vec<f32>, ModelError> {
    match values.iter().position(|x| !x.is_finite()) {
        None => Ok(values),
        Some(i) => Err(ModelError::Weights(format!(
            "`{name}` holds {} at index {i} (of {}): the weights are damaged or come from a \
             run that diverged",
            values[i],
            values.len()
        ))),
    }
}

/// Loads every parameter of `module` from `st`, named `{prefix}{name}`. Every parameter must be
/// present with its exact shape and finite values; extra keys are ignored here (see
/// [`load_file`] for strictness).
pub fn load_params<B: SnnOps, P: Params<B>>(
    module: &mut P,
    st: &SafeTensors<'_>,
    prefix: &str,
) -> Result<(), ModelError> {
    struct Load<'a, 'b> {
        st: &'a SafeTensors<'b>,
        prefix: &'a str,
        error: Option<ModelError>,
    }
    impl<B: SnnOps> ParamMapper<B> for Load<'_, '_> {
        fn map<const D: usize>(&mut self, name: &str, p: Tensor<B, D>) -> Tensor<B, D> {
            if self.error.is_some() {
                return p;
            }
            let key = format!("{}{name}", self.prefix);
            let result = self
                .st
                .tensor(&key)
                .map_err(|_| ModelError::Weights(format!("missing tensor `{key}`")))
                .and_then(|view| {
                    if view.shape() != p.dims().as_slice() {
                        return Err(ModelError::Weights(format!(
                            "`{key}` has shape {:?}, the model expects {:?}",
                            view.shape(),
                            p.dims()
                        )));
                    }
                    view_to_f32(&key, &view).and_then(|v| finite(&key, v))
                });
            match result {
                Ok(values) => {
                    let device = p.device();
                    crate::neurons::upload::<B, D>(&values, p.dims(), &device).require_grad()
                }
                Err(e) => {
                    self.error = Some(e);
                    p
                }
            }
        }
    }
    let mut l = Load {
        st,
        prefix,
        error: None,
    };
    module.map_params("", &mut l);
    l.error.map_or(Ok(()), Err)
}

/// Loads a model file, detecting the plain or HF layout, and rejects files with tensors the model
/// does not have (a different architecture or config).
pub fn load_file<B: SnnOps, P: Params<B>>(
    module: &mut P,
    path: &Path,
) -> Result<Layout, ModelError> {
    let ctx = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| ModelError::Io(ctx.clone(), e))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| ModelError::Weights(format!("{ctx}: not a safetensors file: {e}")))?;
    let names = crate::params::param_shapes(module);
    let layout = if st.tensor(&format!("{HF_PREFIX}{}", names[0].0)).is_ok() {
        Layout::HuggingFace
    } else {
        Layout::Plain
    };
    let expected: BTreeSet<String> = names
        .iter()
        .map(|(n, _)| format!("{}{n}", layout.prefix()))
        .collect();
    let extra: Vec<String> = st
        .names()
        .into_iter()
        .filter(|n| !expected.contains(*n))
        .map(String::from)
        .collect();
    if !extra.is_empty() {
        return Err(ModelError::Weights(format!(
            "{ctx}: {} tensors the model does not have, e.g. `{}`",
            extra.len(),
            extra[0]
        )));
    }
    load_params(module, &st, layout.prefix()).map_err(|e| e.context(&ctx))?;
    Ok(layout)
}

/// All parameters as `(name, shape, f32 values)` in model order.
pub fn param_values<B: Backend, P: Params<B>>(module: &P) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    struct Dump(Vec<(String, Vec<usize>, Vec<f32>)>);
    impl<B: Backend> ParamVisitor<B> for Dump {
        fn visit<const D: usize>(&mut self, name: &str, p: &Tensor<B, D>) {
            let values = p
                .to_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 parameter");
            self.0.push((name.to_string(), p.dims().to_vec(), values));
        }
    }
    let mut d = Dump(Vec::new());
    module.visit_params("", &mut d);
    d.0
}

/// Serialises parameters to safetensors bytes (fp32) under `layout`'s names, with optional
/// string metadata.
pub fn to_bytes<B: Backend, P: Params<B>>(
    module: &P,
    layout: Layout,
    metadata: Option<BTreeMap<String, String>>,
) -> Result<Vec<u8>, ModelError> {
    let params = param_values(module);
    let raw: Vec<(String, Vec<usize>, Vec<u8>)> = params
        .into_iter()
        .map(|(n, s, v)| {
            (
                format!("{}{n}", layout.prefix()),
                s,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = raw
        .iter()
        .map(|(n, s, b)| {
            Ok((
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b)
                    .map_err(|e| ModelError::Weights(format!("{n}: {e}")))?,
            ))
        })
        .collect::<Result<_, ModelError>>()?;
    let meta = metadata.map(|m| m.into_iter().collect());
    safetensors::serialize(views, meta).map_err(|e| ModelError::Weights(format!("serialise: {e}")))
}

/// Writes a model file atomically (temporary file in the same directory, fsync, rename).
pub fn save_file<B: Backend, P: Params<B>>(
    module: &P,
    path: &Path,
    layout: Layout,
) -> Result<(), ModelError> {
    let bytes = to_bytes(module, layout, None)?;
    write_atomic(path, &bytes)
}

/// Atomic file write ([`nsactor_plugin_api::files::write_atomic`]): a crash leaves either the
/// old file or the new one, never a torn one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    nsactor_plugin_api::files::write_atomic(path, bytes)
        .map_err(|e| ModelError::Io(path.display().to_string(), e))
}
