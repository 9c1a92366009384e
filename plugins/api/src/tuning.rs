//! How a backend's kernels are tuned: one typed [`KernelTuning`] value per process, resolved by
//! the host from its configuration layers and handed to the plugin in its option string.
//!
//! The layers, lowest first: the defaults measured beside each kernel; the run configuration's
//! `[backend.kernels]` table (`scan_cube = 64`); the environment's `NSACTOR_*` variable of each
//! knob (`NSACTOR_SCAN_CUBE=64`, [`Knob::env`]). The host sends every knob that differs from
//! its default as a `kernel.KEY=VALUE` option; a plugin starts from the environment (a process
//! that no host configured, such as a benchmark, still honours it) and applies those options
//! over it, so both sides agree. A value that does not parse is an error that names the knob
//! and what it takes.

use crate::EngineError;
use std::fmt;

/// Whether a decoding pass's GEMMs are batch-invariant, and how their kernel is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchInvariance {
    /// Kernels that give the same bits at every row count (checked on random operands), one
    /// per size class, chosen by timing the candidates at five sizes (the default).
    On,
    /// One kernel per problem at every row count, chosen by timing (the rule before s59).
    Single,
    /// The heuristic's first pick at the largest size that runs at all five, untimed.
    First,
    /// The heuristic's pick per row count (results vary with the cohort).
    Off,
}

/// How the CUDA GEMMs are submitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmSubmit {
    /// As one task on CubeCL's server thread, in order with the kernel launches (the default).
    Queued,
    /// From the calling thread, after blocking pointer lookups.
    Blocking,
}

/// A staged kernel's shape: producer planes × steps per chunk (`PxC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageShape {
    pub producers: usize,
    pub chunk: usize,
}

/// An asynchronous ring kernel's shape: producers × chunk × stages, and its width in columns
/// (`PxCxD` or `PxCxDxW`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingShape {
    pub producers: usize,
    pub chunk: usize,
    pub stages: usize,
    pub width: usize,
}

/// Every tuning knob of the kernels (see `docs/CONFIG.md` for what each changes). A shape left
/// `None` is the kernel's own measured default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelTuning {
    pub decode_graphs: bool,
    pub decode_graph_rows: usize,
    pub decode_fusion: bool,
    pub flush: bool,
    pub bf16_storage: bool,
    pub batch_invariant: BatchInvariance,
    pub gemm_trace: bool,
    /// The largest split-K count tried beside cuBLASLt's heuristic picks when a batch-invariant
    /// decoding GEMM's kernels are chosen (powers of two from 2; 0 or 1: none).
    pub gemm_splits: usize,
    /// The most rows a batch-invariant decoding GEMM over frames runs on the one-chain MMA
    /// kernel, where it gives that problem's bits (0: never).
    pub gemm_chain_rows: usize,
    pub gemm_tune: bool,
    pub gemm_submit: GemmSubmit,
    pub fused_norm_plif: bool,
    pub fused_ponder: bool,
    pub fused_ffn_neurons: bool,
    pub fused_gated_out: bool,
    /// Row-parameter scans staged (`true`) or one unit per column.
    pub staged_row_scan: bool,
    pub scan_cube: usize,
    pub scan_unroll: Option<usize>,
    pub stage_async: Option<RingShape>,
    pub stage_async_backward: Option<RingShape>,
    pub stage_row_forward: Option<StageShape>,
    pub stage_row_backward: Option<StageShape>,
    pub stage_block_scan: Option<StageShape>,
    pub stage_ffn_forward: Option<StageShape>,
    pub stage_ffn_backward: Option<StageShape>,
    pub decode_wide_cols: usize,
    /// The wide decoding block scan reads and writes four adjacent columns per unit as vectors
    /// (`true`) or one column per unit; the same bits either way.
    pub decode_wide_vector: bool,
    /// One session's long pass (more than 64 frames) runs the staged block scan whose
    /// producers load a chunk ahead (`true`) or the plain staged one; the same bits.
    pub block_scan_ahead: bool,
    /// The kernels that may skip CubeCL's per-access bounds checks keep them (`true`): a
    /// debugging aid, the same bits.
    pub kernel_bounds_check: bool,
    /// Steps per time chunk of the speculative inference scans of a long pass over few columns
    /// (0: one walk): the FFN neurons, the input neurons (RMSNorm + PLIF) and the block scan.
    pub time_chunk: usize,
    pub time_chunk_norm: usize,
    pub time_chunk_block: usize,
    /// Tokens a group of the RMSNorm + input PLIF kernels: `(forward, backward)`.
    pub norm_plif_prefetch: (usize, usize),
    /// The training scans' σ and softplus as burn composes them (libm `exp`/`log`/`log1p`)
    /// instead of the few-instruction forms (hardware reciprocal and `lg2`).
    pub exact_modulation: bool,
    /// Host values uploaded through pinned staging buffers kept for the process (`true`) or
    /// by the runtime's own write from pageable memory.
    pub pinned_upload: bool,
}

