//! The stage implementation shared by every burn backend: [`BurnBackend<B>`] implements the
//! burn-free [`ComputeBackend`] contract for any `B: SnnOps`, with one [`LayerStage`] per decoder
//! layer and one [`EdgeStage`] for embedding + decode path + tied head.
//!
//! A stage owns its parameters (an autodiff copy, the master, and an inner copy for forward-only
//! work), its accumulated gradients, Adam state, the inputs it keeps for per-layer recompute, and
//! the membrane states of decoding sessions. `backends/ndarray` and `backends/cuda` only pick `B`
//! and the device list; both run exactly this code, so the same checkpoint and the same calls
//! behave the same on either.
//!
//! Depends on burn, `nsactor-kernels`, `nsactor-model` and `nsactor-plugin-api`.

pub mod diagnose;
mod edge;
mod grads;
pub mod graphs;
mod hostbuf;
mod kept;
mod layer;
mod prewarm;
mod probe;
pub mod profile;
pub mod sample;
mod sessions;
mod state;

pub use diagnose::{KernelBench, MemoryReport, TimingHooks};
pub use edge::EdgeStage;
pub use layer::LayerStage;
pub use sessions::SessionTable;

use burn::backend::Autodiff;
use burn::tensor::{Tensor, TensorData, backend::Backend};
use nsactor_kernels::SnnOps;
use nsactor_plugin_api::{
    BackendInfo, CollectiveId, Communicator, ComputeBackend, DeviceTensor, Diagnostic,
    DiagnosticReport, EngineError, HostTensor, Reply, ShardBytes, Stage, StageCall, StageKind,
    StageSnapshot, StageSpec, TensorObject,
};
use std::any::Any;

/// The autodiff backend stages train with.
pub type Ad<B> = Autodiff<B>;

/// A residual-stream (or logits) tensor on a device: the object behind a [`DeviceTensor`].
pub struct Act<B: Backend>(pub Tensor<B, 3>);

