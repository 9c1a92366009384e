//! The whole model against the reference's golden run (`shared/fixtures/tiny_a.safetensors`):
//! forward, loss, every gradient, natural-gradient compensation, clip + Adam, greedy decoding.

mod common;

use burn::tensor::{ElementConversion, Tensor};
use common::*;
use nsactor_model::train::{Adam, AdamConfig, GradSet, clip_factor, natural_gradient};
use nsactor_model::{NeuronSpark, param_shapes};

fn scalar(t: Tensor<Ad, 1>) -> f64 {
    t.into_scalar().elem::<f64>()
}

fn meta_f64(fx: &Fixture, key: &str) -> f64 {
    fx.meta()[key]
        .as_f64()
        .unwrap_or_else(|| panic!("meta {key}"))
}

/// The halt biases are single numbers whose gradient is a sum over all `(T, K, B)` positions of
/// terms that nearly cancel (the normalised halting weights are almost shift-invariant), so their
/// f32 value carries ~1e-4 relative rounding noise in the reference itself. Measured: the same
/// graph run in f64 lands 0.7e-4 to 2.1e-4 from the fixture's layer-0 block halt bias depending
/// only on summation order, while every other tensor agrees to ~1e-6. These four scalars get a
/// 5e-4 bound; everything else the fixture's 1e-4.
fn is_halt_bias(name: &str) -> bool {
    name.ends_with("_halt.bias")
}

fn check_halt_biases(fx: &Fixture, gs: &GradSet<Inner>, prefix: &str) {
    for (name, g) in gs.entries.iter().filter(|(n, _)| is_halt_bias(n)) {
        let e = rel_norm_err(&values(g.clone()), &fx.f32s(&format!("{prefix}{name}")).0);
        assert!(e <= 5e-4, "{prefix}{name}: relative error {e}");
    }
}

/// One training step exactly as the reference ran it, checked at every stage.
#[test]
fn training_step_matches_reference() {
    let fx = Fixture::load("tiny_a.safetensors");
    let mut model: NeuronSpark<Ad> = fx.model("param.");
    let names = param_shapes(&model);
    assert_eq!(names.len(), 7 + 30 * 2, "tiny_a has 2 layers");

    let x = fx.int::<Ad, 2>("input.x");
    let y = fx.int::<Ad, 2>("input.y");
    let mask = fx.float::<Ad, 2>("input.mask");

    // Forward: logits and CE.
    let fwd = model.forward(x.clone());
    let dl = max_abs_diff(&values(fwd.logits), &fx.f32s("out.logits").0);
    assert!(dl <= 1e-4, "logits max |diff| {dl}");

    let out = model.loss(x, y, mask, 0.01);
    let dce = max_abs_diff(
        &values(out.per_token_ce.clone()),
        &fx.f32s("out.per_token_ce").0,
    );
    assert!(dce <= 1e-4, "per-token CE max |diff| {dce}");
    for (got, key) in [
        (scalar(out.ce_masked_mean.clone()), "ce_masked_mean"),
        (scalar(out.ponder_cost.clone()), "ponder_cost"),
        (scalar(out.loss.clone()), "loss"),
    ] {
        let want = meta_f64(&fx, key);
        assert!((got - want).abs() <= 1e-5, "{key}: got {got}, want {want}");
    }

    // Backward: every parameter gradient.
    let grads = out.loss.backward();
    let mut gs = GradSet::<Inner>::collect::<Ad, _>(&model, "", &grads);
    assert_eq!(
        gs.entries.len(),
        names.len(),
        "every parameter receives a gradient"
    );
    let worst = |gs: &GradSet<Inner>, prefix: &str| {
        let mut worst = (0.0f64, String::new());
        for (name, g) in gs.entries.iter().filter(|(n, _)| !is_halt_bias(n)) {
            let e = rel_norm_err(&values(g.clone()), &fx.f32s(&format!("{prefix}{name}")).0);
            if e > worst.0 {
                worst = (e, name.clone());
            }
        }
        worst
    };
    let (e, name) = worst(&gs, "grad.");
    assert!(e <= 1e-4, "gradient of {name}: relative error {e}");
    check_halt_biases(&fx, &gs, "grad.");

    // Natural-gradient compensation, phases 1 and 2.
    natural_gradient(&model, &mut gs);
    let (e, name) = worst(&gs, "cgrad.");
    assert!(
        e <= 1e-4,
        "compensated gradient of {name}: relative error {e}"
    );
    check_halt_biases(&fx, &gs, "cgrad.");

    // Global norm and clip.
    let norm = gs.sum_squares().sqrt();
    let want = meta_f64(&fx, "grad_total_norm_before_clip");
    assert!(
        (norm - want).abs() / want <= 1e-5,
        "global norm {norm} vs {want}"
    );
    // One Adam step on the clipped gradients (the clip inside the update): lr 1e-3, neuron
    // params ×10.
    let mut adam = Adam::<Inner>::new(AdamConfig::adam());
    adam.step::<Ad, _>(&mut model, "", &gs, 1e-3, 1e-2, clip_factor(norm, 1.0));
    let after = nsactor_model::io::param_values(&model);
    let mut worst = (0.0f64, String::new());
    for (name, _, v) in &after {
        let e = rel_norm_err(v, &fx.f32s(&format!("after.{name}")).0);
        if e > worst.0 {
            worst = (e, name.clone());
        }
    }
    assert!(
        worst.0 <= 1e-4,
        "parameter {} after the step: relative error {}",
        worst.1,
        worst.0
    );
}

