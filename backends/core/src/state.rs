//! What every stage shares: the autodiff master and its inner copy, gradient accumulation, the
//! optimizer step and save/load of parameters with optimizer state.

use crate::Ad;
use crate::grads::Streams;
use burn::tensor::{Tensor, TensorData, TensorPrimitive, backend::Backend};
use nsactor_kernels::SnnOps;
use nsactor_model::init::{Rng, part_seed};
use nsactor_model::io::{HF_PREFIX, finite, load_params, view_to_f32};
use nsactor_model::params::{ParamMapper, ParamVisitor, Params};
use nsactor_model::train::{Adam, AdamConfig, AdamState, GradSet};
use nsactor_plugin_api::{
    EngineError, InitialWeights, OptimizerKind, Reply, ShardBytes, StageCall, StageSnapshot,
    StageSpec,
};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;

/// The metadata entry of a stage shard: `{"stage": …, "adam_steps": {name: step}}`.
pub const META_KEY: &str = "nsactor";

/// The generator of part `part`'s first parameters (`0` the edge, `i + 1` layer `i`): seeded
/// from the run's seed, or blank where the caller loads the weights
/// ([`InitialWeights::Loaded`]).
pub(crate) fn initial_rng(spec: &StageSpec, part: u64) -> Rng {
    match spec.weights {
        InitialWeights::Seeded => Rng::new(part_seed(spec.seed, part)),
        InitialWeights::Loaded => Rng::blank(),
    }
}

/// Refuses `call` on the stage `stage` names while it waits for the weights it was opened to
/// load.
pub(crate) fn check_loaded(
    waiting: bool,
    stage: impl FnOnce() -> String,
    call: &str,
) -> Result<(), EngineError> {
    if waiting {
        return Err(EngineError::InvalidInput(format!(
            "{} was opened to load its weights and has none yet; {call} refused",
            stage()
        )));
    }
    Ok(())
}

/// [`check_loaded`] for a stage call. `HoldGrads` passes: it sets how gradients are exchanged,
/// and a data-parallel replica's stages get it when they are wired, before a recovery loads the
/// checkpoint into them.
pub(crate) fn check_call_loaded(
    waiting: bool,
    stage: impl FnOnce() -> String,
    call: &StageCall<'_>,
) -> Result<(), EngineError> {
    let needs_weights = !matches!(call, StageCall::HoldGrads { .. });
    check_loaded(waiting && needs_weights, stage, call.name())
}

/// Flattens every parameter of `m` (declaration order).
pub(crate) fn flat_params<B: Backend, P: Params<B>>(m: &P) -> Vec<Tensor<B, 1>> {
    struct Flat<B: Backend>(Vec<Tensor<B, 1>>);
    impl<B: Backend> ParamVisitor<B> for Flat<B> {
        fn visit<const D: usize>(&mut self, _: &str, p: &Tensor<B, D>) {
            let n = p.shape().num_elements();
            self.0.push(p.clone().reshape([n]));
        }
    }
    let mut f = Flat(Vec::new());
    m.visit_params("", &mut f);
    f.0
}

/// Replaces every parameter of `m` by the next of `values` (declaration order), reshaped.
pub(crate) fn set_params<B: Backend, P: Params<B>>(m: &mut P, values: Vec<Tensor<B, 1>>) {
    struct Set<B: Backend>(std::vec::IntoIter<Tensor<B, 1>>);
    impl<B: Backend> ParamMapper<B> for Set<B> {
        fn map<const D: usize>(&mut self, _: &str, p: Tensor<B, D>) -> Tensor<B, D> {
            let v = self.0.next().expect("as many values as parameters");
            v.reshape(p.dims())
        }
    }
    m.map_params("", &mut Set(values.into_iter()));
}

/// Copies the autodiff master's parameter values into the inner copy used for forward-only work.
pub(crate) fn sync<B: SnnOps, A: Params<Ad<B>>, I: Params<B>>(ad: &A, inner: &mut I) {
    let values = flat_params(ad).into_iter().map(|t| t.inner()).collect();
    set_params(inner, values);
}

