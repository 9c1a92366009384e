//! nsactor patch: the calling thread's compile-only mode.
//!
//! A thread that turns it on (nsactor's kernel prewarm, through cubecl-cuda's
//! `CudaServer::nsactor_compile_only`, which marks the thread's stream on the server) has the
//! kernels it launches compiled ahead on worker threads but not run. This flag is the thread's
//! own side of it: the autotuner reads it to launch each candidate once (so that each is
//! compiled) without timing any or caching a choice.

use core::cell::Cell;

std::thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is in compile-only mode.
pub fn active() -> bool {
    ON.with(Cell::get)
}

/// Turns the calling thread's flag on or off (the server's side is set separately).
pub fn set(on: bool) {
    ON.with(|c| c.set(on));
}
