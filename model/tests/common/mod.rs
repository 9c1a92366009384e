//! Shared helpers for the model tests: the golden fixtures and tolerance measures.

#![allow(dead_code)]

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use burn_ndarray::NdArray;
use nsactor_model::{ModelConfig, NeuronSpark, PlifOut};
use safetensors::SafeTensors;
use std::path::PathBuf;

pub type Inner = NdArray<f32>;
pub type Ad = Autodiff<Inner>;

/// `shared/fixtures/` beside the checkout, or `$NSACTOR_FIXTURES`. Missing fixtures fail the test.
pub fn fixture_bytes(name: &str) -> Vec<u8> {
    let dir = std::env::var_os("NSACTOR_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures"));
    let path = dir.join(name);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "golden fixture {} is required and could not be read: {e}",
            path.display()
        )
    })
}

pub struct Fixture {
    bytes: Vec<u8>,
}

impl Fixture {
    pub fn load(name: &str) -> Self {
        Fixture {
            bytes: fixture_bytes(name),
        }
    }

    pub fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("fixture is valid safetensors")
    }

    pub fn meta(&self) -> serde_json::Value {
        let (_, meta) = SafeTensors::read_metadata(&self.bytes).expect("header");
        let text = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("meta"))
            .expect("meta entry")
            .clone();
        serde_json::from_str(&text).expect("meta is JSON")
    }

    pub fn has(&self, key: &str) -> bool {
        self.st().tensor(key).is_ok()
    }

    pub fn f32s(&self, key: &str) -> (Vec<f32>, Vec<usize>) {
        let st = self.st();
        let v = st
            .tensor(key)
            .unwrap_or_else(|e| panic!("fixture key {key}: {e}"));
        (
            nsactor_model::io::view_to_f32(key, &v).unwrap(),
            v.shape().to_vec(),
        )
    }

    pub fn i64s(&self, key: &str) -> (Vec<i64>, Vec<usize>) {
        let st = self.st();
        let v = st
            .tensor(key)
            .unwrap_or_else(|e| panic!("fixture key {key}: {e}"));
        assert_eq!(v.dtype(), safetensors::Dtype::I64, "{key}");
        let vals = v
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (vals, v.shape().to_vec())
    }

    pub fn float<B: Backend, const D: usize>(&self, key: &str) -> Tensor<B, D> {
        let (v, s) = self.f32s(key);
        Tensor::from_data(TensorData::new(v, s), &Default::default())
    }

    pub fn int<B: Backend, const D: usize>(&self, key: &str) -> Tensor<B, D, Int> {
        let (v, s) = self.i64s(key);
        Tensor::from_data(TensorData::new(v, s), &Default::default())
    }

    /// The model config in the fixture metadata.
    pub fn config(&self) -> ModelConfig {
        let c = &self.meta()["config"];
        let u = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("config.{k}")) as usize;
        ModelConfig {
            vocab_size: u("vocab_size"),
            d: u("D"),
            n: u("N"),
            k: u("K"),
            num_layers: u("num_layers"),
            d_ff: u("D_ff"),
            v_th_min: c["v_th_min"].as_f64().unwrap(),
            plif_out: PlifOut::Leak,
        }
    }

    /// A model with the fixture's parameters under `prefix` (`param.` or `after.`).
    pub fn model<B: nsactor_kernels::SnnOps>(&self, prefix: &str) -> NeuronSpark<B> {
        let mut m = NeuronSpark::<B>::init(&self.config(), 0, &Default::default());
        nsactor_model::io::load_params(&mut m, &self.st(), prefix)
            .expect("fixture parameters load");
        m
    }
}

pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `‖a − b‖ / ‖b‖`.
pub fn rel_norm_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    num.sqrt() / den.sqrt().max(1e-30)
}

/// Asserts that `got` matches `want` within `tol` in the largest `|a − b| / (1 + |b|)`, and
/// that `want` is not all but zero (a gradient that vanished would pass any comparison).
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length mismatch");
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(scale > 1e-3, "{what} is all but zero ({scale})");
    let err = got
        .iter()
        .zip(want)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max);
    assert!(err < tol, "{what} off by {err} (scale {scale})");
}
