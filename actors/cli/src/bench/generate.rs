//! `nsactor bench generate` and `bench decode-profile`: decoding without the network.

use super::open::{open_with_precision, print_memory, print_text};
use super::stats::pct;
use crate::result::{CliError, CliResult};
use nsactor_launch::launch::{self};
use nsactor_plugin_api::Diagnostic;
use std::path::PathBuf;
use std::time::Instant;

/// What [`generate_load`] measured.
#[derive(Debug, Clone)]
pub struct GenerateTimings {
    pub sessions: usize,
    /// Prompt through the model to the first token's logits.
    pub prefill_p50_ms: f64,
    /// One decoding step of one session (its token in, the next token's logits out).
    pub step_p50_ms: f64,
    pub step_p99_ms: f64,
    /// Generated tokens over the wall time of the whole batch of sessions (prefill included).
    pub tokens_per_s: f64,
    /// Decoded tokens (after each session's first) over the time from the last prefill's end to
    /// the last session's end: the steady-state rate.
    pub decode_tokens_per_s: f64,
    /// Mean sessions per batched pass while decoding.
    pub mean_cohort: f64,
    /// The mean step, which the slow steps pull above the median.
    pub step_mean_ms: f64,
    /// The first session's five slowest steps: `(step number from 0, ms)`, slowest first.
    pub slowest: Vec<(usize, f64)>,
}

/// `sessions` concurrent greedy decoding sessions straight on the pipeline's decoder (no
/// network), each feeding `prompt` and then generating `tokens` tokens, end tokens ignored.
/// Run on the pipeline's runtime.
pub async fn generate_load(
    decoder: &nsactor_decoding::AsyncDecoder,
    sessions: usize,
    prompt: &[i64],
    tokens: usize,
    on_device: bool,
) -> CliResult<GenerateTimings> {
    if sessions == 0 || tokens < 2 || prompt.is_empty() {
        return Err("generate_load needs ≥ 1 session, ≥ 2 tokens and a prompt".into());
    }
    let (c0, n0) = decoder.batch_counts();
    let start = Instant::now();
    let runs: Vec<_> = (0..sessions)
        .map(|_| {
            let d = decoder.clone();
            let prompt = prompt.to_vec();
            tokio::spawn(async move {
                let s = d.session();
                let t0 = Instant::now();
                let r = async {
                    let mut steps = Vec::with_capacity(tokens);
                    let prefilled = if on_device {
                        // As the server decodes: the batcher feeds each token back itself.
                        let mut st = d.stream(s, prompt, greedy_stream(tokens - 1)).await?;
                        next_token(&mut st).await?;
                        let prefilled = Instant::now();
                        for _ in 1..tokens {
                            let t = Instant::now();
                            next_token(&mut st).await?;
                            steps.push(t.elapsed().as_secs_f64());
                        }
                        prefilled
                    } else {
                        let mut next = argmax_of(&d, s, prompt).await?;
                        let prefilled = Instant::now();
                        for _ in 1..tokens {
                            let t = Instant::now();
                            next = argmax_of(&d, s, vec![next]).await?;
                            steps.push(t.elapsed().as_secs_f64());
                        }
                        prefilled
                    };
                    Ok::<_, CliError>(((prefilled - t0).as_secs_f64(), prefilled, steps))
                }
                .await;
                // The session's last token is in: freeing its states is not decoding time.
                let last = Instant::now();
                d.close(s).await;
                r.map(|(p, at, steps)| (p, at, steps, last))
            })
        })
        .collect();
    let (mut prefills, mut steps) = (Vec::new(), Vec::new());
    let (mut last_prefill, mut end) = (start, start);
    let mut slowest = Vec::new();
    for r in runs {
        let (p, at, s, done) = r.await??;
        if slowest.is_empty() {
            slowest = s.iter().map(|t| t * 1e3).enumerate().collect();
            slowest.sort_by(|a: &(usize, f64), b| b.1.total_cmp(&a.1));
            slowest.truncate(5);
        }
        prefills.push(p);
        steps.extend(s);
        last_prefill = last_prefill.max(at);
        end = end.max(done);
    }
    let wall = (end - start).as_secs_f64();
    let (c1, n1) = decoder.batch_counts();
    let step_mean_ms = steps.iter().sum::<f64>() / steps.len().max(1) as f64 * 1e3;
    Ok(GenerateTimings {
        sessions,
        step_mean_ms,
        slowest,
        prefill_p50_ms: pct(&mut prefills, 0.5) * 1e3,
        step_p50_ms: pct(&mut steps, 0.5) * 1e3,
        step_p99_ms: pct(&mut steps, 0.99) * 1e3,
        tokens_per_s: (sessions * tokens) as f64 / wall,
        decode_tokens_per_s: (sessions * (tokens - 1)) as f64
            / (end - last_prefill).as_secs_f64().max(1e-9),
        mean_cohort: (n1 - n0) as f64 / (c1 - c0).max(1) as f64,
    })
}

