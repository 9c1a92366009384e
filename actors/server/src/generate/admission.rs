//! Admission to decoding (a cap on concurrent sessions, a bounded queue, "busy" past it), and
//! the watch for a client that goes away while its request waits or its prompt is fed.

use crate::error::ServeError;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Semaphore, mpsc};

/// Sessions: at most `max_sessions` decoding, at most `max_queue` waiting.
pub struct Admission {
    permits: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_queue: usize,
    max_sessions: usize,
}

impl Admission {
    pub fn new(max_sessions: usize, max_queue: usize) -> Self {
        Admission {
            permits: Arc::new(Semaphore::new(max_sessions)),
            waiting: AtomicUsize::new(0),
            max_queue,
            max_sessions,
        }
    }

    /// A place among the sessions decoding, waiting in the queue if need be; "busy" past it.
    pub(crate) async fn enter(&self) -> Result<tokio::sync::OwnedSemaphorePermit, ServeError> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Ok(p);
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.max_queue {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ServeError::Busy(format!(
                "{} sessions are decoding and {} are queued; try again shortly",
                self.max_sessions, self.max_queue
            )));
        }
        // Counted out however the wait ends: a place, shutdown, or the caller giving up
        // the wait (its client gone).
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let _waiting = Waiting(&self.waiting);
        let p = self.permits.clone().acquire_owned().await;
        p.map_err(|_| ServeError::Unavailable("the server is shutting down".into()))
    }

    /// Sessions the server holds at once: decoding and queued.
    pub fn capacity(&self) -> usize {
        self.max_sessions + self.max_queue
    }

    pub fn queued(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
}

/// Ends when the client of a generation is gone: the receiver of its events dropped (a
/// closed connection), or `cancel` set (a WebSocket `cancel`, checked every 20 ms).
pub(super) async fn gone<T>(tx: &mpsc::Sender<T>, cancel: &AtomicBool) {
    let asked = async {
        while !cancel.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        _ = tx.closed() => {}
        _ = asked => {}
    }
}
