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
/// run where the backend has them: on by default; the `decode_fusion` knob of the
/// [`crate::tuning`] (`NSACTOR_DECODE_FUSION=off`) or [`set_decode_fusion`] turns them off (the
/// composed path, for A/B runs and to check them against it).
///
/// [`block_scan_fused`]: crate::block_scan_fused
/// [`gate_skip_fused`]: crate::gate_skip_fused
/// [`centred_residual_fused`]: crate::centred_residual_fused
pub fn decode_fusion() -> bool {
    DECODE_FUSION.load(std::sync::atomic::Ordering::Relaxed)
        && crate::tuning::current().decode_fusion
}

/// Turns the decoding fusions on or off for the process (see [`decode_fusion`]).
pub fn set_decode_fusion(on: bool) {
    DECODE_FUSION.store(on, std::sync::atomic::Ordering::Relaxed);
}

static DECODE_FUSION: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// What the GEMMs issued on this thread belong to, for batch-invariant kernel choice on CUDA
/// (`NSACTOR_BATCH_INVARIANT`): set by [`decoding_gemms`] and [`per_token_gemms`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmRows {
    /// Anything else (training, evaluation): the kernel is chosen per problem.
    Other,
    /// A decoding pass's GEMMs over frames (`T·K·B` rows, at most 4,096).
    DecodeFrames,
    /// A decoding pass's GEMMs over tokens (`T·B` rows, at most 256): the head,
    /// `decode_proj`, the out projections.
    DecodeTokens,
}

thread_local! {
    static DECODING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static PER_TOKEN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn scoped<R>(
    flag: &'static std::thread::LocalKey<std::cell::Cell<bool>>,
    f: impl FnOnce() -> R,
) -> R {
    let before = flag.with(|c| c.replace(true));
    let r = f();
    flag.with(|c| c.set(before));
    r
}

/// Runs `f` as a decoding pass: its GEMMs may be chosen for batch invariance.
pub fn decoding_gemms<R>(f: impl FnOnce() -> R) -> R {
    scoped(&DECODING, f)
}

/// Runs `f`'s GEMMs as per-token ones (inside a decoding pass they see at most 256 rows).
pub fn per_token_gemms<R>(f: impl FnOnce() -> R) -> R {
    scoped(&PER_TOKEN, f)
}

/// The class of a GEMM issued now on this thread.
pub fn gemm_rows() -> GemmRows {
    match (DECODING.with(|c| c.get()), PER_TOKEN.with(|c| c.get())) {
        (false, _) => GemmRows::Other,
        (true, false) => GemmRows::DecodeFrames,
        (true, true) => GemmRows::DecodeTokens,
    }
}
