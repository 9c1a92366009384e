//! The selective scan with the SNNBlock modulation fused in (SPEC §2.3, Eq. 5–7): the kernels
//! read the four projections once, compute `β = σ(r_β + b_β)`, `u = softplus(r_α + b_α)·i`,
//! `V_th = V_min + |r_th + b_th|` in registers or shared memory, and write `V_post` and the
//! spikes (forward; an untracked forward, which no backward follows, leaves the spikes out), or
//! every input's gradient (backward).
//!
//! The 0.9B model has too few columns (28,672) for one unit per column, and the modulation adds
//! four transcendentals per step to each unit's chain. The kernels are staged: in a cube of
//! columns, producer planes prepare the next chunk of steps into shared memory while one plane
//! runs the recurrence over the current chunk (`chunk`); one barrier per chunk swaps the two
//! buffers. The producers load through `cp.async` into a ring of stages in shared memory, each
//! tracked by an mbarrier (`ring`), so the loads ahead of the recurrence hold no registers.
//!
//! The ring copies 16 bytes at a time (8 bf16 columns) where every input is bf16 and the row
//! width keeps them aligned, else 4 bytes; bf16 rows of an odd width keep neither aligned:
//! there the producers load and store plainly through the same ring ([`ring::Ring::direct`]).
//! Two earlier generations left the tree (git keeps them), each slower at every measured shape (`BENCHMARKS.md`): one unit per column computing
//! its own modulation, and the staged kernels whose producers loaded into registers (forward
//! 77 % of copy against the ring's 84 %; with bf16 storage 2.12 ms against 1.75, backward 3.12
//! against 2.83, f32 backward 4.18 against 4.15).
//!
//! Same recurrence as [`crate::reference`], term for term. The modulation's σ and softplus are
//! the few-instruction forms of [`crate::cuda::common::exp_neg_abs`], a few f32 ulp from burn's
//! compositions: the producers are bound by instruction issue, and burn's σ
//! (`exp(−ln(e^{−x} + 1))`) and libm's `log1pf` were most of their instructions. So the
//! forwards agree with the per-element scan composed with the modulation
//! ([`crate::selective_forward_reference`]) to f32 rounding, not bit for bit; the kernels run
//! without CubeCL's bounds checks, guarding every access themselves.

mod chunk;
mod ring;

use crate::cuda::common::{check_f32, dims, out_like, out_typed, stored_dtype};
use crate::cuda::scan::geometry;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use ring::{Ring, selective_backward_kernel, selective_forward_kernel};

/// `(producer planes, steps per chunk, ring stages)` of the asynchronous forward (f32 storage).
/// The `stage_async` knob (`NSACTOR_STAGE_ASYNC`, `PxCxD`) overrides it. Measured on the H100 at the 0.9B shape (ms):
/// 4×12×3 2.314–2.317, 4×12×2 2.307, 4×16×2 2.306, 6×12×3 2.324, 4×8×4 2.340, 4×24×3 2.341,
/// 3×12×3 2.365, 8×16×3 2.389, 4×16×3 2.410, 2×12×3 2.436, 4×12×4 2.441; the staged kernel
/// loading into registers took 2.519 on the same host. Three stages keep two chunks of loads
/// in flight per cube at 27.6 KB of shared memory (8 cubes per SM). 64- and 128-column cubes
/// (`PxCxDx64`, `…x128`: whole 128-byte lines per bf16 row) gained in neither storage. The
/// staged kernel loading into registers, since removed, took 2.49–2.53 ms at its best shape.
const STAGE_ASYNC: (usize, usize, usize, usize) = (4, 12, 3, 32);

/// The same with bf16 storage. Measured (ms): 4×12×3 1.749–1.750, 8×16×3 1.749, 8×24×3 1.758,
/// 4×16×4 1.873, 12×24×3 1.919, 4×24×4 1.923, 4×32×2 1.924, 8×32×2 1.928, 4×24×3 1.944,
/// 8×32×3 1.963, 6×24×3 1.982, 8×48×3 2.512; the register-loading kernel (removed) 2.120.
const STAGE_ASYNC_BF16: (usize, usize, usize, usize) = (4, 12, 3, 32);

