//! Choosing decoding rows' next tokens on the device (`StageCall::SessionSample`): only token
//! ids and their log-probabilities cross to the host, not `[B, V]` logits.
//!
//! The arithmetic follows the host's reference picker (`nsactor_engine::decode::TokenPicker`)
//! step for step, in f32: logit biases (−∞ bans), then the presence and frequency penalties over
//! the generated tokens, then the repetition penalty over prompt and generated tokens, then
//! greedy (`argmax`, bit-identical to the host's on the same logits) or sampling. Sampling
//! divides by the temperature, keeps the top k (a 32-step bisection for the k-th largest value
//! per row), the tokens at least `min_p` times as likely as the most likely one, and the top p
//! (the same for the probability threshold whose mass reaches p), and
//! draws by Gumbel-max: `argmax(l/T + g)` with `g = −ln(−ln u)`, which picks token i with
//! probability `softmax(l/T)_i`. `u` comes from a counter-based generator — a four-round
//! Feistel permutation of the token index keyed by the row's seed and step, in 16-bit halves so
//! every product stays below 2³¹ on any integer width — so a row's draw depends on its own
//! seed and position only, never on its cohort, and is the same on every backend.
//!
//! Where the device and the host may differ: which of two logits within the bisection's
//! resolution (range / 2³²) is the k-th largest, and top-p sets whose f32 mass sits within
//! rounding of p (the host sums in f64); sampled draws come from different generators.

use burn::tensor::{
    ElementConversion, IndexingUpdateOp, Int, Tensor, TensorData, activation, backend::Backend,
};
use nsactor_plugin_api::PickRow;

/// Bisection steps of the top-k and top-p thresholds.
const BISECT: usize = 32;

