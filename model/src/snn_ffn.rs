//! SNNFFN: merged gate/up projection, one merged row-parameter scan, leak × leak gating (SPEC §2.3).

use crate::config::{ModelConfig, PlifOut};
use crate::init::{Rng, kaiming, kaiming_then};
use crate::neurons::{PlifNode, weight};
use crate::params::{Derived, Linear, decoding_pass, impl_params};
use burn::tensor::{Tensor, activation::sigmoid, backend::Backend};
use nsactor_kernels::last_frame;
use nsactor_kernels::{FfnInputs, SnnOps, plif_row};

#[derive(Debug, Clone)]
pub struct SnnFfn<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
    pub skip_proj: Linear<B>,
    pub gate_neuron: PlifNode<B>,
    pub up_neuron: PlifNode<B>,
    /// `[W_gate; W_up]` transposed, `[D, 2·D_ff]`, as the GEMM reads it, for untracked passes.
    pub merged_gate_up: Derived<B>,
    /// `[W_gate; W_up; W_skip]` transposed, `[D, 2·D_ff + D]`, for decoding passes.
    pub merged_gate_up_skip: Derived<B>,
}
impl_params!(SnnFfn {
    tensors: [],
    modules: [
        gate_proj,
        up_proj,
        down_proj,
        skip_proj,
        gate_neuron,
        up_neuron
    ],
    derived: [merged_gate_up, merged_gate_up_skip]
});

/// FFN neuron threshold base `v0 = 0.15` (the decoder layer overrides SNNFFN's own 0.3).
const FFN_V_THRESHOLD: f64 = 0.15;

impl<B: SnnOps> SnnFfn<B> {
    pub fn init(cfg: &ModelConfig, rng: &mut Rng, device: &B::Device) -> Self {
        let (d, f) = (cfg.d, cfg.d_ff);
        let lin = |w, out, inp| Linear::new(weight(w, [out, inp], device), None);
        let gate = kaiming(rng, f, d);
        let up = kaiming(rng, f, d);
        let down_scale = 1.0 / (cfg.num_layers as f32).sqrt();
        let down = kaiming_then(rng, d, f, |_, x| x * down_scale);
        let skip = kaiming(rng, d, d);
        SnnFfn {
            gate_proj: lin(gate, f, d),
            up_proj: lin(up, f, d),
            down_proj: lin(down, d, f),
            skip_proj: lin(skip, d, d),
            gate_neuron: PlifNode::init(f, FFN_V_THRESHOLD, rng, device),
            up_neuron: PlifNode::init(f, FFN_V_THRESHOLD, rng, device),
            merged_gate_up: Derived::default(),
            merged_gate_up_skip: Derived::default(),
        }
    }

    /// The gate and up neurons' β logits, then their thresholds, as the fused kernels take them.
    /// The fused kernels' inputs for the gate and up neurons on `i_gu` (`[TK, B, 2·D_ff]`, or
    /// `[TK·B, W]` read in its first 2·D_ff columns) from state `v0` `[B, 2·D_ff]`.
    pub fn neuron_inputs<const R: usize>(
        &self,
        i_gu: Tensor<B, R>,
        v0: Tensor<B, 2>,
        out: PlifOut,
    ) -> FfnInputs<B> {
        let params = [
            self.gate_neuron.w.clone(),
            self.up_neuron.w.clone(),
            self.gate_neuron.v_th.clone(),
            self.up_neuron.v_th.clone(),
        ];
        FfnInputs::new(i_gu, params, v0, out == PlifOut::Leak)
    }

