//! The `SnnOps` family for the CUDA backend (`burn_cuda::Cuda<f32, i32>`): the GEMM hook through
//! cuBLASLt ([`crate::cuda::gemm`]), the scans and the fused training ops as CubeCL kernels
//! ([`crate::cuda::scan`], [`crate::cuda::selective`], [`crate::cuda::ffn`],
//! [`crate::cuda::norm_plif`], [`crate::cuda::ponder`]), the decoding fusions
//! ([`crate::cuda::decode`]), peer copies, timing and CUDA graphs. Tested against the host
//! reference and the compositions the defaults run.

use crate::KernelError;
use crate::cuda::{
    decode, device, ffn, gated, gemm, graph, host_read, host_write, norm_plif, norm_plif_staged,
    ponder, ponder_backward, precision, scan, selective, timing,
};
use crate::ops::device::{DeviceOps, GraphOps};
use crate::ops::gemm::GemmOps;
use crate::ops::infer::InferOps;
use crate::ops::optim::OptimOps;
use crate::ops::scan::{ScanOps, scan_shape};
use crate::ops::snn::SnnOps;
use crate::ops::types::{
    AdamStep, FfnGrads, FfnInputs, NormPlifInputs, PlifGrads, PlifOutput, PonderInputs, ScanKind,
    SelectiveGrads, SelectiveInputs, StepGraph,
};
use crate::reference::ffn::ffn_param_grads;
use crate::tensor::{prim, through_sigmoid, wrap};
use burn::tensor::{DType, Shape, activation::sigmoid, backend::Backend, ops::FloatTensor};

type Cuda = burn_cuda::Cuda<f32, i32>;

/// Runs a PLIF scan kernel's launch as a timed scan span ([`crate::cuda::timing`]).
fn scan_timed<R>(device: &burn_cuda::CudaDevice, f: impl FnOnce() -> R) -> R {
    timing::timed(device, timing::Kind::Scan, f)
}

/// The fused selective scan's tensors in kernel argument order.
fn selective_args<B: Backend>(inp: SelectiveInputs<B>) -> [FloatTensor<B>; 8] {
    [
        inp.i,
        inp.r_beta,
        inp.r_alpha,
        inp.r_th,
        inp.b_beta,
        inp.b_alpha,
        inp.b_th,
        inp.v0,
    ]
}

/// The fused selective forward as a timed scan span: `(spikes where asked, V_post, last)`.
fn selective_forward_timed(
    inp: SelectiveInputs<Cuda>,
    spikes: bool,
) -> (
    Option<FloatTensor<Cuda>>,
    FloatTensor<Cuda>,
    FloatTensor<Cuda>,
) {
    let _ = scan_shape::<Cuda>(&inp.i, &inp.v0);
    let v_th_min = inp.v_th_min;
    let device = inp.i.device.clone();
    scan_timed(&device, || {
        selective::selective_forward(selective_args(inp), v_th_min, spikes)
    })
}

/// RMSNorm + the input PLIF's tensors `[x, norm_w, w, v_th, v0]` and `(eps, K, leak)`, as the
/// kernels take them.
fn norm_plif_args<B: Backend>(inp: NormPlifInputs<B>) -> ([FloatTensor<B>; 5], f32, usize, bool) {
    let eps = inp.eps as f32;
    (
        [inp.x, inp.norm_w, inp.w, inp.v_th, inp.v0],
        eps,
        inp.k,
        inp.leak,
    )
}

/// PonderAgg's tensors `[frames, halt_w, halt_b]` and `(K, clamp, eps)`, as the kernels take
/// them.
fn ponder_args<B: Backend>(inp: PonderInputs<B>) -> ([FloatTensor<B>; 3], usize, f32, f32) {
    let (clamp, eps) = (inp.clamp as f32, inp.eps as f32);
    ([inp.frames, inp.halt_w, inp.halt_b], inp.k, clamp, eps)
}

/// The FFN neurons' parameters `[w_gate, w_up, th_gate, th_up]`.
fn ffn_params<B: Backend>(inp: &FfnInputs<B>) -> [FloatTensor<B>; 4] {
    [
        inp.w_gate.clone(),
        inp.w_up.clone(),
        inp.th_gate.clone(),
        inp.th_up.clone(),
    ]
}

impl GemmOps for Cuda {
    fn gemm(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        gemm::gemm(lhs, rhs)
    }

    fn gemm_add(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        c: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        gemm::gemm_add(precision::precision(), lhs, rhs, c)
    }

    fn gemm_operand(t: FloatTensor<Self>) -> FloatTensor<Self> {
        gemm::round_operand(t, precision::precision())
    }

