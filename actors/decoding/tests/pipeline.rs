//! The actor pipeline against the sequential reference schedule ([`StagedModel`]) on the
//! embedded CPU backend: same losses, gradient norms, parameters and optimizer state, bit for
//! bit, whatever the number of stages P and micro-batches M; a failed micro-batch skips its
//! step cleanly; a checkpoint resumes a run exactly.

use nsactor_checkpoint::checkpoint;
use nsactor_decoding::{Pipeline, PipelinePlan};
use nsactor_engine::RuntimeError;
use nsactor_plugin_api::{Batch, EngineError};

mod common;

use common::*;

#[test]
fn any_number_of_stages_and_micro_batches_reproduces_the_sequential_schedule_bitwise() {
    let _serial = serial();
    for m in [1, 3, 5] {
        let steps: Vec<Vec<Batch>> = (0..3).map(|s| batches(100 * m as u64 + s, m)).collect();
        let (want, want_shards) = sequential(&steps);
        for p in [1, 2, 4] {
            let mut pl = pipeline(p, None);
            for (i, b) in steps.iter().enumerate() {
                let got = pl.train_step(b, &params(i)).unwrap();
                assert_eq!(bits(&got), want[i], "P={p} M={m} step {i}: {got:?}");
            }
            assert!(
                pl.save_stages().unwrap() == want_shards,
                "P={p} M={m}: parameters or optimizer state differ from the sequential schedule"
            );
            // Every worker did work, and the edge's thread is not a stage's.
            let busy = pl.busy();
            assert_eq!(busy.len(), p + 1);
            assert!(busy.iter().all(|(_, _, jobs)| *jobs > 0), "{busy:?}");
        }
    }
}

#[test]
fn layers_that_keep_their_graphs_train_exactly_as_layers_that_recompute() {
    let _serial = serial();
    // The sequential engine recomputes every layer's forward in its backward; a pipeline
    // whose layers keep their forward's autodiff graph instead must give the same losses,
    // gradient norms, parameters and optimizer state, bit for bit.
    let steps: Vec<Vec<Batch>> = (0..2).map(|s| batches(500 + s, 3)).collect();
    let (want, want_shards) = sequential(&steps);
    // P = 2 stages of 2 layers: the last layer of each keeps (1), or all of them (2, 9).
    for keep in [1, 2, 9] {
        let plan = PipelinePlan::balanced(4, 2, &[0]).unwrap();
        let mut train = train_cfg();
        train.keep_activations = keep.into();
        let mut pl = Pipeline::start(staged(), plan, train, None).unwrap();
        for (i, b) in steps.iter().enumerate() {
            let got = pl.train_step(b, &params(i)).unwrap();
            assert_eq!(bits(&got), want[i], "keep {keep}, step {i}: {got:?}");
        }
        assert!(
            pl.save_stages().unwrap() == want_shards,
            "keep {keep}: parameters or optimizer state differ from recomputing"
        );
    }
    // The number changed between steps, as `keep_activations = "auto"` changes it.
    let plan = PipelinePlan::balanced(4, 2, &[0]).unwrap();
    let mut train = train_cfg();
    train.keep_activations = 0.into();
    let mut pl = Pipeline::start(staged(), plan, train, None).unwrap();
    for (i, (b, keep)) in steps.iter().zip([0, 2]).enumerate() {
        pl.set_keep_activations(keep);
        assert_eq!(pl.keep_activations(), keep);
        let got = pl.train_step(b, &params(i)).unwrap();
        assert_eq!(bits(&got), want[i], "kept {keep} at step {i}: {got:?}");
    }
    assert!(pl.save_stages().unwrap() == want_shards);
}

