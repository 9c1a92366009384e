//! How layers are grouped into pipeline stages and stages placed on devices.
//!
//! Every decoder layer costs the same. Stages fill devices in contiguous blocks (8 stages on 2
//! GPUs: stages 0–3 on the first, 4–7 on the second) so only one hop per direction crosses
//! devices. A device runs one stage's work at a time, so the device is the resource to balance:
//! the layers are first split as evenly as possible over the devices (20 layers on 2 GPUs: 10
//! and 10, whatever P is), then each device's layers over its stages, ⌊n/c⌋ or ⌈n/c⌉ each.
//! Within either split the smaller shares come first: stage 0 also hosts the edge (embedding,
//! head and loss) on its device and, under 1F1B, keeps the most micro-batches in flight, so it
//! gets the lighter compute and memory share.

use nsactor_engine::error::RuntimeError;
use std::ops::Range;

/// One pipeline stage: a run of layers on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePlan {
    pub layers: Range<usize>,
    pub device: usize,
}

/// The layer → stage → device map of a pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelinePlan {
    pub stages: Vec<StagePlan>,
}

impl PipelinePlan {
    /// `num_layers` layers in `p` stages over `devices` (stage `s` on
    /// `devices[s · |devices| / p]`), devices balanced first (module docs).
    pub fn balanced(num_layers: usize, p: usize, devices: &[usize]) -> Result<Self, RuntimeError> {
        if p == 0 {
            return Err(RuntimeError::Invalid(
                "--pipeline must be at least 1".into(),
            ));
        }
        if p > num_layers {
            return Err(RuntimeError::Invalid(format!(
                "--pipeline {p} needs at least {p} layers; the model has {num_layers}"
            )));
        }
        if devices.is_empty() {
            return Err(RuntimeError::Invalid(
                "no devices to place the pipeline on".into(),
            ));
        }
        if devices.len() > p {
            return Err(RuntimeError::Invalid(format!(
                "{} devices for {p} pipeline stages: use --pipeline ≥ {}",
                devices.len(),
                devices.len()
            )));
        }
        // Stages per device (stage s on device block s·g/p) and layers per device: an even split
        // when every device gets at least one layer per stage, else proportional to the stage
        // count (which always does, since p ≤ num_layers).
        let g = devices.len();
        let mut stage_count = vec![0usize; g];
        for s in 0..p {
            stage_count[s * g / p] += 1;
        }
        let mut device_layers = even_split(num_layers, g);
        if device_layers.iter().zip(&stage_count).any(|(l, c)| l < c) {
            let mut before = 0;
            device_layers = stage_count
                .iter()
                .map(|c| {
                    let (a, b) = (num_layers * before / p, num_layers * (before + c) / p);
                    before += c;
                    b - a
                })
                .collect();
        }
        let mut stages = Vec::with_capacity(p);
        let mut start = 0;
        for (j, (&layers, &count)) in device_layers.iter().zip(&stage_count).enumerate() {
            for n in even_split(layers, count) {
                stages.push(StagePlan {
                    layers: start..start + n,
                    device: devices[j],
                });
                start += n;
            }
        }
        Ok(PipelinePlan { stages })
    }

    /// The plans of `d` data-parallel replicas of a `p`-stage pipeline: `devices` is one
    /// device shared by all, or `d` equal blocks, replica `r` on block `r`.
    pub fn replicas(
        num_layers: usize,
        p: usize,
        d: usize,
        devices: &[usize],
    ) -> Result<Vec<Self>, RuntimeError> {
        if d == 0 {
            return Err(RuntimeError::Invalid(
                "--data-parallel must be at least 1".into(),
            ));
        }
        if devices.len() == 1 || d == 1 {
            let one = Self::balanced(num_layers, p, devices)?;
            return Ok(vec![one; d]);
        }
        if !devices.len().is_multiple_of(d) {
            return Err(RuntimeError::Invalid(format!(
                "--devices lists {} devices for {d} data-parallel replicas: give one device, or \
                 {d} equal blocks (replica r takes block r)",
                devices.len()
            )));
        }
        devices
            .chunks(devices.len() / d)
            .map(|block| Self::balanced(num_layers, p, block))
            .collect()
    }

    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    pub fn num_layers(&self) -> usize {
        self.stages.last().map_or(0, |s| s.layers.end)
    }

    /// Stage of layer `i`.
    pub fn stage_of(&self, layer: usize) -> usize {
        self.stages
            .iter()
            .position(|s| s.layers.contains(&layer))
            .expect("layer inside the plan")
    }

    /// Device of each layer, in layer order.
    pub fn layer_devices(&self) -> Vec<usize> {
        self.stages
            .iter()
            .flat_map(|s| s.layers.clone().map(move |_| s.device))
            .collect()
    }

    /// Where [`StagedModel::open`](nsactor_engine::engine::StagedModel::open) puts each stage.
    pub fn placement(&self) -> Placement {
        Placement {
            edge: self.edge_device(),
            layers: self.layer_devices(),
        }
    }

    /// Device of the edge: stage 0's.
    pub fn edge_device(&self) -> usize {
        self.stages[0].device
    }

