//! The `SnnOps` family for `Autodiff<B>`: forward through `B`, backward through `B`'s backward
//! methods, one backward node per op: the scans and the fused training ops here, the GEMMs in
//! [`gemm`].

mod gemm;

use crate::ops::device::{DeviceOps, GraphOps};
use crate::ops::infer::InferOps;
use crate::ops::scan::ScanOps;
use crate::ops::snn::SnnOps;
use crate::ops::types::{
    FfnGrads, FfnInputs, NormPlifInputs, PlifGrads, PlifOutput, PonderInputs, ScanKind,
    SelectiveGrads, SelectiveInputs,
};
use burn::backend::autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::tensor::ops::FloatTensor;

/// Saved for backward: `beta` and `v0` as graph checkpoints, `V_post` and the spikes as outputs.
#[derive(Debug, Clone)]
struct ScanState<B: SnnOps> {
    beta: NodeId,
    v0: NodeId,
    vpost: FloatTensor<B>,
    spike: FloatTensor<B>,
}

#[derive(Debug)]
struct PlifBackward(ScanKind);

impl<B: SnnOps> Backward<B, 4> for PlifBackward {
    type State = ScanState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 4>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_beta, node_u, node_vth, node_v0] = ops.parents;
        let grad_vpost = grads.consume::<B>(&ops.node);
        let state = ops.state;
        let beta: FloatTensor<B> = checkpointer.retrieve_node_output(state.beta);
        let v0: FloatTensor<B> = checkpointer.retrieve_node_output(state.v0);
        let g: PlifGrads<B> =
            B::plif_backward(self.0, beta, v0, state.vpost, state.spike, grad_vpost);
        for (node, grad) in [
            (node_beta, g.beta),
            (node_u, g.u),
            (node_vth, g.vth),
            (node_v0, g.v0),
        ] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

fn forward<B: SnnOps, C: CheckpointStrategy>(
    kind: ScanKind,
    beta: FloatTensor<Autodiff<B, C>>,
    u: FloatTensor<Autodiff<B, C>>,
    vth: FloatTensor<Autodiff<B, C>>,
    v0: FloatTensor<Autodiff<B, C>>,
) -> PlifOutput<Autodiff<B, C>> {
    let run = |b, u, t, v| B::plif_forward(kind, b, u, t, v);
    let prep = PlifBackward(kind)
        .prepare::<C>([
            beta.node.clone(),
            u.node.clone(),
            vth.node.clone(),
            v0.node.clone(),
        ])
        .compute_bound()
        .stateful();
    match prep {
        OpsKind::Tracked(mut prep) => {
            let beta_id = prep.checkpoint(&beta);
            let v0_id = prep.checkpoint(&v0);
            let out = run(beta.primitive, u.primitive, vth.primitive, v0.primitive);
            let state = ScanState {
                beta: beta_id,
                v0: v0_id,
                vpost: out.vpost.clone(),
                spike: out.spike.clone(),
            };
            PlifOutput {
                spike: <FloatTensor<Autodiff<B, C>>>::new(out.spike),
                vpost: prep.finish(state, out.vpost),
                last: out.last.map(<FloatTensor<Autodiff<B, C>>>::new),
            }
        }
        OpsKind::UnTracked(prep) => {
            let out = run(beta.primitive, u.primitive, vth.primitive, v0.primitive);
            PlifOutput {
                spike: <FloatTensor<Autodiff<B, C>>>::new(out.spike),
                vpost: prep.finish(out.vpost),
                last: out.last.map(<FloatTensor<Autodiff<B, C>>>::new),
            }
        }
    }
}

/// Backward of the fused selective scan: every input is saved (the four projections are alive
/// anyway as the GEMMs' outputs), with the forward's `V_post` and spikes.
#[derive(Debug)]
struct SelectiveBackward;

#[derive(Debug, Clone)]
struct SelectiveState<B: SnnOps> {
    inputs: SelectiveInputs<B>,
    vpost: FloatTensor<B>,
    spike: FloatTensor<B>,
}

