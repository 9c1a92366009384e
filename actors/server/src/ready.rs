//! Readiness: a server that warms its decoder up first answers `/health` with 503
//! `{"status": "warming", ...}` and refuses generations (503, `Retry-After`) until the warm-up
//! has run every cohort size; then `/health` says `ok`. A warm-up that fails leaves the
//! server `failed` (the command exits).

use crate::error::ServeError;
use axum::http::StatusCode;
use nsactor_decoding::AsyncDecoder;
use nsactor_decoding::warmup::WarmupPlan;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Where a server is between start and ready.
#[derive(Debug)]
pub struct Readiness {
    ready: AtomicBool,
    done: AtomicUsize,
    total: AtomicUsize,
    failed: Mutex<Option<String>>,
}

impl Default for Readiness {
    /// Ready (a server without a warm-up).
    fn default() -> Self {
        Readiness {
            ready: AtomicBool::new(true),
            done: AtomicUsize::new(0),
            total: AtomicUsize::new(0),
            failed: Mutex::new(None),
        }
    }
}

impl Readiness {
    /// Ready at once without a warm-up, else warming through `plan`'s sizes.
    pub fn for_plan(no_warmup: bool, plan: &WarmupPlan) -> Arc<Self> {
        Arc::new(if no_warmup {
            Readiness::default()
        } else {
            Readiness::warming(plan.sizes.len())
        })
    }

    /// Runs `plan` on `decoder`, reporting progress here and to the log; ready after it, or
    /// failed (with why). `started` is when the server started, for the log.
    pub async fn warm_up(
        &self,
        decoder: &AsyncDecoder,
        plan: &WarmupPlan,
        started: Instant,
    ) -> Result<(), String> {
        let t = Instant::now();
        let sizes: Vec<String> = plan.sizes.iter().map(usize::to_string).collect();
        tracing::info!(
            "warming up at {} cohort sizes ({}) before taking requests; /health answers 503 until then",
            plan.sizes.len(),
            sizes.join(", ")
        );
        let r = decoder
            .warm_up(plan, |done, total, w| {
                self.progress(done);
                tracing::info!(
                    "warm-up {done}/{total}: {} sessions, {} passes, {:.2} s",
                    w.size,
                    w.passes,
                    w.seconds
                );
            })
            .await;
        match r {
            Ok(_) => {
                self.set_ready();
                tracing::info!(
                    "ready {:.1} s after start (warm-up {:.1} s)",
                    started.elapsed().as_secs_f64(),
                    t.elapsed().as_secs_f64()
                );
                Ok(())
            }
            Err(e) => {
                self.fail(e.to_string());
                Err(format!("the warm-up failed: {e}"))
            }
        }
    }

    /// Warming up through `total` steps.
    pub fn warming(total: usize) -> Self {
        let r = Readiness::default();
        r.ready.store(false, Ordering::SeqCst);
        r.total.store(total, Ordering::SeqCst);
        r
    }

    /// `done` of the steps are warm.
    pub fn progress(&self, done: usize) {
        self.done.store(done, Ordering::SeqCst);
    }

    pub fn set_ready(&self) {
        self.done
            .store(self.total.load(Ordering::SeqCst), Ordering::SeqCst);
        self.ready.store(true, Ordering::SeqCst);
    }

    pub fn fail(&self, why: String) {
        *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    fn failure(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// `Ok` once ready; a 503 saying how far the warm-up is otherwise.
    pub fn check(&self) -> Result<(), ServeError> {
        if self.is_ready() {
            return Ok(());
        }
        Err(ServeError::Unavailable(match self.failure() {
            Some(why) => format!("the server failed to warm up: {why}"),
            None => format!(
                "the server is warming up ({} of {} cohort sizes ready); retry shortly",
                self.done.load(Ordering::SeqCst),
                self.total.load(Ordering::SeqCst)
            ),
        }))
    }

    /// `/health`'s status and body (without the server's other fields).
    pub fn health(&self) -> (StatusCode, serde_json::Value) {
        if self.is_ready() {
            return (StatusCode::OK, serde_json::json!({"status": "ok"}));
        }
        let (done, total) = (
            self.done.load(Ordering::SeqCst),
            self.total.load(Ordering::SeqCst),
        );
        let body = match self.failure() {
            Some(why) => serde_json::json!({"status": "failed", "error": why}),
            None => serde_json::json!({"status": "warming", "warmed": done, "of": total}),
        };
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warming_server_says_how_far_it_is_and_refuses_work_until_ready() {
        let r = Readiness::warming(4);
        r.progress(1);
        let (status, body) = r.health();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["status"], "warming");
        assert_eq!(
            (body["warmed"].as_u64(), body["of"].as_u64()),
            (Some(1), Some(4))
        );
        let e = r.check().unwrap_err();
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(e.to_string().contains("1 of 4"), "{e}");
        r.set_ready();
        assert!(r.check().is_ok());
        assert_eq!(
            r.health(),
            (StatusCode::OK, serde_json::json!({"status": "ok"}))
        );
        let f = Readiness::warming(2);
        f.fail("cuda: out of memory".into());
        assert_eq!(f.health().1["status"], "failed");
        assert!(f.check().unwrap_err().to_string().contains("out of memory"));
        assert!(Readiness::default().is_ready());
    }
}
