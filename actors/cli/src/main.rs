//! `nsactor`: train and serve NeuronSpark spiking language models.
//!
//! One module per command; each holds its arguments (clap) and its handler, and reaches the
//! model only through the actor-side crates (`nsactor-launch` and the floors below it; `nsactor-server` for serving). Benchmarks and
//! their printing live under [`bench`]; nothing outside this crate imports them.

mod agent;
mod analyze;
mod args;
mod bench;
mod capacity;
mod config;
mod data;
mod eval;
mod export;
mod generate;
mod group;
mod plot;
mod plugins;
mod result;
mod serve;
mod train;
mod verify;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "nsactor",
    version,
    about = "Train and serve NeuronSpark spiking language models"
)]
struct Cli {
    /// Log format on stderr: `human` or `json` (one object per line). Levels and targets come
    /// from $NSACTOR_LOG (tracing filter syntax, e.g. `debug` or `nsactor=debug`).
    #[arg(long, global = true, default_value = "human", value_parser = ["human", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (default: the tiny config on the bundled corpus, on CPU).
    Train(train::TrainArgs),
    /// List the backend plugins on the search path: name, version, ABI version, devices.
    Plugins(plugins::PluginsArgs),
    /// Benchmarks that print a figure, the device and the comparison.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Replay the reference's golden runs on a backend and check the tolerances.
    #[command(subcommand)]
    Verify(verify::VerifyCommand),
    /// The run configuration after its layers (defaults, file, environment).
    #[command(subcommand)]
    Config(config::ConfigCommand),
    /// Tokenizers.
    #[command(subcommand)]
    Tokenizer(data::TokenizerCommand),
    /// Datasets.
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Serve a checkpoint: streaming generation over WebSocket (`/ws`) and OpenAI-style HTTP
    /// (`/v1/completions`, `/v1/chat/completions`), a chat page at `/`.
    Serve(serve::ServeArgs),
    /// Generate from a checkpoint, streaming to stdout; `--chat` for an interactive loop.
    Generate(generate::GenerateArgs),
    /// Held-out loss of a checkpoint: mean cross entropy and perplexity over batches of
    /// prepared shards or corpus files (e.g. the same weights with `--precision fp32` and `bf16`).
    Eval(eval::EvalArgs),
    /// Draw a run's training curves (`loss.png`) again from its `metrics.jsonl`.
    Plot(plot::PlotArgs),
    /// The paper's interpretability study on a checkpoint: E[K] per token, by token category,
    /// per layer and against surprisal, and the learned β; `analysis.json` and charts.
    Analyze(analyze::AnalyzeArgs),
    /// Write a checkpoint as a Hugging Face directory (config.json, model.safetensors with
    /// `model.` names, tokenizer.json).
    Export(export::ExportArgs),
    /// Make a run directory (config.toml, tokenizer.json, a step-0 checkpoint) from a Hugging
    /// Face directory; `nsactor train --config DIR/config.toml --resume` trains on from it.
    Import(export::ImportArgs),
}

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("NSACTOR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,ractor_cluster=warn"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if format == "json" {
        b.json().init();
    } else {
        b.init();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log_format);
    let json = cli.log_format == "json";
    // The commands that print results end quietly when their reader goes (`| head`), as
    // `cat` does, instead of panicking on a broken pipe. (Sockets are written with
    // MSG_NOSIGNAL by std, so a client that hangs up raises no signal; the commands that
    // serve, train or supervise children keep Rust's default of ignoring SIGPIPE.)
    if matches!(
        cli.command,
        Command::Generate(_)
            | Command::Config(_)
            | Command::Analyze(_)
            | Command::Eval(_)
            | Command::Plot(_)
            | Command::Verify(_)
            | Command::Export(_)
            | Command::Import(_)
            | Command::Plugins(_)
            | Command::Tokenizer(_)
            | Command::Data(_)
    ) {
        // SAFETY: restores the default disposition of one signal; nothing handles SIGPIPE.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Command::Train(a) => train::run(a),
        Command::Plugins(a) => plugins::run(a),
        Command::Bench(c) => bench::run(c),
        Command::Verify(c) => verify::run(c),
        Command::Config(c) => config::run(c),
        Command::Tokenizer(c) => data::tokenizer(c),
        Command::Data(c) => data::data(c),
        Command::Serve(a) => serve::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Plot(a) => plot::run(a),
        Command::Analyze(a) => analyze::run(a),
        Command::Export(a) => export::export(a),
        Command::Import(a) => export::import(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let (text, code) = (e.to_string(), result::exit_code(&e));
            if json {
                // The last line is a log object too, for whatever reads the others.
                let line = serde_json::json!({
                    "level": "ERROR",
                    "fields": {"message": text, "exit_code": code, "hint": hint(&text)},
                });
                eprintln!("{line}");
            } else {
                eprintln!("error: {text}");
                if let Some(h) = hint(&text) {
                    eprintln!("hint: {h}");
                }
            }
            ExitCode::from(code)
        }
    }
}

/// What to do about an error whose text says the device ran out of memory (CubeCL's
/// allocator panics with "can't allocate buffer of size N" on its server thread, which the
/// stage reports as a backend panic).
fn hint(error: &str) -> Option<&'static str> {
    (error.contains("can't allocate buffer") || error.contains("out of memory")).then_some(
        "the device ran out of memory: lower [train] batch_size (`bench`: --batch-size) or \
         keep_activations (--keep-activations; at 0.9B and 14 × 511 each kept layer past the \
         first holds ~14 GiB; `auto` keeps what fits under [train] memory_budget_gib), or \
         serve fewer --max-sessions",
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_allocation_failure_gets_a_hint_and_other_errors_none() {
        let oom = "step 0: layer 7: backend panicked: gemm: a queued GEMM panicked: called \
                   `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 9381867520";
        assert!(super::hint(oom).is_some_and(|h| h.contains("--keep-activations")));
        assert!(super::hint("config: unknown key `foo`").is_none());
    }
}
