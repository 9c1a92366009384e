//! `nsactor bench cluster`: what a step pays for crossing processes. Two ranks of this binary
//! join a world over loopback (the real `ractor_cluster` connection, authenticated); rank 1
//! plays a data-parallel rank's part of a reduction and rank 0 the root's, and the benchmark
//! times:
//! - the control plane: a step's results exchange (a rank's micro-batch losses to rank 0 and
//!   the whole step's back), a round trip of small packets;
//! - the transport: one layer's gradients to rank 0 and its sum back, at the tiny config's
//!   and the 0.9B config's layer sizes (every projection weight of one layer, f32), and what
//!   that makes per step (every layer and the edge, one after another).

use crate::bench::stats::pct;
use crate::result::CliResult;
use nsactor_cluster::{Body, Kind, MicroResult, Peers, WirePart, World};
use nsactor_engine::config::RunConfig;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct ClusterBenchArgs {
    /// Round trips of each gradient size.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Results exchanges timed.
    #[arg(long, default_value_t = 200)]
    exchanges: usize,
}

/// (label, layer gradient values, edge gradient values, layers) of a config.
fn shapes() -> Result<Vec<(&'static str, usize, usize, usize)>, crate::result::CliError> {
    let mut out = Vec::new();
    for (label, text) in [
        ("tiny", include_str!("../../../../configs/tiny.toml")),
        (
            "0.9B",
            include_str!("../../../../configs/neuronspark-0.9b.toml"),
        ),
    ] {
        let m = RunConfig::from_str(text, label)?.model;
        let layer = super::flops::layer_macs_per_frame(&m) as usize;
        out.push((label, layer, m.d * m.vocab_size, m.num_layers));
    }
    Ok(out)
}

fn world(rank: usize, port: u16, secret: &str) -> World {
    World {
        rank,
        size: 2,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        secret: secret.into(),
        timeout: Duration::from_secs(600),
        rendezvous_timeout: Duration::from_secs(60),
        restart: 0,
    }
}

fn part(n: usize) -> WirePart {
    WirePart {
        stream: 0,
        index: 0,
        mask: vec![u32::MAX],
        values: (0..n).map(|i| (i % 977) as f32 * 1e-3).collect(),
    }
}

fn results(n: usize) -> Body {
    Body::Results {
        failed: None,
        micro: (0..n as u64)
            .map(|index| MicroResult {
                index,
                ce: 2.5,
                ponder_sum: 30.0,
                ponder_min: 1.0,
                ponder_max: 4.0,
            })
            .collect(),
    }
}

pub fn run(a: ClusterBenchArgs) -> CliResult {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let shapes = shapes()?;
    // Rank 1: this binary again, told so by its environment.
    if let Some(w) = World::from_env()? {
        return rt.block_on(rank_one(w, &shapes, &a));
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let secret = nsactor_cluster::world::new_secret()?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["bench", "cluster", "--repeats", &a.repeats.to_string()])
        .args(["--exchanges", &a.exchanges.to_string()])
        .envs(world(1, port, &secret).vars())
        .spawn()?;
    let r = rt.block_on(rank_zero(world(0, port, &secret), &shapes, &a));
    let status = child.wait()?;
    r?;
    if !status.success() {
        return Err(format!("rank 1 of the benchmark {status}").into());
    }
    Ok(())
}

async fn rank_one(
    w: World,
    shapes: &[(&str, usize, usize, usize)],
    a: &ClusterBenchArgs,
) -> CliResult {
    let peers = Peers::join(w).await?;
    peers.agree(0, 0).await?;
    // Answers what rank 0 sends: results with its own, a gradient part with it back (the sum
    // of a reduction of one).
    for i in 0..a.exchanges as u64 {
        peers.recv(0, Kind::Results).await?;
        peers.send(0, i, 0, results(2))?;
    }
    let parts = shapes.len() * 2 * a.repeats;
    for _ in 0..parts {
        let p = peers.recv(0, Kind::Grads(1)).await?;
        let Body::Part(w) = p.body else {
            return Err("rank 0 sent no gradient part".into());
        };
        peers.send(0, 0, 1, Body::Part(w))?;
    }
    peers.finish().await?;
    Ok(())
}

async fn rank_zero(
    w: World,
    shapes: &[(&str, usize, usize, usize)],
    a: &ClusterBenchArgs,
) -> CliResult {
    let t = Instant::now();
    let peers = Peers::join(w).await?;
    peers.agree(0, 0).await?;
    println!(
        "two ranks over loopback ({} cores): joined and agreed in {:.2} s",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        t.elapsed().as_secs_f64()
    );
    let mut times = Vec::with_capacity(a.exchanges);
    for i in 0..a.exchanges as u64 {
        let t = Instant::now();
        peers.send(1, i, 0, results(4))?;
        peers.recv(1, Kind::Results).await?;
        times.push(t.elapsed().as_secs_f64());
    }
    println!(
        "control plane: a step's results exchange (4 micro-batches) round trip p50 {:.1} µs, \
         p99 {:.1} µs ({} exchanges)",
        pct(&mut times, 0.5) * 1e6,
        pct(&mut times, 0.99) * 1e6,
        a.exchanges
    );
    for &(label, layer, edge, layers) in shapes {
        let mut per = Vec::new();
        for (what, n) in [("a layer", layer), ("the edge", edge)] {
            let p = part(n);
            let mut rt = Vec::with_capacity(a.repeats);
            for _ in 0..a.repeats {
                let t = Instant::now();
                peers.send(1, 0, 1, Body::Part(p.clone()))?;
                peers.recv(1, Kind::Grads(1)).await?;
                rt.push(t.elapsed().as_secs_f64());
            }
            let s = pct(&mut rt, 0.5);
            println!(
                "transport, {label} {what}: {:.2} M values ({:.1} MB f32) there and back in \
                 p50 {:.2} ms ({:.2} GB/s)",
                n as f64 / 1e6,
                n as f64 * 4e-6,
                s * 1e3,
                n as f64 * 8.0 / s / 1e9
            );
            per.push(s);
        }
        println!(
            "transport, {label} per step (one rank beside rank 0; {layers} layers and the edge, \
             one after another): {:.3} s",
            per[0] * layers as f64 + per[1]
        );
    }
    peers.finish().await?;
    Ok(())
}