    fn gemm_out(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, out: DType) -> FloatTensor<Self> {
        gemm::gemm_out(precision::precision(), lhs, rhs, out)
    }

    fn storage_dtype() -> DType {
        precision::storage_dtype()
    }

    fn merges_small_gemms() -> bool {
        true
    }
}

/// The scans as CubeCL kernels ([`crate::cuda::scan`]), tested against the host reference
/// these defaults run.
impl ScanOps for Cuda {
    fn plif_forward(
        kind: ScanKind,
        beta: FloatTensor<Self>,
        u: FloatTensor<Self>,
        vth: FloatTensor<Self>,
        v0: FloatTensor<Self>,
    ) -> PlifOutput<Self> {
        let _ = scan_shape::<Self>(&u, &v0);
        let device = u.device.clone();
        let row = kind == ScanKind::Row;
        let (spike, vpost) = scan_timed(&device, || scan::forward(row, beta, u, vth, v0));
        PlifOutput {
            spike,
            vpost,
            last: None,
        }
    }

    fn plif_backward(
        kind: ScanKind,
        beta: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        vpost: FloatTensor<Self>,
        spike: FloatTensor<Self>,
        grad_vpost: FloatTensor<Self>,
    ) -> PlifGrads<Self> {
        let _ = scan_shape::<Self>(&grad_vpost, &v0);
        let device = grad_vpost.device.clone();
        let row = kind == ScanKind::Row;
        let [beta, u, vth, v0] = scan_timed(&device, || {
            scan::backward(row, beta, v0, vpost, spike, grad_vpost)
        });
        PlifGrads { beta, u, vth, v0 }
    }
}

impl InferOps for Cuda {
    fn ponder_agg_fused(inp: PonderInputs<Self>) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let (t, k, clamp, eps) = ponder_args(inp);
        Some(ponder::ponder_agg(t, k, clamp, eps))
    }

    fn ponder_residual_fused(
        inp: PonderInputs<Self>,
        h: FloatTensor<Self>,
        w_mean: FloatTensor<Self>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>)> {
        let ([frames, halt_w, halt_b], k, clamp, eps) = ponder_args(inp);
        ponder::ponder_residual([frames, halt_w, halt_b, h, w_mean], k, clamp, eps)
    }

    fn norm_plif_mean_fused(
        inp: NormPlifInputs<Self>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let (t, eps, k, leak) = norm_plif_args(inp);
        Some(norm_plif::norm_plif(t, eps, k, leak, true))
    }

    fn rms_norm_fused(
        x: FloatTensor<Self>,
        gain: FloatTensor<Self>,
        eps: f64,
    ) -> Option<FloatTensor<Self>> {
        Some(decode::rms_norm(x, gain, eps as f32))
    }

    fn norm_plif_fused(
        inp: NormPlifInputs<Self>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let (t, eps, k, leak) = norm_plif_args(inp);
        Some(norm_plif::norm_plif(t, eps, k, leak, false))
    }

    fn ffn_plif_fused(inp: FfnInputs<Self>) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let params = ffn_params(&inp);
        Some(ffn::ffn_infer(inp.i_gu, params, inp.v0, inp.leak))
    }

    fn block_scan_fused(
        y: FloatTensor<Self>,
        b_beta: FloatTensor<Self>,
        b_alpha: FloatTensor<Self>,
        b_th: FloatTensor<Self>,
        v0: FloatTensor<Self>,
        v_th_min: f64,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        Some(decode::block_scan(
            y,
            [b_beta, b_alpha, b_th],
            v0,
            v_th_min as f32,
        ))
    }

    fn gate_skip_fused(
        out: FloatTensor<Self>,
        y: FloatTensor<Self>,
        gate_col: usize,
        skip_col: usize,
    ) -> Option<FloatTensor<Self>> {
        Some(decode::gate_skip(out, y, gate_col, skip_col))
    }

    fn centred_residual_fused(
        h: FloatTensor<Self>,
        r: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        Some(decode::centred_residual(h, r))
    }
}

impl DeviceOps for Cuda {
    fn move_to_device(t: FloatTensor<Self>, device: &Self::Device) -> FloatTensor<Self> {
        device::to_device(t, device)
    }

    fn collective_id() -> Result<Vec<u8>, KernelError> {
        super::nccl::unique_id()
    }

    fn collective_join(
        id: &[u8],
        rank: usize,
        size: usize,
        device: &Self::Device,
    ) -> Result<u64, KernelError> {
        super::nccl::join(id, rank, size, device)
    }

    fn all_reduce_sum(t: FloatTensor<Self>, comm: u64) -> Result<FloatTensor<Self>, KernelError> {
        super::nccl::all_reduce_sum(t, comm)
    }

    fn flush(device: &Self::Device) {
        graph::flush(device);
    }

