//! Prompt cohorts and decoding steps take turns (`nsactor_decoding::batcher`): a burst of
//! prompts arriving together, each its own cohort (their lengths differ), does not hold a
//! decoding stream's next token until the whole burst is prefilled. On the embedded CPU
//! backend.

mod common;

use common::*;

#[test]
fn a_burst_of_prompts_lets_a_decoding_stream_step_between_its_cohorts() {
    let _serial = serial();
    let p = pipeline(1, None);
    // Chunks at their ceiling: the pacer would cut a prompt that started before the rest of
    // the burst was counted as feeding (one stream, one prompt) at its floor, a cohort more.
    let d = p.decoder(256).with_pass_tokens(1024).with_chunk_share(0.0);
    const BURST: usize = 6;
    let (during, alone) = p.block_on(async {
        let stream = Stepper::start(&d).await;
        while stream.steps() < 2 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        // Six prompts of six lengths at once: six prompt cohorts.
        let sessions: Vec<_> = (0..BURST).map(|_| d.session()).collect();
        let (c0, s0) = (d.batch_counts().0, stream.steps());
        let feeds: Vec<_> = sessions
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let d = d.clone();
                let prompt: Vec<i64> = (0..12 * (i + 1)).map(|j| 5 + (j * 7 % 90) as i64).collect();
                tokio::spawn(async move { d.feed(s, prompt).await.unwrap() })
            })
            .collect();
        for f in feeds {
            f.await.unwrap();
        }
        let (c1, s1) = (d.batch_counts().0, stream.steps());
        stream.stop(&d).await;
        for s in sessions {
            d.close(s).await;
        }
        // The prompts' cohorts: those launched less the steps answered meanwhile.
        let prompts = (c1 - c0).saturating_sub(s1 - s0);
        (s1 - s0, prompts)
    });
    assert!(
        (BURST as u64 - 1..=BURST as u64 + 1).contains(&alone),
        "the burst ran as {alone} cohorts, not {BURST}"
    );
    // Oldest first, the stream's next step (queued after the burst) ran after all six: one or
    // two steps during the burst. Taking turns, one after each prompt cohort but the last.
    assert!(
        during >= BURST as u64 - 2,
        "the stream stepped {during} times while {BURST} prompt cohorts ran"
    );
}
