//! A training run as one rank of a world of processes (the environment names the world:
//! `NSACTOR_RANK`, `NSACTOR_WORLD_SIZE`, …, set by `--nproc-per-node`, torchrun, Slurm or a
//! Kubernetes spec).
//!
//! `--data-parallel D` counts the world's replicas (default: one per process); each process
//! runs `D / world size` of them. A rank without `--devices` runs on device `local rank`
//! (modulo the backend's devices). Rank 0 writes every checkpoint before the next step (never
//! in the background), so a loss-spike rollback on any rank finds the same newest checkpoint
//! in the (shared) run directory.

use nsactor_cluster::{Peers, World};
use nsactor_engine::config::RunConfig;
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::world::WorldLink;

/// A control-plane failure before or after the run (joining, agreeing, leaving): said as the
/// control plane says it.
fn control_plane(e: nsactor_cluster::ClusterError) -> RuntimeError {
    RuntimeError::Invalid(e.to_string())
}
use nsactor_plugin_api::ComputeBackend;
use std::sync::Arc;

/// This process's membership of its world, and the runtime its connections live on.
pub struct Rank {
    pub peers: Arc<Peers>,
    rt: tokio::runtime::Runtime,
}

/// Splits the run's replicas among the ranks; fails with the reason when they cannot be.
pub fn local_share(cfg: &mut RunConfig, w: &World) -> Result<(), RuntimeError> {
    let t = &mut cfg.train;
    let global = match t.data_parallel {
        1 => w.size,
        d => d,
    };
    if global % w.size != 0 {
        return Err(RuntimeError::Invalid(format!(
            "--data-parallel {global} does not split over {} processes: give a multiple of \
             the world size",
            w.size
        )));
    }
    if global > t.accumulation {
        return Err(RuntimeError::Invalid(format!(
            "{global} data-parallel replicas over {} processes need at least {global} \
             micro-batches per step, [train] accumulation is {}",
            w.size, t.accumulation
        )));
    }
    t.data_parallel = global / w.size;
    t.async_checkpoint = false;
    Ok(())
}

/// `--devices` as given, or the rank's own device.
pub fn place(cfg: &mut RunConfig, w: &World, backend: &dyn ComputeBackend) {
    if cfg.train.devices.is_none() {
        let n = backend.info().devices.len().max(1);
        cfg.train.devices = Some(vec![w.local_rank % n]);
    }
}

/// What every rank must run alike: the configuration as given (before the rank's own
/// devices) and this build.
pub fn fingerprint(cfg: &RunConfig) -> u64 {
    let mut text = cfg.to_toml();
    text.push_str(env!("CARGO_PKG_VERSION"));
    nsactor_cluster::fingerprint(text.as_bytes())
}

impl Rank {
    /// Joins the world (blocks until every rank it talks to is there).
    pub fn join(world: World) -> Result<Rank, RuntimeError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("nsactor-cluster")
            .enable_all()
            .build()
            .map_err(|e| RuntimeError::Runtime(format!("the control plane's runtime: {e}")))?;
        let peers = Arc::new(rt.block_on(Peers::join(world)).map_err(control_plane)?);
        Ok(Rank { peers, rt })
    }

    pub fn rank(&self) -> usize {
        self.peers.rank()
    }

    /// Every rank runs `fingerprint` from `first_step`, or none goes on.
    pub fn agree(&self, fingerprint: u64, first_step: u64) -> Result<(), RuntimeError> {
        self.rt
            .block_on(self.peers.agree(fingerprint, first_step))
            .map_err(control_plane)
    }

    /// The pipeline's side of the connections: through `backend`'s collectives when rank 0's
    /// has them (NCCL on GPUs), else through the host.
    pub fn link(&self, backend: &Arc<dyn ComputeBackend>) -> Result<Arc<WorldLink>, RuntimeError> {
        let link = self
            .rt
            .block_on(WorldLink::negotiate(self.peers.clone(), backend))?;
        Ok(Arc::new(link))
    }

    /// Ends the run with every rank (rank 0 leaves last).
    pub fn finish(&self) -> Result<(), RuntimeError> {
        self.rt.block_on(self.peers.finish()).map_err(control_plane)
    }

    /// Tells the other ranks this one failed, so they stop waiting for it.
    pub fn abort(&self, why: &str) {
        self.peers.abort(why);
    }
}
