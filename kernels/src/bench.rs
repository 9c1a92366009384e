//! `nsactor bench kernels`, generic over the backend: every PLIF scan of [`SnnOps`] checked
//! against the host reference, then timed at the 0.9B shapes and set against the device's
//! measured elementwise-copy bandwidth. A kernel whose results differ is reported as wrong and
//! not timed.

use crate::SnnOps;
use crate::ops::{
    FfnGrads, FfnInputs, NormPlifInputs, PonderInputs, SelectiveGrads, SelectiveInputs,
    ffn_backward_reference, ffn_forward_reference, norm_plif_backward_reference,
    norm_plif_forward_reference, ponder_backward_reference, ponder_forward_reference,
    selective_backward_reference, selective_forward_reference,
};
use crate::reference;
use burn::tensor::{Distribution, Tensor, TensorPrimitive, backend::Backend, ops::FloatTensor};
use std::fmt::Write;
use std::time::Instant;

/// Shapes and repetitions of a run.
#[derive(Debug, Clone)]
pub struct ScanBench {
    /// `T·K` frames.
    pub steps: usize,
    pub batch: usize,
    /// Columns per batch row of the per-element scan (`D·N`) and of the row scan (`2·D_ff`).
    pub elem_dim: usize,
    pub row_dim: usize,
    /// Frames of the parity check (the reference runs on the host).
    pub check_steps: usize,
    pub reps: usize,
    /// The model width `D` and frames per token `K` of the PonderAgg check.
    pub dim: usize,
    pub k: usize,
}

impl ScanBench {
    /// The 0.9B model: T·K = 511·16 = 8176, B = 4, D·N = 7168, 2·D_ff = 5376.
    pub fn model_0_9b() -> Self {
        ScanBench {
            steps: 8176,
            batch: 4,
            elem_dim: 7168,
            row_dim: 5376,
            check_steps: 64,
            reps: 10,
            dim: 896,
            k: 16,
        }
    }

    /// Parses `key=value` pairs separated by commas or whitespace (keys as the fields).
    pub fn with_options(mut self, options: &str) -> Result<Self, String> {
        for kv in option_items(options) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("option `{kv}` is not key=value"))?;
            let v: usize = v
                .parse()
                .map_err(|_| format!("option {k}: `{v}` is not a whole number"))?;
            if v == 0 {
                return Err(format!("option {k} must be at least 1"));
            }
            match k {
                "steps" => self.steps = v,
                "batch" => self.batch = v,
                "elem_dim" => self.elem_dim = v,
                "row_dim" => self.row_dim = v,
                "check_steps" => self.check_steps = v,
                "reps" => self.reps = v,
                "dim" => self.dim = v,
                "k" => self.k = v,
                other => {
                    return Err(format!(
                        "unknown option `{other}` (steps, batch, elem_dim, row_dim, check_steps, reps, dim, k)"
                    ));
                }
            }
        }
        Ok(self)
    }
}

/// The `key=value` items of an option string, separated by commas or whitespace.
pub fn option_items(options: &str) -> impl Iterator<Item = &str> {
    options
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
}

fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn host<B: Backend>(t: &FloatTensor<B>) -> Vec<f32> {
    use burn::tensor::TensorMetadata;
    let t = t.clone();
    let data = match t.shape().num_dims() {
        2 => Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t)).into_data(),
        _ => Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(t)).into_data(),
    };
    data.convert::<f32>().into_vec::<f32>().expect("f32")
}

/// Largest `|a − b| / (1 + |b|)`.
fn worst(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max)
}

/// Scan inputs for `steps` frames of `cols` columns: β in (0.5, 1), u around the threshold so
/// neurons spike often, V_th in (0.3, 1).
struct Inputs<B: Backend> {
    beta: Tensor<B, 3>,
    u: Tensor<B, 3>,
    vth: Tensor<B, 3>,
    v0: Tensor<B, 2>,
    grad: Tensor<B, 3>,
    beta_row: Tensor<B, 2>,
    vth_row: Tensor<B, 2>,
}

impl<B: Backend> Inputs<B> {
    fn new(steps: usize, batch: usize, dim: usize, device: &B::Device) -> Self {
        let u = |lo, hi| Distribution::Uniform(lo, hi);
        let seq = [steps, batch, dim];
        Inputs {
            beta: Tensor::random(seq, u(0.5, 1.0), device),
            u: Tensor::random(seq, u(-0.2, 0.6), device),
            vth: Tensor::random(seq, u(0.3, 1.0), device),
            v0: Tensor::random([batch, dim], u(-0.5, 0.5), device),
            grad: Tensor::random(seq, u(-1.0, 1.0), device),
            beta_row: Tensor::random([batch, dim], u(0.5, 1.0), device),
            vth_row: Tensor::random([batch, dim], u(0.3, 1.0), device),
        }
    }
}

