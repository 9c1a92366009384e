//! The CPU backend (burn-ndarray) takes every default of the `SnnOps` family: the exact host
//! scans, the compositions from tensor ops and burn's own matmul; a checkpoint's read-back
//! copies each tensor's values straight from its array into the shard (no `TensorData` between).

use crate::error::KernelError;
use crate::ops::device::default_read_f32_into;
use crate::ops::device::{DeviceOps, GraphOps};
use crate::ops::gemm::GemmOps;
use crate::ops::infer::InferOps;
use crate::ops::optim::OptimOps;
use crate::ops::scan::ScanOps;
use crate::ops::snn::SnnOps;
use burn::tensor::ops::FloatTensor;
use burn_ndarray::{NdArray, NdArrayTensor};

impl GemmOps for NdArray<f32> {}

impl ScanOps for NdArray<f32> {}

impl InferOps for NdArray<f32> {}

impl DeviceOps for NdArray<f32> {
    fn read_f32_into(t: FloatTensor<Self>, out: &mut [u8]) -> Result<(), KernelError> {
        let NdArrayTensor::F32(storage) = &t else {
            return default_read_f32_into::<Self>(t, out);
        };
        let view = storage.view();
        if view.len() * 4 != out.len() {
            return Err(KernelError::Misuse(format!(
                "read back {} bytes into a buffer of {}",
                view.len() * 4,
                out.len()
            )));
        }
        match view.as_slice() {
            Some(values) => out.copy_from_slice(bytemuck::cast_slice(values)),
            // Not in standard order (a transposed view): element by element, logical order.
            None => {
                for (o, v) in out.chunks_exact_mut(4).zip(view.iter()) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        Ok(())
    }
}

impl GraphOps for NdArray<f32> {}

impl OptimOps for NdArray<f32> {}

impl SnnOps for NdArray<f32> {}
