//! `auto`'s choices ([`super::AutoKeep`]) from memory readings taken on H200s and H100s.

use super::*;

const GIB: u64 = 1 << 30;

fn mem(device: usize, used_gib: f64) -> DeviceMemory {
    DeviceMemory {
        device,
        used_bytes: (used_gib * GIB as f64) as u64,
        total_bytes: (139.8 * GIB as f64) as u64,
    }
}

fn needs(device: usize, held: u64) -> DeviceNeeds {
    DeviceNeeds {
        device,
        floor_per_layer: 6 * GIB,
        held_for_checkpoints: held,
    }
}

/// The choice after the measured steps: `first` read after each of the first two (one kept
/// layer), `second` after the third (three).
fn chose(a: &mut AutoKeep, first: &[DeviceMemory], second: &[DeviceMemory]) -> usize {
    assert_eq!(a.next(), 1);
    assert_eq!(a.observe(first), Observed::Measuring);
    assert_eq!(a.next(), 1);
    assert_eq!(a.observe(first), Observed::Measuring);
    assert_eq!(a.next(), 3);
    match a.observe(second) {
        Observed::Chose { keep, .. } => {
            assert_eq!(a.next(), keep);
            keep
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_measured_0_9b_at_batch_14_keeps_the_six_layers_that_fitted_on_an_h200() {
    // Session 52 on an H200: 53.46 GiB with one kept layer, ~14.4 GiB for each more; six
    // ran in 127.24 GiB and eight ran out of memory.
    let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
    assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 6);
    // A layer is taken at 2.5 × its 6 GiB of scan inputs (15 GiB), above the 14.4 measured
    // over two. The step with six measures 15.0 GiB a layer over three: a seventh does not
    // fit, and the choice settles with its prediction (82.26 + 3 × 15 GiB) beside the figure.
    match a.observe(&[mem(0, 127.24)]) {
        Observed::Settled(v) => {
            let (d, used, predicted) = v[0];
            assert_eq!(d, 0);
            assert_eq!(used, mem(0, 127.24).used_bytes);
            assert!((gib(predicted) - 127.26).abs() < 0.01, "{}", gib(predicted));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.observe(&[mem(0, 127.24)]), Observed::Done);
    assert_eq!(a.next(), 6);
}

/// The choices `a` makes from `steps` (each step's memory after the first two), and
/// whether it settled.
fn rounds(a: &mut AutoKeep, steps: &[f64]) -> (Vec<usize>, bool) {
    let mut kept = Vec::new();
    for &used in steps {
        match a.observe(&[mem(0, used)]) {
            Observed::Chose { keep, last, .. } => {
                kept.push(keep);
                if last {
                    return (kept, true);
                }
            }
            Observed::Settled(_) => return (kept, true),
            other => panic!("{other:?}"),
        }
    }
    (kept, false)
}

#[test]
fn a_longer_span_measures_a_layer_better_and_raises_the_choice() {
    // This session's H200 at batch 14: 48.55 → 85.71 GiB from one kept layer to three
    // (18.6 GiB a layer: the pools' first growth), 116.30 with five (15.3 a layer).
    let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
    // Five left 20.7 GiB: one more layer at the first span's 18.58 GiB (the largest
    // measured is what a layer is taken to cost); six took 127.24 GiB.
    assert_eq!(chose(&mut a, &[mem(0, 48.55)], &[mem(0, 85.71)]), 5);
    assert_eq!(rounds(&mut a, &[116.30, 127.24]), (vec![6], true));
    assert_eq!(a.next(), 6);
    // At 4 × 511 × 4, without the spare layer: 33.43 → 47.77 GiB (7.2 a layer) chose 14;
    // 99.24 GiB with 14 leaves room for 18 at 7.2 a layer; 118 with 18 for all 20, which
    // ran in 131.05 GiB when asked for by hand.
    let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
    a.needs[0].floor_per_layer = GIB;
    assert_eq!(chose(&mut a, &[mem(0, 33.43)], &[mem(0, 47.77)]), 14);
    assert_eq!(
        rounds(&mut a, &[99.24, 118.0, 131.05]),
        (vec![18, 20], true)
    );
    // A choice that keeps rising (each layer costing less than the first span measured)
    // settles after a few rounds.
    let mut a = AutoKeep::new(10_000, None, vec![needs(0, 0)]);
    a.needs[0].floor_per_layer = GIB / 1024;
    assert_eq!(chose(&mut a, &[mem(0, 10.0)], &[mem(0, 12.0)]), 116);
    let (kept, settled) = rounds(&mut a, &[68.5, 99.5, 116.5, 125.0]);
    assert!(kept.windows(2).all(|w| w[0] < w[1]), "{kept:?}");
    assert_eq!((kept.len(), settled), (MAX_ROUNDS, true), "{kept:?}");
}

#[test]
fn a_choice_below_what_ran_is_final_and_a_failed_step_falls_back_to_what_ran() {
    // Under a 100 GiB cap the 0.9B at batch 14 chooses 4 (96.7 GiB predicted); 101 GiB
    // measured gives one layer back, and that is the end: the pools never shrink, so the
    // same reading would otherwise take another layer each round.
    let mut a = AutoKeep::new(20, Some(100 * GIB), vec![needs(0, 0)]);
    assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 4);
    assert_eq!(rounds(&mut a, &[101.0]), (vec![3], true));
    assert_eq!(a.observe(&[mem(0, 101.0)]), Observed::Done);
    assert_eq!(a.next(), 3);
    // A failed step while measuring, or at a raised number, goes back to what last ran.
    let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
    assert_eq!(a.failed(), 0);
    assert_eq!(a.next(), 0);
    let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
    a.observe(&[mem(0, 53.46)]);
    assert_eq!((a.failed(), a.next()), (1, 1));
    let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
    assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 6);
    assert_eq!((a.failed(), a.next()), (3, 3));
    assert_eq!(a.observe(&[mem(0, 90.0)]), Observed::Done);
}

#[test]
fn steps_of_several_micro_batches_leave_a_layer_spare() {
    // 5 × 511 × 3 on an H200: 30.33 → 50.96 GiB from one kept layer to three. Without
    // the spare layer this chose 10 and then 19, which ran out of memory. (Scan inputs at
    // batch 5: 2.18 GiB, under the 10.3 GiB a layer measured.)
    let spare = |n| {
        let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]).with_spare_layers(n);
        a.needs[0].floor_per_layer = (6.11 * 5.0 / 14.0 * GIB as f64) as u64;
        a
    };
    assert_eq!(chose(&mut spare(0), &[mem(0, 30.33)], &[mem(0, 50.96)]), 10);
    let mut a = spare(1);
    assert_eq!(chose(&mut a, &[mem(0, 30.33)], &[mem(0, 50.96)]), 9);
    // Within a layer of the budget it stays where it is rather than give layers back.
    assert_eq!(rounds(&mut a, &[128.0]), (vec![], true));
    assert_eq!(a.next(), 9);
}

