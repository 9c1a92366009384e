//! `nsactor bench prefill`: prompts through the real server on loopback, as clients send them
//! to `/v1/completions`. One client's time to first token at several prompt lengths and
//! concurrent prompts' aggregate prompt tokens/s, each against the compute ceiling (the model's
//! forward FLOPs per token at the device's dense peak); a scored prompt (`echo` with
//! log-probabilities, nothing generated) beside the prefill of the same prompt; and the device
//! memory in use after a short prompt and after a long one (a session's state is the same size
//! after any number of tokens, and a prompt is fed a pass at a time); and a multiple-choice
//! question's answers scored in one request as lm-evaluation-harness sends them, through the
//! prefix cache against without it. The prompts timed for their first token opt out of the
//! cache (`cache_prompt: false`): each is sent more than once; scored prompts are new each
//! time.

use super::flops::Ceiling;
use super::serve::{Loopback, ServedModel, describe, device_used, idle, load};
use super::sse::{Sender, connect, post};
use crate::result::{CliError, CliResult};
use http_body_util::BodyExt;
use std::net::SocketAddr;
use std::time::Instant;

#[derive(clap::Args)]
pub struct PrefillBenchArgs {
    #[command(flatten)]
    model: ServedModel,
    /// Prompt lengths one client sends, one request at a time.
    #[arg(long, value_delimiter = ',', default_value = "512,2048,4000")]
    lengths: Vec<usize>,
    /// Concurrent prompts as `CLIENTSxTOKENS` (comma-separated), each set sent together (once
    /// unmeasured, then timed).
    #[arg(long, value_delimiter = ',', default_value = "8x512,64x2000")]
    concurrent: Vec<String>,
    /// Length of the prompt scored with `echo` and log-probabilities (0: none).
    #[arg(long, default_value_t = 512)]
    score: usize,
    /// Tokens of a prompt whose every position's logits from one prefill are compared with
    /// those of feeding it one token at a time (0: no check).
    #[arg(long, default_value_t = 64)]
    check: usize,
    /// Prompt lengths after each of which the device memory in use is read, the first the
    /// baseline (`--memory` with no value: none).
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "1024,131072")]
    memory: Vec<usize>,
    /// Answers of the multiple-choice question scored on a `--score`-token context (one
    /// token each, all in one request), through the prefix cache and without (0: none).
    #[arg(long, default_value_t = 4)]
    choices: usize,
    /// Tokens before every question's own context that all questions share (as MMLU's subject
    /// line and fixed few-shot examples): fed once through the cache for all of them.
    #[arg(long, default_value_t = 0)]
    shared: usize,
    /// Measured repetitions of each one-client figure (medians printed), after one unmeasured.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[command(flatten)]
    passes: crate::serve::PassArgs,
    /// The device's dense peak in TFLOP/s for the ratio to the compute ceiling (default: on a
    /// CUDA backend 989 in bf16 and 67 in fp32, as an H100/H200 SXM; none on the CPU).
    #[arg(long)]
    peak_tflops: Option<f64>,
}

/// `CLIENTSxTOKENS`.
fn parse_concurrent(s: &str) -> CliResult<(usize, usize)> {
    let bad = || {
        CliError::from(format!(
            "--concurrent {s:?}: expected CLIENTSxTOKENS, like 64x2000"
        ))
    };
    let (n, len) = s.split_once('x').ok_or_else(bad)?;
    let (n, len) = (
        n.trim().parse().map_err(|_| bad())?,
        len.trim().parse().map_err(|_| bad())?,
    );
    if n == 0 || len == 0 {
        return Err(bad());
    }
    Ok((n, len))
}

/// A prompt of `len` ids that no two clients share (`salt`), past the special tokens.
fn prompt(len: usize, salt: usize, vocab: usize) -> Vec<i64> {
    let span = vocab.saturating_sub(5).max(1) as u64;
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (salt as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            5 + (x % span) as i64
        })
        .collect()
}

/// Seconds from sending `ids` (streamed, one token generated) to the first chunk with a
/// token, on a connection of its own made before the clock starts (the server closes a
/// stream's connection after it); the rest of the answer is read before it returns.
async fn first_token(addr: SocketAddr, ids: &[i64]) -> CliResult<f64> {
    first_token_on(connect(addr).await?, addr, ids).await
}

