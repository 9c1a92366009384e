//! `nsactor bench host`: the host's work for a request that could grow with its prompt. Two
//! parts: encoding a ChatML prompt, and one decoding step's pick block for a cohort.
//!
//! The encoding takes the ASCII fast path between the template's special tokens; it is timed
//! against the full pipeline, and the ids must be equal. The pick block is timed as a stream's
//! step builds it: each session's request advanced by its token and cloned, then laid out for
//! the device. It is timed with the penalties off (no token set is carried, whatever the
//! prompt) and with the repetition penalty on (the prompt's distinct tokens are carried).

use crate::result::CliResult;
use nsactor_decoding::PickRequest;
use nsactor_decoding::cohort::pick_block;
use nsactor_engine::decode::SamplingParams;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct HostArgs {
    /// Prompt lengths to time, in tokens (about), comma-separated.
    #[arg(long, default_value = "2000,32768,131072", value_delimiter = ',')]
    pub tokens: Vec<usize>,
    /// Sessions in the decoding step's cohort.
    #[arg(long, default_value_t = 256)]
    pub sessions: usize,
    /// A `tokenizer.json`; the bundled tokenizer when absent.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// Mean seconds of `f` over at least 5 runs and 0.2 s.
fn timed(mut f: impl FnMut() -> CliResult<usize>) -> CliResult<(f64, usize)> {
    let (mut runs, mut out) = (0u32, 0);
    let t = Instant::now();
    while runs < 5 || t.elapsed() < Duration::from_millis(200) {
        out = f()?;
        runs += 1;
    }
    Ok((t.elapsed().as_secs_f64() / f64::from(runs), out))
}

/// A system message of about `tokens` tokens: the bundled books, repeated as needed.
fn system_text(tokens: usize) -> String {
    let corpus = nsactor_data::bundled_corpus();
    // About 3.3 bytes a token of the bundled tokenizer on these books.
    let want = tokens * 10 / 3;
    let mut text = String::with_capacity(want + corpus.len());
    while text.len() < want {
        let rest = want - text.len();
        text.push_str(&corpus[..corpus.floor_char_boundary(rest.min(corpus.len()))]);
    }
    text
}

pub fn run(a: HostArgs) -> CliResult {
    if a.tokens.contains(&0) || a.sessions == 0 {
        return Err("--tokens and --sessions: at least one".into());
    }
    let tok = match &a.tokenizer {
        Some(p) => nsactor_data::Tokenizer::load(p)?,
        None => nsactor_data::Tokenizer::bundled(),
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("host work per request on this machine's CPU ({cores} cores), one thread");
    println!(
        "{:>9} {:>15} {:>15} {:>8} | {:>24} {:>24}",
        "prompt",
        "encode: fast ms",
        "full pipeline",
        "ratio",
        format!("step of {}: no penalty", a.sessions),
        "repetition penalty"
    );
    for &n in &a.tokens {
        let msgs = [
            nsactor_data::Message::new("system", &system_text(n)),
            nsactor_data::Message::new("user", "What happened next?"),
        ];
        let chat = nsactor_data::chat_template(&msgs, true);
        let (fast, ids_len) = timed(|| Ok(tok.encode(&chat)?.len()))?;
        let (full, _) = timed(|| Ok(tok.encode_unoptimised(&chat)?.len()))?;
        let ids: Vec<i64> = tok.encode(&chat)?.into_iter().map(i64::from).collect();
        if tok.encode_unoptimised(&chat)?.len() != ids_len
            || tok
                .encode_unoptimised(&chat)?
                .iter()
                .zip(&ids)
                .any(|(a, &b)| i64::from(*a) != b)
        {
            return Err(
                format!("{n} tokens: the fast path's ids differ from the pipeline's").into(),
            );
        }
        let step = |repetition: f32| -> CliResult<(f64, usize)> {
            let sampling = SamplingParams {
                temperature: 0.8,
                repetition_penalty: repetition,
                ..SamplingParams::greedy()
            };
            let one = PickRequest::new(sampling, &ids, &[], vec![(0, f32::NEG_INFINITY)], false);
            let mut cohort = vec![one; a.sessions];
            timed(|| {
                // As a stream's step: each request advanced by its drawn token, cloned for
                // the cohort, then laid out.
                for p in cohort.iter_mut() {
                    p.advance(7);
                }
                let picks: Vec<Option<PickRequest>> = cohort.iter().cloned().map(Some).collect();
                Ok(pick_block(&picks).picks().ints.len())
            })
        };
        let (off, off_ints) = step(1.0)?;
        let (rep, rep_ints) = step(1.1)?;
        println!(
            "{:>9} {:>15.3} {:>15.3} {:>7.0}× | {:>11.1} µs {:>7} ids {:>11.1} µs {:>7} ids",
            ids.len(),
            fast * 1e3,
            full * 1e3,
            full / fast.max(1e-12),
            off * 1e6,
            off_ints,
            rep * 1e6,
            rep_ints
        );
    }
    Ok(())
}
