//! One training step's round on the pipeline: the step's micro-batches admitted into the stages
//! a window at a time, each replica's share by its own edge; their events gathered as they
//! finish (with data parallelism, each layer's gradient reduction started once every local
//! replica is through its backward); then the step's loss judged by the spike guard and the
//! optimizer phase run, or the step skipped.

use super::lanes::Lanes;
use super::msg::EdgeMsg;
use super::step::{Event, Ponder, StepCtx, Tally};
use super::supervisor::SupState;
use futures_util::future::join_all;
use nsactor_engine::engine::{StepParams, StepStats};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{Batch, EngineError, MicroBatchId};
use ractor::ActorRef;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A replica's micro-batches waiting for admission: the index in the step, the data.
type Queue = VecDeque<(usize, Arc<Batch>)>;

/// Which replica runs which micro-batch: replica r runs a contiguous share of the step's `m`
/// micro-batches; in a world, of the world's `all` replicas, this rank's being
/// `first .. first + d`.
#[derive(Clone, Copy)]
struct Shares {
    m: usize,
    first: usize,
    all: usize,
    d: usize,
}

impl Shares {
    /// The local replica that runs micro-batch `i`, if this rank runs it.
    fn mine(&self, i: usize) -> Option<usize> {
        super::step::owner(i, self.m, self.all)
            .checked_sub(self.first)
            .filter(|&r| r < self.d)
    }
}

/// What sends a micro-batch into the pipeline: every local replica's edge, the step's ids,
/// scales and schedule, and where its events come back.
struct Admission<'a> {
    shares: Shares,
    edges: Vec<ActorRef<EdgeMsg>>,
    micro: &'a [MicroBatchId],
    loss_scale: f64,
    ponder_weight: f64,
    tx: mpsc::Sender<Event>,
    depth_first: bool,
    tallies: Vec<Option<Arc<Tally>>>,
}

impl Admission<'_> {
    /// Admits the next micro-batch of `pending`, if any, counting it in `in_flight`.
    fn admit(&self, pending: &mut Queue, in_flight: &mut usize) -> Result<(), RuntimeError> {
        if let Some((i, batch)) = pending.pop_front() {
            let r = self.shares.mine(i).expect("a local micro-batch");
            self.edges[r]
                .cast(EdgeMsg::Embed {
                    micro: self.micro[i],
                    batch,
                    loss_scale: self.loss_scale,
                    ponder_weight: self.ponder_weight,
                    ctx: StepCtx {
                        events: self.tx.clone(),
                        depth_first: self.depth_first,
                        tally: self.tallies[r].clone(),
                    },
                })
                .map_err(|_| RuntimeError::Broken("edge stopped".into()))?;
            *in_flight += 1;
        }
        Ok(())
    }
}

/// A step's micro-batches while they run: those waiting per replica, those in flight and
/// finished, each layer's replicas through their backward and the reductions started, the
/// outcomes, and the first failure.
struct Flow {
    rx: mpsc::Receiver<Event>,
    pending: Vec<Queue>,
    in_flight: usize,
    finished: usize,
    ready: Vec<usize>,
    reductions: Vec<JoinHandle<Result<(), RuntimeError>>>,
    results: Vec<Option<(f64, Ponder)>>,
    failure: Option<RuntimeError>,
}