impl Default for KernelTuning {
    fn default() -> Self {
        KernelTuning {
            decode_graphs: true,
            decode_graph_rows: 64,
            decode_fusion: true,
            flush: true,
            bf16_storage: true,
            batch_invariant: BatchInvariance::On,
            gemm_trace: false,
            gemm_splits: 0,
            gemm_chain_rows: 0,
            gemm_tune: true,
            gemm_submit: GemmSubmit::Queued,
            fused_norm_plif: true,
            fused_ponder: true,
            fused_ffn_neurons: true,
            fused_gated_out: true,
            staged_row_scan: true,
            scan_cube: 32,
            scan_unroll: None,
            stage_async: None,
            stage_async_backward: None,
            stage_row_forward: None,
            stage_row_backward: None,
            stage_block_scan: None,
            stage_ffn_forward: None,
            stage_ffn_backward: None,
            decode_wide_cols: 1 << 17,
            decode_wide_vector: true,
            block_scan_ahead: true,
            kernel_bounds_check: false,
            time_chunk: 512,
            time_chunk_norm: 2048,
            time_chunk_block: 0,
            norm_plif_prefetch: (8, 2),
            exact_modulation: false,
            pinned_upload: true,
        }
    }
}

/// One knob: its key (in `[backend.kernels]` and the `kernel.KEY=VALUE` option) and its
/// environment variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knob {
    pub key: &'static str,
    pub env: &'static str,
}

const fn knob(key: &'static str, env: &'static str) -> Knob {
    Knob { key, env }
}

/// Every knob, in the order `docs/CONFIG.md` lists them.
pub const KNOBS: [Knob; 35] = [
    knob("decode_graphs", "NSACTOR_DECODE_GRAPHS"),
    knob("decode_graph_rows", "NSACTOR_DECODE_GRAPH_ROWS"),
    knob("decode_fusion", "NSACTOR_DECODE_FUSION"),
    knob("flush", "NSACTOR_FLUSH"),
    knob("bf16_storage", "NSACTOR_BF16_STORAGE"),
    knob("batch_invariant", "NSACTOR_BATCH_INVARIANT"),
    knob("gemm_trace", "NSACTOR_GEMM_TRACE"),
    knob("gemm_splits", "NSACTOR_GEMM_SPLITS"),
    knob("gemm_chain_rows", "NSACTOR_GEMM_CHAIN_ROWS"),
    knob("gemm_tune", "NSACTOR_GEMM_TUNE"),
    knob("gemm_submit", "NSACTOR_GEMM_SUBMIT"),
    knob("norm_plif", "NSACTOR_NORM_PLIF"),
    knob("ponder", "NSACTOR_PONDER"),
    knob("ffn_neurons", "NSACTOR_FFN_NEURONS"),
    knob("gated_out", "NSACTOR_GATED_OUT"),
    knob("row_scan", "NSACTOR_ROW_SCAN"),
    knob("scan_cube", "NSACTOR_SCAN_CUBE"),
    knob("scan_unroll", "NSACTOR_SCAN_UNROLL"),
    knob("stage_async", "NSACTOR_STAGE_ASYNC"),
    knob("stage_async_backward", "NSACTOR_STAGE_ASYNC_BACKWARD"),
    knob("stage_row_forward", "NSACTOR_STAGE_ROW_FORWARD"),
    knob("stage_row_backward", "NSACTOR_STAGE_ROW_BACKWARD"),
    knob("stage_block_scan", "NSACTOR_STAGE_BLOCK_SCAN"),
    knob("decode_wide_cols", "NSACTOR_DECODE_WIDE_COLS"),
    knob("decode_wide_vector", "NSACTOR_DECODE_WIDE_VECTOR"),
    knob("block_scan_ahead", "NSACTOR_BLOCK_SCAN_AHEAD"),
    knob("kernel_bounds_check", "NSACTOR_KERNEL_BOUNDS_CHECK"),
    knob("time_chunk", "NSACTOR_TIME_CHUNK"),
    knob("time_chunk_norm", "NSACTOR_TIME_CHUNK_NORM"),
    knob("time_chunk_block", "NSACTOR_TIME_CHUNK_BLOCK"),
    knob("norm_plif_prefetch", "NSACTOR_NORM_PLIF_PREFETCH"),
    knob("stage_ffn_forward", "NSACTOR_STAGE_FFN_FORWARD"),
    knob("stage_ffn_backward", "NSACTOR_STAGE_FFN_BACKWARD"),
    knob("modulation", "NSACTOR_MODULATION"),
    knob("pinned_upload", "NSACTOR_PINNED_UPLOAD"),
];

