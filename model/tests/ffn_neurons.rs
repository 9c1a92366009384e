//! The FFN neurons' fused op (`nsactor_kernels::ffn_neurons`: `SnnOps::ffn_neurons_forward` and
//! its autodiff node, with the reference forward and backward a fusing backend's kernels are
//! checked against) against the model's composition under burn's autodiff
//! (`SnnFfn::gate_up_composed`): outputs bit for bit, every gradient.

mod common;

use burn::tensor::{Distribution, Tensor, backend::Backend};
use common::*;
use nsactor_model::init::Rng;
use nsactor_model::{ModelConfig, PlifOut, SnnFfn};

/// A config small enough for the CPU, with the PLIF output activation `out`.
fn small_config(out: PlifOut) -> ModelConfig {
    ModelConfig {
        vocab_size: 11,
        d: 6,
        n: 2,
        k: 3,
        num_layers: 2,
        d_ff: 9,
        v_th_min: 0.1,
        plif_out: out,
    }
}

#[test]
fn fused_ffn_neurons_match_the_composed_model_in_outputs_and_all_gradients() {
    for out in [PlifOut::Leak, PlifOut::VPost] {
        let cfg = small_config(out);
        let (tk, b, f) = (21, 3, cfg.d_ff);
        let dev = Default::default();
        let ffn = SnnFfn::<Ad>::init(&cfg, &mut Rng::new(5), &dev);
        Ad::seed(&dev, 11);
        // Currents large enough that about half the steps fire.
        let i_gu = Tensor::<Ad, 3>::random([tk, b, 2 * f], Distribution::Normal(0.2, 0.6), &dev)
            .require_grad();
        let v0 = Tensor::<Ad, 2>::random([b, 2 * f], Distribution::Normal(0.0, 0.1), &dev)
            .require_grad();
        let weight = Tensor::<Ad, 3>::random([tk, b, f], Distribution::Normal(0.0, 1.0), &dev);

        let (gv_ref, last_ref) = ffn.gate_up_composed(i_gu.clone(), v0.clone(), out);
        let g_ref = (gv_ref.clone() * weight.clone()).sum().backward();
        let (gv, last) =
            nsactor_kernels::ffn_neurons(ffn.neuron_inputs(i_gu.clone(), v0.clone(), out));
        let g = (gv.clone() * weight).sum().backward();

        assert_eq!(values(gv), values(gv_ref), "{out:?}: g·v bit for bit");
        assert_eq!(values(last), values(last_ref), "{out:?}: final state");
        let grads: [(&str, Vec<f32>, Vec<f32>); 6] = [
            (
                "i_gu",
                values(i_gu.grad(&g).unwrap()),
                values(i_gu.grad(&g_ref).unwrap()),
            ),
            (
                "v0",
                values(v0.grad(&g).unwrap()),
                values(v0.grad(&g_ref).unwrap()),
            ),
            (
                "w_gate",
                values(ffn.gate_neuron.w.grad(&g).unwrap()),
                values(ffn.gate_neuron.w.grad(&g_ref).unwrap()),
            ),
            (
                "w_up",
                values(ffn.up_neuron.w.grad(&g).unwrap()),
                values(ffn.up_neuron.w.grad(&g_ref).unwrap()),
            ),
            (
                "th_gate",
                values(ffn.gate_neuron.v_th.grad(&g).unwrap()),
                values(ffn.gate_neuron.v_th.grad(&g_ref).unwrap()),
            ),
            (
                "th_up",
                values(ffn.up_neuron.v_th.grad(&g).unwrap()),
                values(ffn.up_neuron.v_th.grad(&g_ref).unwrap()),
            ),
        ];
        for (name, got, want) in grads {
            assert_close(&format!("{out:?}: ∂{name}"), &got, &want, 1e-5);
        }
    }
}

/// Doubles every parameter it maps.
struct Doubler;

impl<B: Backend> nsactor_model::params::ParamMapper<B> for Doubler {
    fn map<const D: usize>(&mut self, _name: &str, p: Tensor<B, D>) -> Tensor<B, D> {
        p * 2.0
    }
}

/// An untracked pass reuses `[W_gate; W_up]` concatenated once; replacing the parameters drops
/// it, so the next pass sees the new weights, exactly as a module built with them would.
#[test]
fn the_cached_gate_up_weights_follow_the_parameters() {
    let cfg = small_config(PlifOut::Leak);
    let dev = Default::default();
    let mut ffn = SnnFfn::<Inner>::init(&cfg, &mut Rng::new(5), &dev);
    let a = Tensor::<Inner, 3>::random([4, 2, cfg.d], Distribution::Normal(0.3, 1.0), &dev);
    let v0 = Tensor::<Inner, 2>::zeros([2, 2 * cfg.d_ff], &dev);
    assert!(!ffn.merged_gate_up.is_computed());
    let (y1, _) = ffn.forward(a.clone(), v0.clone(), PlifOut::Leak);
    assert!(ffn.merged_gate_up.is_computed());
    // The cached pass equals the first one (and a fresh module's) bit for bit.
    let fresh = SnnFfn::<Inner>::init(&cfg, &mut Rng::new(5), &dev);
    let (y0, _) = fresh.forward(a.clone(), v0.clone(), PlifOut::Leak);
    let (y2, _) = ffn.forward(a.clone(), v0.clone(), PlifOut::Leak);
    assert_eq!(y1.to_data(), y0.to_data());
    assert_eq!(y2.to_data(), y0.to_data());

    use nsactor_model::Params;
    ffn.map_params("", &mut Doubler);
    assert!(
        !ffn.merged_gate_up.is_computed(),
        "new parameters drop the cache"
    );
    let mut doubled = SnnFfn::<Inner>::init(&cfg, &mut Rng::new(5), &dev);
    doubled.map_params("", &mut Doubler);
    let (y3, _) = ffn.forward(a.clone(), v0.clone(), PlifOut::Leak);
    let (want, _) = doubled.forward(a, v0, PlifOut::Leak);
    assert_eq!(y3.to_data(), want.to_data());
    assert_ne!(
        y3.to_data(),
        y0.to_data(),
        "doubling the weights changed the output"
    );
}