/// The four scans: name, bytes moved per call for `n` sequence elements and `c` columns, and
/// the call (returning every output, so all of them are awaited).
type Run<B> = fn(&Inputs<B>) -> Vec<FloatTensor<B>>;
/// Name, row-parameter variant, bytes per call for `n` elements and `c` columns, the call.
type Scan<B> = (&'static str, bool, fn(usize, usize) -> usize, Run<B>);

fn scans<B: SnnOps>() -> [Scan<B>; 4] {
    [
        (
            "per-element forward",
            false,
            |n, c| 4 * (5 * n + c),
            |i| {
                let o = B::plif_elem_forward(
                    prim(i.beta.clone()),
                    prim(i.u.clone()),
                    prim(i.vth.clone()),
                    prim(i.v0.clone()),
                );
                vec![o.spike, o.vpost]
            },
        ),
        (
            "per-element backward",
            false,
            |n, c| 4 * (7 * n + 2 * c),
            |i| {
                // Spikes and V_post of the forward feed the backward; the check and the timing
                // both use the kernel's own forward outputs.
                let o = B::plif_elem_forward(
                    prim(i.beta.clone()),
                    prim(i.u.clone()),
                    prim(i.vth.clone()),
                    prim(i.v0.clone()),
                );
                let g = B::plif_elem_backward(
                    prim(i.beta.clone()),
                    prim(i.v0.clone()),
                    o.vpost,
                    o.spike,
                    prim(i.grad.clone()),
                );
                vec![g.beta, g.u, g.vth, g.v0]
            },
        ),
        (
            "row-parameter forward",
            true,
            |n, c| 4 * (3 * n + 3 * c),
            |i| {
                let o = B::plif_row_forward(
                    prim(i.beta_row.clone()),
                    prim(i.u.clone()),
                    prim(i.vth_row.clone()),
                    prim(i.v0.clone()),
                );
                vec![o.spike, o.vpost]
            },
        ),
        (
            "row-parameter backward",
            true,
            |n, c| 4 * (4 * n + 5 * c),
            |i| {
                let o = B::plif_row_forward(
                    prim(i.beta_row.clone()),
                    prim(i.u.clone()),
                    prim(i.vth_row.clone()),
                    prim(i.v0.clone()),
                );
                let g = B::plif_row_backward(
                    prim(i.beta_row.clone()),
                    prim(i.v0.clone()),
                    o.vpost,
                    o.spike,
                    prim(i.grad.clone()),
                );
                vec![g.beta, g.u, g.vth, g.v0]
            },
        ),
    ]
}

/// The same outputs from the host reference.
fn reference_outputs<B: Backend>(name: &str, i: &Inputs<B>, cols: usize) -> Vec<Vec<f32>> {
    let h3 = |t: &Tensor<B, 3>| host::<B>(&prim(t.clone()));
    let h2 = |t: &Tensor<B, 2>| host::<B>(&prim(t.clone()));
    let (u, v0, grad) = (h3(&i.u), h2(&i.v0), h3(&i.grad));
    match name {
        "per-element forward" | "per-element backward" => {
            let (beta, vth) = (h3(&i.beta), h3(&i.vth));
            let o = reference::elem_forward(&beta, &u, &vth, &v0, cols);
            if name.ends_with("forward") {
                return vec![o.spike, o.vpost];
            }
            let g = reference::elem_backward(&beta, &v0, &o.vpost, &o.spike, &grad, cols);
            vec![g.beta, g.u, g.vth, g.v0]
        }
        _ => {
            let (beta, vth) = (h2(&i.beta_row), h2(&i.vth_row));
            let o = reference::row_forward(&beta, &u, &vth, &v0, cols);
            if name.ends_with("forward") {
                return vec![o.spike, o.vpost];
            }
            let g = reference::row_backward(&beta, &v0, &o.vpost, &o.spike, &grad, cols);
            vec![g.beta, g.u, g.vth, g.v0]
        }
    }
}

/// Seconds per call of `f`, after one warm-up call, over `reps` calls.
fn time<B: Backend>(device: &B::Device, reps: usize, mut f: impl FnMut()) -> f64 {
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
const TOLERANCE: f32 = 1e-4;

/// Runs the check and the timings; the report is plain text, one line per kernel. Fails when
/// a kernel disagrees with the reference.
pub fn run<B: SnnOps>(device: &B::Device, cfg: &ScanBench) -> Result<String, String> {
    let mut out = String::new();
    // Copy bandwidth: an elementwise pass over the largest sequence tensor (read once, write once).
    let n_big = cfg.steps * cfg.batch * cfg.elem_dim;
    let x: Tensor<B, 1> = Tensor::random([n_big], Distribution::Default, device);
    // The best of three rounds: the figure is a ceiling.
    let copy_s = (0..3)
        .map(|_| {
            time::<B>(device, cfg.reps, || {
                let _ = x.clone().mul_scalar(1.000_001);
            })
        })
        .fold(f64::INFINITY, f64::min);
    let copy_bw = 8.0 * n_big as f64 / copy_s;
    drop(x);
    let _ = writeln!(
        out,
        "elementwise copy (x·c, {n_big} f32): {:.0} GB/s",
        copy_bw / 1e9
    );
    let _ = writeln!(
        out,
        "{:<24} {:>11} {:>10} {:>9} {:>10} {:>12}",
        "kernel", "max rel err", "time (ms)", "GB/s", "of copy", "spike agree"
    );
    let mut failed = Vec::new();
    for (name, row, bytes, run) in scans::<B>() {
        let dim = if row { cfg.row_dim } else { cfg.elem_dim };
        let cols = cfg.batch * dim;
        // Parity on a short sequence of the full width.
        let small = Inputs::<B>::new(cfg.check_steps, cfg.batch, dim, device);
        let got: Vec<Vec<f32>> = run(&small).iter().map(host::<B>).collect();
        let want = reference_outputs(name, &small, cols);
        let err = got
            .iter()
            .zip(&want)
            .map(|(g, w)| worst(g, w))
            .fold(0.0f32, f32::max);
        let agree = if name.ends_with("forward") {
            let same = got[0].iter().zip(&want[0]).filter(|(a, b)| a == b).count();
            format!("{:.6}", same as f64 / want[0].len().max(1) as f64)
        } else {
            "-".into()
        };
        drop(small);
        if err.is_nan() || err > TOLERANCE {
            let _ = writeln!(
                out,
                "{name:<24} {err:>11.2e}  WRONG: differs from the reference; not timed"
            );
            failed.push(name);
            continue;
        }
        let full = Inputs::<B>::new(cfg.steps, cfg.batch, dim, device);
        let n = cfg.steps * cols;
        let s = time::<B>(device, cfg.reps, || {
            let _ = run(&full);
        });
        // The backward rows time the forward too (it makes their inputs): subtract it.
        let s = if name.ends_with("backward") {
            let fwd = scans::<B>()
                .into_iter()
                .find(|(f, r, _, _)| *r == row && f.ends_with("forward"))
                .expect("forward")
                .3;
            let f = time::<B>(device, cfg.reps, || {
                let _ = fwd(&full);
            });
            (s - f).max(1e-9)
        } else {
            s
        };
        let bw = bytes(n, cols) as f64 / s;
        let _ = writeln!(
            out,
            "{name:<24} {err:>11.2e} {:>10.3} {:>9.1} {:>9.0}% {agree:>12}",
            s * 1e3,
            bw / 1e9,
            100.0 * bw / copy_bw
        );
    }
    if let Err(name) = selective::<B>(device, cfg, copy_bw, &mut out) {
        failed.push(name);
    }
    if let Err(name) = selective_stored::<B>(device, cfg, copy_bw, &mut out) {
        failed.push(name);
    }
    if let Err(name) = ffn_neurons::<B>(device, cfg, copy_bw, &mut out) {
        failed.push(name);
    }
    if let Err(name) = ffn_stored::<B>(device, cfg, copy_bw, &mut out) {
        failed.push(name);
    }
    if let Err(name) = ponder::<B>(device, cfg, copy_bw, &mut out) {
        failed.push(name);
    }
    if let Err(name) = norm_plif::<B>(device, cfg, copy_bw, &mut out) {
        failed.push(name);
    }
    if failed.is_empty() {
        Ok(out)
    } else {
        Err(format!("{out}wrong kernels: {}", failed.join(", ")))
    }
}

/// The selective scan's gradients in [`SelectiveInputs`]' order.
fn selective_grad_list<B: Backend>(g: SelectiveGrads<B>) -> Vec<FloatTensor<B>> {
    vec![
        g.i, g.r_beta, g.r_alpha, g.r_th, g.b_beta, g.b_alpha, g.b_th, g.v0,
    ]
}

/// The FFN neurons' gradients in [`FfnInputs`]' order.
fn ffn_grad_list<B: Backend>(g: FfnGrads<B>) -> Vec<FloatTensor<B>> {
    vec![g.i_gu, g.w_gate, g.w_up, g.th_gate, g.th_up, g.v0]
}

/// Inputs of the fused selective scan at `steps` frames: projections around the model's
/// operating point (β ≈ σ(1), α ≈ 1, thresholds near the inputs so neurons spike often).
fn selective_inputs<B: Backend>(
    steps: usize,
    cfg: &ScanBench,
    device: &B::Device,
) -> (SelectiveInputs<B>, FloatTensor<B>) {
    let n = |mean, std| Distribution::Normal(mean, std);
    let seq = |d| {
        prim(Tensor::<B, 3>::random(
            [steps, cfg.batch, cfg.elem_dim],
            d,
            device,
        ))
    };
    let vec = |d| prim(Tensor::<B, 1>::random([cfg.elem_dim], d, device));
    let inputs = SelectiveInputs {
        i: seq(n(0.3, 0.5)),
        r_beta: seq(n(0.0, 0.5)),
        r_alpha: seq(n(0.0, 0.5)),
        r_th: seq(n(0.0, 0.3)),
        b_beta: vec(n(1.0, 0.5)),
        b_alpha: vec(n(0.54, 0.1)),
        b_th: vec(n(0.3, 0.1)),
        v_th_min: 0.1,
        v0: prim(Tensor::<B, 2>::random(
            [cfg.batch, cfg.elem_dim],
            n(0.0, 0.2),
            device,
        )),
    };
    (inputs, seq(n(0.0, 1.0)))
}

/// The fused selective scan (modulation inside the kernel) against the same computation
/// composed from tensor ops ([`selective_forward_reference`]) on the same device: outputs and
/// every gradient checked, then both timed at the 0.9B shape. Reports into `out`; the name of
/// the failing kernel on a mismatch.
fn selective<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let grads = selective_grad_list::<B>;
    let fused_fwd = |inp: &SelectiveInputs<B>| B::plif_selective_forward(inp.clone());
    let fused_bwd = |inp: &SelectiveInputs<B>, grad: &FloatTensor<B>| {
        let o = B::plif_selective_forward(inp.clone());
        grads(B::plif_selective_backward(
            inp.clone(),
            o.vpost,
            o.spike,
            grad.clone(),
        ))
    };
    let ref_fwd = |inp: &SelectiveInputs<B>| selective_forward_reference(inp.clone());
    let ref_bwd = |inp: &SelectiveInputs<B>, grad: &FloatTensor<B>| {
        let o = selective_forward_reference(inp.clone());
        grads(selective_backward_reference(
            inp.clone(),
            o.vpost,
            o.spike,
            grad.clone(),
        ))
    };
    let (small, grad) = selective_inputs::<B>(cfg.check_steps, cfg, device);
    let (f, r) = (fused_fwd(&small), ref_fwd(&small));
    let (fs, rs) = (host::<B>(&f.spike), host::<B>(&r.spike));
    let agree = fs.iter().zip(&rs).filter(|(a, b)| a == b).count() as f64 / rs.len() as f64;
    let fired = rs.iter().filter(|&&s| s == 1.0).count() as f64 / rs.len() as f64;
    let err_fwd = worst(&host::<B>(&f.vpost), &host::<B>(&r.vpost));
    let err_bwd = fused_bwd(&small, &grad)
        .iter()
        .zip(&ref_bwd(&small, &grad))
        .map(|(a, b)| worst(&host::<B>(a), &host::<B>(b)))
        .fold(0.0f32, f32::max);
    drop((small, grad));
    let (full, grad) = selective_inputs::<B>(cfg.steps, cfg, device);
    let (n, c) = (
        cfg.steps * cfg.batch * cfg.elem_dim,
        cfg.batch * cfg.elem_dim,
    );
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = fused_fwd(&full);
    });
    let t_ref_fwd = time::<B>(device, cfg.reps, || {
        let _ = ref_fwd(&full);
    });
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = fused_bwd(&full, &grad);
    }) - t_fwd;
    let t_ref_bwd = time::<B>(device, cfg.reps, || {
        let _ = ref_bwd(&full, &grad);
    }) - t_ref_fwd;
    let mut failed = Ok(());
    for (name, err, s, s_ref, bytes) in [
        (
            "selective fused fwd",
            err_fwd,
            t_fwd,
            t_ref_fwd,
            4 * (6 * n + 4 * c),
        ),
        (
            "selective fused bwd",
            err_bwd,
            t_bwd,
            t_ref_bwd,
            4 * (11 * n + 8 * c),
        ),
    ] {
        if err.is_nan() || err > TOLERANCE {
            let _ = writeln!(
                out,
                "{name:<24} {err:>11.2e}  WRONG: differs from the composed reference; not timed"
            );
            failed = Err(name);
            continue;
        }
        let bw = bytes as f64 / s.max(1e-9);
        let _ = writeln!(
            out,
            "{name:<24} {err:>11.2e} {:>10.3} {:>9.1} {:>9.0}% {:>12}  composed from tensor ops: {:.3} ms ({:.1}× slower)",
            s * 1e3,
            bw / 1e9,
            100.0 * bw / copy_bw,
            if name.ends_with("fwd") {
                format!("{agree:.6}")
            } else {
                "-".into()
            },
            s_ref * 1e3,
            s_ref / s.max(1e-9)
        );
    }
    let _ = writeln!(
        out,
        "  (selective check: {:.1}% of the reference's spikes fire)",
        100.0 * fired
    );
    failed
}

