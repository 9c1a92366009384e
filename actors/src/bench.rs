//! `nsactor bench …`: programs that print a figure, the device and the comparison it is about.

use nsactor_plugin_api::timing::DeviceTime;
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
            .call(StageCall::SessionForward { sessions: &[7], h })
            .map(drop)
    })?;
    Ok(BoundaryTimings {
        noop_call,
        transfer,
        layer_step,
    })
}

/// A tensor that is only a shape: what the no-compute stages pass around.
struct Shape(Vec<usize>);

impl nsactor_plugin_api::TensorObject for Shape {
    fn shape(&self) -> Vec<usize> {
        self.0.clone()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// A stage that answers every call at once, or after `busy_us` (forward) / `3 × busy_us`
/// (backward: recompute + backward) of simulated device time in which it holds its worker
/// without using the CPU: activations and gradients pass straight through.
struct EchoStage {
    busy_us: u64,
}

impl nsactor_plugin_api::Stage for EchoStage {
    fn call(&mut self, call: StageCall<'_>) -> Result<nsactor_plugin_api::Reply, EngineError> {
        use nsactor_plugin_api::{DeviceTensor, Reply};
        let t = |shape: Vec<usize>| DeviceTensor::new(Shape(shape));
        Ok(match call {
            StageCall::Embed { tokens, .. } => {
                Reply::tensor(t(vec![tokens.seq_len, tokens.batch, 1]))
            }
            StageCall::Forward { h, .. } => {
                std::thread::sleep(std::time::Duration::from_micros(self.busy_us));
                Reply {
                    tensors: vec![h],
                    scalars: vec![1.0, 1.0, 1.0, 1.0],
                }
            }
            StageCall::Backward { grad, .. } => {
                std::thread::sleep(std::time::Duration::from_micros(3 * self.busy_us));
                Reply::tensor(grad)
            }
            StageCall::Head { h, .. } => Reply {
                tensors: vec![h],
                scalars: vec![0.0, 1.0],
            },
            StageCall::GradStats => Reply {
                tensors: Vec::new(),
                scalars: vec![f64::NAN; 3],
            },
            StageCall::ScaleGrads { .. } => Reply {
                tensors: Vec::new(),
                scalars: vec![0.0],
            },
            _ => Reply::none(),
        })
    }
    fn save(&self) -> Result<Vec<u8>, EngineError> {
        Ok(Vec::new())
    }
    fn load(&mut self, _: &[u8]) -> Result<(), EngineError> {
        Ok(())
    }
    fn param_count(&self) -> u64 {
        0
    }
}

/// A backend of [`EchoStage`]s on one device.
struct EchoBackend {
    layer_busy_us: u64,
}

impl ComputeBackend for EchoBackend {
    fn info(&self) -> nsactor_plugin_api::BackendInfo {
        nsactor_plugin_api::BackendInfo {
            name: "echo".into(),
            version: "0".into(),
            abi_version: nsactor_plugin_api::ABI_VERSION,
            devices: vec!["no compute".into()],
        }
    }
    fn from_host(
        &self,
        _: usize,
        t: &HostTensor,
    ) -> Result<nsactor_plugin_api::DeviceTensor, EngineError> {
        Ok(nsactor_plugin_api::DeviceTensor::new(Shape(
            t.shape.clone(),
        )))
    }
    fn to_host(&self, t: &nsactor_plugin_api::DeviceTensor) -> Result<HostTensor, EngineError> {
        let shape = t.shape();
        Ok(HostTensor {
            data: vec![0.0; shape.iter().product()],
            shape,
        })
    }
    fn to_device(
        &self,
        t: nsactor_plugin_api::DeviceTensor,
        _: usize,
    ) -> Result<nsactor_plugin_api::DeviceTensor, EngineError> {
        Ok(t)
    }
    fn open_stage(&self, _: &StageSpec) -> Result<Box<dyn nsactor_plugin_api::Stage>, EngineError> {
        Ok(Box::new(EchoStage {
            busy_us: self.layer_busy_us,
        }))
    }
}

/// What `nsactor bench pipeline-hop` measured.
#[derive(Debug, Clone)]
pub struct HopTimings {
    pub layers: usize,
    pub stages: usize,
    pub micro_batches: usize,
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
    schedule: crate::config::Schedule,
) -> Result<HopTimings, String> {
    use crate::engine::{StagedModel, StepParams};
    use crate::pipeline::{Pipeline, PipelinePlan};
    let model = format!("[model]\nnum_layers = {layers}\n");
    let backend: Arc<dyn ComputeBackend> = Arc::new(EchoBackend { layer_busy_us });
    let staged = StagedModel::open(backend, &model, 0, OptimizerKind::Adam, None)
        .map_err(|e| e.to_string())?;
    let plan = PipelinePlan::balanced(layers, stages, &[0])?;
    let mut train = crate::config::RunConfig::load(None)
        .map_err(|e| e.to_string())?
        .train;
    train.schedule = schedule;
    let mut p = Pipeline::start(staged, plan, train, None).map_err(|e| e.to_string())?;
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
        p.train_step(&batches, &params).map_err(|e| e.to_string())?;
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(HopTimings {
        layers,
        stages,
        micro_batches,
        step_s: times[times.len() / 2],
        hops: micro_batches * (2 * layers + 3) + 3 * (layers + 1),
    })
}

/// What `nsactor bench recovery` measured.
#[derive(Debug, Clone)]
pub struct RecoveryTimings {
    /// Failure noticed → actors rebuilt, checkpoint verified and loaded, data rewound.
    pub recover_s: f64,
    /// The first step after the rollback.
    pub first_step_s: f64,
    /// A normal step, for comparison.
    pub step_s: f64,
    /// Checkpoint write (parallel shards, fsync) and read + verify throughput, bytes/s.
    pub write_bps: f64,
    pub read_bps: f64,
    pub checkpoint_bytes: u64,
}

/// Trains the tiny config under `dir` with a checkpoint at step 2 and a layer panic in step 3,
/// timing the recovery; then writes and reads back a checkpoint of `synthetic_mb` MB split
/// like the 0.9B model (an edge shard and 20 equal layer shards) to time the disk.
pub fn recovery(dir: &std::path::Path, synthetic_mb: usize) -> Result<RecoveryTimings, String> {
    use crate::engine::StagedModel;
    use crate::pipeline::checkpoint::{self, CheckpointMeta};
    use crate::pipeline::{Pipeline, PipelineError, PipelinePlan};
    let mut cfg = crate::config::RunConfig::load(None).map_err(|e| e.to_string())?;
    cfg.train.out_dir = dir.join("run");
    cfg.train.inject_fault = Some("layer-panic:1:3".into());
    let tok = nsactor_data::Tokenizer::bundled();
    let mut tokens = nsactor_data::MemTokens::default();
    let text = nsactor_data::bundled_corpus();
    nsactor_data::shards::tokenize_text(
        &tok,
        std::path::Path::new("bundled"),
        {
            let mut end = text.len().min(200_000);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            &text[..end]
        },
        "text",
        &mut tokens,
    )
    .map_err(|e| e.to_string())?;
    let sampler = nsactor_data::Sampler::pretrain(
        Arc::new(tokens),
        nsactor_data::Mode::Packed,
        cfg.train.seq_len,
        cfg.train.seed,
    )
    .map_err(|e| e.to_string())?;
    let backend =
        crate::backend::open(crate::backend::default_name(), &[]).map_err(|e| e.to_string())?;
    let staged = StagedModel::open(backend, &cfg.model_toml(), 1, OptimizerKind::Adam, None)
        .map_err(|e| e.to_string())?;
    let plan = PipelinePlan::balanced(staged.num_layers(), 1, &[0])?;
    let mut p = Pipeline::start(staged, plan, cfg.train.clone(), Some(sampler))
        .map_err(|e| e.to_string())?;
    let e = |e: PipelineError| e.to_string();
    p.step().map_err(e)?;
    let t = Instant::now();
    p.step().map_err(e)?;
    let step_s = t.elapsed().as_secs_f64();
    p.checkpoint(&dir.join("run/checkpoints"), 2, String::new(), None)
        .map_err(e)?;
    let recover_s = match p.step() {
        Err(PipelineError::Recovered { seconds, .. }) => seconds,
        other => return Err(format!("expected a recovery, got {other:?}")),
    };
    let t = Instant::now();
    p.step().map_err(e)?;
    let first_step_s = t.elapsed().as_secs_f64();

    // The disk: 1 edge shard (1/60 of the bytes) and 20 layer shards.
    let total = synthetic_mb * 1_000_000;
    let edge = total / 60;
    let layer = (total - edge) / 20;
    let mut shards = vec![vec![0x5au8; edge]];
    shards.extend((0..20).map(|i| vec![i as u8; layer]));
    let bytes: u64 = shards.iter().map(|s| s.len() as u64).sum();
    let root = dir.join("disk");
    let meta = CheckpointMeta {
        step: 1,
        data_cursor: None,
        seed: 0,
        config: String::new(),
        tokenizer_sha256: None,
    };
    let t = Instant::now();
    let written = checkpoint::write(&root, &meta, &shards, 1).map_err(|e| e.to_string())?;
    let write_bps = bytes as f64 / t.elapsed().as_secs_f64();
    drop(shards);
    let t = Instant::now();
    checkpoint::read(&written).map_err(|e| e.to_string())?;
    let read_bps = bytes as f64 / t.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&root);
    Ok(RecoveryTimings {
        recover_s,
        first_step_s,
        step_s,
        write_bps,
        read_bps,
        checkpoint_bytes: bytes,
    })
}

/// One concurrency level of `nsactor bench serve`.
#[derive(Debug, Clone)]
pub struct ServeTimings {
    pub sessions: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    /// Generated tokens over the wall time of the whole batch of requests.
    pub tokens_per_s: f64,
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// `sessions` WebSocket clients on loopback, each generating `tokens` tokens (sampling at
/// temperature 0.8, end tokens ignored) from the server at `addr`; run on the server's runtime.
pub async fn serve_load(
    addr: std::net::SocketAddr,
    sessions: usize,
    tokens: usize,
) -> Result<ServeTimings, String> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let start = Instant::now();
    let clients: Vec<_> = (0..sessions)
        .map(|i| {
            tokio::spawn(async move {
                let tcp = tokio::net::TcpStream::connect(addr)
                    .await
                    .map_err(|e| e.to_string())?;
                tcp.set_nodelay(true).map_err(|e| e.to_string())?;
                let (mut ws, _) = tokio_tungstenite::client_async(format!("ws://{addr}/ws"), tcp)
                    .await
                    .map_err(|e| e.to_string())?;
                let req = serde_json::json!({"type": "generate", "id": "b", "prompt": "Emma was",
                    "max_tokens": tokens, "temperature": 0.8, "seed": i, "ignore_eos": true,
                    "token_ids": true});
                let sent = Instant::now();
                ws.send(Message::Text(req.to_string().into()))
                    .await
                    .map_err(|e| e.to_string())?;
                let (mut ttft, mut gaps, mut n) = (None, Vec::new(), 0usize);
                let mut last = sent;
                while let Some(m) = ws.next().await {
                    let Ok(Message::Text(t)) = m else { continue };
                    let v: serde_json::Value =
                        serde_json::from_str(&t).map_err(|e| e.to_string())?;
                    match v["type"].as_str() {
                        Some("delta") => {
                            let now = Instant::now();
                            let k = v["token_ids"].as_array().map_or(1, |a| a.len().max(1));
                            if ttft.is_none() {
                                ttft = Some((now - sent).as_secs_f64());
                            } else {
                                let gap = (now - last).as_secs_f64() / k as f64;
                                gaps.extend(std::iter::repeat_n(gap, k));
                            }
                            n += k;
                            last = now;
                        }
                        Some("done") => break,
                        _ => return Err(format!("server: {v}")),
                    }
                }
                Ok::<_, String>((ttft.unwrap_or(f64::NAN), gaps, n))
            })
        })
        .collect();
    let (mut ttfts, mut gaps, mut total) = (Vec::new(), Vec::new(), 0usize);
    for c in clients {
        let (t, g, n) = c.await.map_err(|e| e.to_string())??;
        ttfts.push(t);
        gaps.extend(g);
        total += n;
    }
    let wall = start.elapsed().as_secs_f64();
    Ok(ServeTimings {
        sessions,
        ttft_p50_ms: pct(&mut ttfts, 0.5) * 1e3,
        ttft_p99_ms: pct(&mut ttfts, 0.99) * 1e3,
        itl_p50_ms: pct(&mut gaps, 0.5) * 1e3,
        itl_p99_ms: pct(&mut gaps, 0.99) * 1e3,
        tokens_per_s: total as f64 / wall,
    })
}

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
}

