//! RMSNorm + the input PLIF as one differentiable op (`nsactor_kernels::norm_plif_train`:
//! `SnnOps::norm_plif_forward` and its autodiff node, with the reference forward and backward a
//! fusing backend's kernels are checked against) against the model's composition under burn's
//! autodiff (`layer::norm_plif_composed`): the output bit for bit, every gradient.

mod common;

use burn::tensor::{Distribution, Tensor, backend::Backend};
use common::*;
use nsactor_model::init::Rng;
use nsactor_model::layer::norm_plif_composed;
use nsactor_model::neurons::norm_plif_inputs;
use nsactor_model::{PlifNode, PlifOut, RmsNorm};

#[test]
fn norm_plif_op_matches_the_composed_model_in_outputs_and_all_gradients() {
    for out in [PlifOut::Leak, PlifOut::VPost] {
        let (t, k, b, d) = (7, 3, 2, 10);
        let dev = Default::default();
        Ad::seed(&dev, 9);
        let x =
            Tensor::<Ad, 3>::random([t, b, d], Distribution::Normal(0.1, 1.0), &dev).require_grad();
        let norm = RmsNorm {
            weight: Tensor::<Ad, 1>::random([d], Distribution::Normal(1.0, 0.3), &dev)
                .require_grad(),
        };
        let neuron = PlifNode::<Ad>::init(d, 0.5, &mut Rng::new(4), &dev);
        let v0 =
            Tensor::<Ad, 2>::random([b, d], Distribution::Normal(0.0, 0.2), &dev).require_grad();
        let weight = Tensor::<Ad, 3>::random([t * k, b, d], Distribution::Normal(0.0, 1.0), &dev);

        let (y_ref, last_ref) = norm_plif_composed(&norm, &neuron, x.clone(), k, v0.clone(), out);
        let g_ref = (y_ref.clone() * weight.clone()).sum().backward();
        let (y, last) = nsactor_kernels::norm_plif_train(norm_plif_inputs(
            &norm,
            &neuron,
            x.clone(),
            k,
            v0.clone(),
            out,
        ));
        let g = (y.clone() * weight).sum().backward();
        assert_eq!(values(y), values(y_ref), "{out:?}: output bit for bit");
        assert_eq!(values(last), values(last_ref), "{out:?}: final state");
        let checks: [(&str, Vec<f32>, Vec<f32>); 5] = [
            (
                "∂x",
                values(x.grad(&g).unwrap()),
                values(x.grad(&g_ref).unwrap()),
            ),
            (
                "∂norm_w",
                values(norm.weight.grad(&g).unwrap()),
                values(norm.weight.grad(&g_ref).unwrap()),
            ),
            (
                "∂w",
                values(neuron.w.grad(&g).unwrap()),
                values(neuron.w.grad(&g_ref).unwrap()),
            ),
            (
                "∂v_th",
                values(neuron.v_th.grad(&g).unwrap()),
                values(neuron.v_th.grad(&g_ref).unwrap()),
            ),
            (
                "∂v0",
                values(v0.grad(&g).unwrap()),
                values(v0.grad(&g_ref).unwrap()),
            ),
        ];
        for (name, got, want) in checks {
            assert_close(&format!("{out:?}: {name}"), &got, &want, 2e-5);
        }
    }
}
