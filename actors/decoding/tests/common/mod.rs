//! What the pipeline tests share: the tiny model on the embedded CPU backend (one rayon
//! thread, so the CPU kernels are deterministic), pseudo-random batches, step parameters, the
//! sequential reference run, and a small packed corpus.

#![allow(dead_code)]

use nsactor_data::{MemTokens, Mode, Sampler};
use nsactor_decoding::{Pipeline, PipelinePlan};
use nsactor_engine::RuntimeError;
use nsactor_engine::config::{RunConfig, model_from_toml};
use nsactor_engine::engine::{StagedModel, StepParams, StepStats};
use nsactor_plugin_api::{Batch, OptimizerKind};
use std::sync::{Arc, Mutex, MutexGuard};

/// Holds the tests of this file to one at a time. Each compares runs bit for bit, and burn's
/// autodiff keeps process-wide graph state that tests on other threads clean up concurrently:
/// run side by side, a last-bit difference showed up now and then (about 2 runs in 10) in the
/// full suite, never alone.
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

pub const MODEL: &str = "[model]\nvocab_size = 256\nD = 16\nN = 4\nK = 3\nnum_layers = 4\nD_ff = 48\n\
                     v_th_min = 0.1\nplif_out = \"leak\"\n";

pub fn backend() -> Arc<dyn nsactor_plugin_api::ComputeBackend> {
    // These tests compare results bit for bit across schedules. burn-ndarray splits some
    // reductions over rayon's global pool adaptively (work stealing), so when stages really run
    // at once the last bits vary from run to run (measured: 2 of 8 runs of this file differed
    // in a loss by ~1e-11 relative; 0 of 8 with one thread). One rayon thread makes the CPU
    // kernels deterministic; the schedules still overlap on the stage workers.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global();
    nsactor_engine::backend::open(nsactor_engine::backend::EMBEDDED, &[]).unwrap()
}

pub fn staged() -> StagedModel {
    StagedModel::open(
        backend(),
        &model_from_toml(MODEL).unwrap(),
        11,
        OptimizerKind::Adam,
        None,
    )
    .unwrap()
}

pub fn train_cfg() -> nsactor_engine::config::TrainConfig {
    let mut t = RunConfig::load(None).unwrap().train;
    t.batch_size = 2;
    t.seq_len = 12;
    t.accumulation = 3;
    t.steps = 4;
    t.warmup_iters = 2;
    t
}

pub fn pipeline(p: usize, sampler: Option<Sampler>) -> Pipeline {
    let plan = PipelinePlan::balanced(4, p, &[0]).unwrap();
    Pipeline::start(staged(), plan, train_cfg(), sampler).unwrap()
}

/// Deterministic pseudo-random batches.
pub fn batches(seed: u64, m: usize) -> Vec<Batch> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 250 + 5) as i64
    };
    (0..m)
        .map(|_| {
            let (b, t) = (2, 12);
            let inputs: Vec<i64> = (0..b * t).map(|_| next()).collect();
            let targets: Vec<i64> = (0..b * t).map(|_| next()).collect();
            let loss_mask = (0..b * t)
                .map(|i| if i % 7 == 3 { 0.0 } else { 1.0 })
                .collect();
            Batch {
                batch: b,
                seq_len: t,
                inputs,
                targets,
                loss_mask,
            }
        })
        .collect()
}

pub fn params(step: usize) -> StepParams {
    StepParams {
        lr: 2e-3 * (step + 1) as f64,
        neuron_lr: 2e-2 * (step + 1) as f64,
        ponder_weight: 0.01,
        max_grad_norm: 0.5,
    }
}

pub fn bits(s: &StepStats) -> [u64; 6] {
    [
        s.loss.to_bits(),
        s.ce.to_bits(),
        s.expected_k.to_bits(),
        s.expected_k_min.to_bits(),
        s.expected_k_max.to_bits(),
        s.grad_norm.to_bits(),
    ]
}

/// The sequential engine's run of `steps`: each step's statistics as bits, and the stages'
/// saved shards at the end.
pub fn sequential(steps: &[Vec<Batch>]) -> (Vec<[u64; 6]>, Vec<Vec<u8>>) {
    let mut reference = staged();
    let want = steps
        .iter()
        .enumerate()
        .map(|(i, b)| bits(&reference.train_step(b, &params(i)).unwrap()))
        .collect();
    (want, reference.save_stages().unwrap())
}

pub fn sampler() -> Sampler {
    let mut tokens = MemTokens::default();
    let mut x = 12345u64;
    for _ in 0..40 {
        let doc: Vec<u32> = (0..30)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 33) as u32 % 250 + 5
            })
            .collect();
        tokens.push(3, &doc, 4);
    }
    Sampler::pretrain(Arc::new(tokens), Mode::Packed, 12, 5).unwrap()
}