/// Largest accepted error of a kernel that stores bf16 ([`SnnOps::storage_dtype`]) against
/// the f32 reference on the same (rounded) inputs, per tensor as `‖kernel − reference‖ /
/// ‖reference‖` (the 1e-2 for bf16 runs, the measure `verify plif-scan` holds bf16
/// storage to). Elementwise it cannot hold: a bias gradient summed over thousands of steps
/// cancels, and a rounding of 2⁻⁹ in one term becomes a larger share of the small sum.
const TOLERANCE_BF16: f32 = 1e-2;

/// `‖a − b‖ / ‖b‖` (0 when both are 0; infinite when the lengths differ).
fn rel_norm(a: &[f32], b: &[f32]) -> f32 {
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
fn worst_rel_norm<B: Backend>(a: &[FloatTensor<B>], b: &[FloatTensor<B>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| rel_norm(&host::<B>(x), &host::<B>(y)))
        .fold(0.0f32, f32::max)
}

/// `t` `[·, ·, ·]` cast to `dtype`.
fn cast3<B: Backend>(t: &FloatTensor<B>, dtype: burn::tensor::DType) -> FloatTensor<B> {
    prim(Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(t.clone())).cast(dtype))
}

/// `t` rounded to bf16 storage, and the exact f32 values of the rounded tensor.
fn rounded<B: Backend>(t: &FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let low = cast3::<B>(t, burn::tensor::DType::BF16);
    let wide = cast3::<B>(&low, burn::tensor::DType::F32);
    (low, wide)
}

