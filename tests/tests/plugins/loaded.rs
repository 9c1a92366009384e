//! Stages opened to load their weights (`InitialWeights::Loaded`, ABI 11), and stages opened
//! without an optimizer to serve (ABI 12), through the plugin boundary.

use super::{ndarray_plugin, train_batch};
use nsactor_engine::config::tiny_model;
use nsactor_engine::engine::StagedModel;
use nsactor_plugin_api::{
    EngineError, HostTensor, InitialWeights, OptimizerKind, Probe, Stage, StageCall, StageKind,
    StageSpec,
};
use safetensors::SafeTensors;

/// A stage opened to load its weights (`InitialWeights::Loaded`, ABI 11) crosses the C
/// boundary as such: it refuses every call until loaded, with an error that says why, and once
/// loaded from a seeded stage's save it answers exactly as that stage does (the same bytes
/// saved, the same forward bit for bit).
#[test]
fn a_stage_opened_to_load_refuses_calls_until_it_is_loaded() {
    let b = ndarray_plugin();
    let spec = |weights| StageSpec {
        kind: StageKind::Layer(1),
        device: 0,
        model: tiny_model(),
        seed: 11,
        optimizer: Some(OptimizerKind::Adam),
        weights,
    };
    let seeded = b.open_stage(&spec(InitialWeights::Seeded)).unwrap();
    let mut waiting = b.open_stage(&spec(InitialWeights::Loaded)).unwrap();
    let d = tiny_model().d;
    let h = || {
        let host = HostTensor {
            data: (0..3 * d).map(|i| (i as f32 * 0.61).cos()).collect(),
            shape: vec![3, 1, d],
        };
        b.from_host(0, &host).unwrap()
    };
    let e = waiting.call(StageCall::Probe { h: h() }).unwrap_err();
    assert!(
        matches!(e, EngineError::InvalidInput(_)),
        "a refusal is the caller's error: {e:?}"
    );
    let e = e.to_string();
    assert!(
        e.contains("layer 1") && e.contains("has none yet") && e.contains("Probe"),
        "{e}"
    );
    let e = waiting.save().unwrap_err().to_string();
    assert!(e.contains("has none yet") && e.contains("save"), "{e}");
    // A failed load leaves it waiting.
    assert!(waiting.load(b"not a safetensors file").is_err());
    assert!(waiting.call(StageCall::Probe { h: h() }).is_err());
    let bytes = seeded.save().unwrap();
    waiting.load(&bytes).unwrap();
    assert!(
        waiting.save().unwrap() == bytes,
        "loaded, it saves the same bytes"
    );
    let mut seeded = seeded;
    let probe = |s: &mut Box<dyn Stage>| {
        let p = Probe::try_from(s.call(StageCall::Probe { h: h() }).unwrap()).unwrap();
        let out = b.to_host(&p.h).unwrap().data;
        out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    assert_eq!(probe(&mut waiting), probe(&mut seeded));
}

/// A model opened without an optimizer (`StageSpec::optimizer: None`, ABI 12: how `serve`,
/// `eval` and a heal open a checkpoint) takes a trained checkpoint's weights and leaves its Adam
/// moments unread: it evaluates exactly as the trained model does, saves the same parameters
/// and no moments, and refuses a step with an error that says why.
#[test]
fn a_model_opened_without_an_optimizer_loads_the_weights_only_and_refuses_a_step() {
    let model = tiny_model();
    let mut trained =
        StagedModel::open(ndarray_plugin(), &model, 5, OptimizerKind::Adam, None).expect("open");
    let (batch, params) = train_batch();
    trained
        .train_step(std::slice::from_ref(&batch), &params)
        .unwrap();
    let shards = trained.save_stages().unwrap();
    let mut frozen = StagedModel::open_with(
        ndarray_plugin(),
        &model,
        5,
        None,
        None,
        InitialWeights::Loaded,
    )
    .unwrap();
    frozen.load_stages(&shards).unwrap();
    assert_eq!(
        frozen.eval_ce(&batch).unwrap().to_bits(),
        trained.eval_ce(&batch).unwrap().to_bits(),
        "the weights-only load evaluates as the trained model"
    );
    let resaved = frozen.save_stages().unwrap();
    for (full, weights) in shards.iter().zip(&resaved) {
        let (full, weights) = (
            SafeTensors::deserialize(full).unwrap(),
            SafeTensors::deserialize(weights).unwrap(),
        );
        let moments = full
            .names()
            .into_iter()
            .filter(|n| n.starts_with("adam."))
            .count();
        assert!(moments > 0, "the trained shard holds Adam moments");
        let mut names = weights.names();
        names.sort();
        let mut expected: Vec<_> = full
            .names()
            .into_iter()
            .filter(|n| !n.starts_with("adam."))
            .collect();
        expected.sort();
        assert_eq!(names, expected, "the frozen stage saves parameters only");
        for n in names {
            assert!(
                weights.tensor(n).unwrap().data() == full.tensor(n).unwrap().data(),
                "{n} differs after the weights-only load"
            );
        }
    }
    let e = frozen
        .train_step(std::slice::from_ref(&batch), &params)
        .unwrap_err();
    assert!(
        matches!(e, EngineError::InvalidInput(_))
            && e.to_string().contains("opened without an optimizer"),
        "{e}"
    );
}
