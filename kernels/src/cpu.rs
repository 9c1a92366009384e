//! The CPU backend (burn-ndarray) takes every default of the `SnnOps` family: the exact host
//! scans, the compositions from tensor ops and burn's own matmul.

use crate::ops::device::{DeviceOps, GraphOps};
use crate::ops::gemm::GemmOps;
use crate::ops::infer::InferOps;
use crate::ops::optim::OptimOps;
use crate::ops::scan::ScanOps;
use crate::ops::snn::SnnOps;
use burn_ndarray::NdArray;

impl GemmOps for NdArray<f32> {}

impl ScanOps for NdArray<f32> {}

impl InferOps for NdArray<f32> {}

impl DeviceOps for NdArray<f32> {}

impl GraphOps for NdArray<f32> {}

impl OptimOps for NdArray<f32> {}

impl SnnOps for NdArray<f32> {}