    fn compile_only(device: &Self::Device, on: bool) -> bool {
        super::server::compile_only(device, on)
    }

    /// Through [`host_write`] unless the upload is small ([`host_write::MIN_BYTES`]), the
    /// `pinned_upload` knob is off or it fails (a pinned allocation refused, say): then
    /// CubeCL's own write, as the default.
    fn upload_f32(values: &[f32], shape: Shape, device: &Self::Device) -> FloatTensor<Self> {
        use burn::tensor::ops::FloatTensorOps;
        if crate::tuning::current().pinned_upload && values.len() * 4 >= host_write::MIN_BYTES {
            match host_write::upload_f32(values, shape.clone(), device) {
                Ok(t) => return t,
                Err(e) => eprintln!("nsactor: pinned upload failed ({e}); using CubeCL's write"),
            }
        }
        Self::float_from_data(
            burn::tensor::TensorData::new(values.to_vec(), shape),
            device,
        )
    }

    fn read_f32_into(t: FloatTensor<Self>, out: &mut [u8]) -> Result<(), KernelError> {
        use burn::tensor::ops::FloatTensorOps;
        let t = match t.dtype {
            DType::F32 => t,
            _ => Self::float_cast(t, burn::tensor::FloatDType::F32),
        };
        host_read::read_f32_into(t, out)
    }

    fn timed_call<R>(device: &Self::Device, name: &'static str, f: impl FnOnce() -> R) -> R {
        timing::timed(device, timing::Kind::Call(name), f)
    }

    fn submission_stats() -> Option<[u64; 5]> {
        let (launches, launch_ns) = cubecl::cuda::nsactor_stats::launches();
        let (gemms, gemm_ns, lt_ns) = gemm::queued_stats();
        Some([launches, launch_ns, gemms, gemm_ns, lt_ns])
    }
}

impl OptimOps for Cuda {
    fn adam_update(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        s: &AdamStep,
    ) -> [FloatTensor<Self>; 3] {
        super::optim::adam(p, g, m, v, s)
    }

    fn square_sums(ts: Vec<FloatTensor<Self>>) -> FloatTensor<Self> {
        super::optim::square_sums(ts)
    }
}

impl GraphOps for Cuda {
    fn captures_steps() -> bool {
        true
    }

    fn capture<R>(
        device: &Self::Device,
        inputs: &[FloatTensor<Self>],
        f: impl FnOnce() -> R,
    ) -> Result<(R, StepGraph), KernelError> {
        graph::capture(device, inputs, f).map(|(r, g)| (r, StepGraph::new(g)))
    }

    fn capture_copy(src: FloatTensor<Self>, dst: &FloatTensor<Self>) -> Result<(), KernelError> {
        graph::copy(src, dst)
    }

    fn contiguous(t: FloatTensor<Self>) -> FloatTensor<Self> {
        burn_cubecl::kernel::into_contiguous(t)
    }

    fn replay(
        graph: &StepGraph,
        inputs: Vec<(FloatTensor<Self>, FloatTensor<Self>)>,
        written: &[FloatTensor<Self>],
    ) -> Result<(), KernelError> {
        graph
            .get::<graph::Graph>()
            .ok_or_else(|| KernelError::Misuse("a graph captured by another backend".into()))?
            .replay(inputs, written)
    }
}

impl SnnOps for Cuda {
    fn fuses_modulation() -> bool {
        true
    }

    /// The `norm_plif` knob `composed` (`NSACTOR_NORM_PLIF=composed`) keeps the composition, for
    /// comparison.
    fn fuses_norm_plif() -> bool {
        crate::tuning::current().fused_norm_plif
    }

    fn norm_plif_forward(inp: NormPlifInputs<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = inp.x.device.clone();
        let (t, eps, k, leak) = norm_plif_args(inp);
        scan_timed(&device, || norm_plif::norm_plif_train(t, eps, k, leak))
    }

    fn norm_plif_backward(
        inp: NormPlifInputs<Self>,
        vpost: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 5] {
        let d = inp.w.meta.shape()[0];
        let beta = sigmoid(wrap::<Self, 1>(inp.w.clone()));
        let device = inp.x.device.clone();
        let (t, eps, k, leak) = norm_plif_args(inp);
        let [dx, dnw_rows, d_beta, d_th, d_v0] = scan_timed(&device, || {
            norm_plif_staged::norm_plif_backward(t, eps, k, leak, vpost, grad)
        });
        let d_nw = wrap::<Self, 2>(dnw_rows).sum_dim(0).reshape([d]);
        let d_beta = wrap::<Self, 2>(d_beta).sum_dim(0).reshape([d]);
        let d_w = through_sigmoid(d_beta, beta);
        let d_th = wrap::<Self, 2>(d_th).sum_dim(0).reshape([d]);
        [dx, prim(d_nw), prim(d_w), prim(d_th), d_v0]
    }

