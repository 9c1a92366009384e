//! `nsactor bench …`: programs that print a figure, the device and the comparison it is about.

use nsactor_plugin_api::{
    ComputeBackend, EngineError, HostTensor, OptimizerKind, StageCall, StageKind, StageSpec,
};
use std::sync::Arc;
use std::time::Instant;

/// The tiny model used to time the boundary (compute per call is small, so overhead shows).
pub const TINY_MODEL: &str = "[model]\nvocab_size = 512\nD = 64\nN = 4\nK = 4\nnum_layers = 2\n\
                              D_ff = 192\nv_th_min = 0.1\nplif_out = \"leak\"\n";

/// Median and spread of repeated timings, in nanoseconds per call.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub median_ns: f64,
    pub p10_ns: f64,
    pub p90_ns: f64,
}

fn time<F: FnMut() -> Result<(), EngineError>>(
    iters: usize,
    reps: usize,
    mut f: F,
) -> Result<Timing, EngineError> {
    for _ in 0..iters.min(1000) {
        f()?;
    }
    let mut per_call: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f()?;
            }
            Ok(t.elapsed().as_nanos() as f64 / iters as f64)
        })
        .collect::<Result<_, EngineError>>()?;
    per_call.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| per_call[((per_call.len() - 1) as f64 * q).round() as usize];
    Ok(Timing {
        median_ns: at(0.5),
        p10_ns: at(0.1),
        p90_ns: at(0.9),
    })
}

/// The three calls timed on one backend.
#[derive(Debug, Clone, Copy)]
pub struct BoundaryTimings {
    /// A stage call that does no work (`SessionClose` of an unknown session).
    pub noop_call: Timing,
    /// `from_host` of a `[1, 1, 64]` tensor and its `free`.
    pub transfer: Timing,
    /// One decoding step of a tiny layer (`SessionForward`, `[1, 1, 64]`).
    pub layer_step: Timing,
}

/// Times the boundary calls on `backend`.
pub fn boundary(
    backend: &Arc<dyn ComputeBackend>,
    iters: usize,
    reps: usize,
) -> Result<BoundaryTimings, EngineError> {
    let mut stage = backend.open_stage(&StageSpec {
        kind: StageKind::Layer(0),
        device: 0,
        model_toml: TINY_MODEL.into(),
        seed: 1,
        optimizer: OptimizerKind::Adam,
    })?;
    let host = HostTensor {
        data: (0..64).map(|i| (i as f32 * 0.37).sin()).collect(),
        shape: vec![1, 1, 64],
    };
    let noop_call = time(iters, reps, || {
        stage
            .call(StageCall::SessionClose { session: u64::MAX })
            .map(drop)
    })?;
    let transfer = time(iters, reps, || backend.from_host(0, &host).map(drop))?;
    let layer_iters = (iters / 20).max(10);
    let layer_step = time(layer_iters, reps, || {
        let h = backend.from_host(0, &host)?;
        stage
            .call(StageCall::SessionForward { session: 7, h })
            .map(drop)
    })?;
    Ok(BoundaryTimings {
        noop_call,
        transfer,
        layer_step,
    })
}