impl SupState {
    /// The step itself (`train_step` around it clears the gradients after a failure).
    pub(super) async fn train_step_inner(
        &mut self,
        batches: Vec<Batch>,
        p: &StepParams,
        guarded: bool,
    ) -> Result<StepStats, RuntimeError> {
        if batches.is_empty() {
            return Err(
                EngineError::InvalidInput("a step needs at least one micro-batch".into()).into(),
            );
        }
        let m = batches.len();
        // Consecutive ids: micro-batch `i` of the step is `micro[0] + i`.
        let micro = self.ids.micro_batches(m);
        let base = micro[0].0;
        let tokens: u64 = batches
            .iter()
            .map(nsactor_engine::engine::scored_tokens)
            .sum();
        // Replica r runs a contiguous share of the micro-batches, each with its own window;
        // in a world, of the world's replicas, this rank's being `first .. first + d`.
        let d = 1 + self.others.len();
        let num_layers = self.layers.len();
        let (first, all) = self.world_replicas();
        let shares = Shares { m, first, all, d };
        let step_no = self.step + 1;
        // At most one event per micro-batch, and one per layer of each replica, is in the
        // channel at a time.
        let (tx, rx) = mpsc::channel(m + 1 + d * num_layers);
        // Data parallelism: each layer reports when its replica's share is through its
        // backward, and its reduction starts while the other layers go on.
        let tallies: Vec<Option<Arc<Tally>>> = (0..d)
            .map(|r| {
                let share = (0..m).filter(|&i| shares.mine(i) == Some(r)).count();
                (all > 1).then(|| Arc::new(Tally::new(r, share, num_layers)))
            })
            .collect();
        let lanes = Self::reduction_lanes(num_layers);
        let mut flow = Flow::new(rx, batches, shares, num_layers);
        let local = flow.pending.iter().map(|q| q.len()).sum::<usize>();
        let edges: Vec<ActorRef<EdgeMsg>> = std::iter::once(self.edge.clone())
            .chain(self.others.iter().map(|c| c.edge.clone()))
            .collect();
        let depth_first = self.train.schedule == nsactor_engine::config::Schedule::DepthFirst;
        let window = if depth_first { 2 } else { 1 };
        // `nan-grad:STEP`: the loss scaled by NaN makes every gradient of the step NaN.
        let poison = self.topo.fault.as_ref().is_some_and(|f| f.nan_grad_now());
        let loss_scale = if poison { f64::NAN } else { 1.0 / m as f64 };
        let spiked = self.topo.fault.as_ref().is_some_and(|f| f.loss_spike_now());
        let admission = Admission {
            shares,
            edges,
            micro: &micro,
            loss_scale,
            ponder_weight: p.ponder_weight,
            tx,
            depth_first,
            tallies,
        };
        // `depth-first`: a window of 2P micro-batches in flight. With P the stages starved
        // while a newly admitted micro-batch crossed the first stage while layer actors awaited
        // their jobs; since they hand jobs to the worker without waiting, 2P and 8P measure the
        // same (`bench pipeline-hop --layer-busy-us 2000`, 20 layers, P = 2, M = 16: 1.435 s
        // and 1.428 s; 1F1B ideal 1.36 s). The price is P more micro-batches of kept layer
        // inputs per stage.
        for share in &mut flow.pending {
            for _ in 0..window * self.stages {
                admission.admit(share, &mut flow.in_flight)?;
            }
        }
        self.drive(&mut flow, &admission, &lanes, step_no, base)
            .await?;
        if all > 1 {
            self.end_reductions(&mut flow, &lanes, step_no, base)
                .await?;
        }
        if let Some(f) = flow.failure {
            return Err(f);
        }
        debug_assert_eq!(flow.finished, local);
        let results = self.world_results(step_no, flow.results).await?;
        let mut s = step_stats(&results, tokens, m, self.layers.len(), p.ponder_weight);
        if spiked {
            s.loss *= 100.0;
        }
        self.conclude(s, p, guarded).await
    }