/// [`first_token`] on the connection `sender`.
async fn first_token_on(mut sender: Sender, addr: SocketAddr, ids: &[i64]) -> CliResult<f64> {
    let body = serde_json::json!({"prompt": ids, "max_tokens": 1, "temperature": 0,
        "ignore_eos": true, "stream": true, "cache_prompt": false});
    let sent = Instant::now();
    let mut body = post(&mut sender, addr, "/v1/completions", &body).await?;
    let mut ttft = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the stream: {e}"))?;
        if frame
            .data_ref()
            .is_some_and(|d| d.windows(5).any(|w| w == b"data:"))
        {
            ttft.get_or_insert(sent.elapsed().as_secs_f64());
        }
    }
    ttft.ok_or_else(|| "the stream ended without a token".into())
}

/// Seconds to score `ids` (`echo`, log-probabilities, no token generated) as clients do, the
/// prefix cache keeping what it keeps (the prompt is new to it), and how many positions came
/// back scored.
async fn scored(addr: SocketAddr, ids: &[i64]) -> CliResult<(f64, usize)> {
    let body = serde_json::json!({"prompt": ids, "max_tokens": 0, "echo": true, "logprobs": 1});
    scored_body(addr, body).await
}

/// [`scored`] of a request's `body`: the seconds, and the positions of its first choice.
async fn scored_body(addr: SocketAddr, body: serde_json::Value) -> CliResult<(f64, usize)> {
    let mut sender = connect(addr).await?;
    let sent = Instant::now();
    let body = post(&mut sender, addr, "/v1/completions", &body).await?;
    let bytes = body
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    let took = sent.elapsed().as_secs_f64();
    let v: serde_json::Value = serde_json::from_slice(&bytes)?;
    if v["choices"].as_array().is_none() {
        return Err(format!("scoring failed: {v}").into());
    }
    let n = v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .map_or(0, |a| a.iter().filter(|x| x.is_number()).count());
    Ok((took, n))
}

/// The median time to first token of `reps` requests of `ids` after one unmeasured.
async fn ttft(reps: usize, addr: SocketAddr, ids: &[i64]) -> CliResult<f64> {
    first_token(addr, ids).await?;
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        v.push(first_token(addr, ids).await?);
    }
    Ok(super::stats::pct(&mut v, 0.5))
}