/// `(producer planes, steps per chunk, ring stages, columns per cube)` of the asynchronous
/// backward; the `stage_async_backward` knob (`NSACTOR_STAGE_ASYNC_BACKWARD`) overrides it. Measured on the H100 at the 0.9B
/// shape (ms, f32 / bf16 storage): 4×16×2 4.149 / 2.826, 4×8×2 4.132 / 2.919, 4×8×3 4.177 /
/// 2.886, 8×16×2 4.207 / 3.076, 4×12×3 4.244 / 3.370, 2×4×3 4.325 / 3.513, 2×8×3 5.162 /
/// 3.532, 8×8×2 4.182 / 3.759, 4×4×4 4.200 / 3.806, 8×8×4 4.276 / 4.033, 8×8×3 4.317 / 4.053;
/// the register-loading kernel (removed) 4.184 / 3.118 on the same host.
const STAGE_ASYNC_BACKWARD: (usize, usize, usize, usize) = (4, 16, 2, 32);

/// Elements per asynchronous copy of the selective kernels' inputs of `dtypes`: 16 bytes (8 bf16
/// columns, one instruction for a quarter of a 32-column row) where every input is stored in
/// bf16 and `cols` keeps every piece of a row on a 16-byte boundary; else 4 bytes (1 f32, or 2
/// bf16 where `cols` is even); `None` where a bf16 row of odd width (or a view starting off a
/// 4-byte boundary) allows neither (the ring then copies plainly, [`ring::Ring::direct`]). The
/// 16-byte copies took 5 % off the bf16 backward (`docs/benchmarks/HISTORY.md`, issue 34). f32 storage keeps
/// the 4-byte copies: they were withdrawn for a check failure later traced to a spike flipped
/// at a tie with the threshold, not to the copies, and were not measured again.
fn packs<R: CubeRuntime, const N: usize>(
    tensors: [&CubeTensor<R>; N],
    cols: usize,
) -> Option<[usize; N]> {
    let size = |t: &CubeTensor<R>| t.dtype.size();
    let aligned = |bytes: u64| {
        tensors
            .iter()
            .all(|t| t.handle.offset_start.unwrap_or(0).is_multiple_of(bytes))
    };
    if aligned(16) && tensors.iter().all(|t| size(t) == 2) && cols.is_multiple_of(8) {
        return Some([8; N]);
    }
    let narrow = tensors.map(|t| 4 / size(t));
    (aligned(4) && narrow.iter().all(|&p| cols.is_multiple_of(p))).then_some(narrow)
}

/// The forward's ring: the `stage_async` knob (`NSACTOR_STAGE_ASYNC`, `PxCxD` or `PxCxDxW`) or
/// the default for the storage type.
fn forward_ring(stored: DType, direct: bool) -> Ring {
    let default = if stored == DType::F32 {
        STAGE_ASYNC
    } else {
        STAGE_ASYNC_BF16
    };
    ring_shape(crate::tuning::current().stage_async, default, direct)
}

/// A ring kernel's shape from its knob or `default`, copying plainly where `direct`; `chunk`
/// is rounded up to a multiple of `producers`.
fn ring_shape(
    knob: Option<nsactor_plugin_api::tuning::RingShape>,
    default: (usize, usize, usize, usize),
    direct: bool,
) -> Ring {
    let (p, c, d, w) = knob.map_or(default, |r| (r.producers, r.chunk, r.stages, r.width));
    Ring {
        chunk: c.div_ceil(p) * p,
        producers: p,
        stages: d,
        width: w,
        direct,
        spikes: true,
        exact: crate::tuning::current().exact_modulation,
    }
}

