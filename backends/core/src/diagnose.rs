//! The diagnostics every burn backend runs ([`Diagnostic`]): the kernels benchmark (the PLIF
//! scans, then each backend-specific kernel bench), the decode profile, the `plif_scan` fixture
//! check, and — where the backend registered them — device memory and device-time windows.

use crate::BurnBackend;
use nsactor_kernels::{KernelError, SnnOps};
use nsactor_plugin_api::EngineError;
use nsactor_plugin_api::diagnose::{DeviceMemory, Diagnostic, DiagnosticReport, ScanPrecisions};
use nsactor_plugin_api::timing::DeviceTime;

/// The devices of a backend, as its hooks get them.
pub type Devices<B> = [<B as burn::tensor::backend::BackendTypes>::Device];

/// A backend's own kernel benchmark, run by [`Diagnostic::Kernels`] after the PLIF scans: it
/// gets device 0 and the options whose keys carry its prefix (prefix stripped), and returns its
/// report or, when a kernel is wrong, the report with the failure.
pub type KernelBench<B> =
    fn(&<B as burn::tensor::backend::BackendTypes>::Device, &str) -> Result<String, KernelError>;

/// Device memory in use on every device ([`Diagnostic::Memory`]).
pub type MemoryReport<B> = fn(&Devices<B>) -> Result<Vec<DeviceMemory>, EngineError>;

/// Opens ([`Diagnostic::TimingStart`]) and closes ([`Diagnostic::TimingReport`]) a window of
/// device timing.
#[derive(Clone, Copy)]
pub struct TimingHooks<B: SnnOps> {
    pub start: fn(&Devices<B>) -> Result<(), EngineError>,
    pub report: fn(&Devices<B>) -> Result<Vec<DeviceTime>, EngineError>,
}

impl<B: SnnOps> BurnBackend<B> {
    pub(crate) fn run_diagnostic(
        &self,
        what: &Diagnostic,
    ) -> Result<DiagnosticReport, EngineError> {
        let devices: Vec<B::Device> = self.devices.iter().map(|(d, _)| d.clone()).collect();
        let missing = || {
            EngineError::InvalidInput(format!(
                "the {} backend does not report `{}`",
                self.name,
                what.name()
            ))
        };
        match what {
            Diagnostic::Kernels { options } => self.kernels(options).map(DiagnosticReport::Text),
            Diagnostic::DecodeProfile { options } => {
                crate::profile::decode_profile::<B>(self.device(0)?, options)
                    .map(DiagnosticReport::Text)
            }
            Diagnostic::VerifyPlifScan {
                fixture,
                precisions,
            } => verify_plif_scan::<B>(self.device(0)?, fixture, *precisions),
            Diagnostic::Memory => {
                let memory = self.memory.ok_or_else(missing)?;
                memory(&devices).map(DiagnosticReport::Memory)
            }
            Diagnostic::TimingStart => {
                let t = self.timing.as_ref().ok_or_else(missing)?;
                (t.start)(&devices).map(|()| DiagnosticReport::Done)
            }
            Diagnostic::TimingReport => {
                let t = self.timing.as_ref().ok_or_else(missing)?;
                (t.report)(&devices).map(DiagnosticReport::Timing)
            }
        }
    }

    /// `bench kernels`: options go to the kernel bench whose prefix their key carries; the rest
    /// to the scans. `only=A+B` (repeatable) runs just those parts: the scans' [`PARTS`] and
    /// this backend's kernel benches by prefix; an unknown name is refused with the known ones.
    ///
    /// [`PARTS`]: nsactor_kernels::bench::PARTS
    fn kernels(&self, options: &str) -> Result<String, EngineError> {
        let (only, keys): (Vec<&str>, Vec<&str>) =
            nsactor_kernels::options::option_items(options).partition(|kv| kv.starts_with("only="));
        let only: Vec<&str> = only
            .iter()
            .flat_map(|kv| kv["only=".len()..].split('+'))
            .filter(|p| !p.is_empty())
            .collect();
        let benches: Vec<&str> = self.kernel_benches.iter().map(|(p, _)| *p).collect();
        let known = |p: &&str| nsactor_kernels::bench::PARTS.contains(p) || benches.contains(p);
        if let Some(p) = only.iter().find(|p| !known(p)) {
            let names = nsactor_kernels::bench::PARTS.iter().chain(&benches);
            return Err(EngineError::InvalidInput(format!(
                "bench kernels: only: unknown part `{p}` ({})",
                names.copied().collect::<Vec<_>>().join(", ")
            )));
        }
        let runs = |p: &str| only.is_empty() || only.contains(&p);
        let prefixed = |kv: &str, p: &str| kv.strip_prefix(p).is_some_and(|r| r.starts_with('_'));
        let mine = |prefix: &str| {
            keys.iter()
                .filter_map(|kv| kv.strip_prefix(prefix)?.strip_prefix('_'))
                .collect::<Vec<_>>()
                .join(",")
        };
        let scan_options = keys
            .iter()
            .filter(|kv| !self.kernel_benches.iter().any(|(p, _)| prefixed(kv, p)))
            .copied()
            .collect::<Vec<_>>()
            .join(",");
        let mut cfg =
            nsactor_kernels::bench::ScanBench::model_0_9b().with_options(&scan_options)?;
        let scan_parts: Vec<&str> = only
            .iter()
            .copied()
            .filter(|p| !benches.contains(p))
            .collect();
        if !only.is_empty() {
            cfg = cfg.with_only(&scan_parts)?;
        }
        let device = self.device(0)?;
        // Every part runs; a part that disagrees with its reference fails the whole report but
        // keeps its text, any other failure (an option, the device) ends it.
        let mut parts = Vec::new();
        let mut wrong = false;
        let scans = (only.is_empty() || !scan_parts.is_empty())
            .then(|| nsactor_kernels::bench::run::<B>(device, &cfg));
        let results = scans.into_iter().chain(
            self.kernel_benches
                .iter()
                .filter(|(prefix, _)| runs(prefix))
                .map(|(prefix, bench)| bench(device, &mine(prefix))),
        );
        for r in results {
            match r {
                Ok(text) => parts.push(text),
                Err(KernelError::Mismatch { report }) => {
                    wrong = true;
                    parts.push(report);
                }
                Err(e) => return Err(e.into()),
            }
        }
        let report = parts.join("\n");
        if wrong {
            Err(KernelError::Mismatch { report }.into())
        } else {
            Ok(report)
        }
    }
}

/// `nsactor verify plif-scan` inside the backend: the `plif_scan` fixture through this
/// backend's scans in the precisions asked for. A verdict either way; an error only when the
/// fixture cannot be read.
fn verify_plif_scan<B: SnnOps>(
    device: &B::Device,
    fixture: &str,
    precisions: ScanPrecisions,
) -> Result<DiagnosticReport, EngineError> {
    use nsactor_kernels::parity::{ScanPrecision, plif_fixture_all};
    let precisions = match precisions {
        ScanPrecisions::Fp32 => vec![ScanPrecision::F32],
        ScanPrecisions::Bf16 => vec![ScanPrecision::Bf16],
        ScanPrecisions::Both => vec![ScanPrecision::F32, ScanPrecision::Bf16],
    };
    let bytes = std::fs::read(fixture)
        .map_err(|e| EngineError::InvalidInput(format!("cannot read fixture {fixture}: {e}")))?;
    let reports = plif_fixture_all::<B>(device, &bytes, &precisions)?;
    Ok(DiagnosticReport::Verdict {
        passed: reports.iter().all(|r| r.passed()),
        report: reports.iter().map(|r| r.render()).collect(),
    })
}
