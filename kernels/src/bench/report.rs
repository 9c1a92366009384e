//! What every check of the benchmark shares: reading a tensor back, the error measures
//! (elementwise against the reference, by norm for bf16 storage), the tolerances, the timer,
//! bf16 rounding of inputs, and the report line of a fused kernel against its reference.

use crate::tensor::prim;
use burn::tensor::{Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor};
use std::fmt::Write;
use std::time::Instant;

pub(super) fn host<B: Backend>(t: &FloatTensor<B>) -> Vec<f32> {
    use burn::tensor::TensorMetadata;
    let t = t.clone();
    let data = match t.shape().num_dims() {
        1 => Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t)).into_data(),
        2 => Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t)).into_data(),
        _ => Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(t)).into_data(),
    };
    data.convert::<f32>().into_vec::<f32>().expect("f32")
}

/// Largest `|a − b| / (1 + |b|)`.
pub(super) fn worst(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max)
}

/// Seconds per call of `f`, after one warm-up call, over `reps` calls.
pub(super) fn time<B: Backend>(device: &B::Device, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    B::sync(device).expect("device sync");
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    B::sync(device).expect("device sync");
    t.elapsed().as_secs_f64() / reps as f64
}

/// Largest accepted `|kernel − reference| / (1 + |reference|)`. The scans themselves match the
/// reference bit for bit; the row variant's β and V_th gradients are sums over every step,
/// where the GPU compiler's contraction of `sum += a·b` into one fused multiply-add moves the
/// last bits (observed 2e-5 over 64 steps).
pub(super) const TOLERANCE: f32 = 1e-4;

/// Largest accepted error of a kernel that stores bf16 ([`GemmOps::storage_dtype`]) against
/// the f32 reference on the same (rounded) inputs, per tensor as `‖kernel − reference‖ /
/// ‖reference‖` (the 1e-2 for bf16 runs, the measure `verify plif-scan` holds bf16
/// storage to). Elementwise it cannot hold: a bias gradient summed over thousands of steps
/// cancels, and a rounding of 2⁻⁹ in one term becomes a larger share of the small sum.
///
/// [`GemmOps::storage_dtype`]: crate::GemmOps::storage_dtype
pub(super) const TOLERANCE_BF16: f32 = 1e-2;

/// `‖a − b‖ / ‖b‖` (0 when both are 0; infinite when the lengths differ).
pub(super) fn rel_norm(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    let (mut d, mut r) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        d += ((x - y) as f64).powi(2);
        r += (*y as f64).powi(2);
    }
    if d == 0.0 { 0.0 } else { (d / r).sqrt() as f32 }
}

/// The worst `‖a − b‖ / ‖b‖` over pairs of tensors.
pub(super) fn worst_rel_norm<B: Backend>(a: &[FloatTensor<B>], b: &[FloatTensor<B>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| rel_norm(&host::<B>(x), &host::<B>(y)))
        .fold(0.0f32, f32::max)
}

/// The error of a kernel's output `got` against the reference `want`: elementwise where the
/// kernel writes f32; where it writes a narrower type (bf16 storage, the GEMMs' input type),
/// `‖Δ‖/‖ref‖` against the reference rounded to that type (an f32 last bit may move a
/// rounding).
pub(super) fn error_in_type<B: Backend>(got: &FloatTensor<B>, want: &FloatTensor<B>) -> f32 {
    error_in_type_over::<B>(got, want, |v| v)
}

/// [`error_in_type`] over the elements `keep` leaves of both (the columns a spike did not
/// flip in, [`super::flips::Flips::unflipped`]).
pub(super) fn error_in_type_over<B: Backend>(
    got: &FloatTensor<B>,
    want: &FloatTensor<B>,
    keep: impl Fn(Vec<f32>) -> Vec<f32>,
) -> f32 {
    use burn::tensor::TensorMetadata;
    let dtype = got.dtype();
    if dtype == burn::tensor::DType::F32 {
        return worst(&keep(host::<B>(got)), &keep(host::<B>(want)));
    }
    let want = match want.shape().num_dims() {
        2 => prim(Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(want.clone())).cast(dtype)),
        _ => cast3::<B>(want, dtype),
    };
    rel_norm(&keep(host::<B>(got)), &keep(host::<B>(&want)))
}

