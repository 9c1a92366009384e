//! Chunked prefill on the embedded CPU backend: a prompt fed beside other sessions goes in
//! chunks (their steps run between), paced by time beside decoding streams
//! (`nsactor_decoding::pacer`), and its logits are bit for bit those of the prompt fed alone.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

mod common;

use common::*;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Chunked prefill: a prompt fed while another session is open goes in chunks of
/// `chunk_tokens` (the other's steps run between them), alone in passes of the pass budget; its
/// logits are bit for bit the same either way.
#[test]
fn a_prompt_beside_an_open_session_is_fed_in_smaller_chunks_with_the_same_logits() {
    let _serial = serial();
    let p = pipeline(1, None);
    let d = p.decoder(256).with_pass_tokens(1024).with_chunk_tokens(100);
    assert_eq!((d.pass_tokens(), d.chunk_tokens()), (1024, 100));
    let prompt: Vec<i64> = (0..450).map(|i| 5 + (i * 29 % 200) as i64).collect();
    let (c0, _) = d.batch_counts();
    let alone = p.block_on(forced(&d, prompt.clone(), Vec::new())).remove(0);
    let (c1, _) = d.batch_counts();
    assert_eq!(c1 - c0, 1, "alone, 450 tokens are one pass");
    let (beside, passes) = p.block_on(async {
        let other = d.session();
        d.feed(other, vec![7, 8]).await.unwrap();
        let (c0, _) = d.batch_counts();
        let s = d.session();
        let logits = d.feed(s, prompt.clone()).await.unwrap();
        let (c1, _) = d.batch_counts();
        d.close(s).await;
        d.close(other).await;
        (logits, c1 - c0)
    });
    assert_eq!(
        passes, 5,
        "beside an open session, 450 tokens in chunks of 100"
    );
    assert!(
        bits(&alone) == bits(&beside),
        "the chunks changed the logits"
    );
}

/// Beside a session that decodes token after token, a prompt's chunks are paced: held to a
/// share of a step no pass can meet, they halve from the ceiling to the floor (8 tokens) as
/// the batcher reports their passes, and the prompt's logits are still those of feeding it
/// alone. Without the streams, the ceiling again.
#[test]
fn chunks_beside_a_decoding_stream_are_paced_down_to_the_floor_with_the_same_logits() {
    let _serial = serial();
    let p = pipeline(1, None);
    let d = p
        .decoder(256)
        .with_pass_tokens(1024)
        .with_chunk_tokens(128)
        .with_chunk_share(1e-6);
    let prompt: Vec<i64> = (0..600).map(|i| 5 + (i * 31 % 200) as i64).collect();
    let alone = p.block_on(forced(&d, prompt.clone(), Vec::new())).remove(0);
    let (beside, paced, steps) = p.block_on(async {
        let other = d.session();
        d.feed(other, vec![7, 8]).await.unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let stream = {
            let (d, done) = (d.clone(), done.clone());
            tokio::spawn(async move {
                let mut steps = 0u32;
                while !done.load(Ordering::Relaxed) {
                    d.feed(other, vec![9]).await.unwrap();
                    steps += 1;
                }
                steps
            })
        };
        while d.pacer().step_seconds().is_none() {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let s = d.session();
        let logits = d.feed(s, prompt.clone()).await.unwrap();
        let paced = d.chunk_tokens();
        done.store(true, Ordering::Relaxed);
        let steps = stream.await.unwrap();
        d.close(s).await;
        d.close(other).await;
        (logits, paced, steps)
    });
    assert_eq!(
        paced,
        nsactor_decoding::pacer::MIN_CHUNK,
        "chunks paced down to the floor ({steps} steps beside)"
    );
    assert!(steps >= 4, "the stream stepped between the chunks: {steps}");
    assert!(
        bits(&alone) == bits(&beside),
        "the paced chunks changed the logits"
    );
    // The streams gone quiet: the ceiling again, after STALE (or two chunk passes).
    let quiet = std::time::Instant::now();
    while d.chunk_tokens() != 128 && quiet.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(d.chunk_tokens(), 128, "no streams: chunks of the ceiling");
}