/// Number of parameter values of `m`.
pub(crate) fn count<B: Backend, P: Params<B>>(m: &P) -> u64 {
    flat_params(m)
        .iter()
        .map(|t| t.shape().num_elements() as u64)
        .sum()
}

/// Gradients accumulated over micro-batches, plus the optimizer.
pub(crate) struct Trainer<B: SnnOps> {
    /// The streams settled into one set: what the optimizer phase works on.
    pub grads: Option<GradSet<B>>,
    /// Micro-batches' gradients as they arrive, in order ([`Streams`]).
    pub streams: Streams<B>,
    /// `None` in a stage opened without an optimizer ([`StageSpec::optimizer`]): it serves or
    /// evaluates only, and refuses a step.
    pub adam: Option<Adam<B>>,
}

impl<B: SnnOps> Trainer<B> {
    /// A trainer of `streams` gradient streams (a layer 1, the edge 2), with `kind`'s
    /// optimizer if any.
    pub fn new(kind: Option<OptimizerKind>, streams: usize) -> Self {
        let cfg = kind.map(|k| match k {
            OptimizerKind::Adam => AdamConfig::adam(),
            OptimizerKind::AdamW => AdamConfig::adamw_sft(),
        });
        Trainer {
            grads: None,
            streams: Streams::new(streams),
            adam: cfg.map(Adam::new),
        }
    }

    /// Settles every stream into [`grads`](Self::grads), in order.
    pub fn flush(&mut self) {
        self.streams.settle(&mut self.grads);
    }

    /// Drops every gradient, waiting or added.
    pub fn clear(&mut self) {
        self.grads = None;
        self.streams.clear();
    }

    /// The data-parallel exchange calls (`HoldGrads`, `GradsOut`, `GradsIn`) on `module`'s
    /// gradients (named with `prefix`); any other call comes back as `Err`.
    pub fn exchange<'a, M: Params<Ad<B>>>(
        &mut self,
        module: &M,
        prefix: &str,
        call: StageCall<'a>,
    ) -> Result<Result<Reply, EngineError>, StageCall<'a>> {
        let settled = |what: &str| {
            EngineError::InvalidInput(format!(
                "{what} after the optimizer phase began: exchange gradients before GradStats"
            ))
        };
        Ok(match call {
            StageCall::HoldGrads { hold } => {
                self.streams.set_hold(hold);
                Ok(Reply::none())
            }
            StageCall::GradsOut { .. } if self.grads.is_some() => Err(settled("GradsOut")),
            StageCall::GradsOut { keep } => self.streams.take_part(module, prefix, keep),
            StageCall::GradsIn { .. } if self.grads.is_some() => Err(settled("GradsIn")),
            StageCall::GradsIn {
                stream,
                micro,
                mask,
                grad,
            } => self
                .streams
                .put_part(module, prefix, stream, micro, mask, grad)
                .map(|()| Reply::none()),
            other => return Err(other),
        })
    }

    pub fn sum_squares(&self) -> f64 {
        self.grads.as_ref().map_or(0.0, |g| g.sum_squares())
    }

    /// Clip, Adam, clear.
    pub fn step<M: Params<Ad<B>>>(
        &mut self,
        module: &mut M,
        prefix: &str,
        lr: f64,
        neuron_lr: f64,
        clip: f64,
    ) -> Result<(), EngineError> {
        let adam = self.adam.as_mut().ok_or_else(|| {
            EngineError::InvalidInput(
                "Step refused: this stage was opened without an optimizer (to serve or evaluate)"
                    .into(),
            )
        })?;
        self.streams.settle(&mut self.grads);
        let grads = self.grads.take().ok_or_else(|| {
            EngineError::InvalidInput("Step without gradients: run a backward pass first".into())
        })?;
        if !clip.is_finite() || !lr.is_finite() || !neuron_lr.is_finite() {
            return Err(EngineError::InvalidInput(format!(
                "Step needs finite factors, got lr {lr}, neuron_lr {neuron_lr}, clip {clip}"
            )));
        }
        // The clip is applied inside the update (`AdamStep::grad_scale`): no pass of its own.
        adam.step::<Ad<B>, M>(module, prefix, &grads, lr, neuron_lr, clip);
        Ok(())
    }
}

