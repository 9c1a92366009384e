//! The knobs' parsing, printing and layering, as the host and a plugin use them.

use super::*;

#[test]
fn every_knob_round_trips_through_its_option() {
    let mut t = KernelTuning::default();
    for (k, v) in [
        ("decode_graphs", "off"),
        ("decode_graph_rows", "16"),
        ("batch_invariant", "first"),
        ("gemm_chain_rows", "64"),
        ("gemm_submit", "blocking"),
        ("norm_plif", "composed"),
        ("row_scan", "per-unit"),
        ("scan_cube", "64"),
        ("scan_unroll", "8"),
        ("stage_async", "4x12x3"),
        ("stage_row_forward", "8x64"),
        ("decode_wide_cols", "4096"),
        ("decode_wide_vector", "off"),
        ("block_scan_ahead", "off"),
        ("kernel_bounds_check", "on"),
        ("norm_plif_prefetch", "4x4"),
    ] {
        t.set(k, v).unwrap();
    }
    assert_eq!(t.stage_async.unwrap().width, 32);
    let options = t.to_options();
    assert!(
        options.contains("kernel.stage_async=4x12x3x32"),
        "{options}"
    );
    assert!(
        !options.contains("flush"),
        "a default knob is not sent: {options}"
    );
    let (back, rest) =
        KernelTuning::from_options(options.split(',').chain(["precision=bf16"])).unwrap();
    assert_eq!(back, t);
    assert_eq!(rest, ["precision=bf16"]);
    assert_eq!(
        KNOBS.len(),
        KNOBS
            .iter()
            .map(|k| k.key)
            .collect::<std::collections::HashSet<_>>()
            .len()
    );
    for k in KNOBS {
        assert!(
            !KernelTuning::default().value(k.key).is_empty(),
            "{}",
            k.key
        );
    }
}

#[test]
fn bad_values_and_unknown_knobs_are_refused_with_what_they_take() {
    let mut t = KernelTuning::default();
    let e = t.set("scan_cube", "0").unwrap_err();
    assert!(e.contains("from 1 to 1024"), "{e}");
    let e = t.set("stage_row_forward", "40x8").unwrap_err();
    assert!(e.contains("producers 1 to 31"), "{e}");
    let e = t.set("stage_async", "4x12x3x64x1").unwrap_err();
    assert!(e.contains("PxCxD"), "{e}");
    let e = t.set("stage_async", "31x12x3x64").unwrap_err();
    assert!(e.contains("≤ 1024"), "{e}");
    let e = t.set("decode_fusion", "maybe").unwrap_err();
    assert!(e.contains("on or off"), "{e}");
    let e = t.set("scan_cubes", "32").unwrap_err();
    assert!(
        e.contains("no kernel knob `scan_cubes`") && e.contains("scan_cube"),
        "{e}"
    );
    let e = KernelTuning::from_options(["kernel.scan_cube=big"]).unwrap_err();
    assert!(
        e.to_string().contains("option `kernel.scan_cube=big`"),
        "{e}"
    );
    let e = KernelTuning::default()
        .with_vars(|n| (n == "NSACTOR_ROW_SCAN").then(|| "rows".to_string()))
        .unwrap_err();
    assert!(e.to_string().contains("$NSACTOR_ROW_SCAN: `rows`"), "{e}");
    let e = t.set("stage_block_scan", "8x96").unwrap_err();
    assert!(e.contains("at most 64"), "{e}");
    assert_eq!(
        t,
        KernelTuning::default(),
        "a refused value changes nothing"
    );
    let empty = KernelTuning::default()
        .with_vars(|n| (n == "NSACTOR_DECODE_FUSION").then(String::new))
        .unwrap();
    assert_eq!(
        empty,
        KernelTuning::default(),
        "an empty variable is no value"
    );
    let warned = std::cell::RefCell::new(Vec::new());
    let lenient = KernelTuning::default().with_vars_lenient(
        |n| match n {
            "NSACTOR_SCAN_CUBE" => Some("0".into()),
            "NSACTOR_DECODE_FUSION" => Some("off".into()),
            _ => None,
        },
        |w| warned.borrow_mut().push(w.to_string()),
    );
    assert!(
        !lenient.decode_fusion && lenient.scan_cube == 32,
        "{lenient:?}"
    );
    assert!(
        warned.borrow()[0].contains("$NSACTOR_SCAN_CUBE"),
        "{:?}",
        warned.borrow()
    );
}

#[test]
fn the_environment_sets_knobs_under_their_variables() {
    let t = KernelTuning::default()
        .with_vars(|n| match n {
            "NSACTOR_SCAN_CUBE" => Some("128".into()),
            "NSACTOR_DECODE_FUSION" => Some("off".into()),
            "NSACTOR_GEMM_TRACE" => Some("1".into()),
            _ => None,
        })
        .unwrap();
    assert_eq!(t.scan_cube, 128);
    assert!(!t.decode_fusion && t.gemm_trace);
    assert_eq!(
        t.to_options(),
        "kernel.decode_fusion=off,kernel.gemm_trace=on,kernel.scan_cube=128"
    );
}
