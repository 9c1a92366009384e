//! The host side of a stage call: a [`StageCall`] flattened into the `NsArgs` the C table
//! takes, and the input tensor it hands over.

use crate::NsArgs;
use nsactor_plugin_api::{DeviceTensor, SessionId, SnapshotId, StageCall};

/// `call` as `NsArgs` (pointers borrowed from `call`, from `named` for the calls that name
/// sessions and snapshots (sessions first), and from `mask` for `GradsIn`: all must outlive
/// the foreign call) and its input tensors.
pub(crate) fn encode(
    call: StageCall<'_>,
    named: &mut Vec<u64>,
    mask: &mut Vec<i64>,
) -> (NsArgs, Vec<DeviceTensor>) {
    let mut a = zero_args();
    let mut input: Option<DeviceTensor> = None;
    let mut inputs: Vec<DeviceTensor> = Vec::new();
    // `ids` of a call that names sessions or snapshots.
    let mut name = |a: &mut NsArgs, ids: &[&[u64]]| {
        named.clear();
        for part in ids {
            named.extend_from_slice(part);
        }
        a.sessions = named.as_ptr();
        a.sessions_len = named.len();
    };
    let tokens = |a: &mut NsArgs, t: nsactor_plugin_api::Tokens<'_>| {
        a.batch = t.batch as u64;
        a.seq_len = t.seq_len as u64;
        a.ids = t.ids.as_ptr();
        a.ids_len = t.ids.len();
    };
    let head = |a: &mut NsArgs, targets: &[i64], mask: &[f32]| {
        a.targets = targets.as_ptr();
        a.targets_len = targets.len();
        a.mask = mask.as_ptr();
        a.mask_len = mask.len();
    };
    match call {
        StageCall::Forward {
            micro,
            h,
            keep_graph,
        } => {
            a.micro = micro.0;
            a.f[0] = if keep_graph { 1.0 } else { 0.0 };
            input = Some(h);
        }
        StageCall::Backward {
            micro,
            grad,
            ponder_grad,
        } => {
            a.micro = micro.0;
            a.f[0] = ponder_grad;
            input = Some(grad);
        }
        StageCall::Embed { micro, tokens: t } => {
            a.micro = micro.0;
            tokens(&mut a, t);
        }
        StageCall::Head {
            micro,
            h,
            targets,
            mask,
            loss_scale,
        } => {
            a.micro = micro.0;
            head(&mut a, targets, mask);
            a.f[0] = loss_scale;
            input = Some(h);
        }
        StageCall::HeadEval { h, targets, mask } => {
            head(&mut a, targets, mask);
            input = Some(h);
        }
        StageCall::EmbedBackward { micro, grad } => {
            a.micro = micro.0;
            input = Some(grad);
        }
        StageCall::GradStats | StageCall::ZeroGrad => {}
        StageCall::ScaleGrads { scales } => a.f[..3].copy_from_slice(&scales),
        StageCall::Step {
            lr,
            neuron_lr,
            clip,
        } => a.f[..3].copy_from_slice(&[lr, neuron_lr, clip]),
        StageCall::SessionEmbed { tokens: t } => tokens(&mut a, t),
        StageCall::SessionForward { sessions, h }
        | StageCall::SessionDecode { sessions, h }
        | StageCall::SessionDecodeAll { sessions, h } => {
            a.sessions = SessionId::raw(sessions).as_ptr();
            a.sessions_len = sessions.len();
            input = Some(h);
        }
        StageCall::SessionSample { sessions, h, picks } => {
            a.sessions = SessionId::raw(sessions).as_ptr();
            a.sessions_len = sessions.len();
            a.batch = picks.rows as u64;
            a.targets = picks.ints.as_ptr();
            a.targets_len = picks.ints.len();
            a.mask = picks.floats.as_ptr();
            a.mask_len = picks.floats.len();
            input = Some(h);
        }
        StageCall::Probe { h } | StageCall::Evaluate { h } => input = Some(h),
        StageCall::TokenLosses { h, targets } => {
            head(&mut a, targets, &[]);
            input = Some(h);
        }
        StageCall::SessionClose { session } => name(&mut a, &[&[session.0]]),
        StageCall::StateSave {
            sessions,
            snapshots,
        }
        | StageCall::StateRestore {
            sessions,
            snapshots,
        } => {
            name(
                &mut a,
                &[SessionId::raw(sessions), SnapshotId::raw(snapshots)],
            );
        }
        StageCall::StateDrop { snapshot } | StageCall::StateRead { snapshot } => {
            name(&mut a, &[&[snapshot.0]]);
        }
        StageCall::StateWrite { snapshot, states } => {
            name(&mut a, &[&[snapshot.0]]);
            inputs = states;
        }
        StageCall::HoldGrads { hold } => a.f[0] = if hold { 1.0 } else { 0.0 },
        StageCall::GradsOut { keep } => a.f[0] = if keep { 1.0 } else { 0.0 },
        StageCall::GradsIn {
            stream,
            micro,
            mask: m,
            grad,
        } => {
            a.micro = micro.0;
            a.f[0] = f64::from(stream.0);
            *mask = m.words();
            a.ids = mask.as_ptr();
            a.ids_len = mask.len();
            input = Some(grad);
        }
    }
    inputs.extend(input);
    (a, inputs)
}

fn zero_args() -> NsArgs {
    NsArgs {
        micro: 0,
        sessions: std::ptr::null(),
        sessions_len: 0,
        batch: 0,
        seq_len: 0,
        ids: std::ptr::null(),
        ids_len: 0,
        targets: std::ptr::null(),
        targets_len: 0,
        mask: std::ptr::null(),
        mask_len: 0,
        f: [0.0; 4],
    }
}
