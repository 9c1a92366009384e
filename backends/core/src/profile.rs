//! `bench("decode-profile")`: where one decoder layer's decoding step spends its time, on the
//! backend's own device, without actors: the whole step, its four parts, and two probes that
//! bound it from below — the host cost of one tiny elementwise op (launch overhead) and one
//! decode-shaped projection GEMM.

use burn::tensor::{Distribution, ElementConversion, Tensor};
use nsactor_kernels::SnnOps;
use nsactor_model::init::Rng;
use nsactor_model::layer::{ponder_agg, ponder_agg_composed};
use nsactor_model::{LayerState, ModelConfig, SnnDecoderLayer};
use std::time::Instant;

/// Options: `batch` (sessions, default 1), `reps` (default 20), `config=tiny` for a small layer.
pub fn decode_profile<B: SnnOps>(device: &B::Device, options: &str) -> Result<String, String> {
    let (mut batch, mut reps, mut cfg) = (1usize, 20usize, ModelConfig::neuronspark_0_9b());
    for kv in nsactor_kernels::bench::option_items(options) {
        match kv.split_once('=') {
            Some(("batch", v)) => batch = v.parse().map_err(|_| format!("bad batch `{v}`"))?,
            Some(("reps", v)) => reps = v.parse().map_err(|_| format!("bad reps `{v}`"))?,
            Some(("config", "tiny")) => {
                cfg = ModelConfig::from_toml_str(
                    "[model]\nvocab_size = 64\nD = 64\nN = 4\nK = 4\nnum_layers = 2\nD_ff = 128\n",
                )
                .map_err(|e| e.to_string())?
            }
            _ => {
                return Err(format!(
                    "decode-profile takes batch=, reps=, config=tiny; got `{kv}`"
                ));
            }
        }
    }
    if batch == 0 || reps == 0 {
        return Err("batch and reps must be ≥ 1".into());
    }
    let layer = SnnDecoderLayer::<B>::init(&cfg, &mut Rng::new(7), device);
    let (d, k) = (cfg.d, cfg.k);
    let h = Tensor::<B, 3>::random([1, batch, d], Distribution::Normal(0.0, 1.0), device);
    let state = LayerState::zeros(&cfg, batch, device);
    let sync = || B::sync(device).map_err(|e| format!("{e:?}"));
    // Each probe runs once untimed (compilation, autotuning), then `reps` times; per call.
    let time = |n: usize, f: &mut dyn FnMut()| -> Result<f64, String> {
        f();
        sync()?;
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        sync()?;
        Ok(t.elapsed().as_secs_f64() / n as f64)
    };
    let mut out = format!(
        "decode step of one layer (D = {d}, N = {}, K = {k}, D_ff = {}), batch {batch}, {reps} reps:\n",
        cfg.n, cfg.d_ff
    );
    let row = |out: &mut String, name: &str, s: f64| {
        out.push_str(&format!("  {name:<44} {:>9.1} µs\n", s * 1e6));
    };
    let whole = time(reps, &mut || {
        let _ = layer.forward(h.clone(), state.clone(), &cfg);
    })?;
    row(&mut out, "whole layer (forward of one token)", whole);
    let x = layer.block_norm.forward(h.clone());
    row(
        &mut out,
        "RMSNorm",
        time(reps, &mut || {
            let _ = layer.block_norm.forward(h.clone());
        })?,
    );
    row(
        &mut out,
        "input PLIF (K frames)",
        time(reps, &mut || {
            let _ = layer.input_neuron1.forward_tokens(
                x.clone(),
                k,
                state.input1.clone(),
                cfg.plif_out,
            );
        })?,
    );
    let (a1, _) =
        layer
            .input_neuron1
            .forward_tokens(x.clone(), k, state.input1.clone(), cfg.plif_out);
    row(
        &mut out,
        "SNNBlock (7 projections + selective scan)",
        time(reps, &mut || {
            let _ = layer
                .snn_block
                .forward(a1.clone(), state.hidden.clone(), cfg.v_th_min);
        })?,
    );
    let (c1, _) = layer
        .snn_block
        .forward(a1.clone(), state.hidden.clone(), cfg.v_th_min);
    row(
        &mut out,
        "PonderAgg (halt + weighted sum)",
        time(reps, &mut || {
            let _ = ponder_agg(c1.clone(), &layer.block_halt, k);
        })?,
    );
    row(
        &mut out,
        "PonderAgg composed from tensor ops",
        time(reps, &mut || {
            let _ = ponder_agg_composed(c1.clone(), &layer.block_halt, k);
        })?,
    );
    let (agg, ek) = ponder_agg(c1.clone(), &layer.block_halt, k);
    // The fused kernel (where the backend has one) against the composition: refuse a wrong one.
    let (agg_ref, ek_ref) = ponder_agg_composed(c1.clone(), &layer.block_halt, k);
    let rel = |a: Tensor<B, 3>, b: Tensor<B, 3>| -> f32 {
        let scale = b.clone().abs().max().into_scalar().elem::<f32>().max(1e-30);
        (a - b).abs().max().into_scalar().elem::<f32>() / scale
    };
    let err_agg = rel(agg.clone(), agg_ref);
    let err_ek = rel(ek.unsqueeze::<3>(), ek_ref.unsqueeze::<3>());
    out.push_str(&format!(
        "  PonderAgg as run vs composed: aggregate {err_agg:.2e}, E[K] {err_ek:.2e} (max error / max |value|)\n"
    ));
    if !(err_agg <= 1e-4 && err_ek <= 1e-4) {
        return Err(format!(
            "{out}PonderAgg disagrees with its composition: refusing to go on"
        ));
    }
    row(
        &mut out,
        "out projection + centring",
        time(reps, &mut || {
            let r = layer
                .block_out_proj
                .forward(agg.clone().reshape([batch, d]));
            let _ = r.clone() - r.mean_dim(1);
        })?,
    );
    row(
        &mut out,
        "SNNFFN (gate/up + row scan + down)",
        time(reps, &mut || {
            let _ = layer
                .snn_ffn
                .forward(a1.clone(), state.ffn.clone(), cfg.plif_out);
        })?,
    );
    let small = Tensor::<B, 2>::zeros([k * batch, d], device);
    let launches = 200;
    let mut y = small.clone();
    let add = time(1, &mut || {
        for _ in 0..launches {
            y = y.clone() + 1.0;
        }
    })? / launches as f64;
    row(
        &mut out,
        &format!("probe: one elementwise op on [{}, {d}]", k * batch),
        add,
    );
    let w = Tensor::<B, 2>::random([d, cfg.dn()], Distribution::Normal(0.0, 0.02), device);
    row(
        &mut out,
        &format!("probe: GEMM [{}, {d}] × [{d}, {}]", k * batch, cfg.dn()),
        time(reps, &mut || {
            let _ = nsactor_kernels::matmul(small.clone(), w.clone());
        })?,
    );
    out.push_str(&format!(
        "  whole layer ≈ {:.0} elementwise-op launches\n",
        whole / add
    ));
    Ok(out)
}