/// `sessions` concurrent greedy decoding sessions straight on the pipeline's decoder (no
/// network), each feeding `prompt` and then generating `tokens` tokens, end tokens ignored.
/// Run on the pipeline's runtime.
pub async fn generate_load(
    decoder: &crate::pipeline::AsyncDecoder,
    sessions: usize,
    prompt: &[i64],
    tokens: usize,
) -> Result<GenerateTimings, String> {
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
                    let mut logits = d.feed(s, prompt).await.map_err(|e| e.to_string())?;
                    let prefilled = Instant::now();
                    let mut steps = Vec::with_capacity(tokens);
                    for _ in 1..tokens {
                        let next = crate::engine::argmax(&logits) as i64;
                        let t = Instant::now();
                        logits = d.feed(s, vec![next]).await.map_err(|e| e.to_string())?;
                        steps.push(t.elapsed().as_secs_f64());
                    }
                    Ok::<_, String>(((prefilled - t0).as_secs_f64(), prefilled, steps))
                }
                .await;
                d.close(s).await;
                r.map(|(p, at, steps)| (p, at, steps, Instant::now()))
            })
        })
        .collect();
    let (mut prefills, mut steps) = (Vec::new(), Vec::new());
    let (mut last_prefill, mut end) = (start, start);
    for r in runs {
        let (p, at, s, done) = r.await.map_err(|e| e.to_string())??;
        prefills.push(p);
        steps.extend(s);
        last_prefill = last_prefill.max(at);
        end = end.max(done);
    }
    let wall = (end - start).as_secs_f64();
    let (c1, n1) = decoder.batch_counts();
    Ok(GenerateTimings {
        sessions,
        prefill_p50_ms: pct(&mut prefills, 0.5) * 1e3,
        step_p50_ms: pct(&mut steps, 0.5) * 1e3,
        step_p99_ms: pct(&mut steps, 0.99) * 1e3,
        tokens_per_s: (sessions * tokens) as f64 / wall,
        decode_tokens_per_s: (sessions * (tokens - 1)) as f64
            / (end - last_prefill).as_secs_f64().max(1e-9),
        mean_cohort: (n1 - n0) as f64 / (c1 - c0).max(1) as f64,
    })
}

