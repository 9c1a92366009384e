//! `nsactor bench train`: training throughput, MFU, stage busy time, bubble and memory.

use super::breakdown::print_device_breakdown;
use super::flops::train_flops_per_token;
use super::steps::{TrainBench, TrainStepTiming};
use crate::args::LayoutArgs;
use crate::result::CliResult;
use nsactor_engine::config::{Overrides, RunConfig};
use nsactor_launch::launch::{self};
use nsactor_plugin_api::{Diagnostic, DiagnosticReport, OptimizerKind};
use std::path::PathBuf;
use std::time::Instant;

/// Synthetic training batches: seeded uniform token ids over the non-special vocabulary, every
/// target scored. Throughput does not depend on the token values.
pub fn synthetic_batches(
    batch: usize,
    seq_len: usize,
    micro_batches: usize,
    vocab: usize,
    seed: u64,
) -> Vec<nsactor_plugin_api::Batch> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        5 + (s % (vocab.max(6) as u64 - 5)) as i64
    };
    (0..micro_batches)
        .map(|_| {
            let ids: Vec<i64> = (0..batch * (seq_len + 1)).map(|_| next()).collect();
            let mut inputs = Vec::with_capacity(batch * seq_len);
            let mut targets = Vec::with_capacity(batch * seq_len);
            for row in ids.chunks(seq_len + 1) {
                inputs.extend_from_slice(&row[..seq_len]);
                targets.extend_from_slice(&row[1..]);
            }
            nsactor_plugin_api::Batch {
                batch,
                seq_len,
                inputs,
                targets,
                loss_mask: vec![1.0; batch * seq_len],
            }
        })
        .collect()
}

/// Runs `warmup` then `steps` optimizer steps of `train`'s shape (batch, T, accumulation) on
/// synthetic batches through `pipeline`, timing each step end to end (the step returns once
/// every stage has finished and the loss is on the host).
pub fn train_throughput(
    pipeline: &mut nsactor_decoding::Pipeline,
    train: &nsactor_engine::config::TrainConfig,
    vocab: usize,
    warmup: usize,
    steps: usize,
    mut timing: Option<&dyn nsactor_plugin_api::ComputeBackend>,
) -> CliResult<TrainBench> {
    use nsactor_engine::engine::StepParams;
    let params = StepParams {
        lr: train.lr,
        neuron_lr: train.lr * train.neuron_lr_mult,
        ponder_weight: train.ponder_weight,
        max_grad_norm: train.max_grad_norm,
    };
    let workers = pipeline.busy().into_iter().map(|(n, _, _)| n).collect();
    let mut out = TrainBench {
        tokens_per_step: train.batch_size * train.seq_len * train.accumulation,
        warmup: Vec::new(),
        steps: Vec::new(),
        workers,
        device_note: None,
    };
    // Steps are warm-up while `keep_activations = "auto"` is still measuring, too.
    let mut i = 0;
    while out.steps.len() < steps {
        let warm = i < warmup || !pipeline.keep_activations_settled();
        let batches = synthetic_batches(
            train.batch_size,
            train.seq_len,
            train.accumulation,
            vocab,
            train.seed + i as u64,
        );
        let busy_now = |p: &nsactor_decoding::Pipeline| -> Vec<f64> {
            p.busy().into_iter().map(|(_, s, _)| s).collect()
        };
        let delta = |now: Vec<f64>, before: Vec<f64>| -> Vec<f64> {
            now.into_iter().zip(before).map(|(n, b)| n - b).collect()
        };
        let (before, before_t) = (busy_now(pipeline), pipeline.transfers());
        // The device-time window brackets the timed steps only (it waits for the device first).
        let timed = !warm && timing.is_some();
        if timed && let Some(Err(e)) = timing.map(|c| c.diagnose(&Diagnostic::TimingStart)) {
            out.device_note = Some(e.to_string());
            timing = None;
        }
        let t = Instant::now();
        let stats = pipeline
            .train_step(&batches, &params)
            .map_err(|e| format!("step {i}: {e}"))?;
        let seconds = t.elapsed().as_secs_f64();
        let mut device = Vec::new();
        if let Some(c) = timing.filter(|_| timed) {
            device = match c.diagnose(&Diagnostic::TimingReport) {
                Ok(DiagnosticReport::Timing(d)) => d,
                Ok(other) => {
                    return Err(
                        format!("step {i}: device timing: a {} report", other.kind()).into(),
                    );
                }
                Err(e) => return Err(format!("step {i}: device timing: {e}").into()),
            };
        }
        let busy = delta(busy_now(pipeline), before);
        let transfer = delta(pipeline.transfers(), before_t);
        let record = TrainStepTiming {
            seconds,
            loss: stats.loss,
            busy,
            transfer,
            device,
        };
        if warm {
            out.warmup.push(record);
        } else {
            out.steps.push(record);
        }
        i += 1;
    }
    Ok(out)
}

