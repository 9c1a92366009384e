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

/// SplitMix64-seeded xoshiro256** generator: small, fast and stable across platforms.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
    /// Draws nothing: [`blank`](Self::blank).
    blank: bool,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
            blank: false,
        }
    }

    /// A generator that draws nothing: its vectors come out empty at once, which the model's
    /// parameters take as zeros made on the device (scalars come out as an all-zero state
    /// gives them). For a module whose every value is overwritten before use — a layer's
    /// untracked twin, which takes its tracked twin's parameters, or a stage opened to load
    /// weights — where drawing a 0.9B layer's 43 M values took about a second.
    pub fn blank() -> Self {
        Rng {
            s: [0; 4],
            blank: true,
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform01(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform01()
    }

    /// Standard normal by Box–Muller.
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform01();
        let u2 = self.uniform01();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    pub fn uniform_vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        if self.blank {
            return Vec::new();
        }
        (0..n).map(|_| self.uniform(lo, hi) as f32).collect()
    }

    pub fn normal_vec(&mut self, n: usize, mean: f64, std: f64) -> Vec<f32> {
        if self.blank {
            return Vec::new();
        }
        (0..n)
            .map(|_| (mean + std * self.normal()) as f32)
            .collect()
    }
}

/// `kaiming_uniform_(a=√5)` on a `(out, in)` weight: `U(±1/√fan_in)`.
pub fn kaiming(rng: &mut Rng, out: usize, fan_in: usize) -> Vec<f32> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    rng.uniform_vec(out * fan_in, -bound, bound)
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
