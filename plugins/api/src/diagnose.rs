//! Diagnostics a backend runs on request, as typed values: what `nsactor bench kernels`,
//! `bench decode-profile`, `verify plif-scan`, and the memory and device-time parts of
//! `bench train` / `bench generate` ask a backend for, and what it answers.
//!
//! In a linked backend these values pass as they are; across the C boundary
//! `nsactor-plugin-abi` carries them as versioned JSON (its `diagnostic` module has the schema).

use crate::timing::DeviceTime;

/// Which scan precisions `verify plif-scan` checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanPrecisions {
    Fp32,
    Bf16,
    Both,
}

/// A diagnostic to run on the backend.
#[derive(Debug, Clone, PartialEq)]
pub enum Diagnostic {
    /// The backend's kernels checked against their references, then timed, on device 0.
    /// `options`: `key=value` pairs the backend documents (shapes, repetitions).
    Kernels { options: String },
    /// One batched decoding pass of a layer split into its parts, on device 0 (`batch=`,
    /// `reps=`, `config=tiny`).
    DecodeProfile { options: String },
    /// The PLIF scan kernels against a golden fixture file (`plif_scan.safetensors`).
    VerifyPlifScan {
        fixture: String,
        precisions: ScanPrecisions,
    },
    /// Device memory in use on every device.
    Memory,
    /// Opens a window of device timing on every device (it waits for the devices first).
    TimingStart,
    /// Closes the window and reports its breakdown per device.
    TimingReport,
}

impl Diagnostic {
    /// The name the command line and error messages use.
    pub fn name(&self) -> &'static str {
        match self {
            Diagnostic::Kernels { .. } => "kernels",
            Diagnostic::DecodeProfile { .. } => "decode-profile",
            Diagnostic::VerifyPlifScan { .. } => "verify-plif-scan",
            Diagnostic::Memory => "memory",
            Diagnostic::TimingStart => "timing-start",
            Diagnostic::TimingReport => "timing-report",
        }
    }
}

/// One device's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub device: usize,
    /// Bytes in use as the device's driver sees them (allocator pools included).
    pub used_bytes: u64,
    pub total_bytes: u64,
}

impl DeviceMemory {
    /// `device memory cuda:0: 12.50 GiB in use of 79.19 GiB`.
    pub fn render(&self, backend: &str) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        format!(
            "device memory {backend}:{}: {:.2} GiB in use of {:.2} GiB",
            self.device,
            gib(self.used_bytes),
            gib(self.total_bytes)
        )
    }
}

/// What a diagnostic answers.
#[derive(Debug, Clone, PartialEq)]
pub enum DiagnosticReport {
    /// A benchmark's report for people (tables of timings and checks).
    Text(String),
    /// Checks that passed or not, with their report.
    Verdict {
        passed: bool,
        report: String,
    },
    Memory(Vec<DeviceMemory>),
    Timing(Vec<DeviceTime>),
    /// Done; nothing to report (`TimingStart`).
    Done,
}

impl DiagnosticReport {
    /// The kind of report, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            DiagnosticReport::Text(_) => "text",
            DiagnosticReport::Verdict { .. } => "verdict",
            DiagnosticReport::Memory(_) => "memory",
            DiagnosticReport::Timing(_) => "timing",
            DiagnosticReport::Done => "done",
        }
    }
}