/// The prefix of a kernel knob in a plugin's option string.
pub const OPTION_PREFIX: &str = "kernel.";

impl KernelTuning {
    /// The defaults with the environment's knob variables applied.
    pub fn from_env() -> Result<Self, EngineError> {
        Self::default().with_vars(|name| std::env::var(name).ok())
    }

    /// `self` with the knob variables that `var` knows applied (`var(name)` is the value of
    /// the variable `name`, if set).
    pub fn with_vars(mut self, var: impl Fn(&str) -> Option<String>) -> Result<Self, EngineError> {
        for k in KNOBS {
            // An empty value (a shell's `VAR= command`) is no value.
            if let Some(v) = var(k.env).filter(|v| !v.trim().is_empty()) {
                self.set(k.key, &v)
                    .map_err(|e| EngineError::InvalidInput(format!("${}: {e}", k.env)))?;
            }
        }
        Ok(self)
    }

    /// [`KernelTuning::with_vars`] that skips a variable it cannot read (and says so through
    /// `warn`) instead of refusing them all: for a process no host configured.
    pub fn with_vars_lenient(
        mut self,
        var: impl Fn(&str) -> Option<String>,
        warn: impl Fn(&str),
    ) -> Self {
        for k in KNOBS {
            if let Some(v) = var(k.env).filter(|v| !v.trim().is_empty())
                && let Err(e) = self.set(k.key, &v)
            {
                warn(&format!("${}: {e}; that knob keeps its default", k.env));
            }
        }
        self
    }

