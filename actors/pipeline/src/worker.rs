//! Device worker threads: the only threads that run stage compute. Actors hand them jobs and
//! await the reply, so no tokio worker ever blocks on a kernel or a GEMM, and each device's
//! work is issued from threads of its own (one CUDA stream per thread on the CUDA backend).
//!
//! A worker runs one job at a time, backward jobs before forward jobs before control jobs
//! (the 1F1B preference: finishing a micro-batch frees its kept input), and within a class the
//! oldest micro-batch first, then first come first served. Oldest-first is what makes a stage
//! of several layers pipeline: without it two micro-batches in flight interleave layer by layer
//! through the stage and reach the next stage together, so the stages take turns instead of
//! overlapping (measured: no speed-up at all from 2 stages of 10 layers). A panic inside a job
//! is caught and returned as an error.
//!
//! Priorities alone only order jobs that are queued at the same time, and the next layer's job
//! of a micro-batch is not queued yet when this layer's job ends: its actor first gets the
//! reply and sends the activation on. So a job may name its *successor* ([`Worker::run_then`]):
//! until a job at least that urgent arrives (or [`LINGER`] passes), the worker starts nothing
//! less urgent. Without it the worker slips a queued forward of a younger micro-batch between
//! two layers of an older one, and the stage's backward reaches the previous stage late
//! (measured with `bench pipeline-hop --layer-busy-us`).

use std::collections::BinaryHeap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// Which queued job runs first: lower values win — the class first (backward, forward,
/// control), then the micro-batch number (older first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    Backward(u64),
    Forward(u64),
    Control,
}

impl Priority {
    /// Forward work that belongs to no training micro-batch (decoding, evaluation): after the
    /// training forwards.
    pub const FORWARD_UNTRAINED: Priority = Priority::Forward(u64::MAX);
    /// A data-parallel gradient exchange (taking a layer's gradients out for the all-reduce,
    /// putting the sums back): ahead of everything, so that a layer's reduction starts between
    /// two backward jobs and overlaps the rest of the backward, instead of waiting for the
    /// whole backward (measured on 4 H100s, 0.9B, D = 4: docs/benchmarks/HISTORY.md, issue 32).
    pub const GRADS: Priority = Priority::Backward(0);
}

type Job = Box<dyn FnOnce() + Send>;

/// How long a worker holds back less urgent jobs for a named successor: far longer than a hop
/// between two actors (tens of µs), far shorter than a layer's compute.
pub const LINGER: std::time::Duration = std::time::Duration::from_millis(5);

struct Queued {
    priority: Priority,
    seq: u64,
    job: Job,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.priority, self.seq) == (o.priority, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    // BinaryHeap pops the greatest: invert so the lowest (priority, seq) comes first.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.priority, o.seq).cmp(&(self.priority, self.seq))
    }
}

#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Queued>,
    next_seq: u64,
    closed: bool,
    /// The successor the last job named, and until when to hold back for it.
    expect: Option<(Priority, Instant)>,
}

impl Queue {
    /// The next job to run now, or how long to wait for one: `Err(None)` = until a job comes.
    fn next(&mut self) -> Result<Job, Option<std::time::Duration>> {
        if let Some((p, until)) = self.expect {
            let now = Instant::now();
            let top_ok = self.heap.peek().is_some_and(|j| j.priority <= p);
            if !top_ok && now < until {
                return Err(Some(until - now));
            }
            self.expect = None;
        }
        self.heap.pop().map(|j| j.job).ok_or(None)
    }
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    /// Nanoseconds spent running jobs.
    busy_ns: AtomicU64,
    /// Of those, nanoseconds the jobs reported as moving tensors between devices.
    transfer_ns: AtomicU64,
    jobs: AtomicU64,
    /// Jobs queued so far (raised under the queue's lock): an idle worker spinning for work
    /// ([`idle_spin`]) watches it without the lock.
    pushed: AtomicU64,
    /// How long the idle worker spins before it sleeps.
    spin: std::time::Duration,
}

