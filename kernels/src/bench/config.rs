//! The shapes and repetitions of a `nsactor bench kernels` run, from `--options`.

use crate::KernelError;
use crate::options::option_items;

/// The parts of the kernel benchmark, in the order they run, for `only=` (a backend may add
/// its own, such as CUDA's `gemm`): the per-element and row scans, the fused selective scan
/// (f32 and bf16 storage), the FFN neurons, PonderAgg, RMSNorm + input PLIF, the gated output,
/// and the optimizer's kernels.
pub const PARTS: [&str; 7] = [
    "scans",
    "selective",
    "ffn",
    "ponder",
    "norm",
    "gated",
    "optim",
];

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
    /// The [`PARTS`] to run; `None` runs them all.
    pub only: Option<Vec<&'static str>>,
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
            only: None,
        }
    }

    /// Runs only `parts` (names of [`PARTS`]; others are refused by name).
    pub fn with_only(mut self, parts: &[&str]) -> Result<Self, KernelError> {
        let named = parts
            .iter()
            .map(|p| {
                PARTS.iter().find(|k| *k == p).copied().ok_or_else(|| {
                    KernelError::InvalidOption(format!(
                        "only: unknown part `{p}` ({})",
                        PARTS.join(", ")
                    ))
                })
            })
            .collect::<Result<_, _>>()?;
        self.only = Some(named);
        Ok(self)
    }

    /// Whether part `name` of [`PARTS`] runs.
    pub fn runs(&self, name: &str) -> bool {
        self.only.as_ref().is_none_or(|o| o.contains(&name))
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
