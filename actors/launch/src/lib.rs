//! The assembly: from a configuration, a checkpoint or a Hugging Face directory to a running
//! model. [`launch`] opens the backend, places the stages on devices, starts a training run
//! (fresh, resumed or initialised from another run) or loads a checkpoint to serve, evaluate or
//! analyse. [`training`] assembles a whole training run from what `nsactor train` asked for, as
//! one rank of a world of processes ([`world`]) when the environment names one; [`prewarm`] compiles
//! its first step's kernels beside it. The server (`nsactor-server`) and the command-line program (`nsactor`) sit on top;
//! this crate never depends on them.

pub mod launch;
pub mod prewarm;
pub mod run_dir;
pub mod training;
pub mod world;
