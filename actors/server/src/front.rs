//! The server's own runtime: connections, request parsing, generations' text and the events
//! written to clients run on it, apart from the pipeline's runtime where the actors live (as
//! vLLM keeps its API server apart from its engine loop). A cohort's hops between actors then
//! never wait behind hundreds of clients' per-token work.

use std::io;

/// Threads the pipeline keeps busy besides its own runtime: its two runtime threads and (on a
/// GPU) the edge's and one stage's spinning workers.
const PIPELINE_THREADS: usize = 4;

/// Worker threads for the server's runtime: `requested`, or (0) the cores the pipeline leaves,
/// at least 2.
pub fn front_threads(requested: usize) -> usize {
    if requested > 0 {
        return requested;
    }
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    cores.saturating_sub(PIPELINE_THREADS).max(2)
}

/// A multi-threaded runtime of [`front_threads`]`(requested)` workers named `nsactor-http`.
pub fn front_runtime(requested: usize) -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(front_threads(requested))
        .thread_name("nsactor-http")
        .enable_all()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requested_count_wins_and_the_default_is_at_least_two() {
        assert_eq!(front_threads(3), 3);
        assert!(front_threads(0) >= 2);
        let rt = front_runtime(2).unwrap();
        assert_eq!(rt.block_on(async { 1 + 1 }), 2);
    }
}