/// `t` `[·, ·, ·]` cast to `dtype`.
fn cast3<B: Backend>(t: &FloatTensor<B>, dtype: burn::tensor::DType) -> FloatTensor<B> {
    prim(Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(t.clone())).cast(dtype))
}

/// `t` rounded to bf16 storage, and the exact f32 values of the rounded tensor.
pub(super) fn rounded<B: Backend>(t: &FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let low = cast3::<B>(t, burn::tensor::DType::BF16);
    let wide = cast3::<B>(&low, burn::tensor::DType::F32);
    (low, wide)
}

/// One fused kernel's check and timing against its composition.
pub(super) struct Pair {
    name: &'static str,
    /// Worst relative error against the reference (NaN where bit-for-bit was required and
    /// not met).
    err: f32,
    tol: f32,
    s: f64,
    /// The composition's time, where it was timed (not for the bf16-storage variants).
    s_ref: Option<f64>,
    /// Bytes read and written once each, for the bandwidth column.
    bytes: usize,
    /// The spike-agreement column (`-` where there is none).
    agree: String,
}

impl Pair {
    /// A fused kernel against its composition from tensor ops.
    pub(super) fn composed(
        name: &'static str,
        err: f32,
        tol: f32,
        s: f64,
        s_ref: f64,
        bytes: usize,
    ) -> Self {
        Pair {
            name,
            err,
            tol,
            s,
            s_ref: Some(s_ref),
            bytes,
            agree: "-".into(),
        }
    }

    /// The same pair with its spike-agreement column ([`super::flips::Flips::describe`]).
    pub(super) fn agreeing(self, agree: String) -> Self {
        Pair { agree, ..self }
    }

    /// A bf16-storage kernel against the f32 reference on the same rounded inputs.
    pub(super) fn stored(
        name: &'static str,
        err: f32,
        s: f64,
        bytes: usize,
        agree: String,
    ) -> Self {
        Pair {
            name,
            err,
            tol: TOLERANCE_BF16,
            s,
            s_ref: None,
            bytes,
            agree,
        }
    }
}

/// Reports each pair's line (or WRONG and untimed past its tolerance); the name of the last
/// wrong one.
pub(super) fn report_pairs<const N: usize>(
    out: &mut String,
    copy_bw: f64,
    pairs: [Pair; N],
) -> Result<(), &'static str> {
    let mut failed = Ok(());
    for p in pairs {
        let (name, err) = (p.name, p.err);
        if err.is_nan() || err > p.tol {
            let reference = match p.s_ref {
                Some(_) => "the composed reference".to_string(),
                None => format!(
                    "the f32 reference on the same rounded inputs (‖Δ‖/‖ref‖; {})",
                    p.agree
                ),
            };
            let _ = writeln!(
                out,
                "{name:<24} {err:>11.2e}  WRONG: differs from {reference}; not timed"
            );
            failed = Err(name);
            continue;
        }
        let bw = p.bytes as f64 / p.s.max(1e-9);
        let composed = p.s_ref.map_or(String::new(), |r| {
            format!(
                "  composed from tensor ops: {:.3} ms ({:.1}× slower)",
                r * 1e3,
                r / p.s.max(1e-9)
            )
        });
        let _ = writeln!(
            out,
            "{name:<24} {err:>11.2e} {:>10.3} {:>9.1} {:>9.0}% {:>12}{composed}",
            p.s * 1e3,
            bw / 1e9,
            100.0 * bw / copy_bw,
            p.agree,
        );
    }
    failed
}
