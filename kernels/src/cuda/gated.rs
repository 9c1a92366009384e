//! The SNNBlock's gated output `y = r·σ(g) + s` for training and prefill, forward and backward,
//! one element-wise kernel each. Composed, burn runs σ as five kernels (`exp(−ln(e^{−x} + 1))`),
//! the product and the sum forward, and backward recomputes σ, then `1 − σ`, three products, and
//! the three casts of the gradients before their GEMMs: about twenty passes over `[T·K·B, D]`
//! become two.
//!
//! The arithmetic is the composition's, op for op (σ through [`sigmoid_burn`], the backward's
//! products grouped as burn's sigmoid and product backward group them). The compiler may
//! contract the forward's `r·σ + s` into one fused multiply-add, which moves its last bit.

use crate::cuda::common::{
    check_f32, gemm_input, launch_guarded, out_like, out_typed, sigmoid_burn, stored_dtype,
};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube of the element-wise kernels.
const UNITS: u32 = 256;

#[cube(launch, launch_unchecked)]
fn gated_out_kernel(
    r: &Tensor<f32>,
    g: &Tensor<f32>,
    s: &Tensor<f32>,
    y: &mut Tensor<f32>,
    n: u32,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let prod = r[i] * sigmoid_burn(g[i]);
    y[i] = prod + s[i];
}

/// `∂r = dy·σ`, `∂g = (σ·(1 − σ))·(dy·r)`, `∂s = dy`, each written as `O` (the GEMMs' input
/// type: their rounding moves here from the casts it replaces, to nearest even as theirs).
#[allow(clippy::too_many_arguments)]
#[cube(launch, launch_unchecked)]
fn gated_out_backward_kernel<G: Float, O: Float>(
    r: &Tensor<f32>,
    g: &Tensor<f32>,
    dy: &Tensor<G>,
    dr: &mut Tensor<O>,
    dg: &mut Tensor<O>,
    ds: &mut Tensor<O>,
    n: u32,
    #[define(G, O)] _types: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let sig = sigmoid_burn(g[i]);
    let d = f32::cast_from(dy[i]);
    dr[i] = O::cast_from(d * sig);
    let slope = sig * (-sig + 1.0f32);
    dg[i] = O::cast_from(slope * (d * r[i]));
    ds[i] = O::cast_from(d);
}

/// Elements of `t` and the cube count that covers them, checked for 32-bit indexing.
fn cubes<R: CubeRuntime>(t: &CubeTensor<R>, what: &str) -> (usize, CubeCount) {
    let n = t.meta.shape().num_elements();
    assert!(
        n <= u32::MAX as usize,
        "{what}: {n} elements exceed 32-bit indexing"
    );
    (
        n,
        CubeCount::Static(n.div_ceil(UNITS as usize) as u32, 1, 1),
    )
}

fn check_same<R: CubeRuntime>(what: &str, a: &CubeTensor<R>, others: &[&CubeTensor<R>]) {
    for o in others {
        assert_eq!(
            a.meta.shape(),
            o.meta.shape(),
            "{what}: operands of different shapes"
        );
    }
}

/// `r·σ(g) + s` on f32 tensors of one shape.
pub fn gated_out<R: CubeRuntime>(
    r: CubeTensor<R>,
    g: CubeTensor<R>,
    s: CubeTensor<R>,
) -> CubeTensor<R> {
    check_f32(&[&r, &g, &s]);
    check_same("gated output", &r, &[&g, &s]);
    let [r, g, s] = [r, g, s].map(into_contiguous);
    let y = out_like(&r, r.meta.shape().clone());
    let (n, count) = cubes(&r, "gated output");
    if n == 0 {
        return y;
    }
    // SAFETY: units at or past `n` end; every operand has the `n` elements asserted above.
    launch_guarded!(gated_out_kernel::<R>(
        &r.client.clone(),
        count,
        CubeDim::new_1d(UNITS),
        r.into_tensor_arg(),
        g.into_tensor_arg(),
        s.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        n as u32,
    ));
    y
}

/// `[∂r, ∂g, ∂s]` of `r·σ(g) + s` for the upstream `dy` (f32 or bf16), in the type the GEMMs
/// read (bf16 in bf16 precision).
pub fn gated_out_backward<R: CubeRuntime>(
    r: CubeTensor<R>,
    g: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> [CubeTensor<R>; 3] {
    check_f32(&[&r, &g]);
    check_same("gated output backward", &r, &[&g, &dy]);
    let types = [stored_dtype(&dy).into(), gemm_input().into()];
    let [r, g, dy] = [r, g, dy].map(into_contiguous);
    let shape = r.meta.shape().clone();
    let [dr, dg, ds] = [(); 3].map(|_| out_typed(&r, shape.clone(), gemm_input()));
    let (n, count) = cubes(&r, "gated output backward");
    if n == 0 {
        return [dr, dg, ds];
    }
    // SAFETY: units at or past `n` end; every operand has the `n` elements asserted above.
    launch_guarded!(gated_out_backward_kernel::<R>(
        &r.client.clone(),
        count,
        CubeDim::new_1d(UNITS),
        r.into_tensor_arg(),
        g.into_tensor_arg(),
        dy.into_tensor_arg(),
        dr.clone().into_tensor_arg(),
        dg.clone().into_tensor_arg(),
        ds.clone().into_tensor_arg(),
        n as u32,
        types,
    ));
    [dr, dg, ds]
}
