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

/// An input that several GEMM nodes read (the SNNBlock's six projections share theirs), beside
/// an element-wise reader, gets the sum of every reader's gradient, bit for bit as through
/// burn's matmul. (Adding the sum so far in each GEMM's epilogue instead was tried and left
/// out: docs/benchmarks/HISTORY.md, session 35.)
#[test]
fn an_input_read_by_several_gemms_gets_the_sum_of_their_gradients() {
    let dev = Default::default();
    let x = Tensor::<Ad, 2>::random([37, 19], Distribution::Normal(0.0, 1.0), &dev);
    let ws: Vec<Tensor<Ad, 2>> = [23, 5, 19]
        .iter()
        .map(|&n| Tensor::random([n, 19], Distribution::Normal(0.0, 1.0), &dev))
        .collect();
    let run = |ours: bool| {
        let x = x.clone().require_grad();
        let ws: Vec<_> = ws.iter().map(|w| w.clone().require_grad()).collect();
        let mut loss = (x.clone() * x.clone()).sum();
        for (i, w) in ws.iter().enumerate() {
            let y = if ours {
                nsactor_kernels::matmul(x.clone(), w.clone().transpose())
            } else {
                x.clone().matmul(w.clone().transpose())
            };
            loss = loss + (y.clone() * y).sum().mul_scalar(i as f32 + 1.0);
        }
        let grads = loss.backward();
        let mut out = vec![values(x.grad(&grads).unwrap())];
        out.extend(ws.iter().map(|w| values(w.grad(&grads).unwrap())));
        out
    };
    let (ours, theirs) = (run(true), run(false));
    assert_eq!(ours.len(), 4);
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!(b.iter().any(|v| *v != 0.0), "gradient {i}: all zero");
        assert_eq!(a, b, "gradient {i} (0: ∂x)");
    }
    // ∂x holds every reader's share: 2x + Σ 2(i+1)·(x Wᵢᵀ)Wᵢ, at one entry by hand.
    let xv = values(x.clone());
    let mut want = 2.0 * xv[3 * 19 + 4];
    for (i, w) in ws.iter().enumerate() {
        let (wv, n) = (values(w.clone()), w.dims()[0]);
        for o in 0..n {
            let y: f32 = (0..19).map(|k| xv[3 * 19 + k] * wv[o * 19 + k]).sum();
            want += 2.0 * (i as f32 + 1.0) * y * wv[o * 19 + 4];
        }
    }
    let got = ours[0][3 * 19 + 4];
    assert!(
        (got - want).abs() <= 1e-3 * want.abs().max(1.0),
        "{got} vs {want}"
    );
}
