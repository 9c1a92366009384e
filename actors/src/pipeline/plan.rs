//! How layers are grouped into pipeline stages and stages placed on devices.
//!
//! Every decoder layer costs the same, so a balanced split gives each stage ⌊L/P⌋ or ⌈L/P⌉
//! contiguous layers. The smaller stages come first: stage 0 also hosts the edge (embedding,
//! head and loss) on its device and, under 1F1B, keeps the most micro-batches in flight
//! (P of them), so it gets the lighter compute and memory share. Stages fill devices in
//! contiguous blocks (8 stages on 2 GPUs: stages 0–3 on the first, 4–7 on the second) so only
//! one hop per direction crosses devices.

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
    /// `devices[s · |devices| / p]`).
    pub fn balanced(num_layers: usize, p: usize, devices: &[usize]) -> Result<Self, String> {
        if p == 0 {
            return Err("--pipeline must be at least 1".into());
        }
        if p > num_layers {
            return Err(format!(
                "--pipeline {p} needs at least {p} layers; the model has {num_layers}"
            ));
        }
        if devices.is_empty() {
            return Err("no devices to place the pipeline on".into());
        }
        if devices.len() > p {
            return Err(format!(
                "{} devices for {p} pipeline stages: use --pipeline ≥ {}",
                devices.len(),
                devices.len()
            ));
        }
        let (base, extra) = (num_layers / p, num_layers % p);
        let mut stages = Vec::with_capacity(p);
        let mut start = 0;
        for s in 0..p {
            // The last `extra` stages take one layer more.
            let n = base + usize::from(s >= p - extra);
            stages.push(StagePlan {
                layers: start..start + n,
                device: devices[s * devices.len() / p],
            });
            start += n;
        }
        Ok(PipelinePlan { stages })
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

    /// Where [`StagedModel::open`](crate::engine::StagedModel::open) puts each stage.
    pub fn placement(&self) -> crate::engine::Placement {
        crate::engine::Placement {
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

    /// `0-1@0 2-3@0 …`: each stage's layers and device.
    pub fn describe(&self) -> String {
        self.stages
            .iter()
            .map(|s| format!("{}-{}@{}", s.layers.start, s.layers.end - 1, s.device))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twenty_layers_over_eight_stages_put_the_short_stages_first() {
        let p = PipelinePlan::balanced(20, 8, &[0, 1]).unwrap();
        let sizes: Vec<usize> = p.stages.iter().map(|s| s.layers.len()).collect();
        assert_eq!(sizes, [2, 2, 2, 2, 3, 3, 3, 3]);
        let devices: Vec<usize> = p.stages.iter().map(|s| s.device).collect();
        assert_eq!(devices, [0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(p.num_layers(), 20);
        assert!((p.imbalance() - 1.2).abs() < 1e-12);
        assert_eq!(p.stage_of(7), 3);
        assert_eq!(p.stage_of(8), 4);
        assert_eq!(p.layer_devices().iter().filter(|&&d| d == 1).count(), 12);
        assert_eq!(p.describe().split(' ').next(), Some("0-1@0"));
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
                .contains("at least 5 layers")
        );
        assert!(PipelinePlan::balanced(4, 0, &[0]).is_err());
        assert!(
            PipelinePlan::balanced(4, 1, &[0, 1])
                .unwrap_err()
                .contains("--pipeline ≥ 2")
        );
    }
}
