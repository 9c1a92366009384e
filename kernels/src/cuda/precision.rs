//! The arithmetic of the projection GEMMs ([`GemmPrecision`], one per process, chosen by the
//! plugin's `precision` option) and the element types that follow from it: what a GEMM reads
//! ([`input_dtype`]) and what the scans' large activations are stored in ([`storage_dtype`]).

use std::sync::atomic::{AtomicU8, Ordering};

/// Arithmetic of the projection GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmPrecision {
    /// fp32 inputs, fp32 accumulation (no TF32): parity with the reference's fixtures.
    Fp32,
    /// bf16 inputs, fp32 accumulation and output: the tensor cores' full rate.
    Bf16,
}

impl GemmPrecision {
    pub fn name(self) -> &'static str {
        match self {
            GemmPrecision::Fp32 => "fp32",
            GemmPrecision::Bf16 => "bf16",
        }
    }

    pub fn parse(s: &str) -> Result<Self, crate::KernelError> {
        match s {
            "fp32" | "f32" => Ok(GemmPrecision::Fp32),
            "bf16" => Ok(GemmPrecision::Bf16),
            other => Err(crate::KernelError::InvalidOption(format!(
                "unknown GEMM precision `{other}` (expected `fp32` or `bf16`)"
            ))),
        }
    }
}

static PRECISION: AtomicU8 = AtomicU8::new(0);

/// Sets the precision of every later projection GEMM in this process.
pub fn set_precision(p: GemmPrecision) {
    PRECISION.store(p as u8, Ordering::SeqCst);
}

/// The element type a GEMM in the process's precision reads: kernels whose output only feeds a
/// GEMM write it directly.
pub fn input_dtype() -> burn::tensor::DType {
    match precision() {
        GemmPrecision::Bf16 => burn::tensor::DType::BF16,
        GemmPrecision::Fp32 => burn::tensor::DType::F32,
    }
}

/// The type the scans' large activations are stored in ([`GemmOps::storage_dtype`]):
/// the GEMMs' input type, unless the `bf16_storage` knob is off (`NSACTOR_BF16_STORAGE=off`):
/// f32.
///
/// [`GemmOps::storage_dtype`]: crate::GemmOps::storage_dtype
pub fn storage_dtype() -> burn::tensor::DType {
    if !crate::tuning::current().bf16_storage {
        burn::tensor::DType::F32
    } else {
        input_dtype()
    }
}

/// The precision projection GEMMs use now (fp32 until [`set_precision`]).
pub fn precision() -> GemmPrecision {
    match PRECISION.load(Ordering::SeqCst) {
        0 => GemmPrecision::Fp32,
        _ => GemmPrecision::Bf16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_names_round_trip_and_unknown_names_are_errors() {
        for p in [GemmPrecision::Fp32, GemmPrecision::Bf16] {
            assert_eq!(GemmPrecision::parse(p.name()), Ok(p));
        }
        assert!(
            GemmPrecision::parse("fp16")
                .unwrap_err()
                .to_string()
                .contains("fp16")
        );
    }
}
