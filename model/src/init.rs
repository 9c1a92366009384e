//! Structured initialisation exactly as SPEC §5, drawn from a seeded host RNG.
//!
//! PyTorch's RNG stream cannot be reproduced, so parity with the reference is checked on loaded
//! weights; what must match here are the distributions and the per-neuron structure (index
//! `d·N + n`, n fastest).

/// The seed of one part of the model — `0` the edge, `i + 1` decoder layer `i` — derived from the
/// run's seed, so every part initialises the same whether it is built alone (a stage) or with the
/// whole model.
pub fn part_seed(seed: u64, part: u64) -> u64 {
    Rng::new(seed ^ part.wrapping_mul(0xa076_1d64_78bd_642f)).next_u64()
}

/// Golden-ratio increment of SplitMix64.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Vectors at least this long are large: drawn on several threads, and their buffers kept for
/// the next draws ([`recycle`]).
const PARALLEL_MIN: usize = 1 << 20;

/// Normal draws (a logarithm, a square root and a cosine each) at least this long are drawn on
/// several threads too: a 0.9B layer's two `D × D` output projections (0.8 M values each) took
/// ~50 ms on one core, a quarter of the layer's opening on the H200 (HISTORY, session 58).
const PARALLEL_MIN_NORMAL: usize = 1 << 16;

/// Host buffers of this many bytes at most are kept for reuse ([`recycle`]).
const SPARE_BYTES: usize = 256 << 20;

thread_local! {
    /// Buffers of drawn values already uploaded ([`recycle`]), for the next draws.
    static SPARES: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An empty buffer with room for `n` values for a draw, which writes every one of them (so
/// nothing is zeroed first: a memset of a 0.9B layer's 172 MB on one core cost ~20 ms a
/// layer): for a large draw, a recycled one where one is large enough (its pages already in
/// place), else new. A 0.9B layer's 43 M fresh values were page-faulted in one 4 KB page at a
/// time, which on the GPU machines took longer than drawing them (HISTORY, session 53).
fn spare(n: usize) -> Vec<f32> {
    if n < PARALLEL_MIN {
        // Small values may be kept by their tensor (a host backend's storage): never hand
        // them a large buffer.
        return Vec::with_capacity(n);
    }
    let found = SPARES.with_borrow_mut(|s| {
        let best = s
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= n)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i)?;
        Some(s.swap_remove(best))
    });
    match found {
        Some(mut v) => {
            v.clear();
            v
        }
        None => Vec::with_capacity(n),
    }
}

/// Keeps `v` (drawn values, uploaded) for the next draws on this thread; large buffers only,
/// [`SPARE_BYTES`] in all, the largest kept. [`release_spares`] frees them.
pub fn recycle(v: Vec<f32>) {
    if v.capacity() < PARALLEL_MIN {
        return;
    }
    SPARES.with_borrow_mut(|s| {
        s.push(v);
        s.sort_by_key(|v| std::cmp::Reverse(v.capacity()));
        let mut total = 0;
        s.retain(|v| {
            total += v.capacity() * 4;
            total <= SPARE_BYTES
        });
    });
}

/// Frees this thread's kept buffers (once the last stage is drawn).
pub fn release_spares() {
    SPARES.with_borrow_mut(Vec::clear);
}

