//! Data-parallel replicas reducing through the backend's collectives, on the embedded CPU
//! backend behind a wrapper that gives it several devices and an all-reduce (a rendezvous of
//! the group's ranks on the host, summing in rank order as NCCL's ring would not, so that the
//! result can be compared bit for bit): the replicas of every stage all-reduce together, once
//! per part and replica, and the run gives the hub reduction's losses, parameters and
//! optimizer state bit for bit; replicas that share a device reduce through replica 0.
//!
//! The rendezvous blocks until every rank of the group has called, as a collective may: the
//! runtime must issue a stage's calls on all its replicas at once, and in the same order.

mod common;

use common::*;
use nsactor_decoding::{Pipeline, PipelinePlan};
use nsactor_engine::config::{DpReduce, model_from_toml};
use nsactor_engine::engine::StagedModel;
use nsactor_plugin_api::{
    BackendInfo, Batch, CollectiveId, Communicator, ComputeBackend, DeviceTensor, EngineError,
    HostTensor, OptimizerKind, Stage, StageSpec,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How long a rank waits for the others before the rendezvous reports a hang.
const PATIENCE: Duration = Duration::from_secs(30);

/// One call of every rank: their values (by rank), then the sum and how many ranks took it.
#[derive(Default)]
struct Round {
    parts: Vec<Option<Vec<f32>>>,
    sum: Option<Vec<f32>>,
    taken: usize,
}

#[derive(Default)]
struct GroupState {
    joined: usize,
    /// Each rank's next call.
    calls: Vec<u64>,
    rounds: HashMap<u64, Round>,
}

struct Group {
    size: usize,
    state: Mutex<GroupState>,
    bell: Condvar,
}

impl Group {
    fn wait<'a>(
        &self,
        g: std::sync::MutexGuard<'a, GroupState>,
        done: impl Fn(&GroupState) -> bool,
        what: &str,
    ) -> Result<std::sync::MutexGuard<'a, GroupState>, EngineError> {
        let (g, t) = self
            .bell
            .wait_timeout_while(g, PATIENCE, |s| !done(s))
            .unwrap();
        match t.timed_out() {
            true => Err(EngineError::Backend(format!("{what}: a rank never came"))),
            false => Ok(g),
        }
    }
}

/// The embedded CPU backend as `devices` devices (all the one CPU) with a host all-reduce.
struct Multi {
    inner: Arc<dyn ComputeBackend>,
    devices: usize,
    collectives: bool,
    next_id: AtomicUsize,
    groups: Mutex<HashMap<Vec<u8>, Arc<Group>>>,
    comms: Mutex<Vec<(Arc<Group>, usize)>>,
    reduced: AtomicUsize,
}

impl Multi {
    fn new(devices: usize, collectives: bool) -> Arc<Multi> {
        Arc::new(Multi {
            inner: backend(),
            devices,
            collectives,
            next_id: AtomicUsize::new(0),
            groups: Default::default(),
            comms: Default::default(),
            reduced: AtomicUsize::new(0),
        })
    }
}

impl ComputeBackend for Multi {
    fn info(&self) -> BackendInfo {
        let mut i = self.inner.info();
        i.devices = (0..self.devices).map(|d| format!("cpu as {d}")).collect();
        i
    }
    fn from_host(&self, _: usize, t: &HostTensor) -> Result<DeviceTensor, EngineError> {
        self.inner.from_host(0, t)
    }
    fn to_host(&self, t: &DeviceTensor) -> Result<HostTensor, EngineError> {
        self.inner.to_host(t)
    }
    fn to_device(&self, t: DeviceTensor, _: usize) -> Result<DeviceTensor, EngineError> {
        self.inner.to_device(t, 0)
    }
    fn open_stage(&self, spec: &StageSpec) -> Result<Box<dyn Stage>, EngineError> {
        let mut spec = spec.clone();
        spec.device = 0;
        self.inner.open_stage(&spec)
    }
    fn collective_id(&self) -> Result<CollectiveId, EngineError> {
        if !self.collectives {
            return Err(nsactor_plugin_api::collective::unsupported("multi"));
        }
        let n = self.next_id.fetch_add(1, Ordering::SeqCst);
        Ok(CollectiveId(n.to_le_bytes().to_vec()))
    }
    fn collective_join(
        &self,
        id: &CollectiveId,
        rank: usize,
        size: usize,
        _: usize,
    ) -> Result<Communicator, EngineError> {
        let group = self
            .groups
            .lock()
            .unwrap()
            .entry(id.0.clone())
            .or_insert_with(|| {
                Arc::new(Group {
                    size,
                    state: Mutex::new(GroupState {
                        calls: vec![0; size],
                        ..Default::default()
                    }),
                    bell: Condvar::new(),
                })
            })
            .clone();
        let mut s = group.state.lock().unwrap();
        s.joined += 1;
        group.bell.notify_all();
        drop(group.wait(s, |s| s.joined == size, "join")?);
        let mut comms = self.comms.lock().unwrap();
        comms.push((group, rank));
        Ok(Communicator(comms.len() as u64 - 1))
    }
    fn all_reduce_sum(
        &self,
        comm: Communicator,
        t: DeviceTensor,
    ) -> Result<DeviceTensor, EngineError> {
        let (group, rank) = self.comms.lock().unwrap()[comm.0 as usize].clone();
        let host = self.inner.to_host(&t)?;
        let mut s = group.state.lock().unwrap();
        let call = s.calls[rank];
        s.calls[rank] += 1;
        let size = group.size;
        let round = s.rounds.entry(call).or_insert_with(|| Round {
            parts: vec![None; size],
            ..Default::default()
        });
        if let Some(other) = round.parts.iter().flatten().next()
            && other.len() != host.data.len()
        {
            return Err(EngineError::Backend(format!(
                "call {call}: rank {rank} sums {} values, another rank {}",
                host.data.len(),
                other.len()
            )));
        }
        round.parts[rank] = Some(host.data);
        if round.parts.iter().all(Option::is_some) {
            // In rank order, one after another: replica 0's sum first, as the hub adds.
            let mut parts = round.parts.iter().flatten();
            let mut sum = parts.next().unwrap().clone();
            for p in parts {
                for (a, b) in sum.iter_mut().zip(p) {
                    *a += b;
                }
            }
            round.sum = Some(sum);
            group.bell.notify_all();
        }
        let mut s = group.wait(s, |s| s.rounds[&call].sum.is_some(), "all-reduce")?;
        let round = s.rounds.get_mut(&call).unwrap();
        let sum = round.sum.clone().unwrap();
        round.taken += 1;
        if round.taken == size {
            s.rounds.remove(&call);
        }
        self.reduced.fetch_add(1, Ordering::SeqCst);
        self.inner.from_host(
            0,
            &HostTensor {
                data: sum,
                shape: host.shape,
            },
        )
    }
}

