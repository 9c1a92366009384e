//! The plugin boundary: the ndarray plugin loaded through libloading equals the embedded engine
//! bit for bit and reproduces the reference's `tiny_a` step; every failure of the boundary gives
//! an error that says what happened and what to do, and the host survives plugin panics.

mod common;

use common::*;

// More tests of this binary, by topic.
#[path = "plugins/interpretability.rs"]
mod interpretability;
#[path = "plugins/loaded.rs"]
mod loaded;

use nsactor_checkpoint::weights::merge_params;
use nsactor_engine::config::tiny_model;
use nsactor_engine::engine::{StagedModel, StepParams};
use nsactor_plugin_abi::host::{Plugin, library_file_name, resolve};
use nsactor_plugin_api::{
    ABI_VERSION, Batch, ComputeBackend, EngineError, HostTensor, InitialWeights, MicroBatchId,
    ModelConfig, OptimizerKind, SessionId, StageCall, StageKind, StageSpec,
};
use nsactor_training::verify;
use safetensors::SafeTensors;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// The ndarray plugin and the faulty test plugins, built once per test binary.
fn plugins() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(cargo_build)
}

fn ndarray_plugin() -> Arc<dyn ComputeBackend> {
    let p = Plugin::load(&library(plugins(), "nsactor_backend_ndarray")).expect("loads");
    assert_eq!(p.name, "ndarray");
    assert_eq!(p.abi_version, ABI_VERSION);
    p.open("").expect("opens")
}

/// One small training batch of the tiny model (2 × 8 tokens) and the step's parameters.
fn train_batch() -> (Batch, StepParams) {
    let (b, t) = (2, 8);
    let batch = Batch {
        batch: b,
        seq_len: t,
        inputs: (0..b * t).map(|i| (i * 7 % 200) as i64 + 3).collect(),
        targets: (0..b * t).map(|i| (i * 11 % 200) as i64 + 3).collect(),
        loss_mask: vec![1.0; b * t],
    };
    let params = StepParams {
        lr: 1e-2,
        neuron_lr: 1e-1,
        ponder_weight: 0.01,
        max_grad_norm: 1.0,
    };
    (batch, params)
}

#[test]
fn ndarray_plugin_equals_the_embedded_engine_bitwise_and_matches_the_reference() {
    let fx = fixture_bytes("tiny_a.safetensors");
    let plugin = verify::tiny_a(ndarray_plugin(), &fx, 1, &[0]).unwrap();
    let embedded =
        verify::tiny_a(Arc::new(nsactor_backend_ndarray::backend()), &fx, 2, &[0]).unwrap();

    // Bitwise: the same code on both sides of the boundary.
    assert_eq!(plugin.ce_before.to_bits(), embedded.ce_before.to_bits());
    assert_eq!(plugin.loss.to_bits(), embedded.loss.to_bits());
    assert_eq!(plugin.grad_norm.to_bits(), embedded.grad_norm.to_bits());
    assert!(
        plugin.shards == embedded.shards,
        "parameters or optimizer state differ between plugin and embedded engine"
    );
    assert_eq!(plugin.greedy, embedded.greedy);

    // The reference, within the fixture's tolerances.
    for (name, value, bound, ok) in plugin.checks() {
        assert!(
            ok,
            "{name}: {value:e} exceeds {bound:e}; worst parameter {:?}, greedy {:?} vs {:?}",
            plugin.worst_param, plugin.greedy, plugin.greedy_want
        );
    }
    let merged = merge_params(&plugin.shards).unwrap();
    let st = SafeTensors::deserialize(&merged).unwrap();
    let (_, header) = SafeTensors::read_metadata(&fx).unwrap();
    let params = header
        .tensors()
        .keys()
        .filter(|k| k.starts_with("param."))
        .count();
    assert_eq!(st.names().len(), params, "every parameter, once");
}

