//! Cohorts padded up to their bucket, and the serving warm-up, on the CPU backend (issue 29):
//! padding changes no real session's logits by a single bit, and a warm-up runs every size of
//! its plan and changes nothing that is decoded after it.

mod common;

use common::{batches, forced, pipeline, serial};
use nsactor_decoding::AsyncDecoder;
use nsactor_decoding::buckets::CohortBuckets;
use nsactor_decoding::warmup::WarmupPlan;

/// Seven sessions with prompts and continuations of several lengths, all at once (so cohorts
/// of 3, 5, 7 … sessions form and change): every session's logits at every position.
async fn concurrent(d: &AsyncDecoder) -> Vec<Vec<Vec<f32>>> {
    let tasks: Vec<_> = (0..7u64)
        .map(|i| {
            let d = d.clone();
            let prompt =
                batches(100 + i, 1)[0].inputs[..[3, 5, 5, 1, 8, 2, 6][i as usize]].to_vec();
            let tokens = batches(200 + i, 1)[0].inputs[..(4 + 2 * i as usize)].to_vec();
            tokio::spawn(async move { forced(&d, prompt, tokens).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn bits(v: &[Vec<Vec<f32>>]) -> Vec<Vec<Vec<u32>>> {
    v.iter()
        .map(|s| {
            s.iter()
                .map(|r| r.iter().map(|x| x.to_bits()).collect())
                .collect()
        })
        .collect()
}

#[test]
fn padded_cohorts_give_every_session_the_same_logits_bit_for_bit() {
    let _serial = serial();
    let p = pipeline(2, None);
    let d = p.decoder(256);
    d.set_buckets(CohortBuckets::Exact);
    let exact = p.block_on(concurrent(&d));
    assert_eq!(d.padded_rows(), 0);
    // Every cohort of 2 or more sessions pads up to 8.
    d.set_buckets(CohortBuckets::parse("1,8", 8).unwrap());
    let (c0, n0) = d.batch_counts();
    let padded = p.block_on(concurrent(&d));
    let (c1, n1) = d.batch_counts();
    let pads = d.padded_rows();
    assert!(pads > 0, "no cohort was padded");
    eprintln!(
        "{} cohorts, {} session rows, {pads} pad rows",
        c1 - c0,
        n1 - n0
    );
    assert!(
        bits(&exact) == bits(&padded),
        "a session's logits changed when its cohort was padded"
    );
    assert_eq!(d.open_sessions(), 0, "pad sessions are not counted as open");
}

#[test]
fn a_warm_up_runs_every_size_of_its_plan_and_changes_no_later_decoding() {
    let _serial = serial();
    let p = pipeline(2, None);
    let d = p.decoder(256);
    let before = p.block_on(concurrent(&d));
    let plan = WarmupPlan {
        sizes: vec![1, 3, 8],
        passes: Default::default(),
    };
    let mut seen = Vec::new();
    let warmed = p
        .block_on(d.warm_up(&plan, |done, total, w| seen.push((done, total, w.size))))
        .unwrap();
    assert_eq!(seen, vec![(1, 3, 1), (2, 3, 3), (3, 3, 8)]);
    // A prefill, three greedy steps, a sampled one and a long chunk (this model's pass holds
    // 16,384 / K = 5,461 tokens, more than the 8-token prompt) per size; one session also
    // prefills lengths 2 to 16 (8 is the prompt's) and the powers of two from 32 to 4,096.
    let passes: Vec<(usize, usize)> = warmed.iter().map(|w| (w.size, w.passes)).collect();
    assert_eq!(passes, vec![(1, 6 + 14 + 8), (3, 6), (8, 6)], "{warmed:?}");
    let after = p.block_on(concurrent(&d));
    assert!(bits(&before) == bits(&after));
}
