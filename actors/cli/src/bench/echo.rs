//! A backend whose stages do no work (or spin a set time), to time the runtime around them.

use nsactor_plugin_api::{ComputeBackend, EngineError, HostTensor, StageCall, StageSpec};

/// A tensor that is only a shape: what the no-compute stages pass around.
pub struct Shape(Vec<usize>);

impl nsactor_plugin_api::TensorObject for Shape {
    fn shape(&self) -> Vec<usize> {
        self.0.clone()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// A stage that answers every call at once, or after `busy_us` (forward) / `3 × busy_us`
/// (backward: recompute + backward) of simulated device time in which it holds its worker
/// without using the CPU: activations and gradients pass straight through.
pub struct EchoStage {
    busy_us: u64,
}

impl nsactor_plugin_api::Stage for EchoStage {
    fn call(&mut self, call: StageCall<'_>) -> Result<nsactor_plugin_api::Reply, EngineError> {
        use nsactor_plugin_api::{DeviceTensor, Reply};
        let t = |shape: Vec<usize>| DeviceTensor::new(Shape(shape));
        Ok(match call {
            StageCall::Embed { tokens, .. } => {
                Reply::tensor(t(vec![tokens.seq_len, tokens.batch, 1]))
            }
            StageCall::Forward { h, .. } => {
                std::thread::sleep(std::time::Duration::from_micros(self.busy_us));
                Reply {
                    tensors: vec![h],
                    scalars: vec![1.0, 1.0, 1.0, 1.0],
                }
            }
            StageCall::Backward { grad, .. } => {
                std::thread::sleep(std::time::Duration::from_micros(3 * self.busy_us));
                Reply::tensor(grad)
            }
            StageCall::Head { h, .. } => Reply {
                tensors: vec![h],
                scalars: vec![0.0, 1.0],
            },
            StageCall::GradStats => Reply {
                tensors: Vec::new(),
                scalars: vec![f64::NAN; 3],
            },
            StageCall::ScaleGrads { .. } => Reply {
                tensors: Vec::new(),
                scalars: vec![0.0],
            },
            _ => Reply::none(),
        })
    }
    fn save(&self) -> Result<Vec<u8>, EngineError> {
        Ok(Vec::new())
    }
    fn load(&mut self, _: &[u8]) -> Result<(), EngineError> {
        Ok(())
    }
    fn param_count(&self) -> u64 {
        0
    }
}

/// A backend of [`EchoStage`]s on one device.
pub struct EchoBackend {
    pub layer_busy_us: u64,
}

impl ComputeBackend for EchoBackend {
    fn info(&self) -> nsactor_plugin_api::BackendInfo {
        nsactor_plugin_api::BackendInfo {
            name: "echo".into(),
            version: "0".into(),
            abi_version: nsactor_plugin_api::ABI_VERSION,
            devices: vec!["no compute".into()],
        }
    }
    fn from_host(
        &self,
        _: usize,
        t: &HostTensor,
    ) -> Result<nsactor_plugin_api::DeviceTensor, EngineError> {
        Ok(nsactor_plugin_api::DeviceTensor::new(Shape(
            t.shape.clone(),
        )))
    }
    fn to_host(&self, t: &nsactor_plugin_api::DeviceTensor) -> Result<HostTensor, EngineError> {
        let shape = t.shape();
        Ok(HostTensor {
            data: vec![0.0; shape.iter().product()],
            shape,
        })
    }
    fn to_device(
        &self,
        t: nsactor_plugin_api::DeviceTensor,
        _: usize,
    ) -> Result<nsactor_plugin_api::DeviceTensor, EngineError> {
        Ok(t)
    }
    fn open_stage(&self, _: &StageSpec) -> Result<Box<dyn nsactor_plugin_api::Stage>, EngineError> {
        Ok(Box::new(EchoStage {
            busy_us: self.layer_busy_us,
        }))
    }
}
