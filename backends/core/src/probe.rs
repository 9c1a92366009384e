//! The interpretability calls (`nsactor analyze`): a layer's [`Probe`] — its output, every
//! token's E[K] and the distribution of its hidden neurons' selective β(t) reduced on the
//! device — and the edge's per-position cross entropy. Nothing is kept and no state changes.

use crate::wrap;
use burn::tensor::{Int, Tensor, TensorData};
use nsactor_kernels::SnnOps;
use nsactor_model::model::cross_entropy_ignore_pad;
use nsactor_model::{Edge, LayerState, ModelConfig, SnnDecoderLayer};
use nsactor_plugin_api::{BETA_BINS, EngineError, Probe, Reply};

/// `h` `[T, B, D]` through `layer` from membranes at rest.
pub(crate) fn probe_layer<B: SnnOps>(
    layer: &SnnDecoderLayer<B>,
    cfg: &ModelConfig,
    h: Tensor<B, 3>,
) -> Reply {
    let b = h.dims()[1];
    let state = LayerState::zeros(cfg, b, &h.device());
    let (out, beta) = layer.probe(h, state, cfg);
    let [ek1, ek2] = out.expected_k;
    let [tk, rows, dn] = beta.dims();
    let beta_mean = beta
        .clone()
        .reshape([tk * rows, dn])
        .mean_dim(0)
        .reshape([1, 1, dn]);
    Probe {
        h: wrap(out.h),
        expected_k: wrap(Tensor::stack(vec![ek1, ek2], 0)),
        beta_hist: wrap(histogram(beta).reshape([1, 1, BETA_BINS])),
        beta_mean: wrap(beta_mean),
    }
    .into()
}

/// Counts of `x` (values in `[0, 1]`) in [`BETA_BINS`] equal bins, the last closed: the
/// number at or above each lower edge, differenced. Sums of 0/1 values in f32: exact while a
/// partial sum stays below 2²⁴, within a count or two of 10⁸ beyond.
fn histogram<B: SnnOps>(x: Tensor<B, 3>) -> Tensor<B, 1> {
    let device = x.device();
    let mut at_or_above: Vec<Tensor<B, 1>> = (0..BETA_BINS)
        .map(|i| {
            x.clone()
                .greater_equal_elem(i as f64 / BETA_BINS as f64)
                .float()
                .sum()
        })
        .collect();
    at_or_above.push(Tensor::zeros([1], &device));
    let cum = Tensor::cat(at_or_above, 0);
    cum.clone().narrow(0, 0, BETA_BINS) - cum.narrow(0, 1, BETA_BINS)
}

/// The surprisal `−ln p(target)` of every position of `h` `[T, B, D]`: `[1, B, T]` (0 where the
/// target is padding, id 0).
pub(crate) fn token_losses<B: SnnOps>(
    edge: &Edge<B>,
    cfg: &ModelConfig,
    h: Tensor<B, 3>,
    targets: &[i64],
) -> Result<Reply, EngineError> {
    let [t, b, d] = h.dims();
    if d != cfg.d || t * b == 0 || targets.len() != t * b {
        return Err(EngineError::InvalidInput(format!(
            "TokenLosses: h [{t}, {b}, {d}] needs D = {} and {} targets, got {}",
            cfg.d,
            t * b,
            targets.len()
        )));
    }
    let vocab = cfg.vocab_size as i64;
    if let Some(bad) = targets.iter().find(|&&id| id < 0 || id >= vocab) {
        return Err(EngineError::InvalidInput(format!(
            "target id {bad} is outside the vocabulary (0..{vocab})"
        )));
    }
    let device = h.device();
    let (logits, _) = edge.decode(h, Tensor::zeros([b, d], &device), cfg);
    let targets =
        Tensor::<B, 2, Int>::from_data(TensorData::new(targets.to_vec(), [b, t]), &device);
    let ce = cross_entropy_ignore_pad(logits, targets);
    Ok(Reply::tensor(wrap(ce.reshape([1, b, t]))))
}
