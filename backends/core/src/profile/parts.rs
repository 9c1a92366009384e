//! The decode profile's later parts: the layer's sublayers one by one (each as run against its
//! composition from tensor ops, timed and checked), then the probes that bound a decoding
//! step from below — one tiny elementwise op, one decode-shaped GEMM, and the host round trips
//! that reading a step's logits costs.

use super::{Setup, Timer, check, row};
use burn::tensor::{Distribution, Tensor};
use nsactor_kernels::SnnOps;
use nsactor_model::layer::{norm_plif, norm_plif_composed, ponder_agg, ponder_agg_composed};
use nsactor_model::params::decoding_pass;
use nsactor_plugin_api::EngineError;

/// The layer's projection GEMMs alone, at the pass's shapes and as a decoding pass issues them
/// (the block's merged input, `W_out`, the FFN's merged gate/up/skip and its down projection
/// over the frame rows; the two out projections over the token rows), on operands already in
/// the GEMMs' input type: their time, their rate, and what the rest of `whole` (the layer as
/// run) is. The layer's other kernels (norms, scans, PonderAgg, gating) and its gaps make up
/// that rest.
pub(super) fn gemms_alone<B: SnnOps>(
    out: &mut String,
    t: &Timer<B>,
    s: &Setup<B>,
    whole: f64,
) -> Result<(), EngineError> {
    let (cfg, layer, device) = (&s.cfg, &s.layer, t.device);
    let (rows, token_rows) = (s.rows(), s.tokens * s.batch);
    let (d, dn, f) = (cfg.d, cfg.dn(), cfg.d_ff);
    let operand = |r: usize, w: usize| {
        nsactor_kernels::gemm_operand(Tensor::<B, 2>::random(
            [r, w],
            Distribution::Normal(0.0, 0.5),
            device,
        ))
    };
    let (a, v, gv, agg) = (
        operand(rows, d),
        operand(rows, dn),
        operand(rows, f),
        operand(token_rows, d),
    );
    let skip = Tensor::<B, 2>::zeros([rows, d], device);
    let ffn = &layer.snn_ffn;
    let merged = decoding_pass::<B>(rows, device);
    let w_gus = nsactor_kernels::gemm_operand(
        Tensor::cat(
            vec![
                ffn.gate_proj.weight.clone(),
                ffn.up_proj.weight.clone(),
                ffn.skip_proj.weight.clone(),
            ],
            0,
        )
        .transpose(),
    );
    let gemms = t.time(t.reps, &mut || {
        let _ = layer.snn_block.projections(a.clone(), dn);
        let _ = layer.snn_block.W_out.forward(v.clone());
        if merged {
            let _ = nsactor_kernels::matmul(a.clone(), w_gus.clone());
        } else {
            let _ = ffn.gate_proj.forward(a.clone());
            let _ = ffn.up_proj.forward(a.clone());
            let _ = ffn.skip_proj.forward(a.clone());
        }
        let _ = ffn.down_proj.forward_add(gv.clone(), skip.clone());
        nsactor_kernels::per_token_gemms(|| {
            let _ = layer.block_out_proj.forward(agg.clone());
            let _ = layer.ffn_out_proj.forward(agg.clone());
        });
    })?;
    // Multiply-adds: the block's six projections and W_out, the FFN's three and its down
    // projection, over the frame rows; the two out projections over the token rows.
    let macs =
        rows * (d * (4 * dn + 2 * d) + dn * d + d * (2 * f + d) + f * d) + token_rows * 2 * d * d;
    let tflops = 2.0 * macs as f64 / gemms / 1e12;
    row(
        out,
        &format!("the layer's projection GEMMs alone ({tflops:.2} TFLOP/s)"),
        gemms,
    );
    row(
        out,
        &format!(
            "  the rest of the layer ({:.0} % of it: norms, scans, PonderAgg, gating, gaps)",
            100.0 * (whole - gemms).max(0.0) / whole
        ),
        (whole - gemms).max(0.0),
    );
    Ok(())
}

