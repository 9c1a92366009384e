//! How passes are cut, on the embedded CPU backend: a prompt fed beside other sessions goes in
//! chunks (their steps run between), paced by time beside decoding streams
//! (`nsactor_decoding::pacer`), and its logits are bit for bit those of the prompt fed alone;
//! a pass holds at most `with_pass_sessions` sessions, the others going in further cohorts.

mod common;

use common::*;
use nsactor_decoding::Pipeline;

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

/// Beside a session that decodes token after token, a prompt's chunks are paced by the passes
/// the batcher reports: with a share of a step every pass meets, they climb from the floor
/// (8 tokens) to the ceiling (128); with a share no pass can meet, they halve back down to
/// the floor; the prompt's logits are those of feeding it alone either way. Without the
/// stream, the ceiling again.
#[test]
fn chunks_beside_a_decoding_stream_climb_and_fall_with_their_share_and_keep_the_logits() {
    let _serial = serial();
    let p = pipeline(1, None);
    let d = p
        .decoder(256)
        .with_pass_tokens(1024)
        .with_chunk_tokens(128)
        .with_chunk_share(1e6);
    let prompt: Vec<i64> = (0..600).map(|i| 5 + (i * 31 % 200) as i64).collect();
    let alone = p.block_on(forced(&d, prompt.clone(), Vec::new())).remove(0);
    let (runs, steps) = p.block_on(async {
        let stream = Stepper::start(&d).await;
        while d.pacer().step_seconds().is_none() {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let mut runs = Vec::new();
        for share in [1e6, 1e-6] {
            d.pacer().set_share(share);
            let (c0, s0) = (d.batch_counts().0, stream.steps());
            let s = d.session();
            let logits = d.feed(s, prompt.clone()).await.unwrap();
            let paced = d.chunk_tokens();
            // Cohorts launched meanwhile less the stream's steps answered (one step may be in
            // flight at either end): the prompt's passes, give or take one.
            let (c1, s1) = (d.batch_counts().0, stream.steps());
            let passes = (c1 - c0).saturating_sub(s1 - s0);
            d.close(s).await;
            runs.push((logits, paced, passes));
        }
        (runs, stream.stop(&d).await)
    });
    // Climbing: 8, 16, 32, 64, then 128 × 3 and the last 96 tokens: 8 passes.
    let floor = nsactor_decoding::pacer::MIN_CHUNK;
    assert_eq!(
        runs[0].1, 128,
        "chunks climbed to the ceiling ({steps} steps beside)"
    );
    assert!(
        (7..=9).contains(&runs[0].2),
        "8 passes climbing: {}",
        runs[0].2
    );
    // Falling: 128, 64, 32, 16, then 45 × 8: 49 passes.
    assert_eq!(runs[1].1, floor, "chunks fell to the floor");
    assert!(
        (48..=50).contains(&runs[1].2),
        "49 passes falling: {}",
        runs[1].2
    );
    assert!(steps >= 8, "the stream stepped between the chunks: {steps}");
    for (logits, _, _) in &runs {
        assert!(
            bits(&alone) == bits(logits),
            "the paced chunks changed the logits"
        );
    }
    // The stream stopped: the ceiling again, after STALE (or two chunk passes).
    let quiet = std::time::Instant::now();
    while d.chunk_tokens() != 128 && quiet.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(d.chunk_tokens(), 128, "no streams: chunks of the ceiling");
}

/// Sessions decoding together, each with 8 tokens forced after its prompt, all at once.
fn together(p: &Pipeline, d: &nsactor_decoding::AsyncDecoder) -> Vec<Vec<Vec<f32>>> {
    p.block_on(async {
        let tasks: Vec<_> = (0..6i64)
            .map(|i| {
                let d = d.clone();
                tokio::spawn(async move {
                    forced(&d, vec![5 + i, 9, 11 + 2 * i], (20..28).collect()).await
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    })
}

/// `with_pass_sessions(2)` (`serve --max-num-seqs 2`): six sessions decoding at once run in
/// cohorts of at most two, two in flight over the two stages, where without the cap they
/// batch past two; every session's logits are bit for bit the same either way.
#[test]
fn a_pass_holds_at_most_the_session_cap_with_the_same_logits() {
    let _serial = serial();
    let p = pipeline(2, None);
    let d = p.decoder(256);
    let mean = |(c0, n0): (u64, u64), (c1, n1): (u64, u64)| (n1 - n0) as f64 / (c1 - c0) as f64;
    let b0 = d.batch_counts();
    let free = together(&p, &d);
    let b1 = d.batch_counts();
    let d = d.with_pass_sessions(2);
    let capped = together(&p, &d);
    let b2 = d.batch_counts();
    let (m_free, m_capped) = (mean(b0, b1), mean(b1, b2));
    eprintln!("mean cohort: {m_free:.2} without the cap, {m_capped:.2} with 2");
    assert!(m_free > 2.0, "without the cap, cohorts of {m_free:.2}");
    assert!(
        m_capped <= 2.0 && m_capped > 1.0,
        "with a cap of 2, cohorts of {m_capped:.2}"
    );
    for (a, b) in free.iter().zip(&capped) {
        for (x, y) in a.iter().zip(b) {
            assert!(bits(x) == bits(y), "the cap changed a session's logits");
        }
    }
}

/// A prompt given up (its client gone) feeds no chunk it had not asked for yet: given up
/// before, no pass runs; given up after its first chunk, the rest are not fed. The call ends
/// with `Cancelled`, the close forgets the mark, and the decoder serves on.
#[test]
fn a_prompt_given_up_feeds_no_further_chunk() {
    let _serial = serial();
    let p = pipeline(1, None);
    let d = p.decoder(256).with_pass_tokens(1024).with_chunk_tokens(100);
    let prompt: Vec<i64> = (0..450).map(|i| 5 + (i * 29 % 200) as i64).collect();
    let (before, midway) = p.block_on(async {
        let other = d.session();
        d.feed(other, vec![7, 8]).await.unwrap();
        // Given up before it starts.
        let s = d.session();
        d.give_up(s);
        let c0 = d.batch_counts().0;
        let r = d.feed(s, prompt.clone()).await;
        let before = (r, d.batch_counts().0 - c0);
        d.close(s).await;
        // Given up once its first chunk has run (five chunks of 100 beside `other`).
        let s = d.session();
        let c0 = d.batch_counts().0;
        let feeding = tokio::spawn({
            let (d, prompt) = (d.clone(), prompt.clone());
            async move { d.feed(s, prompt).await }
        });
        while d.batch_counts().0 == c0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        d.give_up(s);
        let r = feeding.await.unwrap();
        let midway = (r, d.batch_counts().0 - c0);
        d.close(s).await;
        // A new session is fed whole.
        let s = d.session();
        d.feed(s, prompt.clone()).await.unwrap();
        d.close(s).await;
        d.close(other).await;
        (before, midway)
    });
    assert!(
        matches!(before.0, Err(nsactor_engine::RuntimeError::Cancelled(_))),
        "{:?}",
        before.0.map(|l| l.len())
    );
    assert_eq!(
        before.1, 0,
        "a prompt given up before it starts runs no pass"
    );
    assert!(
        matches!(midway.0, Err(nsactor_engine::RuntimeError::Cancelled(_))),
        "{:?}",
        midway.0.map(|l| l.len())
    );
    assert!(
        (1..5).contains(&midway.1),
        "given up after its first chunk, {} of its 5 passes ran",
        midway.1
    );
}
