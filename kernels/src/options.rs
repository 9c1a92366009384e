//! Process options read by the kernels' users: the `key=value` option strings of the backend
//! plugins and the benchmarks (`[backend]`, `--options`), and the decoding fusions' switch.

/// The `key=value` items of an option string, separated by commas or whitespace.
pub fn option_items(options: &str) -> impl Iterator<Item = &str> {
    options
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
}

/// Whether the decoding fusions ([`block_scan_fused`], [`gate_skip_fused`],
/// [`centred_residual_fused`], the CUDA PonderAgg's one-unit-per-channel kernel for a few rows)
/// run where the backend has them: on by default,
/// `NSACTOR_DECODE_FUSION=off` at start or [`set_decode_fusion`] turns them off (the composed
/// path, for A/B runs and to check them against it).
///
/// [`block_scan_fused`]: crate::block_scan_fused
/// [`gate_skip_fused`]: crate::gate_skip_fused
/// [`centred_residual_fused`]: crate::centred_residual_fused
pub fn decode_fusion() -> bool {
    DECODE_FUSION.load(std::sync::atomic::Ordering::Relaxed)
        && *DECODE_FUSION_ENV
            .get_or_init(|| std::env::var("NSACTOR_DECODE_FUSION").as_deref() != Ok("off"))
}

/// Turns the decoding fusions on or off for the process (see [`decode_fusion`]).
pub fn set_decode_fusion(on: bool) {
    DECODE_FUSION.store(on, std::sync::atomic::Ordering::Relaxed);
}

static DECODE_FUSION: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
static DECODE_FUSION_ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
