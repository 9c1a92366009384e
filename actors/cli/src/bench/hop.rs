//! `nsactor bench pipeline-hop`: an actor hop against a 0.9B layer's compute.

use super::echo::EchoBackend;
use crate::result::CliResult;
use nsactor_plugin_api::{ComputeBackend, OptimizerKind};
use std::sync::Arc;
use std::time::Instant;

/// What `nsactor bench pipeline-hop` measured.
#[derive(Debug, Clone)]
pub struct HopTimings {
    /// Median seconds of one training step (all micro-batches plus the optimizer phase).
    pub step_s: f64,
    /// Hops per step: per micro-batch, embed → L forwards → head → L backwards → embedding
    /// backward (2L + 3 messages, each with a worker handoff), plus the optimizer phase's
    /// 3·(L + 1) calls.
    pub hops: usize,
}

impl HopTimings {
    pub fn per_hop_s(&self) -> f64 {
        self.step_s / self.hops as f64
    }
}

/// Times training steps through a pipeline of `layers` no-compute layer actors in `stages`
/// stages, `micro_batches` per step; the median of `steps` steps. With `layer_busy_us > 0` each
/// layer's forward holds its stage for that long (and its backward three times as long), as a
/// device would, so the schedule's overlap and bubble can be measured without a GPU.
pub fn pipeline_hops(
    layers: usize,
    stages: usize,
    micro_batches: usize,
    steps: usize,
    layer_busy_us: u64,
    schedule: nsactor_engine::config::Schedule,
) -> CliResult<HopTimings> {
    use nsactor_decoding::{Pipeline, PipelinePlan};
    use nsactor_engine::engine::{StagedModel, StepParams};
    let model = nsactor_engine::config::ModelConfig {
        num_layers: layers,
        ..nsactor_engine::config::tiny_model()
    };
    let backend: Arc<dyn ComputeBackend> = Arc::new(EchoBackend { layer_busy_us });
    let staged = StagedModel::open(backend, &model, 0, OptimizerKind::Adam, None)?;
    let plan = PipelinePlan::balanced(layers, stages, &[0])?;
    let mut train = nsactor_engine::config::RunConfig::load(None)?.train;
    train.schedule = schedule;
    let mut p = Pipeline::start(staged, plan, train, None)?;
    let batch = nsactor_plugin_api::Batch {
        batch: 1,
        seq_len: 1,
        inputs: vec![1],
        targets: vec![1],
        loss_mask: vec![1.0],
    };
    let batches = vec![batch; micro_batches];
    let params = StepParams {
        lr: 1e-3,
        neuron_lr: 1e-2,
        ponder_weight: 0.0,
        max_grad_norm: 1.0,
    };
    let mut times = Vec::with_capacity(steps);
    for i in 0..steps + 2 {
        let t = Instant::now();
        p.train_step(&batches, &params)?;
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(HopTimings {
        step_s: times[times.len() / 2],
        hops: micro_batches * (2 * layers + 3) + 3 * (layers + 1),
    })
}

#[derive(clap::Args)]
pub struct HopArgs {
    /// Layer actors in the pipeline.
    #[arg(long, default_value_t = 20)]
    layers: usize,
    /// Pipeline stages to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pipeline: Vec<usize>,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 64)]
    micro: usize,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 9)]
    steps: usize,
    /// Simulated device time per layer forward in µs (backward: 3×), held without using the
    /// CPU: measures the schedule's overlap and bubble instead of the hop cost.
    #[arg(long, default_value_t = 0)]
    layer_busy_us: u64,
    /// Micro-batch order on the stage workers: `auto`, `fifo` or `depth-first` (overlaps
    /// stages of several layers; see [train].schedule). Overrides [train].schedule.
    #[arg(long, value_parser = ["auto", "fifo", "depth-first"])]
    schedule: Option<String>,
}

pub fn run(args: HopArgs) -> crate::result::CliResult {
    // 0.9B, one layer, one micro-batch of 4 × 511 tokens: ≈107 GFLOP per trained token with
    // per-layer recompute over 20 layers (DESIGN.md performance model).
    let layer_flop = 107e9 / 20.0 * 4.0 * 511.0;
    let at = |tflops: f64| layer_flop / (tflops * 1e12);
    println!(
        "actor pipeline hop: {} no-compute layer actors, {} micro-batches per step, median of {} steps; {} CPU threads",
        args.layers,
        args.micro,
        args.steps,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "0.9B layer compute per micro-batch (4×511 tokens, fwd + recompute + bwd, {:.1} TFLOP): {:.1} ms at 600 TFLOP/s (cuBLAS bf16), {:.0} ms at 88 TFLOP/s (burn's matmul)",
        layer_flop * 1e-12,
        at(600.0) * 1e3,
        at(88.0) * 1e3
    );
    println!(
        "{:>9} {:>12} {:>8} {:>12} {:>22}",
        "pipeline", "step (ms)", "hops", "per hop (µs)", "share of a 0.9B layer"
    );
    for &p in &args.pipeline {
        let t = pipeline_hops(
            args.layers,
            p,
            args.micro,
            args.steps,
            args.layer_busy_us,
            args.schedule.as_deref().unwrap_or("fifo").parse()?,
        )?;
        // A layer sees two hops per micro-batch: its forward input and its backward input.
        let share = 2.0 * t.per_hop_s() / at(600.0);
        println!(
            "{:>9} {:>12.3} {:>8} {:>12.2} {:>21.4}%",
            p,
            t.step_s * 1e3,
            t.hops,
            t.per_hop_s() * 1e6,
            share * 100.0
        );
    }
    Ok(())
}