    /// The `ponder` knob `composed` (`NSACTOR_PONDER=composed`) keeps the composition, for
    /// comparison.
    fn fuses_ponder() -> bool {
        crate::tuning::current().fused_ponder
    }

    fn ponder_forward(inp: PonderInputs<Self>) -> FloatTensor<Self> {
        let (t, k, clamp, eps) = ponder_args(inp);
        ponder::ponder_agg_packed(t, k, clamp, eps)
    }

    fn ponder_backward(inp: PonderInputs<Self>, grad: FloatTensor<Self>) -> [FloatTensor<Self>; 3] {
        let d = inp.halt_w.meta.shape()[1];
        let (t, k, clamp, eps) = ponder_args(inp);
        let [dx, dw_rows, db_rows] = ponder_backward::ponder_backward(t, grad, k, clamp, eps);
        let dw = wrap::<Self, 2>(dw_rows).sum_dim(0).reshape([1, d]);
        let db = wrap::<Self, 1>(db_rows).sum();
        [dx, prim(dw), prim(db)]
    }

    /// The `gated_out` knob `composed` (`NSACTOR_GATED_OUT=composed`) keeps the composition, for
    /// comparison.
    fn fuses_gated_out() -> bool {
        crate::tuning::current().fused_gated_out
    }

    fn gated_out_forward(
        r: FloatTensor<Self>,
        g: FloatTensor<Self>,
        s: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        gated::gated_out(r, g, s)
    }

    fn gated_out_backward(
        r: FloatTensor<Self>,
        g: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> [FloatTensor<Self>; 3] {
        gated::gated_out_backward(r, g, dy)
    }

    /// The `ffn_neurons` knob `composed` (`NSACTOR_FFN_NEURONS=composed`) keeps the composition, for
    /// comparison.
    fn fuses_ffn_neurons() -> bool {
        crate::tuning::current().fused_ffn_neurons
    }

    fn ffn_neurons_forward(inp: FfnInputs<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = inp.i_gu.device.clone();
        scan_timed(&device, || {
            let params = ffn_params(&inp);
            ffn::ffn_forward(inp.i_gu, params, inp.v0, inp.leak)
        })
    }

    fn ffn_neurons_backward(
        inp: FfnInputs<Self>,
        vpost: FloatTensor<Self>,
        grad_gv: FloatTensor<Self>,
    ) -> FfnGrads<Self> {
        let device = inp.i_gu.device.clone();
        let [d_i, d_beta, d_th, d_v0] = scan_timed(&device, || {
            ffn::ffn_backward(
                inp.i_gu.clone(),
                ffn_params(&inp),
                inp.v0.clone(),
                vpost,
                grad_gv,
                inp.leak,
            )
        });
        let [w_gate, w_up, th_gate, th_up] = ffn_param_grads(&inp, d_beta, d_th);
        FfnGrads {
            i_gu: d_i,
            w_gate,
            w_up,
            th_gate,
            th_up,
            v0: d_v0,
        }
    }

    fn plif_selective_forward(inp: SelectiveInputs<Self>) -> PlifOutput<Self> {
        let (spike, vpost, last) = selective_forward_timed(inp, true);
        PlifOutput {
            spike: spike.expect("asked for the spikes"),
            vpost,
            last: Some(last),
        }
    }

    fn plif_selective_untracked(
        inp: SelectiveInputs<Self>,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let (_, vpost, last) = selective_forward_timed(inp, false);
        (vpost, Some(last))
    }

    fn plif_selective_backward(
        inp: SelectiveInputs<Self>,
        vpost: FloatTensor<Self>,
        spike: FloatTensor<Self>,
        grad_vpost: FloatTensor<Self>,
    ) -> SelectiveGrads<Self> {
        let (shape, _) = scan_shape::<Self>(&grad_vpost, &inp.v0);
        let device = inp.i.device.clone();
        let [i, r_beta, r_alpha, r_th, v0, bias] = scan_timed(&device, || {
            selective::selective_backward(selective_args(inp), vpost, spike, grad_vpost)
        });
        // [3, B, DN] per-column sums over time → [3, DN] over the batch.
        let dn = shape[2];
        let bias = wrap::<Self, 3>(bias).sum_dim(1).reshape([3, dn]);
        let row = |k: usize| prim(bias.clone().narrow(0, k, 1).reshape([dn]));
        SelectiveGrads {
            i,
            r_beta,
            r_alpha,
            r_th,
            b_beta: row(0),
            b_alpha: row(1),
            b_th: row(2),
            v0,
        }
    }
}