/// Greedy stateful decoding with the stepped (`after.*`) parameters reproduces the reference's
/// tokens, and each incremental logit row equals the full forward's.
#[test]
fn greedy_generation_matches_reference() {
    let fx = Fixture::load("tiny_a.safetensors");
    let model: NeuronSpark<Inner> = fx.model("after.");
    let (prompt, pshape) = fx.i64s("gen.prompt");
    let (greedy, gshape) = fx.i64s("gen.greedy");
    assert_eq!(pshape[0], 1);
    let new_tokens = gshape[1] - pshape[1];
    let got = model.generate_greedy(std::slice::from_ref(&prompt), new_tokens, None);
    assert_eq!(got[0], greedy, "greedy tokens");

    // Full forward over greedy[:-1] equals the reference's logits.
    let (full_want, fshape) = fx.f32s("gen.full_logits");
    let vocab = fshape[2];
    let ids: Vec<i64> = greedy[..greedy.len() - 1].to_vec();
    let ids_t = Tensor::<Inner, 2, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new(ids.clone(), [1, ids.len()]),
        &Default::default(),
    );
    let full = values(model.forward(ids_t.clone()).logits);
    let d = max_abs_diff(&full, &full_want);
    assert!(d <= 1e-4, "full logits max |diff| {d}");

    // Incremental: prefill the prompt, then feed one token at a time.
    let p = prompt.len();
    let mut dec = model.prefill(ids_t.slice([0..1, 0..p]));
    let mut rows = vec![values(dec.next_logits.clone())];
    for &tok in &ids[p..] {
        model.feed(&mut dec, &[tok]);
        rows.push(values(dec.next_logits.clone()));
    }
    for (i, row) in rows.iter().enumerate() {
        let pos = p - 1 + i;
        let want = &full_want[pos * vocab..(pos + 1) * vocab];
        let d = max_abs_diff(row, want);
        assert!(
            d <= 1e-4,
            "incremental logits at position {pos}: max |diff| {d}"
        );
    }
}

/// Rounds every parameter it maps to bf16 (kept in f32 tensors).
struct RoundToBf16;

impl<B: burn::tensor::backend::Backend> nsactor_model::params::ParamMapper<B> for RoundToBf16 {
    fn map<const D: usize>(&mut self, _name: &str, p: Tensor<B, D>) -> Tensor<B, D> {
        let (shape, device) = (p.shape(), p.device());
        let v: Vec<f32> = values(p)
            .into_iter()
            .map(nsactor_kernels::parity::round_bf16)
            .collect();
        Tensor::from_data(burn::tensor::TensorData::new(v, shape), &device).require_grad()
    }
}

/// Why `verify tiny-a --precision bf16` bounds the loss and the gradient norm but only reports
/// each parameter's gradient: tiny_a's gradients are not continuous in its inputs at bf16's
/// resolution. Rounding the weights to bf16 (≤ 2⁻⁹ relative each) and computing everything else
/// in exact f32 moves the loss by ≈ 1e-4 but every one of the 67 gradients by more than 1e-2
/// (measured: up to 0.49): spikes are step functions of `V − V_th`, and the membranes that
/// cross their threshold after the perturbation change the surrogate-free gradients of `V_th`,
/// the halting heads and everything upstream.
#[test]
fn bf16_rounded_weights_move_the_gradients_beyond_1e_2_but_not_the_loss() {
    use nsactor_model::Params;
    let fx = Fixture::load("tiny_a.safetensors");
    let mut model: NeuronSpark<Ad> = fx.model("param.");
    model.map_params("", &mut RoundToBf16);
    let out = model.loss(
        fx.int::<Ad, 2>("input.x"),
        fx.int::<Ad, 2>("input.y"),
        fx.float::<Ad, 2>("input.mask"),
        0.01,
    );
    let ce: f64 = out.ce_masked_mean.clone().into_scalar().elem();
    let want = meta_f64(&fx, "ce_masked_mean");
    assert!((ce - want).abs() / want < 1e-3, "CE {ce} against {want}");
    let grads = out.loss.backward();
    let gs = GradSet::<Inner>::collect::<Ad, _>(&model, "", &grads);
    let errors: Vec<f64> = gs
        .entries
        .iter()
        .map(|(n, g)| rel_norm_err(&values(g.clone()), &fx.f32s(&format!("grad.{n}")).0) as f64)
        .collect();
    assert_eq!(errors.len(), 67);
    let over = errors.iter().filter(|&&e| e > 1e-2).count();
    assert!(over > 60, "{over} of 67 gradients beyond 1e-2: {errors:?}");
}
