//! Self-healing decoding on the embedded CPU backend: a layer that panics mid-generation fails
//! the sessions that had run, the supervisor rebuilds every actor and reloads the weights from
//! their source, and decoding goes on with the same logits as before the fault; past the
//! restart policy decoding fails and says why.

use nsactor_decoding::heal::{Health, RestartPolicy, WeightSource};
use nsactor_decoding::{AsyncDecoder, Pipeline, PipelinePlan};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod common;

use common::*;

/// How the weight source answers after its first read.
#[derive(Clone, Copy)]
enum Again {
    Reads,
    /// Reads, after this long (a slow disk: the rebuild takes at least as long).
    Slowly(Duration),
    Fails,
}

/// A pipeline of 4 layers in `stages` stages whose layer 1 panics in its `pass`-th decoding
/// pass, loaded from a source of trained weights (unlike the fresh stages a rebuild opens)
/// that answers later reads as `again` says, and how many times the source was read.
fn faulty(pass: u64, stages: usize, again: Again) -> (Pipeline, Arc<AtomicUsize>) {
    let mut trained = pipeline(1, None);
    trained.train_step(&batches(3, 1), &params(0)).unwrap();
    let shards: Vec<Arc<Vec<u8>>> = trained
        .save_stages()
        .unwrap()
        .into_iter()
        .map(Arc::new)
        .collect();
    let mut train = train_cfg();
    train.inject_fault = Some(format!("session-panic:1:{pass}"));
    let plan = PipelinePlan::balanced(4, stages, &[0]).unwrap();
    let mut p = Pipeline::start(staged(), plan, train, None).unwrap();
    let reads = Arc::new(AtomicUsize::new(0));
    let counted = reads.clone();
    let source: WeightSource = Arc::new(move || {
        if counted.fetch_add(1, Ordering::SeqCst) > 0 {
            match again {
                Again::Reads => {}
                Again::Slowly(d) => std::thread::sleep(d),
                Again::Fails => {
                    return Err(nsactor_engine::RuntimeError::Invalid(
                        "checkpoint gone".into(),
                    ));
                }
            }
        }
        Ok(shards.clone())
    });
    p.load_from(source).unwrap();
    (p, reads)
}

/// The logits after each of `ids`, fed one at a time to a new session (closed after).
async fn logits(d: &AsyncDecoder, ids: &[i64]) -> Vec<Vec<f32>> {
    let s = d.session();
    let mut out = Vec::new();
    for &id in ids {
        out.push(d.feed(s, vec![id]).await.unwrap());
    }
    d.close(s).await;
    out
}

