//! Decoding passes and state ops kept apart on the devices.
//!
//! On a GPU every stage thread of a decoding server puts its work on one stream (the CUDA
//! backend's `streams=shared`, `serve`'s default), and a layer captures its decoding step as
//! a CUDA graph by recording that stream. Work another thread put on the stream meanwhile would
//! be recorded into the graph, and a host write (a state op's gather indices, an imported
//! state) fails the capture and is lost with it: a restore that ran while a layer captured
//! read indices that were never written (`CUDA_ERROR_ILLEGAL_ADDRESS` on an H200, s46). So a
//! pass holds [`pass`]'s shared hold for its whole run, and a state op (restore, save, close,
//! drop, read, write) waits for passes in flight and runs alone ([`state`]). The lock is the
//! process's: every decoder in it shares the devices' streams. A state op is a few device ops
//! for all of its sessions, so passes wait little for it.

use std::future::Future;
use tokio::sync::RwLock;

static ORDER: RwLock<()> = RwLock::const_new(());

/// Runs a decoding pass: beside other passes, never beside a state op.
pub(crate) async fn pass<R>(f: impl Future<Output = R>) -> R {
    let asked = std::time::Instant::now();
    let _hold = ORDER.read().await;
    let waited = asked.elapsed();
    if waited.as_micros() > 500 {
        tracing::trace!(
            "a pass waited {:.2} ms for a state op",
            waited.as_secs_f64() * 1e3
        );
    }
    f.await
}

/// Runs a state op on the stages: alone (after the passes in flight; passes launched while it
/// waits wait for it).
pub(crate) async fn state<R>(f: impl Future<Output = R>) -> R {
    let _hold = ORDER.write().await;
    f.await
}
