//! `nsactor verify tiny-a`: the reference's golden `tiny_a` run replayed on any backend —
//! forward CE, one training step (loss, compensated gradient norm, every parameter after
//! clip + Adam) and greedy decoding — checked against the fixture's tolerances. It runs through
//! the actor pipeline: supervisor, edge and layer actors on their worker threads.

use nsactor_checkpoint::weights::merge_params;
use nsactor_decoding::{Pipeline, PipelinePlan};
use nsactor_engine::engine::{StagedModel, StepParams};
use nsactor_plugin_api::{Batch, ComputeBackend, EngineError, ModelConfig, OptimizerKind};
use safetensors::SafeTensors;
use std::sync::Arc;

/// Tolerances of `shared/fixtures/README.md` (fp32).
pub const CE_ABS: f64 = 1e-4;
pub const NORM_REL: f64 = 1e-5;
pub const PARAM_REL: f64 = 1e-4;
/// The fp32 bound of the halting biases' gradients (see [`TinyAReport::worst_halt_grad`]).
pub const HALT_BIAS_REL: f64 = 5e-4;
/// Tokens the fixture generates after its prompt.
const GENERATED: usize = 8;

/// The golden run's inputs and expectations.
pub struct TinyAFixture<'a> {
    st: SafeTensors<'a>,
    meta: serde_json::Value,
}

fn bad(m: impl Into<String>) -> EngineError {
    EngineError::InvalidInput(format!("tiny_a fixture: {}", m.into()))
}

impl<'a> TinyAFixture<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Self, EngineError> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        let (_, m) = SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
        let text = m
            .metadata()
            .as_ref()
            .and_then(|m| m.get("meta"))
            .ok_or_else(|| bad("no `meta` metadata"))?;
        let meta = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        Ok(TinyAFixture { st, meta })
    }

    fn num(&self, key: &str) -> Result<f64, EngineError> {
        self.meta[key]
            .as_f64()
            .ok_or_else(|| bad(format!("meta `{key}` missing")))
    }

    /// The fixture's model (its `config` uses the reference's keys and the leak output).
    pub fn model(&self) -> Result<ModelConfig, EngineError> {
        nsactor_checkpoint::export::model_from_hf(&self.meta["config"])
            .map_err(|e| bad(e.to_string()))
    }

    pub fn f32s(&self, key: &str) -> Result<Vec<f32>, EngineError> {
        let v = self
            .st
            .tensor(key)
            .map_err(|e| bad(format!("{key}: {e}")))?;
        Ok(f32_values(&v))
    }

    pub fn i64s(&self, key: &str) -> Result<Vec<i64>, EngineError> {
        let v = self
            .st
            .tensor(key)
            .map_err(|e| bad(format!("{key}: {e}")))?;
        Ok(v.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect())
    }

    /// The tensors under `prefix` (`param.`, `after.`), renamed to plain names, as a model file.
    pub fn weights(&self, prefix: &str) -> Result<Vec<u8>, EngineError> {
        let views: Vec<_> = self
            .st
            .tensors()
            .into_iter()
            .filter_map(|(n, v)| n.strip_prefix(prefix).map(|s| (s.to_string(), v)))
            .collect();
        safetensors::serialize(views, None).map_err(|e| bad(e.to_string()))
    }

    pub fn param_names(&self) -> Vec<String> {
        let mut n: Vec<String> = self
            .st
            .names()
            .into_iter()
            .filter_map(|n| n.strip_prefix("param.").map(String::from))
            .collect();
        n.sort();
        n
    }

    pub fn batch(&self) -> Result<Batch, EngineError> {
        let dim = |k: &str| {
            self.meta[k]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| bad(format!("meta `{k}` missing")))
        };
        Ok(Batch {
            batch: dim("batch")?,
            seq_len: dim("seq_len")?,
            inputs: self.i64s("input.x")?,
            targets: self.i64s("input.y")?,
            loss_mask: self.f32s("input.mask")?,
        })
    }
}