/// The selective scan with bf16 storage, where the backend stores it: the four projections
/// and the upstream gradient rounded to bf16 go in, spikes, `V_post` and the projections'
/// gradients come out in bf16. Checked against the composed f32 reference on the same rounded
/// values (spikes and the final state must agree exactly: the arithmetic is f32; `V_post` and
/// the gradients within [`TOLERANCE_BF16`]), then timed at the 0.9B shape, bytes counted at
/// their stored width.
fn selective_stored<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    if B::storage_dtype() == burn::tensor::DType::F32 {
        return Ok(());
    }
    // (bf16 inputs, their exact f32 values, bf16 gradient, its f32 values)
    let prepare = |steps: usize| {
        let (inp, grad) = selective_inputs::<B>(steps, cfg, device);
        let (mut low, mut wide) = (inp.clone(), inp.clone());
        (low.i, wide.i) = rounded::<B>(&inp.i);
        (low.r_beta, wide.r_beta) = rounded::<B>(&inp.r_beta);
        (low.r_alpha, wide.r_alpha) = rounded::<B>(&inp.r_alpha);
        (low.r_th, wide.r_th) = rounded::<B>(&inp.r_th);
        let (grad_low, grad_wide) = rounded::<B>(&grad);
        (low, wide, grad_low, grad_wide)
    };
    let grads = selective_grad_list::<B>;
    let fused_bwd = |inp: &SelectiveInputs<B>, grad: &FloatTensor<B>| {
        let o = B::plif_selective_forward(inp.clone());
        grads(B::plif_selective_backward(
            inp.clone(),
            o.vpost,
            o.spike,
            grad.clone(),
        ))
    };
    let (low, wide, grad_low, grad_wide) = prepare(cfg.check_steps);
    let f = B::plif_selective_forward(low.clone());
    let r = selective_forward_reference(wide.clone());
    let (fs, rs) = (host::<B>(&f.spike), host::<B>(&r.spike));
    let agree = fs.iter().zip(&rs).filter(|(a, b)| a == b).count() as f64 / rs.len() as f64;
    let last_exact = f.last.as_ref().is_none_or(|last| {
        let rv = host::<B>(&r.vpost);
        host::<B>(last) == rv[rv.len() - cfg.batch * cfg.elem_dim..]
    });
    let err_fwd = if agree == 1.0 && last_exact {
        rel_norm(&host::<B>(&f.vpost), &host::<B>(&r.vpost))
    } else {
        f32::INFINITY
    };
    let reference = selective_backward_reference(wide, r.vpost, r.spike, grad_wide);
    let err_bwd = worst_rel_norm::<B>(&fused_bwd(&low, &grad_low), &grads(reference));
    drop((low, grad_low, f));
    let (full, _, grad, _) = prepare(cfg.steps);
    let (n, c) = (
        cfg.steps * cfg.batch * cfg.elem_dim,
        cfg.batch * cfg.elem_dim,
    );
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::plif_selective_forward(full.clone());
    });
    // The backward alone, on one forward's outputs.
    let o = B::plif_selective_forward(full.clone());
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = B::plif_selective_backward(
            full.clone(),
            o.vpost.clone(),
            o.spike.clone(),
            grad.clone(),
        );
    });
    let agree = if err_fwd.is_finite() {
        format!("{agree:.6}")
    } else {
        format!("spikes agree {agree:.6}, final state exact: {last_exact}")
    };
    // Stored values 2 bytes; biases, v0, the final state and the per-column sums 4.
    report_pairs(
        out,
        copy_bw,
        [
            Pair::stored(
                "selective fwd, bf16",
                err_fwd,
                t_fwd,
                2 * 6 * n + 4 * 3 * c,
                agree,
            ),
            Pair::stored(
                "selective bwd, bf16",
                err_bwd,
                t_bwd,
                2 * 11 * n + 4 * 5 * c,
                "-".into(),
            ),
        ],
    )
}

