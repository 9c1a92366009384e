//! nsactor's metrics on the [`prometheus`] crate: one registry per server
//! ([`ServingMetrics`], named as deployers scrape vLLM: `nsactor_num_requests_running`,
//! `nsactor_time_to_first_token_seconds`, …) and one per training run ([`TrainingMetrics`]:
//! loss, tokens/s, E[K], step time), exposed in the Prometheus text format by the server's
//! `GET /metrics` and, for training, by the small exporter of [`exporter`] on
//! `--metrics-addr`. The names and their meaning are listed in `docs/GUIDE.md` (Metrics).

pub mod exporter;
pub mod registry;
pub mod serving;
pub mod training;

pub use exporter::Exporter;
pub use registry::{CONTENT_TYPE, TelemetryError, render};
pub use serving::{PrefixCacheState, ServingMetrics};
pub use training::TrainingMetrics;