async fn wait_for(d: &AsyncDecoder, want: impl Fn(&Health) -> bool) -> Health {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let h = d.health();
        if want(&h) {
            return h;
        }
        assert!(Instant::now() < deadline, "still {h:?} after 60 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[test]
fn a_stage_lost_while_decoding_is_rebuilt_and_decoding_goes_on_with_the_same_weights() {
    let _serial = serial();
    let ids = [5i64, 17, 3];
    // Passes 1–3 are the reference; pass 5, the victim's second input, panics.
    let (p, reads) = faulty(5, 2, Again::Reads);
    let d = p.decoder(256);
    p.block_on(async {
        let before = logits(&d, &ids).await;
        assert_eq!(d.health(), Health::Serving);
        let victim = d.session();
        d.feed(victim, vec![ids[0]]).await.unwrap();
        let err = d.feed(victim, vec![ids[1]]).await.unwrap_err().to_string();
        assert!(err.contains("panic"), "{err}");
        // Inputs of new sessions wait for the rebuild and then run on the new actors.
        let after = logits(&d, &ids).await;
        assert_eq!(
            after, before,
            "the rebuilt pipeline decodes with the source's weights"
        );
        assert_eq!(d.health(), Health::Serving);
        assert_eq!(d.recoveries(), 1);
        assert_eq!(
            reads.load(Ordering::SeqCst),
            2,
            "read at load and at the rebuild"
        );
        // The victim's states went with the old actors: it is refused until closed.
        let lost = d.feed(victim, vec![ids[2]]).await.unwrap_err().to_string();
        assert!(lost.contains("states were lost"), "{lost}");
        d.close(victim).await;
        assert_eq!(d.open_sessions(), 0);
    });
}

#[test]
fn a_stream_running_when_its_stage_is_lost_ends_with_the_error_and_a_new_one_runs() {
    use nsactor_decoding::{PickRequest, StreamPlan};
    let _serial = serial();
    let (p, _) = faulty(3, 2, Again::Reads);
    let d = p.decoder(256);
    p.block_on(async {
        let plan = StreamPlan {
            pick: PickRequest::greedy(false),
            more: 20,
            end_tokens: Vec::new(),
        };
        let s = d.session();
        let mut st = d.stream(s, vec![5, 17], plan.clone()).await.unwrap();
        let mut tokens = 0;
        let err = loop {
            match st
                .next()
                .await
                .expect("a stream ends with its error, not silently")
            {
                Ok(_) => tokens += 1,
                Err(e) => break e.to_string(),
            }
        };
        assert_eq!(tokens, 2, "passes 1 and 2 chose tokens, pass 3 panicked");
        assert!(err.contains("panic"), "{err}");
        assert!(st.next().await.is_none());
        d.close(s).await;
        // A new stream runs to its end on the rebuilt actors.
        let s = d.session();
        let mut st = d.stream(s, vec![5, 17], plan).await.unwrap();
        let mut n = 0;
        while let Some(t) = st.next().await {
            t.unwrap();
            n += 1;
        }
        assert_eq!(n, 21);
        d.close(s).await;
        assert_eq!((d.health(), d.recoveries()), (Health::Serving, 1));
    });
}

#[test]
fn past_the_restart_policy_decoding_fails_and_refuses_every_input() {
    let _serial = serial();
    let (p, reads) = faulty(2, 2, Again::Reads);
    let d = p.decoder(256);
    d.set_heal_policy(RestartPolicy::new(0, Duration::from_secs(60)));
    let cause = p.block_on(fails_at_pass_2(&d));
    assert!(
        cause.contains("panic") && cause.contains("0 rebuild"),
        "{cause}"
    );
    assert_eq!(reads.load(Ordering::SeqCst), 1, "no rebuild was tried");
}

/// Feeds a session until its second pass panics; waits for decoding to fail, checks that it
/// refuses a new session, and returns why it failed.
async fn fails_at_pass_2(d: &AsyncDecoder) -> String {
    let s = d.session();
    d.feed(s, vec![5]).await.unwrap();
    assert!(d.feed(s, vec![17]).await.is_err());
    let Health::Failed { cause } = wait_for(d, |h| matches!(h, Health::Failed { .. })).await else {
        unreachable!()
    };
    let e = d.feed(d.session(), vec![5]).await.unwrap_err().to_string();
    assert!(e.contains("decoding has failed"), "{e}");
    d.close(s).await;
    cause
}

/// A session's input that waits behind the cohort that loses the stage is refused at once,
/// while the rebuild is still reading the weights; a new session's input waits and then runs.
#[test]
fn an_input_waiting_behind_the_lost_cohort_is_refused_at_once_and_a_new_one_waits() {
    let _serial = serial();
    // One stage: one cohort in flight at a time, so A's token waits behind B's prompt.
    let (p, _) = faulty(2, 1, Again::Slowly(Duration::from_millis(500)));
    let d = p.decoder(256);
    p.block_on(async {
        let a = d.session();
        d.feed(a, vec![5]).await.unwrap();
        let b = d.session();
        // B's prompt is sent first and launches (pass 2 panics); A's token waits behind it.
        let (eb, ea) = tokio::join!(d.feed(b, vec![3, 4, 6]), async {
            let r = d.feed(a, vec![17]).await;
            (r, d.health())
        });
        let eb = eb.unwrap_err().to_string();
        assert!(eb.contains("panic"), "{eb}");
        let (ea, health) = ea;
        let ea = ea.unwrap_err().to_string();
        assert!(ea.contains("states were lost"), "{ea}");
        assert!(
            matches!(health, Health::Recovering { .. }),
            "refused without waiting for the rebuild: {health:?}"
        );
        // A new session queued during the rebuild runs after it.
        let c = d.session();
        d.feed(c, vec![5]).await.unwrap();
        assert_eq!(d.health(), Health::Serving);
        for s in [a, b, c] {
            d.close(s).await;
        }
        assert_eq!(d.open_sessions(), 0);
    });
}

#[test]
fn a_rebuild_whose_weights_cannot_be_read_fails_decoding_with_the_cause() {
    let _serial = serial();
    let (p, reads) = faulty(2, 2, Again::Fails);
    let d = p.decoder(256);
    let cause = p.block_on(fails_at_pass_2(&d));
    assert!(
        cause.contains("rebuilding after a lost stage failed") && cause.contains("checkpoint gone"),
        "{cause}"
    );
    assert_eq!(reads.load(Ordering::SeqCst), 2);
}
