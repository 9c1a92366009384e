//! `nsactor bench serve`: TTFT, inter-token latency and tokens/s through the real server on loopback.

use super::long::LongPrompt;
use super::stats::ServeTimings;
use crate::result::{CliError, CliResult};
use nsactor_launch::launch::{self};
use std::path::PathBuf;
use std::time::Instant;

const GIB: f64 = (1u64 << 30) as f64;

/// `n` requests of one client, one after another (16 tokens each), right after the server is
/// ready: the first one's TTFT and time per token beside the others' median and the last's.
async fn after_ready(addr: std::net::SocketAddr, n: usize, temperature: f32) -> CliResult {
    let mut runs = Vec::with_capacity(n);
    for _ in 0..n {
        let t = serve_load(addr, 1, 16, temperature).await?;
        runs.push((t.ttft_p50_ms, t.itl_p50_ms));
    }
    let median = |f: fn(&(f64, f64)) -> f64| {
        let mut v: Vec<f64> = runs[1..].iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let (first, last) = (runs[0], runs[n - 1]);
    println!(
        "after ready, {n} requests of one client one after another: TTFT first {:.1} ms, median of the others {:.1} ms, last {:.1} ms; ITL p50 first {:.2} ms, others {:.2} ms, last {:.2} ms",
        first.0,
        median(|r| r.0),
        last.0,
        first.1,
        median(|r| r.1),
        last.1
    );
    Ok(())
}

/// `sessions` WebSocket clients on loopback, each generating `tokens` tokens (at `temperature`,
/// client i with seed i; 0 is greedy; end tokens ignored) from the server at `addr`; run on the
/// server's runtime.
pub async fn serve_load(
    addr: std::net::SocketAddr,
    sessions: usize,
    tokens: usize,
    temperature: f32,
) -> CliResult<ServeTimings> {
    serve_load_with(addr, sessions, tokens, temperature, None).await
}

/// [`serve_load`], and with `long = Some((n, after))` one more client that sends an `n`-token
/// prompt `after` into the run (for 4 tokens; its own figures are left out): the others'
/// inter-token gaps show what its prefill costs them.
pub async fn serve_load_with(
    addr: std::net::SocketAddr,
    sessions: usize,
    tokens: usize,
    temperature: f32,
    long: Option<(usize, std::time::Duration)>,
) -> CliResult<ServeTimings> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let extra = usize::from(long.is_some());
    // Every client connects first; the clock starts when all are connected and they send
    // together, so the figures are those of `sessions` concurrent streams, not of the ramp
    // of connections and handshakes (which share the server's runtime here).
    let ready = std::sync::Arc::new(tokio::sync::Barrier::new(sessions + 1));
    let clients: Vec<_> = (0..sessions + extra)
        .map(|i| {
            let ready = ready.clone();
            tokio::spawn(async move {
                let long = long.filter(|_| i == sessions);
                if let Some((_, after)) = long {
                    tokio::time::sleep(after).await;
                }
                let connect = async {
                    let tcp = tokio::net::TcpStream::connect(addr).await?;
                    tcp.set_nodelay(true)?;
                    let (ws, _) =
                        tokio_tungstenite::client_async(format!("ws://{addr}/ws"), tcp).await?;
                    Ok::<_, CliError>(ws)
                };
                let ws = connect.await;
                if long.is_none() {
                    ready.wait().await;
                }
                let mut ws = ws?;
                let req = match long {
                    Some((n, _)) => super::long::request(n),
                    None => serde_json::json!({"type": "generate", "id": "b", "prompt": "Emma was",
                        "max_tokens": tokens, "temperature": temperature, "seed": i,
                        "ignore_eos": true, "token_ids": true}),
                };
                let sent = Instant::now();
                ws.send(Message::Text(req.to_string().into())).await?;
                let (mut ttft, mut gaps) = (None, Vec::new());
                let mut got = super::long::Generated::default();
                let mut last = sent;
                while let Some(m) = ws.next().await {
                    let Ok(Message::Text(t)) = m else { continue };
                    let v: serde_json::Value = serde_json::from_str(&t)?;
                    match v["type"].as_str() {
                        Some("delta") => {
                            let now = Instant::now();
                            let k = got.take(&v).max(1);
                            if ttft.is_none() {
                                ttft = Some((now - sent).as_secs_f64());
                            } else {
                                let gap = (now - last).as_secs_f64() / k as f64;
                                gaps.extend(std::iter::repeat_n(gap, k));
                            }
                            last = now;
                        }
                        Some("done") => break,
                        _ => return Err(format!("server: {v}").into()),
                    }
                }
                Ok::<_, CliError>((ttft.unwrap_or(f64::NAN), gaps, got))
            })
        })
        .collect();
    ready.wait().await;
    let start = Instant::now();
    let (mut ttfts, mut gaps, mut total) = (Vec::new(), Vec::new(), 0usize);
    let mut texts = std::collections::HashSet::new();
    let mut long_out = None;
    for (i, c) in clients.into_iter().enumerate() {
        let (t, g, got) = c.await??;
        if i == sessions {
            long_out = Some(LongPrompt {
                ttft_ms: t * 1e3,
                got,
            });
            continue;
        }
        let ids = got.ids;
        ttfts.push(t);
        gaps.extend(g);
        total += ids.len();
        texts.insert(ids);
    }
    let wall = start.elapsed().as_secs_f64();
    let mut t = ServeTimings::of(sessions, ttfts, gaps, total, texts.len(), wall);
    t.long = long_out;
    Ok(t)
}

