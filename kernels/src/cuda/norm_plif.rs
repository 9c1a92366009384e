//! RMSNorm then the row-parameter input PLIF over the K frames of each token (SPEC §2.3) as
//! CubeCL kernels: the inverse RMS per row, then one unit per `(batch row, channel)` walks the
//! tokens and their frames. For inference (output in the GEMM's input type, optionally each
//! token's K outputs averaged, a decoding step's RMS summed inside the scan kernel) and for
//! training (saving `V_post`), with the training op's backward.

use crate::cuda::common::{
    FEW_ROWS, check_norm_plif_params, gemm_input, launch_guarded, out_like, out_typed, sigmoid_burn,
};
use crate::cuda::norm_plif_staged::{
    Frames, NORM_PLIF_CUBE, norm_plif_geometry, norm_plif_staged_kernel, prefetch, rms_inv,
    token_frames,
};
use crate::cuda::precision::storage_dtype;
use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// RMSNorm then the row-parameter input PLIF over K frames of each token: one unit per
/// `(batch row, channel)` walks the tokens and their frames in order. `u = (1 − β)·x̂` is the
/// same in a token's K frames (SPEC §3); the output is `(1 − β)·V_post` (`leak`) or `V_post`.
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
fn norm_plif_kernel<O: Float>(
    x: &Tensor<f32>,
    r: &Tensor<f32>,
    norm_w: &Tensor<f32>,
    w: &Tensor<f32>,
    v_th: &Tensor<f32>,
    v0: &Tensor<f32>,
    y: &mut Tensor<O>,
    last: &mut Tensor<f32>,
    vpost: &mut Tensor<f32>,
    cols: u32,
    dim: u32,
    tokens: u32,
    eps: f32,
    #[comptime] k: usize,
    #[comptime] leak: bool,
    #[comptime] save_vpost: bool,
    #[comptime] fused_rms: bool,
    #[comptime] mean_frames: bool,
    #[define(O)] _out: StorageType,
) {
    let cols = cols as usize;
    let dim = dim as usize;
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let b = c / dim;
    let d = c % dim;
    let beta = sigmoid_burn(w[d]);
    let one_minus = -beta + 1.0f32;
    let th = v_th[d];
    let nw = norm_w[d];
    let mut v = v0[c];
    for t in 0..tokens as usize {
        // 1/RMS of the token's row: read from `r`, or (`r` is then a stand-in, its read
        // unused) summed here by the plane exactly as
        // `rms_inv_kernel` sums it (lane l takes channels l, l + 32, …; then the plane sum).
        // With `fused_rms` every plane holds 32 channels of one batch row (D a multiple of
        // 32), so no unit left before the plane's sums.
        let mut rr = r[t * (cols / dim) + b];
        if comptime![fused_rms] {
            let base = t * cols + b * dim;
            let mut ss = 0.0f32;
            let mut dd = d % 32;
            // Eight loads in flight per round (28 a lane at D = 896: four rounds of waiting,
            // not seven), summed in the same order as one at a time.
            while dd + 224 < dim {
                let x0 = x[base + dd];
                let x1 = x[base + dd + 32];
                let x2 = x[base + dd + 64];
                let x3 = x[base + dd + 96];
                let x4 = x[base + dd + 128];
                let x5 = x[base + dd + 160];
                let x6 = x[base + dd + 192];
                let x7 = x[base + dd + 224];
                ss += x0 * x0;
                ss += x1 * x1;
                ss += x2 * x2;
                ss += x3 * x3;
                ss += x4 * x4;
                ss += x5 * x5;
                ss += x6 * x6;
                ss += x7 * x7;
                dd += 256usize;
            }
            while dd < dim {
                let xv = x[base + dd];
                ss += xv * xv;
                dd += 32usize;
            }
            let total = plane_sum(ss);
            rr = 1.0f32 / (total / f32::cast_from(dim) + eps).sqrt();
        }
        let u = x[t * cols + c] * rr * nw * one_minus;
        let frames = Frames {
            beta,
            one_minus,
            th,
            t,
            c,
            cols,
        };
        v = token_frames::<O>(&frames, v, u, y, vpost, k, leak, save_vpost, mean_frames);
    }
    last[c] = v;
}

/// `x` `[T, B, D]` → RMSNorm (`norm_w`, `eps`) → input PLIF (`w` = the β logits, `v_th`, state
/// `v0` `[B, D]`) over K frames per token, for inference: the output `[T·K, B, D]`, or with
/// `mean` each token's K outputs averaged in the kernel (`[T, B, D]` in the GEMM's input type:
/// the edge's output neuron before `decode_proj`), and the final state `[B, D]`. `inputs`:
/// `[x, norm_w, w, v_th, v0]`, as every function here takes them.
pub fn norm_plif<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 5],
    eps: f32,
    k: usize,
    leak: bool,
    mean: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let chunk = crate::cuda::speculative::time_chunk_norm();
    norm_plif_cut(inputs, eps, k, leak, mean, chunk)
}

/// [`norm_plif`] cut in time chunks of `chunk` frames where it is cut at all (0: never).
pub(crate) fn norm_plif_cut<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 5],
    eps: f32,
    k: usize,
    leak: bool,
    mean: bool,
    chunk: usize,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [y, last, _] = norm_plif_with(inputs, eps, k, leak, false, mean, chunk);
    (y, last)
}

