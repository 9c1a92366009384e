//! `nsactor bench checkpoint`: a training run's checkpoint on its backend, timed by part. The
//! config is opened with Adam and stepped once (so every moment exists), then: the snapshot;
//! the stages read back one after another (device to host and serialising, no disk); the
//! checkpoint as a run writes it (synchronous, then in the background beside training steps,
//! whose slowdown is reported); the final checkpoint with the run's weights from the same read;
//! and the disk's own write rate on the same number of bytes (the same pieces, fsync, one and
//! eight writers), which is the ceiling the checkpoint's rate is compared to.

use super::train::synthetic_batches;
use crate::args::LayoutArgs;
use crate::result::CliResult;
use nsactor_checkpoint::disk::DiskMode;
use nsactor_decoding::Pipeline;
use nsactor_engine::config::{Overrides, RunConfig};
use nsactor_engine::engine::StepParams;
use nsactor_launch::launch;
use nsactor_plugin_api::OptimizerKind;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args)]
pub struct CheckpointBenchArgs {
    /// Run config (default: the embedded configs/tiny.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    layout: LayoutArgs,
    /// Override [train].batch_size for the steps beside the background write.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Where the checkpoints and the disk probe are written (on the disk a run writes to);
    /// removed afterwards.
    #[arg(long, default_value = "bench-checkpoint")]
    dir: PathBuf,
    /// Steps timed without a checkpoint, the baseline for the steps beside a background write.
    #[arg(long, default_value_t = 3)]
    steps: usize,
}

/// Rates in GB/s (decimal) of `bytes` over `seconds`.
fn gbps(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / 1e9 / seconds.max(1e-9)
}

/// The disk's own rate: `total` bytes written as `files` files by as many threads, each in
/// 8 MB pieces in `mode`, fsynced and renamed, as a checkpoint's shards are. Returns seconds
/// and whether every file went past the page cache (`false` in direct mode where the file
/// system refused it).
pub fn disk_write(dir: &Path, total: u64, files: usize, mode: DiskMode) -> CliResult<(f64, bool)> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let piece = vec![0x5au8; 8 << 20];
    let per_file = total / files as u64;
    let t = Instant::now();
    let direct = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..files)
            .map(|i| {
                let (path, piece) = (dir.join(format!("probe-{i}.bin")), &piece);
                s.spawn(move || {
                    nsactor_plugin_api::files::write_atomic_with(&path, |f| {
                        let mut out = nsactor_checkpoint::disk::Appender::new(f, mode);
                        let direct = out.is_direct();
                        let mut left = per_file;
                        while left > 0 {
                            let n = left.min(piece.len() as u64) as usize;
                            out.put(&piece[..n])?;
                            left -= n as u64;
                        }
                        out.finish().map(|_| direct)
                    })
                    .map_err(|e| format!("{}: {e}", path.display()))
                })
            })
            .collect();
        jobs.into_iter().try_fold(true, |all, j| {
            j.join()
                .expect("a probe writer does not panic")
                .map(|d| all && d)
        })
    })?;
    let seconds = t.elapsed().as_secs_f64();
    for i in 0..files {
        let _ = std::fs::remove_file(dir.join(format!("probe-{i}.bin")));
    }
    Ok((seconds, direct))
}

