//! cubek's naive fp32 GEMM: the on-device reference the cuBLASLt GEMMs are checked against.

use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::matmul::init_matmul_output;
use burn_cubecl::tensor::CubeTensor;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::{Strategy, launch_ref};
use cubek::std::InputBinding;

/// `lhs · rhs` with cubek's naive kernel: one fp32 fused multiply-add chain per output, never the
/// TF32 tensor-core path that cubek's tiled kernels take for f32 inputs on sm_80+ (10-bit
/// mantissa inputs, ~1e-3 relative error per product), which the reference ran with disabled.
pub fn matmul_naive<R: CubeRuntime>(lhs: CubeTensor<R>, rhs: CubeTensor<R>) -> CubeTensor<R> {
    let dtype = lhs.dtype;
    let out = init_matmul_output(&lhs, &rhs, dtype);
    let client = out.client.clone();
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: dtype.into(),
        rhs: dtype.into(),
        out: dtype.into(),
    });
    launch_ref(
        &Strategy::Naive,
        &client,
        InputBinding::new(lhs.binding(), dtype.into()),
        InputBinding::new(rhs.binding(), dtype.into()),
        out.clone().binding(),
        &mut dtypes,
    )
    .expect("the naive matmul accepts any f32 shapes");
    out
}
