//! `nsactor bench kernels` on the CPU backend: the check passes for the reference scans (to
//! the bit), `only` runs just the parts named, and the option parser refuses what it does not
//! know.

use burn_ndarray::NdArray;
use nsactor_kernels::bench::{ScanBench, run};

#[test]
fn the_cpu_scans_pass_the_check_and_are_timed() {
    let cfg = ScanBench::model_0_9b()
        .with_options("steps=40,batch=2,elem_dim=24,row_dim=16,check_steps=13,reps=1,dim=12,k=4")
        .unwrap();
    assert_eq!((cfg.steps, cfg.check_steps, cfg.reps), (40, 13, 1));
    assert_eq!((cfg.dim, cfg.k), (12, 4));
    let report = run::<NdArray<f32>>(&Default::default(), &cfg).unwrap();
    for name in [
        "per-element forward",
        "per-element backward",
        "row-parameter forward",
        "row-parameter backward",
        "selective fused fwd",
        "selective fused bwd",
        "ffn neurons fwd",
        "ffn neurons bwd",
        "ponder agg fwd",
        "ponder agg bwd",
        "norm + input plif fwd",
        "norm + input plif bwd",
        "adam update",
        "gradient square sums",
    ] {
        let line = report
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} line in\n{report}"));
        let err: f32 = line[name.len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(err, 0.0, "the CPU runs the reference itself: {line}");
        assert!(!line.contains("WRONG"), "{line}");
    }
}

#[test]
fn only_the_parts_asked_for_run() {
    let cfg = ScanBench::model_0_9b()
        .with_options("steps=40,batch=2,elem_dim=24,row_dim=16,check_steps=13,reps=1,dim=12,k=4")
        .unwrap()
        .with_only(&["selective", "optim"])
        .unwrap();
    let report = run::<NdArray<f32>>(&Default::default(), &cfg).unwrap();
    for name in ["selective fused fwd", "selective fused bwd", "adam update"] {
        assert!(
            report.lines().any(|l| l.starts_with(name)),
            "no {name} in\n{report}"
        );
    }
    for name in [
        "per-element forward",
        "ffn neurons fwd",
        "ponder agg fwd",
        "gated output",
    ] {
        assert!(!report.contains(name), "{name} ran in\n{report}");
    }
    let e = ScanBench::model_0_9b()
        .with_only(&["selectiv"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown part `selectiv`") && e.contains("selective"),
        "{e}"
    );
}

#[test]
fn unknown_or_bad_options_are_refused_by_name() {
    let base = ScanBench::model_0_9b;
    let e = base().with_options("stepz=3").unwrap_err().to_string();
    assert!(e.contains("unknown option `stepz`"), "{e}");
    let e = base().with_options("steps=x").unwrap_err().to_string();
    assert!(e.contains("steps: `x` is not a whole number"), "{e}");
    let e = base().with_options("reps=0").unwrap_err().to_string();
    assert!(e.contains("reps must be at least 1"), "{e}");
    let e = base().with_options("batch").unwrap_err().to_string();
    assert!(e.contains("`batch` is not key=value"), "{e}");
}
