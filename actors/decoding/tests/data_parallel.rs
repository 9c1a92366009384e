//! Data parallelism × pipeline on the embedded CPU backend: D replicas of a P-stage pipeline,
//! each running a contiguous share of the step's micro-batches, give the per-step losses,
//! gradient norms, parameters and optimizer state of the sequential schedule at the same
//! global batch, bit for bit (`ordered` reduction); a run saved under one layout resumes
//! under another exactly; the `sum` reduction stays within float noise of it; bad layouts
//! are refused with a clear error.

mod common;

use common::*;
use nsactor_decoding::{Pipeline, PipelinePlan};
use nsactor_engine::config::{DpReduce, TrainConfig};
use nsactor_plugin_api::Batch;

fn replicated(d: usize, p: usize, reduce: DpReduce) -> Pipeline {
    let mut t: TrainConfig = train_cfg();
    t.data_parallel = d;
    t.dp_reduce = reduce;
    let plan = PipelinePlan::balanced(4, p, &[0]).unwrap();
    Pipeline::start(staged(), plan, t, None).unwrap()
}

#[test]
fn replicas_times_stages_reproduce_the_sequential_schedule_bitwise() {
    let _serial = serial();
    for m in [3, 4] {
        let steps: Vec<Vec<Batch>> = (0..3)
            .map(|s| batches(900 + 10 * m as u64 + s, m))
            .collect();
        let (want, want_shards) = sequential(&steps);
        for d in [1, 2, 3] {
            for p in [1, 2] {
                let mut pl = replicated(d, p, DpReduce::Auto);
                // Every replica's loss enters each step, and a replica whose parameters had
                // drifted from replica 0's would change the next step's loss.
                for (i, b) in steps.iter().enumerate() {
                    let got = pl.train_step(b, &params(i)).unwrap();
                    assert_eq!(bits(&got), want[i], "D={d} P={p} M={m} step {i}: {got:?}");
                }
                assert!(
                    pl.save_stages().unwrap() == want_shards,
                    "D={d} P={p} M={m}: parameters or optimizer state differ"
                );
            }
        }
    }
}

#[test]
fn a_run_saved_under_one_layout_resumes_under_another_exactly() {
    let _serial = serial();
    let steps: Vec<Vec<Batch>> = (0..4).map(|s| batches(1300 + s, 6)).collect();
    let (want, want_shards) = sequential(&steps);
    let mut first = replicated(2, 2, DpReduce::Ordered);
    for (i, b) in steps[..2].iter().enumerate() {
        assert_eq!(bits(&first.train_step(b, &params(i)).unwrap()), want[i]);
    }
    let shards = first.save_stages().unwrap();
    drop(first);
    let mut resumed = replicated(3, 1, DpReduce::Ordered);
    resumed.load_stages(shards).unwrap();
    for (i, b) in steps.iter().enumerate().skip(2) {
        let got = resumed.train_step(b, &params(i)).unwrap();
        assert_eq!(
            bits(&got),
            want[i],
            "step {i} after resuming D=2 P=2 as D=3 P=1"
        );
    }
    assert!(resumed.save_stages().unwrap() == want_shards);
}

#[test]
fn summing_replica_sums_stays_within_float_noise_of_the_sequential_schedule() {
    let _serial = serial();
    let steps: Vec<Vec<Batch>> = (0..3).map(|s| batches(1700 + s, 4)).collect();
    let mut reference = staged();
    let mut pl = replicated(2, 2, DpReduce::Sum);
    for (i, b) in steps.iter().enumerate() {
        let want = reference.train_step(b, &params(i)).unwrap();
        let got = pl.train_step(b, &params(i)).unwrap();
        // The losses of step 0 are computed before any update: the same bits. Later steps
        // differ only by the reordered gradient sums' rounding.
        let tol = if i == 0 { 0.0 } else { 1e-5 };
        assert!(
            (got.loss - want.loss).abs() <= tol * want.loss.abs(),
            "step {i}: {} vs {}",
            got.loss,
            want.loss
        );
        let rel = (got.grad_norm - want.grad_norm).abs() / want.grad_norm;
        assert!(
            rel < 1e-5,
            "step {i}: grad norm {} vs {}",
            got.grad_norm,
            want.grad_norm
        );
    }
}

#[test]
fn layouts_that_do_not_fit_are_refused_with_the_reason() {
    let _serial = serial();
    let mut t = train_cfg();
    t.data_parallel = 4; // 3 micro-batches per step
    let e = t.validate("test").unwrap_err().to_string();
    assert!(
        e.contains("data_parallel") && e.contains("accumulation"),
        "{e}"
    );

    let mut t = train_cfg();
    t.data_parallel = 2;
    t.devices = Some(vec![0, 1, 2]);
    let plan = PipelinePlan::balanced(4, 1, &[0]).unwrap();
    let e = Pipeline::start(staged(), plan, t, None)
        .err()
        .expect("three devices do not split over two replicas")
        .to_string();
    assert!(e.contains("equal blocks"), "{e}");
}

/// A layer that panics under two replicas (ordered reduction) rolls the run back to its
/// checkpoint and the run ends as the one without the fault does, bit for bit. The rebuilt
/// stages wait for the checkpoint (`InitialWeights::Loaded`) and take the gradient hold while
/// the replicas are wired, before it is loaded.
#[test]
fn a_replicated_run_recovers_from_its_checkpoint_exactly() {
    let _serial = serial();
    let mut t = train_cfg();
    t.steps = 6;
    t.accumulation = 4;
    t.data_parallel = 2;
    t.dp_reduce = DpReduce::Ordered;
    let (want, want_shards) = straight_run(&t);

    let (mut p, got, back, _dir) = recovery_run(&t, Some("layer-panic:2:5"), 2);
    assert_eq!(back, [4]);
    assert_eq!(got, want);
    assert!(p.save_stages().unwrap() == want_shards);
}