/// The same for training: `(output, V_post [T·K, B, D])`, `V_post` saved for the backward.
pub fn norm_plif_train<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 5],
    eps: f32,
    k: usize,
    leak: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [y, _, vpost] = norm_plif_with(inputs, eps, k, leak, true, false, 0);
    (y, vpost)
}

/// `[output, final state, V_post (empty unless save_vpost)]`; inputs `x, norm_w, w, v_th, v0`;
/// inference in time chunks of `chunk` frames where it is cut.
fn norm_plif_with<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 5],
    eps: f32,
    k: usize,
    leak: bool,
    save_vpost: bool,
    mean_frames: bool,
    chunk: usize,
) -> [CubeTensor<R>; 3] {
    let (t, batch, dim) = norm_plif_geometry(&inputs.each_ref(), k);
    let [x, norm_w, w, v_th, v0] = inputs.map(into_contiguous);
    check_norm_plif_params([&norm_w, &w, &v_th, &v0], (batch, dim));
    // A decoding step (few token rows) sums each row's RMS inside the scan kernel where a
    // plane holds one row's channels: one launch instead of two. With many token rows (a
    // training micro-batch, even untracked) every plane would walk all its tokens' rows alone,
    // so the separate kernel, one plane per row, stays.
    let fused_rms =
        !save_vpost && t * batch < FEW_ROWS && dim.is_multiple_of(NORM_PLIF_CUBE as usize);
    let r = if fused_rms {
        x.clone()
    } else {
        rms_inv(&x, t, batch, dim, eps)
    };
    // Inference writes the output in the type the projections' GEMM reads; training in the
    // storage type, which the model rounds the projections' shared input to anyway
    // (`nsactor_kernels::stored`): bf16 in bf16 precision, so that cast and its backward's
    // widening of the summed input gradients are gone (the backward reads that sum as it is).
    let y_dtype = if save_vpost {
        storage_dtype()
    } else {
        gemm_input()
    };
    let frames = if mean_frames { t } else { t * k };
    let y = out_typed(&x, Shape::new([frames, batch, dim]), y_dtype);
    let last = out_like(&x, Shape::new([batch, dim]));
    let vpost = out_like(
        &x,
        Shape::new(if save_vpost {
            [t * k, batch, dim]
        } else {
            [1, 1, 1]
        }),
    );
    let cols = batch * dim;
    if t == 0 {
        // No tokens: no frames, the state as it came (the staged kernel clamps its loads
        // below `T`).
        return [y, v0, vpost];
    }
    let cubes = CubeCount::Static(cols.div_ceil(NORM_PLIF_CUBE as usize) as u32, 1, 1);
    if !save_vpost
        && !fused_rms
        && crate::cuda::speculative::chunks_for(t * k, cols, chunk).is_some()
    {
        // One session's long pass: cut in chunks of whole tokens.
        let per = chunk.div_ceil(k);
        let ins = [x, r, norm_w, w, v_th, v0];
        let outs = [y.clone(), last.clone()];
        let geometry = (cols, dim, t, k);
        let cut = (per, t.div_ceil(per));
        crate::cuda::speculative::norm_plif(ins, outs, geometry, leak, mean_frames, cut);
        return [y, last, vpost];
    }
    if !fused_rms {
        // Many token rows: the kernel staged by tokens.
        let (group, _) = prefetch();
        // SAFETY: units past `cols` end; tokens are clamped below `T > 0`; `x`, `y`, `vpost` (`[T·K, B, D]` when
        // saved, else never written), `r` `[T, B]`, the parameters and `v0` have the shapes asserted
        // above or allocated here.
        launch_guarded!(norm_plif_staged_kernel::<R>(
            &x.client.clone(),
            cubes,
            CubeDim::new_1d(NORM_PLIF_CUBE),
            x.into_tensor_arg(),
            r.into_tensor_arg(),
            norm_w.into_tensor_arg(),
            w.into_tensor_arg(),
            v_th.into_tensor_arg(),
            v0.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            last.clone().into_tensor_arg(),
            vpost.clone().into_tensor_arg(),
            cols as u32,
            dim as u32,
            t as u32,
            k,
            leak,
            save_vpost,
            mean_frames,
            group,
            y_dtype.into(),
        ));
        return [y, last, vpost];
    }
    // SAFETY: as the staged kernel above; `r` is `x` here (read, then replaced).
    launch_guarded!(norm_plif_kernel::<R>(
        &x.client.clone(),
        cubes,
        CubeDim::new_1d(NORM_PLIF_CUBE),
        x.into_tensor_arg(),
        r.into_tensor_arg(),
        norm_w.into_tensor_arg(),
        w.into_tensor_arg(),
        v_th.into_tensor_arg(),
        v0.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        last.clone().into_tensor_arg(),
        vpost.clone().into_tensor_arg(),
        cols as u32,
        dim as u32,
        t as u32,
        eps,
        k,
        leak,
        save_vpost,
        fused_rms,
        mean_frames,
        y_dtype.into(),
    ));
    [y, last, vpost]
}