    /// Gathers the step's events until no micro-batch is in flight: a layer through its
    /// backward on every local replica starts its reduction; a finished micro-batch admits the
    /// next of its replica's share unless the step has failed. A stage lost to a panic, or a
    /// child found dead, ends the step at once.
    async fn drive(
        &mut self,
        f: &mut Flow,
        a: &Admission<'_>,
        lanes: &Arc<Lanes>,
        step_no: u64,
        base: u64,
    ) -> Result<(), RuntimeError> {
        let d = a.shares.d;
        while f.in_flight > 0 {
            let event = tokio::select! {
                e = f.rx.recv() => e,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                    if let Some(who) = self.dead_child() {
                        let why = format!("{who} stopped during a step");
                        self.broken = Some(why.clone());
                        return Err(f.failure.take().unwrap_or(RuntimeError::Broken(why)));
                    }
                    continue;
                }
            };
            let Some(event) = event else { break };
            let micro_done = match event {
                Event::LayerReady { layer, .. } => {
                    self.die_if_injected();
                    f.ready[layer] += 1;
                    if f.ready[layer] == d && f.failure.is_none() {
                        let k = 1 + layer;
                        f.reductions
                            .push(self.spawn_reduce(k, lanes.clone(), step_no, base));
                    }
                    continue;
                }
                Event::Done { micro, .. } | Event::Failed { micro, .. } => micro,
            };
            f.in_flight -= 1;
            f.finished += 1;
            let i = (micro_done.0 - base) as usize;
            match event {
                Event::LayerReady { .. } => unreachable!("handled above"),
                Event::Done { ce, ponder, .. } => {
                    f.results[i] = Some((ce, ponder));
                }
                Event::Failed { who, micro, error } => {
                    tracing::error!("{micro} failed in {who}: {error}");
                    if matches!(error, EngineError::Panic(_)) {
                        // The actor is gone with its stage: nothing left to drain for.
                        self.broken = Some(format!("{who} panicked"));
                        return Err(RuntimeError::Stage { who, error });
                    }
                    f.failure.get_or_insert(RuntimeError::Stage { who, error });
                }
            }
            if f.failure.is_none() {
                a.admit(
                    &mut f.pending[a.shares.mine(i).expect("local")],
                    &mut f.in_flight,
                )?;
            }
        }
        Ok(())
    }

    /// With several replicas: the edge's share is done with the last micro-batch, so its
    /// reduction starts (or, after a failure, every lane is abandoned); then every reduction
    /// ends, the first failure kept.
    async fn end_reductions(
        &self,
        f: &mut Flow,
        lanes: &Arc<Lanes>,
        step_no: u64,
        base: u64,
    ) -> Result<(), RuntimeError> {
        match f.failure {
            None => f
                .reductions
                .push(self.spawn_reduce(0, lanes.clone(), step_no, base)),
            Some(_) => lanes.abandon(),
        }
        for r in join_all(std::mem::take(&mut f.reductions)).await {
            let r = r.map_err(|e| RuntimeError::Runtime(format!("a reduction task: {e}")))?;
            if let Err(e) = r {
                f.failure.get_or_insert(e);
            }
        }
        Ok(())
    }

    /// The step's end: the loss-spike guard (when `guarded`), then the optimizer phase — or,
    /// for a non-finite loss or gradient norm, the gradients dropped and the step skipped.
    async fn conclude(
        &mut self,
        mut s: StepStats,
        p: &StepParams,
        guarded: bool,
    ) -> Result<StepStats, RuntimeError> {
        if let Some(mean) = self.guard.judge(s.loss).filter(|_| guarded) {
            // No update: `train_step` drops the gradients, `next_step` rolls back.
            return Err(RuntimeError::LossSpike {
                step: self.step + 1,
                loss: s.loss,
                mean,
                factor: self.guard.factor(),
                to_step: self.step,
            });
        }
        // A non-finite loss or gradient norm skips the step: the gradients are dropped and no
        // parameter or optimizer state changes; the data moves on past its batches.
        let norm = match s.loss.is_finite() {
            true => self.apply_step(p).await?,
            false => None,
        };
        match norm {
            Some(n) => {
                s.grad_norm = n;
                if guarded {
                    self.guard.record(s.loss);
                }
            }
            None => {
                self.zero_grad().await?;
                s.skipped = true;
                s.grad_norm = f64::NAN;
            }
        }
        Ok(s)
    }
}

impl Flow {
    /// The step's micro-batches queued by the local replica that runs each (another rank's
    /// left out), none in flight yet.
    fn new(rx: mpsc::Receiver<Event>, batches: Vec<Batch>, shares: Shares, layers: usize) -> Self {
        let ready = vec![0usize; layers];
        let mut pending: Vec<Queue> = vec![Default::default(); shares.d];
        for (i, b) in batches.into_iter().enumerate() {
            if let Some(r) = shares.mine(i) {
                pending[r].push_back((i, Arc::new(b)));
            }
        }
        Flow {
            rx,
            pending,
            in_flight: 0,
            finished: 0,
            ready,
            reductions: Vec::new(),
            results: vec![None; shares.m],
            failure: None,
        }
    }
}

/// The step's figures from every micro-batch's outcome, added in micro-batch order.
fn step_stats(
    results: &[Option<(f64, Ponder)>],
    tokens: u64,
    m: usize,
    layers: usize,
    ponder_weight: f64,
) -> StepStats {
    let l = layers as f64;
    let mf = m as f64;
    let mut s = StepStats {
        tokens,
        ..StepStats::empty()
    };
    for r in results {
        let (ce, pd) = r.expect("every micro-batch finished");
        s.add_micro(ce, pd.sum / l, pd.min, pd.max, mf, ponder_weight);
    }
    s
}