#[derive(clap::Args)]
pub struct TrainBenchArgs {
    /// Run config (default: the embedded configs/tiny.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    layout: LayoutArgs,
    /// Override [train].batch_size (sequences per micro-batch).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Override [train].seq_len.
    #[arg(long)]
    seq_len: Option<usize>,
    /// Override [train].accumulation (micro-batches per step).
    #[arg(long)]
    accumulation: Option<usize>,
    /// Untimed steps first (kernel compilation, autotuning, pool growth), and any more
    /// that `--keep-activations auto` measures.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// One device's peak dense TFLOP/s for the MFU, which counts every device the run uses
    /// (default: H100 SXM bf16 989, fp32 67).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Skip the device-time breakdown (GEMMs, scans, other work, time outside stage calls),
    /// which brackets each GEMM, scan and stage call with device events and waits for the
    /// device between timed steps.
    #[arg(long)]
    no_breakdown: bool,
}

pub fn run(a: TrainBenchArgs) -> crate::result::CliResult {
    if a.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    let mut cfg = RunConfig::load(a.config.as_deref())?;
    cfg.apply(&Overrides {
        batch_size: a.batch_size,
        seq_len: a.seq_len,
        accumulation: a.accumulation,
        ..a.layout.overrides()?
    })?;
    let compute = launch::open_backend(&cfg, a.layout.backend.as_deref())?;
    let info = compute.info();
    let devices = cfg.train.devices.clone().unwrap_or_else(|| vec![0]);
    let vocab = cfg.model.vocab_size;
    let t_open = std::time::Instant::now();
    let mut pipeline = launch::launch(compute.clone(), &cfg, OptimizerKind::Adam, None)?;
    let params = pipeline.param_count();
    let plan = pipeline.plan().clone();
    let model_flops = train_flops_per_token(&cfg.model, 0);
    let open_s = t_open.elapsed().as_secs_f64();
    let precision = cfg.backend.precision.as_deref().unwrap_or("fp32");
    let used: Vec<&str> = devices.iter().map(|&d| info.devices[d].as_str()).collect();
    println!(
        "train bench: {} ({params} parameters) on {} {}, GEMMs {precision}; {}",
        a.config
            .as_ref()
            .map_or("embedded configs/tiny.toml".into(), |p| p
                .display()
                .to_string()),
        info.name,
        info.version,
        used.join(" | ")
    );
    println!(
        "pipeline {} stage(s) [{}] (layers@device), {:?} schedule; batch {} × T {} × accumulation {} = {} tokens/step; model opened in {open_s:.1} s",
        plan.num_stages(),
        plan.describe(),
        cfg.train.schedule.resolve(&info.name),
        cfg.train.batch_size,
        cfg.train.seq_len,
        cfg.train.accumulation,
        cfg.train.batch_size * cfg.train.seq_len * cfg.train.accumulation
    );
    let replicas = pipeline.replica_plans().to_vec();
    if replicas.len() > 1 {
        let layouts: Vec<String> = replicas
            .iter()
            .map(|p| format!("[{}]", p.describe()))
            .collect();
        println!(
            "data parallelism: {} replicas {}, {:?} reduction; each runs {}–{} of the {} micro-batches",
            replicas.len(),
            layouts.join(" "),
            cfg.train.dp_reduce.resolve(&info.name),
            cfg.train.accumulation / replicas.len(),
            cfg.train.accumulation.div_ceil(replicas.len()),
            cfg.train.accumulation
        );
    }
    // The peak of every device the replicas use.
    let gpus = replicas
        .iter()
        .flat_map(|p| p.stages.iter().map(|s| s.device))
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    // `auto` chooses from device memory where the backend reports it (elsewhere it keeps
    // none at once); its measuring steps are warm-up.
    let auto = cfg.train.keep_activations.is_auto()
        && crate::capacity::device_memory(compute.as_ref()).is_some();
    let r = train_throughput(
        &mut pipeline,
        &cfg.train,
        vocab,
        a.warmup,
        a.steps,
        (!a.no_breakdown).then_some(compute.as_ref()),
    )?;
    println!(
        "{:>6} {:>10} {:>10} {:>9}",
        "step", "time (s)", "tokens/s", "loss"
    );
    for (i, s) in r.warmup.iter().chain(&r.steps).enumerate() {
        println!(
            "{:>6} {:>10.3} {:>10.0} {:>9.4}{}",
            i,
            s.seconds,
            r.tokens_per_step as f64 / s.seconds,
            s.loss,
            if i < r.warmup.len() {
                "  (warm-up)"
            } else {
                ""
            }
        );
    }
    // Layers that recompute their forward in the backward: all but the last `keep` of each
    // stage (`auto`: what it chose).
    let keep = pipeline.keep_activations();
    let recomputed: usize = plan
        .stages
        .iter()
        .map(|s| s.layers.len().saturating_sub(keep))
        .sum();
    println!(
        "kept layers: the last {keep} of each stage keep their forward's graph ({})",
        match cfg.train.keep_activations {
            _ if auto => "auto: chosen from the device memory of the warm-up steps",
            nsactor_engine::config::KeepActivations::Auto => {
                "auto: this backend reports no device memory"
            }
            _ => "keep_activations",
        }
    );
    let executed_flops = train_flops_per_token(&cfg.model, recomputed);
    let step = r.median_step_s();
    let tflops = r.tokens_per_s() * model_flops / 1e12;
    let executed = r.tokens_per_s() * executed_flops / 1e12;
    let peak = gpus as f64
        * a.peak_tflops
            .unwrap_or(if precision == "bf16" { 989.0 } else { 67.0 });
    println!(
        "median step {:.3} s: {:.0} tokens/s; {:.4} GFLOP/token (projections, fwd + bwd) → {tflops:.3} TFLOP/s, MFU {:.2}% of {peak} TFLOP/s; executed with the recompute of {recomputed} of {} layers {:.4} GFLOP/token, {executed:.3} TFLOP/s ({:.2}%)",
        step,
        r.tokens_per_s(),
        model_flops / 1e9,
        100.0 * tflops / peak,
        plan.num_layers(),
        executed_flops / 1e9,
        100.0 * executed / peak
    );
    println!(
        "per-worker time per step (host time inside stage calls; of it, issuing input moves from another device):"
    );
    let busy = r.mean_busy();
    for ((name, b), t) in r.workers.iter().zip(&busy).zip(r.mean_transfer()) {
        println!(
            "  {name:<16} busy {b:>8.3} s  {:>5.1}% of the step   transfer {:>8.4} s",
            100.0 * b / step,
            t
        );
    }
    // The edge's worker is not a stage; stages are the rest.
    let stages = &busy[1..];
    let p = stages.len() as f64;
    let m = cfg.train.accumulation as f64;
    println!(
        "bubble: measured {:.1}% (1 − Σ stage busy / (P · step)), 1F1B theory (P−1)/(M+P−1) = {:.1}% for P = {p}, M = {m}",
        100.0 * (1.0 - stages.iter().sum::<f64>() / (p * step)),
        100.0 * (p - 1.0) / (m + p - 1.0)
    );
    print_device_breakdown(&r, &info, executed_flops, a.no_breakdown);
    super::open::print_memory(compute.as_ref());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_batches_are_shifted_windows_of_ordinary_tokens() {
        let b = synthetic_batches(3, 10, 2, 100, 7);
        assert_eq!(b.len(), 2);
        for m in &b {
            m.validate().unwrap();
            assert!(m.inputs.iter().all(|&t| (5..100).contains(&t)));
            for r in 0..3 {
                assert_eq!(
                    m.inputs[r * 10 + 1..r * 10 + 10],
                    m.targets[r * 10..r * 10 + 9]
                );
            }
        }
        assert_ne!(b[0].inputs, b[1].inputs);
    }

    #[test]
    fn the_device_breakdown_is_the_mean_over_timed_steps_per_device() {
        use nsactor_plugin_api::timing::DeviceTime;
        use nsactor_plugin_api::timing::SpanKind::*;
        let step = |gemm_end: f64, dev: Vec<usize>| TrainStepTiming {
            seconds: 1.0,
            loss: 0.0,
            busy: vec![0.0],
            transfer: vec![0.0],
            device: dev
                .into_iter()
                .map(|d| {
                    DeviceTime::from_spans(
                        d,
                        1.0,
                        &[(Call("Forward"), 0.0, 0.5), (Gemm, 0.0, gemm_end)],
                    )
                })
                .collect(),
        };
        let mut r = TrainBench {
            tokens_per_step: 1,
            warmup: vec![step(0.5, vec![0])],
            steps: vec![step(0.1, vec![0, 1]), step(0.3, vec![0, 1])],
            workers: vec!["w".into()],
            device_note: None,
        };
        let m = r.mean_device();
        assert_eq!(m.len(), 2);
        // The warm-up step is not in it.
        assert!((m[0].gemm_s - 0.2).abs() < 1e-12 && (m[1].gemm_s - 0.2).abs() < 1e-12);
        assert_eq!((m[0].window_s, m[0].calls_s, m[0].gemms), (1.0, 0.5, 1));
        assert!((m[0].other_s() - 0.3).abs() < 1e-12);
        // By call name, the same means.
        let c = &m[0].by_call;
        assert_eq!((c.len(), c[0].name.as_str(), c[0].calls), (1, "Forward", 1));
        assert!((c[0].seconds - 0.5).abs() < 1e-12 && (c[0].kernels_s - 0.2).abs() < 1e-12);
        r.steps.iter_mut().for_each(|s| s.device.clear());
        assert!(r.mean_device().is_empty());
    }
}
