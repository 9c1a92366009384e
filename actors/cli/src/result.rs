//! What every command returns: [`CliResult`], whose error ([`CliError`]) `main` prints as
//! `error: …` with exit code 1, or [`EXIT_REFUSED`] where it refuses the command's input. A room of its own at the bottom of the crate, so the commands
//! that return it import nothing from `main`.

/// What a command returns: its error is printed as `error: …` with [`exit_code`]'s status.
pub type CliResult<T = ()> = Result<T, CliError>;

/// The CLI's top-level error: whatever a command failed with (each library's own error type,
/// or a message of the CLI's), sendable across the benchmarks' tasks.
pub type CliError = Box<dyn std::error::Error + Send + Sync>;

/// The exit status of a command that refused its input (a configuration, an argument, data, a
/// checkpoint that does not fit): `EX_CONFIG` of sysexits(3). `nsactor train --max-restarts`
/// does not restart a child that exits with it, since the same command would fail the same
/// way; every other failure exits 1.
pub const EXIT_REFUSED: u8 = 78;

/// The exit status for `error`: [`EXIT_REFUSED`] where the error refuses the command's input,
/// else 1.
pub fn exit_code(error: &CliError) -> u8 {
    use nsactor_engine::error::RuntimeError;
    use nsactor_plugin_api::EngineError;
    let refused = if error.downcast_ref::<Refused>().is_some() {
        true
    } else if let Some(e) = error.downcast_ref::<RuntimeError>() {
        e.refuses_input()
    } else if let Some(e) = error.downcast_ref::<EngineError>() {
        RuntimeError::from(e.clone()).refuses_input()
    } else if let Some(e) = error.downcast_ref::<nsactor_data::DataError>() {
        e.refuses_input()
    } else if let Some(e) = error.downcast_ref::<nsactor_analysis::AnalysisError>() {
        e.refuses_input()
    } else {
        false
    };
    if refused { EXIT_REFUSED } else { 1 }
}

/// A refusal the CLI words itself (such as a supervised child's exit 78, passed on): exits
/// [`EXIT_REFUSED`].
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// A command's refusal of its input, worded by the CLI: exits [`EXIT_REFUSED`].
pub fn refuse(why: impl Into<String>) -> CliError {
    Box::new(Refused(why.into()))
}
