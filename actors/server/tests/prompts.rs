//! Prompts: scoring one (`echo` with log-probabilities) costs one prefill, not one pass per
//! token, and its numbers are bit for bit those of feeding the prompt one token at a time
//! (every position's log-probability and its alternatives, across the passes a long prompt is
//! cut into, with other scoring requests batched beside it); a prompt past the server's limit
//! is refused with both numbers.

mod common;

use common::{http, serve};
use nsactor_server::generate::{Admission, GenEvent, Generator};
use nsactor_server::logprobs::{TokenLogprob, token_logprob};
use nsactor_server::protocol::{GenSpec, PromptSpec};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

/// The old way: one decoder pass per token, each position's logits scoring the next token.
async fn token_at_a_time(g: &Generator, prompt: &[i64], top: usize) -> Vec<TokenLogprob> {
    let s = g.decoder.session();
    let mut out = Vec::new();
    let mut logits = g.decoder.feed(s, vec![prompt[0]]).await.unwrap();
    for &t in &prompt[1..] {
        out.push(token_logprob(&logits, t, top));
        logits = g.decoder.feed(s, vec![t]).await.unwrap();
    }
    g.decoder.close(s).await;
    out
}

/// The server's way: a scoring request (`max_tokens` 1, prompt log-probabilities).
async fn scored(g: Arc<Generator>, prompt: Vec<i64>, top: usize) -> Vec<TokenLogprob> {
    let spec = GenSpec {
        prompt: PromptSpec::Ids(prompt),
        max_tokens: 1,
        sampling: nsactor_engine::decode::SamplingParams::greedy(),
        stop: Vec::new(),
        token_ids: true,
        ignore_eos: true,
        logit_bias: Vec::new(),
        logprobs: Some(top),
        prompt_logprobs: Some(top),
        add_special_tokens: false,
        cache_prompt: true,
        time_limit: None,
        extras: Default::default(),
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let run = tokio::spawn(async move {
        g.run(spec, tx, Arc::new(AtomicBool::new(false)))
            .await
            .unwrap()
    });
    let mut prompt_lps = None;
    while let Some(e) = rx.recv().await {
        if let GenEvent::Prompt { logprobs, .. } = e {
            prompt_lps = Some(logprobs);
        }
    }
    run.await.unwrap();
    let lps = prompt_lps.expect("the prompt's log-probabilities");
    assert!(lps[0].is_none(), "the first token has no context");
    lps.into_iter().skip(1).map(Option::unwrap).collect()
}

/// A scored position's token, its log-probability's bits and its alternatives'.
type Bits = (i64, u32, Vec<(i64, u32)>);

fn bits(lps: &[TokenLogprob]) -> Vec<Bits> {
    lps.iter()
        .map(|l| {
            let top = l.top.iter().map(|(t, p)| (*t, p.to_bits())).collect();
            (l.token_id, l.logprob.to_bits(), top)
        })
        .collect()
}

#[test]
fn a_scored_prompt_is_one_prefill_with_the_numbers_of_one_token_at_a_time() {
    let s = serve(4, 8);
    // A generator over the same model whose prompts may span several passes.
    let g = Arc::new(Generator {
        decoder: s.pipeline.decoder(512),
        prefix: Arc::default(),
        tokenizer: Arc::new(nsactor_data::Tokenizer::bundled()),
        admission: Admission::new(4, 8),
        metrics: Arc::default(),
        max_prompt_tokens: 1 << 17,
        drain: Arc::default(),
        ready: Arc::default(),
    });
    let pass = g.decoder.pass_tokens();
    // Two prompts longer than a pass (so they are cut at different places) and two short
    // ones of one length (so they batch together).
    let make = |n: usize, k: i64| -> Vec<i64> {
        (0..n as i64).map(|i| 5 + (i * 37 + k * 11) % 500).collect()
    };
    let prompts = [
        make(pass + 300, 1),
        make(pass + 17, 2),
        make(40, 3),
        make(40, 4),
    ];
    s.pipeline.block_on(async move {
        let mut want = Vec::new();
        for p in &prompts {
            want.push(token_at_a_time(&g, p, 3).await);
        }
        let (c0, n0) = g.decoder.batch_counts();
        let tasks: Vec<_> = prompts
            .iter()
            .map(|p| tokio::spawn(scored(g.clone(), p.clone(), 3)))
            .collect();
        let mut got = Vec::new();
        for t in tasks {
            got.push(t.await.unwrap());
        }
        let (c1, n1) = g.decoder.batch_counts();
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.len(), prompts[i].len() - 1);
            assert_eq!(w.len(), g.len(), "prompt {i}");
            assert!(
                bits(w) == bits(g),
                "prompt {i}: the scored log-probabilities differ from one token at a time"
            );
            assert!(w.iter().all(|l| l.top.len() == 3 && l.logprob <= 0.0));
        }
        // One prefill: passes of at most `pass` tokens for all but the last token, then one
        // pass from the last token (and the one generated token's pass): far fewer inputs
        // than tokens.
        let tokens: usize = prompts.iter().map(Vec::len).sum();
        let inputs = (n1 - n0) as usize;
        assert!(
            inputs <= 3 * prompts.len() + 2,
            "{inputs} inputs for {tokens} prompt tokens in {} cohorts",
            c1 - c0
        );
    });
}

#[test]
fn a_prompt_past_the_limit_is_refused_naming_its_length_and_the_limit() {
    let s = serve(4, 8);
    let limit = s.state.generator.max_prompt_tokens;
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let ids: Vec<i64> = (0..=limit as i64).map(|i| 5 + i % 400).collect();
        let req = serde_json::json!({"prompt": ids, "max_tokens": 1});
        let (status, body) =
            http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
        assert_eq!(status, 400, "{body}");
        let want = format!("the prompt has {} tokens; the limit is {limit}", limit + 1);
        assert!(body.contains(&want), "{body}");
        assert!(body.contains("--max-prompt-tokens"), "{body}");
        // At the limit it runs.
        let req = serde_json::json!({"prompt": &ids[..limit], "max_tokens": 1});
        let (status, body) =
            http(addr, "POST", "/v1/completions", req.to_string().as_bytes()).await;
        assert_eq!(status, 200, "{body}");
    });
}
