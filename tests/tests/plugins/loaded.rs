//! Stages opened to load their weights (`InitialWeights::Loaded`, ABI 11) through the plugin
//! boundary.

use super::ndarray_plugin;
use nsactor_plugin_api::{
    EngineError, HostTensor, InitialWeights, OptimizerKind, Probe, Stage, StageCall, StageKind,
    StageSpec,
};
use nsactor_runtime::config::tiny_model;

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
        optimizer: OptimizerKind::Adam,
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