/// How long an idle worker spins for its next job before it sleeps on the condition variable,
/// on `backend`: `NSACTOR_WORKER_SPIN_US` when set; otherwise 5 ms where the devices compute
/// asynchronously (every backend but `ndarray`) and 0 on `ndarray`, whose jobs compute on the
/// host's cores and would lose one to a spinning neighbour. A decoding step hands each worker a
/// job every few milliseconds, and waking a sleeping thread costs tens of microseconds per
/// hand-off; on the H100 the spin took batch-1 decoding from 400–405 to 413–419 tokens/s
/// (docs/benchmarks/HISTORY.md, session 14). A spinning worker holds a core while it lasts.
pub fn idle_spin(backend: &str) -> std::time::Duration {
    let us = std::env::var("NSACTOR_WORKER_SPIN_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(if backend == "ndarray" { 0 } else { 5000 });
    std::time::Duration::from_micros(us)
}

thread_local! {
    /// Transfer time the running job has reported ([`add_transfer`]).
    static TRANSFER_NS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Called from inside a job: `d` of its time went to moving a tensor between devices.
pub fn add_transfer(d: std::time::Duration) {
    TRANSFER_NS.with(|t| t.set(t.get() + d.as_nanos() as u64));
}

/// A thread that runs compute jobs for one pipeline stage.
pub struct Worker {
    name: String,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// A job that panicked: the panic message.
#[derive(Debug, Clone)]
pub struct JobPanicked(pub String);

pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

impl Worker {
    /// A worker that sleeps as soon as it is idle.
    pub fn spawn(name: impl Into<String>) -> std::io::Result<Self> {
        Self::spawn_spinning(name, std::time::Duration::ZERO)
    }

    /// A worker that spins for `spin` when idle before it sleeps ([`idle_spin`]).
    pub fn spawn_spinning(
        name: impl Into<String>,
        spin: std::time::Duration,
    ) -> std::io::Result<Self> {
        let name = name.into();
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
            busy_ns: AtomicU64::new(0),
            transfer_ns: AtomicU64::new(0),
            jobs: AtomicU64::new(0),
            pushed: AtomicU64::new(0),
            spin,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                loop {
                    let job = {
                        let mut q = s.queue.lock().unwrap_or_else(|e| e.into_inner());
                        loop {
                            match q.next() {
                                Ok(job) => break job,
                                Err(_) if q.closed && q.heap.is_empty() => return,
                                Err(Some(d)) => {
                                    q = s
                                        .ready
                                        .wait_timeout(q, d)
                                        .unwrap_or_else(|e| e.into_inner())
                                        .0
                                }
                                Err(None) => {
                                    let spin = s.spin;
                                    if !spin.is_zero() {
                                        // Spin without the lock until a job is queued (or the
                                        // spin is over), then look again under it.
                                        let seen = s.pushed.load(Ordering::Acquire);
                                        drop(q);
                                        let until = Instant::now() + spin;
                                        while s.pushed.load(Ordering::Acquire) == seen
                                            && Instant::now() < until
                                        {
                                            std::hint::spin_loop();
                                        }
                                        q = s.queue.lock().unwrap_or_else(|e| e.into_inner());
                                        // `pushed` moves under the lock: unchanged now means
                                        // nothing came, and what comes next will notify.
                                        if s.pushed.load(Ordering::Acquire) != seen || q.closed {
                                            continue;
                                        }
                                    }
                                    q = s.ready.wait(q).unwrap_or_else(|e| e.into_inner())
                                }
                            }
                        }
                    };
                    job();
                }
            })?;
        Ok(Worker {
            name,
            shared,
            thread: Some(thread),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `f` on the worker thread; resolves to its result, or to the panic it raised.
    pub fn run<R, F>(
        &self,
        priority: Priority,
        f: F,
    ) -> impl Future<Output = Result<R, JobPanicked>> + Send + use<R, F>
    where
        R: Send + 'static,
        F: FnOnce() -> R + Send + 'static,
    {
        self.run_then(priority, None, f)
    }

    /// [`run`](Self::run), then, when `successor` names one, hold back jobs less urgent than
    /// it for up to [`LINGER`] (module docs).
    pub fn run_then<R, F>(
        &self,
        priority: Priority,
        successor: Option<Priority>,
        f: F,
    ) -> impl Future<Output = Result<R, JobPanicked>> + Send + use<R, F>
    where
        R: Send + 'static,
        F: FnOnce() -> R + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let shared = self.shared.clone();
        let job: Job = Box::new(move || {
            let t = Instant::now();
            let r = catch_unwind(AssertUnwindSafe(f)).map_err(|p| JobPanicked(panic_message(&*p)));
            if let (Some(p), Ok(_)) = (successor, &r) {
                // Set on the worker thread before the reply goes out, so before the successor
                // can be queued and before the worker picks its next job.
                let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
                q.expect = Some((p, Instant::now() + LINGER));
            }
            // Counted before the reply, so a caller that has its result sees its job counted.
            shared
                .busy_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            shared
                .transfer_ns
                .fetch_add(TRANSFER_NS.with(|t| t.replace(0)), Ordering::Relaxed);
            shared.jobs.fetch_add(1, Ordering::Relaxed);
            let _ = tx.send(r);
        });
        {
            let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            let seq = q.next_seq;
            q.next_seq += 1;
            q.heap.push(Queued { priority, seq, job });
            self.shared.pushed.fetch_add(1, Ordering::Release);
        }
        self.shared.ready.notify_one();
        async move {
            rx.await
                .unwrap_or_else(|_| Err(JobPanicked("the worker thread stopped".into())))
        }
    }

    /// Seconds of [`busy`](Self::busy) the jobs spent moving tensors between devices.
    pub fn transfer_s(&self) -> f64 {
        self.shared.transfer_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// Seconds spent running jobs so far, and how many jobs ran.
    pub fn busy(&self) -> (f64, u64) {
        (
            self.shared.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            self.shared.jobs.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Worker {
    /// Lets queued jobs finish, then joins the thread.
    fn drop(&mut self) {
        self.shared
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .closed = true;
        self.shared.ready.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_jobs_overtake_forward_jobs_older_micro_batches_go_first_and_panics_come_back_as_errors()
     {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let w = Worker::spawn("test-worker").unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        // Hold the worker busy so the next jobs queue up behind the gate.
        let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
        let gate = w.run(Priority::Control, move || gate_rx.recv().unwrap());
        let push = |p, tag: &'static str| {
            let o = order.clone();
            w.run(p, move || o.lock().unwrap().push(tag))
        };
        let f1 = push(Priority::Forward(3), "f1");
        let c1 = push(Priority::Control, "c1");
        let b1 = push(Priority::Backward(5), "b1");
        let f2 = push(Priority::Forward(3), "f2");
        let b2 = push(Priority::Backward(5), "b2");
        // An older micro-batch overtakes younger ones of its class, queued earlier or not.
        let f0 = push(Priority::Forward(1), "f0");
        let b0 = push(Priority::Backward(4), "b0");
        gate_tx.send(()).unwrap();
        rt.block_on(async {
            gate.await.unwrap();
            for f in [f1, c1, b1, f2, b2, f0, b0] {
                f.await.unwrap();
            }
        });
        assert_eq!(
            *order.lock().unwrap(),
            ["b0", "b1", "b2", "f0", "f1", "f2", "c1"]
        );
        let r = rt.block_on(w.run(Priority::Forward(0), || -> u32 { panic!("boom {}", 7) }));
        assert_eq!(r.unwrap_err().0, "boom 7");
        // The worker survives a panicking job.
        assert_eq!(rt.block_on(w.run(Priority::Forward(0), || 5)).unwrap(), 5);
        assert_eq!(w.busy().1, 10);
    }

    #[test]
    fn a_spinning_worker_runs_jobs_that_come_while_it_spins_and_after_it_sleeps() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let w = Worker::spawn_spinning("test-spin", std::time::Duration::from_millis(20)).unwrap();
        // Back to back (caught while spinning), then after the spin is over (asleep).
        for (i, pause) in [0u64, 0, 1, 60, 0, 60].into_iter().enumerate() {
            std::thread::sleep(std::time::Duration::from_millis(pause));
            assert_eq!(
                rt.block_on(w.run(Priority::Forward(0), move || i)).unwrap(),
                i
            );
        }
        assert_eq!(w.busy().1, 6);
        if std::env::var_os("NSACTOR_WORKER_SPIN_US").is_none() {
            assert!(idle_spin("ndarray").is_zero());
            assert_eq!(idle_spin("cuda"), std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn a_named_successor_runs_before_less_urgent_queued_work_and_is_not_waited_for_forever() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let w = Arc::new(Worker::spawn("test-successor").unwrap());
        let order = Arc::new(Mutex::new(Vec::new()));
        let push = |p, successor, tag: &'static str| {
            let o = order.clone();
            w.run_then(p, successor, move || o.lock().unwrap().push(tag))
        };
        // Layer 0 of micro-batch 1 names its successor (layer 1 of the same micro-batch); a
        // younger micro-batch's forward is already queued behind it and must wait for it.
        let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
        let gate = w.run_then(
            Priority::Forward(1),
            Some(Priority::Forward(1)),
            move || gate_rx.recv().unwrap(),
        );
        let young = push(Priority::Forward(2), None, "f2 layer 0");
        gate_tx.send(()).unwrap();
        rt.block_on(async {
            gate.await.unwrap();
            // The successor is queued only after the reply, as an actor would queue it.
            tokio::time::sleep(std::time::Duration::from_micros(200)).await;
            push(Priority::Forward(1), None, "f1 layer 1")
                .await
                .unwrap();
            young.await.unwrap();
        });
        assert_eq!(*order.lock().unwrap(), ["f1 layer 1", "f2 layer 0"]);
        // A successor that never comes holds the worker back for LINGER at most.
        let t = Instant::now();
        rt.block_on(async {
            push(Priority::Backward(7), Some(Priority::Backward(7)), "b7")
                .await
                .unwrap();
            push(Priority::Forward(8), None, "f8").await.unwrap();
        });
        let waited = t.elapsed();
        assert!(waited >= LINGER, "{waited:?}");
        assert!(waited < LINGER * 20, "{waited:?}");
        assert_eq!(order.lock().unwrap()[2..], ["b7", "f8"]);
    }
}