pub fn run(a: PrefillBenchArgs) -> CliResult {
    let l = load(&a.model)?;
    let concurrent = a
        .concurrent
        .iter()
        .map(|s| parse_concurrent(s))
        .collect::<CliResult<Vec<_>>>()?;
    let longest = (a.lengths.iter().chain(&a.memory).copied())
        .chain(concurrent.iter().map(|c| c.1))
        // A question's answers are a token past its context.
        .chain([a.shared + a.score + usize::from(a.choices > 1)])
        .max()
        .unwrap_or(1);
    // A question's answers are one request's choices, all admitted at once.
    let max_sessions = (concurrent.iter().map(|c| c.0).max())
        .unwrap_or(1)
        .max(a.choices);
    let limits = nsactor_server::protocol::Limits {
        max_prompt_tokens: longest.max(1),
        // Token ids as JSON text: at most 7 bytes each.
        max_message_bytes: (longest * 8).max(nsactor_server::protocol::DEFAULT_MAX_MESSAGE_BYTES),
        ..Default::default()
    };
    let decoder = a.passes.apply(l.pipeline.decoder(l.vocab));
    let state = nsactor_server::ServerState::new(
        (decoder, l.tokenizer.clone(), Default::default()),
        (max_sessions, max_sessions),
        l.name.clone(),
        Default::default(),
        (limits, Default::default()),
    );
    let (decoder, prefix) = (
        state.generator.decoder.clone(),
        state.generator.prefix.clone(),
    );
    let info = l.pipeline.backend().info();
    let precision = a.model.precision.as_deref();
    let bf16 = precision.or(l.config.backend.precision.as_deref()) == Some("bf16");
    let ceiling = Ceiling::forward(&l.config.model, a.peak_tflops, &info.name, bf16);
    println!(
        "prefill: {}; {:.2} GFLOP per prompt token forward; passes of at most {} tokens (chunks of at most {} while others decode, paced to {:.2} of a step); through /v1/completions on loopback",
        describe(&l),
        ceiling.flops_per_token / 1e9,
        decoder.pass_tokens(),
        decoder.pacer().max(),
        decoder.pacer().share()
    );
    let loopback = Loopback::start(state, 0, 2)?;
    let addr = loopback.addr;
    let backend = l.pipeline.backend().clone();
    loopback.clients.block_on(async {
        for &len in &a.lengths {
            let ids = prompt(len, len, l.vocab);
            let (p0, c0) = (decoder.cohort_phases(), decoder.batch_counts().0);
            let t = ttft(a.reps, addr, &ids).await?;
            let (p1, c1) = (decoder.cohort_phases(), decoder.batch_counts().0);
            let per_pass = |i: usize| 1e3 * (p1[i] - p0[i]) / (c1 - c0).max(1) as f64;
            println!(
                "one client, {len:>7} prompt tokens: time to first token {:.1} ms, {:.0} prompt tokens/s ({}); {} passes, each embed {:.2} ms, layers {:.2} ms, decode {:.2} ms",
                t * 1e3,
                len as f64 / t,
                ceiling.describe(len as f64 / t),
                (c1 - c0) / (a.reps.max(1) as u64 + 1),
                per_pass(0),
                per_pass(1),
                per_pass(2)
            );
        }
        for &(n, len) in &concurrent {
            // One unmeasured round first, as for one client: cohorts of a shape not met before
            // pay their GEMMs' autotuning there (seconds on a fresh machine).
            idle(&decoder).await;
            concurrent_prompts(addr, n, len, l.vocab).await?;
            idle(&decoder).await;
            let tps = concurrent_prompts(addr, n, len, l.vocab).await?;
            println!(
                "{n:>4} clients × {len} prompt tokens together: {tps:.0} prompt tokens/s ({})",
                ceiling.describe(tps)
            );
        }
        if a.score > 0 {
            let ids = prompt(a.score, 7 * a.score, l.vocab);
            let prefill = ttft(a.reps, addr, &ids).await?;
            // A new prompt each time: none is found in the cache.
            let fresh = |rep: usize| prompt(a.score, 7 * a.score + 1 + rep, l.vocab);
            let (_, positions) = scored(addr, &fresh(0)).await?;
            let mut runs = Vec::with_capacity(a.reps);
            for rep in 1..=a.reps.max(1) {
                runs.push(scored(addr, &fresh(rep)).await?.0);
            }
            let t = super::stats::pct(&mut runs, 0.5);
            println!(
                "scoring a {}-token prompt (echo, log-probabilities, {positions} positions scored): {:.1} ms, against {:.1} ms to its first token",
                a.score,
                t * 1e3,
                prefill * 1e3
            );
        }
        if a.score > 0 && a.choices > 1 {
            let shape = (a.shared, a.score, a.choices, a.reps);
            multiple_choice(addr, shape, l.vocab, &prefix).await?;
        }
        if a.check > 1 {
            check(&decoder, &prompt(a.check, 11, l.vocab)).await?;
        }
        memory_rows(&a.memory, addr, l.vocab, backend.as_ref()).await
    })
}

/// A question of `choices` one-token answers on a `context`-token context (after `shared`
/// tokens every question has), scored in one request (as lm-evaluation-harness sends a batch),
/// `reps` times without the prefix cache and through it (a new context each time): the median
/// times, and the prompt tokens the cache saved.
async fn multiple_choice(
    addr: SocketAddr,
    (shared, context, choices, reps): (usize, usize, usize, usize),
    vocab: usize,
    prefix: &nsactor_decoding::prefix::PrefixCache,
) -> CliResult {
    let question = |salt: usize| -> Vec<Vec<i64>> {
        let ctx = prompt(shared, 1_000_033, vocab);
        let ctx: Vec<i64> = ctx
            .into_iter()
            .chain(prompt(context, salt, vocab))
            .collect();
        (0..choices)
            .map(|k| ctx.iter().copied().chain([5 + k as i64]).collect())
            .collect()
    };
    let mut times = [Vec::new(), Vec::new()];
    let saved0 = prefix.report().tokens_saved;
    for rep in 0..=reps.max(1) {
        for (i, cache) in [false, true].into_iter().enumerate() {
            let body = serde_json::json!({"prompt": question(31 * rep + 17 * i + 3),
                "max_tokens": 0, "echo": true, "logprobs": 1, "cache_prompt": cache});
            let (t, positions) = scored_body(addr, body).await?;
            if positions != shared + context {
                return Err(format!("{positions} positions scored of {}", shared + context).into());
            }
            // The first round is unmeasured (new shapes compile).
            if rep > 0 {
                times[i].push(t);
            }
        }
    }
    let saved = prefix.report().tokens_saved - saved0;
    let [mut off, mut on] = times;
    let (off, on) = (
        super::stats::pct(&mut off, 0.5),
        super::stats::pct(&mut on, 0.5),
    );
    let behind = match shared {
        0 => String::new(),
        s => format!(" behind {s} tokens every question shares"),
    };
    println!(
        "a {choices}-answer question on a {context}-token context{behind}, scored in one request: {:.1} ms through the prefix cache against {:.1} ms without ({:.2}×); the cache saved {} prompt tokens a question",
        on * 1e3,
        off * 1e3,
        off / on,
        saved / (reps.max(1) as u64 + 1)
    );
    Ok(())
}

