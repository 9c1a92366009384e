//! `nsactor bench prepare`: `nsactor data prepare` on a generated folder of Parquet shards, the
//! issue's "1 GB of Parquet on two cores at ≥ 50 MB/s". The corpus is English prose with the
//! documents of a web crawl: each a run of 5–60 sentences drawn at random from the bundled books
//! (about 4.5 KB on average, every one different, so a codec finds no more repetition than in
//! real text). By default half the documents carry typographic characters (curly apostrophes,
//! em dashes, an accented word), as web text does; the tokenizer's ASCII fast path declines
//! those (`--non-ascii 0` leaves them out). The files are laid out as `datasets` writes a
//! dataset (`data/train-0000N-of-0000M.parquet`, a `text` column, row groups of a few thousand
//! rows). The timed part is the library call behind `nsactor data prepare`
//! ([`nsactor_data::prepare::prepare`]) on that folder; it prints MB/s of Parquet read and of
//! text, tokens/s, the CPU time, the machine's cores and the ratio to the target.

use crate::result::CliResult;
use nsactor_data::SplitMix64;
use nsactor_data::parquet_docs::StringsWriter;
use nsactor_data::prepare::{self, PrepareOptions};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The target: MB of Parquet files per second.
const TARGET_MB_S: f64 = 50.0;