    /// Largest stage's layer count over the mean: the pipeline runs at the pace of its slowest
    /// stage, so 1/imbalance bounds its efficiency (1.0 = perfectly even).
    pub fn imbalance(&self) -> f64 {
        let max = self
            .stages
            .iter()
            .map(|s| s.layers.len())
            .max()
            .unwrap_or(0);
        max as f64 * self.num_stages() as f64 / self.num_layers() as f64
    }

    /// Busiest device's layer count over the mean per device (1.0 = every device even).
    pub fn device_imbalance(&self) -> f64 {
        let mut per: std::collections::BTreeMap<usize, usize> = Default::default();
        for s in &self.stages {
            *per.entry(s.device).or_default() += s.layers.len();
        }
        let max = per.values().copied().max().unwrap_or(0);
        max as f64 * per.len() as f64 / self.num_layers() as f64
    }

    /// `0-1@0 2-3@0 …`: each stage's layers and device.
    pub fn describe(&self) -> String {
        self.stages
            .iter()
            .map(|s| format!("{}-{}@{}", s.layers.start, s.layers.end - 1, s.device))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// `n` split into `parts` shares of ⌊n/parts⌋ or ⌈n/parts⌉, the larger ones last.
fn even_split(n: usize, parts: usize) -> Vec<usize> {
    let (base, extra) = (n / parts, n % parts);
    (0..parts)
        .map(|i| base + usize::from(i >= parts - extra))
        .collect()
}

pub use nsactor_engine::placement::Placement;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_take_equal_blocks_of_devices() {
        let r = PipelinePlan::replicas(4, 2, 2, &[0, 1, 2, 3]).unwrap();
        assert_eq!(r[0].describe(), "0-1@0 2-3@1");
        assert_eq!(r[1].describe(), "0-1@2 2-3@3");
        let shared = PipelinePlan::replicas(4, 2, 3, &[0]).unwrap();
        assert_eq!(shared.len(), 3);
        assert!(shared.iter().all(|p| p.describe() == "0-1@0 2-3@0"));
        let e = PipelinePlan::replicas(4, 2, 2, &[0, 1, 2]).unwrap_err();
        assert!(e.to_string().contains("equal blocks"), "{e}");
    }

    #[test]
    fn twenty_layers_over_eight_stages_on_two_devices_split_ten_and_ten() {
        let p = PipelinePlan::balanced(20, 8, &[0, 1]).unwrap();
        let sizes: Vec<usize> = p.stages.iter().map(|s| s.layers.len()).collect();
        assert_eq!(sizes, [2, 2, 3, 3, 2, 2, 3, 3]);
        let devices: Vec<usize> = p.stages.iter().map(|s| s.device).collect();
        assert_eq!(devices, [0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(p.num_layers(), 20);
        assert!((p.imbalance() - 1.2).abs() < 1e-12);
        assert_eq!(p.device_imbalance(), 1.0);
        assert_eq!(p.stage_of(9), 3);
        assert_eq!(p.stage_of(10), 4);
        assert_eq!(p.layer_devices().iter().filter(|&&d| d == 1).count(), 10);
        assert_eq!(p.describe().split(' ').next(), Some("0-1@0"));
        // One device: the plain split, short stages first.
        let one = PipelinePlan::balanced(20, 8, &[0]).unwrap();
        let sizes: Vec<usize> = one.stages.iter().map(|s| s.layers.len()).collect();
        assert_eq!(sizes, [2, 2, 2, 2, 3, 3, 3, 3]);
        // Three stages on two devices: 10 layers per device, device 0's split over two stages.
        let three = PipelinePlan::balanced(20, 3, &[0, 1]).unwrap();
        assert_eq!(three.describe(), "0-4@0 5-9@0 10-19@1");
        // An even device split that would leave a stage empty falls back to one proportional
        // to the stage counts: 5 layers, 5 stages, 3 of them on device 0.
        let tight = PipelinePlan::balanced(5, 5, &[0, 1]).unwrap();
        assert!(tight.stages.iter().all(|s| s.layers.len() == 1));
        assert_eq!(tight.describe(), "0-0@0 1-1@0 2-2@0 3-3@1 4-4@1");
        assert_eq!(
            PipelinePlan::balanced(7, 2, &[3, 5]).unwrap().describe(),
            "0-2@3 3-6@5"
        );
    }

    #[test]
    fn even_splits_and_bad_requests() {
        let p = PipelinePlan::balanced(4, 4, &[0]).unwrap();
        assert!(
            p.stages
                .iter()
                .all(|s| s.layers.len() == 1 && s.device == 0)
        );
        assert_eq!(p.imbalance(), 1.0);
        assert_eq!(
            PipelinePlan::balanced(4, 1, &[0]).unwrap().stages[0].layers,
            0..4
        );
        assert!(
            PipelinePlan::balanced(4, 5, &[0])
                .unwrap_err()
                .to_string()
                .contains("at least 5 layers")
        );
        assert!(PipelinePlan::balanced(4, 0, &[0]).is_err());
        assert!(
            PipelinePlan::balanced(4, 1, &[0, 1])
                .unwrap_err()
                .to_string()
                .contains("--pipeline ≥ 2")
        );
    }
}
