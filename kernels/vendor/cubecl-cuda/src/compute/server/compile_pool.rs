//! nsactor patch: the threads that compile kernels ahead (`ahead.rs`), with two queues.
//!
//! A compilation some launch waits for goes in the urgent queue; a compile-only stream's (a
//! prewarm's, which nothing waits for yet) in the other. A worker takes urgent work first, so
//! a prewarm that hands over a whole step's kernels at once never holds up a kernel the run
//! needs now; when a launch takes over a prewarm's compilation that has not started, the
//! compilation moves to the urgent queue ([`Pool::hurry`]). Two workers (one where there are
//! two or three) never take work from the second queue, so urgent work starts at once even
//! while a prewarm's compilations, some of seconds, hold the others.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

type Job = Box<dyn FnOnce() + Send>;

/// One compilation, run by whichever worker takes it first (it may sit in both queues).
pub(super) struct Slot(Mutex<Option<Job>>);

impl Slot {
    pub(super) fn new(job: Job) -> Arc<Self> {
        Arc::new(Slot(Mutex::new(Some(job))))
    }

    fn take(&self) -> Option<Job> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

#[derive(Default)]
struct Queues {
    urgent: VecDeque<Arc<Slot>>,
    later: VecDeque<Arc<Slot>>,
    /// Workers busy with work from `later`.
    running_later: usize,
}

/// The workers: one fewer than the host's cores (at most 16), at least 1.
pub(super) struct Pool {
    queues: Mutex<Queues>,
    work: Condvar,
    /// Worker threads that started.
    workers: AtomicUsize,
}

impl Pool {
    /// The process's pool, its threads started on first use.
    pub(super) fn get() -> &'static Arc<Pool> {
        static POOL: OnceLock<Arc<Pool>> = OnceLock::new();
        POOL.get_or_init(|| {
            let n = std::thread::available_parallelism()
                .map_or(1, |n| n.get().saturating_sub(1))
                .clamp(1, 16);
            let pool = Arc::new(Pool {
                queues: Mutex::new(Queues::default()),
                work: Condvar::new(),
                workers: AtomicUsize::new(0),
            });
            for i in 0..n {
                let worker = pool.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("cubecl-compile-{i}"))
                    .spawn(move || worker.work_loop());
                match spawned {
                    Ok(_) => {
                        pool.workers.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => log::warn!("a kernel compilation thread did not start: {e}"),
                }
            }
            pool
        })
    }

    /// Queues `slot` (`urgent`: a launch waits for it). Returns it back where no worker runs.
    pub(super) fn submit(&self, slot: Arc<Slot>, urgent: bool) -> Result<(), Arc<Slot>> {
        if self.workers.load(Ordering::Relaxed) == 0 {
            return Err(slot);
        }
        let mut q = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        if urgent {
            q.urgent.push_back(slot);
        } else {
            q.later.push_back(slot);
        }
        self.work.notify_one();
        Ok(())
    }

    /// Moves a queued compilation to the urgent queue (nothing happens if it has started).
    pub(super) fn hurry(&self, slot: &Arc<Slot>) {
        let mut q = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        q.urgent.push_back(slot.clone());
        self.work.notify_one();
    }

    /// Workers that may take work from the second queue at once: all but two (one of two or
    /// three; the only one of one).
    fn later_workers(&self) -> usize {
        let n = self.workers.load(Ordering::Relaxed);
        match n {
            0 | 1 => 1,
            2 | 3 => n - 1,
            _ => n - 2,
        }
    }

    fn work_loop(&self) {
        loop {
            let (slot, later) = {
                let mut q = self.queues.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(s) = q.urgent.pop_front() {
                        break (s, false);
                    }
                    if q.running_later < self.later_workers()
                        && let Some(s) = q.later.pop_front()
                    {
                        q.running_later += 1;
                        break (s, true);
                    }
                    q = self.work.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            if let Some(job) = slot.take() {
                job();
            }
            if later {
                let mut q = self.queues.lock().unwrap_or_else(|e| e.into_inner());
                q.running_later -= 1;
                // A worker that waits for later work may take it now.
                self.work.notify_all();
            }
        }
    }
}

/// Runs a slot's job here (no worker thread): as upstream, on the server thread.
pub(super) fn run_here(slot: &Slot) {
    if let Some(job) = slot.take() {
        job();
    }
}
