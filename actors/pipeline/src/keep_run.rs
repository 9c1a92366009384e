//! The run's side of `keep_activations = "auto"`: the planner built from the pipeline's
//! placement and the run's configuration ([`auto_keep`]), and what the supervisor does around
//! each step: set the kept layers before it ([`before_step`]), measure device memory after it
//! and log ([`after_step`]). The choice itself is [`super::keep::AutoKeep`].

use super::keep::{AutoKeep, DeviceNeeds, Observed, gib};
use super::topology::Topology;
use nsactor_engine::config::TrainConfig;
use nsactor_plugin_api::{DeviceMemory, Diagnostic, DiagnosticReport};
use std::collections::BTreeMap;

/// Bytes a parameter holds in a stage that trains with Adam: its f32 value and two f32
/// moments (a checkpoint's 10.49 GB for the 0.9B's 874 M parameters).
const STATE_BYTES_PER_PARAM: u64 = 12;

/// The planner for a run whose `keep_activations` is `auto`, where the backend reports device
/// memory; `None` otherwise (a fixed number, or the CPU: then the layers keep what
/// [`Topology::keep`] started with).
pub fn auto_keep(topo: &Topology, train: &TrainConfig, param_count: u64) -> Option<AutoKeep> {
    if !train.keep_activations.is_auto() {
        return None;
    }
    if device_memory(topo).is_none() {
        tracing::info!(
            "keep_activations auto: the {} backend reports no device memory, so every layer \
             recomputes its forward in the backward",
            topo.backend.info().name
        );
        return None;
    }
    let m = &topo.spec.model;
    let num_layers = topo.replicas[0].plan.num_layers().max(1) as u64;
    // Per device: the stages of every replica placed there, and the layers of replica 0's
    // (a checkpoint's snapshot holds replica 0's state only).
    let mut placed: BTreeMap<usize, (u64, u64)> = BTreeMap::new();
    let mut max_layers = 0;
    for (i, r) in topo.replicas.iter().enumerate() {
        for s in &r.plan.stages {
            let e = placed.entry(s.device).or_default();
            e.0 += 1;
            if i == 0 {
                e.1 += s.layers.len() as u64;
            }
            max_layers = max_layers.max(s.layers.len());
        }
    }
    // The four scan inputs of one micro-batch in bf16: what a kept layer holds at the least.
    let frames = (train.batch_size * train.seq_len * m.k) as u64;
    let scan_inputs = 4 * m.dn() as u64 * frames * 2;
    let needs = placed
        .into_iter()
        .map(|(device, (stages, layers))| DeviceNeeds {
            device,
            floor_per_layer: stages * scan_inputs,
            held_for_checkpoints: if train.checkpoint_every > 0 {
                STATE_BYTES_PER_PARAM * param_count * layers / num_layers
            } else {
                0
            },
        })
        .collect();
    let cap = train
        .memory_budget_gib
        .map(|g| (g * (1u64 << 30) as f64) as u64);
    Some(
        AutoKeep::new(max_layers, cap, needs)
            .with_spare_layers(usize::from(train.accumulation > 1)),
    )
}

/// Each device's memory as the backend reports it, or `None` where it reports none.
fn device_memory(topo: &Topology) -> Option<Vec<DeviceMemory>> {
    match topo.backend.diagnose(&Diagnostic::Memory) {
        Ok(DiagnosticReport::Memory(m)) => Some(m),
        _ => None,
    }
}

/// Sets the layers the next step keeps, where `auto` is choosing them.
pub fn before_step(auto: &Option<AutoKeep>, topo: &Topology) {
    if let Some(a) = auto {
        topo.keep.set(a.next());
    }
}

/// After a step that succeeded: measures, and logs a choice and how it came out; `auto`
/// becomes `None` once the choice is settled.
pub fn after_step(auto: &mut Option<AutoKeep>, topo: &Topology) {
    let Some(a) = auto.as_mut() else {
        return;
    };
    let ran = a.next();
    let Some(memory) = device_memory(topo) else {
        tracing::warn!(
            "keep_activations auto: the device memory report failed; {ran} kept layer(s) per \
             stage from now on"
        );
        settle(auto, topo);
        return;
    };
    match a.observe(&memory) {
        Observed::Measuring => tracing::info!(
            "keep_activations auto: measured {} with {ran} kept layer(s) per stage",
            render(&memory)
        ),
        Observed::Chose {
            keep,
            devices,
            last,
        } => {
            let why: Vec<String> = devices
                .iter()
                .map(|d| {
                    format!(
                        "device {}: {:.2} GiB in use at the step before, {:.2} after \
                         this one with {ran} kept, so {:.2} GiB a layer; {:.2} of {:.2} \
                         GiB allowed: {} fit",
                        d.device,
                        gib(d.first),
                        gib(d.second),
                        gib(d.per_layer),
                        gib(d.allowed),
                        gib(d.total),
                        d.fits
                    )
                })
                .collect();
            tracing::info!(
                "keep_activations auto: {keep} layer(s) per stage keep their forward's \
                 graph from the next step on ({})",
                why.join("; ")
            );
            if last {
                settle(auto, topo);
            }
        }
        Observed::NoRoom { keep, devices } => {
            let why: Vec<String> = devices
                .iter()
                .map(|d| {
                    format!(
                        "device {}: {:.2} GiB in use after two steps with {ran} kept; a layer \
                         more is taken to need {:.2} GiB ({} × its scan inputs, not measured, \
                         and a tenth more), {:.2} of {:.2} GiB allowed",
                        d.device,
                        gib(d.second),
                        gib(d.per_layer) * super::keep::MARGIN,
                        super::keep::PESSIMISM,
                        gib(d.allowed),
                        gib(d.total),
                    )
                })
                .collect();
            tracing::info!(
                "keep_activations auto: {keep} layer(s) per stage keep their forward's graph, \
                 with no step tried at more: a step out of device memory would end the run ({})",
                why.join("; ")
            );
            settle(auto, topo);
        }
        Observed::Settled(v) => {
            for (device, used, predicted) in v {
                tracing::info!(
                    "keep_activations auto: settled on {ran} kept layer(s) per stage; \
                     device {device}: {:.2} GiB in use with them (predicted {:.2})",
                    gib(used),
                    gib(predicted)
                );
            }
            settle(auto, topo);
        }
        Observed::Done => settle(auto, topo),
    }
}

/// After a step that failed: while `auto` is choosing, the number falls back to the last that
/// ran a step and stays there ([`AutoKeep::failed`]).
pub fn step_failed(auto: &mut Option<AutoKeep>, topo: &Topology) {
    let Some(a) = auto.as_mut() else {
        return;
    };
    let (ran, keep) = (a.next(), a.failed());
    tracing::warn!(
        "keep_activations auto: a step with {ran} kept layer(s) per stage failed; {keep} from \
         now on"
    );
    topo.keep.set(keep);
    settle(auto, topo);
}

/// The number is final: the layers keep `auto`'s last choice from the next step on (a choice
/// below what just ran included), and `auto` is done.
fn settle(auto: &mut Option<AutoKeep>, topo: &Topology) {
    if let Some(a) = auto.as_ref() {
        topo.keep.set(a.next());
    }
    topo.keep.set_settled(true);
    *auto = None;
}

fn render(memory: &[DeviceMemory]) -> String {
    let v: Vec<String> = memory
        .iter()
        .map(|m| format!("device {}: {:.2} GiB", m.device, gib(m.used_bytes)))
        .collect();
    v.join(", ")
}