/// The dtype shared by the four projections of the selective scan: f32, or bf16 storage
/// (what the scans' outputs and the projections' gradients are then stored in too).
fn projection_dtype<R: CubeRuntime>(inputs: &[CubeTensor<R>; 8]) -> DType {
    let dtype = stored_dtype(&inputs[0]);
    assert!(
        inputs[1..4].iter().all(|t| t.dtype == dtype),
        "selective scan: the four projections are all f32 or all bf16, got {:?}",
        inputs[..4].iter().map(|t| t.dtype).collect::<Vec<_>>()
    );
    check_f32(&inputs[4..].iter().collect::<Vec<_>>());
    dtype
}

/// Asserts what the unchecked kernels rely on: the four projections (and `extra`, the
/// backward's `V_post`, spikes and upstream gradient) `[TK, B, DN]` alike, the biases `[DN]`,
/// `v0` `[B, DN]`.
fn check_shapes<R: CubeRuntime>(inputs: &[CubeTensor<R>; 8], extra: &[&CubeTensor<R>]) {
    let shape = dims(&inputs[0]);
    assert_eq!(
        shape.len(),
        3,
        "selective scan: projections are [TK, B, DN]"
    );
    let (b, dn) = (shape[1], shape[2]);
    for t in inputs[1..4].iter().chain(extra.iter().copied()) {
        assert_eq!(dims(t), shape, "selective scan: [TK, B, DN] tensors alike");
    }
    for t in &inputs[4..7] {
        assert_eq!(dims(t), [dn], "selective scan: biases are [DN]");
    }
    assert_eq!(dims(&inputs[7]), [b, dn], "selective scan: v0 is [B, DN]");
}

/// Forward of the fused selective scan: `(spike, vpost, last)`, the spikes only where `spikes`
/// (what the backward reads; an untracked forward leaves them out). `inputs`: the projections
/// `i, r_β, r_α, r_th` `[TK, B, DN]`, the biases `b_β, b_α, b_th` `[DN]`, and `v0` `[B, DN]`.
/// Spikes and `V_post` are stored in the projections' type (f32, or bf16 storage: the kernel
/// reads bf16, computes in f32 and rounds what it writes); `last`, the final membrane state
/// `[B, DN]`, is always the f32 state itself.
pub fn selective_forward<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 8],
    v_th_min: f32,
    spikes: bool,
) -> (Option<CubeTensor<R>>, CubeTensor<R>, CubeTensor<R>) {
    let stored = projection_dtype(&inputs);
    check_shapes(&inputs, &[]);
    let (shape, steps, cols, _, _) = geometry(&inputs[0]);
    let dn = shape[2] as u32;
    let state = Shape::new([shape[1], shape[2]]);
    let [i, rb, ra, rt, bb, ba, bt, v0] = inputs.map(into_contiguous);
    // Without spikes the kernel writes none: a one-element placeholder stands for the argument.
    let spike = out_like(
        &i,
        if spikes {
            shape.clone()
        } else {
            Shape::new([1])
        },
    );
    let vpost = out_like(&i, shape);
    let last = out_typed(&i, state, DType::F32);
    let client = i.client.clone();
    // `cp.async` copies 16 or 4 bytes of a row; odd bf16 rows are copied plainly, one element
    // at a time.
    let pack = packs([&i, &rb, &ra, &rt], cols as usize).map(|[p, ..]| p);
    let direct = pack.is_none();
    let pack = pack.unwrap_or(1);
    let ring = Ring {
        spikes,
        ..forward_ring(stored, direct)
    };
    // SAFETY: launched without CubeCL's per-access bounds checks (a metadata load, a compare
    // and a branch on every global store). The kernel guards every global access itself:
    // columns by `c < cols`, steps by the chunk's bounds, biases by `j = c mod DN`, on
    // tensors whose shapes `check_shapes` asserted or this function allocated.
    unsafe {
        selective_forward_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(cols.div_ceil(ring.width as u32), 1, 1),
            CubeDim::new_2d(ring.width as u32, 1 + ring.producers as u32),
            i.into_tensor_arg(),
            rb.into_tensor_arg(),
            ra.into_tensor_arg(),
            rt.into_tensor_arg(),
            bb.into_tensor_arg(),
            ba.into_tensor_arg(),
            bt.into_tensor_arg(),
            v0.into_tensor_arg(),
            spike.clone().into_tensor_arg(),
            vpost.clone().into_tensor_arg(),
            last.clone().into_tensor_arg(),
            cols,
            steps,
            steps.div_ceil(ring.chunk as u32),
            dn,
            v_th_min,
            pack,
            ring,
            stored.into(),
        );
    }
    (spikes.then_some(spike), vpost, last)
}

