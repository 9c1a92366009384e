//! The projection GEMM hook (`SnnOps::gemm`) and its autodiff backward, against burn's
//! own matmul and its built-in backward on the CPU.

use burn::backend::Autodiff;
use burn::tensor::{Distribution, Tensor, backend::Backend};
use burn_ndarray::NdArray;

type Ad = Autodiff<NdArray<f32>>;

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

#[test]
fn matmul_and_its_gradients_equal_burns() {
    let dev = Default::default();
    let x = Tensor::<Ad, 2>::random([37, 19], Distribution::Normal(0.0, 1.0), &dev);
    let w = Tensor::<Ad, 2>::random([23, 19], Distribution::Normal(0.0, 1.0), &dev);
    let g = Tensor::<Ad, 2>::random([37, 23], Distribution::Normal(0.0, 1.0), &dev);
    let run = |ours: bool| {
        let (x, w) = (x.clone().require_grad(), w.clone().require_grad());
        let y = if ours {
            nsactor_kernels::matmul(x.clone(), w.clone().transpose())
        } else {
            x.clone().matmul(w.clone().transpose())
        };
        let grads = (y.clone() * g.clone()).sum().backward();
        (
            values(y),
            values(x.grad(&grads).unwrap()),
            values(w.grad(&grads).unwrap()),
        )
    };
    let (y, gx, gw) = run(true);
    let (y_ref, gx_ref, gw_ref) = run(false);
    assert_eq!(y, y_ref, "forward");
    assert_eq!(gx, gx_ref, "∂x");
    assert_eq!(gw, gw_ref, "∂w");
    // And the values are a matrix product: one entry by hand.
    let (xv, wv) = (values(x.clone()), values(w.clone()));
    let dot: f32 = (0..19).map(|k| xv[5 * 19 + k] * wv[7 * 19 + k]).sum();
    assert!((y[5 * 23 + 7] - dot).abs() <= 1e-4 * dot.abs().max(1.0));
}

#[test]
fn matmul_add_and_its_gradients_equal_the_product_then_the_sum() {
    let dev = Default::default();
    let x = Tensor::<Ad, 2>::random([37, 19], Distribution::Normal(0.0, 1.0), &dev);
    let w = Tensor::<Ad, 2>::random([23, 19], Distribution::Normal(0.0, 1.0), &dev);
    let c = Tensor::<Ad, 2>::random([37, 23], Distribution::Normal(0.0, 1.0), &dev);
    let g = Tensor::<Ad, 2>::random([37, 23], Distribution::Normal(0.0, 1.0), &dev);
    let run = |ours: bool| {
        let (x, w, c) = (
            x.clone().require_grad(),
            w.clone().require_grad(),
            c.clone().require_grad(),
        );
        let y = if ours {
            nsactor_kernels::matmul_add(x.clone(), w.clone().transpose(), c.clone())
        } else {
            nsactor_kernels::matmul(x.clone(), w.clone().transpose()) + c.clone()
        };
        let grads = (y.clone() * g.clone()).sum().backward();
        [
            values(y),
            values(x.grad(&grads).unwrap()),
            values(w.grad(&grads).unwrap()),
            values(c.grad(&grads).unwrap()),
        ]
    };
    let (ours, theirs) = (run(true), run(false));
    for (name, (a, b)) in ["y", "∂x", "∂w", "∂c"].iter().zip(ours.iter().zip(&theirs)) {
        assert!(b.iter().any(|v| *v != 0.0), "{name}: all zero");
        assert_eq!(a, b, "{name}");
    }
}
