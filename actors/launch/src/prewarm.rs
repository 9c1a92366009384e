//! A cold run's first-step kernels compiled while its stages are set up (`[train] prewarm`).
//!
//! One thread per device the run uses asks the backend for [`ComputeBackend::prewarm`]: one
//! layer's training step at the run's micro-batch shape, compiled and not run (the shape
//! itself: several kernels and every autotuned operation's key depend on it, so a smaller one
//! compiled mostly other kernels; its memory is only reserved while the step is handed over,
//! then given back). The
//! threads start right after the backend opens and run beside the stages' opening and the
//! first step; nothing waits for them but the end of the run (dropping [`Prewarm`]), and a
//! failure only costs the head start (it is logged, the run goes on).

use nsactor_engine::config::RunConfig;
use nsactor_plugin_api::{ComputeBackend, InitialWeights, StageKind, StageSpec};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// The prewarm threads of a run; dropping it waits for them (they return once the step's
/// kernels are handed to the compiler, not compiled: the backend's compiler threads finish
/// those on their own).
#[derive(Default)]
pub struct Prewarm {
    threads: Vec<JoinHandle<()>>,
}

impl Prewarm {
    /// Starts a thread per device of `cfg`'s run (none where `[train] prewarm` is off).
    pub fn start(compute: &Arc<dyn ComputeBackend>, cfg: &RunConfig) -> Self {
        if !cfg.train.prewarm {
            return Self::default();
        }
        let mut devices = cfg.train.devices.clone().unwrap_or_else(|| vec![0]);
        devices.sort_unstable();
        devices.dedup();
        let threads = devices
            .into_iter()
            .filter_map(|device| {
                let compute = compute.clone();
                let spec = StageSpec {
                    kind: StageKind::Layer(0),
                    device,
                    model: cfg.model.clone(),
                    seed: cfg.train.seed,
                    optimizer: None,
                    weights: InitialWeights::Loaded,
                };
                let (batch, seq_len) = (cfg.train.batch_size, cfg.train.seq_len);
                std::thread::Builder::new()
                    .name(format!("prewarm-{device}"))
                    .spawn(move || run(compute.as_ref(), &spec, batch, seq_len))
                    .map_err(|e| tracing::warn!("prewarm: no thread for device {device}: {e}"))
                    .ok()
            })
            .collect();
        Prewarm { threads }
    }
}

impl Drop for Prewarm {
    fn drop(&mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn run(compute: &dyn ComputeBackend, spec: &StageSpec, batch: usize, seq_len: usize) {
    let started = Instant::now();
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        compute.prewarm(spec, batch, seq_len)
    }));
    let took = started.elapsed().as_secs_f64();
    match ran {
        Ok(Ok(true)) => tracing::info!(
            "prewarm: device {}'s first-step kernels handed to the compiler in {took:.2} s",
            spec.device
        ),
        Ok(Ok(false)) => tracing::debug!(
            "prewarm: nothing compiled ahead on device {} (the backend has no compile-only mode \
             here)",
            spec.device
        ),
        Ok(Err(e)) => tracing::warn!("prewarm on device {} failed: {e}", spec.device),
        Err(_) => tracing::warn!("prewarm on device {} panicked", spec.device),
    }
}