impl<B: SnnOps> Backward<B, 8> for SelectiveBackward {
    type State = SelectiveState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 8>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad_vpost = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let g: SelectiveGrads<B> =
            B::plif_selective_backward(s.inputs, s.vpost, s.spike, grad_vpost);
        let all = [
            g.i, g.r_beta, g.r_alpha, g.r_th, g.b_beta, g.b_alpha, g.b_th, g.v0,
        ];
        for (node, grad) in ops.parents.into_iter().zip(all) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Backward of RMSNorm + the input PLIF: the inputs and the forward's `V_post` are saved.
#[derive(Debug)]
struct NormPlifBackward;

#[derive(Debug, Clone)]
struct NormPlifState<B: SnnOps> {
    inputs: NormPlifInputs<B>,
    vpost: FloatTensor<B>,
}

impl<B: SnnOps> Backward<B, 5> for NormPlifBackward {
    type State = NormPlifState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 5>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let g = B::norm_plif_backward(s.inputs, s.vpost, grad);
        for (node, grad) in ops.parents.into_iter().zip(g) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Backward of PonderAgg: the inputs are saved (the halting distribution is recomputed).
#[derive(Debug)]
struct PonderBackward;

impl<B: SnnOps> Backward<B, 3> for PonderBackward {
    type State = PonderInputs<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let g = B::ponder_backward(ops.state, grad);
        for (node, grad) in ops.parents.into_iter().zip(g) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Backward of the FFN neurons: the inputs and the forward's `V_post` are saved (the spikes are
/// recomputed from them).
#[derive(Debug)]
struct FfnBackward;

#[derive(Debug, Clone)]
struct FfnState<B: SnnOps> {
    inputs: FfnInputs<B>,
    vpost: FloatTensor<B>,
}

impl<B: SnnOps> Backward<B, 6> for FfnBackward {
    type State = FfnState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 6>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad_gv = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let g: FfnGrads<B> = B::ffn_neurons_backward(s.inputs, s.vpost, grad_gv);
        let all = [g.i_gu, g.w_gate, g.w_up, g.th_gate, g.th_up, g.v0];
        for (node, grad) in ops.parents.into_iter().zip(all) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Backward of the SNNBlock's gated output: `r` and `g` are saved (σ is recomputed).
#[derive(Debug)]
struct GatedOutBackward;

impl<B: SnnOps> Backward<B, 3> for GatedOutBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<B>(&ops.node);
        let (r, g) = ops.state;
        let d = B::gated_out_backward(r, g, dy);
        for (node, grad) in ops.parents.into_iter().zip(d) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The scans' forward through `B`, their backward node (`PlifBackward`) through `B`'s.
impl<B: SnnOps, C: CheckpointStrategy> ScanOps for Autodiff<B, C> {
    fn plif_forward(
        kind: ScanKind,
        beta: FloatTensor<Self>,
        u: FloatTensor<Self>,
        vth: FloatTensor<Self>,
        v0: FloatTensor<Self>,
    ) -> PlifOutput<Self> {
        forward::<B, C>(kind, beta, u, vth, v0)
    }
}

/// The inference fusions are never used under autodiff: the defaults (`None`).
impl<B: SnnOps, C: CheckpointStrategy> InferOps for Autodiff<B, C> {}

/// Uploads go through the inner backend's ([`DeviceOps::upload_f32`]); the rest are defaults.
impl<B: SnnOps, C: CheckpointStrategy> DeviceOps for Autodiff<B, C> {
    fn upload_f32(
        values: &[f32],
        shape: burn::tensor::Shape,
        device: &Self::Device,
    ) -> burn::tensor::ops::FloatTensor<Self> {
        use burn::tensor::backend::AutodiffBackend;
        <Self as AutodiffBackend>::from_inner(B::upload_f32(values, shape, device))
    }

    fn compile_only(device: &Self::Device, on: bool) -> bool {
        B::compile_only(device, on)
    }
}

impl<B: SnnOps, C: CheckpointStrategy> GraphOps for Autodiff<B, C> {}

impl<B: SnnOps, C: CheckpointStrategy> crate::ops::optim::OptimOps for Autodiff<B, C> {}

impl<B: SnnOps, C: CheckpointStrategy> SnnOps for Autodiff<B, C> {
    fn fuses_modulation() -> bool {
        B::fuses_modulation()
    }

    fn fuses_ffn_neurons() -> bool {
        B::fuses_ffn_neurons()
    }

    fn fuses_ponder() -> bool {
        B::fuses_ponder()
    }

    fn fuses_norm_plif() -> bool {
        B::fuses_norm_plif()
    }

    fn fuses_gated_out() -> bool {
        B::fuses_gated_out()
    }

    fn gated_out_forward(
        r: FloatTensor<Self>,
        g: FloatTensor<Self>,
        s: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let parents = [r.node.clone(), g.node.clone(), s.node.clone()];
        match GatedOutBackward
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::gated_out_forward(r.primitive.clone(), g.primitive.clone(), s.primitive);
                prep.finish((r.primitive, g.primitive), y)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::gated_out_forward(r.primitive, g.primitive, s.primitive))
            }
        }
    }