/// Teacher-forced decoding of `prompt` then `tokens` through one session: the logits of the
/// prompt and of every token.
pub async fn forced(
    d: &nsactor_decoding::AsyncDecoder,
    prompt: Vec<i64>,
    tokens: Vec<i64>,
) -> Vec<Vec<f32>> {
    let s = d.session();
    let mut out = vec![d.feed(s, prompt).await.unwrap()];
    for t in tokens {
        out.push(d.feed(s, vec![t]).await.unwrap());
    }
    d.close(s).await;
    out
}

/// Runs `cfg.steps` steps, checkpointing every `every` steps under `out_dir/checkpoints` (0:
/// never); returns each step's loss bits (redone steps overwrite) and the recoveries seen.
pub fn run_with_recovery(
    p: &mut Pipeline,
    steps: u64,
    every: u64,
    root: &std::path::Path,
) -> (Vec<u64>, Vec<u64>) {
    let mut losses = Vec::new();
    let mut rolled_back_to = Vec::new();
    let mut step = 0;
    while step < steps {
        match p.step() {
            Ok(r) => {
                step = r.step;
                losses.truncate(step as usize - 1);
                losses.push(r.stats.loss.to_bits());
                if every > 0 && step % every == 0 {
                    p.checkpoint(root, 0, "cfg".into(), None).unwrap();
                }
            }
            Err(RuntimeError::Recovered { to_step, cause, .. }) => {
                assert!(cause.contains("injected fault: layer 2"), "{cause}");
                rolled_back_to.push(to_step);
                step = to_step;
            }
            Err(e) => panic!("{e}"),
        }
    }
    (losses, rolled_back_to)
}

/// A run of `t` on two stages of the 4-layer model over the packed corpus, in a fresh
/// directory, `fault` injected where given, stepped through `t.steps` by [`run_with_recovery`]
/// (a checkpoint every `every` steps): the pipeline, each step's loss bits, the steps it rolled
/// back to, and the directory (kept while the caller holds it).
pub fn recovery_run(
    t: &nsactor_engine::config::TrainConfig,
    fault: Option<&str>,
    every: u64,
) -> (Pipeline, Vec<u64>, Vec<u64>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut t = t.clone();
    t.out_dir = dir.path().to_path_buf();
    t.inject_fault = fault.map(str::to_string);
    let steps = t.steps;
    let plan = PipelinePlan::balanced(4, 2, &[0]).unwrap();
    let mut p = Pipeline::start(staged(), plan, t, Some(sampler())).unwrap();
    let (losses, back) = run_with_recovery(&mut p, steps, every, &dir.path().join("checkpoints"));
    (p, losses, back, dir)
}

/// The [`recovery_run`] of `t` without a fault (a checkpoint every 2 steps), which rolls back
/// nowhere: each step's loss bits and the stages at its end.
pub fn straight_run(t: &nsactor_engine::config::TrainConfig) -> (Vec<u64>, Vec<Vec<u8>>) {
    let (mut straight, want, none, _dir) = recovery_run(t, None, 2);
    assert!(none.is_empty());
    (want, straight.save_stages().unwrap())
}

/// A session fed one token at a time in a loop of its own (as a client that steps), counting
/// the steps answered, until [`Stepper::stop`].
pub struct Stepper {
    pub session: nsactor_plugin_api::SessionId,
    pub stepped: Arc<std::sync::atomic::AtomicU64>,
    done: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Stepper {
    /// Opens a session on `d` (fed two tokens) and starts its steps; call from inside the
    /// pipeline's runtime.
    pub async fn start(d: &nsactor_decoding::AsyncDecoder) -> Stepper {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let session = d.session();
        d.feed(session, vec![7, 8]).await.unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let stepped = Arc::new(AtomicU64::new(0));
        let task = {
            let (d, done, stepped) = (d.clone(), done.clone(), stepped.clone());
            tokio::spawn(async move {
                while !done.load(Ordering::Relaxed) {
                    d.feed(session, vec![9]).await.unwrap();
                    stepped.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        Stepper {
            session,
            stepped,
            done,
            task,
        }
    }

    /// Steps answered so far.
    pub fn steps(&self) -> u64 {
        self.stepped.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Ends the loop and closes the session: the steps answered in all.
    pub async fn stop(self, d: &nsactor_decoding::AsyncDecoder) -> u64 {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        let steps = self.stepped.clone();
        self.task.await.unwrap();
        d.close(self.session).await;
        steps.load(std::sync::atomic::Ordering::Relaxed)
    }
}