    /// Sets one knob from its text; the error says what the knob takes.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let v = value.trim();
        match key {
            "decode_graphs" => self.decode_graphs = switch(v)?,
            "decode_graph_rows" => self.decode_graph_rows = count(v, 0, usize::MAX)?,
            "decode_fusion" => self.decode_fusion = switch(v)?,
            "flush" => self.flush = switch(v)?,
            "bf16_storage" => self.bf16_storage = switch(v)?,
            "batch_invariant" => {
                self.batch_invariant = match v {
                    "on" => BatchInvariance::On,
                    "single" => BatchInvariance::Single,
                    "first" => BatchInvariance::First,
                    "off" => BatchInvariance::Off,
                    _ => return Err(format!("`{v}`: expected on, single, first or off")),
                }
            }
            "gemm_trace" => self.gemm_trace = !matches!(v, "0" | "off" | "false" | ""),
            "gemm_splits" => self.gemm_splits = count(v, 0, 64)?,
            "gemm_chain_rows" => self.gemm_chain_rows = count(v, 0, 4096)?,
            "gemm_tune" => self.gemm_tune = switch(v)?,
            "gemm_submit" => {
                self.gemm_submit = match v {
                    "queued" => GemmSubmit::Queued,
                    "blocking" => GemmSubmit::Blocking,
                    _ => return Err(format!("`{v}`: expected queued or blocking")),
                }
            }
            "norm_plif" => self.fused_norm_plif = fused(v)?,
            "ponder" => self.fused_ponder = fused(v)?,
            "ffn_neurons" => self.fused_ffn_neurons = fused(v)?,
            "gated_out" => self.fused_gated_out = fused(v)?,
            "row_scan" => {
                self.staged_row_scan = match v {
                    "staged" => true,
                    "per-unit" => false,
                    _ => return Err(format!("`{v}`: expected staged or per-unit")),
                }
            }
            "scan_cube" => self.scan_cube = count(v, 1, 1024)?,
            "scan_unroll" => self.scan_unroll = Some(count(v, 1, 1024)?),
            "stage_async" => self.stage_async = Some(ring(v)?),
            "stage_async_backward" => self.stage_async_backward = Some(ring(v)?),
            "stage_row_forward" => self.stage_row_forward = Some(stage(v)?),
            "stage_row_backward" => self.stage_row_backward = Some(stage(v)?),
            "stage_block_scan" => {
                let shape = stage(v)?;
                if shape.chunk > 64 {
                    return Err(format!(
                        "`{v}`: the block scan takes at most 64 steps a chunk"
                    ));
                }
                self.stage_block_scan = Some(shape);
            }
            "modulation" => {
                self.exact_modulation = match v {
                    "fast" => false,
                    "exact" => true,
                    _ => return Err(format!("`{v}`: expected fast or exact")),
                }
            }
            "pinned_upload" => self.pinned_upload = switch(v)?,
            "stage_ffn_forward" => self.stage_ffn_forward = Some(stage(v)?),
            "stage_ffn_backward" => self.stage_ffn_backward = Some(stage(v)?),
            "decode_wide_cols" => self.decode_wide_cols = count(v, 0, usize::MAX)?,
            "decode_wide_vector" => self.decode_wide_vector = switch(v)?,
            "block_scan_ahead" => self.block_scan_ahead = switch(v)?,
            "kernel_bounds_check" => self.kernel_bounds_check = switch(v)?,
            "time_chunk" => self.time_chunk = count(v, 0, 1 << 20)?,
            "time_chunk_norm" => self.time_chunk_norm = count(v, 0, 1 << 20)?,
            "time_chunk_block" => self.time_chunk_block = count(v, 0, 1 << 20)?,
            "norm_plif_prefetch" => {
                let [f, b] = dims::<2>(v, "FxB")?;
                if !(1..=16).contains(&f) || !(1..=16).contains(&b) {
                    return Err(format!("`{v}`: each of FxB is 1 to 16"));
                }
                self.norm_plif_prefetch = (f, b);
            }
            _ => {
                let keys: Vec<&str> = KNOBS.iter().map(|k| k.key).collect();
                return Err(format!(
                    "no kernel knob `{key}` (the knobs: {})",
                    keys.join(", ")
                ));
            }
        }
        Ok(())
    }

    /// The knobs that differ from their defaults, as `kernel.KEY=VALUE` options joined by
    /// commas (empty when none does).
    pub fn to_options(&self) -> String {
        let default = KernelTuning::default();
        KNOBS
            .iter()
            .filter_map(|k| {
                let v = self.value(k.key);
                (v != default.value(k.key)).then(|| format!("{OPTION_PREFIX}{}={v}", k.key))
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Splits a plugin's option items into the kernel knobs, applied over the environment's
    /// tuning, and the other items (the plugin's own options).
    pub fn from_options<'a>(
        items: impl IntoIterator<Item = &'a str>,
    ) -> Result<(Self, Vec<&'a str>), EngineError> {
        let mut tuning = Self::from_env()?;
        let mut rest = Vec::new();
        for item in items {
            match item.strip_prefix(OPTION_PREFIX) {
                Some(kv) => {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    tuning
                        .set(k, v)
                        .map_err(|e| EngineError::InvalidInput(format!("option `{item}`: {e}")))?;
                }
                None => rest.push(item),
            }
        }
        Ok((tuning, rest))
    }

    /// One knob's value as [`KernelTuning::set`] reads it (`-` for a kernel's own default).
    pub fn value(&self, key: &str) -> String {
        let on = |b: bool| if b { "on" } else { "off" }.to_string();
        let fused = |b: bool| if b { "fused" } else { "composed" }.to_string();
        let shape = |s: Option<StageShape>| s.map_or("-".into(), |s| s.to_string());
        let ring = |s: Option<RingShape>| s.map_or("-".into(), |s| s.to_string());
        match key {
            "decode_graphs" => on(self.decode_graphs),
            "decode_graph_rows" => self.decode_graph_rows.to_string(),
            "decode_fusion" => on(self.decode_fusion),
            "flush" => on(self.flush),
            "bf16_storage" => on(self.bf16_storage),
            "batch_invariant" => match self.batch_invariant {
                BatchInvariance::On => "on",
                BatchInvariance::Single => "single",
                BatchInvariance::First => "first",
                BatchInvariance::Off => "off",
            }
            .into(),
            "gemm_trace" => on(self.gemm_trace),
            "gemm_splits" => self.gemm_splits.to_string(),
            "gemm_chain_rows" => self.gemm_chain_rows.to_string(),
            "gemm_tune" => on(self.gemm_tune),
            "gemm_submit" => match self.gemm_submit {
                GemmSubmit::Queued => "queued",
                GemmSubmit::Blocking => "blocking",
            }
            .into(),
            "norm_plif" => fused(self.fused_norm_plif),
            "ponder" => fused(self.fused_ponder),
            "ffn_neurons" => fused(self.fused_ffn_neurons),
            "gated_out" => fused(self.fused_gated_out),
            "row_scan" => if self.staged_row_scan {
                "staged"
            } else {
                "per-unit"
            }
            .into(),
            "scan_cube" => self.scan_cube.to_string(),
            "scan_unroll" => self.scan_unroll.map_or("-".into(), |u| u.to_string()),
            "stage_async" => ring(self.stage_async),
            "stage_async_backward" => ring(self.stage_async_backward),
            "stage_row_forward" => shape(self.stage_row_forward),
            "stage_row_backward" => shape(self.stage_row_backward),
            "stage_block_scan" => shape(self.stage_block_scan),
            "modulation" => if self.exact_modulation {
                "exact"
            } else {
                "fast"
            }
            .into(),
            "pinned_upload" => on(self.pinned_upload),
            "stage_ffn_forward" => shape(self.stage_ffn_forward),
            "stage_ffn_backward" => shape(self.stage_ffn_backward),
            "decode_wide_cols" => self.decode_wide_cols.to_string(),
            "decode_wide_vector" => on(self.decode_wide_vector),
            "block_scan_ahead" => on(self.block_scan_ahead),
            "kernel_bounds_check" => on(self.kernel_bounds_check),
            "time_chunk" => self.time_chunk.to_string(),
            "time_chunk_norm" => self.time_chunk_norm.to_string(),
            "time_chunk_block" => self.time_chunk_block.to_string(),
            "norm_plif_prefetch" => {
                format!(
                    "{}x{}",
                    self.norm_plif_prefetch.0, self.norm_plif_prefetch.1
                )
            }
            _ => String::new(),
        }
    }
}

impl fmt::Display for StageShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.producers, self.chunk)
    }
}