#[derive(clap::Args)]
pub struct GenerateBenchArgs {
    /// Run config whose model is freshly initialised (default: the embedded configs/tiny.toml).
    #[arg(long, conflicts_with = "checkpoint")]
    config: Option<PathBuf>,
    /// A checkpoint to decode with instead of a fresh model.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Backend (default: the config's or the run's, else the embedded CPU one).
    #[arg(long)]
    backend: Option<String>,
    /// Projection GEMM arithmetic: fp32 or bf16 (CUDA).
    #[arg(long, value_parser = ["fp32", "bf16"])]
    precision: Option<String>,
    /// Concurrent sessions to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    sessions: Vec<usize>,
    /// Tokens each session generates (the first comes from the prefill).
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Prompt length in tokens (a fixed synthetic prompt).
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Devices for the stages, e.g. `0,1`.
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    #[command(flatten)]
    passes: crate::serve::PassArgs,
    /// The device's memory bandwidth in GB/s for the weight-streaming ceiling (default: H100
    /// SXM's measured copy bandwidth, 2,852).
    #[arg(long, default_value_t = 2852.0)]
    bandwidth_gbs: f64,
    /// The device's dense peak in TFLOP/s for the ratio to the compute ceiling (default: on a
    /// CUDA backend 989 in bf16 and 67 in fp32, as an H100/H200 SXM; none on the CPU).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Where the greedy token is chosen: `device` (as the server does: only ids cross) or
    /// `host` (the logits are copied and the host takes their argmax).
    #[arg(long, value_parser = ["device", "host"], default_value = "device")]
    pick: String,
}

/// Greedy on the device without logits, `more` tokens after the first, end tokens ignored.
fn greedy_stream(more: usize) -> nsactor_decoding::StreamPlan {
    nsactor_decoding::StreamPlan {
        pick: nsactor_decoding::PickRequest::greedy(false),
        more,
        end_tokens: Vec::new(),
    }
}

/// The stream's next token.
async fn next_token(st: &mut nsactor_decoding::DecodeStream) -> CliResult<i64> {
    match st.next().await {
        Some(p) => Ok(p?.token),
        None => Err("the decoding stream ended before its last token".into()),
    }
}

/// Feeds `ids` to `session`; the argmax of the logits copied to the host.
async fn argmax_of(
    d: &nsactor_decoding::AsyncDecoder,
    session: nsactor_plugin_api::SessionId,
    ids: Vec<i64>,
) -> CliResult<i64> {
    Ok(nsactor_engine::decode::argmax(&d.feed(session, ids).await?) as i64)
}

