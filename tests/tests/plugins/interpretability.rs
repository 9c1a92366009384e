//! The interpretability calls (`Probe`, `TokenLosses`, ABI 7) through the plugin boundary.

use super::ndarray_plugin;
use nsactor_engine::config::tiny_model;
use nsactor_plugin_api::{
    ComputeBackend, InitialWeights, OptimizerKind, StageCall, StageKind, StageSpec,
};
use std::sync::Arc;

/// The interpretability calls (`Probe`, `TokenLosses`, ABI 7) through the plugin equal the
/// embedded engine's bit for bit, and a misdirected or malformed one is a clear error.
#[test]
fn probe_and_token_losses_cross_the_boundary_bitwise() {
    let run = |b: Arc<dyn ComputeBackend>| {
        let spec = |kind| StageSpec {
            kind,
            device: 0,
            model: tiny_model(),
            seed: 3,
            optimizer: Some(OptimizerKind::Adam),
            weights: InitialWeights::Seeded,
        };
        let mut edge = b.open_stage(&spec(StageKind::Edge)).unwrap();
        let mut layer = b.open_stage(&spec(StageKind::Layer(0))).unwrap();
        let ids = [3i64, 40, 41, 42, 43];
        let tokens = nsactor_plugin_api::Tokens {
            ids: &ids,
            batch: 1,
            seq_len: 5,
        };
        fn edge_h(
            edge: &mut dyn nsactor_plugin_api::Stage,
            tokens: nsactor_plugin_api::Tokens<'_>,
        ) -> nsactor_plugin_api::DeviceTensor {
            edge.call(StageCall::SessionEmbed { tokens })
                .unwrap()
                .into_tensor("SessionEmbed")
                .unwrap()
        }
        let h = edge_h(&mut *edge, tokens);
        let p = nsactor_plugin_api::Probe::try_from(layer.call(StageCall::Probe { h }).unwrap())
            .unwrap();
        let host = |t: &nsactor_plugin_api::DeviceTensor| b.to_host(t).unwrap();
        let (ek, hist, mean) = (host(&p.expected_k), host(&p.beta_hist), host(&p.beta_mean));
        assert_eq!(ek.shape, [2, 5, 1]);
        assert_eq!(hist.shape, [1, 1, nsactor_plugin_api::BETA_BINS]);
        let dn = tiny_model().dn();
        assert_eq!(
            hist.data.iter().sum::<f32>(),
            (5 * tiny_model().k * dn) as f32
        );
        assert_eq!(mean.shape, [1, 1, dn]);
        let targets = [40i64, 41, 42, 43, 0];
        let ce = edge
            .call(StageCall::TokenLosses {
                h: p.h,
                targets: &targets,
            })
            .unwrap()
            .into_tensor("TokenLosses")
            .unwrap();
        let ce = host(&ce);
        assert_eq!(ce.shape, [1, 1, 5]);
        assert_eq!(ce.data[4], 0.0, "padding scores nothing");
        assert!(ce.data[..4].iter().all(|&x| x > 0.0));
        // Misdirected and malformed calls.
        let h = edge_h(&mut *edge, tokens);
        let e = edge.call(StageCall::Probe { h }).unwrap_err().to_string();
        assert!(e.contains("Probe is a layer call"), "{e}");
        let h = edge_h(&mut *edge, tokens);
        let e = edge
            .call(StageCall::TokenLosses {
                h,
                targets: &targets[..3],
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("TokenLosses") && e.contains("5 targets, got 3"),
            "{e}"
        );
        [ek.data, hist.data, mean.data, ce.data]
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
