//! The training loop behind `nsactor train`: LR schedule, micro-batches, logging, weights.

use crate::config::RunConfig;
use crate::engine::{StagedModel, StepParams};
use nsactor_data::{Sampler, Tokenizer};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Engine(#[from] nsactor_plugin_api::EngineError),
    #[error("weights: {0}")]
    Weights(String),
    #[error("data: {0}")]
    Data(#[from] nsactor_data::DataError),
    #[error("{0}")]
    Config(String),
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub losses: Vec<f64>,
    pub tokens_per_s: f64,
    pub weights: PathBuf,
}

/// Fails when `tok` has ids the model's embedding cannot hold.
pub fn check_tokenizer(cfg: &RunConfig, tok: &Tokenizer) -> Result<(), TrainError> {
    match cfg.vocab_size() {
        Some(v) if tok.vocab_size() <= v => Ok(()),
        v => Err(TrainError::Config(format!(
            "tokenizer {} has {} tokens but [model] vocab_size is {}; set vocab_size ≥ {} or use \
             a smaller tokenizer",
            tok.origin(),
            tok.vocab_size(),
            v.map_or("missing".into(), |v| v.to_string()),
            tok.vocab_size()
        ))),
    }
}

/// Runs `cfg.train.steps` optimizer steps on `engine` with batches from `sampler`, logging every
/// `log_interval` steps to stderr and every step to `out_dir/metrics.jsonl`, then writes
/// `out_dir/model.safetensors`, `out_dir/config.toml` and the sampler's cursor
/// `out_dir/data_cursor.json`.
pub fn run(
    cfg: &RunConfig,
    engine: &mut StagedModel,
    sampler: &mut Sampler,
) -> Result<RunSummary, TrainError> {
    let t = &cfg.train;
    let out_dir = t.out_dir.clone();
    std::fs::create_dir_all(&out_dir).map_err(|e| TrainError::Io(out_dir.clone(), e))?;
    let metrics_path = out_dir.join("metrics.jsonl");
    let mut metrics = std::fs::File::create(&metrics_path)
        .map_err(|e| TrainError::Io(metrics_path.clone(), e))?;
    eprintln!(
        "nsactor train: {} parameters on {}; {} steps × {} micro-batches × {}×{} tokens",
        engine.param_count(),
        describe(engine),
        t.steps,
        t.accumulation,
        t.batch_size,
        t.seq_len
    );
    let total_micro = t.steps * t.accumulation as u64;
    // Drawn only on a terminal; otherwise the log lines below are the progress.
    let bar = indicatif::ProgressBar::new(t.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed} < {eta}]")
            .expect("a valid template"),
    );
    let start = Instant::now();
    let mut tokens = 0u64;
    let mut losses = Vec::with_capacity(t.steps as usize);
    for step in 0..t.steps {
        let micro = (0..t.accumulation)
            .map(|_| sampler.next_batch(t.batch_size, t.seq_len))
            .collect::<Result<Vec<_>, _>>()?;
        // The step uses the LR of the last micro-step of its window (SPEC §7.2).
        let lr = t.lr_at((step + 1) * t.accumulation as u64 - 1, total_micro);
        let params = StepParams {
            lr,
            neuron_lr: lr * t.neuron_lr_mult,
            ponder_weight: t.ponder_weight,
            max_grad_norm: t.max_grad_norm,
        };
        let stats = engine.train_step(&micro, &params)?;
        tokens += stats.tokens;
        losses.push(stats.loss);
        let elapsed = start.elapsed().as_secs_f64();
        let line = serde_json::json!({
            "step": step + 1, "loss": stats.loss, "ce": stats.ce, "ppl": stats.ce.exp(), "lr": lr,
            "expected_k": stats.expected_k, "expected_k_min": stats.expected_k_min,
            "expected_k_max": stats.expected_k_max, "grad_norm": stats.grad_norm,
            "tokens": tokens, "tokens_per_s": tokens as f64 / elapsed,
        });
        writeln!(metrics, "{line}").map_err(|e| TrainError::Io(metrics_path.clone(), e))?;
        bar.set_position(step + 1);
        bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | E[K] {:.2}",
            stats.loss,
            tokens as f64 / elapsed,
            stats.expected_k
        ));
        if (step + 1) % t.log_interval == 0 || step == 0 || step + 1 == t.steps {
            let line = format!(
                "step {:>6}/{} loss {:.4} ppl {:>8.2} lr {:.2e} E[K] {:.3} [{:.2}, {:.2}] |g| {:.3} {:.0} tok/s",
                step + 1,
                t.steps,
                stats.loss,
                stats.ce.exp(),
                lr,
                stats.expected_k,
                stats.expected_k_min,
                stats.expected_k_max,
                stats.grad_norm,
                tokens as f64 / elapsed
            );
            if bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
        }
    }
    bar.finish_and_clear();
    let plot_path = out_dir.join("loss.png");
    let png = crate::plot::loss_curve(&losses, 640, 360).to_png();
    crate::weights::write_atomic(&plot_path, &png).map_err(|e| TrainError::Io(plot_path, e))?;
    let weights = out_dir.join("model.safetensors");
    let merged =
        crate::weights::merge_params(&engine.save_stages()?).map_err(TrainError::Weights)?;
    crate::weights::write_atomic(&weights, &merged)
        .map_err(|e| TrainError::Io(weights.clone(), e))?;
    let config_path = out_dir.join("config.toml");
    let text = toml::to_string(cfg).expect("a RunConfig serialises");
    std::fs::write(&config_path, text).map_err(|e| TrainError::Io(config_path, e))?;
    let cursor_path = out_dir.join("data_cursor.json");
    let cursor = serde_json::to_string(&sampler.cursor()).expect("a cursor serialises");
    std::fs::write(&cursor_path, cursor).map_err(|e| TrainError::Io(cursor_path, e))?;
    Ok(RunSummary {
        losses,
        tokens_per_s: tokens as f64 / start.elapsed().as_secs_f64(),
        weights,
    })
}

/// `ndarray 0.1.0 (cpu (2 threads, f32))`.
pub fn describe(engine: &StagedModel) -> String {
    let info = engine.backend().info();
    format!(
        "{} {} ({})",
        info.name,
        info.version,
        info.devices.join(", ")
    )
}