#[test]
fn checkpoints_during_the_run_and_a_cap_leave_room_and_keep_fewer() {
    let ckpt = (9.77 * GIB as f64) as u64;
    let mut a = AutoKeep::new(20, None, vec![needs(0, ckpt)]);
    assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 5);
    let mut a = AutoKeep::new(20, Some(100 * GIB), vec![needs(0, 0)]);
    assert_eq!(chose(&mut a, &[mem(0, 53.46)], &[mem(0, 82.26)]), 4);
    // Under a 70 GiB cap three layers are not tried: 53.46 GiB leaves room for one more at
    // 2.5 × 6 GiB (16.5 with the margin). Two take 67.86 GiB, and that is the choice.
    let mut a = AutoKeep::new(20, Some(70 * GIB), vec![needs(0, 0)]);
    for _ in 0..2 {
        assert_eq!(a.observe(&[mem(0, 53.46)]), Observed::Measuring);
    }
    assert_eq!(a.next(), 2);
    match a.observe(&[mem(0, 67.86)]) {
        Observed::Chose { keep, last, .. } => assert_eq!((keep, last), (2, true)),
        other => panic!("{other:?}"),
    }
    // Below what one took, none: the excess (13.46 GiB) is given back in whole layers of the
    // unmeasured 15 GiB.
    let mut a = AutoKeep::new(20, Some(40 * GIB), vec![needs(0, 0)]);
    assert_eq!(a.observe(&[mem(0, 53.46)]), Observed::Measuring);
    match a.observe(&[mem(0, 53.46)]) {
        Observed::NoRoom { keep, .. } => assert_eq!(keep, 0),
        other => panic!("{other:?}"),
    }
    assert_eq!((a.next(), a.observe(&[mem(0, 40.0)])), (0, Observed::Done));
}