/// Counter-based SplitMix64: draw `k` of a stream is `mix(key + k·γ)`, a function of its
/// position alone, so a long vector is drawn on every core in slices and comes out the same
/// whatever the thread count (a 0.9B layer's 43 M values took ~0.2 s on one core).
#[derive(Debug, Clone)]
pub struct Rng {
    key: u64,
    /// Draws taken so far.
    counter: u64,
    /// Draws nothing: [`blank`](Self::blank).
    blank: bool,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng {
            key: mix(seed.wrapping_add(GAMMA)),
            counter: 0,
            blank: false,
        }
    }

    /// A generator that draws nothing: its vectors come out empty at once, which the model's
    /// parameters take as zeros made on the device (scalars come out as an all-zero state
    /// gives them). For a module whose every value is overwritten before use — a layer's
    /// untracked twin, which takes its tracked twin's parameters, or a stage opened to load
    /// weights.
    pub fn blank() -> Self {
        Rng {
            key: 0,
            counter: 0,
            blank: true,
        }
    }

    /// Draw number `k` (from 1) of this stream.
    fn at(&self, k: u64) -> u64 {
        mix(self.key.wrapping_add(k.wrapping_mul(GAMMA)))
    }

    fn unit(bits: u64) -> f64 {
        (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Box–Muller on two uniform draws.
    fn box_muller(u1: f64, u2: f64) -> f64 {
        let u1 = 1.0 - u1;
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    pub fn next_u64(&mut self) -> u64 {
        self.counter += 1;
        self.at(self.counter)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform01(&mut self) -> f64 {
        Self::unit(self.next_u64())
    }

    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform01()
    }

    /// Standard normal by Box–Muller (two draws).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform01();
        let u2 = self.uniform01();
        Self::box_muller(u1, u2)
    }

    /// `n` values, value `i` made from the draws after the first `per·i` of those left
    /// (`per` draws each) and its index; the stream moves on by `per·n`. Vectors of at least
    /// `parallel` values are drawn on several threads.
    fn vec(
        &mut self,
        n: usize,
        per: u64,
        parallel: usize,
        value: impl Fn(&Rng, u64, usize) -> f32 + Sync,
    ) -> Vec<f32> {
        if self.blank {
            return Vec::new();
        }
        let base = self.counter;
        self.counter += per * n as u64;
        let this = &*self;
        let mut out = spare(n);
        let fill = |start: usize, slice: &mut [std::mem::MaybeUninit<f32>]| {
            for (i, v) in slice.iter_mut().enumerate() {
                let i = start + i;
                v.write(value(this, base + per * i as u64, i));
            }
        };
        let room = &mut out.spare_capacity_mut()[..n];
        let threads = if n >= parallel {
            std::thread::available_parallelism().map_or(1, |t| t.get().min(32))
        } else {
            1
        };
        if threads == 1 {
            fill(0, room);
        } else {
            let chunk = n.div_ceil(threads);
            std::thread::scope(|s| {
                for (c, slice) in room.chunks_mut(chunk).enumerate() {
                    let fill = &fill;
                    s.spawn(move || fill(c * chunk, slice));
                }
            });
        }
        // SAFETY: the first `n` values of the capacity (`spare` made room for them) were each
        // written above, by exactly one of the fills.
        unsafe { out.set_len(n) };
        out
    }

    pub fn uniform_vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        self.uniform_vec_then(n, lo, hi, |_, x| x)
    }

    /// [`uniform_vec`](Self::uniform_vec) with `then(i, x)` applied to value `i` as it is
    /// drawn (a per-row or per-column scaling), on the drawing threads: the same values as
    /// applying it afterwards, without another pass over the vector on one core.
    pub fn uniform_vec_then(
        &mut self,
        n: usize,
        lo: f64,
        hi: f64,
        then: impl Fn(usize, f32) -> f32 + Sync,
    ) -> Vec<f32> {
        self.vec(n, 1, PARALLEL_MIN, |r, k, i| {
            then(i, (lo + (hi - lo) * Self::unit(r.at(k + 1))) as f32)
        })
    }

    pub fn normal_vec(&mut self, n: usize, mean: f64, std: f64) -> Vec<f32> {
        self.vec(n, 2, PARALLEL_MIN_NORMAL, |r, k, _| {
            let z = Self::box_muller(Self::unit(r.at(k + 1)), Self::unit(r.at(k + 2)));
            (mean + std * z) as f32
        })
    }
}

