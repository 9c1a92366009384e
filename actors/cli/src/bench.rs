//! `nsactor bench …`: programs that print a figure, the device and the comparison it is about.

mod breakdown;
mod checkpoint;
mod cluster;
mod detok;
mod echo;
mod flops;
mod generate;
mod heal;
mod hop;
mod host;
mod kernels;
mod long;
mod open;
mod overhead;
mod prefill;
mod prepare;
mod recovery;
mod serve;
mod sse;
mod stats;
mod steps;
mod train;
mod turns;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Per-call cost of the plugin boundary: the same calls through a loaded plugin and through
    /// the embedded engine.
    PluginOverhead(overhead::OverheadArgs),
    /// Cost of one actor-pipeline hop (message + worker handoff, no compute) and its share of a
    /// 0.9B layer's compute per micro-batch.
    PipelineHop(hop::HopArgs),
    /// In-process recovery time on the tiny model, checkpoint write/read bandwidth of this
    /// disk, and what they project for the 0.9B model.
    Recovery(recovery::RecoveryArgs),
    /// How long a server's decoding is away after it loses a stage (a layer panics): the
    /// rebuild from the checkpoint on disk by phase, and the first pass after it.
    Heal(heal::HealArgs),
    /// Streaming server under load: time to first token, inter-token latency p50/p99 and
    /// aggregate tokens/s at several numbers of concurrent WebSocket sessions.
    Serve(serve::ServeBenchArgs),
    /// The backend's PLIF scan kernels: each checked against the host reference (a wrong kernel
    /// is not timed), then its GB/s at the 0.9B shapes against the device's elementwise-copy
    /// bandwidth.
    Kernels(kernels::KernelsArgs),
    /// Training throughput of a config on a backend: synthetic batches of the config's shape
    /// through the actor pipeline; tokens/s, step time, model TFLOP/s and MFU, per-stage busy
    /// time, device memory.
    Train(train::TrainBenchArgs),
    /// A training run's checkpoint by part: the snapshot, the stages read back, the write as a
    /// run does it (synchronous and beside training steps, with their slowdown), the final
    /// checkpoint with the weights, and the disk's own write rate on the same bytes.
    Checkpoint(checkpoint::CheckpointBenchArgs),
    /// Greedy decoding throughput: concurrent sessions straight on the pipeline's batched
    /// decoder (no network); prefill time, per-step latency p50/p99, aggregate tokens/s and the
    /// weight-streaming ceiling.
    Generate(generate::GenerateBenchArgs),
    /// Prompts through the real server on loopback: one client's time to first token at
    /// several prompt lengths and concurrent prompts' prompt tokens/s against the compute
    /// ceiling, a scored prompt (echo) beside its prefill, and the device memory after a short
    /// and a long prompt.
    Prefill(prefill::PrefillBenchArgs),
    /// One decoder layer's decoding pass on the backend's device without actors (a step, or a
    /// prompt pass with `--options tokens=T`): the whole pass, its parts, its GEMMs alone, and
    /// the launch-overhead and GEMM probes that bound it.
    DecodeProfile(generate::DecodeProfileArgs),
    /// What crossing processes costs: two ranks over loopback; a step's results exchange
    /// (control plane) and one layer's gradients there and back (transport) at the tiny and
    /// 0.9B layer sizes, and the per-step total.
    Cluster(cluster::ClusterBenchArgs),
    /// The server's text per generated token: a window of recent tokens decoded
    /// (incremental detokenizing) against the whole generation decoded again each time.
    Detokenize(detok::DetokArgs),
    /// The host's work for a request that could grow with its prompt: encoding a ChatML
    /// prompt (the fast path against the full pipeline) and a decoding step's pick block for
    /// a cohort of sessions, with the penalties off and on.
    Host(host::HostArgs),
    /// `nsactor data prepare` on a generated folder of Parquet shards (1 GB by default): MB/s
    /// of Parquet and of text, tokens/s and the ratio to the 50 MB/s target, on this machine's
    /// cores.
    Prepare(prepare::PrepareBenchArgs),
}

/// Runs a `bench` subcommand.
pub fn run(c: BenchCommand) -> crate::result::CliResult {
    match c {
        BenchCommand::PluginOverhead(a) => overhead::run(a),
        BenchCommand::PipelineHop(a) => hop::run(a),
        BenchCommand::Recovery(a) => recovery::run(a),
        BenchCommand::Heal(a) => heal::run(a),
        BenchCommand::Serve(a) => serve::run(a),
        BenchCommand::Kernels(a) => kernels::run(a),
        BenchCommand::Train(a) => train::run(a),
        BenchCommand::Checkpoint(a) => checkpoint::run(a),
        BenchCommand::Generate(a) => generate::run(a),
        BenchCommand::DecodeProfile(a) => generate::decode_profile_cmd(a),
        BenchCommand::Prefill(a) => prefill::run(a),
        BenchCommand::Cluster(a) => cluster::run(a),
        BenchCommand::Detokenize(a) => detok::run(a),
        BenchCommand::Host(a) => host::run(a),
        BenchCommand::Prepare(a) => prepare::run(a),
    }
}
