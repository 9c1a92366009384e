//! PonderAgg's differentiable op (`nsactor_kernels::ponder_agg_train`: `SnnOps::ponder_forward`
//! and its autodiff node, with the reference forward and backward a fusing backend's kernels are
//! checked against) against the model's composition under burn's autodiff
//! (`layer::ponder_agg_composed`): the aggregate, E[K] and every gradient.

mod common;

use burn::tensor::{Distribution, Tensor, backend::Backend};
use common::*;
use nsactor_model::layer::{ponder_agg_composed, ponder_inputs};
use nsactor_model::params::Linear;

#[test]
fn ponder_op_matches_the_composed_model_in_outputs_and_all_gradients() {
    let (t, k, b, d) = (5, 4, 3, 10);
    let dev = Default::default();
    Ad::seed(&dev, 3);
    let frames =
        Tensor::<Ad, 3>::random([t * k, b, d], Distribution::Normal(0.0, 1.0), &dev).require_grad();
    // A halt projection that spreads p over (0, 1), so that some p hit the clamp and the
    // survival products matter.
    let halt = Linear::new(
        Tensor::<Ad, 2>::random([1, d], Distribution::Normal(0.0, 1.5), &dev).require_grad(),
        Some(Tensor::<Ad, 1>::from_floats([-0.5], &dev).require_grad()),
    );
    let w_agg = Tensor::<Ad, 3>::random([t, b, d], Distribution::Normal(0.0, 1.0), &dev);
    let w_ek = Tensor::<Ad, 2>::random([t, b], Distribution::Normal(0.0, 1.0), &dev);
    let objective = |agg: Tensor<Ad, 3>, ek: Tensor<Ad, 2>| {
        (agg * w_agg.clone()).sum() + (ek * w_ek.clone()).sum()
    };

    let (agg_ref, ek_ref) = ponder_agg_composed(frames.clone(), &halt, k);
    let g_ref = objective(agg_ref.clone(), ek_ref.clone()).backward();
    let bias = halt.bias.clone().unwrap();
    let (agg, ek) =
        nsactor_kernels::ponder_agg_train(ponder_inputs(frames.clone(), &halt, &bias, k));
    let g = objective(agg.clone(), ek.clone()).backward();

    let checks: [(&str, Vec<f32>, Vec<f32>); 5] = [
        ("aggregate", values(agg), values(agg_ref)),
        ("E[K]", values(ek), values(ek_ref)),
        (
            "∂frames",
            values(frames.grad(&g).unwrap()),
            values(frames.grad(&g_ref).unwrap()),
        ),
        (
            "∂halt_w",
            values(halt.weight.grad(&g).unwrap()),
            values(halt.weight.grad(&g_ref).unwrap()),
        ),
        (
            "∂halt_b",
            values(bias.grad(&g).unwrap()),
            values(bias.grad(&g_ref).unwrap()),
        ),
    ];
    for (name, got, want) in checks {
        assert_close(name, &got, &want, 2e-5);
    }
}