/// The model a serving benchmark serves.
#[derive(clap::Args)]
pub struct ServedModel {
    /// Checkpoint to serve (default: a fresh model of --config).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Run config of the fresh model (default: the embedded tiny one).
    #[arg(long, conflicts_with = "checkpoint")]
    config: Option<PathBuf>,
    /// Projection GEMM arithmetic of the fresh model: fp32 or bf16 (CUDA).
    #[arg(long, value_parser = ["fp32", "bf16"])]
    pub precision: Option<String>,
    /// Backend (with --checkpoint: default the run's).
    #[arg(long)]
    backend: Option<String>,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1)]
    pub pipeline: usize,
}

#[derive(clap::Args)]
pub struct ServeBenchArgs {
    #[command(flatten)]
    model: ServedModel,
    #[command(flatten)]
    passes: crate::serve::PassArgs,
    /// Sampling temperature of every client (0: greedy, and the clients should all agree).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Client protocols to measure at each concurrency: `ws` (the WebSocket) and `sse`
    /// (`/v1/completions` streamed as Server-Sent Events).
    #[arg(long, value_delimiter = ',', value_parser = ["ws", "sse"], default_value = "ws,sse")]
    protocol: Vec<String>,
    /// Concurrent sessions to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    sessions: Vec<usize>,
    /// Tokens each session generates.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Cohort sizes the server pads to and warms up (as `nsactor serve --cohort-buckets`).
    #[arg(long, default_value = "ladder", value_name = "SIZES")]
    cohort_buckets: String,
    /// Skip the server's warm-up (as `nsactor serve --no-warmup`): the requests after ready
    /// meet a cold server, and each concurrency level then gets a short unmeasured run first.
    #[arg(long)]
    no_warmup: bool,
    /// Requests one client sends one after another right after the server is ready (each
    /// 16 tokens): the first one's figures against the rest's.
    #[arg(long, default_value_t = 100)]
    after_ready: usize,
    /// At each concurrency, one more WebSocket run during which another client sends a prompt
    /// of this many tokens (row `ws+long`: the others' inter-token gaps while it is prefilled;
    /// 0: none).
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    long_prompt: usize,
    /// The kinds of pass the warm-up runs at each size besides the prefill: a subset of
    /// `greedy,sampled,long` (for finding what a warm-up changes).
    #[arg(long, default_value = "greedy,sampled,long", value_name = "KINDS")]
    warmup_passes: String,
    /// Worker threads of the server's runtime (as `nsactor serve --http-threads`; 0: the
    /// cores the pipeline and the clients leave, at least 2).
    #[arg(long, default_value_t = 0, value_name = "N")]
    http_threads: usize,
    /// Worker threads of the clients' runtime, apart from the server's (as clients in other
    /// processes would be).
    #[arg(long, default_value_t = 2, value_name = "N")]
    client_threads: usize,
    /// Multi-turn mode: each of --sessions' clients holds a conversation of this many turns
    /// through /v1/chat/completions, answers of --tokens tokens; a row per turn (0: the
    /// decoding table instead).
    #[arg(long, default_value_t = 0, value_name = "N")]
    turns: usize,
    /// Bytes of each user message in --turns mode (English words).
    #[arg(long, default_value_t = 100, value_name = "BYTES")]
    turn_bytes: usize,
    /// Bytes of the system prompt every --turns conversation starts with (shared by them).
    #[arg(long, default_value_t = 0, value_name = "BYTES")]
    system_bytes: usize,
    /// With --turns: a conversation of about this many tokens is answered, its state
    /// exported (`/v1/state/export`) and imported on a second server of the same model with an
    /// empty cache (a restart), and its next turn timed there beside a third server that
    /// prefills it all (0: none).
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    carry: usize,
    #[command(flatten)]
    prefix: crate::serve::PrefixArgs,
}