/// Backward of the fused selective scan: `[∂i, ∂r_β, ∂r_α, ∂r_th, ∂v0, bias sums]`, the last
/// `[3, B, DN]` (`∂b_β, ∂b_α, ∂b_th` summed over time per column; sum it over `B`). The four
/// projections' gradients come in the projections' type; `vpost`, `spike` and `grad` may each
/// be f32 or bf16.
pub fn selective_backward<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 8],
    vpost: CubeTensor<R>,
    spike: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> [CubeTensor<R>; 6] {
    let stored = projection_dtype(&inputs);
    check_shapes(&inputs, &[&vpost, &spike, &grad]);
    assert_eq!(
        vpost.dtype, spike.dtype,
        "selective scan: V_post and spikes are stored alike"
    );
    let types = [
        stored.into(),
        stored_dtype(&vpost).into(),
        stored_dtype(&grad).into(),
    ];
    let (shape, steps, cols, _, _) = geometry(&grad);
    let dn = shape[2] as u32;
    let [i, rb, ra, rt, bb, ba, bt, v0] = inputs.map(into_contiguous);
    let [vpost, spike, grad] = [vpost, spike, grad].map(into_contiguous);
    let state = Shape::new([shape[1], shape[2]]);
    let client = grad.client.clone();
    let g_v0 = out_typed(&grad, state.clone(), DType::F32);
    let g_bias = out_typed(&grad, Shape::new([3, state[0], state[1]]), DType::F32);
    // As in the forward: 16- or 4-byte copies, or plain ones where a type stored in bf16 has
    // rows of odd width.
    let found = packs([&i, &rb, &ra, &rt, &vpost, &spike, &grad], cols as usize)
        .map(|p| [p[0], p[4], p[6]]);
    let direct = found.is_none();
    let packs = found.map_or((1, 1, 1), |[pi, ps, pg]| (pi, ps, pg));
    let ring = ring_shape(
        crate::tuning::current().stage_async_backward,
        STAGE_ASYNC_BACKWARD,
        direct,
    );
    let g = || out_typed(&grad, shape.clone(), stored);
    let [g_i, g_rb, g_ra, g_rt] = [g(), g(), g(), g()];
    // SAFETY: as for the forward's launch above; the backward guards its accesses alike.
    unsafe {
        selective_backward_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(cols.div_ceil(ring.width as u32), 1, 1),
            CubeDim::new_2d(ring.width as u32, 1 + ring.producers as u32),
            i.into_tensor_arg(),
            rb.into_tensor_arg(),
            ra.into_tensor_arg(),
            rt.into_tensor_arg(),
            bb.into_tensor_arg(),
            ba.into_tensor_arg(),
            bt.into_tensor_arg(),
            v0.into_tensor_arg(),
            vpost.into_tensor_arg(),
            spike.into_tensor_arg(),
            grad.into_tensor_arg(),
            g_i.clone().into_tensor_arg(),
            g_rb.clone().into_tensor_arg(),
            g_ra.clone().into_tensor_arg(),
            g_rt.clone().into_tensor_arg(),
            g_v0.clone().into_tensor_arg(),
            g_bias.clone().into_tensor_arg(),
            cols,
            steps,
            steps.div_ceil(ring.chunk as u32),
            dn,
            packs,
            ring,
            types,
        );
    }
    [g_i, g_rb, g_ra, g_rt, g_v0, g_bias]
}
