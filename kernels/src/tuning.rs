//! The process's kernel tuning ([`KernelTuning`]): installed once by the backend that opens
//! the kernels (from its option string, over the environment), read by every kernel launcher
//! from here. A process that opened no backend through its options (a test, a benchmark
//! linking the kernels directly) gets the environment's tuning on first use.
//!
//! Kernels are reached through burn's backend traits, whose calls carry tensors only, so the
//! value cannot travel with each call; it is fixed before the first kernel runs instead.

use nsactor_plugin_api::{EngineError, KernelTuning};
use std::sync::OnceLock;

static TUNING: OnceLock<KernelTuning> = OnceLock::new();

/// Fixes the process's tuning. Installing the same value again is a no-op; another value, or
/// one after the kernels already ran on the environment's, is an error (the knobs are chosen
/// once, before the first kernel).
pub fn install(tuning: KernelTuning) -> Result<(), EngineError> {
    let now = TUNING.get_or_init(|| tuning.clone());
    if *now == tuning {
        Ok(())
    } else {
        Err(EngineError::InvalidInput(format!(
            "the kernel tuning is set once per process and is already `{}`; this backend asks \
             for `{}`",
            shown(now),
            shown(&tuning)
        )))
    }
}

/// The process's tuning (the environment's when none was installed; a variable that does not
/// read is reported and skipped, the others still apply).
pub fn current() -> &'static KernelTuning {
    TUNING.get_or_init(|| {
        KernelTuning::default().with_vars_lenient(
            |name| std::env::var(name).ok(),
            |w| eprintln!("nsactor: {w}"),
        )
    })
}

fn shown(t: &KernelTuning) -> String {
    match t.to_options() {
        o if o.is_empty() => "the defaults".into(),
        o => o,
    }
}
