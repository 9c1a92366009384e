//! The training driver: the run loop over a `Pipeline` ([`train`]: steps, schedule, periodic
//! and final checkpoints, resume, samples, metrics and the loss picture), held-out evaluation
//! ([`heldout`]), the run's metrics history ([`history`]), stopping on SIGTERM/SIGINT with a
//! checkpoint ([`shutdown`]), and checking a backend against the authors' golden fixtures
//! ([`verify`]).

pub mod heldout;
pub mod history;
pub mod shutdown;
pub mod startup;
pub mod train;
pub mod verify;