impl fmt::Display for RingShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}x{}x{}x{}",
            self.producers, self.chunk, self.stages, self.width
        )
    }
}

/// `on`/`off` (also `true`/`false`, `1`/`0`).
fn switch(v: &str) -> Result<bool, String> {
    match v {
        "on" | "true" | "1" => Ok(true),
        "off" | "false" | "0" => Ok(false),
        _ => Err(format!("`{v}`: expected on or off")),
    }
}

/// `fused`/`composed`.
fn fused(v: &str) -> Result<bool, String> {
    match v {
        "fused" => Ok(true),
        "composed" => Ok(false),
        _ => Err(format!("`{v}`: expected fused or composed")),
    }
}

fn count(v: &str, lo: usize, hi: usize) -> Result<usize, String> {
    v.parse()
        .ok()
        .filter(|n| (lo..=hi).contains(n))
        .ok_or_else(|| match hi {
            usize::MAX => format!("`{v}`: expected an integer ≥ {lo}"),
            _ => format!("`{v}`: expected an integer from {lo} to {hi}"),
        })
}

/// `N` numbers joined by `x`.
fn dims<const N: usize>(v: &str, form: &str) -> Result<[usize; N], String> {
    let parts: Vec<usize> = v
        .split('x')
        .map(|n| n.parse().ok())
        .collect::<Option<_>>()
        .ok_or_else(|| format!("`{v}`: expected {form}"))?;
    parts
        .try_into()
        .map_err(|_| format!("`{v}`: expected {form}"))
}

/// `PxC`: producers 1–31, chunk 1–128.
fn stage(v: &str) -> Result<StageShape, String> {
    let [producers, chunk] = dims::<2>(v, "PxC")?;
    if !(1..=31).contains(&producers) || !(1..=128).contains(&chunk) {
        return Err(format!(
            "`{v}`: PxC takes producers 1 to 31, a chunk of 1 to 128"
        ));
    }
    Ok(StageShape { producers, chunk })
}

/// `PxCxD` or `PxCxDxW`: producers 1–31, chunk 1–128, stages 2–4, width 32, 64 or 128, with
/// `W·(1 + P) ≤ 1024` units.
fn ring(v: &str) -> Result<RingShape, String> {
    let n: Vec<&str> = v.split('x').collect();
    let [producers, chunk, stages, width] = match n.len() {
        3 => {
            let [p, c, d] = dims::<3>(v, "PxCxD or PxCxDxW")?;
            [p, c, d, 32]
        }
        _ => dims::<4>(v, "PxCxD or PxCxDxW")?,
    };
    if !(1..=31).contains(&producers)
        || !(1..=128).contains(&chunk)
        || !(2..=4).contains(&stages)
        || ![32, 64, 128].contains(&width)
        || width * (1 + producers) > 1024
    {
        return Err(format!(
            "`{v}`: producers 1 to 31, a chunk of 1 to 128, 2 to 4 stages, a width of 32, 64 \
             or 128, and width × (1 + producers) ≤ 1024"
        ));
    }
    Ok(RingShape {
        producers,
        chunk,
        stages,
        width,
    })
}

#[cfg(test)]
mod tests;
