//! `nsactor verify batch-invariance`: a session's logits must not depend on the cohort it is
//! decoded in (issue 29). One prompt is decoded greedily alone, then inside cohorts of other
//! sessions with other prompts — prefills of its length batched with it, every decoding step
//! one batched pass of the whole cohort (prefills in passes of at most `PASS_FRAME_ROWS` frame
//! rows, as the batcher runs them), straight through the stages — and its tokens and
//! logits are compared with the lone run's, bit for bit. Tokens are chosen on the device, as
//! the server chooses them (`SessionSample`, greedy), and each is checked against the host's
//! argmax of the logits that came back with it.

use nsactor_plugin_api::{
    ComputeBackend, DeviceTensor, EngineError, IdAllocator, InitialWeights, ModelConfig,
    OptimizerKind, PicksBuf, SessionId, Stage, StageCall, StageKind, StageSpec, Tokens,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// What one cohort size showed.
#[derive(Debug, Clone, PartialEq)]
pub struct CohortCheck {
    /// Sessions in the cohort (ours included).
    pub sessions: usize,
    /// Decoding steps whose greedy token differs from the lone run's.
    pub tokens_differing: usize,
    /// Logits (over every step) whose bits differ from the lone run's, and of how many.
    pub logits_differing: usize,
    pub logits: usize,
    /// The largest absolute difference of a logit.
    pub max_abs_diff: f32,
    /// Device-chosen greedy tokens (every session, every step) unlike the host's argmax.
    pub picks_differing: usize,
}

impl CohortCheck {
    /// Bit-identical logits (hence tokens).
    pub fn invariant(&self) -> bool {
        self.logits_differing == 0 && self.tokens_differing == 0 && self.picks_differing == 0
    }
}

/// What [`decode_cohort`] returns: each session's logits per step, and how many of the
/// device's greedy tokens differed from the host's argmax of those logits.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub logits: Vec<Vec<Vec<f32>>>,
    pub picks_differing: usize,
}

/// The model's stages on one device, driven directly.
struct Stages {
    backend: Arc<dyn ComputeBackend>,
    edge: Box<dyn Stage>,
    layers: Vec<Box<dyn Stage>>,
}

impl Stages {
    fn open(
        backend: Arc<dyn ComputeBackend>,
        model: &ModelConfig,
        seed: u64,
    ) -> Result<Self, EngineError> {
        let spec = |kind| StageSpec {
            kind,
            device: 0,
            model: model.clone(),
            seed,
            optimizer: Some(OptimizerKind::Adam),
            weights: InitialWeights::Seeded,
        };
        let edge = backend.open_stage(&spec(StageKind::Edge))?;
        let layers = (0..model.num_layers)
            .map(|i| backend.open_stage(&spec(StageKind::Layer(i))))
            .collect::<Result<_, _>>()?;
        Ok(Stages {
            backend,
            edge,
            layers,
        })
    }

    /// One pass of `sessions` feeding `ids` (`[sessions, t]` row-major): each session's
    /// last-position logits and its greedy token chosen on the device.
    fn pass(
        &mut self,
        sessions: &[SessionId],
        ids: &[i64],
        t: usize,
    ) -> Result<Vec<(Vec<f32>, i64)>, EngineError> {
        let tokens = Tokens {
            ids,
            batch: sessions.len(),
            seq_len: t,
        };
        let mut h: DeviceTensor = self
            .edge
            .call(StageCall::SessionEmbed { tokens })?
            .into_tensor("SessionEmbed")?;
        for l in &mut self.layers {
            h = l
                .call(StageCall::SessionForward { sessions, h })?
                .into_tensor("SessionForward")?;
        }
        let mut picks = PicksBuf::new();
        for _ in sessions {
            // Greedy, logits back: what a feed without a pick gets.
            picks.push(&crate::cohort::row_pick(None));
        }
        let out = self
            .edge
            .call(StageCall::SessionSample {
                sessions,
                h,
                picks: picks.picks(),
            })?
            .tensors;
        let [picked, logits] = <[DeviceTensor; 2]>::try_from(out).map_err(|o| {
            EngineError::Backend(format!("SessionSample answered {} tensors", o.len()))
        })?;
        let picked = self.backend.to_host(&picked)?.data;
        let host = self.backend.to_host(&logits)?.data;
        let v = host.len() / sessions.len();
        Ok(host
            .chunks(v)
            .zip(picked)
            .map(|(l, p)| (l.to_vec(), p as i64))
            .collect())
    }
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best })
}