#[derive(clap::Args)]
pub struct PrepareBenchArgs {
    /// Size of the generated corpus: MB (10⁶ bytes) of Parquet files.
    #[arg(long, default_value_t = 1000.0)]
    pub mb: f64,
    /// Parquet files (shards) the corpus is split into.
    #[arg(long, default_value_t = 4)]
    pub files: usize,
    /// Their codec: snappy (the Hub's usual), zstd, gzip, lz4 or none.
    #[arg(long, default_value = "snappy")]
    pub codec: String,
    /// Rows in a row group.
    #[arg(long, default_value_t = 5_000)]
    pub row_group: usize,
    /// A `tokenizer.json`; the bundled tokenizer when absent.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Folder for the corpus and the shards; a temporary one, removed after, when absent.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Fraction of documents with typographic characters (curly apostrophes, em dashes, an
    /// accented word), as web text has: they leave the tokenizer's ASCII fast path.
    #[arg(long, default_value_t = 0.5)]
    pub non_ascii: f64,
    /// Seed of the generated text.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// The bundled books' sentences, each with its closing punctuation and a space.
fn sentences() -> Vec<String> {
    let text = nsactor_data::bundled_corpus();
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = Vec::new();
    let mut start = 0;
    for (i, c) in flat.char_indices() {
        if matches!(c, '.' | '!' | '?') && flat[i + 1..].starts_with(' ') {
            let s = flat[start..=i].trim();
            if s.len() > 20 {
                out.push(format!("{s} "));
            }
            start = i + 1;
        }
    }
    out
}

/// Writes about `a.mb` MB of Parquet under `dir/data`; returns the files' total size.
fn generate(a: &PrepareBenchArgs, dir: &Path) -> CliResult<u64> {
    let pool = sentences();
    let mut rng = SplitMix64(a.seed);
    let per_file = (a.mb * 1e6 / a.files as f64) as u64;
    let data = dir.join("data");
    std::fs::create_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
    let mut total = 0;
    for f in 0..a.files {
        let path = data.join(format!("train-{f:05}-of-{:05}.parquet", a.files));
        let mut w = StringsWriter::create(&path, "text", &a.codec)?;
        // Text per file, at the codec's ratio measured on the first row group.
        let (mut written_text, mut ratio) = (0u64, None::<f64>);
        loop {
            let docs: Vec<String> = (0..a.row_group)
                .map(|_| {
                    let n = 5 + rng.below(56) as usize;
                    let mut d = String::with_capacity(n * 100);
                    for _ in 0..n {
                        d.push_str(&pool[rng.below(pool.len() as u64) as usize]);
                    }
                    d.pop();
                    if (rng.below(1 << 20) as f64) < a.non_ascii * f64::from(1 << 20) {
                        d = d.replace('\'', "’").replace("--", "—");
                        d.push_str(" — café.");
                    }
                    d
                })
                .collect();
            written_text += docs.iter().map(|d| d.len() as u64).sum::<u64>();
            let rows: Vec<Option<&str>> = docs.iter().map(|d| Some(d.as_str())).collect();
            w.write_group(&rows)?;
            let r = *ratio.get_or_insert_with(|| {
                let on_disk = std::fs::metadata(&path).map_or(0, |m| m.len()).max(1);
                written_text as f64 / on_disk as f64
            });
            if written_text as f64 / r >= per_file as f64 {
                break;
            }
        }
        total += w.close()?;
    }
    Ok(total)
}

pub fn run(a: PrepareBenchArgs) -> CliResult {
    if a.files == 0 || a.row_group == 0 || a.mb.is_nan() || a.mb <= 0.0 {
        return Err("--mb, --files and --row-group must be positive".into());
    }
    if !(0.0..=1.0).contains(&a.non_ascii) {
        return Err("--non-ascii: a fraction from 0 to 1".into());
    }
    let tok = nsactor_data::Tokenizer::load_or_bundled(a.tokenizer.as_deref())?;
    let tmp;
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => {
            tmp =
                std::env::temp_dir().join(format!("nsactor-bench-prepare-{}", std::process::id()));
            tmp.clone()
        }
    };
    let out = dir.join("shards");
    let _ = std::fs::remove_dir_all(dir.join("data"));
    let _ = std::fs::remove_dir_all(&out);
    let t = Instant::now();
    let size = generate(&a, &dir)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "prepare: {:.1} MB of Parquet ({} files, {}, {} rows a row group, {:.0} % of documents not ASCII) generated in {:.1} s under {}; {} ({} tokens); {cores} cores, {} rayon threads",
        size as f64 / 1e6,
        a.files,
        a.codec,
        a.row_group,
        a.non_ascii * 100.0,
        t.elapsed().as_secs_f64(),
        dir.display(),
        tok.origin(),
        tok.vocab_size(),
        rayon_threads(),
    );
    let opts = PrepareOptions::default();
    let cpu0 = cpu_seconds();
    let r = prepare::prepare(&tok, std::slice::from_ref(&dir), &out, &opts)?;
    let cpu = cpu_seconds() - cpu0;
    let m = &r.manifest;
    let mb_s = r.input_mb_per_s();
    println!(
        "{:>9} {:>10} {:>12} {:>11} {:>13} {:>13} {:>9} {:>14}",
        "seconds",
        "documents",
        "text MB",
        "tokens",
        "Parquet MB/s",
        "text MB/s",
        "Mtok/s",
        "of 50 MB/s"
    );
    println!(
        "{:>9.2} {:>10} {:>12.1} {:>11} {:>13.2} {:>13.2} {:>9.3} {:>13.2}×",
        r.seconds,
        m.documents,
        m.text_bytes as f64 / 1e6,
        m.tokens,
        mb_s,
        r.mb_per_s(),
        m.tokens as f64 / r.seconds / 1e6,
        mb_s / TARGET_MB_S
    );
    println!(
        "text/Parquet {:.2}×, {:.2} bytes/token, {} shards; {:.2} CPU seconds ({:.0} % of {cores} cores): {:.2} MB of Parquet per CPU second",
        m.text_bytes as f64 / r.input_bytes as f64,
        m.text_bytes as f64 / m.tokens as f64,
        m.shards.len(),
        cpu,
        100.0 * cpu / r.seconds / cores as f64,
        r.input_bytes as f64 / 1e6 / cpu.max(1e-9),
    );
    // Where the time goes: the same files read again without encoding.
    let (t, cpu0) = (Instant::now(), cpu_seconds());
    let mut docs = 0;
    for f in nsactor_data::corpus::expand(&[dir.join("data")])? {
        nsactor_data::stream::read_documents(&f, "text", &mut |b| {
            docs += b.docs.len();
            Ok(())
        })?;
    }
    let (secs, cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    println!(
        "reading alone (one thread, {docs} documents, no encoding): {secs:.2} s, {cpu:.2} CPU s, {:.1} MB/s of Parquet",
        r.input_bytes as f64 / 1e6 / secs
    );
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

/// User and system CPU time of this process so far (all threads).
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return f64::NAN;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Threads of rayon's global pool (`RAYON_NUM_THREADS`, else one a core).
fn rayon_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