/// L2 norms of the gradients that are present (f32 square roots on the device, as
/// [`nsactor_model::train::square_sum`]`.sqrt()`), read back in one transfer.
pub(crate) fn norms<B: SnnOps, const N: usize>(gs: [Option<&Tensor<B, 1>>; N]) -> [Option<f64>; N] {
    let present: Vec<_> = gs
        .iter()
        .flatten()
        .map(|g| (*g).clone().into_primitive().tensor())
        .collect();
    let mut values = match present.is_empty() {
        true => Vec::new(),
        false => Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::square_sums(present)))
            .sqrt()
            .into_data()
            .convert::<f64>()
            .into_vec::<f64>()
            .expect("f64 values"),
    }
    .into_iter();
    std::array::from_fn(|i| gs[i].map(|_| values.next().expect("one norm per gradient")))
}

#[cfg(not(target_endian = "little"))]
compile_error!(
    "stage shards are written as the host's f32 bytes, which safetensors wants little-endian"
);

/// Serialises `module`'s parameters (named `{prefix}{name}`) and the Adam state of those names
/// (none without an optimizer).
pub(crate) fn save_stage<B: SnnOps, M: Params<B>>(
    module: &M,
    prefix: &str,
    adam: Option<&Adam<B>>,
    stage: &str,
) -> Result<Vec<u8>, EngineError> {
    snapshot_stage(module, prefix, adam, stage).serialise()
}

/// Keeps the handles of `module`'s parameters and of their Adam moments: a snapshot on the
/// device, taken without a copy or a wait. It stays valid while training goes on because
/// nothing writes into a tensor it holds: the optimizer and `sync` make new tensors, and a
/// backend reuses a buffer in place only when its handle is the only one.
pub(crate) fn snapshot_stage<B: SnnOps, M: Params<B>>(
    module: &M,
    prefix: &str,
    adam: Option<&Adam<B>>,
    stage: &str,
) -> StageSnap<B> {
    struct Dump<B: Backend>(Vec<(String, Vec<usize>, Tensor<B, 1>)>);
    impl<B: Backend> ParamVisitor<B> for Dump<B> {
        fn visit<const D: usize>(&mut self, name: &str, p: &Tensor<B, D>) {
            let n = p.shape().num_elements();
            self.0
                .push((name.to_string(), p.dims().to_vec(), p.clone().reshape([n])));
        }
    }
    let mut d = Dump(Vec::new());
    module.visit_params(prefix, &mut d);
    let mut snap = StageSnap {
        tensors: Vec::new(),
        adam_steps: BTreeMap::new(),
        stage: stage.to_string(),
    };
    for (name, shape, values) in d.0 {
        if let Some(st) = adam.and_then(|a| a.state.get(&name)) {
            snap.adam_steps.insert(name.clone(), st.step);
            for (kind, t) in [("exp_avg", &st.exp_avg), ("exp_avg_sq", &st.exp_avg_sq)] {
                snap.tensors
                    .push((format!("adam.{kind}.{name}"), shape.clone(), t.clone()));
            }
        }
        snap.tensors.push((name, shape, values));
    }
    snap
}

/// A stage's state as held tensor handles ([`snapshot_stage`]), serialised later.
pub(crate) struct StageSnap<B: Backend> {
    /// `(name in the file, shape, flat values)`, in the file's order.
    tensors: Vec<(String, Vec<usize>, Tensor<B, 1>)>,
    adam_steps: BTreeMap<String, u64>,
    stage: String,
}

