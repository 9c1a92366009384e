//! `nsactor plot`: draws a run's training curves again from its `metrics.jsonl` (a run still
//! going, one stopped early, or one whose picture is wanted elsewhere).

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct PlotArgs {
    /// The run directory (it holds `metrics.jsonl`).
    run: PathBuf,
    /// Where to write the picture (default: `RUN/loss.png`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The title above the panels (default: the run directory).
    #[arg(long)]
    title: Option<String>,
}

pub fn run(a: PlotArgs) -> crate::result::CliResult {
    let metrics = a.run.join("metrics.jsonl");
    let out = a.out.unwrap_or_else(|| a.run.join("loss.png"));
    // The picture is a PNG; a name that says otherwise (or the metrics file itself, which
    // the run's history would be lost to) is refused before anything is written.
    let png = out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if !png {
        return Err(Box::new(crate::result::Refused(format!(
            "--out {}: the picture is a PNG; name it `….png`",
            out.display()
        ))));
    }
    if !metrics.is_file() {
        return Err(crate::result::refuse(format!(
            "{} has no `metrics.jsonl`: give the directory of a training run",
            a.run.display()
        )));
    }
    let title = a.title.unwrap_or_else(|| a.run.display().to_string());
    nsactor_training::history::draw(&metrics, &out, title)?;
    println!("{}", out.display());
    Ok(())
}