#[test]
fn a_missing_plugin_lists_the_places_searched() {
    let dirs = vec![
        PathBuf::from("/nonexistent/a"),
        PathBuf::from("/nonexistent/b"),
    ];
    let e = resolve("nosuch", &dirs).unwrap_err().to_string();
    assert!(e.contains(&library_file_name("nosuch")), "{e}");
    assert!(
        e.contains("/nonexistent/a") && e.contains("/nonexistent/b"),
        "{e}"
    );
    assert!(e.contains("NSACTOR_PLUGIN_PATH"), "{e}");
    let e = nsactor_engine::backend::open("/nonexistent/libx.so", &[])
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("/nonexistent/libx.so") && e.contains("does not exist"),
        "{e}"
    );
}

#[test]
fn a_plugin_for_another_abi_version_is_refused_naming_both_versions() {
    let e = Plugin::load(&library(plugins(), "nsactor_testplugin_bad_abi")).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, EngineError::Plugin(_)), "{e:?}");
    assert!(
        m.contains("ABI version 999") && m.contains(&format!("ABI version {ABI_VERSION}")),
        "{m}"
    );
}

#[test]
fn a_library_without_the_entry_symbol_is_refused() {
    let e = Plugin::load(&library(plugins(), "nsactor_testplugin_no_symbol"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not an nsactor backend plugin") && e.contains("nsactor_plugin_table"),
        "{e}"
    );
}

#[test]
fn a_device_that_fails_to_initialise_is_reported_and_the_host_continues() {
    let p = Plugin::load(&library(plugins(), "nsactor_testplugin_panicky")).unwrap();
    let e = p.open("fail").err().unwrap().to_string();
    assert!(
        e.contains("could not initialise") && e.contains("injected failure"),
        "{e}"
    );
    let e = p.open("panic").err().unwrap().to_string();
    assert!(e.contains("injected panic while opening"), "{e}");
    // The same library still opens normally afterwards.
    assert_eq!(p.open("").unwrap().info().devices, vec!["nothing"]);
}

#[test]
fn a_panic_inside_a_plugin_call_is_reported_and_the_host_keeps_running() {
    let p = Plugin::load(&library(plugins(), "nsactor_testplugin_panicky")).unwrap();
    let backend = p.open("").unwrap();
    let mut stage = backend
        .open_stage(&StageSpec {
            kind: StageKind::Layer(0),
            device: 0,
            model: ModelConfig::neuronspark_0_9b(),
            seed: 0,
            optimizer: Some(OptimizerKind::Adam),
            weights: InitialWeights::Seeded,
        })
        .unwrap();
    let host = HostTensor {
        data: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        shape: vec![1, 2, 3],
    };
    let t = backend.from_host(0, &host).unwrap();
    let e = stage
        .call(StageCall::Forward {
            micro: MicroBatchId(0),
            h: t,
            keep_graph: false,
        })
        .unwrap_err();
    assert!(
        matches!(&e, EngineError::Panic(m) if m.contains("injected panic in Forward")),
        "{e:?}"
    );
    // The plugin, the stage and tensor transfer keep working.
    let t = backend.from_host(0, &host).unwrap();
    let out = stage
        .call(StageCall::SessionForward {
            sessions: &[SessionId(1)],
            h: t,
        })
        .unwrap()
        .into_tensor("SessionForward")
        .unwrap();
    assert_eq!(out.shape(), vec![1, 2, 3]);
    assert_eq!(backend.to_host(&out).unwrap(), host);
    let e = stage.call(StageCall::GradStats).unwrap_err().to_string();
    assert!(e.contains("not supported by the panicky plugin"), "{e}");
}

#[test]
fn tensors_of_one_backend_are_refused_by_another() {
    let plugin = ndarray_plugin();
    let embedded = nsactor_backend_ndarray::backend();
    let host = HostTensor {
        data: vec![0.0; 64],
        shape: vec![1, 1, 64],
    };
    let t = plugin.from_host(0, &host).unwrap();
    let e = embedded.to_host(&t).unwrap_err().to_string();
    assert!(e.contains("another backend"), "{e}");
    // `ready` crosses the ABI (ABI 4): a CPU tensor is always computed; a foreign one is refused.
    plugin.ready(&t).unwrap();
    let e = embedded.ready(&t).unwrap_err().to_string();
    assert!(e.contains("ready") && e.contains("another backend"), "{e}");
    // Two contexts of the same plugin do not share tensors either.
    let other = ndarray_plugin();
    let e = other.to_host(&t).unwrap_err().to_string();
    assert!(e.contains("another context"), "{e}");
    let e = other.ready(&t).unwrap_err().to_string();
    assert!(e.contains("another context"), "{e}");
    let e = other.to_device(t, 0).unwrap_err().to_string();
    assert!(e.contains("another context"), "{e}");
    let e = plugin.from_host(3, &host).unwrap_err().to_string();
    assert!(e.contains("device 3 does not exist"), "{e}");
}

/// The CUDA plugin is built everywhere (it needs no toolkit) and must fail cleanly where there
/// is no GPU; where there is one it must list it.
#[test]
fn the_cuda_plugin_loads_and_opens_or_says_why_not() {
    let dir = cargo_build();
    let p = Plugin::load(&library(&dir, "nsactor_backend_cuda")).expect("the cuda plugin loads");
    assert_eq!(p.name, "cuda");
    match p.open("") {
        Ok(b) => {
            let info = b.info();
            assert!(
                !info.devices.is_empty() && info.devices[0].starts_with("cuda:0"),
                "{info:?}"
            );
        }
        Err(e) => {
            let m = e.to_string();
            assert!(
                m.contains("cannot use CUDA") && m.contains("--backend ndarray"),
                "{m}"
            );
        }
    }
}

#[test]
fn a_stage_snapshot_keeps_its_state_while_training_goes_on_and_serialises_on_another_thread() {
    let mut m = StagedModel::open(
        ndarray_plugin(),
        &tiny_model(),
        5,
        OptimizerKind::Adam,
        None,
    )
    .unwrap();
    let (batch, params) = train_batch();
    m.train_step(std::slice::from_ref(&batch), &params).unwrap();
    let before = m.save_stages().unwrap();
    let snaps = m.snapshot_stages().unwrap();
    // An unserialised snapshot is freed in the plugin when dropped.
    drop(m.snapshot_stages().unwrap());
    m.train_step(std::slice::from_ref(&batch), &params).unwrap();
    let after = m.save_stages().unwrap();
    assert!(after != before, "the second step changed nothing");
    let got = std::thread::spawn(move || {
        snaps
            .into_iter()
            .map(|s| s.bytes())
            .collect::<Result<Vec<_>, _>>()
    })
    .join()
    .unwrap()
    .unwrap();
    // The plugin's buffers are read in place (no copy across the boundary), then freed there.
    assert!(
        got.iter().map(|b| &b[..]).eq(before.iter().map(|v| &v[..])),
        "a snapshot taken before the second step serialised to other bytes than save()"
    );
}

/// `SessionSample` (ABI 8) through the C boundary: its picks block arrives whole (greedy and
/// sampled rows, biases, bans, penalties), the picked tokens and logits are bit-identical to the
/// embedded engine's, and a malformed block is refused with a clear error.
#[test]
fn session_sample_crosses_the_boundary_bitwise() {
    use nsactor_plugin_api::{PickParams, PicksBuf, RowPick, SessionId};
    let run = |b: Arc<dyn ComputeBackend>| {
        let spec = |kind| StageSpec {
            kind,
            device: 0,
            model: tiny_model(),
            seed: 4,
            optimizer: Some(OptimizerKind::Adam),
            weights: InitialWeights::Seeded,
        };
        let mut edge = b.open_stage(&spec(StageKind::Edge)).unwrap();
        let mut layer = b.open_stage(&spec(StageKind::Layer(0))).unwrap();
        let sessions = [SessionId(1), SessionId(2)];
        let ids = [3i64, 40, 41, 3, 50, 51];
        let tokens = nsactor_plugin_api::Tokens {
            ids: &ids,
            batch: 2,
            seq_len: 3,
        };
        let mut pass = |picks: &mut PicksBuf| {
            let h = edge
                .call(StageCall::SessionEmbed { tokens })
                .unwrap()
                .into_tensor("SessionEmbed")
                .unwrap();
            let h = layer
                .call(StageCall::SessionForward {
                    sessions: &sessions,
                    h,
                })
                .unwrap()
                .into_tensor("SessionForward")
                .unwrap();
            edge.call(StageCall::SessionSample {
                sessions: &sessions,
                h,
                picks: picks.picks(),
            })
        };
        let p = |temperature, seed| PickParams {
            temperature,
            top_k: 7,
            top_p: 0.9,
            min_p: 0.0,
            repetition_penalty: 1.2,
            presence_penalty: 0.3,
            frequency_penalty: 0.1,
            seed,
            step: 2,
            want_logits: true,
        };
        let bias = [(0u32, f32::NEG_INFINITY), (42, 1.5)];
        let mut picks = PicksBuf::new();
        picks.push(&RowPick {
            params: p(0.0, 1),
            history: &[40, 41, 42],
            generated: &[42],
            bias: &bias,
        });
        picks.push(&RowPick {
            params: p(0.9, 2),
            history: &[50],
            generated: &[],
            bias: &[],
        });
        let out = pass(&mut picks).unwrap().tensors;
        assert_eq!(out.len(), 2);
        let picked = b.to_host(&out[0]).unwrap();
        let logits = b.to_host(&out[1]).unwrap();
        assert_eq!(picked.shape, [1, 2, 2]);
        assert_eq!(logits.shape, [1, 2, tiny_model().vocab_size]);
        // One pick for two rows is refused, naming the call.
        let mut one = PicksBuf::new();
        one.push(&RowPick {
            params: p(0.0, 1),
            history: &[],
            generated: &[],
            bias: &[],
        });
        let e = pass(&mut one).unwrap_err().to_string();
        assert!(
            e.contains("SessionSample") && e.contains("1 picks for 2 rows"),
            "{e}"
        );
        [picked.data, logits.data]
    };
    let plugin = run(ndarray_plugin());
    let embedded = run(Arc::new(nsactor_backend_ndarray::backend()));
    for (i, (a, b)) in plugin.iter().zip(&embedded).enumerate() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(a),
            bits(b),
            "reply tensor {i} differs across the boundary"
        );
    }
}