/// The little-endian f32 values of a safetensors view (the fixture and our shards are f32).
fn f32_values(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// `‖a − b‖ / ‖b‖`.
pub fn rel_norm_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// What one replay produced and how far it is from the fixture.
#[derive(Debug, Clone)]
pub struct TinyAReport {
    pub ce_before: f64,
    pub ce_want: f64,
    pub loss: f64,
    pub loss_want: f64,
    pub grad_norm: f64,
    pub grad_norm_want: f64,
    /// The parameter farthest from `after.*` and its relative error.
    pub worst_param: (String, f64),
    /// Every parameter's gradient error, in the fixture's order: the gradient as Adam received
    /// it (compensated and clipped, read back from the first moment: `m₁ = (1 − β₁)·g`)
    /// against the fixture's `cgrad.*` times the clip factor.
    pub grad_errors: Vec<(String, f64)>,
    pub greedy: Vec<i64>,
    pub greedy_want: Vec<i64>,
    /// Every stage's bytes after the step (parameters and optimizer state).
    pub shards: Vec<Vec<u8>>,
}

/// The bounds of a bf16 run (bf16 GEMM inputs, fp32 accumulation): 1e-2 relative on the
/// outputs (CE, loss) and on the compensated gradient's norm. Each parameter's gradient, the
/// greedy tokens and the parameters after the Adam step are reported, not bounded: tiny_a's
/// gradients are not continuous at bf16's resolution — rounding only its weights to bf16 and
/// computing the rest in exact f32 moves every one of its 67 gradients by more than 1e-2 (up
/// to 0.49) while the loss moves by 1e-4 (the model crate's test
/// `bf16_rounded_weights_move_the_gradients_beyond_1e_2_but_not_the_loss`): spikes are step
/// functions, and a membrane pushed across its threshold changes the gradients upstream of it.
pub const BF16_REL: f64 = 1e-2;

/// The halting heads' biases: single numbers whose gradient sums nearly cancelling terms, so
/// the fixture's own f32 value carries ≈ 1e-4 relative noise (the model's fixture test measured
/// 0.7e-4 to 2.1e-4 between summation orders in f64); held to [`HALT_BIAS_REL`] in fp32.
fn is_halt_bias(name: &str) -> bool {
    name.ends_with("_halt.bias")
}

impl TinyAReport {
    /// The parameter (halting biases apart) whose gradient is farthest from the fixture's.
    pub fn worst_grad(&self) -> (&str, f64) {
        self.worst_grad_where(|n| !is_halt_bias(n))
    }

    /// The halting bias whose gradient is farthest from the fixture's.
    pub fn worst_halt_grad(&self) -> (&str, f64) {
        self.worst_grad_where(is_halt_bias)
    }

    fn worst_grad_where(&self, keep: impl Fn(&str) -> bool) -> (&str, f64) {
        self.grad_errors
            .iter()
            .filter(|(n, _)| keep(n))
            .fold(("", 0.0), |w, (n, e)| {
                if *e > w.1 || !e.is_finite() {
                    (n.as_str(), *e)
                } else {
                    w
                }
            })
    }

    /// Each check as `(name, value, bound, passed)`, at the fp32 bounds.
    pub fn checks(&self) -> Vec<(&'static str, f64, f64, bool)> {
        self.checks_at(false)
    }

    /// The checks at the fp32 bounds, or at the bf16 ones ([`BF16_REL`]).
    pub fn checks_at(&self, bf16: bool) -> Vec<(&'static str, f64, f64, bool)> {
        let check = |name, value: f64, bound| (name, value, bound, value <= bound);
        let norm = (self.grad_norm - self.grad_norm_want).abs() / self.grad_norm_want;
        if bf16 {
            let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-30);
            return vec![
                check(
                    "forward CE rel",
                    rel(self.ce_before, self.ce_want),
                    BF16_REL,
                ),
                check("step loss rel", rel(self.loss, self.loss_want), BF16_REL),
                check("compensated grad norm rel", norm, BF16_REL),
            ];
        }
        let greedy = (self.greedy == self.greedy_want) as u8 as f64;
        vec![
            check(
                "forward CE |diff|",
                (self.ce_before - self.ce_want).abs(),
                CE_ABS,
            ),
            check(
                "step loss |diff|",
                (self.loss - self.loss_want).abs(),
                CE_ABS,
            ),
            check("compensated grad norm rel", norm, NORM_REL),
            check(
                "worst parameter gradient rel",
                self.worst_grad().1,
                PARAM_REL,
            ),
            check(
                "worst halting-bias gradient rel",
                self.worst_halt_grad().1,
                HALT_BIAS_REL,
            ),
            check(
                "worst parameter after step rel",
                self.worst_param.1,
                PARAM_REL,
            ),
            ("greedy tokens equal", greedy, 1.0, greedy == 1.0),
        ]
    }

    pub fn passed(&self) -> bool {
        self.checks().iter().all(|c| c.3)
    }

    /// Generated tokens (after the shared prompt) equal to the fixture's, and how many there are.
    pub fn greedy_agreement(&self) -> (usize, usize) {
        let prompt = self.greedy_want.len().saturating_sub(GENERATED);
        let same = self
            .greedy
            .iter()
            .zip(&self.greedy_want)
            .skip(prompt)
            .filter(|(a, b)| a == b)
            .count();
        (same, self.greedy_want.len() - prompt)
    }
}

