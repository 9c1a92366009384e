//! The PLIF neuron's step, written once for every kernel family (the scans, the selective scan,
//! RMSNorm + input PLIF, the FFN neurons, the decoding scans): charge, fire, soft reset, and
//! the reverse step of the detached-reset backward (SPEC §6.1).
//!
//! The arithmetic is [`crate::reference`]'s, term for term: `V_pre = fma(β, V, u)`, a spike
//! where `V_pre ≥ V_th`, the reset `V = V_pre − V_th·s` (exact, `s` is 0 or 1), `f32` state.
//! In reverse, with `gV = g + acc` (the step's own gradient plus the one carried from the step
//! after it): `∂β = gV·∂V_pre/∂β`, `∂V_th = −gV·s`, `∂u = gV`, and `acc = gV·β` carried to the
//! step before, each its own rounded product like the reference. The reset's spike is detached
//! and no kernel is ever handed a spike gradient (SPEC §0.2): the surrogate
//! (`Sigmoid(α = 4)`) reaches no gradient, so no kernel computes it.
//!
//! CubeCL expands these functions into the kernels that call them, so a kernel's code is what
//! it was when each wrote the step out itself (the parity checks of `nsactor bench kernels`
//! compare them with the reference on the device).

use cubecl::prelude::*;

/// The membrane before the spike test: `V_pre = fma(β, V, u)`.
#[cube]
pub(crate) fn charge(beta: f32, v: f32, u: f32) -> f32 {
    fma(beta, v, u)
}

/// The spike: 1 where `V_pre ≥ V_th`, else 0.
#[cube]
pub(crate) fn fire(v_pre: f32, th: f32) -> f32 {
    select(v_pre >= th, 1.0f32, 0.0f32)
}

/// The soft reset: `V_pre − V_th·s`.
#[cube]
pub(crate) fn soft_reset(v_pre: f32, th: f32, spike: f32) -> f32 {
    v_pre - th * spike
}

/// One step's outcome: the spike and the membrane after the reset.
#[derive(CubeType)]
pub(crate) struct Fired {
    pub spike: f32,
    pub v: f32,
}

/// Charge, fire and reset: one PLIF step from membrane `v` with input `u`.
#[cube]
pub(crate) fn plif(beta: f32, v: f32, u: f32, th: f32) -> Fired {
    let v_pre = charge(beta, v, u);
    let spike = fire(v_pre, th);
    Fired {
        spike,
        v: soft_reset(v_pre, th, spike),
    }
}

/// One PLIF step's new membrane (where the spike itself is not kept).
#[cube]
pub(crate) fn plif_step(beta: f32, v: f32, u: f32, th: f32) -> f32 {
    plif(beta, v, u, th).v
}

/// The spike of the step from `v_prev` with input `u`, recomputed in a backward pass that did
/// not store it.
#[cube]
pub(crate) fn spike_of(beta: f32, v_prev: f32, u: f32, th: f32) -> f32 {
    fire(charge(beta, v_prev, u), th)
}

/// One reverse step's gradients (see the module's formulas).
#[derive(CubeType)]
pub(crate) struct Reverse {
    /// `gV = g + acc`: also the gradient of the step's input `u`.
    pub gv: f32,
    /// `gV·∂V_pre/∂β`.
    pub g_beta: f32,
    /// `−gV·s`.
    pub g_th: f32,
    /// `gV·β`, carried to the step before.
    pub acc: f32,
}

/// The reverse of one step: `g` is the gradient reaching the step's `V_post` from outside,
/// `acc` the one carried from the step after, `dbeta` the step's `∂V_pre/∂β` (`V_{k−1}`; with
/// `u = i·(1 − β)`, `V_{k−1} − i`), `spike` its spike.
#[cube]
pub(crate) fn plif_reverse(g: f32, acc: f32, beta: f32, dbeta: f32, spike: f32) -> Reverse {
    let gv = g + acc;
    Reverse {
        gv,
        g_beta: gv * dbeta,
        g_th: -gv * spike,
        acc: gv * beta,
    }
}
