//! `nsactor bench heal`: how long a server's decoding is away after it loses a stage, on the
//! path `nsactor serve` runs. A fresh model of the config is checkpointed to disk and opened
//! again through `launch::load_checkpoint` (as `serve --checkpoint` opens it) with
//! `session-panic:1:PASS`; one session feeds tokens until layer 1 panics. Printed: the time
//! from the lost stage (found before any session is answered) until decoding serves again,
//! the rebuild's phases (read + verify the checkpoint, rebuild the actors, load the weights),
//! and the first pass after it against one before.

use crate::result::CliResult;
use nsactor_decoding::heal::Health;
use nsactor_launch::launch::{self, CheckpointOptions};
use std::path::PathBuf;
use std::time::Instant;

/// Decoding passes before the fault: the first ones compile and tune the kernels.
const PASSES_BEFORE: u64 = 8;

#[derive(clap::Args)]
pub struct HealArgs {
    /// Run config of the model (default: the embedded tiny config).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Backend name or plugin path (default: the config's).
    #[arg(long)]
    backend: Option<String>,
    /// GEMM precision (default: the config's).
    #[arg(long)]
    precision: Option<String>,
    /// Scratch directory for the checkpoint (removed afterwards).
    #[arg(long, default_value = "runs/bench-heal")]
    dir: PathBuf,
}

/// What `nsactor bench heal` measured.
#[derive(Debug, Clone, Copy)]
pub struct HealReport {
    /// The rebuild's phases, and decoding away from the lost stage until serving again.
    pub timings: nsactor_decoding::heal::HealTimings,
    /// One decoding pass before the fault and the first after the rebuild.
    pub pass_before_s: f64,
    pub first_pass_after_s: f64,
    pub checkpoint_bytes: u64,
}

pub fn run(a: HealArgs) -> CliResult {
    let _ = std::fs::remove_dir_all(&a.dir);
    let r = measure(&a);
    let _ = std::fs::remove_dir_all(&a.dir);
    let (r, described) = r?;
    println!("{described}");
    println!(
        "  decoding away {:.1} ms: read + verify the checkpoint ({:.3} GB) {:.1} ms, rebuild the \
         actors {:.1} ms, load the weights {:.1} ms",
        r.timings.away_s * 1e3,
        r.checkpoint_bytes as f64 / 1e9,
        r.timings.read_s * 1e3,
        r.timings.rebuild_s * 1e3,
        r.timings.load_s * 1e3
    );
    println!(
        "  first decoding pass after it: {:.1} ms (one before the fault: {:.1} ms)",
        r.first_pass_after_s * 1e3,
        r.pass_before_s * 1e3
    );
    Ok(())
}

/// The report and a line naming the model and the device.
pub fn measure(a: &HealArgs) -> CliResult<(HealReport, String)> {
    let run = a.dir.join("run");
    let fresh = launch::load_fresh(
        a.config.as_deref(),
        a.backend.as_deref(),
        a.precision.clone(),
        1,
        None,
    )?;
    let (mut pipeline, config, name) = (fresh.pipeline, fresh.config, fresh.name);
    let dir = pipeline.checkpoint(&run.join("checkpoints"), 1, config.to_toml(), None)?;
    drop(pipeline);
    let checkpoint_bytes = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    let l = launch::load_checkpoint(&CheckpointOptions {
        checkpoint: dir,
        backend: a.backend.clone(),
        pipeline: 1,
        precision: a.precision.clone(),
        inject_fault: Some(format!("session-panic:1:{}", PASSES_BEFORE + 1)),
        ..Default::default()
    })?;
    let described = format!(
        "heal bench: {name} ({} parameters) on {}; layer 1 panics in decoding pass {}",
        l.pipeline.param_count(),
        nsactor_training::train::describe(l.pipeline.backend().as_ref()),
        PASSES_BEFORE + 1
    );
    let d = l.pipeline.decoder(l.vocab);
    let report = l.pipeline.block_on(async {
        let s = d.session();
        let mut pass_before_s = 0.0;
        for i in 0..PASSES_BEFORE {
            let t = Instant::now();
            d.feed(s, vec![(i as i64 * 7 + 1) % l.vocab as i64]).await?;
            pass_before_s = t.elapsed().as_secs_f64();
        }
        if d.feed(s, vec![1]).await.is_ok() {
            return Err("the injected fault did not fire".into());
        }
        let mut changes = d.health_changes();
        let end = changes
            .wait_for(|h| !matches!(h, Health::Recovering { .. }))
            .await
            .map(|h| h.clone())
            .map_err(|_| "the decoder stopped while it healed")?;
        if let Health::Failed { cause } = end {
            return Err(format!("decoding failed instead of healing: {cause}").into());
        }
        d.close(s).await;
        let s = d.session();
        let t = Instant::now();
        d.feed(s, vec![1]).await?;
        let first_pass_after_s = t.elapsed().as_secs_f64();
        d.close(s).await;
        let timings = d.last_heal().ok_or("healed without timings")?;
        Ok::<_, crate::result::CliError>(HealReport {
            timings,
            pass_before_s,
            first_pass_after_s,
            checkpoint_bytes,
        })
    })?;
    Ok((report, described))
}
