//! nsactor patch: kernels compiled ahead, on worker threads, while their launches wait in order.
//!
//! Upstream compiles a kernel on the server thread when it is first launched, so a cold process
//! compiles its kernels one after another while the device idles (a 0.9B training step: ~175
//! kernels, ~14 s). Here a launch whose kernel is neither loaded nor in the on-disk cache starts
//! its compilation (CubeCL's source, then NVRTC) on a worker thread and waits in a queue; the
//! server thread goes on to the next task. Launches and queued tasks (`nsactor_in_order`) that
//! come while the queue is not empty join it, so the device sees every launch in the order it
//! was submitted. The queue's head is launched as soon as its kernel is ready; every other
//! server operation (reads, writes, syncs, resources handed out, captures, collectives) first
//! launches the whole queue, waiting for the compilations it needs. Compilations started
//! together therefore run side by side.
//!
//! Allocations (`initialize_memory`) that come while the queue is not empty wait in it too: a
//! stream's cursor then advances, and a freed buffer is reused, in the submitted order, as
//! upstream. (With allocations made at once, a stream that synchronised with another while
//! draining would record that stream's later allocations as synchronised, and skip waiting for
//! the kernels that write them; and memory freed behind queued launches could not be reused,
//! so a first training step grew by up to 10.8 GiB and, unbounded, ran out of memory.) A
//! launch of a loaded kernel drains the queue first once it holds `CUBECL_COMPILE_AHEAD` entries
//! (default 1,024, a bound on the host's side only; `0` turns the whole mechanism off, as
//! upstream). Nothing is queued while a stream is being captured into a graph.
//!
//! A stream in compile-only mode (`nsactor_compile_only`; nsactor's prewarm runs one layer's
//! training step on it while the real run is being set up) has each kernel it
//! launches compiled on the workers and nothing run: its launches never join the queue. Such a
//! compilation waits, finished or not, until a real launch of the same kernel claims it (that
//! launch then waits in the queue as if it had started it), so a kernel is compiled once.

use super::CudaServer;
use super::compile_pool;
use crate::CudaCompiler;
use crate::compute::context::KernelSource;
use cubecl_common::stream_id::StreamId;
use cubecl_core::{
    prelude::*,
    server::{KernelArguments, LaunchError, ServerError},
};
use cubecl_runtime::compiler::CubeTask;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_char;
use std::sync::mpsc::{Receiver, TryRecvError, sync_channel};
use std::time::{Duration, Instant};

/// A task queued behind the launches that wait for their kernels (see `nsactor_in_order`).
pub type InOrderTask = Box<dyn FnOnce(&mut CudaServer) + Send>;

/// The queue of launches and tasks waiting for kernels compiled ahead.
#[derive(Default)]
pub(super) struct Ahead {
    /// Most entries queued before a launch of a loaded kernel drains the queue; 0: off.
    limit: usize,
    queue: VecDeque<Deferred>,
    /// Compilations running on worker threads, by kernel.
    running: HashMap<KernelId, Compiling>,
    /// Set while the queue is being launched (a queued task's own server calls must not
    /// drain it again).
    draining: bool,
    /// Streams in compile-only mode: their launches are compiled ahead, never run.
    compile_only: std::collections::HashSet<StreamId>,
}

impl std::fmt::Debug for Ahead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ahead")
            .field("limit", &self.limit)
            .field("queued", &self.queue.len())
            .field("compiling", &self.running.len())
            .field("compile_only", &self.compile_only.len())
            .finish()
    }
}

impl Ahead {
    /// The queue's length from `CUBECL_COMPILE_AHEAD` (default 1,024; `0`: off).
    pub(super) fn from_env() -> Self {
        let limit = std::env::var("CUBECL_COMPILE_AHEAD")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(1024);
        Self {
            limit,
            ..Self::default()
        }
    }
}

