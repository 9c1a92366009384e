//! Tokens chosen on the device (`StageCall::SessionSample`) against the host's reference
//! picker (`TokenPicker`) on the same logits, through the real stages of the tiny model on the
//! CPU backend: greedy with logit biases, bans and all three penalties picks the very same
//! token at every step; sampled rows stay inside the host's top-k / top-p sets.

use nsactor_engine::backend::{self, EMBEDDED};
use nsactor_engine::config::tiny_model;
use nsactor_engine::decode::{SamplingParams, TokenPicker};
use nsactor_plugin_api::{
    ComputeBackend, IdAllocator, InitialWeights, OptimizerKind, PickParams, PicksBuf, RowPick,
    SessionId, Stage, StageCall, StageKind, StageSpec, Tokens,
};
use std::sync::Arc;

struct Model {
    backend: Arc<dyn ComputeBackend>,
    edge: Box<dyn Stage>,
    layers: Vec<Box<dyn Stage>>,
}

impl Model {
    fn open() -> Self {
        let backend = backend::open(EMBEDDED, &[]).unwrap();
        let model = tiny_model();
        let spec = |kind| StageSpec {
            kind,
            device: 0,
            model: model.clone(),
            seed: 5,
            optimizer: Some(OptimizerKind::Adam),
            weights: InitialWeights::Seeded,
        };
        let edge = backend.open_stage(&spec(StageKind::Edge)).unwrap();
        let layers = (0..model.num_layers)
            .map(|i| backend.open_stage(&spec(StageKind::Layer(i))).unwrap())
            .collect();
        Model {
            backend,
            edge,
            layers,
        }
    }

