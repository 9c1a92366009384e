//! What every command returns: [`CliResult`], whose error ([`CliError`]) `main` prints as
//! `error: …` with exit code 1. A room of its own at the bottom of the crate, so the commands
//! that return it import nothing from `main`.

/// What a command returns: its error is printed as `error: …` and the exit code is 1.
pub type CliResult<T = ()> = Result<T, CliError>;

/// The CLI's top-level error: whatever a command failed with (each library's own error type,
/// or a message of the CLI's), sendable across the benchmarks' tasks.
pub type CliError = Box<dyn std::error::Error + Send + Sync>;