#[test]
fn a_failing_micro_batch_skips_the_step_and_leaves_no_gradients_behind() {
    let _serial = serial();
    let good = batches(7, 3);
    let mut bad = good.clone();
    bad[1].inputs[5] = 999; // outside the 256-token vocabulary
    let after = batches(8, 3);

    let mut reference = staged();
    let want = reference.train_step(&after, &params(0)).unwrap();

    let mut pl = pipeline(2, None);
    let err = pl.train_step(&bad, &params(0)).unwrap_err();
    match &err {
        RuntimeError::Stage {
            who,
            error: EngineError::InvalidInput(msg),
        } => {
            assert_eq!(who, "edge");
            assert!(msg.contains("999"), "{msg}");
        }
        other => panic!("unexpected error {other:?}"),
    }
    // The failed step changed nothing: the next step equals a fresh model's first step.
    let got = pl.train_step(&after, &params(0)).unwrap();
    assert_eq!(bits(&got), bits(&want));
    assert!(pl.save_stages().unwrap() == reference.save_stages().unwrap());
    // Generation and evaluation run through the same actors.
    let greedy = pl.generate_greedy(&[3, 4, 5], 5, None, &[]).unwrap();
    assert_eq!(
        greedy,
        reference.generate_greedy(&[3, 4, 5], 5, None, &[]).unwrap()
    );
    assert_eq!(
        pl.eval_ce(&after[0]).unwrap().to_bits(),
        reference.eval_ce(&after[0]).unwrap().to_bits()
    );
}

#[test]
fn a_checkpoint_resumes_the_run_exactly() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut straight = pipeline(2, Some(sampler()));
    let want: Vec<_> = (0..4).map(|_| straight.step().unwrap()).collect();
    assert_eq!(want.last().unwrap().step, 4);

    let mut first = pipeline(2, Some(sampler()));
    for _ in 0..2 {
        first.step().unwrap();
    }
    let ckpt = first.checkpoint(dir.path(), 2, "cfg".into(), None).unwrap();
    drop(first);

    let (found, skipped) = checkpoint::latest_valid(dir.path());
    assert!(skipped.is_empty());
    let checkpoint::Loaded {
        dir: found_dir,
        manifest,
        shards,
    } = found.unwrap();
    assert_eq!((found_dir, manifest.step), (ckpt, 2));
    assert_eq!(shards.len(), 5);
    // A different P resumes it too: the schedule does not change the result.
    let mut resumed = pipeline(4, Some(sampler()));
    resumed.load_stages(shards).unwrap();
    resumed
        .set_position(manifest.step, manifest.data_cursor)
        .unwrap();
    for w in &want[2..] {
        let got = resumed.step().unwrap();
        assert_eq!(got.step, w.step);
        assert_eq!(got.lr.to_bits(), w.lr.to_bits());
        assert_eq!(got.cursor, w.cursor);
        assert_eq!(bits(&got.stats), bits(&w.stats), "step {}", w.step);
    }
    assert!(resumed.save_stages().unwrap() == straight.save_stages().unwrap());
}

#[test]
fn a_panicking_layer_actor_is_rebuilt_and_the_run_ends_as_if_nothing_happened() {
    let _serial = serial();
    let mut t = train_cfg();
    t.steps = 6;
    let (want, want_shards) = straight_run(&t);

    // Layer 2 panics in step 5: back to the step-4 checkpoint.
    let (mut p, got, back, _dir) = recovery_run(&t, Some("layer-panic:2:5"), 2);
    assert_eq!(back, [4]);
    assert_eq!(got, want);
    assert!(p.save_stages().unwrap() == want_shards);
    // Decoding runs on the rebuilt actors.
    assert_eq!(p.generate_greedy(&[3, 4], 3, None, &[]).unwrap().len(), 5);

    // Before any checkpoint: back to the initial weights and the first batch.
    let (mut p, got, back, _dir) = recovery_run(&t, Some("layer-panic:2:2"), 0);
    assert_eq!(back, [0]);
    assert_eq!(got, want);
    assert!(p.save_stages().unwrap() == want_shards);
}

