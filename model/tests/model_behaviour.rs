//! Behaviour of the model beyond the golden run: streaming equals full forward, frame invariance,
//! structured init, natural-gradient edge cases, configs and weight-file errors.

mod common;

use burn::tensor::{Distribution, Int, Tensor, TensorData};
use common::*;
use nsactor_model::init::{BlockInitTable, Rng, inv_normal_cdf, linspace};
use nsactor_model::io::{Layout, load_file, save_file};
use nsactor_model::layer::ponder_agg;
use nsactor_model::params::Linear;
use nsactor_model::train::phase2_scales;
use nsactor_model::{
    LayerState, ModelConfig, ModelError, NeuronSpark, PlifOut, is_neuron_param, param_shapes,
};

/// Small random configs, including N = 1 and K = 1 corners.
fn configs() -> Vec<ModelConfig> {
    let base = ModelConfig {
        vocab_size: 97,
        d: 12,
        n: 3,
        k: 3,
        num_layers: 2,
        d_ff: 20,
        v_th_min: 0.1,
        plif_out: PlifOut::Leak,
    };
    vec![
        base.clone(),
        ModelConfig {
            n: 1,
            k: 5,
            plif_out: PlifOut::VPost,
            ..base.clone()
        },
        ModelConfig {
            k: 1,
            num_layers: 3,
            d: 8,
            ..base.clone()
        },
        ModelConfig {
            n: 2,
            k: 2,
            d_ff: 7,
            ..base
        },
    ]
}

fn random_ids(b: usize, t: usize, vocab: usize, seed: u64) -> Vec<i64> {
    let mut rng = Rng::new(seed);
    (0..b * t)
        .map(|_| (rng.next_u64() % vocab as u64) as i64)
        .collect()
}

/// A model with the membranes pushed to spike often: thresholds lowered and modulation widened,
/// so the streaming test crosses resets rather than staying subthreshold.
fn lively_model(cfg: &ModelConfig, seed: u64) -> NeuronSpark<Inner> {
    let mut m = NeuronSpark::<Inner>::init(cfg, seed, &Default::default());
    for layer in &mut m.layers {
        layer.input_neuron1.v_th = layer.input_neuron1.v_th.clone() * 0.05;
        layer.input_neuron2.v_th = layer.input_neuron2.v_th.clone() * 0.05;
        layer.snn_ffn.gate_neuron.v_th = layer.snn_ffn.gate_neuron.v_th.clone() * 0.05;
    }
    m
}

#[test]
fn stepping_token_by_token_equals_one_forward() {
    for (ci, cfg) in configs().iter().enumerate() {
        let model = lively_model(cfg, 7 + ci as u64);
        let (b, t) = (2, 6);
        let ids = random_ids(b, t, cfg.vocab_size, ci as u64);
        let dev = Default::default();
        let full = values(
            model
                .forward(Tensor::<Inner, 2, Int>::from_data(
                    TensorData::new(ids.clone(), [b, t]),
                    &dev,
                ))
                .logits,
        );
        // Layer-level: T calls of `step` with carried state equal one `forward` per layer.
        let h = model.edge.embed(Tensor::from_data(
            TensorData::new(ids.clone(), [b, t]),
            &dev,
        ));
        for layer in &model.layers {
            let whole = layer.forward(h.clone(), LayerState::zeros(cfg, b, &dev), cfg);
            let mut state = LayerState::zeros(cfg, b, &dev);
            let mut steps = Vec::new();
            let mut step_ek: [Vec<Tensor<Inner, 2>>; 2] = [Vec::new(), Vec::new()];
            for i in 0..t {
                let out = layer.step(h.clone().narrow(0, i, 1), state, cfg);
                state = out.state;
                steps.push(out.h);
                let [e1, e2] = out.expected_k;
                step_ek[0].push(e1);
                step_ek[1].push(e2);
            }
            // E[K] of every token (what `nsactor analyze` reports) is the same streamed.
            for (sub, (stepped, whole_ek)) in step_ek.into_iter().zip(&whole.expected_k).enumerate()
            {
                let d = max_abs_diff(&values(Tensor::cat(stepped, 0)), &values(whole_ek.clone()));
                assert!(
                    d <= 1e-5,
                    "config {ci}: stepped E[K] of sublayer {sub} differs by {d}"
                );
            }
            // The probe is the forward, plus β(t) of every frame and hidden neuron in (0, 1).
            let (probed, beta) = layer.probe(h.clone(), LayerState::zeros(cfg, b, &dev), cfg);
            assert_eq!(values(probed.h), values(whole.h.clone()), "config {ci}");
            assert_eq!(beta.dims(), [t * cfg.k, b, cfg.dn()]);
            assert!(values(beta).iter().all(|&x| x > 0.0 && x < 1.0));
            let d = max_abs_diff(&values(Tensor::cat(steps, 0)), &values(whole.h));
            assert!(
                d <= 1e-5,
                "config {ci}: stepped layer output differs by {d}"
            );
            let d = max_abs_diff(&values(state.hidden), &values(whole.state.hidden));
            assert!(
                d <= 1e-5,
                "config {ci}: stepped hidden state differs by {d}"
            );
        }
        // Model-level: prefill 1 token then feed the rest one by one.
        let rows: Vec<Vec<i64>> = ids.chunks(t).map(|c| c.to_vec()).collect();
        let first: Vec<i64> = rows.iter().map(|r| r[0]).collect();
        let mut dec = model.prefill(Tensor::from_data(TensorData::new(first, [b, 1]), &dev));
        let vocab = cfg.vocab_size;
        for i in 0..t {
            let got = values(dec.next_logits.clone());
            for row in 0..b {
                let want = &full[(row * t + i) * vocab..(row * t + i + 1) * vocab];
                let d = max_abs_diff(&got[row * vocab..(row + 1) * vocab], want);
                assert!(
                    d <= 1e-4,
                    "config {ci}: incremental logits at {i} differ by {d}"
                );
            }
            if i + 1 < t {
                let next: Vec<i64> = rows.iter().map(|r| r[i + 1]).collect();
                model.feed(&mut dec, &next);
            }
        }
    }
}

