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
    if let Some(s) = error.downcast_ref::<Signalled>() {
        return s.exit_code();
    }
    if refused { EXIT_REFUSED } else { 1 }
}

/// A command a signal stopped before it could end well (`train --max-restarts` asked to stop
/// while its child had not finished): exits 128 + the signal, as the shell reports a process
/// a signal ended and as `train` itself exits on a second signal.
#[derive(Debug)]
pub struct Signalled {
    pub signal: i32,
    pub message: String,
}

impl Signalled {
    pub fn exit_code(&self) -> u8 {
        u8::try_from(128 + self.signal).unwrap_or(1)
    }
}

impl std::fmt::Display for Signalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Signalled {}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_by_signal_exits_128_plus_the_signal_and_a_refusal_78() {
        let stopped = |signal| -> CliError {
            Box::new(Signalled {
                signal,
                message: "stopped on request".into(),
            })
        };
        assert_eq!(exit_code(&stopped(15)), 143);
        assert_eq!(exit_code(&stopped(2)), 130);
        assert_eq!(exit_code(&refuse("no")), EXIT_REFUSED);
        assert_eq!(exit_code(&"a crash".into()), 1);
    }
}
