//! `nsactor bench plugin-overhead`: the cost of the plugin boundary against the embedded engine.

use super::stats::{Spread, time};
use nsactor_engine::backend;
use nsactor_plugin_api::{
    ComputeBackend, EngineError, HostTensor, InitialWeights, OptimizerKind, SessionId, StageCall,
    StageKind, StageSpec,
};
use std::sync::Arc;

/// The three calls timed on one backend.
#[derive(Debug, Clone, Copy)]
pub struct BoundaryTimings {
    /// A stage call that does no work (`SessionClose` of an unknown session).
    pub noop_call: Spread,
    /// `from_host` of a `[1, 1, 64]` tensor and its `free`.
    pub transfer: Spread,
    /// One decoding step of a tiny layer (`SessionForward`, `[1, 1, 64]`).
    pub layer_step: Spread,
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
        model: nsactor_engine::config::tiny_model(),
        seed: 1,
        optimizer: Some(OptimizerKind::Adam),
        weights: InitialWeights::Seeded,
    })?;
    let host = HostTensor {
        data: (0..64).map(|i| (i as f32 * 0.37).sin()).collect(),
        shape: vec![1, 1, 64],
    };
    let noop_call = time(iters, reps, || {
        stage
            .call(StageCall::SessionClose {
                session: SessionId(u64::MAX),
            })
            .map(drop)
    })?;
    let transfer = time(iters, reps, || backend.from_host(0, &host).map(drop))?;
    let layer_iters = (iters / 20).max(10);
    let layer_step = time(layer_iters, reps, || {
        let h = backend.from_host(0, &host)?;
        stage
            .call(StageCall::SessionForward {
                sessions: &[SessionId(7)],
                h,
            })
            .map(drop)
    })?;
    Ok(BoundaryTimings {
        noop_call,
        transfer,
        layer_step,
    })
}

#[derive(clap::Args)]
pub struct OverheadArgs {
    /// Plugin to measure (name or path).
    #[arg(long, default_value = "ndarray")]
    backend: String,
    /// Calls per timed repetition.
    #[arg(long, default_value_t = 20_000)]
    iters: usize,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 15)]
    reps: usize,
}

pub fn run(args: OverheadArgs) -> crate::result::CliResult {
    let plugin = backend::open(&args.backend, &[])?;
    let info = plugin.info();
    let p = boundary(&plugin, args.iters, args.reps)?;
    let e = if backend::has_embedded() {
        Some(boundary(
            &backend::open(backend::EMBEDDED, &[])?,
            args.iters,
            args.reps,
        )?)
    } else {
        None
    };
    println!(
        "plugin boundary: {} {} on {} ({} × {} calls, median ns/call [p10–p90])",
        info.name,
        info.version,
        info.devices.join(", "),
        args.reps,
        args.iters
    );
    let cell = |t: &Spread| format!("{:>9.0} [{:.0}–{:.0}]", t.median_ns, t.p10_ns, t.p90_ns);
    println!(
        "{:<34} {:>24} {:>24} {:>12}",
        "call", "embedded", "plugin", "overhead"
    );
    let rows = [
        ("no-op stage call", p.noop_call, e.map(|e| e.noop_call)),
        (
            "from_host + free [1,1,64]",
            p.transfer,
            e.map(|e| e.transfer),
        ),
        (
            "tiny layer decode step",
            p.layer_step,
            e.map(|e| e.layer_step),
        ),
    ];
    for (name, pt, et) in rows {
        match et {
            Some(et) => println!(
                "{name:<34} {:>24} {:>24} {:>9.0} ns",
                cell(&et),
                cell(&pt),
                pt.median_ns - et.median_ns
            ),
            None => println!("{name:<34} {:>24} {:>24}", "-", cell(&pt)),
        }
    }
    Ok(())
}