#[test]
fn residual_frames_of_a_token_stay_identical() {
    for (ci, cfg) in configs().iter().enumerate() {
        let model = lively_model(cfg, 11 + ci as u64);
        let (b, t, k, d) = (2, 5, cfg.k, cfg.d);
        let dev = Default::default();
        let ids = random_ids(b, t, cfg.vocab_size, 100 + ci as u64);
        let h = model
            .edge
            .embed(Tensor::from_data(TensorData::new(ids, [b, t]), &dev));
        let mut frames = h
            .clone()
            .unsqueeze_dim::<4>(1)
            .expand([t, k, b, d])
            .reshape([t * k, b, d]);
        let mut tokens = h;
        for layer in &model.layers {
            frames = layer.forward_frames(frames, cfg);
            tokens = layer
                .forward(tokens, LayerState::zeros(cfg, b, &dev), cfg)
                .h;
            let f = values(frames.clone());
            let per_token = b * d;
            for ti in 0..t {
                let first = &f[ti * k * per_token..(ti * k + 1) * per_token];
                for fi in 1..k {
                    let other = &f[(ti * k + fi) * per_token..(ti * k + fi + 1) * per_token];
                    assert_eq!(
                        first, other,
                        "config {ci}: token {ti} frame {fi} differs from frame 0"
                    );
                }
            }
            let tk = values(tokens.clone());
            let firsts: Vec<f32> = (0..t)
                .flat_map(|ti| f[ti * k * per_token..(ti * k + 1) * per_token].to_vec())
                .collect();
            let dd = max_abs_diff(&firsts, &tk);
            assert!(
                dd <= 1e-5,
                "config {ci}: per-token layer differs from frame layout by {dd}"
            );
        }
    }
}

#[test]
fn ponder_at_init_has_the_spec_expected_k() {
    // SPEC §14.3: with p = σ(−3.5) everywhere, E[K] = 7.8702 and λ̂₁/λ̂₁₆ = 1.5625.
    let (t, k, b, d) = (3, 16, 2, 4);
    let dev = Default::default();
    let halt = Linear::<Inner>::new(
        Tensor::zeros([1, d], &dev),
        Some(Tensor::from_data([-3.5f32], &dev)),
    );
    let frames = Tensor::<Inner, 3>::random([t * k, b, d], Distribution::Normal(0.0, 1.0), &dev);
    let (agg, ek) = ponder_agg(frames.clone(), &halt, k);
    for e in values(ek) {
        assert!((e - 7.8702).abs() < 1e-3, "E[K] {e}");
    }
    // With one-hot frames the aggregate reads out the weights λ̂_k directly.
    let mut onehot = vec![0.0f32; t * k * b * d];
    for f in 0..t * k {
        onehot[f * b * d] = (f % k) as f32 + 1.0;
    }
    let (agg1, _) = ponder_agg(
        Tensor::from_data(TensorData::new(onehot.clone(), [t * k, b, d]), &dev),
        &halt,
        k,
    );
    let unit = |i: usize| {
        let mut v = vec![0.0f32; t * k * b * d];
        for tt in 0..t {
            v[(tt * k + i) * b * d] = 1.0;
        }
        values(
            ponder_agg(
                Tensor::from_data(TensorData::new(v, [t * k, b, d]), &dev),
                &halt,
                k,
            )
            .0,
        )[0]
    };
    let ratio = unit(0) / unit(15);
    assert!((ratio - 1.5625).abs() < 1e-3, "λ̂₁/λ̂₁₆ = {ratio}");
    assert_eq!(agg.dims(), [t, b, d]);
    assert!(values(agg1)[0] > 0.0);
}