/// `kaiming_uniform_(a=√5)` on a `(out, in)` weight: `U(±1/√fan_in)`.
pub fn kaiming(rng: &mut Rng, out: usize, fan_in: usize) -> Vec<f32> {
    kaiming_then(rng, out, fan_in, |_, x| x)
}

/// [`kaiming`] with `then(i, x)` applied to value `i` (row-major) as it is drawn
/// ([`Rng::uniform_vec_then`]).
pub fn kaiming_then(
    rng: &mut Rng,
    out: usize,
    fan_in: usize,
    then: impl Fn(usize, f32) -> f32 + Sync,
) -> Vec<f32> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    rng.uniform_vec_then(out * fan_in, -bound, bound, then)
}

/// `xavier_uniform_` on a `(out, in)` weight: `U(±√(6/(in+out)))`.
pub fn xavier(rng: &mut Rng, out: usize, fan_in: usize) -> Vec<f32> {
    let bound = (6.0 / (fan_in + out) as f64).sqrt();
    rng.uniform_vec(out * fan_in, -bound, bound)
}

/// `torch.linspace(start, end, steps)` in f64.
pub fn linspace(start: f64, end: f64, steps: usize) -> Vec<f64> {
    match steps {
        0 => vec![],
        1 => vec![start],
        _ => (0..steps)
            .map(|i| start + (end - start) * i as f64 / (steps - 1) as f64)
            .collect(),
    }
}

