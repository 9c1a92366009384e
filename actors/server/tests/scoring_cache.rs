//! Scoring through the prefix cache: a prompt scored past a prefix that was scored before
//! (a question's other answers, as lm-evaluation-harness sends them) is fed only past it,
//! and every number is bit for bit that of feeding the prompt one token at a time — after a
//! hit, across passes, with fewer alternatives than were kept, with more (no hit), when the
//! scores are evicted, and for prompts scored together that share a context (one pass over
//! it, the others waiting for its snapshot); through `/v1/completions` with a list of
//! prompts too.

mod common;

use common::{bits, http, scored, serve, token_at_a_time};
use nsactor_decoding::prefix::{PrefixCache, PrefixConfig, parting_depths};
use nsactor_server::generate::{Admission, Generator};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;

fn generator(s: &common::Served, cfg: PrefixConfig) -> Arc<Generator> {
    Arc::new(Generator {
        decoder: s.pipeline.decoder(512),
        prefix: Arc::new(PrefixCache::new(cfg)),
        tokenizer: Arc::new(nsactor_data::Tokenizer::bundled()),
        admission: Admission::new(8, 8),
        metrics: Arc::default(),
        max_prompt_tokens: 1 << 17,
        drain: Arc::default(),
        ready: Arc::default(),
    })
}

/// Tokens of the tiny model's vocabulary, `n` of them, varied by `k`.
fn tokens(n: usize, k: i64) -> Vec<i64> {
    (0..n as i64).map(|i| 5 + (i * 37 + k * 11) % 500).collect()
}

fn with(context: &[i64], answer: &[i64]) -> Vec<i64> {
    context.iter().chain(answer).copied().collect()
}

/// (hits, tokens saved) so far.
fn counts(g: &Generator) -> (u64, u64) {
    let s = &g.prefix.stats;
    (
        s.hits.load(Ordering::Relaxed),
        s.tokens_saved.load(Ordering::Relaxed),
    )
}

#[test]
fn a_prompt_scored_past_a_scored_prefix_is_fed_past_it_with_the_same_bits() {
    let s = serve(4, 8);
    let g = generator(&s, PrefixConfig::default());
    let pass = g.decoder.pass_tokens();
    let short = tokens(50, 1);
    let long = tokens(pass + 20, 2);
    let prompts = [
        with(&short, &[7]),
        with(&short, &[9]),
        with(&short, &[11, 12, 13]),
        with(&long, &[21]),
        with(&long, &[22, 23]),
    ];
    s.pipeline.block_on(async move {
        let mut want = Vec::new();
        for p in &prompts {
            want.push(token_at_a_time(&g, p, 3).await);
        }
        for (i, p) in prompts.iter().enumerate() {
            let (n0, before) = (g.decoder.batch_counts().1, counts(&g));
            let got = scored(g.clone(), p.clone(), 3, Vec::new()).await;
            assert!(bits(&got) == bits(&want[i]), "prompt {i}: other numbers");
            let (inputs, now) = (g.decoder.batch_counts().1 - n0, counts(&g));
            // The first of each context is fed whole; the others start where it ended.
            let hit = match i {
                0 | 3 => None,
                1 | 2 => Some(short.len()),
                _ => Some(long.len()),
            };
            assert_eq!(
                now.1 - before.1,
                hit.unwrap_or(0) as u64,
                "prompt {i}: tokens saved"
            );
            assert_eq!(now.0 - before.0, u64::from(hit.is_some()), "prompt {i}");
            if i == 1 {
                // Nothing to feed before the last token: its pass and the one generated.
                assert!(inputs <= 2, "{inputs} inputs for a second answer");
            }
        }
        // More alternatives than were kept: no scored prefix serves them; the prompt is fed
        // whole (its scores then replace the narrower ones).
        let before = counts(&g);
        let got = scored(g.clone(), prompts[1].clone(), 5, Vec::new()).await;
        assert!(bits(&got) == bits(&token_at_a_time(&g, &prompts[1], 5).await));
        assert_eq!(counts(&g), before, "no hit for 5 alternatives");
        // Fewer: the kept ones cut to the first one.
        let got = scored(g.clone(), prompts[0].clone(), 1, Vec::new()).await;
        assert!(bits(&got) == bits(&token_at_a_time(&g, &prompts[0], 1).await));
        assert_eq!(counts(&g).0, before.0 + 1);
        assert!(g.prefix.usage().score_bytes > 0);
    });
}

