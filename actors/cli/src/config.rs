//! `nsactor config`: the run configuration as every command sees it after its layers.

use nsactor_engine::config::{EnvLayer, RunConfig};
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum ConfigCommand {
    /// Print the merged configuration as TOML: the defaults, then the file (`--config`, or the
    /// embedded tiny config), then the `NSACTOR_TABLE__KEY` environment variables.
    /// Command-line flags of the other commands come on top of this.
    Show(ShowArgs),
}

#[derive(clap::Args)]
pub struct ShowArgs {
    /// TOML run configuration (default: the embedded `configs/tiny.toml`).
    #[arg(long)]
    config: Option<PathBuf>,
}

pub fn run(c: ConfigCommand) -> crate::result::CliResult {
    match c {
        ConfigCommand::Show(a) => show(a),
    }
}

fn show(a: ShowArgs) -> crate::result::CliResult {
    let env = EnvLayer::from_env();
    let cfg = RunConfig::load_with(a.config.as_deref(), &env)?;
    let file = a.config.as_ref().map_or_else(
        || "the embedded configs/tiny.toml".to_string(),
        |p| p.display().to_string(),
    );
    println!("# nsactor configuration: defaults ← {file}");
    for name in env.names() {
        println!("# ← ${name}");
    }
    print!("{}", cfg.to_toml());
    Ok(())
}