/// An integer of the `[model]` table, as f64.
fn model_int(model: &toml::Table, k: &str) -> Result<f64, String> {
    model
        .get(k)
        .and_then(|v| v.as_integer())
        .map(|v| v as f64)
        .ok_or_else(|| format!("[model] has no integer `{k}`"))
}

/// Projection multiply-adds of one layer for one frame, from the `[model]` table: the SNNBlock's
/// four `D → D·N` input projections (W_in, W_β, W_α, W_th), W_gate and W_skip (`D → D`) and
/// W_out (`D·N → D`), the FFN's merged gate+up (`D → 2·D_ff`) and down (`D_ff → D`).
pub fn layer_macs_per_frame(model: &toml::Table) -> Result<f64, String> {
    let get = |k| model_int(model, k);
    let (d, n, dff) = (get("D")?, get("N")?, get("D_ff")?);
    let dn = d * n;
    Ok(4.0 * d * dn + 2.0 * d * d + dn * d + d * 2.0 * dff + dff * d)
}

/// Training FLOPs per token: every layer's projections run forward and twice in the backward
/// (`∂x`, `∂W`) for each of the `K` frames, plus the tied head's forward and backward (the
/// model's FLOPs, what MFU counts); with `recomputed` of the layers running their forward again
/// in the backward (activation checkpointing), what the device executes.
pub fn train_flops_per_token(model: &toml::Table, recomputed: usize) -> Result<f64, String> {
    let get = |k| model_int(model, k);
    let (k, l, d, v) = (get("K")?, get("num_layers")?, get("D")?, get("vocab_size")?);
    let passes = 6.0 * l + 2.0 * recomputed as f64;
    Ok(passes * k * layer_macs_per_frame(model)? + 6.0 * d * v)
}