    /// One pass of `sessions` (one row each) feeding `ids` (`t` per session), picking on the
    /// device: each row's `(token, logprob, logits)`.
    fn pass(
        &mut self,
        sessions: &[SessionId],
        ids: &[i64],
        t: usize,
        rows: &[RowPick<'_>],
    ) -> Vec<(i64, f32, Vec<f32>)> {
        let tokens = Tokens {
            ids,
            batch: sessions.len(),
            seq_len: t,
        };
        let mut h = self
            .edge
            .call(StageCall::SessionEmbed { tokens })
            .unwrap()
            .into_tensor("SessionEmbed")
            .unwrap();
        for l in &mut self.layers {
            h = l
                .call(StageCall::SessionForward { sessions, h })
                .unwrap()
                .into_tensor("SessionForward")
                .unwrap();
        }
        let mut buf = PicksBuf::new();
        rows.iter().for_each(|r| buf.push(r));
        let out = self
            .edge
            .call(StageCall::SessionSample {
                sessions,
                h,
                picks: buf.picks(),
            })
            .unwrap()
            .tensors;
        let picked = self.backend.to_host(&out[0]).unwrap().data;
        let logits = self.backend.to_host(&out[1]).unwrap().data;
        let n = sessions.len();
        let v = logits.len() / n;
        (0..n)
            .map(|i| {
                (
                    picked[i] as i64,
                    picked[n + i],
                    logits[i * v..(i + 1) * v].to_vec(),
                )
            })
            .collect()
    }
}

fn params(s: &SamplingParams, step: u64) -> PickParams {
    PickParams {
        temperature: s.temperature,
        top_k: s.top_k as u32,
        top_p: s.top_p,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        step,
        want_logits: true,
    }
}

/// Four sessions decode 10 steps together, each greedy under other settings; at every step
/// each device token equals the host picker's on the logits the device returned.
#[test]
fn device_greedy_picks_equal_the_host_picker_under_biases_bans_and_penalties() {
    let mut m = Model::open();
    let ids = IdAllocator::default();
    let sessions: Vec<SessionId> = (0..4).map(|_| ids.session()).collect();
    let settings = [
        SamplingParams::greedy(),
        SamplingParams {
            repetition_penalty: 1.8,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            presence_penalty: 1.5,
            frequency_penalty: 0.7,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: -0.5,
            frequency_penalty: 1.1,
            ..SamplingParams::greedy()
        },
    ];
    let bias: Vec<(u32, f32)> = vec![(0, f32::NEG_INFINITY), (3, f32::NEG_INFINITY), (40, 2.5)];
    let prompt: Vec<i64> = vec![7, 19, 23, 7, 40, 11];
    let mut pickers: Vec<TokenPicker> = settings.iter().map(|s| TokenPicker::new(*s)).collect();
    let mut history: Vec<Vec<i64>> = vec![prompt.clone(); 4];
    let mut generated: Vec<Vec<i64>> = vec![Vec::new(); 4];
    let mut feed: Vec<i64> = prompt.repeat(4);
    let mut t = prompt.len();
    let mut distinct = std::collections::BTreeSet::new();
    for step in 0..10 {
        let rows: Vec<RowPick> = (0..4)
            .map(|i| RowPick {
                params: params(&settings[i], step),
                history: &history[i],
                generated: &generated[i],
                bias: &bias,
            })
            .collect();
        let out = m.pass(&sessions, &feed, t, &rows);
        let mut next = Vec::new();
        for (i, (token, logprob, raw)) in out.into_iter().enumerate() {
            let mut l = raw.clone();
            for &(id, b) in &bias {
                l[id as usize] += b;
            }
            let host = pickers[i].pick(&mut l, &history[i]);
            assert_eq!(token, host, "session {i} step {step}");
            // The log-probability is of the raw logits.
            let max = raw.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let z: f64 = raw.iter().map(|&x| (x as f64 - max).exp()).sum();
            let want = raw[token as usize] as f64 - max - z.ln();
            assert!((logprob as f64 - want).abs() < 1e-4, "{logprob} vs {want}");
            history[i].push(token);
            generated[i].push(token);
            distinct.insert((i, token));
            next.push(token);
        }
        feed = next;
        t = 1;
    }
    // The settings do make the sessions choose differently.
    assert!(distinct.len() > 10, "{distinct:?}");
}

/// Sampled rows: every device token lies inside the host's top-k ∩ top-p set of its logits,
/// and a row's draws repeat exactly with its seed.
#[test]
fn device_samples_stay_inside_the_host_sets_and_repeat_with_their_seed() {
    let run = || {
        let mut m = Model::open();
        let ids = IdAllocator::default();
        let sessions: Vec<SessionId> = (0..4).map(|_| ids.session()).collect();
        let settings = [
            SamplingParams {
                temperature: 1.0,
                top_k: 5,
                seed: 1,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                temperature: 0.7,
                top_p: 0.5,
                seed: 2,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                temperature: 1.3,
                top_k: 20,
                top_p: 0.8,
                seed: 3,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                temperature: 1.5,
                min_p: 0.2,
                top_p: 0.95,
                seed: 4,
                ..SamplingParams::greedy()
            },
        ];
        let mut feed: Vec<i64> = [9, 10, 11].repeat(4);
        let mut t = 3;
        let mut tokens = Vec::new();
        for step in 0..12 {
            let rows: Vec<RowPick> = settings
                .iter()
                .map(|s| RowPick {
                    params: params(s, step),
                    history: &[],
                    generated: &[],
                    bias: &[],
                })
                .collect();
            let out = m.pass(&sessions, &feed, t, &rows);
            for (i, (token, _, l)) in out.iter().enumerate() {
                let s = &settings[i];
                let allowed = allowed(l, s.temperature, s.top_k, s.top_p, s.min_p);
                assert!(
                    allowed.contains(&(*token as usize)),
                    "row {i}: {token} not in {allowed:?}"
                );
            }
            feed = out.iter().map(|o| o.0).collect();
            tokens.push(feed.clone());
            t = 1;
        }
        tokens
    };
    assert_eq!(run(), run());
}

/// The host's kept set: the top k by logit, those at least `min_p` as likely as the best
/// (with a little slack for the device's f32), then the smallest prefix reaching p.
fn allowed(l: &[f32], temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..l.len()).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let max = l[order[0]] as f64;
    let mut w: Vec<f64> = order
        .iter()
        .map(|&i| ((l[i] as f64 - max) / temperature as f64).exp())
        .collect();
    let keep = w
        .iter()
        .take_while(|&&q| q >= min_p as f64 * (1.0 - 1e-5))
        .count();
    order.truncate(keep);
    w.truncate(keep);
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    let keep = w
        .iter()
        .position(|&q| {
            acc += q / total;
            acc >= top_p as f64 - 1e-6
        })
        .map_or(order.len(), |i| i + 1);
    order.truncate(keep);
    order
}