/// The FFN neurons with bf16 storage: the currents `i_gu` and the upstream gradient rounded
/// to bf16 go in, `g·v` and `∂i_gu` come out in bf16, `V_post` (which the backward's spike
/// recomputation reads) in f32. Against the composition in f32 on the same rounded values:
/// `V_post` bit for bit, `g·v` and every gradient within [`TOLERANCE_BF16`], both output
/// modes; timed at the 0.9B shape.
fn ffn_stored<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    if B::storage_dtype() == burn::tensor::DType::F32 {
        return Ok(());
    }
    let prepare = |steps: usize, leak: bool| {
        let (inp, grad) = ffn_inputs::<B>(steps, cfg, leak, device);
        let (mut low, mut wide) = (inp.clone(), inp.clone());
        (low.i_gu, wide.i_gu) = rounded::<B>(&inp.i_gu);
        let (grad_low, grad_wide) = rounded::<B>(&grad);
        (low, wide, grad_low, grad_wide)
    };
    let grads = ffn_grad_list::<B>;
    let fused_bwd = |inp: &FfnInputs<B>, grad: &FloatTensor<B>| {
        let (_, vpost) = B::ffn_neurons_forward(inp.clone());
        grads(B::ffn_neurons_backward(inp.clone(), vpost, grad.clone()))
    };
    let (mut err_fwd, mut err_bwd) = (0.0f32, 0.0f32);
    for leak in [true, false] {
        let (low, wide, grad_low, grad_wide) = prepare(cfg.check_steps, leak);
        let (gv, vp) = B::ffn_neurons_forward(low.clone());
        let (gv_ref, vp_ref) = ffn_forward_reference(&wide);
        err_fwd = if host::<B>(&vp) == host::<B>(&vp_ref) {
            err_fwd.max(rel_norm(&host::<B>(&gv), &host::<B>(&gv_ref)))
        } else {
            f32::INFINITY
        };
        let reference = grads(ffn_backward_reference(wide, vp_ref, grad_wide));
        err_bwd = err_bwd.max(worst_rel_norm::<B>(&fused_bwd(&low, &grad_low), &reference));
    }
    let (full, _, grad, _) = prepare(cfg.steps, true);
    let n = cfg.steps * cfg.batch * cfg.row_dim / 2;
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::ffn_neurons_forward(full.clone());
    });
    // The backward alone, on one forward's `V_post`.
    let (_, vpost) = B::ffn_neurons_forward(full.clone());
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = B::ffn_neurons_backward(full.clone(), vpost.clone(), grad.clone());
    });
    // Forward: i_gu read (2n bf16), g·v (n bf16) and V_post (2n f32) written; backward:
    // ∂(g·v), i_gu and V_post read, ∂i_gu (2n bf16) written.
    report_pairs(
        out,
        copy_bw,
        [
            Pair::stored("ffn neurons fwd, bf16", err_fwd, t_fwd, 14 * n, "-".into()),
            Pair::stored("ffn neurons bwd, bf16", err_bwd, t_bwd, 18 * n, "-".into()),
        ],
    )
}