/// Something submitted to the server that waits for an earlier launch's kernel.
enum Deferred {
    Launch {
        /// `None` where the kernel went to a worker thread with its compilation (it comes back
        /// with the result).
        kernel: Option<Box<dyn CubeTask<CudaCompiler>>>,
        id: KernelId,
        count: CubeCount,
        bindings: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    },
    Task(InOrderTask),
}

/// A compilation's result, with the kernel it was run for.
struct Done {
    kernel: Box<dyn CubeTask<CudaCompiler>>,
    result: Result<(KernelSource, Vec<c_char>), LaunchError>,
    took: Duration,
}

type Job = Box<dyn FnOnce() + Send>;

impl CudaServer {
    /// nsactor patch: launches now, or queues the launch behind earlier ones whose kernels are
    /// being compiled (starting its own kernel's compilation where it needs one).
    pub(super) fn launch_or_queue(
        &mut self,
        kernel: Box<dyn CubeTask<CudaCompiler>>,
        count: CubeCount,
        bindings: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) {
        if self.ahead.compile_only.contains(&stream_id) {
            return self.compile_only(kernel, mode);
        }
        if self.ahead.limit == 0 || self.ahead.draining || self.capture.is_some() {
            return self.launch_now(kernel, None, count, bindings, mode, stream_id);
        }
        let mut id = kernel.id();
        id.mode(mode);
        let loaded = self.ctx.module_names.contains_key(&id);
        if !loaded
            && let Some(compiling) = self.ahead.running.get_mut(&id)
            && !compiling.claimed
        {
            // A compile-only stream's compilation: this launch takes it over and waits for it
            // in the queue (its own kernel object is the same kernel; the worker's comes back).
            compiling.claimed = true;
            compile_pool::Pool::get().hurry(&compiling.slot);
            self.ahead.queue.push_back(Deferred::Launch {
                kernel: None,
                id,
                count,
                bindings,
                mode,
                stream_id,
            });
            return self.launch_ready();
        }
        if !loaded && self.to_compile(&id) {
            self.compile_on_worker(kernel, id.clone(), mode, true);
            self.ahead.queue.push_back(Deferred::Launch {
                kernel: None,
                id,
                count,
                bindings,
                mode,
                stream_id,
            });
            return self.launch_ready();
        }
        if self.ahead.queue.is_empty() {
            return self.launch_now(kernel, Some(id), count, bindings, mode, stream_id);
        }
        if loaded && self.ahead.queue.len() >= self.ahead.limit {
            self.drain_for("the queue's length");
            return self.launch_now(kernel, Some(id), count, bindings, mode, stream_id);
        }
        self.ahead.queue.push_back(Deferred::Launch {
            kernel: Some(kernel),
            id,
            count,
            bindings,
            mode,
            stream_id,
        });
        self.launch_ready();
    }

    /// A compile-only stream's launch: its kernel compiled on a worker unless loaded, being
    /// compiled or in the on-disk cache; nothing runs, and the bindings go.
    fn compile_only(&mut self, kernel: Box<dyn CubeTask<CudaCompiler>>, mode: ExecutionMode) {
        let mut id = kernel.id();
        id.mode(mode);
        if !self.ctx.module_names.contains_key(&id) && self.to_compile(&id) {
            self.compile_on_worker(kernel, id, mode, false);
        }
    }

    /// Whether a kernel not loaded needs compiling: not being compiled, not in the on-disk
    /// cache, and valid on this device (an invalid one fails at its launch, as upstream).
    fn to_compile(&self, id: &KernelId) -> bool {
        !self.ahead.running.contains_key(id)
            && !self.ctx.in_cache(id)
            && self.ctx.validate(id).is_ok()
    }