/// One optimizer step on synthetic batches of the config's shape; returns its seconds.
fn step(pipeline: &mut Pipeline, cfg: &RunConfig, seed: u64) -> CliResult<f64> {
    let t = &cfg.train;
    let params = StepParams {
        lr: t.lr,
        neuron_lr: t.lr * t.neuron_lr_mult,
        ponder_weight: t.ponder_weight,
        max_grad_norm: t.max_grad_norm,
    };
    let b = synthetic_batches(
        t.batch_size,
        t.seq_len,
        t.accumulation,
        cfg.model.vocab_size,
        seed,
    );
    let start = Instant::now();
    pipeline
        .train_step(&b, &params)
        .map_err(|e| format!("step: {e}"))?;
    Ok(start.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn run(a: CheckpointBenchArgs) -> CliResult {
    let mut cfg = RunConfig::load(a.config.as_deref())?;
    cfg.apply(&Overrides {
        batch_size: a.batch_size,
        ..a.layout.overrides()?
    })?;
    // Checkpoints are taken beside steps here: `keep_activations = "auto"` leaves room for
    // the snapshot as in a run that checkpoints.
    cfg.train.checkpoint_every = cfg.train.checkpoint_every.max(1);
    let compute = launch::open_backend(&cfg, a.layout.backend.as_deref())?;
    let info = compute.info();
    let mut pipeline = launch::launch(compute.clone(), &cfg, OptimizerKind::Adam, None)?;
    let root = a.dir.join("checkpoints");
    let _ = std::fs::remove_dir_all(&a.dir);
    std::fs::create_dir_all(&a.dir).map_err(|e| format!("{}: {e}", a.dir.display()))?;
    println!(
        "checkpoint bench: {} ({} parameters) on {} {}, {}; checkpoints under {}",
        a.config
            .as_ref()
            .map_or("embedded configs/tiny.toml".into(), |p| p
                .display()
                .to_string()),
        pipeline.param_count(),
        info.name,
        info.version,
        info.devices.first().map_or("", String::as_str),
        a.dir.display()
    );
    // Two steps: kernels compiled, every Adam moment written; more while `keep_activations =
    // "auto"` is still choosing, so every timed step keeps the same layers.
    let mut seed = cfg.train.seed;
    let mut warm = 0;
    while warm < 2 || !pipeline.keep_activations_settled() {
        step(&mut pipeline, &cfg, seed)?;
        seed += 1;
        warm += 1;
    }
    let base: Vec<f64> = (0..a.steps)
        .map(|_| {
            seed += 1;
            step(&mut pipeline, &cfg, seed)
        })
        .collect::<CliResult<_>>()?;
    let base_step = median(base);

    // The stages read back, one after another, no disk: from a snapshot, so the time is the
    // read's, not the tail of the last step the stages were still finishing.
    let snaps = pipeline.snapshot_stages()?;
    let t = Instant::now();
    let shards = nsactor_checkpoint::writer::serialise(snaps)?;
    let read_s = t.elapsed().as_secs_f64();
    let bytes: u64 = shards.iter().map(|s| s.len() as u64).sum();
    let largest = shards.iter().map(|s| s.len()).max().unwrap_or(0);
    let count = shards.len();
    drop(shards);
    println!(
        "state: {:.2} GB in {count} stages (largest {:.1} MB); read back one stage after another \
         (device to host, serialised, no disk) {read_s:.2} s = {:.2} GB/s",
        bytes as f64 / 1e9,
        largest as f64 / 1e6,
        gbps(bytes, read_s)
    );

    // The disk's own rate on the same bytes.
    let probe = a.dir.join("probe");
    // Both ways a checkpoint may write (`NSACTOR_CHECKPOINT_IO`); the run's own way is the
    // ceiling its rate is compared to.
    let mode = DiskMode::from_env()?;
    let mut disk = 0.0;
    for m in [DiskMode::Buffered, DiskMode::Direct] {
        let (one, direct_one) = disk_write(&probe, bytes, 1, m)?;
        let (eight, direct_eight) = disk_write(&probe, bytes, 8, m)?;
        if m == mode {
            disk = gbps(bytes, one).max(gbps(bytes, eight));
        }
        println!(
            "disk ({}{}): {:.2} GB in 8 MB pieces, fsynced: one writer {one:.2} s = {:.2} GB/s, \
             eight {eight:.2} s = {:.2} GB/s",
            match m {
                DiskMode::Buffered => "page cache",
                DiskMode::Direct if direct_one && direct_eight => "direct",
                DiskMode::Direct => "direct refused: through the page cache",
            },
            if m == mode { ", the run's" } else { "" },
            bytes as f64 / 1e9,
            gbps(bytes, one),
            gbps(bytes, eight)
        );
    }

    // As a run writes it, synchronously.
    let config = cfg.to_toml();
    let r = pipeline.checkpoint_with(&root, 2, config.clone(), None, false)?;
    let w = r
        .written
        .ok_or("a synchronous checkpoint reported no write")?;
    let synchronous = gbps(w.bytes, w.seconds);
    println!(
        "checkpoint (synchronous): snapshot {:.3} s, written {:.2} s = {:.2} GB/s ({:.0}% of the \
         disk's {disk:.2} GB/s; reading the stages {:.2} s summed over the writers)",
        r.snapshot_seconds,
        w.seconds,
        gbps(w.bytes, w.seconds),
        100.0 * gbps(w.bytes, w.seconds) / disk,
        w.read_seconds
    );

    // In the background, beside training steps.
    let t = Instant::now();
    let r = pipeline.checkpoint_with(&root, 2, config.clone(), None, true)?;
    let snapshot = r.snapshot_seconds;
    let mut beside = Vec::new();
    let (mut done, mut background) = (None, 0.0);
    while done.is_none() {
        seed += 1;
        beside.push(step(&mut pipeline, &cfg, seed)?);
        if beside.len() >= a.steps.max(1) {
            let wait = Instant::now();
            done = pipeline.finish_checkpoint()?;
            let waited = wait.elapsed().as_secs_f64();
            let w = done.as_ref().ok_or("no background write in flight")?;
            background = gbps(w.bytes, w.seconds);
            println!(
                "checkpoint (background): snapshot {snapshot:.3} s, written {:.2} s = {:.2} GB/s; \
                 {} steps beside it, then waited {waited:.2} s for the write ({:.2} s from the \
                 request)",
                w.seconds,
                gbps(w.bytes, w.seconds),
                beside.len(),
                t.elapsed().as_secs_f64()
            );
        }
    }
    let during = median(beside.clone());
    let worst = beside.iter().copied().fold(0.0, f64::max);
    println!(
        "steps: {base_step:.3} s median without a checkpoint, {during:.3} s median beside the write \
         ({:+.1}%), worst {worst:.3} s ({:+.1}%); target ≤ +5%",
        100.0 * (during / base_step - 1.0),
        100.0 * (worst / base_step - 1.0)
    );

    // The run's end: its last checkpoint, whose weights file becomes the run's weights.
    let weights = a.dir.join("model.safetensors");
    let t = Instant::now();
    let w = pipeline.checkpoint_exporting(&root, 2, config, None, &weights)?;
    let end = t.elapsed().as_secs_f64();
    let exported = w.export.as_ref().map_or(0, |e| e.1);
    println!(
        "final checkpoint with the run's weights: {:.2} GB (of which the weights file {:.2} GB, \
         linked as {}) in {end:.2} s ({:.2} GB/s of files); the checkpoint alone took {:.2} s above",
        w.bytes as f64 / 1e9,
        exported as f64 / 1e9,
        weights.display(),
        gbps(w.bytes, end),
        w.seconds
    );
    let files = gbps(w.bytes, end);
    println!(
        "checkpoint write rate {synchronous:.2} GB/s synchronous: {:.2}× the 2 GB/s target, {:.0}% \
         of this disk (in the background beside steps {background:.2} GB/s; the final checkpoint \
         with its weights {files:.2} GB/s of files)",
        synchronous / 2.0,
        100.0 * synchronous / disk
    );
    let _ = std::fs::remove_dir_all(&a.dir);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_probe_writes_the_bytes_asked_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        for mode in [DiskMode::Buffered, DiskMode::Direct] {
            let (s, direct) = disk_write(dir.path(), 3 << 20, 3, mode).unwrap();
            assert!(s > 0.0);
            assert!(!direct || mode == DiskMode::Direct);
            assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        }
        assert!((gbps(2_000_000_000, 1.0) - 2.0).abs() < 1e-12);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
