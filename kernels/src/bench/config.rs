//! The shapes and repetitions of a `nsactor bench kernels` run, from `--options`.

use crate::KernelError;
use crate::options::option_items;

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
    pub fn with_options(mut self, options: &str) -> Result<Self, KernelError> {
        for kv in option_items(options) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| KernelError::InvalidOption(format!("`{kv}` is not key=value")))?;
            let v: usize = v.parse().map_err(|_| {
                KernelError::InvalidOption(format!("{k}: `{v}` is not a whole number"))
            })?;
            if v == 0 {
                return Err(KernelError::InvalidOption(format!(
                    "{k} must be at least 1"
                )));
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
                    return Err(KernelError::InvalidOption(format!(
                        "unknown option `{other}` (steps, batch, elem_dim, row_dim, check_steps, reps, dim, k)"
                    )));
                }
            }
        }
        Ok(self)
    }
}