/// Every row's next token and its log-probability under `logits` (the model's own
/// distribution): `[2, B]` f32, ids in row 0.
pub fn pick<B: Backend>(logits: Tensor<B, 2>, rows: &[PickRow<'_>]) -> Tensor<B, 2> {
    let device = logits.device();
    let [b, v] = logits.dims();
    let raw = logits.clone();
    let params: Vec<f32> = rows
        .iter()
        .flat_map(|r| {
            [
                r.temperature,
                if r.top_k == 0 || r.top_k as usize >= v {
                    0.0
                } else {
                    r.top_k as f32
                },
                r.top_p,
                r.repetition_penalty,
                r.presence_penalty,
                r.frequency_penalty,
                r.min_p.ln(),
            ]
        })
        .collect();
    let params = Tensor::<B, 2>::from_data(TensorData::new(params, [b, 7]), &device);
    let col = |i: usize| params.clone().narrow(1, i, 1).expand([b, v]);
    let mut l = logits;

    if rows.iter().any(|r| !r.bias.is_empty()) {
        let add = scatter_rows::<B>(rows, b, v, &device, |r| {
            (r.bias_ids.to_vec(), r.bias.to_vec())
        });
        l = l + add;
    }
    if rows
        .iter()
        .any(|r| r.presence_penalty != 0.0 || r.frequency_penalty != 0.0)
    {
        let counts = scatter_rows::<B>(rows, b, v, &device, |r| {
            (r.generated.to_vec(), vec![1.0; r.generated.len()])
        });
        let used = counts.clone().greater_elem(0.0).float();
        // The host's `l − (presence + frequency·n)`, applied only where n > 0.
        l = l - (col(4) + col(5) * counts) * used;
    }
    if rows.iter().any(|r| r.repetition_penalty != 1.0) {
        let seen = scatter_rows::<B>(rows, b, v, &device, |r| {
            (r.history.to_vec(), vec![1.0; r.history.len()])
        })
        .greater_elem(0.0);
        let r = col(3);
        let penalised =
            (l.clone() / r.clone()).mask_where(l.clone().lower_equal_elem(0.0), l.clone() * r);
        l = l.mask_where(seen, penalised);
    }

    let greedy = l.clone().argmax(1);
    let ids = if rows.iter().any(|r| r.temperature > 0.0) {
        let sampled = sample(l, rows, &col, b, v, &device);
        let temps: Vec<f32> = rows.iter().map(|r| r.temperature).collect();
        let draws =
            Tensor::<B, 2>::from_data(TensorData::new(temps, [b, 1]), &device).greater_elem(0.0);
        greedy.mask_where(draws, sampled)
    } else {
        greedy
    };
    let logprob = activation::log_softmax(raw, 1).gather(1, ids.clone());
    Tensor::cat(vec![ids.float(), logprob], 1).swap_dims(0, 1)
}

/// Temperature, top-k, top-p and the Gumbel-max draw of the rows that sample: `[B, 1]` ids.
fn sample<B: Backend>(
    l: Tensor<B, 2>,
    rows: &[PickRow<'_>],
    col: &dyn Fn(usize) -> Tensor<B, 2>,
    b: usize,
    v: usize,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let temperature = col(0);
    let t = temperature
        .clone()
        .mask_fill(temperature.lower_equal_elem(0.0), 1.0);
    let mut s = l / t;
    let neg_inf = f32::NEG_INFINITY;
    if rows.iter().any(|r| r.top_k > 0 && (r.top_k as usize) < v) {
        let k = col(1);
        let tau = top_k_threshold(s.clone(), k.clone(), b, v);
        // Rows without a top-k keep everything.
        let tau = tau.mask_fill(k.equal_elem(0.0), neg_inf);
        s = s.clone().mask_fill(s.lower(tau), neg_inf);
    }
    if rows.iter().any(|r| r.min_p > 0.0) {
        // p / p_max ≥ min_p, as logits: s − max(s) ≥ ln(min_p) (−∞ keeps every token).
        let max = s.clone().max_dim(1).expand([b, v]);
        s = s.clone().mask_fill(s.sub(max).lower(col(6)), neg_inf);
    }
    if rows.iter().any(|r| r.top_p < 1.0) {
        let p = activation::softmax(s.clone(), 1);
        let top_p = col(2);
        let tau = top_p_threshold(p.clone(), top_p.clone(), b, v);
        let tau = tau.mask_fill(top_p.greater_equal_elem(1.0), 0.0);
        s = s.mask_fill(p.lower(tau), neg_inf);
    }
    let u = uniform::<B>(rows, b, v, device);
    let gumbel = u.log().neg().log().neg();
    (s + gumbel).argmax(1)
}

/// Per row, the k-th largest value of `s` (`k` ≥ 1, broadcast `[B, V]`), expanded to `[B, V]`.
fn top_k_threshold<B: Backend>(
    s: Tensor<B, 2>,
    k: Tensor<B, 2>,
    b: usize,
    v: usize,
) -> Tensor<B, 2> {
    let k = k.narrow(1, 0, 1);
    let count = |at: Tensor<B, 2>| {
        s.clone()
            .greater_equal(at.expand([b, v]))
            .float()
            .sum_dim(1)
    };
    let max = s.clone().max_dim(1);
    // The smallest finite value: every finite token is kept when there are fewer than k.
    let finite_min = s
        .clone()
        .mask_fill(s.clone().is_inf(), f32::INFINITY)
        .min_dim(1);
    let lo = bisect(finite_min, max.clone(), |mid| {
        count(mid).greater_equal(k.clone())
    });
    let at_max = count(max.clone()).greater_equal(k);
    lo.mask_where(at_max, max).expand([b, v])
}

/// Per row, the largest probability τ whose tokens (p ≥ τ) hold at least `top_p` of the mass,
/// expanded to `[B, V]`.
fn top_p_threshold<B: Backend>(
    p: Tensor<B, 2>,
    top_p: Tensor<B, 2>,
    b: usize,
    v: usize,
) -> Tensor<B, 2> {
    let top_p = top_p.narrow(1, 0, 1);
    let mass = |at: Tensor<B, 2>| {
        let keep = p.clone().greater_equal(at.expand([b, v])).float();
        (p.clone() * keep).sum_dim(1)
    };
    let max = p.clone().max_dim(1);
    let lo = bisect(max.zeros_like(), max.clone(), |mid| {
        mass(mid).greater_equal(top_p.clone())
    });
    let at_max = mass(max.clone()).greater_equal(top_p);
    lo.mask_where(at_max, max).expand([b, v])
}

/// [`BISECT`] halvings of `[lo, hi]` (`[B, 1]`) keeping `ok(lo)` true: the largest threshold
/// each row's `ok` holds for, within (hi − lo) / 2³².
fn bisect<B: Backend>(
    mut lo: Tensor<B, 2>,
    mut hi: Tensor<B, 2>,
    ok: impl Fn(Tensor<B, 2>) -> Tensor<B, 2, burn::tensor::Bool>,
) -> Tensor<B, 2> {
    for _ in 0..BISECT {
        let mid = (lo.clone() + hi.clone()) * 0.5;
        let yes = ok(mid.clone());
        lo = lo.mask_where(yes.clone(), mid.clone());
        hi = hi.mask_where(yes.bool_not(), mid);
    }
    lo
}

/// `[B, V]` uniform draws in (0, 1), each a function of its row's keys and its token index.
fn uniform<B: Backend>(
    rows: &[PickRow<'_>],
    b: usize,
    v: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    let keys: Vec<i64> = rows.iter().flat_map(|r| r.keys.map(|k| k as i64)).collect();
    let keys = Tensor::<B, 2, Int>::from_data(TensorData::new(keys, [b, 4]), device);
    let idx = Tensor::<B, 1, Int>::arange(0..v as i64, device)
        .reshape([1, v])
        .expand([b, v]);
    let scalar = |x: i64| x.elem::<B::IntElem>();
    let mut left = idx.clone().bitwise_and_scalar(scalar(0xFFFF));
    let mut right = idx.bitwise_right_shift_scalar(scalar(16));
    for round in 0..4 {
        let key = keys.clone().narrow(1, round, 1).expand([b, v]);
        let f = mix16::<B>(right.clone().bitwise_xor(key));
        (left, right) = (right, left.bitwise_xor(f));
    }
    // 24 bits: exact in f32.
    let bits = left.mul_scalar(256) + right.bitwise_right_shift_scalar(scalar(8));
    (bits.float() + 0.5) / (1u32 << 24) as f32
}

/// A 16-bit mixing function: odd multipliers below 2¹⁵ and xor-shifts.
fn mix16<B: Backend>(x: Tensor<B, 2, Int>) -> Tensor<B, 2, Int> {
    let s = |x: i64| x.elem::<B::IntElem>();
    let mut x = x;
    for (mul, shift) in [(0x2C1B, 7), (0x3A4D, 9), (0x1F35, 8)] {
        x = x.mul_scalar(mul).bitwise_and_scalar(s(0xFFFF));
        x = x
            .clone()
            .bitwise_xor(x.bitwise_right_shift_scalar(s(shift)));
    }
    x
}

/// `[B, V]` zeros with each row's `(ids, values)` added in (padding adds 0 to token 0).
fn scatter_rows<B: Backend>(
    rows: &[PickRow<'_>],
    b: usize,
    v: usize,
    device: &B::Device,
    of: impl Fn(&PickRow<'_>) -> (Vec<i64>, Vec<f32>),
) -> Tensor<B, 2> {
    let lists: Vec<_> = rows.iter().map(of).collect();
    let width = lists.iter().map(|(i, _)| i.len()).max().unwrap_or(0).max(1);
    let (mut ids, mut vals) = (vec![0i64; b * width], vec![0f32; b * width]);
    for (r, (i, x)) in lists.iter().enumerate() {
        ids[r * width..r * width + i.len()].copy_from_slice(i);
        vals[r * width..r * width + x.len()].copy_from_slice(x);
    }
    let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, width]), device);
    let vals = Tensor::<B, 2>::from_data(TensorData::new(vals, [b, width]), device);
    Tensor::zeros([b, v], device).scatter(1, ids, vals, IndexingUpdateOp::Add)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ndarray::NdArray;
    use nsactor_plugin_api::{PickParams, PicksBuf, RowPick};

    type Cpu = NdArray<f32>;
    type Cpu32 = NdArray<f32, i32>;

    fn params(temperature: f32, top_k: u32, top_p: f32, step: u64) -> PickParams {
        PickParams {
            temperature,
            top_k,
            top_p,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 7,
            step,
            want_logits: false,
        }
    }

    /// Picks `[ids, logprobs]` of `rows` over `logits` (one row of logits per pick).
    fn run<B: Backend>(logits: &[Vec<f32>], rows: &[RowPick<'_>]) -> (Vec<i64>, Vec<f32>) {
        let mut buf = PicksBuf::new();
        rows.iter().for_each(|r| buf.push(r));
        let v = logits[0].len();
        let picks = buf.picks();
        let parsed = picks.parse(v).unwrap();
        let flat: Vec<f32> = logits.concat();
        let t = Tensor::<B, 2>::from_data(
            TensorData::new(flat, [logits.len(), v]),
            &Default::default(),
        );
        let out = pick(t, &parsed).into_data().to_vec::<f32>().unwrap();
        let b = logits.len();
        (
            out[..b].iter().map(|&x| x as i64).collect(),
            out[b..].to_vec(),
        )
    }

    fn row<'a>(p: PickParams) -> RowPick<'a> {
        RowPick {
            params: p,
            history: &[],
            generated: &[],
            bias: &[],
        }
    }

    /// Greedy with a ban, a bias and all three penalties: the host picker's arithmetic
    /// (bias, then presence/frequency over generated tokens, then repetition over the history).
    #[test]
    fn greedy_applies_bias_and_penalties_like_the_host() {
        let logits = vec![vec![0.5f32, 3.0, 2.9, -1.0, 2.0, 1.0]];
        let greedy = params(0.0, 0, 1.0, 0);
        // Plain argmax.
        assert_eq!(run::<Cpu>(&logits, &[row(greedy)]).0, [1]);
        // Token 1 banned: 2 wins.
        let ban = [(1u32, f32::NEG_INFINITY)];
        let r = RowPick {
            bias: &ban,
            ..row(greedy)
        };
        assert_eq!(run::<Cpu>(&logits, &[r]).0, [2]);
        // Repetition 2 on the history {1, 2}: 3.0/2, 2.9/2 → token 4 (2.0) wins.
        let r = RowPick {
            params: PickParams {
                repetition_penalty: 2.0,
                ..greedy
            },
            history: &[1, 2, 1],
            ..row(greedy)
        };
        assert_eq!(run::<Cpu>(&logits, &[r]).0, [4]);
        // Frequency 0.6 per use of 1 (used twice: 3.0 − 1.2 = 1.8) and presence 0.5 on 2
        // (2.9 − 0.5 − 0.6 = 1.8): token 4 (2.0) wins; a +0.3 bias on 1 does not save it.
        let bias = [(1u32, 0.3f32)];
        let r = RowPick {
            params: PickParams {
                presence_penalty: 0.5,
                frequency_penalty: 0.6,
                ..greedy
            },
            generated: &[1, 2, 1],
            bias: &bias,
            ..row(greedy)
        };
        assert_eq!(run::<Cpu>(&logits, &[r]).0, [4]);
        // The log-probability is the raw logits' log-softmax of the chosen token.
        let (_, lp) = run::<Cpu>(&logits, &[row(greedy)]);
        let z: f32 = logits[0].iter().map(|x| (x - 3.0).exp()).sum();
        assert!((lp[0] + z.ln()).abs() < 1e-5, "{} vs {}", lp[0], -z.ln());
    }

    /// Gumbel-max draws follow softmax(l / T): 4,000 draws (4,000 steps of one seed) against
    /// the probabilities, within 5 standard errors per token.
    #[test]
    fn sampled_tokens_follow_the_tempered_distribution() {
        let l = vec![1.0f32, 0.0, 2.0, -1.0, 0.5];
        let temperature = 0.8;
        let n = 4000;
        let logits = vec![l.clone(); n];
        let rows: Vec<_> = (0..n as u64)
            .map(|s| row(params(temperature, 0, 1.0, s)))
            .collect();
        let (ids, _) = run::<Cpu>(&logits, &rows);
        let z: f32 = l.iter().map(|x| (x / temperature).exp()).sum();
        for (i, x) in l.iter().enumerate() {
            let p = ((x / temperature).exp() / z) as f64;
            let got = ids.iter().filter(|&&t| t == i as i64).count() as f64 / n as f64;
            let se = (p * (1.0 - p) / n as f64).sqrt();
            assert!((got - p).abs() < 5.0 * se, "token {i}: {got} vs {p}");
        }
    }

    /// Top-k keeps exactly the k largest; top-p the smallest most-likely set reaching p.
    #[test]
    fn top_k_and_top_p_keep_the_host_sets() {
        let l = vec![0.1f32, 2.0, 1.5, -0.3, 1.9, 0.7, 1.0, -2.0];
        let n = 600;
        let logits = vec![l.clone(); n];
        let drawn = |p: PickParams| {
            let rows: Vec<_> = (0..n as u64)
                .map(|s| row(PickParams { step: s, ..p }))
                .collect();
            let (ids, _) = run::<Cpu>(&logits, &rows);
            let mut set: Vec<i64> = ids;
            set.sort();
            set.dedup();
            set
        };
        assert_eq!(drawn(params(1.0, 3, 1.0, 0)), [1, 2, 4]);
        // Probabilities at T = 1: tokens 1, 4, 2, 6 hold 0.292, 0.265, 0.177, 0.108: p = 0.5
        // keeps {1, 4} (0.557), p = 0.6 adds 2, p = 0.2 keeps 1.
        assert_eq!(drawn(params(1.0, 0, 0.5, 0)), [1, 4]);
        assert_eq!(drawn(params(1.0, 0, 0.6, 0)), [1, 2, 4]);
        assert_eq!(drawn(params(1.0, 0, 0.2, 0)), [1]);
        // Both: top-k 4, then of the renormalised four (0.347, 0.314, 0.211, 0.128) p = 0.7.
        assert_eq!(drawn(params(1.0, 4, 0.7, 0)), [1, 2, 4]);
        // Banned tokens are never drawn.
        let ban = [(1u32, f32::NEG_INFINITY), (4, f32::NEG_INFINITY)];
        let rows: Vec<_> = (0..n as u64)
            .map(|s| RowPick {
                bias: &ban,
                ..row(params(1.0, 2, 1.0, s))
            })
            .collect();
        let (ids, _) = run::<Cpu>(&logits, &rows);
        assert!(ids.iter().all(|&t| t == 2 || t == 6), "{ids:?}");
    }

    /// A row's draw depends on its seed and step only: not on the other rows of its batch, and
    /// not on the backend's integer width (the CUDA backend's are 32-bit).
    #[test]
    fn draws_are_independent_of_the_batch_and_the_integer_width() {
        let l: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32) / 16.0).collect();
        let one = run::<Cpu>(std::slice::from_ref(&l), &[row(params(1.0, 0, 1.0, 5))]).0;
        let others: Vec<f32> = l.iter().rev().copied().collect();
        let rows = [
            row(PickParams {
                seed: 3,
                ..params(0.5, 10, 0.9, 1)
            }),
            row(params(1.0, 0, 1.0, 5)),
            row(params(0.0, 0, 1.0, 0)),
        ];
        let three = run::<Cpu>(&[others.clone(), l.clone(), others], &rows).0;
        assert_eq!(one[0], three[1]);
        let u64 = uniform::<Cpu>(&[parse_one(9, 4)], 1, 4096, &Default::default());
        let u32 = uniform::<Cpu32>(&[parse_one(9, 4)], 1, 4096, &Default::default());
        let (a, b) = (
            u64.into_data().to_vec::<f32>().unwrap(),
            u32.into_data().to_vec::<f32>().unwrap(),
        );
        assert_eq!(a, b);
        // Spread evenly over (0, 1): 16 bins of 256 expected draws each (χ² with 15 degrees
        // of freedom; 37.7 is its 0.999 quantile), and distinct but for a few of 24-bit
        // collisions.
        assert!(a.iter().all(|&u| u > 0.0 && u < 1.0));
        let mut bins = [0f64; 16];
        a.iter().for_each(|&u| bins[(u * 16.0) as usize] += 1.0);
        let chi2: f64 = bins.iter().map(|&n| (n - 256.0).powi(2) / 256.0).sum();
        assert!(chi2 < 37.7, "χ² {chi2}: {bins:?}");
        let mut s = a.clone();
        s.sort_by(f32::total_cmp);
        s.dedup();
        assert!(
            s.len() >= a.len() - 8,
            "{} distinct of {}",
            s.len(),
            a.len()
        );
    }

    fn parse_one(seed: u64, step: u64) -> PickRow<'static> {
        PickRow {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            want_logits: false,
            keys: nsactor_plugin_api::picks::row_key(seed, step),
            history: &[],
            generated: &[],
            bias_ids: &[],
            bias: &[],
        }
    }
}