/// Waits until the last run's sessions are freed (a client has its last event before its
/// session's states are freed), so each run starts on an idle server.
pub(super) async fn idle(d: &nsactor_decoding::AsyncDecoder) {
    while d.open_sessions() > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Bytes in use on every device together, where the backend says (pools keep their peak).
pub(super) fn device_used(b: &dyn nsactor_plugin_api::ComputeBackend) -> Option<u64> {
    crate::capacity::device_memory(b).map(|d| d.iter().map(|&(used, _)| used).sum())
}

/// The model to serve: `--checkpoint`'s, or a fresh one of `--config`.
pub(super) fn load(a: &ServedModel) -> CliResult<launch::Loaded> {
    Ok(match &a.checkpoint {
        Some(c) => launch::load_checkpoint(&launch::CheckpointOptions {
            checkpoint: c.clone(),
            backend: a.backend.clone(),
            pipeline: a.pipeline,
            devices: None,
            tokenizer: None,
            precision: None,
            ..Default::default()
        })?,
        None => launch::load_fresh(
            a.config.as_deref(),
            a.backend.as_deref(),
            a.precision.clone(),
            a.pipeline,
            None,
        )?,
    })
}

/// `NAME (N parameters) on BACKEND VERSION (DEVICES)`: the model and where it runs, as the
/// serving benchmarks' first line says it.
pub(super) fn describe(l: &launch::Loaded) -> String {
    let info = l.pipeline.backend().info();
    format!(
        "{} ({} parameters) on {} {} ({})",
        l.name,
        l.pipeline.param_count(),
        info.name,
        info.version,
        info.devices.join(", ")
    )
}

/// The run's description and the table's header.
fn print_header(a: &ServeBenchArgs, l: &launch::Loaded) {
    println!(
        "serve: {}, pipeline {}; {} tokens per session at temperature {}, on loopback, the clock started once every client has connected; engine: the same load on the decoder, no network",
        describe(l),
        a.model.pipeline,
        a.tokens,
        a.temperature
    );
    println!(
        "{:>9} {:>8} {:>14} {:>14} {:>13} {:>13} {:>16} {:>12} {:>9} {:>6}",
        "sessions",
        "client",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "ITL p50 (ms)",
        "ITL p99 (ms)",
        "tokens/s (all)",
        "mean cohort",
        "distinct",
        "pad %"
    );
}

pub fn run(a: ServeBenchArgs) -> crate::result::CliResult {
    let started = Instant::now();
    let l = load(&a.model)?;
    // The long prompt's client is one more session (else it waits for a place until the
    // others have finished, and their gaps show nothing of its prefill).
    let max = a.sessions.iter().copied().max().unwrap_or(1) + usize::from(a.long_prompt > 0);
    let (buckets, mut plan) = a.passes.warmup_plan(&a.cohort_buckets, max)?;
    plan.passes = nsactor_decoding::warmup::Passes::parse(&a.warmup_passes)?;
    let ready = nsactor_server::ready::Readiness::for_plan(a.no_warmup, &plan);
    let state = nsactor_server::ServerState::new(
        (
            a.passes.apply(l.pipeline.decoder(l.vocab)),
            l.tokenizer.clone(),
            a.prefix.config(),
        ),
        (max, max),
        l.name.clone(),
        Default::default(),
        (Default::default(), ready.clone()),
    );
    print_header(&a, &l);
    let precision = l.config.backend.precision.clone().unwrap_or("fp32".into());
    let ceiling = super::flops::Ceiling::forward(
        &l.config.model,
        None,
        &l.pipeline.backend().info().name,
        precision == "bf16",
    );
    let decoder = state.generator.decoder.clone();
    let cache = state.generator.prefix.clone();
    decoder.set_buckets(buckets.clone());
    // For --carry: two more servers of the same model, their caches empty.
    let spare = |_| -> CliResult<Loopback> {
        let state = nsactor_server::ServerState::new(
            (decoder.clone(), l.tokenizer.clone(), a.prefix.config()),
            (max, max),
            l.name.clone(),
            Default::default(),
            Default::default(),
        );
        Loopback::start(state, 2, 1)
    };
    let spares = (0..2 * usize::from(a.carry > 0))
        .map(spare)
        .collect::<CliResult<Vec<_>>>()?;
    let loopback = Loopback::start(state, a.http_threads, a.client_threads)?;
    let addr = loopback.addr;
    loopback.clients.block_on(async {
        if !a.no_warmup {
            let t = Instant::now();
            ready.warm_up(&decoder, &plan, started).await?;
            println!(
                "warm-up: {} cohort sizes ({buckets}) in {:.1} s; ready {:.1} s after start",
                plan.sizes.len(),
                t.elapsed().as_secs_f64(),
                started.elapsed().as_secs_f64()
            );
        }
        if a.turns > 0 {
            let mut first = 0;
            for &clients in &a.sessions {
                idle(&decoder).await;
                let t = super::turns::Turns {
                    clients,
                    first,
                    turns: a.turns,
                    user_bytes: a.turn_bytes,
                    system_bytes: a.system_bytes,
                    answer_tokens: a.tokens,
                    temperature: a.temperature,
                };
                super::turns::run(addr, t, &cache, &ceiling).await?;
                first += clients;
            }
            if let [b, c] = &spares[..] {
                super::turns::carry([addr, b.addr, c.addr], a.carry, a.tokens).await?;
                // Every session closed (and its snapshot kept) before the servers go.
                idle(&decoder).await;
            }
            return Ok(());
        }
        if a.after_ready > 0 {
            after_ready(addr, a.after_ready, a.temperature).await?;
        }
        if a.no_warmup {
            for &n in &a.sessions {
                serve_load(addr, n, 4, a.temperature).await?;
            }
        }
        let backend = l.pipeline.backend();
        let used0 = device_used(backend.as_ref());
        let mut runs: Vec<&str> = a.protocol.iter().map(String::as_str).collect();
        if a.long_prompt > 0 {
            runs.push("ws+long");
        }
        for &n in &a.sessions {
            for &protocol in &runs {
                protocol_row(&a, addr, &decoder, n, protocol).await?;
            }
            engine_row(&a, &decoder, n, backend.as_ref(), used0).await?;
        }
        Ok::<_, crate::result::CliError>(())
    })
}

/// A server on loopback and its clients, on three runtimes as in a deployment: the
/// pipeline's (the actors), the server's, and the clients' (the load generator).
pub(super) struct Loopback {
    pub addr: std::net::SocketAddr,
    pub clients: tokio::runtime::Runtime,
    /// Kept for the server's tasks.
    _front: tokio::runtime::Runtime,
}

impl Loopback {
    /// Serves `state` on a loopback port with `http_threads` (0: the cores the pipeline and
    /// the clients leave, at least 2) and builds a runtime of `client_threads` for clients.
    pub fn start(
        state: nsactor_server::state::Shared,
        http_threads: usize,
        client_threads: usize,
    ) -> CliResult<Loopback> {
        let client_threads = client_threads.max(1);
        let http_threads = match http_threads {
            0 => nsactor_server::front::front_threads(0)
                .saturating_sub(client_threads)
                .max(2),
            n => n,
        };
        let front = nsactor_server::front::front_runtime(http_threads)?;
        let clients = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(client_threads)
            .thread_name("nsactor-bench-client")
            .enable_all()
            .build()?;
        let listener = front.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        front.spawn(nsactor_server::serve(
            listener,
            state,
            std::future::pending(),
        ));
        println!(
            "runtimes: the server's {http_threads} threads, the clients' {client_threads}, the pipeline's own"
        );
        Ok(Loopback {
            addr,
            clients,
            _front: front,
        })
    }
}

/// One measured run of `n` clients through `protocol` (`ws`, `sse`, or `ws+long`), from an
/// idle server: a row of the table, with the decoder's mean cohort and padding over the run.
async fn protocol_row(
    a: &ServeBenchArgs,
    addr: std::net::SocketAddr,
    decoder: &nsactor_decoding::AsyncDecoder,
    n: usize,
    protocol: &str,
) -> CliResult {
    idle(decoder).await;
    let (c0, n0) = decoder.batch_counts();
    let p0 = decoder.padded_rows();
    let t = match protocol {
        "sse" => super::sse::sse_load(addr, n, a.tokens, a.temperature).await?,
        "ws+long" => {
            let after = std::time::Duration::from_millis(200);
            let long = Some((a.long_prompt, after));
            serve_load_with(addr, n, a.tokens, a.temperature, long).await?
        }
        _ => serve_load(addr, n, a.tokens, a.temperature).await?,
    };
    let (c1, n1) = decoder.batch_counts();
    let pad = (decoder.padded_rows() - p0) as f64;
    println!(
        "{:>9} {:>8} {:>14.1} {:>14.1} {:>13.2} {:>13.2} {:>16.0} {:>12.1} {:>9} {:>6.1}",
        t.sessions,
        protocol,
        t.ttft_p50_ms,
        t.ttft_p99_ms,
        t.itl_p50_ms,
        t.itl_p99_ms,
        t.tokens_per_s,
        (n1 - n0) as f64 / (c1 - c0).max(1) as f64,
        t.distinct,
        100.0 * pad / (pad + (n1 - n0) as f64).max(1.0)
    );
    if let Some(long) = &t.long {
        println!(
            "{:>18} the {}-token prompt's first token after {:.1} ms; chunks beside decoding \
             of at most {} tokens, paced to {:.2} of a step)",
            format!("({protocol}, {n}:"),
            a.long_prompt,
            long.ttft_ms,
            decoder.pacer().max(),
            decoder.pacer().share()
        );
        idle(decoder).await;
        super::long::check_alone(addr, a.long_prompt, long, &format!("({protocol}, {n}:")).await?;
    }
    if let Some(f) = t.first_text_p50_ms {
        println!(
            "{:>18} first chunk with text p50 {f:.1} ms)",
            format!("({protocol}, {n}:")
        );
    }
    Ok(())
}

/// The engine alone under the same load as the rows above it (what the server's path adds
/// shows beside), then the device memory in use against `used0`, after the warm-up.
async fn engine_row(
    a: &ServeBenchArgs,
    decoder: &nsactor_decoding::AsyncDecoder,
    n: usize,
    backend: &dyn nsactor_plugin_api::ComputeBackend,
    used0: Option<u64>,
) -> CliResult {
    // The engine alone under the same load: what the server's path adds shows beside.
    idle(decoder).await;
    let prompt = [1i64, 40, 41];
    let e = super::generate::generate_load(decoder, n, &prompt, a.tokens, true).await?;
    println!(
        "{:>9} {:>8} {:>14.1} {:>14} {:>13.2} {:>13.2} {:>16.0} {:>12.1} {:>9}",
        n,
        "engine",
        e.prefill_p50_ms,
        "",
        e.step_p50_ms,
        e.step_p99_ms,
        e.tokens_per_s,
        e.mean_cohort,
        ""
    );
    if let (Some(u0), Some(u1)) = (used0, device_used(backend)) {
        println!(
            "{:>9} device memory {:.2} GiB after the warm-up, {:.2} GiB now: at most {:.2} MiB per session (pools keep their peak: states and the passes' activations)",
            n,
            u0 as f64 / GIB,
            u1 as f64 / GIB,
            u1.saturating_sub(u0) as f64 / n as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}