/// The gradient exchange of data parallelism (`HoldGrads`, `GradsOut`, `GradsIn`, ABI 9)
/// through the plugin equals the embedded engine's bit for bit: a holding stage hands its
/// micro-batch's gradients over with their key and mask, another copy adds them after its own,
/// and the sum comes back whole; a part of the wrong size is refused.
#[test]
fn the_gradient_exchange_crosses_the_boundary_bitwise() {
    use nsactor_plugin_api::GradPart;
    let run = |b: Arc<dyn ComputeBackend>| {
        let model = tiny_model();
        let open = || {
            b.open_stage(&StageSpec {
                kind: StageKind::Layer(1),
                device: 0,
                model: model.clone(),
                seed: 5,
                optimizer: Some(OptimizerKind::Adam),
                weights: InitialWeights::Seeded,
            })
            .unwrap()
        };
        let (mut root, mut other) = (open(), open());
        let (t, d) = (4, model.d);
        let h = |seed: f32| HostTensor {
            data: (0..t * 2 * d)
                .map(|i| ((i as f32 * seed).sin()) * 0.5)
                .collect(),
            shape: vec![t, 2, d],
        };
        let train = |st: &mut Box<dyn nsactor_plugin_api::Stage>, micro: u64, seed: f32| {
            let out = st
                .call(StageCall::Forward {
                    micro: MicroBatchId(micro),
                    h: b.from_host(0, &h(seed)).unwrap(),
                    keep_graph: false,
                })
                .unwrap();
            drop(out);
            st.call(StageCall::Backward {
                micro: MicroBatchId(micro),
                grad: b.from_host(0, &h(seed + 1.0)).unwrap(),
                ponder_grad: 0.01,
            })
            .unwrap();
        };
        other.call(StageCall::HoldGrads { hold: true }).unwrap();
        train(&mut root, 7, 0.3);
        train(&mut other, 8, 0.7);
        let out = |st: &mut Box<dyn nsactor_plugin_api::Stage>, keep| {
            GradPart::from_reply(st.call(StageCall::GradsOut { keep }).unwrap()).unwrap()
        };
        let held = out(&mut other, false).expect("micro-batch 8's gradients");
        assert_eq!(held.key, MicroBatchId(8));
        assert!(out(&mut other, false).is_none(), "one part only");
        let n: usize = held.flat.shape().iter().product();
        assert_eq!(
            n as u64,
            root.param_count(),
            "every parameter has a gradient"
        );
        let mask = held.mask.clone();
        root.call(StageCall::GradsIn {
            stream: held.stream,
            micro: held.key,
            mask: &mask,
            grad: held.flat,
        })
        .unwrap();
        let sum = out(&mut root, true).expect("the sum");
        assert_eq!(sum.key, MicroBatchId(7), "keyed by its first micro-batch");
        let again = out(&mut root, false).expect("`keep` left it in place");
        let (a, s) = (
            b.to_host(&again.flat).unwrap(),
            b.to_host(&sum.flat).unwrap(),
        );
        assert_eq!(a, s);
        // A part of the wrong length for its mask.
        let short = b
            .from_host(
                0,
                &HostTensor {
                    data: vec![0.0; 3],
                    shape: vec![1, 1, 3],
                },
            )
            .unwrap();
        let e = root
            .call(StageCall::GradsIn {
                stream: sum.stream,
                micro: MicroBatchId(9),
                mask: &mask,
                grad: short,
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("GradsIn") && e.contains("3 values"), "{e}");
        s.data
    };
    let plugin = run(ndarray_plugin());
    let embedded = run(Arc::new(nsactor_backend_ndarray::backend()));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&plugin) == bits(&embedded),
        "the summed gradients differ across the boundary"
    );
    assert!(plugin.iter().any(|&g| g != 0.0));
}

