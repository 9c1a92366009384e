//! `nsactor bench kernels`: the backend's own kernel benchmark.

use super::open::{open_with_precision, print_text};
use nsactor_plugin_api::Diagnostic;

#[derive(clap::Args)]
pub struct KernelsArgs {
    /// Backend plugin (or `embedded`).
    #[arg(long, default_value = "cuda")]
    backend: String,
    /// Projection GEMM arithmetic of the process (CUDA): with bf16 the bf16-storage variants
    /// of the scans are checked and timed too.
    #[arg(long, value_parser = ["fp32", "bf16"], default_value = "fp32")]
    precision: String,
    /// Shapes and repetitions as key=value pairs: steps (T·K), batch, elem_dim (D·N),
    /// row_dim (2·D_ff), check_steps, reps, dim (D), k (K). Default: the 0.9B shapes, 10 reps.
    /// `only=A+B` runs just those parts: scans, selective, ffn, ponder, norm, gated, optim, and
    /// the backend's own (CUDA: gemm).
    #[arg(long, default_value = "")]
    options: String,
}

pub fn run(args: KernelsArgs) -> crate::result::CliResult {
    let b = open_with_precision(&args.backend, &args.precision)?;
    let info = b.info();
    println!(
        "PLIF scan kernels: {} {} on {}",
        info.name,
        info.version,
        info.devices.first().map_or("?", |d| d.as_str())
    );
    print_text(
        b.as_ref(),
        Diagnostic::Kernels {
            options: args.options,
        },
    )
}
