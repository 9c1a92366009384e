//! Parity of the PLIF scans with the reference implementation's golden data
//! (`shared/fixtures/plif_scan.safetensors`) and with an independent autodiff reference.

use burn::backend::Autodiff;
use burn::tensor::{Distribution, Tensor, backend::Backend};
use burn_ndarray::NdArray;
use nsactor_kernels::KernelError;
use nsactor_kernels::parity::{self, ScanPrecision};
use nsactor_kernels::{plif_elem, plif_row};
use std::path::PathBuf;

type Inner = NdArray<f32>;
type Ad = Autodiff<Inner>;

fn fixture_path(name: &str) -> PathBuf {
    let dir = std::env::var_os("NSACTOR_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures"));
    dir.join(name)
}

/// The fixture's bytes; a missing fixture fails the test (it is the yardstick).
fn fixture(name: &str) -> Vec<u8> {
    let path = fixture_path(name);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "golden fixture {} is required and could not be read: {e}",
            path.display()
        )
    })
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `‖a − b‖ / ‖b‖`, the fixture README's gradient tolerance measure.
fn rel_norm_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num.sqrt() / den.sqrt().max(1e-30)) as f32
}

/// Runs one scan variant from the fixture through [`parity::plif_fixture`] (what `nsactor verify
/// plif-scan` runs inside a plugin) and holds the CPU to tighter bounds than the README's:
/// spikes equal, `V_post` within 1e-5, gradients within 1e-4 relative.
fn check_fixture(variant: &'static str) {
    let bytes = fixture("plif_scan.safetensors");
    let r = parity::plif_fixture::<Inner>(&Default::default(), &bytes, variant, ScanPrecision::F32)
        .unwrap();
    assert!(r.spikes > 0, "{variant}: fixture has spikes");
    assert_eq!(
        r.flips, 0,
        "{variant}: {} of {} spikes differ",
        r.flips, r.elements
    );
    assert!(r.passed(), "{}", r.render());
    assert_eq!(r.compared[0].name, "V_post");
    assert!(r.compared[0].max_abs <= 1e-5, "{}", r.render());
    assert_eq!(r.compared.len(), 5, "V_post and four gradients");
}

/// bf16 storage around the fp32 scan (inputs, outputs and gradients rounded to bf16) stays
/// within the 1e-2 relative of the fp32 fixture on every neuron none of whose spikes
/// flipped; the flips are few and reported.
fn check_fixture_bf16(variant: &'static str) {
    let bytes = fixture("plif_scan.safetensors");
    let r =
        parity::plif_fixture::<Inner>(&Default::default(), &bytes, variant, ScanPrecision::Bf16)
            .unwrap();
    println!("{}", r.render());
    assert!(r.passed(), "{}", r.render());
    // Rounding moves a few membranes across their thresholds, not many.
    assert!(r.spike_agreement() > 0.99, "{}", r.render());
    assert!(r.flipped_neurons * 5 < r.neurons, "{}", r.render());
    // Rounding did change something: the check is not the fp32 run again.
    assert!(r.compared.iter().any(|c| c.max_abs > 0.0), "{}", r.render());
}

#[test]
fn elem_scan_in_bf16_storage_is_within_1e_2_of_the_fixture() {
    check_fixture_bf16("elem");
}

#[test]
fn row_scan_in_bf16_storage_is_within_1e_2_of_the_fixture() {
    check_fixture_bf16("row");
}

#[test]
fn a_malformed_fixture_is_an_error_not_a_panic() {
    let dev = Default::default();
    let e = parity::plif_fixture::<Inner>(&dev, b"not safetensors", "elem", ScanPrecision::F32)
        .unwrap_err();
    assert!(matches!(e, KernelError::Fixture(_)), "{e:?}");
    assert!(e.to_string().contains("not valid safetensors"), "{e}");
    let bytes = fixture("plif_scan.safetensors");
    let e = parity::plif_fixture::<Inner>(&dev, &bytes, "diag", ScanPrecision::F32).unwrap_err();
    assert!(matches!(e, KernelError::Misuse(_)), "{e:?}");
    assert!(e.to_string().contains("unknown scan variant"), "{e}");
}

#[test]
fn elem_scan_matches_reference_fixture() {
    check_fixture("elem");
}

#[test]
fn row_scan_matches_reference_fixture() {
    check_fixture("row");
}

/// The scan written as plain burn ops, one step at a time, differentiated by burn's autodiff.
/// The spike enters the reset as a constant (`detach`), as in SPEC §6.1.
fn naive_scan(
    beta: Tensor<Ad, 3>,
    u: Tensor<Ad, 3>,
    vth: Tensor<Ad, 3>,
    v0: Tensor<Ad, 2>,
) -> Tensor<Ad, 3> {
    let [tk, b, d] = u.dims();
    let mut v = v0;
    let mut out = Vec::with_capacity(tk);
    for k in 0..tk {
        let step = |t: &Tensor<Ad, 3>| t.clone().narrow(0, k, 1).reshape([b, d]);
        let v_pre = step(&beta) * v + step(&u);
        let th = step(&vth);
        let s = v_pre.clone().greater_equal(th.clone()).float().detach();
        v = v_pre - th * s;
        out.push(v.clone().unsqueeze_dim::<3>(0));
    }
    Tensor::cat(out, 0)
}

