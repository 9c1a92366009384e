//! Prompts: scoring one (`echo` with log-probabilities) costs one prefill, not one pass per
//! token, and its numbers are bit for bit those of feeding the prompt one token at a time
//! (every position's log-probability and its alternatives, across the passes a long prompt is
//! cut into, with other scoring requests batched beside it); a prompt past the server's limit
//! is refused with both numbers.

mod common;

use common::{bits, http, scored, serve, token_at_a_time};
use nsactor_server::generate::{Admission, Generator};
use std::sync::Arc;

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
            .map(|p| tokio::spawn(scored(g.clone(), p.clone(), 3, Vec::new())))
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

/// A client gone while its request waits for a place, or while its prompt is fed, ends it
/// there: the queue lets it go at once, and of a prompt only the chunk in flight runs
/// (vLLM aborts between scheduler steps too). Both end `cancelled`, free their place and the
/// session, and the server goes on.
#[test]
fn a_client_gone_in_the_queue_or_in_its_prompt_ends_its_request_there() {
    use nsactor_server::generate::GenEvent;
    use nsactor_server::protocol::{GenSpec, PromptSpec};
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};
    let s = serve(1, 8);
    let g = Arc::new(Generator {
        decoder: s.pipeline.decoder(512).with_pass_tokens(32),
        prefix: Arc::default(),
        tokenizer: Arc::new(nsactor_data::Tokenizer::bundled()),
        admission: Admission::new(1, 8),
        metrics: Arc::default(),
        max_prompt_tokens: 1 << 17,
        drain: Arc::default(),
        ready: Arc::default(),
    });
    let spec = |prompt: Vec<i64>, max_tokens: usize| GenSpec {
        prompt: PromptSpec::Ids(prompt),
        max_tokens,
        sampling: nsactor_engine::decode::SamplingParams::greedy(),
        stop: Vec::new(),
        token_ids: false,
        ignore_eos: true,
        logit_bias: Vec::new(),
        logprobs: None,
        prompt_logprobs: None,
        add_special_tokens: false,
        cache_prompt: false,
        time_limit: None,
        extras: Default::default(),
        parts: Vec::new(),
    };
    let long: Vec<i64> = (0..640).map(|i| 5 + (i * 37) % 500).collect();
    s.pipeline.block_on(async move {
        // One place: a stream holds it.
        let holder = Arc::new(AtomicBool::new(false));
        let (tx, mut held) = tokio::sync::mpsc::channel(1024);
        let running = tokio::spawn({
            let (g, cancel) = (g.clone(), holder.clone());
            async move { g.run(spec(vec![5, 6, 7], 100_000), tx, cancel).await }
        });
        assert!(matches!(held.recv().await, Some(GenEvent::Delta { .. })));
        // Queued, then its client goes.
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let queued = tokio::spawn({
            let g = g.clone();
            let cancel = Arc::new(AtomicBool::new(false));
            async move { g.run(spec(vec![5, 6], 4), tx, cancel).await }
        });
        while g.admission.queued() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let t = Instant::now();
        drop(rx);
        let f = queued.await.unwrap().unwrap();
        assert_eq!(f.finish_reason, "cancelled");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert_eq!(g.admission.queued(), 0);
        holder.store(true, std::sync::atomic::Ordering::SeqCst);
        drop(held);
        assert_eq!(running.await.unwrap().unwrap().finish_reason, "cancelled");
        // A prompt of 20 passes; its client goes once the first has run.
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let c0 = g.decoder.batch_counts().0;
        let feeding = tokio::spawn({
            let (g, prompt) = (g.clone(), long.clone());
            let cancel = Arc::new(AtomicBool::new(false));
            async move { g.run(spec(prompt, 4), tx, cancel).await }
        });
        while g.decoder.batch_counts().0 == c0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(rx);
        let f = feeding.await.unwrap().unwrap();
        let passes = g.decoder.batch_counts().0 - c0;
        assert_eq!(f.finish_reason, "cancelled");
        assert!(
            passes < 20,
            "{passes} of the prompt's 20 passes ran for nobody"
        );
        assert_eq!(g.decoder.open_sessions(), 0, "its states were freed");
        // The place is free and the server serves on.
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let f = g
            .run(spec(long.clone(), 2), tx, Arc::new(AtomicBool::new(false)))
            .await
            .unwrap();
        assert_eq!(f.finish_reason, "length");
        while rx.recv().await.is_some() {}
    });
}