fn replicated(b: &Arc<Multi>, d: usize, p: usize, devices: Vec<usize>) -> Pipeline {
    let model = StagedModel::open(
        b.clone(),
        &model_from_toml(MODEL).unwrap(),
        11,
        OptimizerKind::Adam,
        None,
    )
    .unwrap();
    let mut t = train_cfg();
    t.data_parallel = d;
    t.dp_reduce = DpReduce::Sum;
    t.devices = Some(devices.clone());
    let block = (devices.len() / d).max(1);
    let plan = PipelinePlan::balanced(4, p, &devices[..block]).unwrap();
    Pipeline::start(model, plan, t, None).unwrap()
}

/// Each step's figures and the final shards of `steps` under a layout.
fn run(
    b: &Arc<Multi>,
    d: usize,
    p: usize,
    devices: Vec<usize>,
    steps: &[Vec<Batch>],
) -> (Vec<[u64; 6]>, Vec<Vec<u8>>) {
    let mut pl = replicated(b, d, p, devices);
    let got = steps
        .iter()
        .enumerate()
        .map(|(i, s)| bits(&pl.train_step(s, &params(i)).unwrap()))
        .collect();
    (got, pl.save_stages().unwrap())
}

#[test]
fn replicas_all_reduce_together_and_give_the_hubs_sums_bit_for_bit() {
    let _serial = serial();
    let steps: Vec<Vec<Batch>> = (0..3).map(|s| batches(2100 + s, 6)).collect();
    for (d, p, devices) in [
        (2, 1, vec![0, 1]),
        (3, 1, vec![0, 1, 2]),
        (2, 2, vec![0, 1, 2, 3]),
    ] {
        let hub = Multi::new(4, false);
        let want = run(&hub, d, p, devices.clone(), &steps);
        assert_eq!(hub.reduced.load(Ordering::SeqCst), 0);
        let nccl = Multi::new(4, true);
        let got = run(&nccl, d, p, devices.clone(), &steps);
        // 4 layers with one part each and the edge's two (head, embedding), on every replica.
        let calls = nccl.reduced.load(Ordering::SeqCst);
        assert_eq!(
            calls,
            steps.len() * d * (4 + 2),
            "D={d} P={p}: all-reduce calls"
        );
        assert_eq!(got.0, want.0, "D={d} P={p}: step figures");
        assert!(
            got.1 == want.1,
            "D={d} P={p}: parameters or optimizer state differ"
        );
    }
}

#[test]
fn replicas_sharing_a_device_reduce_through_replica_0() {
    let _serial = serial();
    let steps: Vec<Vec<Batch>> = (0..2).map(|s| batches(2200 + s, 4)).collect();
    let hub = Multi::new(2, false);
    let want = run(&hub, 2, 1, vec![0], &steps);
    let shared = Multi::new(2, true);
    let got = run(&shared, 2, 1, vec![0], &steps);
    assert_eq!(
        shared.reduced.load(Ordering::SeqCst),
        0,
        "one device: no group"
    );
    assert_eq!(got.0, want.0);
    assert!(got.1 == want.1);
}