/// Inverse standard normal CDF Φ⁻¹(p) (Acklam's rational approximation, refined by one Halley
/// step on the erfc-based CDF; ≈1e-12 relative).
pub fn inv_normal_cdf(p: f64) -> f64 {
    assert!(
        p > 0.0 && p < 1.0,
        "inv_normal_cdf needs 0 < p < 1, got {p}"
    );
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.38357751867269e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let lo = 0.02425;
    let x = if p < lo {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - lo {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        let q = (-2.0 * (1.0 - p).ln()).sqrt();
        -(((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    let e = 0.5 * erfc(-x / std::f64::consts::SQRT_2) - p;
    let u = e * (2.0 * std::f64::consts::PI).sqrt() * (x * x / 2.0).exp();
    x - u / (1.0 + x * u / 2.0)
}

/// Complementary error function (Numerical Recipes' Chebyshev fit, |rel err| < 1.2e-7),
/// accurate enough for the one Halley refinement above.
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.26551223
            + t * (1.00002368
                + t * (0.37409196
                    + t * (0.09678418
                        + t * (-0.18628806
                            + t * (0.27886807
                                + t * (-1.13520398
                                    + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
            .exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

/// Per-neuron-group constants of the SNNBlock's structured init (SPEC §5), for `n = 0..N`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockInitTable {
    /// `β_n = linspace(0.80, 0.99, N)`.
    pub beta: Vec<f64>,
    /// `W_in` row scale `√(1 − β_n²)`.
    pub w_in_scale: Vec<f64>,
    /// `b_th` base before jitter: `max(σ_V,n·z_n − V_min, 0.05)`.
    pub b_th: Vec<f64>,
    /// `W_out` column scale `(1/√p_n) / mean_n(1/√p_n)`.
    pub w_out_scale: Vec<f64>,
}

/// Threshold-calibration constants: `K_ref = 16`, `p_assumed = 0.15`.
const K_REF: i32 = 16;
const P_ASSUMED: f64 = 0.15;

impl BlockInitTable {
    pub fn new(n: usize, v_th_min: f64) -> Self {
        let beta = linspace(0.80, 0.99, n);
        let p_fire = linspace(0.25, 0.08, n);
        let sigma_i = (P_ASSUMED / 3.0).sqrt();
        let b_th = beta
            .iter()
            .zip(&p_fire)
            .map(|(b, p)| {
                let sigma_v = sigma_i * (1.0 - b.powi(2 * K_REF)).sqrt();
                let z = inv_normal_cdf(1.0 - p);
                (sigma_v * z - v_th_min).max(0.05)
            })
            .collect();
        let inv_sqrt: Vec<f64> = p_fire.iter().map(|p| 1.0 / p.sqrt()).collect();
        let mean = inv_sqrt.iter().sum::<f64>() / n as f64;
        BlockInitTable {
            w_in_scale: beta.iter().map(|b| (1.0 - b * b).sqrt()).collect(),
            b_th,
            w_out_scale: inv_sqrt.iter().map(|v| v / mean).collect(),
            beta,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vector is the same draws as the scalar calls one after another, on one thread or
    /// many (a vector past `PARALLEL_MIN`, or a normal one past `PARALLEL_MIN_NORMAL`, is
    /// drawn in slices), and the stream goes on from where the vector left it.
    #[test]
    fn vectors_equal_scalar_draws_on_any_thread_count() {
        for n in [5, PARALLEL_MIN_NORMAL + 3, PARALLEL_MIN + 3] {
            let (mut a, mut b) = (Rng::new(11), Rng::new(11));
            let u = a.uniform_vec(n, -0.5, 2.0);
            let want: Vec<f32> = (0..n).map(|_| b.uniform(-0.5, 2.0) as f32).collect();
            assert_eq!(u, want, "uniform, n = {n}");
            let g = a.normal_vec(n, 1.0, 0.25);
            let want: Vec<f32> = (0..n).map(|_| (1.0 + 0.25 * b.normal()) as f32).collect();
            assert_eq!(g, want, "normal, n = {n}");
            assert_eq!(a.next_u64(), b.next_u64());
        }
    }

    /// A function applied as the values are drawn gives the values of applying it afterwards,
    /// on one thread or many.
    #[test]
    fn a_function_applied_while_drawing_equals_it_applied_after() {
        for n in [7, PARALLEL_MIN + 5] {
            let scale = |i: usize, x: f32| x * (1.0 + (i % 3) as f32 * 0.25);
            let drawn = kaiming_then(&mut Rng::new(4), 1, n, scale);
            let after: Vec<f32> = kaiming(&mut Rng::new(4), 1, n)
                .into_iter()
                .enumerate()
                .map(|(i, x)| scale(i, x))
                .collect();
            assert_eq!(drawn, after, "n = {n}");
        }
    }

    #[test]
    fn draws_have_the_moments_asked_for_and_seeds_differ() {
        let mut r = Rng::new(3);
        let n = 200_000;
        let u = r.uniform_vec(n, -1.0, 1.0);
        let mean = u.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = u.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0 / 3.0).abs() < 0.01,
            "{mean} {var}"
        );
        assert!(u.iter().all(|&x| (-1.0..1.0).contains(&x)));
        let g = r.normal_vec(n, 0.0, 2.0);
        let mean = g.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = g.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.02 && (var - 4.0).abs() < 0.08,
            "{mean} {var}"
        );
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
        assert!(Rng::blank().uniform_vec(10, 0.0, 1.0).is_empty());
    }

    /// A draw into a recycled buffer (larger than it, holding old values) equals a draw into a
    /// fresh one; small buffers are not kept, and releasing empties the pool.
    #[test]
    fn recycled_buffers_give_the_same_draws() {
        let n = PARALLEL_MIN + 7;
        let fresh = Rng::new(5).uniform_vec(n, 0.0, 1.0);
        recycle(vec![9.0; n + 1000]);
        recycle(vec![1.0; 10]);
        assert_eq!(
            SPARES.with_borrow(Vec::len),
            1,
            "a small buffer is not kept"
        );
        let again = Rng::new(5).uniform_vec(n, 0.0, 1.0);
        assert_eq!(again, fresh);
        assert!(again.capacity() >= n + 1000, "the kept buffer was taken");
        assert_eq!(SPARES.with_borrow(Vec::len), 0);
        recycle(again);
        release_spares();
        assert_eq!(SPARES.with_borrow(Vec::len), 0);
    }
}
