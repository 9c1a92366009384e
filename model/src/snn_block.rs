//! SNNBlock: seven projections, fused modulation and the selective hidden PLIF scan (SPEC §2.3).

use crate::config::ModelConfig;
use crate::init::{BlockInitTable, Rng, kaiming, kaiming_then};
use crate::neurons::{param, weight};
use crate::params::{Derived, Linear, decoding_pass, impl_params};
use burn::tensor::{Tensor, activation::sigmoid, backend::Backend};
use nsactor_kernels::{SnnOps, plif_selective};

/// Field names are the reference `state_dict` keys (`snn_block.W_in.weight`, …).
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct SnnBlock<B: Backend> {
    pub b_beta: Tensor<B, 1>,
    pub b_alpha: Tensor<B, 1>,
    pub b_th: Tensor<B, 1>,
    pub W_in: Linear<B>,
    pub W_beta_x: Linear<B>,
    pub W_alpha_x: Linear<B>,
    pub W_th_x: Linear<B>,
    pub W_gate: Linear<B>,
    pub W_skip: Linear<B>,
    pub W_out: Linear<B>,
    /// The four scan inputs' weights concatenated and transposed, `[D, 4·DN]`, as the merged
    /// GEMM of [`projections`](Self::projections) reads it.
    pub merged_scan: Derived<B>,
    /// The gate's and skip path's weights the same way, `[D, 2·D]`.
    pub merged_gate: Derived<B>,
}
impl_params!(SnnBlock {
    tensors: [b_beta, b_alpha, b_th],
    modules: [W_in, W_beta_x, W_alpha_x, W_th_x, W_gate, W_skip, W_out],
    derived: [merged_scan, merged_gate]
});

/// The merged projections `(y_scan [rows, 4·DN], y_gate [rows, 2·D])` as the six projections'
/// column slices.
fn merged_slices<B: Backend>(
    (y_scan, y_gate): (Tensor<B, 2>, Tensor<B, 2>),
    dn: usize,
    d: usize,
) -> [Tensor<B, 2>; 6] {
    let scan = |j: usize| y_scan.clone().narrow(1, j * dn, dn);
    let gate = |j: usize| y_gate.clone().narrow(1, j * d, d);
    [scan(0), scan(1), scan(2), scan(3), gate(0), gate(1)]
}

/// `softplus⁻¹(1) = ln(e − 1)`: the `b_alpha` init mean, so `α ≈ 1` at init.
const B_ALPHA_MEAN: f64 = 0.541_324_854_612_918;

fn linear<B: SnnOps>(w: Vec<f32>, out: usize, inp: usize, device: &B::Device) -> Linear<B> {
    Linear::new(weight(w, [out, inp], device), None)
}

impl<B: SnnOps> SnnBlock<B> {
    /// Structured init of SPEC §5 (hidden neuron index `d·N + n`).
    pub fn init(cfg: &ModelConfig, rng: &mut Rng, device: &B::Device) -> Self {
        let (d, n, dn) = (cfg.d, cfg.n, cfg.dn());
        let table = BlockInitTable::new(n, cfg.v_th_min);
        let b_beta = (0..dn)
            .map(|r| {
                let b = table.beta[r % n];
                ((b / (1.0 - b)).ln() + 0.1 * rng.normal()) as f32
            })
            .collect();
        let b_alpha = rng.normal_vec(dn, B_ALPHA_MEAN, 0.1);
        let b_th = (0..dn)
            .map(|r| (table.b_th[r % n] + 0.02 * rng.normal()) as f32)
            .collect();
        // The scalings are applied as the values are drawn, on the drawing threads.
        let w_in = kaiming_then(rng, dn, d, |i, x| x * table.w_in_scale[(i / d) % n] as f32);
        let small = |rng: &mut Rng| kaiming_then(rng, dn, d, |_, x| x * 0.1);
        let w_beta_x = small(rng);
        let w_alpha_x = small(rng);
        let w_th_x = small(rng);
        let w_gate = kaiming(rng, d, d);
        let w_skip = kaiming(rng, d, d);
        let w_out = kaiming_then(rng, d, dn, |i, x| {
            x * table.w_out_scale[(i % dn) % n] as f32
        });
        SnnBlock {
            b_beta: param(b_beta, [dn], device),
            b_alpha: param(b_alpha, [dn], device),
            b_th: param(b_th, [dn], device),
            W_in: linear(w_in, dn, d, device),
            W_beta_x: linear(w_beta_x, dn, d, device),
            W_alpha_x: linear(w_alpha_x, dn, d, device),
            W_th_x: linear(w_th_x, dn, d, device),
            W_gate: linear(w_gate, d, d, device),
            W_skip: linear(w_skip, d, d, device),
            W_out: linear(w_out, d, dn, device),
            merged_scan: Derived::default(),
            merged_gate: Derived::default(),
        }
    }