impl<B: Backend> TensorObject for Act<B> {
    fn shape(&self) -> Vec<usize> {
        self.0.dims().to_vec()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

/// Unwraps a handle made by this backend.
pub(crate) fn act<B: Backend>(t: DeviceTensor, what: &str) -> Result<Tensor<B, 3>, EngineError> {
    t.downcast::<Act<B>>().map(|a| a.0).map_err(|t| {
        EngineError::InvalidInput(format!(
            "{what}: tensor {:?} belongs to another backend",
            t.shape()
        ))
    })
}

pub(crate) fn wrap<B: Backend>(t: Tensor<B, 3>) -> DeviceTensor {
    DeviceTensor::new(Act(t))
}

/// A burn backend behind the stage contract.
pub struct BurnBackend<B: SnnOps> {
    name: String,
    version: String,
    devices: Vec<(B::Device, String)>,
    kernel_benches: Vec<(&'static str, KernelBench<B>)>,
    memory: Option<MemoryReport<B>>,
    timing: Option<TimingHooks<B>>,
    enter: fn(),
}

/// A stage whose every call first runs the backend's per-thread setup ([`BurnBackend::with_enter`]),
/// and runs as a timed call span ([`SnnOps::timed_call`]) on its device.
///
/// [`SnnOps::timed_call`]: nsactor_kernels::DeviceOps::timed_call
struct Entered<B: SnnOps> {
    stage: Box<dyn Stage>,
    enter: fn(),
    device: B::Device,
}

impl<B: SnnOps> Stage for Entered<B> {
    fn call(&mut self, call: StageCall<'_>) -> Result<Reply, EngineError> {
        (self.enter)();
        let stage = &mut self.stage;
        B::timed_call(&self.device, call.name(), || stage.call(call))
    }
    fn save(&self) -> Result<Vec<u8>, EngineError> {
        (self.enter)();
        self.stage.save()
    }
    fn snapshot(&self) -> Result<Box<dyn StageSnapshot>, EngineError> {
        (self.enter)();
        Ok(Box::new(EnteredSnapshot {
            inner: self.stage.snapshot()?,
            enter: self.enter,
        }))
    }
    fn load(&mut self, bytes: &[u8]) -> Result<(), EngineError> {
        (self.enter)();
        self.stage.load(bytes)
    }
    fn param_count(&self) -> u64 {
        self.stage.param_count()
    }
}

/// A snapshot serialised after the backend's per-thread setup, on whatever thread writes it.
struct EnteredSnapshot {
    inner: Box<dyn StageSnapshot>,
    enter: fn(),
}

impl StageSnapshot for EnteredSnapshot {
    fn bytes(self: Box<Self>) -> Result<ShardBytes, EngineError> {
        (self.enter)();
        self.inner.bytes()
    }
}

impl<B: SnnOps> BurnBackend<B> {
    /// `devices`: every usable device with a human description, indexed by device number.
    pub fn new(name: &str, version: &str, devices: Vec<(B::Device, String)>) -> Self {
        BurnBackend {
            name: name.into(),
            version: version.into(),
            devices,
            kernel_benches: Vec::new(),
            memory: None,
            timing: None,
            enter: || {},
        }
    }

    /// Runs `enter` on the calling thread before every call into the backend and its stages
    /// (e.g. to put every worker thread's work on one device stream).
    pub fn with_enter(mut self, enter: fn()) -> Self {
        self.enter = enter;
        self
    }

    /// Reports device memory for [`Diagnostic::Memory`](nsactor_plugin_api::Diagnostic).
    pub fn with_memory(mut self, report: MemoryReport<B>) -> Self {
        self.memory = Some(report);
        self
    }

    /// Opens and closes device-time windows for `Diagnostic::TimingStart` / `TimingReport`.
    pub fn with_timing(mut self, hooks: TimingHooks<B>) -> Self {
        self.timing = Some(hooks);
        self
    }

    /// Adds a backend-specific benchmark to `Diagnostic::Kernels`; its options are the ones named
    /// `{prefix}_key=value`.
    pub fn with_kernel_bench(mut self, prefix: &'static str, bench: KernelBench<B>) -> Self {
        self.kernel_benches.push((prefix, bench));
        self
    }

    fn device(&self, i: usize) -> Result<&B::Device, EngineError> {
        self.devices.get(i).map(|(d, _)| d).ok_or_else(|| {
            EngineError::InvalidInput(format!(
                "device {i} does not exist; the {} backend has {} device(s)",
                self.name,
                self.devices.len()
            ))
        })
    }
}

impl<B: SnnOps> ComputeBackend for BurnBackend<B> {
    fn info(&self) -> BackendInfo {
        BackendInfo {
            name: self.name.clone(),
            version: self.version.clone(),
            abi_version: nsactor_plugin_api::ABI_VERSION,
            devices: self.devices.iter().map(|(_, d)| d.clone()).collect(),
        }
    }

    fn from_host(&self, device: usize, t: &HostTensor) -> Result<DeviceTensor, EngineError> {
        (self.enter)();
        let dev = self.device(device)?;
        let [a, b, c] = <[usize; 3]>::try_from(t.shape.as_slice()).map_err(|_| {
            EngineError::InvalidInput(format!("tensors are 3-D, got shape {:?}", t.shape))
        })?;
        if a * b * c != t.data.len() {
            return Err(EngineError::InvalidInput(format!(
                "shape {:?} needs {} values, got {}",
                t.shape,
                a * b * c,
                t.data.len()
            )));
        }
        let data = TensorData::new(t.data.clone(), [a, b, c]);
        Ok(wrap::<B>(Tensor::from_data(data, dev)))
    }

    fn to_host(&self, t: &DeviceTensor) -> Result<HostTensor, EngineError> {
        (self.enter)();
        let a = t.downcast_ref::<Act<B>>().ok_or_else(|| {
            EngineError::InvalidInput("to_host: the tensor belongs to another backend".into())
        })?;
        let data =
            a.0.to_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| EngineError::Backend(format!("to_host: {e:?}")))?;
        Ok(HostTensor {
            data,
            shape: a.0.dims().to_vec(),
        })
    }

    fn ready(&self, t: &DeviceTensor) -> Result<(), EngineError> {
        (self.enter)();
        let x = t.downcast_ref::<Act<B>>().ok_or_else(|| {
            EngineError::InvalidInput(format!(
                "ready: tensor {:?} belongs to another backend",
                t.shape()
            ))
        })?;
        B::sync(&x.0.device()).map_err(|e| EngineError::Backend(format!("device sync: {e}")))
    }

    fn to_device(&self, t: DeviceTensor, device: usize) -> Result<DeviceTensor, EngineError> {
        (self.enter)();
        let dev = self.device(device)?.clone();
        let x = act::<B>(t, "to_device")?;
        let moved = B::move_to_device(x.into_primitive().tensor(), &dev);
        Ok(wrap(Tensor::<B, 3>::from_primitive(
            burn::tensor::TensorPrimitive::Float(moved),
        )))
    }

    fn collective_id(&self) -> Result<CollectiveId, EngineError> {
        (self.enter)();
        Ok(CollectiveId(B::collective_id()?))
    }

    fn collective_join(
        &self,
        id: &CollectiveId,
        rank: usize,
        size: usize,
        device: usize,
    ) -> Result<Communicator, EngineError> {
        (self.enter)();
        let dev = self.device(device)?.clone();
        Ok(Communicator(B::collective_join(&id.0, rank, size, &dev)?))
    }

    fn all_reduce_sum(
        &self,
        comm: Communicator,
        t: DeviceTensor,
    ) -> Result<DeviceTensor, EngineError> {
        (self.enter)();
        let x = act::<B>(t, "all_reduce_sum")?;
        let sum = B::all_reduce_sum(x.into_primitive().tensor(), comm.0)?;
        Ok(wrap(Tensor::<B, 3>::from_primitive(
            burn::tensor::TensorPrimitive::Float(sum),
        )))
    }

    fn diagnose(&self, what: &Diagnostic) -> Result<DiagnosticReport, EngineError> {
        (self.enter)();
        self.run_diagnostic(what)
    }

    /// A layer's step (see [`prewarm`]); the edge has nothing here. Without `enter`: the
    /// calling thread keeps a stream of its own, the one put in compile-only mode.
    fn prewarm(&self, spec: &StageSpec, batch: usize, seq_len: usize) -> Result<bool, EngineError> {
        let dev = self.device(spec.device)?.clone();
        spec.model.validate()?;
        if batch == 0 || seq_len == 0 {
            return Err(EngineError::InvalidInput(format!(
                "prewarm: a [{seq_len}, {batch}, D] input is empty"
            )));
        }
        match spec.kind {
            StageKind::Layer(i) => {
                layer::check_layer(&spec.model, i)?;
                Ok(prewarm::layer::<B>(&spec.model, batch, seq_len, &dev))
            }
            StageKind::Edge => Ok(false),
        }
    }

    fn open_stage(&self, spec: &StageSpec) -> Result<Box<dyn Stage>, EngineError> {
        (self.enter)();
        let dev = self.device(spec.device)?.clone();
        spec.model.validate()?;
        let cfg = spec.model.clone();
        let stage: Box<dyn Stage> = match spec.kind {
            StageKind::Edge => Box::new(EdgeStage::<B>::new(cfg, spec, dev.clone())),
            StageKind::Layer(i) => {
                layer::check_layer(&cfg, i)?;
                Box::new(LayerStage::<B>::new(cfg, i, spec, dev.clone()))
            }
        };
        Ok(Box::new(Entered::<B> {
            stage,
            enter: self.enter,
            device: dev,
        }))
    }
}