pub fn run(a: GenerateBenchArgs) -> crate::result::CliResult {
    if a.tokens < 2 || a.prompt_len == 0 || a.sessions.contains(&0) {
        return Err("--tokens must be ≥ 2, --prompt-len ≥ 1 and every --sessions ≥ 1".into());
    }
    let l = match &a.checkpoint {
        Some(c) => launch::load_checkpoint(&launch::CheckpointOptions {
            checkpoint: c.clone(),
            backend: a.backend.clone(),
            pipeline: a.pipeline,
            devices: a.devices.clone(),
            tokenizer: None,
            precision: a.precision.clone(),
            ..Default::default()
        })?,
        None => launch::load_fresh(
            a.config.as_deref(),
            a.backend.as_deref(),
            a.precision.clone(),
            a.pipeline,
            a.devices.as_deref(),
        )?,
    };
    let info = l.pipeline.backend().info();
    let params = l.pipeline.param_count();
    let precision = l.config.backend.precision.clone().unwrap_or("fp32".into());
    let bytes = if precision == "bf16" { 2.0 } else { 4.0 };
    // Batch-1 decoding reads every weight once per token.
    let weight_read = a.bandwidth_gbs * 1e9 / (params as f64 * bytes);
    let ceiling = super::flops::Ceiling::forward(
        &l.config.model,
        a.peak_tflops,
        &info.name,
        precision == "bf16",
    );
    println!(
        "generate bench: {} ({params} parameters) on {} {} ({}), GEMMs {precision}, pipeline {}; prompt {} tokens, {} tokens per session, greedy (picked on the {})",
        l.name,
        info.name,
        info.version,
        info.devices.join(", "),
        a.pipeline,
        a.prompt_len,
        a.tokens,
        a.pick
    );
    println!(
        "batch-1 ceiling: {:.2} GB of {precision} weights per token at {} GB/s = {weight_read:.0} tokens/s",
        params as f64 * bytes / 1e9,
        a.bandwidth_gbs
    );
    println!(
        "{:>9} {:>16} {:>14} {:>14} {:>16} {:>18} {:>12}",
        "sessions",
        "prefill p50 (ms)",
        "step p50 (ms)",
        "step p99 (ms)",
        "tokens/s (all)",
        "tokens/s (decode)",
        "mean cohort"
    );
    let vocab = l.vocab;
    let prompt: Vec<i64> = (0..a.prompt_len)
        .map(|i| ((i * 7919 + 101) % vocab.max(1)) as i64)
        .collect();
    let decoder = a.passes.apply(l.pipeline.decoder(vocab));
    let on_device = a.pick == "device";
    l.pipeline.block_on(async {
        // Warm-up at every batch size measured (kernel compilation, autotuning, pool growth).
        for &n in &a.sessions {
            generate_load(&decoder, n, &prompt, 4, on_device).await?;
        }
        let (mut host, mut slow, mut compute) = (Vec::new(), Vec::new(), Vec::new());
        for &n in &a.sessions {
            let (c0, _) = decoder.batch_counts();
            let b0 = l.pipeline.busy();
            let p0 = decoder.cohort_phases();
            let _ = nsactor_pipeline::trace::take();
            let t = generate_load(&decoder, n, &prompt, a.tokens, on_device).await?;
            let timelines = nsactor_pipeline::trace::take();
            let (c1, _) = decoder.batch_counts();
            let p1 = decoder.cohort_phases();
            let per_pass: Vec<String> = l
                .pipeline
                .busy()
                .iter()
                .zip(&b0)
                .map(|((name, s1, _), (_, s0, _))| {
                    format!("{name} {:.2} ms", (s1 - s0) * 1e3 / (c1 - c0).max(1) as f64)
                })
                .collect();
            let passes = (c1 - c0).max(1) as f64;
            let ms: Vec<f64> = p1.iter().zip(&p0).map(|(x, y)| (x - y) * 1e3 / passes).collect();
            if nsactor_pipeline::trace::enabled() {
                println!("  cohort timeline, median µs from its start ({n} sessions):");
                for (m, us, count) in nsactor_pipeline::trace::medians(&timelines) {
                    println!("    {us:>9.1}  {} ({count} cohorts)", m.name());
                }
            }
            host.push((
                n,
                format!(
                    "{}; cohort {:.2} ms = embed {:.2} + layers {:.2} + decode and copy {:.2} (+ {:.2} between)",
                    per_pass.join(", "),
                    ms[3],
                    ms[0],
                    ms[1],
                    ms[2],
                    ms[3] - ms[0] - ms[1] - ms[2]
                ),
            ));
            let worst: Vec<String> = t
                .slowest
                .iter()
                .map(|(i, ms)| format!("#{i} {ms:.2}"))
                .collect();
            slow.push((n, t.step_mean_ms, worst.join(", ")));
            compute.push((n, ceiling.describe(t.decode_tokens_per_s)));
            println!(
                "{:>9} {:>16.1} {:>14.2} {:>14.2} {:>16.0} {:>18.0} {:>12.1}",
                t.sessions,
                t.prefill_p50_ms,
                t.step_p50_ms,
                t.step_p99_ms,
                t.tokens_per_s,
                t.decode_tokens_per_s,
                t.mean_cohort
            );
        }
        println!(
            "host time inside stage calls per batched pass (prefill and decode passes alike):"
        );
        for (n, line) in host {
            println!("  {n:>4} sessions: {line}");
        }
        println!(
            "decoding against the compute ceiling ({:.2} GFLOP a token forward):",
            ceiling.flops_per_token / 1e9
        );
        for (n, line) in compute {
            println!("  {n:>4} sessions: {line}");
        }
        println!("mean step, and one session's slowest steps (step number from 0: ms):");
        for (n, mean, worst) in slow {
            println!("  {n:>4} sessions: mean {mean:.2} ms; {worst}");
        }
        Ok::<_, crate::result::CliError>(())
    })?;
    print_memory(l.pipeline.backend().as_ref());
    Ok(())
}

#[derive(clap::Args)]
pub struct DecodeProfileArgs {
    /// Backend plugin (or `embedded`).
    #[arg(long, default_value = "cuda")]
    backend: String,
    /// Projection GEMM arithmetic: fp32 or bf16 (CUDA).
    #[arg(long, value_parser = ["fp32", "bf16"], default_value = "fp32")]
    precision: String,
    /// `batch=` (sessions), `tokens=` (per session: 1 is a decoding step, more a prompt pass),
    /// `reps=`, `config=tiny`.
    #[arg(long, default_value = "")]
    options: String,
}

pub fn decode_profile_cmd(a: DecodeProfileArgs) -> crate::result::CliResult {
    let b = open_with_precision(&a.backend, &a.precision)?;
    print_text(b.as_ref(), Diagnostic::DecodeProfile { options: a.options })
}
