//! `nsactor export` and `nsactor import`: Hugging Face directories in and out.

use nsactor_engine::backend;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ExportArgs {
    /// A checkpoint directory, a checkpoints root or a run directory (its newest valid
    /// checkpoint is used).
    #[arg(long)]
    checkpoint: PathBuf,
    #[arg(long, default_value = "hf", value_parser = ["hf"])]
    format: String,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// The run's tokenizer.json (default: the one in the checkpoint's config).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct ImportArgs {
    /// A Hugging Face NeuronSpark directory, or a Hub name `owner/name[@revision]` (fetched
    /// into the Hub cache; an existing path wins).
    #[arg(long, value_name = "DIR|OWNER/NAME")]
    from: String,
    /// Revision of a Hub model: a branch, tag or commit (default `main`).
    #[arg(long, value_name = "REV")]
    revision: Option<String>,
    #[arg(long, default_value = "hf", value_parser = ["hf"])]
    format: String,
    /// The run directory to create.
    #[arg(long)]
    out: PathBuf,
    /// Backend that opens the stages to write the checkpoint.
    #[arg(long, default_value = backend::EMBEDDED)]
    backend: String,
}

/// An error when `out` holds a training run or a checkpoint, which writing there would
/// damage (an export or import into a folder of its own kind is a re-export: allowed).
fn not_a_run(out: &std::path::Path, flag: &str) -> crate::result::CliResult {
    let held = [
        "manifest.json",
        "checkpoints",
        "metrics.jsonl",
        "data_cursor.json",
    ]
    .into_iter()
    .find(|name| out.join(name).exists());
    match held {
        Some(name) => Err(crate::result::refuse(format!(
            "{flag} {} holds a training run or checkpoint (its `{name}`), which this would \
             overwrite: write to a folder of its own",
            out.display()
        ))),
        None => Ok(()),
    }
}

/// `nsactor export`.
pub fn export(a: ExportArgs) -> crate::result::CliResult {
    not_a_run(&a.out, "--out")?;
    let dir = nsactor_checkpoint::export::export_hf(&a.checkpoint, &a.out, a.tokenizer.as_deref())?;
    println!("exported {} to {}", dir.display(), a.out.display());
    Ok(())
}

/// `nsactor import`.
pub fn import(a: ImportArgs) -> crate::result::CliResult {
    not_a_run(&a.out, "--out")?;
    let compute = backend::open(&a.backend, &[])?;
    let from = nsactor_checkpoint::hub::resolve(&a.from, a.revision.as_deref())?;
    let dir = nsactor_checkpoint::export::import_hf(&from.path, &a.out, compute)?;
    println!(
        "imported {} as {}; continue with: nsactor train --config {} --resume",
        a.from,
        dir.display(),
        a.out.join("config.toml").display()
    );
    Ok(())
}