#[test]
fn structured_init_matches_the_spec_table() {
    let table = BlockInitTable::new(8, 0.1);
    let close = |got: &[f64], want: &[f64], what: &str| {
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 6e-5, "{what}: got {got:?}, want {want:?}");
        }
    };
    close(
        &table.w_in_scale,
        &[
            0.6000, 0.5620, 0.5198, 0.4723, 0.4177, 0.3528, 0.2700, 0.1411,
        ],
        "W_in row scale",
    );
    close(
        &table.b_th,
        &[
            0.0508, 0.0682, 0.0864, 0.1053, 0.1236, 0.1378, 0.1356, 0.0648,
        ],
        "b_th",
    );
    close(
        &table.w_out_scale,
        &[
            0.7734, 0.8140, 0.8616, 0.9188, 0.9891, 1.0785, 1.1975, 1.3672,
        ],
        "W_out column scale",
    );
    let z: Vec<f64> = linspace(0.25, 0.08, 8)
        .iter()
        .map(|p| inv_normal_cdf(1.0 - p))
        .collect();
    close(
        &z,
        &[
            0.6745, 0.7530, 0.8365, 0.9263, 1.0243, 1.1332, 1.2575, 1.4051,
        ],
        "z_n",
    );

    // The per-neuron structure lands at index d·N + n in an initialised block.
    let cfg = ModelConfig {
        vocab_size: 16,
        d: 256,
        n: 8,
        k: 2,
        num_layers: 20,
        d_ff: 8,
        v_th_min: 0.1,
        plif_out: PlifOut::Leak,
    };
    let m = NeuronSpark::<Inner>::init(&cfg, 3, &Default::default());
    let bb = values(m.layers[0].snn_block.b_beta.clone());
    let logit = [
        1.3863, 1.5655, 1.7686, 2.0060, 2.2963, 2.6780, 3.2551, 4.5951,
    ];
    for (n, want) in logit.iter().enumerate() {
        let mean = (0..cfg.d).map(|d| bb[d * 8 + n] as f64).sum::<f64>() / cfg.d as f64;
        assert!(
            (mean - want).abs() < 0.03,
            "b_beta mean for n={n}: {mean} vs {want}"
        );
    }
    let halt_b = values(m.layers[0].block_halt.bias.clone().unwrap());
    assert_eq!(halt_b, vec![-3.5]);
    let out_std = values(m.layers[0].block_out_proj.weight.clone());
    let std =
        (out_std.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / out_std.len() as f64).sqrt();
    assert!(
        (std - 0.02 / 40f64.sqrt()).abs() < 2e-4,
        "out_proj std {std}"
    );
}

#[test]
fn the_0_9b_config_has_the_reference_parameter_count() {
    let cfg = nsactor_model::config::from_toml_file(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/neuronspark-0.9b.toml"),
    )
    .unwrap();
    assert_eq!(cfg, ModelConfig::neuronspark_0_9b());
    let model = NeuronSpark::<Inner>::init(&cfg, 0, &Default::default());
    let shapes = param_shapes(&model);
    assert_eq!(shapes.len(), 607);
    let total: usize = shapes
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    assert_eq!(total, 874_142_120);
    let names: std::collections::BTreeSet<_> = shapes.iter().map(|(n, _)| n.as_str()).collect();
    assert!(
        names.contains("layers.19.snn_block.W_in.weight") && names.contains("decode_proj.bias")
    );
}

