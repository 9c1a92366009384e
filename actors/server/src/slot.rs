//! A connection's place: the `--max-connections` permit and the `nsactor_connections` count,
//! held together by whoever holds the connection (the listener's HTTP connection, then a
//! WebSocket it was upgraded to) and given back when the last holder lets go.

use nsactor_telemetry::ServingMetrics;
use std::sync::Arc;
use tokio::sync::OwnedSemaphorePermit;

/// A connection's place under `--max-connections`, counted in `nsactor_connections`: both are
/// given back when the last holder (the HTTP connection, a WebSocket it was upgraded to) drops
/// it. Every request carries it as an extension.
pub struct ConnSlot {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<ServingMetrics>,
}

impl ConnSlot {
    pub(crate) fn new(permit: OwnedSemaphorePermit, metrics: Arc<ServingMetrics>) -> Arc<Self> {
        metrics.connections.inc();
        Arc::new(ConnSlot {
            _permit: permit,
            metrics,
        })
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.metrics.connections.dec();
    }
}