impl<B: SnnOps> StageSnap<B> {
    /// The safetensors bytes of [`save_stage`], byte for byte what `safetensors::serialize`
    /// makes of the same tensors. The file is laid out first ([`layout`]) and each tensor read
    /// straight into its place ([`SnnOps::read_f32_into`]): one host copy of the state, no
    /// second buffer, at the 0.9B shape's 10.5 GB of stages.
    pub(crate) fn serialise(self) -> Result<Vec<u8>, EngineError> {
        // One metadata entry: safetensors keeps metadata in a HashMap, whose order would make
        // the bytes of identical states differ.
        let mut meta = std::collections::HashMap::new();
        meta.insert(
            META_KEY.to_string(),
            serde_json::json!({ "stage": self.stage, "adam_steps": self.adam_steps }).to_string(),
        );
        let mut tensors = self.tensors;
        // safetensors' order: by dtype (all f32 here), then by name.
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let shapes = tensors.iter().map(|(n, s, _)| (n.as_str(), s.as_slice()));
        let (header, spans) = layout(shapes, meta)
            .map_err(|e| EngineError::Backend(format!("serialise {}: {e}", self.stage)))?;
        let data_len = spans.last().map_or(0, |s| s.1);
        let mut out = crate::hostbuf::zeroed(header.len() + data_len);
        out[..header.len()].copy_from_slice(&header);
        let body = &mut out[header.len()..];
        for ((name, _, t), (at, end)) in tensors.into_iter().zip(spans) {
            B::read_f32_into(t.into_primitive().tensor(), &mut body[at..end])
                .map_err(|e| EngineError::Backend(format!("serialise {name}: {e}")))?;
        }
        Ok(out)
    }
}

/// A tensor's bytes in a file's data: `(start, end)`.
type Span = (usize, usize);

/// A safetensors file of `f32` tensors laid out as `safetensors::serialize` lays it out: the
/// header (its length, then the JSON padded with spaces to 8 bytes) and each tensor's byte span
/// in the data, in the order given (which must be safetensors' own: by name).
fn layout<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a [usize])>,
    meta: std::collections::HashMap<String, String>,
) -> Result<(Vec<u8>, Vec<Span>), String> {
    let mut at = 0;
    let mut infos = Vec::new();
    let mut spans = Vec::new();
    for (name, shape) in tensors {
        let end = at + shape.iter().product::<usize>() * 4;
        infos.push((
            name.to_string(),
            safetensors::tensor::TensorInfo {
                dtype: Dtype::F32,
                shape: shape.to_vec(),
                data_offsets: (at, end),
            },
        ));
        spans.push((at, end));
        at = end;
    }
    let metadata =
        safetensors::tensor::Metadata::new(Some(meta), infos).map_err(|e| e.to_string())?;
    let mut json = serde_json::to_string(&metadata)
        .map_err(|e| e.to_string())?
        .into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut header = (json.len() as u64).to_le_bytes().to_vec();
    header.extend_from_slice(&json);
    Ok((header, spans))
}

impl<B: SnnOps> StageSnapshot for StageSnap<B> {
    fn bytes(self: Box<Self>) -> Result<ShardBytes, EngineError> {
        Ok(self.serialise()?.into())
    }
}

/// Loads `module`'s parameters from `bytes` (plain names or the HF `model.` layout) and, for a
/// stage with an optimizer, the Adam state when the file has it for every parameter; otherwise
/// the optimizer starts fresh. Without an optimizer the file's Adam moments are never read.
/// Bytes that are no safetensors file or lack or misshape a tensor are refused input
/// ([`EngineError::InvalidInput`]): the same file would fail the same way again.
pub(crate) fn load_stage<B: SnnOps, M: Params<Ad<B>>>(
    module: &mut M,
    prefix: &str,
    adam: Option<&mut Adam<B>>,
    bytes: &[u8],
    stage: &str,
) -> Result<(), EngineError> {
    read_stage(module, prefix, adam, bytes).map_err(|e| match e {
        EngineError::InvalidInput(m) => EngineError::InvalidInput(format!("{stage}: {m}")),
        other => other,
    })
}