/// One timed training step of `nsactor bench train`.
#[derive(Debug, Clone)]
pub struct TrainStepTiming {
    pub seconds: f64,
    pub loss: f64,
    /// Per worker (edge, then stages): seconds spent in stage calls during this step.
    pub busy: Vec<f64>,
    /// Per worker: of `busy`, seconds spent issuing the moves of its inputs from another device.
    pub transfer: Vec<f64>,
    /// Per device: where this step's device time went (empty where not measured).
    pub device: Vec<DeviceTime>,
}

/// What `nsactor bench train` measured.
#[derive(Debug, Clone)]
pub struct TrainBench {
    pub tokens_per_step: usize,
    pub warmup: Vec<TrainStepTiming>,
    pub steps: Vec<TrainStepTiming>,
    /// Worker names, in the order of [`TrainStepTiming::busy`].
    pub workers: Vec<String>,
    /// Why the device-time breakdown is missing, where it is.
    pub device_note: Option<String>,
}

impl TrainBench {
    /// Median step time of the timed steps.
    pub fn median_step_s(&self) -> f64 {
        let mut t: Vec<f64> = self.steps.iter().map(|s| s.seconds).collect();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    }

    pub fn tokens_per_s(&self) -> f64 {
        self.tokens_per_step as f64 / self.median_step_s()
    }

    /// Mean busy seconds per timed step of each worker.
    pub fn mean_busy(&self) -> Vec<f64> {
        self.mean_per_worker(|s| &s.busy)
    }