#[test]
fn growth_under_the_scan_inputs_is_not_believed_and_every_layer_fits_a_roomy_device() {
    // The pools had room: no growth measured. The estimate (2.5 × the 6 GiB of scan inputs
    // a layer) decides: (137.0 − 50) GiB / 16.5 GiB = 5 layers past the three measured.
    let mut a = AutoKeep::new(20, None, vec![needs(0, 0)]);
    assert_eq!(chose(&mut a, &[mem(0, 50.0)], &[mem(0, 50.0)]), 8);
    // A small model: all of its layers.
    let mut a = AutoKeep::new(4, None, vec![needs(0, 0)]);
    assert_eq!(chose(&mut a, &[mem(0, 5.0)], &[mem(0, 5.1)]), 4);
}

#[test]
fn the_tightest_device_decides_and_other_devices_reports_are_ignored() {
    let mut a = AutoKeep::new(10, None, vec![needs(0, 0), needs(1, 0)]);
    let first = [mem(0, 40.0), mem(1, 60.0), mem(7, 1.0)];
    let second = [mem(0, 60.0), mem(1, 100.0), mem(7, 139.0)];
    // Device 0: 10 GiB a layer measured, taken at 15 (2.5 × 6), 77 GiB free → 3 + 4 = 7;
    // device 1: 20 GiB, 37 free → 4.
    match (a.observe(&first), a.observe(&first), a.observe(&second)) {
        (Observed::Measuring, Observed::Measuring, Observed::Chose { keep, devices, .. }) => {
            assert_eq!(keep, 4);
            assert_eq!(devices.iter().map(|d| d.fits).collect::<Vec<_>>(), [7, 4]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_stage_of_one_layer_is_measured_once() {
    let mut a = AutoKeep::new(1, None, vec![needs(0, 0)]);
    assert_eq!(a.next(), 1);
    match a.observe(&[mem(0, 10.0)]) {
        Observed::Chose { keep, .. } => assert_eq!(keep, 1),
        other => panic!("{other:?}"),
    }
    let mut a = AutoKeep::new(1, Some(5 * GIB), vec![needs(0, 0)]);
    match a.observe(&[mem(0, 10.0)]) {
        Observed::Chose { keep, .. } => assert_eq!(keep, 0),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_shared_number_is_read_per_layer() {
    let k = KeepLayers::new(2);
    assert!(k.keeps(1) && k.keeps(2) && !k.keeps(3));
    k.clone().set(0);
    assert!(!k.keeps(1));
}

/// The memory readings of one device of `total_gib`.
fn mem_of(total_gib: f64, used_gib: f64) -> DeviceMemory {
    DeviceMemory {
        device: 0,
        used_bytes: (used_gib * GIB as f64) as u64,
        total_bytes: (total_gib * GIB as f64) as u64,
    }
}

#[test]
fn an_h100_at_batch_14_keeps_one_layer_without_trying_three() {
    // Session 64 on an H100 (79.65 GiB), 0.9B at batch 14, checkpoints every 10 steps: 44.77
    // GiB after the first step with one kept layer. The step with three kept ran out of
    // memory and the CUDA backend could not go on. Without a kept layer the second step took
    // 50.5 GiB; with one, ~8.5 GiB over the first step's reading is taken here.
    let scan_inputs = (6.11 * GIB as f64) as u64;
    let ckpt = (9.77 * GIB as f64) as u64;
    let needs = || DeviceNeeds {
        device: 0,
        floor_per_layer: scan_inputs,
        held_for_checkpoints: ckpt,
    };
    let mut a = AutoKeep::new(20, None, vec![needs()]);
    let without_checkpoints = || {
        let needs = DeviceNeeds {
            held_for_checkpoints: 0,
            ..needs()
        };
        AutoKeep::new(20, None, vec![needs])
    };
    assert_eq!(a.observe(&[mem_of(79.65, 44.77)]), Observed::Measuring);
    assert_eq!(a.next(), 1);
    match a.observe(&[mem_of(79.65, 53.3)]) {
        Observed::NoRoom { keep, devices } => {
            assert_eq!(keep, 1);
            // 79.65 − 2 reserved − 9.77 for checkpoints = 67.88 GiB allowed; one more layer
            // at 2.5 × 6.11 GiB (× 1.1) would need 70.1.
            assert!((gib(devices[0].allowed) - 67.88).abs() < 0.01);
            assert!((gib(devices[0].per_layer) - 15.27).abs() < 0.01);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.next(), 1);
    assert_eq!(a.observe(&[mem_of(79.65, 60.0)]), Observed::Done);
    // Without checkpoints one more layer fits at that cost, and the third step tries two.
    let mut a = without_checkpoints();
    for _ in 0..2 {
        assert_eq!(a.observe(&[mem_of(79.65, 53.3)]), Observed::Measuring);
    }
    assert_eq!(a.next(), 2);
    // A failed step there falls back to the one that ran.
    assert_eq!((a.failed(), a.next()), (1, 1));
    // A span of one layer that shows no growth (the pools had room) does not make a layer
    // cheap: it is still taken at 2.5 × its scan inputs, so 24.35 GiB left take one more
    // (at the scan inputs alone, three more: five, ~96 GiB).
    let steps = |third: f64| {
        let mut a = without_checkpoints();
        for _ in 0..2 {
            a.observe(&[mem_of(79.65, 53.3)]);
        }
        assert_eq!(a.next(), 2);
        match a.observe(&[mem_of(79.65, third)]) {
            Observed::Chose { keep, .. } => keep,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(steps(53.3), 3);
    // Measured growth above the estimate wins: 14.7 GiB for the second layer leaves no room.
    assert_eq!(steps(68.0), 2);
}

#[test]
fn a_span_that_measures_a_layer_cheap_does_not_fill_an_h100() {
    // Session 81 on an H100 (79.18 GiB), 0.9B at 4 × 511 × 4: 34.24 GiB after the second step
    // with one kept layer, 40.43 with three (3.09 GiB a layer). Taking that figure chose 12,
    // and the step ran out of memory (a 4.95 GiB allocation refused): at batch 4 a kept layer
    // costs ~5.1 GiB (all 20 ran in 131.05 GiB from 33.43 on an H200). The estimate of
    // 2.5 × the scan inputs (1.75 GiB at batch 4) stays the least a layer costs.
    let needs = DeviceNeeds {
        device: 0,
        floor_per_layer: (6.11 * 4.0 / 14.0 * GIB as f64) as u64,
        held_for_checkpoints: 0,
    };
    let mut a = AutoKeep::new(20, None, vec![needs]).with_spare_layers(1);
    assert_eq!(a.observe(&[mem_of(79.18, 29.30)]), Observed::Measuring);
    assert_eq!(a.observe(&[mem_of(79.18, 34.24)]), Observed::Measuring);
    assert_eq!(a.next(), 3);
    let keep = match a.observe(&[mem_of(79.18, 40.43)]) {
        Observed::Chose { keep, devices, .. } => {
            assert!((gib(devices[0].per_layer) - 4.36).abs() < 0.01);
            keep
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(keep, 9);
    // At the cost measured on the H200, what it chose fits the card.
    assert!(40.43 + (keep - 3) as f64 * 5.1 < 79.18 - 2.0);
}
