//! The `[backend]` table's values that its types take but the backends refuse: checked once at
//! load, each refusal naming its key and what it takes.

use super::BackendConfig;

impl BackendConfig {
    /// Refuses a precision, stream mode, kernel knob or cache directory the backends cannot
    /// take; the message names the key and what it takes.
    pub(super) fn check(&self) -> Result<(), String> {
        if let Some(p) = &self.precision
            && p != "fp32"
            && p != "bf16"
        {
            return Err(format!(
                "[backend] precision = `{p}`: expected `fp32` or `bf16`"
            ));
        }
        if let Some(s) = &self.streams
            && s != "shared"
            && s != "per-thread"
        {
            return Err(format!(
                "[backend] streams = `{s}`: expected `shared` or `per-thread`"
            ));
        }
        self.kernel_table()?;
        if let Some(d) = &self.cache_dir
            && d.to_string_lossy().contains([',', ' ', '\t', '\n'])
        {
            return Err(format!(
                "[backend] cache_dir = `{}`: a path without commas or spaces, please (it travels \
                 in the plugin's option string)",
                d.display()
            ));
        }
        Ok(())
    }
}