/// Replays `tiny_a` on `backend` through the actor pipeline with `stages` pipeline stages
/// spread over `devices` (stage `s` on `devices[s % len]`, the edge on the first).
pub fn tiny_a(
    backend: Arc<dyn ComputeBackend>,
    fixture: &[u8],
    stages: usize,
    devices: &[usize],
) -> Result<TinyAReport, EngineError> {
    let fx = TinyAFixture::parse(fixture)?;
    let adam = &fx.meta["adam"];
    let lr = adam["lr"].as_f64().unwrap_or(1e-3);
    let max_grad_norm = adam["clip"].as_f64().unwrap_or(1.0);
    let model = fx.model()?;
    let plan = PipelinePlan::balanced(model.num_layers, stages, devices)
        .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
    let mut staged = StagedModel::open(
        backend,
        &model,
        0,
        OptimizerKind::Adam,
        Some(plan.placement()),
    )?;
    staged.load_model_bytes(&fx.weights("param.")?)?;
    let train = nsactor_engine::config::RunConfig::load(None)
        .expect("the embedded config parses")
        .train;
    let mut m = Pipeline::start(staged, plan, train, None).map_err(EngineError::from)?;
    let batch = fx.batch()?;
    let ce_before = m.eval_ce(&batch)?;
    let stats = m
        .train_step(
            &[batch],
            &StepParams {
                lr,
                neuron_lr: adam["neuron_lr"].as_f64().unwrap_or(lr * 10.0),
                ponder_weight: 0.01,
                max_grad_norm,
            },
        )
        .map_err(EngineError::from)?;
    let shards = m.save_stages().map_err(EngineError::from)?;
    let merged = merge_params(&shards).map_err(|e| EngineError::Backend(e.to_string()))?;
    let st = SafeTensors::deserialize(&merged).map_err(|e| EngineError::Backend(e.to_string()))?;
    let mut worst = (String::new(), 0.0f64);
    for name in fx.param_names() {
        let got: Vec<f32> = match st.tensor(&name) {
            Ok(v) => f32_values(&v),
            Err(_) => {
                return Err(EngineError::Backend(format!(
                    "the model has no parameter `{name}`"
                )));
            }
        };
        let e = rel_norm_err(&got, &fx.f32s(&format!("after.{name}"))?);
        if e > worst.1 || !e.is_finite() {
            worst = (name, e);
        }
    }
    let beta1 = adam["betas"][0].as_f64().unwrap_or(0.9);
    let clip = nsactor_plugin_api::optim::clip_factor(
        fx.num("grad_total_norm_before_clip")?,
        max_grad_norm,
    );
    let shard_views = shards
        .iter()
        .map(|b| SafeTensors::deserialize(b).map_err(|e| EngineError::Backend(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    let mut grad_errors = Vec::new();
    for name in fx.param_names() {
        let key = format!("adam.exp_avg.{name}");
        let Some(view) = shard_views.iter().find_map(|st| st.tensor(&key).ok()) else {
            return Err(EngineError::Backend(format!(
                "no Adam first moment `{key}` in the stage shards"
            )));
        };
        let got: Vec<f32> = f32_values(&view)
            .into_iter()
            .map(|m| m / (1.0 - beta1) as f32)
            .collect();
        let want: Vec<f32> = fx
            .f32s(&format!("cgrad.{name}"))?
            .into_iter()
            .map(|g| g * clip as f32)
            .collect();
        let e = rel_norm_err(&got, &want);
        grad_errors.push((name, e));
    }
    let greedy = m.generate_greedy(&fx.i64s("gen.prompt")?, GENERATED, None, &[])?;
    Ok(TinyAReport {
        ce_before,
        ce_want: fx.num("ce_masked_mean")?,
        loss: stats.loss,
        loss_want: fx.num("loss")?,
        grad_norm: stats.grad_norm,
        grad_norm_want: fx.num("grad_total_norm_before_clip")?,
        worst_param: worst,
        grad_errors,
        greedy,
        greedy_want: fx.i64s("gen.greedy")?,
        shards,
    })
}