    /// `a` `[TK, B, D]`, merged gate/up state `v0` `[B, 2·D_ff]` (gate first) → `[TK, B, D]` and
    /// the final state.
    pub fn forward(
        &self,
        a: Tensor<B, 3>,
        v0: Tensor<B, 2>,
        out: PlifOut,
    ) -> (Tensor<B, 3>, Tensor<B, 2>) {
        let [tk, b, d] = a.dims();
        let f = self.gate_proj.weight.dims()[0];
        let flat = a.reshape([tk * b, d]);
        let finish = |i_gu: Tensor<B, 3>, skip: Tensor<B, 2>| {
            let (gv, last) = self.gate_up(i_gu, v0.clone(), out);
            // The skip path added in the down projection's GEMM.
            let y = self.down_proj.forward_add(gv.reshape([tk * b, f]), skip);
            (y.reshape([tk, b, d]), last)
        };
        if decoding_pass::<B>(tk * b, &flat.device()) {
            // A decoding step: one GEMM for gate, up and skip, the neurons reading its first
            // 2·D_ff columns in place where the backend fuses them.
            let w = self.merged_gate_up_skip.get_or_init(|| {
                let w = Tensor::cat(
                    vec![
                        self.gate_proj.weight.clone(),
                        self.up_proj.weight.clone(),
                        self.skip_proj.weight.clone(),
                    ],
                    0,
                );
                crate::params::as_operand(w.transpose())
            });
            let y = nsactor_kernels::matmul(flat.clone(), w); // [TK·B, 2·D_ff + D]
            if let Some((gv, last)) =
                nsactor_kernels::ffn_plif_fused_rows(self.neuron_inputs(y.clone(), v0.clone(), out))
            {
                // The skip path added in the down projection's GEMM.
                let skip = y.narrow(1, 2 * f, d);
                let y = self.down_proj.forward_add(gv.reshape([tk * b, f]), skip);
                return (y.reshape([tk, b, d]), last);
            }
            // Unfused: the same product's slices.
            let i_gu = y.clone().narrow(1, 0, 2 * f).reshape([tk, b, 2 * f]);
            return finish(i_gu, y.narrow(1, 2 * f, d));
        }
        let cat = || {
            Tensor::cat(
                vec![self.gate_proj.weight.clone(), self.up_proj.weight.clone()],
                0,
            )
            .transpose()
        };
        // Autodiff must see the weights; an untracked pass reuses the concatenation.
        let w_gu = if B::ad_enabled(&flat.device()) {
            cat()
        } else {
            self.merged_gate_up
                .get_or_init(|| crate::params::as_operand(cat()))
        };
        // Rounded once for both GEMMs (bf16 storage).
        let flat = nsactor_kernels::stored(flat);
        // [TK·B, 2·D_ff]; in the storage type where the fused neurons read it (bf16 on CUDA
        // in bf16 precision), f32 for the composition.
        let i_gu = if B::fuses_ffn_neurons() {
            nsactor_kernels::matmul_stored(flat.clone(), w_gu)
        } else {
            nsactor_kernels::matmul(flat.clone(), w_gu)
        };
        let skip = self.skip_proj.forward(flat);
        finish(i_gu.reshape([tk, b, 2 * f]), skip)
    }

    /// The gate and up neurons on the merged projection `i_gu` `[TK, B, 2·D_ff]` and their
    /// product `[TK, B, D_ff]`, with the final state: one kernel where the backend fuses it for
    /// inference ([`nsactor_kernels::InferOps::ffn_plif_fused`]), one differentiable op where it
    /// fuses them for training ([`nsactor_kernels::ffn_neurons`]), else composed.
    pub fn gate_up(
        &self,
        i_gu: Tensor<B, 3>,
        v0: Tensor<B, 2>,
        out: PlifOut,
    ) -> (Tensor<B, 3>, Tensor<B, 2>) {
        let inputs = || self.neuron_inputs(i_gu.clone(), v0.clone(), out);
        if let Some(fused) = nsactor_kernels::ffn_plif_fused(inputs()) {
            return fused;
        }
        if B::fuses_ffn_neurons() {
            return nsactor_kernels::ffn_neurons(inputs());
        }
        self.gate_up_composed(i_gu, v0, out)
    }

    /// [`gate_up`](Self::gate_up) composed from tensor ops: `u = (1 − β)·i`, one merged
    /// row-parameter scan, leak × leak gating.
    pub fn gate_up_composed(
        &self,
        i_gu: Tensor<B, 3>,
        v0: Tensor<B, 2>,
        out: PlifOut,
    ) -> (Tensor<B, 3>, Tensor<B, 2>) {
        let [tk, b, two_f] = i_gu.dims();
        let f = two_f / 2;
        let beta = Tensor::cat(
            vec![
                sigmoid(self.gate_neuron.w.clone()),
                sigmoid(self.up_neuron.w.clone()),
            ],
            0,
        );
        let one_minus = beta.clone().neg() + 1.0; // [2·D_ff]
        let vth = Tensor::cat(
            vec![self.gate_neuron.v_th.clone(), self.up_neuron.v_th.clone()],
            0,
        );
        // On the flattened rows, as the reference writes it: the β gradient is then one sum
        // over rows (a 3-D broadcast would sum over two dimensions, in another order).
        let rows = i_gu.reshape([tk * b, 2 * f]) * one_minus.clone().unsqueeze::<2>();
        let u = rows.reshape([tk, b, 2 * f]);
        let (_, vpost) = plif_row(
            beta.unsqueeze::<2>().expand([b, 2 * f]),
            u,
            vth.unsqueeze::<2>().expand([b, 2 * f]),
            v0,
        );
        let last = last_frame(&vpost);
        let act = match out {
            PlifOut::Leak => vpost * one_minus.unsqueeze::<3>(),
            PlifOut::VPost => vpost,
        };
        let g = act.clone().slice([0..tk, 0..b, 0..f]);
        let v = act.slice([0..tk, 0..b, f..2 * f]);
        (g * v, last)
    }
}
