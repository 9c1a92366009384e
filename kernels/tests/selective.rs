//! The selective scan's fused op (`SnnOps::plif_selective_forward` and its autodiff node)
//! against the same model composed from tensor ops and `plif_elem` under burn's autodiff:
//! outputs and every gradient.

use burn::backend::Autodiff;
use burn::tensor::TensorPrimitive;
use burn::tensor::{Distribution, Tensor, activation::sigmoid, backend::Backend};
use burn_ndarray::NdArray;
use nsactor_kernels::{SelectiveInputs, SnnOps, plif_elem};

type Ad = Autodiff<NdArray<f32>>;

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

/// Largest |a − b| / (1 + |b|).
fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max)
}

#[test]
fn fused_selective_scan_matches_the_composed_model_in_outputs_and_all_gradients() {
    let (tk, b, dn) = (24, 3, 40);
    let dev = Default::default();
    Ad::seed(&dev, 7);
    let seq = |scale: f64| {
        Tensor::<Ad, 3>::random([tk, b, dn], Distribution::Normal(0.0, scale), &dev).require_grad()
    };
    let vec = |mean: f64| {
        Tensor::<Ad, 1>::random([dn], Distribution::Normal(mean, 0.5), &dev).require_grad()
    };
    let (i, rb, ra, rt) = (seq(1.0), seq(1.0), seq(1.0), seq(0.3));
    let (bb, ba, bt) = (vec(1.0), vec(0.5), vec(0.2));
    let v0 = Tensor::<Ad, 2>::random([b, dn], Distribution::Normal(0.0, 0.2), &dev).require_grad();
    let weight = Tensor::<Ad, 3>::random([tk, b, dn], Distribution::Normal(0.0, 1.0), &dev);
    let v_min = 0.1;

    // The model's composition (snn_block.rs): modulation from tensor ops, then the scan.
    let bias = |t: &Tensor<Ad, 1>| t.clone().unsqueeze::<3>();
    let beta = sigmoid(rb.clone() + bias(&bb));
    let x = ra.clone() + bias(&ba);
    let alpha = x.clone().clamp_min(0.0) + x.abs().neg().exp().log1p();
    let vth = (rt.clone() + bias(&bt)).abs() + v_min;
    let (s_ref, v_ref) = plif_elem(beta, alpha * i.clone(), vth, v0.clone());
    let g_ref = (v_ref.clone() * weight.clone()).sum().backward();

    // The fused op's autodiff node with the reference forward and backward (what a fusing
    // backend's kernels are checked against), called directly: `plif_selective` composes on
    // backends that do not fuse.
    let p = |t: Tensor<Ad, 3>| t.into_primitive().tensor();
    let p1 = |t: Tensor<Ad, 1>| t.into_primitive().tensor();
    let out = <Ad as SnnOps>::plif_selective_forward(SelectiveInputs {
        i: p(i.clone()),
        r_beta: p(rb.clone()),
        r_alpha: p(ra.clone()),
        r_th: p(rt.clone()),
        b_beta: p1(bb.clone()),
        b_alpha: p1(ba.clone()),
        b_th: p1(bt.clone()),
        v_th_min: v_min as f32,
        v0: v0.clone().into_primitive().tensor(),
    });
    let wrap = |t| Tensor::<Ad, 3>::from_primitive(TensorPrimitive::Float(t));
    let (s, v) = (wrap(out.spike), wrap(out.vpost));
    let g = (v.clone() * weight).sum().backward();

    // Same ops in the same order: the forward is bit for bit the composed one.
    assert_eq!(values(v), values(v_ref));
    let spikes = values(s);
    assert_eq!(spikes, values(s_ref));
    let fired = spikes.iter().filter(|&&x| x == 1.0).count();
    assert!(
        fired > 10 && fired < spikes.len() - 10,
        "{fired} spikes: the test must exercise both branches"
    );

    let grad3 = |t: &Tensor<Ad, 3>, g| values(t.grad(g).expect("a gradient"));
    let grad1 = |t: &Tensor<Ad, 1>, g| values(t.grad(g).expect("a gradient"));
    for (name, a, r) in [
        ("i", grad3(&i, &g), grad3(&i, &g_ref)),
        ("r_beta", grad3(&rb, &g), grad3(&rb, &g_ref)),
        ("r_alpha", grad3(&ra, &g), grad3(&ra, &g_ref)),
        ("r_th", grad3(&rt, &g), grad3(&rt, &g_ref)),
        ("b_beta", grad1(&bb, &g), grad1(&bb, &g_ref)),
        ("b_alpha", grad1(&ba, &g), grad1(&ba, &g_ref)),
        ("b_th", grad1(&bt, &g), grad1(&bt, &g_ref)),
        (
            "v0",
            values(v0.grad(&g).unwrap()),
            values(v0.grad(&g_ref).unwrap()),
        ),
    ] {
        let e = worst(&a, &r);
        assert!(e < 1e-5, "∂{name}: worst relative error {e}");
        assert!(a.iter().any(|&x| x != 0.0), "∂{name} is all zeros");
    }
}
