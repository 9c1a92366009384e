//! Data parallelism inside the supervisor: which replica runs which micro-batch, the gradient
//! reduction across replicas, and the optimizer-phase calls sent to every replica.
//!
//! A step's M micro-batches are split into D contiguous shares, replica r taking
//! `r·M/D .. (r+1)·M/D`. Once every micro-batch is done, each stage's gradients are reduced
//! onto replica 0's copy of the stage and the sum is handed back to every replica, stage by
//! stage and all stages at once. Under `ordered` the replicas after the first hold each
//! micro-batch's gradients apart, and replica 0 adds them after its own (which come first) in
//! micro-batch order: the sum one replica would make, bit for bit. Under `sum` each replica
//! sums its own share and replica 0 adds the replicas' sums in replica order. Tensors cross
//! devices through [`ComputeBackend::to_device`](nsactor_plugin_api::ComputeBackend::to_device)
//! (peer copies between GPUs) as the receiving stage's worker takes them in.

use super::msg::{GradOp, Hop, StageControl, control_all};
use super::supervisor::SupState;
use super::topology::Children;
use crate::error::RuntimeError;
use futures_util::future::join_all;
use nsactor_plugin_api::{GradPart, Reply};

/// Reduces one stage's gradients over its copies (`stages[r]` is replica r's), leaving the
/// sum in every copy.
async fn reduce_stage(who: &str, stages: &[Hop]) -> Result<(), RuntimeError> {
    let (root, rest) = stages.split_first().expect("at least one replica");
    // Every part of the other replicas goes to replica 0, which adds them in key order.
    for st in rest {
        while let Some(part) = st.grads(who, GradOp::Out { keep: false }).await? {
            root.grads(who, GradOp::In(part)).await?;
        }
    }
    // Replica 0's sums (one per stream): a copy to each other replica, then back home.
    let mut sums: Vec<GradPart> = Vec::new();
    loop {
        for st in rest {
            if let Some(copy) = root.grads(who, GradOp::Out { keep: true }).await? {
                st.grads(who, GradOp::In(copy)).await?;
            }
        }
        match root.grads(who, GradOp::Out { keep: false }).await? {
            Some(sum) => sums.push(sum),
            None => break,
        }
    }
    for sum in sums {
        root.grads(who, GradOp::In(sum)).await?;
    }
    Ok(())
}

impl SupState {
    /// Every replica's actors, replica 0 first.
    pub(super) fn replicas(&self) -> Vec<Children> {
        std::iter::once(Children {
            edge: self.edge.clone(),
            layers: self.layers.clone(),
        })
        .chain(self.others.iter().cloned())
        .collect()
    }

    /// Sums every stage's gradients over the replicas (module docs); all stages at once.
    pub(super) async fn reduce_grads(&self) -> Result<(), RuntimeError> {
        let replicas = self.replicas();
        let stages: Vec<Vec<Hop>> = replicas
            .iter()
            .map(|c| Hop::all(&c.edge, &c.layers))
            .collect();
        let per_stage: Vec<Vec<Hop>> = (0..stages[0].len())
            .map(|k| stages.iter().map(|r| r[k].clone()).collect())
            .collect();
        let names: Vec<String> = (0..per_stage.len())
            .map(|k| match k {
                0 => "edge".to_string(),
                k => format!("layer {}", k - 1),
            })
            .collect();
        let done = join_all(
            per_stage
                .iter()
                .zip(&names)
                .map(|(copies, who)| reduce_stage(who, copies)),
        )
        .await;
        done.into_iter().collect()
    }

    /// [`control_all`] on every replica at once; replica 0's answers, after checking the
    /// others' for errors.
    pub(super) async fn control_replicas(
        &self,
        edge_call: StageControl,
        layer_call: impl Fn(usize) -> StageControl + Copy,
    ) -> Result<(Reply, Vec<Reply>), RuntimeError> {
        let replicas = self.replicas();
        let answers = join_all(
            replicas
                .iter()
                .map(|c| control_all(&c.edge, &c.layers, edge_call, layer_call)),
        )
        .await;
        let mut first = None;
        for (e, ls) in answers {
            let e = e?;
            let ls = ls.into_iter().collect::<Result<Vec<_>, _>>()?;
            first.get_or_insert((e, ls));
        }
        Ok(first.expect("at least one replica"))
    }
}