/// Inputs of the FFN neurons at `steps` frames (`row_dim` = 2·D_ff channels) and an upstream
/// gradient of `g·v`: currents and thresholds near the model's operating point.
fn ffn_inputs<B: Backend>(
    steps: usize,
    cfg: &ScanBench,
    leak: bool,
    device: &B::Device,
) -> (FfnInputs<B>, FloatTensor<B>) {
    let n = |mean, std| Distribution::Normal(mean, std);
    let f = cfg.row_dim / 2;
    let vec = |d| prim(Tensor::<B, 1>::random([f], d, device));
    let inputs = FfnInputs {
        i_gu: prim(Tensor::<B, 3>::random(
            [steps, cfg.batch, 2 * f],
            n(0.2, 0.6),
            device,
        )),
        w_gate: vec(n(0.0, 0.5)),
        w_up: vec(n(0.0, 0.5)),
        th_gate: vec(n(0.15, 0.05)),
        th_up: vec(n(0.15, 0.05)),
        v0: prim(Tensor::<B, 2>::random(
            [cfg.batch, 2 * f],
            n(0.0, 0.1),
            device,
        )),
        leak,
    };
    let grad = prim(Tensor::<B, 3>::random(
        [steps, cfg.batch, f],
        n(0.0, 1.0),
        device,
    ));
    (inputs, grad)
}