#[test]
fn neuron_group_is_the_spec_list() {
    let cfg = &configs()[0];
    let m = NeuronSpark::<Inner>::init(cfg, 1, &Default::default());
    let neuron: Vec<String> = param_shapes(&m)
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| is_neuron_param(n))
        .collect();
    // Per layer: 4 input-neuron, 3 modulation-bias, 4 FFN-neuron tensors; plus the output neuron.
    assert_eq!(neuron.len(), 11 * cfg.num_layers + 2);
    for n in [
        "layers.0.block_halt.bias",
        "norm.gain",
        "decode_proj.bias",
        "embed_tokens.weight",
        "layers.1.ffn_norm.weight",
    ] {
        assert!(!is_neuron_param(n), "{n} is base LR");
    }
}

#[test]
fn phase2_equalises_norms_with_clamps_and_skips() {
    let s = phase2_scales(&[Some(1.0), Some(4.0)]);
    assert!(
        (s[0] - 2.0).abs() < 1e-12 && (s[1] - 0.5).abs() < 1e-12,
        "{s:?}"
    );
    // Clamped to [1/100, 100]; a zero-norm layer and a missing gradient are left alone.
    let s = phase2_scales(&[Some(1e-6), Some(1e6), Some(0.0), None]);
    assert_eq!(s[0], 100.0);
    assert_eq!(s[1], 0.01);
    assert_eq!(&s[2..], &[1.0, 1.0]);
    // Fewer than two valid layers: unchanged.
    assert_eq!(phase2_scales(&[Some(3.0), Some(1e-13)]), vec![1.0, 1.0]);
}