/// The sublayer's start as run (fused where the backend fuses it) or composed: timed, then
/// checked over 3 tokens from a non-resting state. Returns its spikes for the resting input,
/// which the block and the FFN parts read.
pub(super) fn norm_plif_part<B: SnnOps>(
    out: &mut String,
    t: &Timer<B>,
    s: &Setup<B>,
) -> Result<Tensor<B, 3>, EngineError> {
    let (cfg, layer, batch, d, k, device) = (&s.cfg, &s.layer, s.batch, s.cfg.d, s.cfg.k, t.device);
    let np = |h: &Tensor<B, 3>, v0: &Tensor<B, 2>, fused: bool| {
        let f = if fused { norm_plif } else { norm_plif_composed };
        f(
            &layer.block_norm,
            &layer.input_neuron1,
            h.clone(),
            k,
            v0.clone(),
            cfg.plif_out,
        )
    };
    for (name, fused) in [
        ("RMSNorm + input PLIF (K frames)", true),
        ("RMSNorm + input PLIF composed from tensor ops", false),
    ] {
        let secs = t.time(t.reps, &mut || {
            let _ = np(&s.h, &s.state.input1, fused);
        })?;
        row(out, name, secs);
    }
    // As run against the composition, over 3 tokens from a non-resting state.
    let h3 = Tensor::<B, 3>::random([3, batch, d], Distribution::Normal(0.0, 1.0), device);
    let v0 = Tensor::<B, 2>::random([batch, d], Distribution::Normal(0.0, 0.2), device);
    let ((y, last), (y_ref, last_ref)) = (np(&h3, &v0, true), np(&h3, &v0, false));
    check(
        out,
        "RMSNorm + input PLIF",
        &[(y, y_ref), (last.unsqueeze(), last_ref.unsqueeze())],
    )?;
    let (a1, _) = np(&s.h, &s.state.input1, true);
    Ok(a1)
}

/// The SNN block on the input spikes `a1`: timed whole; its projections as run (one GEMM on
/// concatenated weights where the backend merges them) checked against six separate GEMMs;
/// PonderAgg as run against its composition; then the out projection with its centring.
pub(super) fn block_part<B: SnnOps>(
    out: &mut String,
    t: &Timer<B>,
    s: &Setup<B>,
    a1: &Tensor<B, 3>,
) -> Result<(), EngineError> {
    let (cfg, layer, batch, d, k, reps) = (&s.cfg, &s.layer, s.batch, s.cfg.d, s.cfg.k, t.reps);
    let tokens = s.tokens;
    row(
        out,
        "SNNBlock (7 projections + selective scan)",
        t.time(reps, &mut || {
            let _ = layer
                .snn_block
                .forward(a1.clone(), s.state.hidden.clone(), cfg.v_th_min);
        })?,
    );
    // The projections as run (one GEMM on concatenated weights where the backend merges them)
    // against six separate GEMMs.
    let rows = s.rows();
    let flat = a1.clone().reshape([rows, d]);
    let blk = &layer.snn_block;
    let merged = blk.projections(flat.clone(), cfg.dn());
    let separate = [
        &blk.W_in,
        &blk.W_beta_x,
        &blk.W_alpha_x,
        &blk.W_th_x,
        &blk.W_gate,
        &blk.W_skip,
    ]
    .map(|l| l.forward(flat.clone()));
    let pairs: Vec<_> = merged
        .into_iter()
        .zip(separate)
        .map(|(m, s)| {
            let w = m.dims()[1];
            (
                m.reshape([rows / batch, batch, w]),
                s.reshape([rows / batch, batch, w]),
            )
        })
        .collect();
    check(out, "SNNBlock projections", &pairs)?;
    if decoding_pass::<B>(rows, t.device) {
        let (y, _) = blk.merged_projection(flat.clone());
        let scan = || {
            nsactor_kernels::block_scan_fused(
                y.clone(),
                blk.b_beta.clone(),
                blk.b_alpha.clone(),
                blk.b_th.clone(),
                s.state.hidden.clone(),
                cfg.v_th_min,
            )
        };
        if scan().is_some() {
            row(
                out,
                "  of it: the selective scan on the merged product",
                t.time(reps, &mut || {
                    let _ = scan();
                })?,
            );
        }
    }
    let (c1, _) = layer
        .snn_block
        .forward(a1.clone(), s.state.hidden.clone(), cfg.v_th_min);
    let pa = |fused: bool| {
        let f = if fused {
            ponder_agg
        } else {
            ponder_agg_composed
        };
        f(c1.clone(), &layer.block_halt, k)
    };
    for (name, fused) in [
        ("PonderAgg (halt + weighted sum)", true),
        ("PonderAgg composed from tensor ops", false),
    ] {
        let secs = t.time(reps, &mut || {
            let _ = pa(fused);
        })?;
        row(out, name, secs);
    }
    let ((agg, ek), (agg_ref, ek_ref)) = (pa(true), pa(false));
    check(
        out,
        "PonderAgg",
        &[
            (agg.clone(), agg_ref),
            (ek.unsqueeze_dim(2), ek_ref.unsqueeze_dim(2)),
        ],
    )?;
    row(
        out,
        "out projection + centring",
        t.time(reps, &mut || {
            let r = layer
                .block_out_proj
                .forward(agg.clone().reshape([tokens * batch, d]));
            let _ = r.clone() - r.mean_dim(1);
        })?,
    );
    Ok(())
}

