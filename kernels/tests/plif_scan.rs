//! Parity of the PLIF scans with the reference implementation's golden data
//! (`shared/fixtures/plif_scan.safetensors`) and with an independent autodiff reference.

use burn::backend::Autodiff;
use burn::tensor::{Distribution, Tensor, TensorData, backend::Backend};
use burn_ndarray::NdArray;
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

struct Fixture(Vec<u8>);

impl Fixture {
    fn load(name: &str) -> Self {
        let path = fixture_path(name);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "golden fixture {} is required and could not be read: {e}",
                path.display()
            )
        });
        Fixture(bytes)
    }

    /// The tensor's values (row-major) and shape.
    fn raw(&self, key: &str) -> (Vec<f32>, Vec<usize>) {
        let st =
            safetensors::SafeTensors::deserialize(&self.0).expect("fixture is valid safetensors");
        let view = st
            .tensor(key)
            .unwrap_or_else(|e| panic!("fixture key {key}: {e}"));
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{key} is not f32");
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        (values, view.shape().to_vec())
    }

    fn flat(&self, key: &str) -> Vec<f32> {
        self.raw(key).0
    }

    fn get<const D: usize>(&self, key: &str) -> Tensor<Ad, D> {
        let (values, shape) = self.raw(key);
        Tensor::from_data(TensorData::new(values, shape), &Default::default())
    }
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

/// Runs one scan variant from the fixture and checks spikes, `V_post` and all four gradients.
fn check_fixture(prefix: &str) {
    let fx = Fixture::load("plif_scan.safetensors");
    let key = |k: &str| format!("{prefix}.{k}");
    let u = fx.get::<3>(&key("u")).require_grad();
    let v0 = fx.get::<2>(&key("v0")).require_grad();
    let grad_vpost = fx.get::<3>(&key("grad_vpost"));
    let (spike, vpost, beta_grad, vth_grad, grads) = if prefix == "elem" {
        let beta = fx.get::<3>(&key("beta")).require_grad();
        let vth = fx.get::<3>(&key("vth")).require_grad();
        let (spike, vpost) = plif_elem(beta.clone(), u.clone(), vth.clone(), v0.clone());
        let grads = (vpost.clone() * grad_vpost).sum().backward();
        let gb = values(beta.grad(&grads).expect("beta grad"));
        let gt = values(vth.grad(&grads).expect("vth grad"));
        (spike, vpost, gb, gt, grads)
    } else {
        let beta = fx.get::<2>(&key("beta")).require_grad();
        let vth = fx.get::<2>(&key("vth")).require_grad();
        let (spike, vpost) = plif_row(beta.clone(), u.clone(), vth.clone(), v0.clone());
        let grads = (vpost.clone() * grad_vpost).sum().backward();
        let gb = values(beta.grad(&grads).expect("beta grad"));
        let gt = values(vth.grad(&grads).expect("vth grad"));
        (spike, vpost, gb, gt, grads)
    };
    let want_spike = fx.flat(&key("spike"));
    let got_spike = values(spike);
    let flips = got_spike
        .iter()
        .zip(&want_spike)
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(
        flips,
        0,
        "{prefix}: {flips} of {} spikes differ",
        want_spike.len()
    );
    assert!(want_spike.contains(&1.0), "{prefix}: fixture has spikes");
    let dv = max_abs_diff(&values(vpost), &fx.flat(&key("vpost")));
    assert!(dv <= 1e-5, "{prefix}: V_post max |diff| {dv}");
    let checks = [
        ("grad_beta", beta_grad),
        ("grad_vth", vth_grad),
        ("grad_u", values(u.grad(&grads).expect("u grad"))),
        ("grad_v0", values(v0.grad(&grads).expect("v0 grad"))),
    ];
    for (name, got) in checks {
        let err = rel_norm_err(&got, &fx.flat(&key(name)));
        assert!(err <= 1e-4, "{prefix}: {name} relative error {err}");
    }
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