#[test]
fn configs_reject_unknown_keys_and_bad_values() {
    let ok = "[model]\nvocab_size = 10\nD = 4\nN = 2\nK = 2\nnum_layers = 1\nD_ff = 4\n";
    let cfg = nsactor_model::config::from_toml_str(ok).unwrap();
    assert_eq!(cfg.plif_out, PlifOut::Leak);
    assert_eq!(cfg.v_th_min, 0.1);
    let err = nsactor_model::config::from_toml_str(&format!("{ok}dropout = 0.1\n"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("dropout"), "{err}");
    let err = nsactor_model::config::from_toml_str(&ok.replace("K = 2", "K = 0"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("`K` must be positive"), "{err}");
    let err = nsactor_model::config::from_toml_str(&format!("{ok}plif_out = \"spike\"\n"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("spike"), "{err}");
    let tiny = nsactor_model::config::from_toml_file(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny.toml"),
    )
    .unwrap();
    assert_eq!((tiny.d, tiny.k, tiny.num_layers), (64, 4, 2));
}

#[test]
fn safetensors_round_trip_in_both_layouts_and_reject_bad_files() {
    let cfg = &configs()[0];
    let dev = Default::default();
    let a = NeuronSpark::<Inner>::init(cfg, 5, &dev);
    let dir = std::env::temp_dir().join(format!("nsactor-io-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for layout in [Layout::Plain, Layout::HuggingFace] {
        let path = dir.join(format!("{layout:?}.safetensors"));
        save_file(&a, &path, layout).unwrap();
        let mut b = NeuronSpark::<Inner>::init(cfg, 6, &dev);
        assert_eq!(load_file(&mut b, &path).unwrap(), layout);
        for ((na, _, va), (nb, _, vb)) in nsactor_model::io::param_values(&a)
            .iter()
            .zip(nsactor_model::io::param_values(&b))
        {
            assert_eq!(na, &nb);
            assert_eq!(va, &vb, "{na}");
        }
    }
    let path = dir.join("Plain.safetensors");
    // A model of another shape: a clear shape error naming the tensor.
    let mut other = NeuronSpark::<Inner>::init(
        &ModelConfig {
            d: 16,
            ..cfg.clone()
        },
        1,
        &dev,
    );
    let err = load_file(&mut other, &path).unwrap_err().to_string();
    assert!(
        err.contains("shape") && err.contains("embed_tokens.weight"),
        "{err}"
    );
    // Fewer layers in the model than in the file: extra tensors are rejected.
    let mut fewer = NeuronSpark::<Inner>::init(
        &ModelConfig {
            num_layers: 1,
            ..cfg.clone()
        },
        1,
        &dev,
    );
    let err = load_file(&mut fewer, &path).unwrap_err().to_string();
    assert!(err.contains("does not have"), "{err}");
    // More layers in the model than in the file: a missing tensor.
    let mut more = NeuronSpark::<Inner>::init(
        &ModelConfig {
            num_layers: 3,
            ..cfg.clone()
        },
        1,
        &dev,
    );
    let err = load_file(&mut more, &path).unwrap_err().to_string();
    assert!(err.contains("missing tensor `layers.2."), "{err}");
    // A truncated file.
    let bytes = std::fs::read(&path).unwrap();
    let torn = dir.join("torn.safetensors");
    std::fs::write(&torn, &bytes[..bytes.len() / 2]).unwrap();
    let mut b = NeuronSpark::<Inner>::init(cfg, 6, &dev);
    let err = load_file(&mut b, &torn).unwrap_err();
    assert!(matches!(err, ModelError::Weights(_)), "{err}");
    assert!(err.to_string().contains("torn.safetensors"), "{err}");
    // A missing file names the path.
    let err = load_file(&mut b, &dir.join("nope.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("nope.safetensors"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn operand_row_means_give_the_mean_of_the_projection() {
    // A decoding pass centres an out projection through w̄ (`residual_update`): x·w̄ᵀ must be
    // the mean over the output channels of x·Wᵀ, for every row.
    use burn::tensor::Distribution;
    use nsactor_model::params::Linear;
    let device = Default::default();
    let (inputs, outputs, rows) = (24, 40, 5);
    let lin = Linear::<Inner>::new(
        Tensor::random([outputs, inputs], Distribution::Normal(0.0, 1.0), &device),
        None,
    );
    let x = Tensor::<Inner, 2>::random([rows, inputs], Distribution::Normal(0.0, 1.0), &device);
    let w_mean = lin.operand_row_means();
    assert_eq!(w_mean.dims(), [1, inputs]);
    let via_means: Vec<f32> = (x.clone() * w_mean)
        .sum_dim(1)
        .into_data()
        .to_vec()
        .unwrap();
    let direct: Vec<f32> = lin.forward(x).mean_dim(1).into_data().to_vec().unwrap();
    for (a, b) in via_means.iter().zip(&direct) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
    }
    // And the centred output then has zero mean per row, as the composition's centring.
    let c = Tensor::<Inner, 2>::zeros([rows, outputs], &device);
    let x2 = Tensor::<Inner, 2>::random([rows, inputs], Distribution::Normal(0.0, 1.0), &device);
    let centred = lin.forward_add(x2.clone(), c) - (x2 * lin.operand_row_means()).sum_dim(1);
    let means: Vec<f32> = centred.mean_dim(1).into_data().to_vec().unwrap();
    assert!(means.iter().all(|m| m.abs() < 1e-5), "{means:?}");
}

/// `Rng::blank` draws nothing: a layer and an edge built from it have the seeded ones'
/// parameters, names and shapes alike, and every weight matrix (the drawn vectors: what took
/// the time) is zero, made on the device. Per-neuron vectors computed from the init table
/// with a scalar draw each are whatever the blank state gives: they are overwritten too.
#[test]
fn a_blank_generator_gives_the_same_parameters_all_zero() {
    use nsactor_model::params::{ParamVisitor, Params};
    struct Collect(Vec<(String, Vec<usize>, Vec<f32>)>);
    impl ParamVisitor<Inner> for Collect {
        fn visit<const D: usize>(&mut self, name: &str, p: &Tensor<Inner, D>) {
            let values = p.to_data().to_vec::<f32>().unwrap();
            self.0.push((name.to_string(), p.dims().to_vec(), values));
        }
    }
    let dev = Default::default();
    for cfg in configs() {
        let params = |blank: bool| {
            let mut rng = if blank { Rng::blank() } else { Rng::new(9) };
            let mut c = Collect(Vec::new());
            nsactor_model::SnnDecoderLayer::<Inner>::init(&cfg, &mut rng, &dev)
                .visit_params("layers.0.", &mut c);
            nsactor_model::Edge::<Inner>::init(&cfg, &mut rng, &dev).visit_params("", &mut c);
            c.0
        };
        let (seeded, blank) = (params(false), params(true));
        assert_eq!(seeded.len(), blank.len());
        let mut matrices = 0;
        for ((n, s, v), (bn, bs, bv)) in seeded.iter().zip(&blank) {
            assert_eq!((n, s), (bn, bs));
            assert_eq!(bv.len(), v.len(), "{n}");
            if s.len() == 2 && s[0] > 1 && s[1] > 1 {
                matrices += 1;
                assert!(bv.iter().all(|&x| x == 0.0), "{n} drawn: {bv:?}");
                assert!(v.iter().any(|&x| x != 0.0), "{n} seeded is drawn");
            }
        }
        assert!(matrices >= 12, "{matrices} weight matrices");
    }
}