/// Decodes `prompts` greedily as one cohort for `steps` tokens on fresh stages (`seed`):
/// prefills batched by prompt length, then each step one pass of all sessions.
pub fn decode_cohort(
    backend: Arc<dyn ComputeBackend>,
    model: &ModelConfig,
    seed: u64,
    prompts: &[Vec<i64>],
    steps: usize,
) -> Result<Decoded, EngineError> {
    let mut m = Stages::open(backend, model, seed)?;
    let ids = IdAllocator::default();
    let sessions: Vec<SessionId> = prompts.iter().map(|_| ids.session()).collect();
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    let mut picked: Vec<i64> = vec![0; prompts.len()];
    let mut picks_differing = 0;
    let mut take = |i: usize, (row, token): (Vec<f32>, i64), picked: &mut [i64]| {
        picks_differing += usize::from(argmax(&row) as i64 != token);
        picked[i] = token;
        logits[i].push(row);
    };
    let mut by_len: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, p) in prompts.iter().enumerate() {
        by_len.entry(p.len()).or_default().push(i);
    }
    // Prefills in passes of at most PASS_FRAME_ROWS frame rows, as the batcher runs them.
    let budget = crate::batcher::PASS_FRAME_ROWS / model.k.max(1);
    for (t, members) in by_len {
        for group in members.chunks((budget / t).max(1)) {
            let s: Vec<SessionId> = group.iter().map(|&i| sessions[i]).collect();
            let ids: Vec<i64> = group.iter().flat_map(|&i| prompts[i].clone()).collect();
            for (out, &i) in m.pass(&s, &ids, t)?.into_iter().zip(group) {
                take(i, out, &mut picked);
            }
        }
    }
    for _ in 1..steps {
        let next = picked.clone();
        for (i, out) in m.pass(&sessions, &next, 1)?.into_iter().enumerate() {
            take(i, out, &mut picked);
        }
    }
    Ok(Decoded {
        logits,
        picks_differing,
    })
}

/// A prompt of `len` ids in `5..vocab` drawn from `seed` (ids below 5 are the specials).
fn prompt(vocab: usize, seed: usize, len: usize) -> Vec<i64> {
    let span = vocab.saturating_sub(5).max(1);
    (0..len)
        .map(|j| 5 + ((seed * 131 + j * 17) % span) as i64)
        .collect()
}

/// Our prompt decoded alone, then inside each of `cohorts` (sizes, ours included); the others'
/// prompts alternate between our length (prefilled with us) and other lengths.
pub fn check(
    backend: Arc<dyn ComputeBackend>,
    model: &ModelConfig,
    seed: u64,
    cohorts: &[usize],
    steps: usize,
) -> Result<Vec<CohortCheck>, EngineError> {
    // A cohort of one is the prompt alone, compared with itself: it proves nothing.
    if steps == 0 || cohorts.iter().any(|&c| c < 2) {
        return Err(EngineError::InvalidInput(
            "batch invariance needs at least one step and cohorts of at least two sessions \
             (ours and another; a cohort of one is the prompt alone, compared with itself)"
                .into(),
        ));
    }
    let v = model.vocab_size;
    let ours = prompt(v, 1, 6);
    let alone = decode_cohort(
        backend.clone(),
        model,
        seed,
        std::slice::from_ref(&ours),
        steps,
    )?;
    let (alone_picks, alone) = (alone.picks_differing, alone.logits[0].clone());
    cohorts
        .iter()
        .map(|&n| {
            let mut prompts: Vec<Vec<i64>> = (1..n)
                .map(|i| prompt(v, 1 + i, if i % 2 == 1 { 6 } else { 3 + i % 5 }))
                .collect();
            prompts.insert(n / 2, ours.clone());
            let mut d = decode_cohort(backend.clone(), model, seed, &prompts, steps)?;
            let mine = d.logits.swap_remove(n / 2);
            let mut c = CohortCheck {
                sessions: n,
                tokens_differing: 0,
                logits_differing: 0,
                logits: 0,
                max_abs_diff: 0.0,
                picks_differing: alone_picks + d.picks_differing,
            };
            for (a, b) in alone.iter().zip(&mine) {
                c.tokens_differing += usize::from(argmax(a) != argmax(b));
                c.logits += a.len();
                for (x, y) in a.iter().zip(b) {
                    if x.to_bits() != y.to_bits() {
                        c.logits_differing += 1;
                        c.max_abs_diff = c.max_abs_diff.max((x - y).abs());
                    }
                }
            }
            Ok(c)
        })
        .collect()
}