    /// The six projections of the input `[TK·B, D]`: `W_in, W_β, W_α, W_th` (`[TK·B, DN]` each),
    /// `W_gate, W_skip` (`[TK·B, D]`). The first four, read only by the selective scan, come in
    /// the backend's storage type ([`SnnOps::storage_dtype`]: bf16 on CUDA in bf16 precision),
    /// the gate and skip path in f32. Six GEMMs; two on concatenated weights where the backend
    /// prefers it ([`SnnOps::merges_small_gemms`]) for a small call without autodiff (a
    /// decoding step), whose outputs are column slices of two products.
    ///
    /// [`SnnOps::merges_small_gemms`]: nsactor_kernels::GemmOps::merges_small_gemms
    /// [`SnnOps::storage_dtype`]: nsactor_kernels::GemmOps::storage_dtype
    pub fn projections(&self, flat: Tensor<B, 2>, dn: usize) -> [Tensor<B, 2>; 6] {
        let [rows, d] = flat.dims();
        if decoding_pass::<B>(rows, &flat.device()) {
            return merged_slices(self.merged_projection(flat), dn, d);
        }
        let [w_in, w_beta, w_alpha, w_th, w_gate, w_skip] = self.input_linears();
        // Rounded once for the six GEMMs (bf16 storage), not once per GEMM.
        let flat = nsactor_kernels::stored(flat);
        [
            w_in.forward_stored(flat.clone()),
            w_beta.forward_stored(flat.clone()),
            w_alpha.forward_stored(flat.clone()),
            w_th.forward_stored(flat.clone()),
            w_gate.forward(flat.clone()),
            w_skip.forward(flat),
        ]
    }

    /// The six projections of the block's input, in [`projections`](Self::projections)' order.
    fn input_linears(&self) -> [&Linear<B>; 6] {
        [
            &self.W_in,
            &self.W_beta_x,
            &self.W_alpha_x,
            &self.W_th_x,
            &self.W_gate,
            &self.W_skip,
        ]
    }

    /// The six projections of a decoding pass's input `[TK·B, D]` as two GEMMs on concatenated
    /// weights: the scan's four inputs `[TK·B, 4·DN]` in the storage type (as the training
    /// forward stores them), the gate and skip path `[TK·B, 2·D]` in f32, columns in
    /// [`projections`](Self::projections)' order.
    pub fn merged_projection(&self, flat: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let [w_in, w_beta, w_alpha, w_th, w_gate, w_skip] = self.input_linears();
        let cat = |lins: &[&Linear<B>]| {
            let w = Tensor::cat(lins.iter().map(|l| l.weight.clone()).collect(), 0);
            crate::params::as_operand(w.transpose())
        };
        let w_scan = self
            .merged_scan
            .get_or_init(|| cat(&[w_in, w_beta, w_alpha, w_th]));
        let w_gate = self.merged_gate.get_or_init(|| cat(&[w_gate, w_skip]));
        (
            nsactor_kernels::matmul_stored(flat.clone(), w_scan),
            nsactor_kernels::matmul(flat, w_gate),
        )
    }

    /// The selective decay β(t) = σ(W_β·a + b_β) of every hidden neuron at every frame of `a`
    /// `[TK, B, D]`: `[TK, B, DN]` (Eq. 5; what [`forward`](Self::forward)'s scan computes
    /// inside its kernel).
    pub fn beta(&self, a: Tensor<B, 3>) -> Tensor<B, 3> {
        let [tk, b, d] = a.dims();
        let dn = self.b_beta.dims()[0];
        let rb = self.W_beta_x.forward(a.reshape([tk * b, d]));
        sigmoid(rb + self.b_beta.clone().unsqueeze::<2>()).reshape([tk, b, dn])
    }

    /// `a` `[TK, B, D]`, hidden state `v0` `[B, DN]` → output `[TK, B, D]` and final state.
    pub fn forward(
        &self,
        a: Tensor<B, 3>,
        v0: Tensor<B, 2>,
        v_th_min: f64,
    ) -> (Tensor<B, 3>, Tensor<B, 2>) {
        let [tk, b, d] = a.dims();
        let dn = self.b_beta.dims()[0];
        let flat = a.reshape([tk * b, d]);
        let projected = if decoding_pass::<B>(tk * b, &flat.device()) {
            // A decoding step: the scan and the gated output read the merged product in place
            // where the backend fuses them (five launches instead of ≈ 14).
            let (y, y_gate) = self.merged_projection(flat);
            if let Some((vpost, last)) = nsactor_kernels::block_scan_fused(
                y.clone(),
                self.b_beta.clone(),
                self.b_alpha.clone(),
                self.b_th.clone(),
                v0.clone(),
                v_th_min,
            ) {
                let out = self.W_out.forward(vpost);
                let out = match nsactor_kernels::gate_skip_fused(out.clone(), y_gate.clone(), 0, d)
                {
                    Some(o) => o,
                    None => nsactor_kernels::gated_out(
                        out,
                        y_gate.clone().narrow(1, 0, d),
                        y_gate.narrow(1, d, d),
                    ),
                };
                return (out.reshape([tk, b, d]), last);
            }
            merged_slices((y, y_gate), dn, d)
        } else {
            self.projections(flat, dn)
        };
        let [i, rb, ra, rt, gate, skip] = projected;
        let seq = |x: Tensor<B, 2>| x.reshape([tk, b, dn]);
        // Modulation (Eq. 5-7): β = σ(·+b_β), α = softplus(·+b_α), V_th = V_min + |·+b_th|,
        // u = α·i, inside the scan kernel where the backend fuses it.
        let (vpost, last) = plif_selective(
            seq(i),
            seq(rb),
            seq(ra),
            seq(rt),
            self.b_beta.clone(),
            self.b_alpha.clone(),
            self.b_th.clone(),
            v_th_min,
            v0,
        );
        // `W_out·V_post · σ(gate) + skip`: one op where the backend fuses it.
        let out = self.W_out.forward(vpost.reshape([tk * b, dn]));
        let out = nsactor_kernels::gated_out(out, gate, skip);
        (out.reshape([tk, b, d]), last)
    }
}