#[test]
fn concurrent_sessions_are_batched_at_each_layer_and_decode_as_they_would_alone() {
    let _serial = serial();
    let p = pipeline(2, None);
    let d = p.decoder(256);
    // Prompts of several lengths (two share one, so their prefill batches too) and
    // continuations of several lengths, so sessions join and leave running cohorts.
    let work: Vec<(Vec<i64>, Vec<i64>)> = (0..7u64)
        .map(|i| {
            let prompt =
                batches(100 + i, 1)[0].inputs[..[3, 5, 5, 1, 8, 2, 6][i as usize]].to_vec();
            let tokens = batches(200 + i, 1)[0].inputs[..(6 + 3 * i as usize)].to_vec();
            (prompt, tokens)
        })
        .collect();
    let alone: Vec<Vec<Vec<f32>>> = work
        .iter()
        .map(|(pr, t)| p.block_on(forced(&d, pr.clone(), t.clone())))
        .collect();
    let (c0, n0) = d.batch_counts();
    assert_eq!(c0, n0, "one session at a time is never batched");
    let together: Vec<Vec<Vec<f32>>> = p.block_on(async {
        let tasks: Vec<_> = work
            .iter()
            .enumerate()
            .map(|(i, (pr, t))| {
                let (d, pr, t) = (d.clone(), pr.clone(), t.clone());
                tokio::spawn(async move {
                    // Staggered starts: later sessions join cohorts already running.
                    tokio::time::sleep(std::time::Duration::from_micros(300 * i as u64)).await;
                    forced(&d, pr, t).await
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    let mut worst = 0f32;
    for (a, b) in alone.iter().zip(&together) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x.len(), 256);
            for (u, v) in x.iter().zip(y) {
                worst = worst.max((u - v).abs());
            }
        }
    }
    let (c1, n1) = d.batch_counts();
    let mean = (n1 - n0) as f64 / (c1 - c0) as f64;
    eprintln!("mean cohort {mean:.2}, worst |Δlogit| {worst:e}");
    assert!(
        worst <= 1e-5,
        "batched logits differ from single-session ones by {worst}"
    );
    assert!(
        mean > 2.0,
        "sessions were not batched: mean cohort {mean:.2}"
    );
}

#[test]
fn streams_choose_the_tokens_single_feeds_choose_and_run_whole_cohorts() {
    use nsactor_decoding::{PickRequest, StreamPlan};
    use nsactor_engine::decode::SamplingParams;
    let _serial = serial();
    // One stage: one cohort in flight (with P stages, P cohorts alternate by design).
    let p = pipeline(1, None);
    let d = p.decoder(256);
    let (sessions, tokens) = (5usize, 12usize);
    let pick = |history: Vec<i64>, generated: Vec<i64>| {
        let sampling = SamplingParams {
            repetition_penalty: 1.3,
            ..SamplingParams::greedy()
        };
        PickRequest::new(
            sampling,
            &history,
            &generated,
            vec![(7, f32::NEG_INFINITY)],
            false,
        )
    };
    let prompts: Vec<Vec<i64>> = (0..sessions as u64)
        .map(|i| batches(300 + i, 1)[0].inputs[..2 + i as usize].to_vec())
        .collect();
    // One step at a time, the caller feeding each token back (the penalty's history grows).
    let alone: Vec<Vec<i64>> = prompts
        .iter()
        .map(|pr| {
            p.block_on(async {
                let s = d.session();
                let (mut history, mut out) = (pr.clone(), Vec::new());
                let mut ids = pr.clone();
                for _ in 0..tokens {
                    let t = d
                        .feed_pick(s, ids, pick(history.clone(), out.clone()))
                        .await
                        .unwrap()
                        .token;
                    history.push(t);
                    out.push(t);
                    ids = vec![t];
                }
                d.close(s).await;
                out
            })
        })
        .collect();
    let (c0, n0) = d.batch_counts();
    let streamed: Vec<Vec<i64>> = p.block_on(async {
        let tasks: Vec<_> = prompts
            .iter()
            .map(|pr| {
                let (d, pr) = (d.clone(), pr.clone());
                let first = pick(pr.clone(), Vec::new());
                tokio::spawn(async move {
                    let s = d.session();
                    let plan = StreamPlan {
                        pick: first,
                        more: tokens - 1,
                        end_tokens: Vec::new(),
                    };
                    let mut st = d.stream(s, pr, plan).await.unwrap();
                    let mut out = Vec::new();
                    while let Some(t) = st.next().await {
                        out.push(t.unwrap().token);
                    }
                    d.close(s).await;
                    out
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    assert_eq!(streamed, alone, "a stream picks as fed steps do");
    let (c1, n1) = d.batch_counts();
    eprintln!(
        "{} cohorts for {sessions} streams of {tokens} tokens",
        c1 - c0
    );
    assert_eq!(n1 - n0, (sessions * tokens) as u64, "one input per token");
    // Prompts of different lengths go in separate cohorts (here 5, then 11 steps of all 5);
    // once every session decodes, the batcher requeues them together and every step is one
    // cohort of all of them. A session spawned late may split a step or two off first.
    assert!(
        c1 - c0 < (tokens + 2 * sessions) as u64,
        "{} cohorts for {sessions} streams of {tokens} tokens",
        c1 - c0
    );
    assert_eq!(d.open_sessions(), 0);
}

#[test]
fn background_checkpoints_write_the_same_files_as_synchronous_ones() {
    let _serial = serial();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut background = pipeline(2, Some(sampler()));
    let mut synchronous = pipeline(2, Some(sampler()));
    for step in 1..=4u64 {
        background.step().unwrap();
        synchronous.step().unwrap();
        if step % 2 == 0 {
            let r = background
                .checkpoint_with(a.path(), 0, "cfg".into(), None, true)
                .unwrap();
            assert_eq!(r.step, step);
            assert!(r.written.is_none(), "the write goes on in the background");
            // The second checkpoint first finishes the write of the first.
            let previous = r.previous.map(|p| p.unwrap().step);
            assert_eq!(previous, (step == 4).then_some(2));
            let r = synchronous
                .checkpoint_with(b.path(), 0, "cfg".into(), None, false)
                .unwrap();
            assert_eq!(r.written.unwrap().step, step);
        }
    }
    let last = background.finish_checkpoint().unwrap().unwrap();
    assert_eq!(last.step, 4);
    assert!(background.finish_checkpoint().unwrap().is_none());
    for step in [2, 4] {
        let (da, db) = (
            checkpoint::step_dir(a.path(), step),
            checkpoint::step_dir(b.path(), step),
        );
        let mut names: Vec<_> = std::fs::read_dir(&db)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(
            names.len(),
            7,
            "five shards, the weights file and a manifest: {names:?}"
        );
        for n in names {
            let (x, y) = (std::fs::read(da.join(&n)), std::fs::read(db.join(&n)));
            assert!(x.unwrap() == y.unwrap(), "step {step}: {n:?} differs");
        }
    }
}

#[test]
fn nan_gradients_skip_the_step_and_change_nothing() {
    let _serial = serial();
    let mut cfg = train_cfg();
    cfg.inject_fault = Some("nan-grad:2".into());
    let plan = PipelinePlan::balanced(4, 2, &[0]).unwrap();
    let mut faulty = Pipeline::start(staged(), plan, cfg, Some(sampler())).unwrap();
    let mut clean = pipeline(2, Some(sampler()));
    let first = faulty.step().unwrap();
    assert_eq!(bits(&first.stats), bits(&clean.step().unwrap().stats));
    let before = faulty.save_stages().unwrap();
    let skipped = faulty.step().unwrap();
    let reference = clean.step().unwrap();
    assert!(skipped.stats.skipped && skipped.stats.grad_norm.is_nan());
    assert!(!reference.stats.skipped && reference.stats.grad_norm.is_finite());
    // The forward ran as usual; nothing was updated; the data moved past the batches.
    assert_eq!(skipped.stats.loss.to_bits(), reference.stats.loss.to_bits());
    assert!(
        faulty.save_stages().unwrap() == before,
        "a skipped step changes nothing"
    );
    assert_eq!((skipped.step, skipped.cursor), (2, reference.cursor));
    let next = faulty.step().unwrap();
    assert!(!next.stats.skipped && next.stats.grad_norm.is_finite());
    assert!(
        faulty.save_stages().unwrap() != before,
        "the step after it trains"
    );
}

#[test]
fn a_loss_spike_rolls_back_to_the_checkpoint_and_skips_the_batches_since() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = train_cfg();
    cfg.out_dir = dir.path().to_path_buf();
    cfg.loss_spike_factor = 5.0;
    cfg.loss_spike_window = 2;
    cfg.inject_fault = Some("loss-spike:4".into());
    let plan = PipelinePlan::balanced(4, 2, &[0]).unwrap();
    let mut faulty = Pipeline::start(staged(), plan, cfg, Some(sampler())).unwrap();
    let mut clean = pipeline(2, Some(sampler()));
    for _ in 0..2 {
        assert_eq!(
            bits(&faulty.step().unwrap().stats),
            bits(&clean.step().unwrap().stats)
        );
    }
    let root = dir.path().join("checkpoints");
    faulty.checkpoint(&root, 2, "cfg".into(), None).unwrap();
    let at_checkpoint = faulty.save_stages().unwrap();
    // Step 3 is judged (two steps seen) and passes; step 4 spikes.
    assert_eq!(
        bits(&faulty.step().unwrap().stats),
        bits(&clean.step().unwrap().stats)
    );
    match faulty.step() {
        Err(RuntimeError::LossSpike {
            step: 4,
            to_step: 2,
            factor,
            loss,
            mean,
        }) => assert!(factor == 5.0 && loss > 5.0 * mean, "{loss} vs {mean}"),
        other => panic!("expected a loss spike at step 4: {other:?}"),
    }
    assert!(
        faulty.save_stages().unwrap() == at_checkpoint,
        "rolled back to the step-2 checkpoint"
    );
    // The run goes on from step 2's weights with the data after step 4's batches: the same
    // as loading that checkpoint into the clean run, positioned after its own step 4.
    let after_4 = clean.step().unwrap().cursor;
    clean.load_stages(at_checkpoint).unwrap();
    clean.set_position(2, after_4).unwrap();
    let (got, want) = (faulty.step().unwrap(), clean.step().unwrap());
    assert_eq!((got.step, got.cursor), (3, want.cursor));
    assert_eq!(bits(&got.stats), bits(&want.stats));
    assert!(faulty.save_stages().unwrap() == clean.save_stages().unwrap());
}

/// A prompt longer than one pass's budget (here 1,024 tokens) is fed in two passes, and the
/// neuron states carry across them: the logits equal those of the same prompt fed by hand in
/// three pieces.
#[test]
fn a_prompt_longer_than_one_pass_is_fed_in_chunks_that_carry_the_states() {
    let _serial = serial();
    let p = pipeline(1, None);
    let d = p.decoder(256).with_pass_tokens(1024);
    let prompt: Vec<i64> = (0..1500).map(|i| 5 + (i * 37 % 200) as i64).collect();
    let (c0, _) = d.batch_counts();
    let whole = p.block_on(forced(&d, prompt.clone(), Vec::new())).remove(0);
    let (c1, _) = d.batch_counts();
    assert_eq!(c1 - c0, 2, "1,500 tokens at 1,024 a pass");
    let pieces = p.block_on(async {
        let s = d.session();
        let mut last = Vec::new();
        for part in prompt.chunks(500) {
            last = d.feed(s, part.to_vec()).await.unwrap();
        }
        d.close(s).await;
        last
    });
    let worst = whole
        .iter()
        .zip(&pieces)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-5, "chunked prefill differs by {worst}");
}

/// A stream that has ended while its reader still holds the session open is not waited for:
/// the other sessions' cohorts launch at once, never when the launch window runs out.
#[test]
fn an_ended_stream_whose_session_is_still_open_is_not_waited_for() {
    use nsactor_decoding::{PickRequest, StreamPlan};
    let _serial = serial();
    let p = pipeline(1, None);
    let d = p.decoder(256);
    let prompt = batches(77, 1)[0].inputs[..3].to_vec();
    let w0 = d.window_launches();
    let (short, long) = p.block_on(async {
        let (finished_tx, finished_rx) = tokio::sync::oneshot::channel::<()>();
        let stream = |more: usize| {
            let (d, prompt) = (d.clone(), prompt.clone());
            async move {
                let s = d.session();
                let plan = StreamPlan {
                    pick: PickRequest::greedy(false),
                    more,
                    end_tokens: Vec::new(),
                };
                let mut st = d.stream(s, prompt, plan).await.unwrap();
                let mut n = 0;
                while let Some(t) = st.next().await {
                    t.unwrap();
                    n += 1;
                }
                (s, n)
            }
        };
        // The short stream ends after 2 tokens; its session stays open until the long one
        // has finished, as a server's session does while its client reads the last tokens.
        let short = tokio::spawn({
            let (d, one) = (d.clone(), stream(1));
            async move {
                let (s, n) = one.await;
                let _ = finished_rx.await;
                d.close(s).await;
                n
            }
        });
        let long = tokio::spawn({
            let (d, one) = (d.clone(), stream(11));
            async move {
                let (s, n) = one.await;
                d.close(s).await;
                let _ = finished_tx.send(());
                n
            }
        });
        (short.await.unwrap(), long.await.unwrap())
    });
    assert_eq!((short, long), (2, 12));
    assert_eq!(
        d.window_launches() - w0,
        0,
        "cohorts waited out the launch window for a stream that had ended"
    );
    assert_eq!(d.open_sessions(), 0);
}