/// The FFN neurons' training op ([`SnnOps::ffn_neurons_forward`] / `_backward`) against the
/// composition ([`ffn_forward_reference`] / [`ffn_backward_reference`]) on the same device:
/// `g·v` and `V_post` bit for bit, every gradient within the tolerance, in both output modes;
/// then both timed at the 0.9B shape (`row_dim` = 2·D_ff, leak).
fn ffn_neurons<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let grads = ffn_grad_list::<B>;
    let fused_bwd = |inp: &FfnInputs<B>, grad: &FloatTensor<B>| {
        let (_, vpost) = B::ffn_neurons_forward(inp.clone());
        grads(B::ffn_neurons_backward(inp.clone(), vpost, grad.clone()))
    };
    let ref_bwd = |inp: &FfnInputs<B>, grad: &FloatTensor<B>| {
        let (_, vpost) = ffn_forward_reference(inp);
        grads(ffn_backward_reference(inp.clone(), vpost, grad.clone()))
    };
    // The forward's error is 0 when bit for bit, NaN otherwise.
    let (mut err_fwd, mut err_bwd) = (0.0f32, 0.0f32);
    for leak in [true, false] {
        let (small, grad) = ffn_inputs::<B>(cfg.check_steps, cfg, leak, device);
        let (gv, vp) = B::ffn_neurons_forward(small.clone());
        let (gv_ref, vp_ref) = ffn_forward_reference(&small);
        // Bit for bit: any difference (NaN included) fails the check.
        for (a, b) in [(gv, gv_ref), (vp, vp_ref)] {
            let (a, b) = (host::<B>(&a), host::<B>(&b));
            let same =
                a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            if !same {
                err_fwd = f32::NAN;
            }
        }
        err_bwd = fused_bwd(&small, &grad)
            .iter()
            .zip(&ref_bwd(&small, &grad))
            .map(|(a, b)| worst(&host::<B>(a), &host::<B>(b)))
            .fold(err_bwd, f32::max);
    }
    let (full, grad) = ffn_inputs::<B>(cfg.steps, cfg, true, device);
    let n = cfg.steps * cfg.batch * cfg.row_dim / 2;
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::ffn_neurons_forward(full.clone());
    });
    let t_ref_fwd = time::<B>(device, cfg.reps, || {
        let _ = ffn_forward_reference(&full);
    });
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = fused_bwd(&full, &grad);
    }) - t_fwd;
    let t_ref_bwd = time::<B>(device, cfg.reps, || {
        let _ = ref_bwd(&full, &grad);
    }) - t_ref_fwd;
    // Bytes: i_gu read, g·v and V_post written (forward); ∂(g·v), i_gu, V_post read and ∂i_gu
    // written (backward). The forward must be bit for bit (tolerance 0).
    report_pairs(
        out,
        copy_bw,
        [
            Pair::composed("ffn neurons fwd", err_fwd, 0.0, t_fwd, t_ref_fwd, 4 * 5 * n),
            Pair::composed(
                "ffn neurons bwd",
                err_bwd,
                TOLERANCE,
                t_bwd,
                t_ref_bwd,
                4 * 7 * n,
            ),
        ],
    )
}

/// PonderAgg's training op ([`SnnOps::ponder_forward`] / `_backward`) against the composition
/// ([`ponder_forward_reference`] / [`ponder_backward_reference`]) on the same device, outputs
/// and gradients within the tolerance (the logits' dot products sum in another order), then both
/// timed at `steps` frames of `K` (`dim` = D).
fn ponder<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let n = |mean, std| Distribution::Normal(mean, std);
    let inputs = |steps: usize| {
        let frames = steps.div_ceil(cfg.k) * cfg.k;
        let inp = PonderInputs {
            frames: prim(Tensor::<B, 3>::random(
                [frames, cfg.batch, cfg.dim],
                n(0.0, 1.0),
                device,
            )),
            halt_w: prim(Tensor::<B, 2>::random([1, cfg.dim], n(0.0, 0.05), device)),
            halt_b: prim(Tensor::<B, 1>::random([1], n(-1.0, 0.1), device)),
            k: cfg.k,
            clamp: 1e-7,
            eps: 1e-8,
        };
        let grad = prim(Tensor::<B, 3>::random(
            [frames / cfg.k, cfg.batch, cfg.dim + 1],
            n(0.0, 1.0),
            device,
        ));
        (inp, grad)
    };
    let (small, grad) = inputs(cfg.check_steps.max(cfg.k));
    let err_fwd = worst(
        &host::<B>(&B::ponder_forward(small.clone())),
        &host::<B>(&ponder_forward_reference(&small)),
    );
    let err_bwd = B::ponder_backward(small.clone(), grad.clone())
        .iter()
        .zip(&ponder_backward_reference(small, grad))
        .map(|(a, b)| worst(&host::<B>(a), &host::<B>(b)))
        .fold(0.0f32, f32::max);
    let (full, grad) = inputs(cfg.steps);
    let frames = cfg.steps.div_ceil(cfg.k) * cfg.k * cfg.batch * cfg.dim;
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::ponder_forward(full.clone());
    });
    let t_ref_fwd = time::<B>(device, cfg.reps, || {
        let _ = ponder_forward_reference(&full);
    });
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = B::ponder_backward(full.clone(), grad.clone());
    });
    let t_ref_bwd = time::<B>(device, cfg.reps, || {
        let _ = ponder_backward_reference(full.clone(), grad.clone());
    });
    // Bytes: the frames read once (forward); read twice and ∂frames written (backward).
    report_pairs(
        out,
        copy_bw,
        [
            Pair::composed(
                "ponder agg fwd",
                err_fwd,
                TOLERANCE,
                t_fwd,
                t_ref_fwd,
                4 * frames,
            ),
            Pair::composed(
                "ponder agg bwd",
                err_bwd,
                TOLERANCE,
                t_bwd,
                t_ref_bwd,
                4 * 3 * frames,
            ),
        ],
    )
}

