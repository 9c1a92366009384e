//! A misbehaving backend for the boundary tests: open options `fail` make device initialisation
//! fail and `panic` make it panic (`$NSACTOR_TEST_PANICKY`, when set, stands in for the
//! options: the command line passes its own); its stages panic on `Forward` and echo inputs
//! otherwise, so a test can check that the host survives a panic and keeps using the plugin.

use nsactor_plugin_api::{
    BackendInfo, ComputeBackend, DeviceTensor, EngineError, HostTensor, Reply, Stage, StageCall,
    StageSpec, TensorObject,
};
use std::any::Any;

struct Host(HostTensor);

impl TensorObject for Host {
    fn shape(&self) -> Vec<usize> {
        self.0.shape.clone()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

struct Panicky;

impl ComputeBackend for Panicky {
    fn info(&self) -> BackendInfo {
        BackendInfo {
            name: "panicky".into(),
            version: "0.0.0".into(),
            abi_version: nsactor_plugin_api::ABI_VERSION,
            devices: vec!["nothing".into()],
        }
    }
    fn from_host(&self, _: usize, t: &HostTensor) -> Result<DeviceTensor, EngineError> {
        Ok(DeviceTensor::new(Host(t.clone())))
    }
    fn to_host(&self, t: &DeviceTensor) -> Result<HostTensor, EngineError> {
        t.downcast_ref::<Host>()
            .map(|h| h.0.clone())
            .ok_or_else(|| EngineError::InvalidInput("foreign tensor".into()))
    }
    fn to_device(&self, t: DeviceTensor, _: usize) -> Result<DeviceTensor, EngineError> {
        Ok(t)
    }
    fn open_stage(&self, _: &StageSpec) -> Result<Box<dyn Stage>, EngineError> {
        Ok(Box::new(PanickyStage))
    }
}

struct PanickyStage;

impl Stage for PanickyStage {
    fn call(&mut self, call: StageCall<'_>) -> Result<Reply, EngineError> {
        match call {
            StageCall::Forward { .. } => panic!("injected panic in Forward"),
            StageCall::SessionForward { h, .. } => Ok(Reply::tensor(h)),
            other => Err(EngineError::InvalidInput(format!(
                "{} is not supported by the panicky plugin",
                other.name()
            ))),
        }
    }
    fn save(&self) -> Result<Vec<u8>, EngineError> {
        Ok(b"panicky".to_vec())
    }
    fn load(&mut self, _: &[u8]) -> Result<(), EngineError> {
        Ok(())
    }
    fn param_count(&self) -> u64 {
        0
    }
}

fn open(options: &str) -> Result<Box<dyn ComputeBackend>, EngineError> {
    // The command line opens plugins with options of its own: $NSACTOR_TEST_PANICKY, when
    // set, stands in for them.
    let env = std::env::var("NSACTOR_TEST_PANICKY").unwrap_or_default();
    let options = if env.is_empty() {
        options
    } else {
        env.as_str()
    };
    match options {
        "fail" => Err(EngineError::Backend(
            "device 0 is unavailable (injected failure)".into(),
        )),
        "panic" => panic!("injected panic while opening"),
        _ => Ok(Box::new(Panicky)),
    }
}

nsactor_plugin_abi::export_plugin!("panicky", "0.0.0", open);
