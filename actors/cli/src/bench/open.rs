//! What the benchmarks share to open a backend and print what it reports: the plugin option
//! for a precision, opening with it, a text diagnostic, and the devices' memory in use.

use nsactor_plugin_api::{ComputeBackend, Diagnostic, DiagnosticReport};

/// The plugin option string that sets `precision` on `backend`: the CPU backend has one
/// precision and takes no options.
pub fn precision_option(backend: &str, precision: &str) -> String {
    if backend == "cuda" {
        format!("precision={precision}")
    } else {
        String::new()
    }
}

/// Opens `backend` (a name or plugin path) with its GEMMs in `precision`.
pub fn open_with_precision(
    backend: &str,
    precision: &str,
) -> Result<std::sync::Arc<dyn ComputeBackend>, nsactor_plugin_api::EngineError> {
    nsactor_engine::backend::open_with(backend, &[], &precision_option(backend, precision))
}

/// Runs a diagnostic whose report is text for people, and prints it.
pub fn print_text(b: &dyn ComputeBackend, d: Diagnostic) -> crate::result::CliResult {
    match b.diagnose(&d)? {
        DiagnosticReport::Text(t) => {
            print!("{t}");
            Ok(())
        }
        other => Err(format!("`{}` answered a {} report", d.name(), other.kind()).into()),
    }
}

/// Prints every device's memory in use, or why the backend does not say.
pub fn print_memory(b: &dyn ComputeBackend) {
    match b.diagnose(&Diagnostic::Memory) {
        Ok(DiagnosticReport::Memory(devices)) => {
            let name = b.info().name;
            for d in devices {
                println!(
                    "{} (driver: total − free; allocator pools keep their peak)",
                    d.render(&name)
                );
            }
        }
        Ok(other) => println!(
            "device memory: the backend answered a {} report",
            other.kind()
        ),
        Err(e) => println!("device memory: not reported by this backend ({e})"),
    }
}