/// The SNN FFN on the input spikes `a1`, timed whole; then its neurons and gating as run
/// against their composition, timed and checked on a non-resting state.
pub(super) fn ffn_part<B: SnnOps>(
    out: &mut String,
    t: &Timer<B>,
    s: &Setup<B>,
    a1: &Tensor<B, 3>,
) -> Result<(), EngineError> {
    let (cfg, layer, batch, k, reps, device) =
        (&s.cfg, &s.layer, s.batch, s.cfg.k, t.reps, t.device);
    row(
        out,
        "SNNFFN (gate/up + row scan + down)",
        t.time(reps, &mut || {
            let _ = layer
                .snn_ffn
                .forward(a1.clone(), s.state.ffn.clone(), cfg.plif_out);
        })?,
    );
    let f2 = 2 * cfg.d_ff;
    let i_gu = Tensor::<B, 3>::random([3 * k, batch, f2], Distribution::Normal(0.0, 1.0), device);
    let v0 = Tensor::<B, 2>::random([batch, f2], Distribution::Normal(0.0, 0.1), device);
    let gu = |fused: bool| {
        let ffn = &layer.snn_ffn;
        let (i, v) = (i_gu.clone(), v0.clone());
        if fused {
            ffn.gate_up(i, v, cfg.plif_out)
        } else {
            ffn.gate_up_composed(i, v, cfg.plif_out)
        }
    };
    for (name, fused) in [
        ("  of it: FFN neurons and gating, as run", true),
        ("  of it: FFN neurons and gating, composed", false),
    ] {
        let secs = t.time(reps, &mut || {
            let _ = gu(fused);
        })?;
        row(out, name, secs);
    }
    let ((gv, last), (gv_ref, last_ref)) = (gu(true), gu(false));
    check(
        out,
        "FFN neurons and gating",
        &[(gv, gv_ref), (last.unsqueeze(), last_ref.unsqueeze())],
    )
}

/// The probes on launches: one tiny elementwise op (per launch, returned), and a decode-shaped
/// projection GEMM with its input in f32 or already rounded.
pub(super) fn launch_probes<B: SnnOps>(
    out: &mut String,
    t: &Timer<B>,
    s: &Setup<B>,
) -> Result<f64, EngineError> {
    let (cfg, d, reps, device) = (&s.cfg, s.cfg.d, t.reps, t.device);
    let rows = s.rows();
    let small = Tensor::<B, 2>::zeros([rows, d], device);
    let launches = 200;
    let mut y = small.clone();
    let add = t.time(1, &mut || {
        for _ in 0..launches {
            y = y.clone() + 1.0;
        }
    })? / launches as f64;
    row(
        out,
        &format!("probe: one elementwise op on [{rows}, {d}]"),
        add,
    );
    // The weight as decoding keeps it (rounded once, as the GEMM reads it); the input f32
    // (rounded by the call, as a layer's inputs are where no kernel writes them rounded) or
    // already rounded.
    let w = nsactor_kernels::gemm_operand(Tensor::<B, 2>::random(
        [d, cfg.dn()],
        Distribution::Normal(0.0, 0.02),
        device,
    ));
    let small_op = nsactor_kernels::gemm_operand(small.clone());
    for (name, x) in [("f32 input", &small), ("input already rounded", &small_op)] {
        row(
            out,
            &format!("probe: GEMM [{rows}, {d}] × [{d}, {}], {name}", cfg.dn()),
            t.time(reps, &mut || {
                let _ = nsactor_kernels::matmul(x.clone(), w.clone());
            })?,
        );
    }
    Ok(add)
}

/// Host round trips: what reading a decoding step's logits costs beyond the work itself
/// (median of single calls, each from an idle device, as a decoding step meets it).
pub(super) fn host_probes<B: SnnOps>(
    out: &mut String,
    t: &Timer<B>,
    s: &Setup<B>,
) -> Result<(), EngineError> {
    let (cfg, batch) = (&s.cfg, s.batch);
    let logits = Tensor::<B, 2>::random([batch, cfg.vocab_size], Distribution::Default, t.device);
    row(
        out,
        "probe: sync of an idle device",
        t.median(&mut || t.sync())?,
    );
    row(
        out,
        &format!("probe: read [{batch}, {}] f32 to the host", cfg.vocab_size),
        t.median(&mut || {
            logits
                .clone()
                .into_data()
                .to_vec::<f32>()
                .map(|_| ())
                .map_err(|e| EngineError::Backend(format!("{e:?}")))
        })?,
    );
    row(
        out,
        "probe: one elementwise op, then read it",
        t.median(&mut || {
            (logits.clone() + 1.0)
                .into_data()
                .to_vec::<f32>()
                .map(|_| ())
                .map_err(|e| EngineError::Backend(format!("{e:?}")))
        })?,
    );
    Ok(())
}