    /// Hands `kernel`'s compilation to a worker thread; `claimed`: a launch waits for it (a
    /// compile-only stream's waits unclaimed until one does).
    fn compile_on_worker(
        &mut self,
        kernel: Box<dyn CubeTask<CudaCompiler>>,
        id: KernelId,
        mode: ExecutionMode,
        claimed: bool,
    ) {
        let setup = self
            .ctx
            .nvrtc_setup(self.streams.logger.compilation_activated());
        let (tx, rx) = sync_channel(1);
        let job_id = id.clone();
        let job: Job = Box::new(move || {
            let started = Instant::now();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                setup.compile(&*kernel, &job_id, mode)
            }))
            .unwrap_or_else(|_| {
                Err(LaunchError::Unknown {
                    reason: "the kernel's compilation panicked".into(),
                    backtrace: cubecl_common::backtrace::BackTrace::capture(),
                })
            });
            let _ = tx.send(Done {
                kernel,
                result,
                took: started.elapsed(),
            });
        });
        let slot = compile_pool::Slot::new(job);
        if let Err(slot) = compile_pool::Pool::get().submit(slot.clone(), claimed) {
            // No worker: compile here, as upstream.
            compile_pool::run_here(&slot);
        }
        self.ahead.running.insert(
            id,
            Compiling {
                rx,
                done: None,
                claimed,
                slot,
            },
        );
    }

    /// nsactor patch: puts the calling thread's stream in compile-only mode (`on`) or back.
    /// Returns whether the mode is available: it needs the compile-ahead queue
    /// (`CUBECL_COMPILE_AHEAD` not 0). The thread sets its own side,
    /// `cubecl_runtime::nsactor_compile_only::set`, too.
    pub fn nsactor_compile_only(&mut self, stream_id: StreamId, on: bool) -> bool {
        if !on {
            self.ahead.compile_only.remove(&stream_id);
            return true;
        }
        if self.ahead.limit == 0 {
            return false;
        }
        self.ahead.compile_only.insert(stream_id);
        true
    }

    /// nsactor patch: runs `task` now, or behind the launches queued for their kernels (see
    /// `ahead.rs`), so that work outside CubeCL (a cuBLASLt GEMM) keeps its place among the
    /// launches. `task` must name its stream itself: it may run during another thread's call.
    pub fn nsactor_in_order(&mut self, task: InOrderTask) {
        if self.ahead.draining {
            return task(self);
        }
        if self.ahead.queue.is_empty() {
            // Run as a drained entry would: whatever it submits runs at once, at its place. A
            // panic goes on to the channel, which logs it, as upstream.
            self.ahead.draining = true;
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(self)));
            self.ahead.draining = false;
            if let Err(panic) = ran {
                std::panic::resume_unwind(panic);
            }
            return;
        }
        self.ahead.queue.push_back(Deferred::Task(task));
        self.launch_ready();
    }

    /// nsactor patch: launches every queued launch and runs every queued task, waiting for the
    /// compilations they need. Every server operation other than a launch calls it first;
    /// `cause` names it in the compilation log (`CUBECL_COMPILE_LOG=1`).
    pub(super) fn drain_for(&mut self, cause: &'static str) {
        if self.ahead.queue.is_empty() || self.ahead.draining {
            return;
        }
        let (entries, compiling) = (self.ahead.queue.len(), self.ahead.running.len());
        let started = Instant::now();
        self.drain_queue(true);
        crate::nsactor_stats::record_drain(cause, entries, compiling, started.elapsed());
    }

    /// nsactor patch: whether work waits in the queue (and it is not being drained), so that
    /// what is submitted now must wait behind it.
    pub(super) fn ahead_queued(&self) -> bool {
        !self.ahead.queue.is_empty() && !self.ahead.draining
    }

    /// Launches the queue's head while its kernels are ready, without waiting.
    fn launch_ready(&mut self) {
        self.drain_queue(false);
    }

    fn drain_queue(&mut self, wait: bool) {
        if self.ahead.draining {
            return;
        }
        // Cleared however the drain ends: a panicking task or launch (the device's thread
        // survives it) leaves the rest queued for the next drain, in order.
        self.ahead.draining = true;
        let drained =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.drain_entries(wait)));
        self.ahead.draining = false;
        if let Err(panic) = drained {
            std::panic::resume_unwind(panic);
        }
    }

    fn drain_entries(&mut self, wait: bool) {
        while let Some(front) = self.ahead.queue.front() {
            if let Deferred::Launch {
                kernel: None, id, ..
            } = front
                && !wait
            {
                let ready = self.ahead.running.get_mut(id).is_none_or(Compiling::ready);
                if !ready {
                    break;
                }
            }
            let Some(next) = self.ahead.queue.pop_front() else {
                break;
            };
            // A panicking entry is its own submitter's failure, as upstream (where it panicked
            // in that thread's task): a launch's goes to its stream as a launch error, a task's
            // to the log, and the drain goes on; it never reaches the thread whose call drains.
            match next {
                Deferred::Task(task) => {
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(self)));
                    if let Err(panic) = ran {
                        log::error!("a queued server task panicked: {}", panic_message(&*panic));
                    }
                }
                Deferred::Launch {
                    kernel,
                    id,
                    count,
                    bindings,
                    mode,
                    stream_id,
                } => {
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let kernel = match kernel {
                            Some(kernel) => Some(kernel),
                            None => self.finish_ahead(&id, stream_id),
                        };
                        if let Some(kernel) = kernel {
                            self.launch_now(kernel, Some(id), count, bindings, mode, stream_id);
                        }
                    }));
                    if let Err(panic) = ran {
                        let reason = format!("the launch panicked: {}", panic_message(&*panic));
                        self.launch_failed(
                            stream_id,
                            LaunchError::Unknown {
                                reason,
                                backtrace: cubecl_common::backtrace::BackTrace::capture(),
                            },
                        );
                    }
                }
            }
        }
    }

    /// The compilation of `id` taken from its worker (waiting for it) and loaded; the kernel
    /// back for its launch, or `None` where it failed (the error goes to the stream, as a
    /// failed launch's does).
    fn finish_ahead(
        &mut self,
        id: &KernelId,
        stream_id: StreamId,
    ) -> Option<Box<dyn CubeTask<CudaCompiler>>> {
        let done = self.ahead.running.remove(id).and_then(Compiling::take);
        let Some(done) = done else {
            self.launch_failed(
                stream_id,
                LaunchError::Unknown {
                    reason: "a kernel compilation thread stopped".into(),
                    backtrace: cubecl_common::backtrace::BackTrace::capture(),
                },
            );
            return None;
        };
        let logger = self.streams.logger.clone();
        let loaded = done.result.and_then(|(compiled, image)| {
            self.ctx
                .finish_compile(id, done.kernel.name(), compiled, image, &logger, done.took)
        });
        match loaded {
            Ok(()) => Some(done.kernel),
            Err(err) => {
                self.launch_failed(stream_id, err);
                None
            }
        }
    }

    fn launch_failed(&mut self, stream_id: StreamId, err: LaunchError) {
        let err: ServerError = err.into();
        match self.streams.resolve(stream_id, [].into_iter(), false) {
            Ok(mut stream) => stream.current().errors.push(err),
            Err(e) => log::error!("a kernel launch failed ({err:?}) on a stream not found ({e:?})"),
        }
    }
}

/// A panic's message, where it has one.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

/// A compilation on a worker thread: its channel, and its result once taken from it.
struct Compiling {
    rx: Receiver<Done>,
    done: Option<Done>,
    /// Whether a launch waits for it (false: a compile-only stream's, not yet taken over).
    claimed: bool,
    /// Its job, to move it ahead when a launch takes it over before it started.
    slot: std::sync::Arc<compile_pool::Slot>,
}

impl Compiling {
    /// Whether the result is in (or the worker gone), without waiting.
    fn ready(&mut self) -> bool {
        if self.done.is_some() {
            return true;
        }
        match self.rx.try_recv() {
            Ok(done) => {
                self.done = Some(done);
                true
            }
            Err(TryRecvError::Empty) => false,
            Err(TryRecvError::Disconnected) => true,
        }
    }

    /// The result, waiting for it; `None` where the worker went without one.
    fn take(mut self) -> Option<Done> {
        self.done.take().or_else(|| self.rx.recv().ok())
    }
}
