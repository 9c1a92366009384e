//! `nsactor bench decode-profile` on the embedded CPU backend, as users call it: one layer's
//! decoding step and a prompt pass split into their parts, each fused part checked against its
//! composition, and bad options refused by name.

use super::common::cli::{run_err, run_stdout};

#[test]
fn decode_profile_splits_a_step_and_a_prompt_pass() {
    let stdout = run_stdout(&[
        "bench",
        "decode-profile",
        "--backend",
        "embedded",
        "--options",
        "config=tiny,reps=3",
    ]);
    let micros = |name: &str| -> f64 {
        let l = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no `{name}` row in:\n{stdout}"));
        l.split_whitespace().rev().nth(1).unwrap().parse().unwrap()
    };
    // Every part of the layer is timed. Their sizes are not compared: on a loaded 2-core
    // machine one scheduling pause inside a 3-rep mean outweighs a whole part (CI saw the
    // SNNBlock row at 4.1 ms beside a 0.7 ms layer); the comparison is `bench`'s job.
    for name in [
        "whole layer",
        "RMSNorm + input PLIF",
        "SNNBlock",
        "PonderAgg",
        "out projection",
        "SNNFFN",
    ] {
        let t = micros(name);
        assert!(t.is_finite() && t > 0.0, "`{name}` {t}: {stdout}");
    }
    // Each fused part is checked against its composition (on the CPU they are the same ops).
    for name in [
        "RMSNorm + input PLIF as run",
        "PonderAgg as run",
        "FFN neurons and gating as run",
    ] {
        let l = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no `{name}` check in:\n{stdout}"));
        assert!(l.contains("max error 0.00e0"), "{l}");
        assert!(l.contains("(0 of 1 batch rows)"), "{l}");
    }
    let err = run_err(&[
        "bench",
        "decode-profile",
        "--backend",
        "embedded",
        "--options",
        "batch=0",
    ]);
    assert!(err.contains("batch"), "{err}");

    // A prompt pass (4 tokens of 2 sessions): the same parts at its shapes, and the layer's
    // GEMMs alone beside the rest.
    let stdout = run_stdout(&[
        "bench",
        "decode-profile",
        "--backend",
        "embedded",
        "--options",
        "config=tiny,reps=3,tokens=4,batch=2",
    ]);
    assert!(
        stdout.contains("batch 2 × 4 token(s) (32 frame rows)"),
        "{stdout}"
    );
    for name in [
        "whole layer (forward of 4 token(s))",
        "the layer's projection GEMMs alone",
    ] {
        let l = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no `{name}` row in:\n{stdout}"));
        let t: f64 = l.split_whitespace().rev().nth(1).unwrap().parse().unwrap();
        assert!(t.is_finite() && t > 0.0, "`{name}` {t}: {stdout}");
    }
    assert!(stdout.contains("the rest of the layer"), "{stdout}");
    let l = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("SNNBlock projections as run"))
        .unwrap_or_else(|| panic!("no projections check in:\n{stdout}"));
    assert!(l.contains("(0 of 2 batch rows)"), "{l}");
    let err = run_err(&[
        "bench",
        "decode-profile",
        "--backend",
        "embedded",
        "--options",
        "tokens=0",
    ]);
    assert!(err.contains("tokens"), "{err}");
}
