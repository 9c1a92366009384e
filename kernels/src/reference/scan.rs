//! The exact sequential PLIF scans on host memory (SPEC §6.1, §6.2).
//!
//! Layout: time-major, element `(k, c)` at `k * cols + c`, where a column `c` is a flattened
//! `(batch, dim)` index. State and arithmetic are `f32`; `v_pre = β·v + u` is one fused
//! multiply-add, as in the reference kernels.

use crate::ops::types::ScanKind;

/// Forward outputs of a scan: spikes (0/1) and the post-reset membrane potential, both `[TK, cols]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ScanOut {
    pub spike: Vec<f32>,
    pub vpost: Vec<f32>,
}

/// Gradients of a scan. For the row-parameter variant `beta` and `vth` are `[cols]` sums over time;
/// for the per-element variant they are `[TK, cols]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ScanGrads {
    pub beta: Vec<f32>,
    pub u: Vec<f32>,
    pub vth: Vec<f32>,
    pub v0: Vec<f32>,
}

fn check_len(name: &str, got: usize, want: usize) {
    assert_eq!(
        got, want,
        "PLIF scan: `{name}` has {got} elements, expected {want}"
    );
}

/// Per-element forward: `beta, u, vth` are `[TK, cols]`, `v0` is `[cols]`.
pub fn elem_forward(beta: &[f32], u: &[f32], vth: &[f32], v0: &[f32], cols: usize) -> ScanOut {
    check_len("beta", beta.len(), u.len());
    check_len("vth", vth.len(), u.len());
    scan_forward(u, v0, cols, |k, c| (beta[k * cols + c], vth[k * cols + c]))
}

/// Row-parameter forward: `beta, vth` are `[cols]` held for every step, `u` is `[TK, cols]`.
pub fn row_forward(beta: &[f32], u: &[f32], vth: &[f32], v0: &[f32], cols: usize) -> ScanOut {
    check_len("beta", beta.len(), cols);
    check_len("vth", vth.len(), cols);
    scan_forward(u, v0, cols, |_, c| (beta[c], vth[c]))
}

fn scan_forward(
    u: &[f32],
    v0: &[f32],
    cols: usize,
    params: impl Fn(usize, usize) -> (f32, f32),
) -> ScanOut {
    check_len("v0", v0.len(), cols);
    assert!(
        cols > 0 && u.len().is_multiple_of(cols),
        "PLIF scan: u length {} is not a multiple of {cols}",
        u.len()
    );
    let steps = u.len() / cols;
    let mut v = v0.to_vec();
    let mut spike = vec![0.0f32; u.len()];
    let mut vpost = vec![0.0f32; u.len()];
    for k in 0..steps {
        let row = k * cols;
        for c in 0..cols {
            let (b, th) = params(k, c);
            let v_pre = b.mul_add(v[c], u[row + c]);
            let s = if v_pre >= th { 1.0 } else { 0.0 };
            let vn = v_pre - th * s;
            v[c] = vn;
            spike[row + c] = s;
            vpost[row + c] = vn;
        }
    }
    ScanOut { spike, vpost }
}

/// Per-element backward (detached reset; `V_th` itself is not needed because no surrogate term
/// reaches the gradient): returns `[TK, cols]` gradients for `beta, u, vth`
/// and `[cols]` for `v0`.
pub fn elem_backward(
    beta: &[f32],
    v0: &[f32],
    vpost: &[f32],
    spike: &[f32],
    grad_vpost: &[f32],
    cols: usize,
) -> ScanGrads {
    let n = grad_vpost.len();
    check_len("beta", beta.len(), n);
    let mut g_beta = vec![0.0f32; n];
    let mut g_vth = vec![0.0f32; n];
    let (g_u, g_v0) = scan_backward(
        v0,
        vpost,
        spike,
        grad_vpost,
        cols,
        |k, c| beta[k * cols + c],
        |i, gpre, v_prev, gv_spike| {
            g_beta[i] = gpre * v_prev;
            g_vth[i] = gv_spike;
        },
    );
    ScanGrads {
        beta: g_beta,
        u: g_u,
        vth: g_vth,
        v0: g_v0,
    }
}

/// Row-parameter backward (detached reset): `beta`/`vth` gradients are accumulated over time into
/// `[cols]`; `u` gets `[TK, cols]`.
pub fn row_backward(
    beta: &[f32],
    v0: &[f32],
    vpost: &[f32],
    spike: &[f32],
    grad_vpost: &[f32],
    cols: usize,
) -> ScanGrads {
    check_len("beta", beta.len(), cols);
    let mut g_beta = vec![0.0f32; cols];
    let mut g_vth = vec![0.0f32; cols];
    let (g_u, g_v0) = scan_backward(
        v0,
        vpost,
        spike,
        grad_vpost,
        cols,
        |_, c| beta[c],
        |i, gpre, v_prev, gv_spike| {
            let c = i % cols;
            g_beta[c] += gpre * v_prev;
            g_vth[c] += gv_spike;
        },
    );
    ScanGrads {
        beta: g_beta,
        u: g_u,
        vth: g_vth,
        v0: g_v0,
    }
}

/// The shared reverse loop of SPEC §6.1 with `gSpike ≡ 0`:
/// `gV = gVpost[k] + acc; gpre = gV; gβ = gpre·V[k−1]; gu = gpre; gVth = −gV·s[k]; acc = gpre·β[k]`.
/// `emit(index, gpre, v_prev, g_vth)` receives the per-step terms for β and V_th.
fn scan_backward(
    v0: &[f32],
    vpost: &[f32],
    spike: &[f32],
    grad_vpost: &[f32],
    cols: usize,
    beta_at: impl Fn(usize, usize) -> f32,
    mut emit: impl FnMut(usize, f32, f32, f32),
) -> (Vec<f32>, Vec<f32>) {
    let n = grad_vpost.len();
    check_len("v0", v0.len(), cols);
    check_len("vpost", vpost.len(), n);
    check_len("spike", spike.len(), n);
    assert!(
        cols > 0 && n.is_multiple_of(cols),
        "PLIF scan: gradient length {n} is not a multiple of {cols}"
    );
    let steps = n / cols;
    let mut acc = vec![0.0f32; cols];
    let mut g_u = vec![0.0f32; n];
    for k in (0..steps).rev() {
        let row = k * cols;
        for c in 0..cols {
            let i = row + c;
            let v_prev = if k > 0 { vpost[i - cols] } else { v0[c] };
            let gv = grad_vpost[i] + acc[c];
            g_u[i] = gv;
            emit(i, gv, v_prev, -gv * spike[i]);
            acc[c] = gv * beta_at(k, c);
        }
    }
    (g_u, acc)
}

/// A host forward scan: `(beta, u, vth, v0, cols)`.
pub type HostForward = fn(&[f32], &[f32], &[f32], &[f32], usize) -> ScanOut;

/// A host backward scan: `(beta, v0, vpost, spike, grad_vpost, cols)`.
pub type HostBackward = fn(&[f32], &[f32], &[f32], &[f32], &[f32], usize) -> ScanGrads;

/// The host scans of `kind`: its forward and its backward.
pub fn scans(kind: ScanKind) -> (HostForward, HostBackward) {
    match kind {
        ScanKind::Elem => (elem_forward, elem_backward),
        ScanKind::Row => (row_forward, row_backward),
    }
}