#[test]
fn a_backend_without_collectives_says_so_across_the_boundary() {
    use nsactor_plugin_api::{CollectiveId, Communicator};
    let b = ndarray_plugin();
    let e = b.collective_id().expect_err("the CPU has no collectives");
    let m = e.to_string();
    assert!(m.contains("collectives"), "{m}");
    let e = b
        .collective_join(&CollectiveId(vec![0; 128]), 0, 2, 0)
        .expect_err("nor can it join a group");
    assert!(e.to_string().contains("collectives"), "{e}");
    let t = b.from_host(0, &row4(1.0)).unwrap();
    let e = b
        .all_reduce_sum(Communicator(0), t)
        .expect_err("nor all-reduce");
    assert!(e.to_string().contains("collectives"), "{e}");
}

/// `prewarm` (ABI 17) crosses the boundary: the CPU backend has no compile-only mode and says
/// so (`false`, nothing run), bad requests come back as errors naming what is wrong, and the
/// backend serves on afterwards.
#[test]
fn prewarm_crosses_the_boundary_and_a_backend_without_the_mode_says_so() {
    let b = ndarray_plugin();
    let spec = StageSpec {
        kind: StageKind::Layer(0),
        device: 0,
        model: tiny_model(),
        seed: 1,
        optimizer: None,
        weights: InitialWeights::Loaded,
    };
    assert!(!b.prewarm(&spec, 1, 8).expect("a CPU prewarm is no error"));
    let e = b.prewarm(&spec, 0, 8).expect_err("an empty input");
    assert!(
        matches!(e, EngineError::InvalidInput(_)) && e.to_string().contains("prewarm"),
        "{e}"
    );
    let e = b
        .prewarm(
            &StageSpec {
                device: 7,
                ..spec.clone()
            },
            1,
            8,
        )
        .expect_err("no device 7");
    assert!(e.to_string().contains("device 7"), "{e}");
    let layers = tiny_model().num_layers;
    let e = b
        .prewarm(
            &StageSpec {
                kind: StageKind::Layer(layers),
                ..spec.clone()
            },
            1,
            8,
        )
        .expect_err("no such layer");
    assert!(e.to_string().contains("does not exist"), "{e}");
    let back = b
        .from_host(0, &row4(2.0))
        .and_then(|t| b.to_host(&t))
        .expect("the backend works on");
    assert_eq!(back.data, vec![2.0; 4]);
}

/// A `[1, 1, 4]` tensor of `v`s.
fn row4(v: f32) -> HostTensor {
    HostTensor {
        data: vec![v; 4],
        shape: vec![1, 1, 4],
    }
}
