//! The SNNBlock's gated output as one op (`SnnOps::gated_out_forward` and its autodiff node,
//! with the reference forward and backward a fusing backend's kernels are checked against)
//! against the composition `r·σ(g) + s` under burn's autodiff: the output and all three
//! gradients, bit for bit (the reference is the composition op for op).

use burn::backend::Autodiff;
use burn::tensor::TensorPrimitive;
use burn::tensor::{Distribution, Tensor, activation::sigmoid, backend::Backend};
use burn_ndarray::NdArray;
use nsactor_kernels::SnnOps;

type Ad = Autodiff<NdArray<f32>>;

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

#[test]
fn gated_output_op_matches_the_composition_bit_for_bit_in_output_and_gradients() {
    let (rows, d) = (37, 19);
    let dev = Default::default();
    Ad::seed(&dev, 11);
    let t = |std: f64| {
        Tensor::<Ad, 2>::random([rows, d], Distribution::Normal(0.0, std), &dev).require_grad()
    };
    // Gate logits wide enough that σ saturates at both ends for some elements.
    let (r, g, s) = (t(1.0), t(6.0), t(1.0));
    let weight = Tensor::<Ad, 2>::random([rows, d], Distribution::Normal(0.0, 1.0), &dev);

    let want = r.clone() * sigmoid(g.clone()) + s.clone();
    let g_want = (want.clone() * weight.clone()).sum().backward();
    let prim = |x: &Tensor<Ad, 2>| x.clone().into_primitive().tensor();
    let got = Tensor::<Ad, 2>::from_primitive(TensorPrimitive::Float(Ad::gated_out_forward(
        prim(&r),
        prim(&g),
        prim(&s),
    )));
    let g_got = (got.clone() * weight).sum().backward();

    assert_eq!(values(got), values(want), "output");
    for (name, x) in [("∂r", &r), ("∂g", &g), ("∂s", &s)] {
        let got = values(x.grad(&g_got).expect("a gradient through the op"));
        let want = values(x.grad(&g_want).expect("a gradient through the composition"));
        assert!(want.iter().any(|v| *v != 0.0), "{name}: a zero gradient");
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn the_wrapper_composes_where_the_backend_does_not_fuse() {
    // NdArray does not fuse: `gated_out` is the composition itself.
    assert!(!<Ad as SnnOps>::fuses_gated_out());
    let dev = Default::default();
    let r = Tensor::<Ad, 2>::from_floats([[1.0, -2.0], [0.5, 3.0]], &dev);
    let g = Tensor::<Ad, 2>::from_floats([[0.0, 40.0], [-40.0, 1.0]], &dev);
    let s = Tensor::<Ad, 2>::from_floats([[0.25, 0.0], [1.0, -1.0]], &dev);
    let y = values(nsactor_kernels::gated_out(r, g, s));
    let sig1 = 1.0 / (1.0 + (-1.0f32).exp());
    let want = [0.75, -2.0, 1.0, 3.0 * sig1 - 1.0];
    for (a, b) in y.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{y:?} against {want:?}");
    }
}
