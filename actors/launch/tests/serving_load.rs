//! A checkpoint opened to serve (`launch::load_checkpoint`, as `serve`, `eval`, `generate` and
//! `analyze` open one) on the embedded CPU backend: its stages take the trained weights and no
//! optimizer, so the pipeline evaluates as the trained one but refuses to train or to write a
//! checkpoint that would have lost the Adam state.

#![cfg(feature = "embedded-cpu")]

use nsactor_engine::backend::EMBEDDED;
use nsactor_engine::config::{RunConfig, model_from_toml};
use nsactor_launch::launch::{CheckpointOptions, load_checkpoint};

#[path = "../../decoding/tests/common/mod.rs"]
mod common;

use common::*;

#[test]
fn a_checkpoint_opened_to_serve_evaluates_as_trained_and_refuses_to_train_or_checkpoint() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut trained = pipeline(1, None);
    trained.train_step(&batches(3, 2), &params(0)).unwrap();
    let mut cfg = RunConfig::load(None).unwrap();
    cfg.model = model_from_toml(MODEL).unwrap();
    cfg.train = train_cfg();
    let ck = trained
        .checkpoint(dir.path(), 2, toml::to_string(&cfg).unwrap(), None)
        .unwrap();
    let mut served = load_checkpoint(&CheckpointOptions {
        checkpoint: ck,
        backend: Some(EMBEDDED.into()),
        pipeline: 1,
        ..Default::default()
    })
    .unwrap()
    .pipeline;
    let probe = &batches(9, 1)[0];
    assert_eq!(
        served.eval_ce(probe).unwrap().to_bits(),
        trained.eval_ce(probe).unwrap().to_bits(),
        "the served pipeline evaluates as the trained one"
    );
    let e = served.train_step(&batches(4, 1), &params(1)).unwrap_err();
    assert!(
        e.to_string().contains("opened without an optimizer"),
        "a step is refused: {e}"
    );
    let e = served
        .checkpoint(&dir.path().join("again"), 2, String::new(), None)
        .unwrap_err();
    assert!(
        e.to_string().contains("without an optimizer"),
        "a checkpoint is refused: {e}"
    );
    assert!(!dir.path().join("again").exists(), "nothing was written");
    // The trained pipeline still trains.
    trained.train_step(&batches(4, 1), &params(1)).unwrap();
}