/// RMSNorm + the input PLIF's training op ([`SnnOps::norm_plif_forward`] / `_backward`)
/// against the composition ([`norm_plif_forward_reference`] / [`norm_plif_backward_reference`])
/// on the same device, in both output modes: outputs and gradients within the tolerance (the
/// kernels reduce `mean(x²)` in another order), then both timed at `steps` frames of `K`
/// (`dim` = D, leak).
fn norm_plif<B: SnnOps>(
    device: &B::Device,
    cfg: &ScanBench,
    copy_bw: f64,
    out: &mut String,
) -> Result<(), &'static str> {
    let n = |mean, std| Distribution::Normal(mean, std);
    let inputs = |steps: usize, leak: bool| {
        let t = steps.div_ceil(cfg.k);
        let vec = |d| prim(Tensor::<B, 1>::random([cfg.dim], d, device));
        let inp = NormPlifInputs {
            x: prim(Tensor::<B, 3>::random(
                [t, cfg.batch, cfg.dim],
                n(0.1, 1.0),
                device,
            )),
            norm_w: vec(n(1.0, 0.2)),
            eps: 1e-6,
            w: vec(n(0.0, 0.5)),
            v_th: vec(n(0.5, 0.15)),
            v0: prim(Tensor::<B, 2>::random(
                [cfg.batch, cfg.dim],
                n(0.0, 0.2),
                device,
            )),
            k: cfg.k,
            leak,
        };
        let grad = prim(Tensor::<B, 3>::random(
            [t * cfg.k, cfg.batch, cfg.dim],
            n(0.0, 1.0),
            device,
        ));
        (inp, grad)
    };
    let (mut err_fwd, mut err_bwd) = (0.0f32, 0.0f32);
    for leak in [true, false] {
        let (small, grad) = inputs(cfg.check_steps.max(cfg.k), leak);
        let (y, vp) = B::norm_plif_forward(small.clone());
        let (y_ref, vp_ref) = norm_plif_forward_reference(&small);
        err_fwd = err_fwd
            .max(worst(&host::<B>(&y), &host::<B>(&y_ref)))
            .max(worst(&host::<B>(&vp), &host::<B>(&vp_ref)));
        err_bwd = B::norm_plif_backward(small.clone(), vp, grad.clone())
            .iter()
            .zip(&norm_plif_backward_reference(small, vp_ref, grad))
            .map(|(a, b)| worst(&host::<B>(a), &host::<B>(b)))
            .fold(err_bwd, f32::max);
    }
    let (full, grad) = inputs(cfg.steps, true);
    let frames = cfg.steps.div_ceil(cfg.k) * cfg.k * cfg.batch * cfg.dim;
    let (_, vpost) = B::norm_plif_forward(full.clone());
    let (_, vpost_ref) = norm_plif_forward_reference(&full);
    let t_fwd = time::<B>(device, cfg.reps, || {
        let _ = B::norm_plif_forward(full.clone());
    });
    let t_ref_fwd = time::<B>(device, cfg.reps, || {
        let _ = norm_plif_forward_reference(&full);
    });
    let t_bwd = time::<B>(device, cfg.reps, || {
        let _ = B::norm_plif_backward(full.clone(), vpost.clone(), grad.clone());
    });
    let t_ref_bwd = time::<B>(device, cfg.reps, || {
        let _ = norm_plif_backward_reference(full.clone(), vpost_ref.clone(), grad.clone());
    });
    // Bytes: the output and V_post written (forward); ∂y and V_post read (backward).
    report_pairs(
        out,
        copy_bw,
        [
            Pair::composed(
                "norm + input plif fwd",
                err_fwd,
                TOLERANCE,
                t_fwd,
                t_ref_fwd,
                4 * 2 * frames,
            ),
            Pair::composed(
                "norm + input plif bwd",
                err_bwd,
                TOLERANCE,
                t_bwd,
                t_ref_bwd,
                4 * 2 * frames,
            ),
        ],
    )
}

/// One fused kernel's check and timing against its composition.
struct Pair {
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
    fn composed(name: &'static str, err: f32, tol: f32, s: f64, s_ref: f64, bytes: usize) -> Self {
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

    /// A bf16-storage kernel against the f32 reference on the same rounded inputs.
    fn stored(name: &'static str, err: f32, s: f64, bytes: usize, agree: String) -> Self {
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
fn report_pairs<const N: usize>(
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