    /// Mean transfer seconds per timed step of each worker.
    pub fn mean_transfer(&self) -> Vec<f64> {
        self.mean_per_worker(|s| &s.transfer)
    }

    /// Each device's breakdown summed over the timed steps, divided by their number; empty
    /// where it was not measured.
    pub fn mean_device(&self) -> Vec<DeviceTime> {
        let mut sum: Vec<DeviceTime> = Vec::new();
        for s in &self.steps {
            for d in &s.device {
                match sum.iter_mut().find(|x| x.device == d.device) {
                    Some(x) => x.add(d),
                    None => sum.push(*d),
                }
            }
        }
        let n = self.steps.len().max(1) as f64;
        sum.iter_mut().for_each(|d| d.scale(1.0 / n));
        sum
    }

    fn mean_per_worker(&self, field: impl Fn(&TrainStepTiming) -> &Vec<f64>) -> Vec<f64> {
        (0..self.workers.len())
            .map(|w| self.steps.iter().map(|s| field(s)[w]).sum::<f64>() / self.steps.len() as f64)
            .collect()
    }
}

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
    pipeline: &mut crate::pipeline::Pipeline,
    train: &crate::config::TrainConfig,
    vocab: usize,
    warmup: usize,
    steps: usize,
    mut timing: Option<&dyn nsactor_plugin_api::ComputeBackend>,
) -> Result<TrainBench, String> {
    use crate::engine::StepParams;
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
    for i in 0..warmup + steps {
        let batches = synthetic_batches(
            train.batch_size,
            train.seq_len,
            train.accumulation,
            vocab,
            train.seed + i as u64,
        );
        let busy_now = |p: &crate::pipeline::Pipeline| -> Vec<f64> {
            p.busy().into_iter().map(|(_, s, _)| s).collect()
        };
        let delta = |now: Vec<f64>, before: Vec<f64>| -> Vec<f64> {
            now.into_iter().zip(before).map(|(n, b)| n - b).collect()
        };
        let (before, before_t) = (busy_now(pipeline), pipeline.transfers());
        // The device-time window brackets the timed steps only (it waits for the device first).
        let timed = i >= warmup && timing.is_some();
        if timed && let Some(Err(e)) = timing.map(|c| c.bench("timing", "start")) {
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
            device = c
                .bench("timing", "report")
                .map_err(|e| e.to_string())
                .and_then(|r| DeviceTime::parse_report(&r))
                .map_err(|e| format!("step {i}: device timing: {e}"))?;
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
        if i < warmup {
            out.warmup.push(record);
        } else {
            out.steps.push(record);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_per_token_of_the_0_9b_config() {
        let cfg = crate::config::RunConfig::from_str(
            include_str!("../../configs/neuronspark-0.9b.toml"),
            "0.9b",
        )
        .unwrap();
        // 4·896·7168 + 2·896² + 7168·896 + 896·5376 + 2688·896 multiply-adds per frame and layer.
        assert_eq!(layer_macs_per_frame(&cfg.model).unwrap(), 40_943_616.0);
        // × 8 (fwd, recompute, 2 × bwd) × 16 frames × 20 layers, + 6 · 896 · 6144 for the head.
        assert_eq!(
            train_flops_per_token(&cfg.model, 20).unwrap(),
            8.0 * 16.0 * 20.0 * 40_943_616.0 + 6.0 * 896.0 * 6144.0
        );
        // The model's FLOPs (no recompute), and 6 layers keeping their graphs.
        assert_eq!(
            train_flops_per_token(&cfg.model, 0).unwrap(),
            6.0 * 16.0 * 20.0 * 40_943_616.0 + 6.0 * 896.0 * 6144.0
        );
        assert_eq!(
            train_flops_per_token(&cfg.model, 14).unwrap(),
            (6.0 * 20.0 + 2.0 * 14.0) * 16.0 * 40_943_616.0 + 6.0 * 896.0 * 6144.0
        );
    }

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
        use nsactor_plugin_api::timing::SpanKind::*;
        let step = |gemm_end: f64, dev: Vec<usize>| TrainStepTiming {
            seconds: 1.0,
            loss: 0.0,
            busy: vec![0.0],
            transfer: vec![0.0],
            device: dev
                .into_iter()
                .map(|d| DeviceTime::from_spans(d, 1.0, &[(Call, 0.0, 0.5), (Gemm, 0.0, gemm_end)]))
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
        r.steps.iter_mut().for_each(|s| s.device.clear());
        assert!(r.mean_device().is_empty());
    }
}