/// `n` clients each sending a `len`-token prompt at once (one token generated): the prompt
/// tokens of all over the time from sending to the last first token.
async fn concurrent_prompts(
    addr: SocketAddr,
    n: usize,
    len: usize,
    vocab: usize,
) -> CliResult<f64> {
    let mut senders = Vec::with_capacity(n);
    for _ in 0..n {
        senders.push(connect(addr).await?);
    }
    let start = Instant::now();
    let tasks: Vec<_> = senders
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let ids = prompt(len, 1_000_003 * (i + 1) + len, vocab);
            tokio::spawn(async move { first_token_on(c, addr, &ids).await })
        })
        .collect();
    for t in tasks {
        t.await.map_err(|e| format!("a client failed: {e}"))??;
    }
    Ok((n * len) as f64 / start.elapsed().as_secs_f64())
}

/// The device memory in use after a prompt of each of `lengths` (pools keep their peak, so a
/// long prompt that needed more would show).
async fn memory_rows(
    lengths: &[usize],
    addr: SocketAddr,
    vocab: usize,
    backend: &dyn nsactor_plugin_api::ComputeBackend,
) -> CliResult {
    let mut base = None;
    for &len in lengths.iter().filter(|&&l| l > 0) {
        let t = first_token(addr, &prompt(len, 3 * len + 1, vocab)).await?;
        let Some(used) = device_used(backend) else {
            println!("the backend does not report its memory: no memory figures");
            return Ok(());
        };
        let gib = used as f64 / (1u64 << 30) as f64;
        let b = *base.get_or_insert(used);
        println!(
            "after a {len}-token prompt (first token in {:.1} ms): device memory in use {gib:.3} GiB, {:+.2}% against after the first",
            t * 1e3,
            100.0 * (used as f64 - b as f64) / b.max(1) as f64
        );
    }
    Ok(())
}

/// Every position's logits of `ids` from one prefill ([`feed_every`]) against those of
/// feeding it one token at a time: how many are bit for bit the same, and the largest
/// difference (on the CPU they are all the same; a GPU runs other kernels for one token).
///
/// [`feed_every`]: nsactor_decoding::AsyncDecoder::feed_every
async fn check(d: &nsactor_decoding::AsyncDecoder, ids: &[i64]) -> CliResult {
    let ids = &ids[..ids.len().min(d.pass_tokens())];
    let s = d.session();
    let every = d.feed_every(s, ids.to_vec()).await;
    d.close(s).await;
    let every = every?;
    let s = d.session();
    let mut one = Vec::with_capacity(every.len());
    for &t in ids {
        match d.feed(s, vec![t]).await {
            Ok(l) => one.extend(l),
            Err(e) => {
                d.close(s).await;
                return Err(e.into());
            }
        }
    }
    d.close(s).await;
    let same = every
        .iter()
        .zip(&one)
        .filter(|(a, b)| a.to_bits() == b.to_bits())
        .count();
    let worst = every
        .iter()
        .zip(&one)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = one.iter().map(|x| x.abs()).fold(0f32, f32::max);
    println!(
        "one prefill against one token at a time, {} positions: {same} of {} logits bit for bit the same, largest difference {worst:.3e} (logits up to {scale:.2})",
        ids.len(),
        one.len()
    );
    Ok(())
}