#[test]
fn answers_scored_together_feed_their_context_once_and_evicted_scores_cost_only_time() {
    let s = serve(4, 8);
    let g = generator(&s, PrefixConfig::default());
    let context = tokens(60, 3);
    let prompts = [
        with(&context, &[30]),
        with(&context, &[31, 32]),
        with(&context, &[33]),
        with(&context, &[34, 35, 36]),
    ];
    let refs: Vec<&[i64]> = prompts.iter().map(Vec::as_slice).collect();
    let parts = parting_depths(&refs);
    assert!(parts.iter().all(|p| p == &[context.len()]), "{parts:?}");
    let g2 = generator(
        &s,
        PrefixConfig {
            score_bytes: 1,
            ..PrefixConfig::default()
        },
    );
    s.pipeline.block_on(async move {
        let mut want = Vec::new();
        for p in &prompts {
            want.push(token_at_a_time(&g, p, 2).await);
        }
        let tasks: Vec<_> = prompts
            .iter()
            .zip(&parts)
            .map(|(p, parts)| tokio::spawn(scored(g.clone(), p.clone(), 2, parts.clone())))
            .collect();
        for (i, t) in tasks.into_iter().enumerate() {
            assert!(bits(&t.await.unwrap()) == bits(&want[i]), "prompt {i}");
        }
        // One fed the context; the three others waited for its snapshot and started there.
        assert_eq!(counts(&g), (3, 3 * context.len() as u64));
        // Scores past their budget are dropped as soon as kept: no scored hit, the same bits.
        for (i, p) in prompts.iter().enumerate() {
            let got = scored(g2.clone(), p.clone(), 2, Vec::new()).await;
            assert!(
                bits(&got) == bits(&want[i]),
                "prompt {i} without scores kept"
            );
        }
        assert_eq!(counts(&g2), (0, 0));
        assert_eq!(g2.prefix.usage().score_bytes, 0);
    });
}

/// Each prompt's `token_logprobs` from a `/v1/completions` echo.
fn token_logprobs(v: &Value) -> Vec<Vec<Value>> {
    let mut choices = v["choices"].as_array().unwrap().clone();
    choices.sort_by_key(|c| c["index"].as_u64());
    choices
        .iter()
        .map(|c| c["logprobs"]["token_logprobs"].as_array().unwrap().clone())
        .collect()
}

#[test]
fn a_list_of_prompts_sharing_a_context_is_scored_from_one_pass_over_it() {
    let s = serve(4, 8);
    let (addr, state) = (s.addr, s.state.clone());
    let context = tokens(40, 4);
    let prompts: Vec<Vec<i64>> = (0..4).map(|k| with(&context, &[100 + k])).collect();
    s.pipeline.block_on(async move {
        let body = |prompt: Value| {
            json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 1}).to_string()
        };
        // Each alone, without the cache, then all four in one request through it.
        let mut alone = Vec::new();
        for p in &prompts {
            let mut req: Value = serde_json::from_str(&body(json!(p))).unwrap();
            req["cache_prompt"] = json!(false);
            let (status, b) =
                http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
            assert_eq!(status, 200, "{b}");
            alone.extend(token_logprobs(&serde_json::from_str(&b).unwrap()));
        }
        let saved0 = state.generator.prefix.report().tokens_saved;
        let (status, b) = http(
            addr,
            "POST",
            "/v1/completions",
            body(json!(prompts)).as_bytes(),
        )
        .await;
        assert_eq!(status, 200, "{b}");
        let together = token_logprobs(&serde_json::from_str(&b).unwrap());
        assert_eq!(together, alone, "the same numbers, choice by choice");
        let saved = state.generator.prefix.report().tokens_saved - saved0;
        assert_eq!(saved, 3 * context.len() as u64, "the context fed once");
        let (_, metrics) = http(addr, "GET", "/metrics", b"").await;
        let line = metrics
            .lines()
            .find(|l| l.starts_with("nsactor_prefix_cache_score_bytes "))
            .expect("the score bytes gauge");
        assert!(!line.ends_with(" 0"), "{line}");
    });
}