fn read_stage<B: SnnOps, M: Params<Ad<B>>>(
    module: &mut M,
    prefix: &str,
    adam: Option<&mut Adam<B>>,
    bytes: &[u8],
) -> Result<(), EngineError> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| EngineError::InvalidInput(format!("not a safetensors file: {e}")))?;
    let names: Vec<(String, Vec<usize>)> = {
        struct Names(Vec<(String, Vec<usize>)>);
        impl<B: Backend> ParamVisitor<B> for Names {
            fn visit<const D: usize>(&mut self, name: &str, p: &Tensor<B, D>) {
                self.0.push((name.to_string(), p.dims().to_vec()));
            }
        }
        let mut n = Names(Vec::new());
        module.visit_params(prefix, &mut n);
        n.0
    };
    let hf =
        st.tensor(&names[0].0).is_err() && st.tensor(&format!("{HF_PREFIX}{}", names[0].0)).is_ok();
    let file_prefix = if hf {
        format!("{HF_PREFIX}{prefix}")
    } else {
        prefix.to_string()
    };
    load_params(module, &st, &file_prefix).map_err(|e| EngineError::InvalidInput(e.to_string()))?;
    let Some(adam) = adam else {
        return Ok(());
    };

    let (_, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| EngineError::InvalidInput(format!("safetensors header: {e}")))?;
    let steps: BTreeMap<String, u64> = match meta.metadata().as_ref().and_then(|m| m.get(META_KEY))
    {
        Some(text) => {
            let v: serde_json::Value = serde_json::from_str(text)
                .map_err(|e| EngineError::InvalidInput(format!("`{META_KEY}` metadata: {e}")))?;
            serde_json::from_value(v["adam_steps"].clone())
                .map_err(|e| EngineError::InvalidInput(format!("`{META_KEY}` adam_steps: {e}")))?
        }
        None => BTreeMap::new(),
    };
    adam.state.clear();
    let complete = names.iter().all(|(n, _)| {
        steps.contains_key(n)
            && st.tensor(&format!("adam.exp_avg.{n}")).is_ok()
            && st.tensor(&format!("adam.exp_avg_sq.{n}")).is_ok()
    });
    if !complete {
        return Ok(());
    }
    let device = flat_params(module)[0].device();
    for (name, shape) in &names {
        let n: usize = shape.iter().product();
        let read = |key: String| -> Result<Tensor<B, 1>, EngineError> {
            let view = st
                .tensor(&key)
                .map_err(|e| EngineError::InvalidInput(format!("{key}: {e}")))?;
            let values = view_to_f32(&key, &view)
                .and_then(|v| finite(&key, v))
                .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
            if values.len() != n {
                return Err(EngineError::InvalidInput(format!(
                    "{key} has {} values, the parameter {n}",
                    values.len()
                )));
            }
            Ok(Tensor::from_data(
                TensorData::new(values, [n]),
                &device.clone(),
            ))
        };
        adam.state.insert(
            name.clone(),
            AdamState {
                exp_avg: read(format!("adam.exp_avg.{name}"))?,
                exp_avg_sq: read(format!("adam.exp_avg_sq.{name}"))?,
                step: steps[name],
            },
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ndarray::NdArray;
    use safetensors::tensor::TensorView;

    type B = NdArray<f32>;

    /// The shard laid out by hand and read in place is, byte for byte, the file
    /// `safetensors::serialize` writes from the same tensors (names out of order, an empty one,
    /// Adam moments and their steps in the metadata).
    #[test]
    fn a_serialised_stage_is_what_safetensors_writes() {
        let device = Default::default();
        let values = |n: usize, k: f32| (0..n).map(|i| i as f32 * k - 1.5).collect::<Vec<_>>();
        let parts: Vec<(String, Vec<usize>, Vec<f32>)> = vec![
            ("w.b".into(), vec![2, 3], values(6, 0.25)),
            ("adam.exp_avg.w.b".into(), vec![2, 3], values(6, -0.5)),
            ("a".into(), vec![5], values(5, 1e-3)),
            ("z.empty".into(), vec![0], vec![]),
        ];
        let snap = StageSnap::<B> {
            tensors: parts
                .iter()
                .map(|(n, s, v)| {
                    let t = Tensor::from_data(TensorData::new(v.clone(), [v.len()]), &device);
                    (n.clone(), s.clone(), t)
                })
                .collect(),
            adam_steps: BTreeMap::from([("w.b".to_string(), 7)]),
            stage: "layer-000".into(),
        };
        let bytes: Vec<Vec<u8>> = parts
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views = parts.iter().zip(&bytes).map(|((n, s, _), b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        });
        let mut meta = std::collections::HashMap::new();
        meta.insert(
            META_KEY.to_string(),
            serde_json::json!({ "stage": "layer-000", "adam_steps": {"w.b": 7} }).to_string(),
        );
        let expected = safetensors::serialize(views, Some(meta)).unwrap();
        assert_eq!(snap.serialise().unwrap(), expected);
    }
}
