//! `nsactor bench detokenize`: the server's text per generated token, decoding a window of
//! recent tokens ([`nsactor_data::TextStream`]) against decoding the whole generation again at
//! every token (what the server did before).

use crate::result::CliResult;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct DetokArgs {
    /// Generation lengths to time, comma-separated.
    #[arg(long, default_value = "256,1024,4096", value_delimiter = ',')]
    pub tokens: Vec<usize>,
    /// A `tokenizer.json`; the bundled tokenizer when absent.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

pub fn run(a: DetokArgs) -> CliResult {
    if a.tokens.contains(&0) {
        return Err("--tokens: lengths of at least one token".into());
    }
    let tok = match &a.tokenizer {
        Some(p) => nsactor_data::Tokenizer::load(p)?,
        None => nsactor_data::Tokenizer::bundled(),
    };
    // The bundled books as the "generation": real text, with its spaces, punctuation and
    // the odd character spelled in byte pieces.
    let longest = a.tokens.iter().copied().max().unwrap_or(0);
    let corpus = nsactor_data::bundled_corpus();
    let mut ids = tok.encode(&corpus[..corpus.floor_char_boundary(longest * 16)])?;
    while ids.len() < longest {
        let again = ids.clone();
        ids.extend(again);
    }
    println!(
        "detokenize: {} ({} tokens), per generated token, the whole text so far each time against a window",
        a.tokenizer
            .as_ref()
            .map_or("the bundled tokenizer".to_string(), |p| p
                .display()
                .to_string()),
        tok.vocab_size()
    );
    println!(
        "{:>8} {:>16} {:>16} {:>16} {:>16} {:>9} {:>10}",
        "tokens",
        "whole: total ms",
        "whole: last µs",
        "window: total ms",
        "window: µs/tok",
        "ratio",
        "same text"
    );
    for &n in &a.tokens {
        let ids = &ids[..n];
        let t = Instant::now();
        let mut whole = String::new();
        for i in 1..=n {
            whole = tok.decode(&ids[..i], true)?;
        }
        let whole_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let _ = tok.decode(ids, true)?;
        let last_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut s = tok.text_stream(true);
        let mut text = String::new();
        for &id in ids {
            if let Some(p) = s.step(id)? {
                text.push_str(&p);
            }
        }
        text.push_str(&s.finish()?);
        let window_s = t.elapsed().as_secs_f64();
        println!(
            "{n:>8} {:>16.2} {:>16.1} {:>16.3} {:>16.2} {:>8.0}× {:>10}",
            whole_s * 1e3,
            last_s * 1e6,
            window_s * 1e3,
            window_s * 1e6 / n as f64,
            whole_s / window_s.max(1e-12),
            if text == whole { "yes" } else { "NO" }
        );
        if text != whole {
            return Err(
                format!("{n} tokens: the window's text differs from the whole decode").into(),
            );
        }
    }
    Ok(())
}