    fn norm_plif_forward(inp: NormPlifInputs<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let parents = [
            inp.x.node.clone(),
            inp.norm_w.node.clone(),
            inp.w.node.clone(),
            inp.v_th.node.clone(),
            inp.v0.node.clone(),
        ];
        let inner = NormPlifInputs::<B> {
            x: inp.x.primitive,
            norm_w: inp.norm_w.primitive,
            eps: inp.eps,
            w: inp.w.primitive,
            v_th: inp.v_th.primitive,
            v0: inp.v0.primitive,
            k: inp.k,
            leak: inp.leak,
        };
        match NormPlifBackward
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (y, vpost) = B::norm_plif_forward(inner.clone());
                let state = NormPlifState {
                    inputs: inner,
                    vpost: vpost.clone(),
                };
                (prep.finish(state, y), <FloatTensor<Self>>::new(vpost))
            }
            OpsKind::UnTracked(prep) => {
                let (y, vpost) = B::norm_plif_forward(inner);
                (prep.finish(y), <FloatTensor<Self>>::new(vpost))
            }
        }
    }

    fn ponder_forward(inp: PonderInputs<Self>) -> FloatTensor<Self> {
        let parents = [
            inp.frames.node.clone(),
            inp.halt_w.node.clone(),
            inp.halt_b.node.clone(),
        ];
        let inner = PonderInputs::<B> {
            frames: inp.frames.primitive,
            halt_w: inp.halt_w.primitive,
            halt_b: inp.halt_b.primitive,
            k: inp.k,
            clamp: inp.clamp,
            eps: inp.eps,
        };
        match PonderBackward
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::ponder_forward(inner.clone());
                prep.finish(inner, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::ponder_forward(inner)),
        }
    }

    fn ffn_neurons_forward(inp: FfnInputs<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let parents = [
            inp.i_gu.node.clone(),
            inp.w_gate.node.clone(),
            inp.w_up.node.clone(),
            inp.th_gate.node.clone(),
            inp.th_up.node.clone(),
            inp.v0.node.clone(),
        ];
        let inner = FfnInputs::<B> {
            i_gu: inp.i_gu.primitive,
            w_gate: inp.w_gate.primitive,
            w_up: inp.w_up.primitive,
            th_gate: inp.th_gate.primitive,
            th_up: inp.th_up.primitive,
            v0: inp.v0.primitive,
            leak: inp.leak,
        };
        match FfnBackward.prepare::<C>(parents).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (gv, vpost) = B::ffn_neurons_forward(inner.clone());
                let state = FfnState {
                    inputs: inner,
                    vpost: vpost.clone(),
                };
                (prep.finish(state, gv), <FloatTensor<Self>>::new(vpost))
            }
            OpsKind::UnTracked(prep) => {
                let (gv, vpost) = B::ffn_neurons_forward(inner);
                (prep.finish(gv), <FloatTensor<Self>>::new(vpost))
            }
        }
    }

    fn plif_selective_forward(inp: SelectiveInputs<Self>) -> PlifOutput<Self> {
        let parents = [
            inp.i.node.clone(),
            inp.r_beta.node.clone(),
            inp.r_alpha.node.clone(),
            inp.r_th.node.clone(),
            inp.b_beta.node.clone(),
            inp.b_alpha.node.clone(),
            inp.b_th.node.clone(),
            inp.v0.node.clone(),
        ];
        let inner = SelectiveInputs::<B> {
            i: inp.i.primitive,
            r_beta: inp.r_beta.primitive,
            r_alpha: inp.r_alpha.primitive,
            r_th: inp.r_th.primitive,
            b_beta: inp.b_beta.primitive,
            b_alpha: inp.b_alpha.primitive,
            b_th: inp.b_th.primitive,
            v_th_min: inp.v_th_min,
            v0: inp.v0.primitive,
        };
        match SelectiveBackward
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::plif_selective_forward(inner.clone());
                let state = SelectiveState {
                    inputs: inner,
                    vpost: out.vpost.clone(),
                    spike: out.spike.clone(),
                };
                PlifOutput {
                    spike: <FloatTensor<Self>>::new(out.spike),
                    vpost: prep.finish(state, out.vpost),
                    last: out.last.map(<FloatTensor<Self>>::new),
                }
            }
            OpsKind::UnTracked(prep) => {
                let out = B::plif_selective_forward(inner);
                PlifOutput {
                    spike: <FloatTensor<Self>>::new(out.spike),
                    vpost: prep.finish(out.vpost),
                    last: out.last.map(<FloatTensor<Self>>::new),
                }
            }
        }
    }
}