/// Random inputs whose membranes cross threshold often, with a long-enough sequence that the
/// reset/carry logic is exercised across many steps.
fn random_case(tk: usize, b: usize, d: usize) -> [Tensor<Ad, 3>; 4] {
    let dev = Default::default();
    let beta = Tensor::<Ad, 3>::random([tk, b, d], Distribution::Uniform(0.5, 0.99), &dev);
    let u = Tensor::<Ad, 3>::random([tk, b, d], Distribution::Normal(0.1, 0.4), &dev);
    let vth = Tensor::<Ad, 3>::random([tk, b, d], Distribution::Uniform(0.1, 0.6), &dev);
    let g = Tensor::<Ad, 3>::random([tk, b, d], Distribution::Normal(0.0, 1.0), &dev);
    [beta, u, vth, g]
}

#[test]
fn elem_scan_gradients_match_naive_autodiff() {
    let (tk, b, d) = (37, 3, 5);
    let [beta, u, vth, g] = random_case(tk, b, d);
    let v0 = Tensor::<Ad, 2>::random([b, d], Distribution::Normal(0.0, 0.3), &Default::default());
    let leaves = |t: &Tensor<Ad, 3>| t.clone().detach().require_grad();
    let (b1, u1, t1, v1) = (
        leaves(&beta),
        leaves(&u),
        leaves(&vth),
        v0.clone().detach().require_grad(),
    );
    let (b2, u2, t2, v2) = (
        leaves(&beta),
        leaves(&u),
        leaves(&vth),
        v0.detach().require_grad(),
    );

    let (spike, fast) = plif_elem(b1.clone(), u1.clone(), t1.clone(), v1.clone());
    let slow = naive_scan(b2.clone(), u2.clone(), t2.clone(), v2.clone());
    let n_spikes = values(spike).iter().filter(|&&s| s == 1.0).count();
    assert!(
        n_spikes > tk * b * d / 10,
        "test case should spike often, got {n_spikes}"
    );
    assert!(max_abs_diff(&values(fast.clone()), &values(slow.clone())) <= 1e-5);

    let gf = (fast * g.clone()).sum().backward();
    let gs = (slow * g).sum().backward();
    let pairs = [
        (
            values(b1.grad(&gf).unwrap()),
            values(b2.grad(&gs).unwrap()),
            "beta",
        ),
        (
            values(u1.grad(&gf).unwrap()),
            values(u2.grad(&gs).unwrap()),
            "u",
        ),
        (
            values(t1.grad(&gf).unwrap()),
            values(t2.grad(&gs).unwrap()),
            "vth",
        ),
    ];
    for (a, b, name) in pairs {
        let err = rel_norm_err(&a, &b);
        assert!(err <= 1e-5, "{name}: relative error {err}");
    }
    let err = rel_norm_err(
        &values(v1.grad(&gf).unwrap()),
        &values(v2.grad(&gs).unwrap()),
    );
    assert!(err <= 1e-5, "v0: relative error {err}");
}

#[test]
fn row_scan_equals_elem_scan_with_broadcast_parameters() {
    // SPEC §14.1: row-parameter gradients equal per-element gradients summed over time.
    let (tk, b, d) = (29, 2, 7);
    let dev = Default::default();
    let beta_row =
        Tensor::<Ad, 2>::random([b, d], Distribution::Uniform(0.5, 0.99), &dev).require_grad();
    let vth_row =
        Tensor::<Ad, 2>::random([b, d], Distribution::Uniform(0.1, 0.6), &dev).require_grad();
    let u = Tensor::<Ad, 3>::random([tk, b, d], Distribution::Normal(0.1, 0.4), &dev);
    let g = Tensor::<Ad, 3>::random([tk, b, d], Distribution::Normal(0.0, 1.0), &dev);
    let v0 = Tensor::<Ad, 2>::zeros([b, d], &dev);

    let (s_row, row) = plif_row(beta_row.clone(), u.clone(), vth_row.clone(), v0.clone());
    let gr = (row.clone() * g.clone()).sum().backward();

    let beta_e = beta_row
        .clone()
        .detach()
        .unsqueeze_dim::<3>(0)
        .expand([tk, b, d])
        .detach()
        .require_grad();
    let vth_e = vth_row
        .clone()
        .detach()
        .unsqueeze_dim::<3>(0)
        .expand([tk, b, d])
        .detach()
        .require_grad();
    let (s_elem, elem) = plif_elem(beta_e.clone(), u, vth_e.clone(), v0);
    let ge = (elem.clone() * g).sum().backward();

    assert_eq!(values(s_row), values(s_elem));
    assert_eq!(values(row), values(elem));
    let sum_t = |t: Tensor<Inner, 3>| values(t.sum_dim(0).reshape([b, d]));
    let err_b = rel_norm_err(
        &values(beta_row.grad(&gr).unwrap()),
        &sum_t(beta_e.grad(&ge).unwrap()),
    );
    let err_t = rel_norm_err(
        &values(vth_row.grad(&gr).unwrap()),
        &sum_t(vth_e.grad(&ge).unwrap()),
    );
    assert!(err_b <= 1e-5 && err_t <= 1e-5, "beta {err_b}, vth {err_t}");
}
