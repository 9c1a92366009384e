//! [`StageHolder`]: an actor's stage and the worker it runs on. Jobs lock the stage one at a
//! time on the worker thread; a panic inside one loses the stage, and every later job says so.

use super::step::StepCtx;
use super::worker::{self, JobPanicked, Priority, Worker};
use nsactor_plugin_api::{ComputeBackend, DeviceTensor, EngineError, MicroBatchId, Stage};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;

/// An actor's stage and where it runs: the stage is locked by its worker's jobs, one at a time.
/// After a panic inside a job the stage is gone and every later call fails, naming that panic,
/// until the actor is rebuilt.
#[derive(Clone)]
pub struct StageHolder {
    pub(crate) who: String,
    /// Locked only by the worker's jobs, one at a time; `Err` holds the message of the panic
    /// that lost the stage.
    pub(crate) stage: Arc<std::sync::Mutex<Result<Box<dyn Stage>, String>>>,
    pub(crate) worker: Arc<Worker>,
    pub(crate) backend: Arc<dyn ComputeBackend>,
    pub(crate) device: usize,
    /// Devices of the stages it hands tensors to: `[backward, forward]` (gradients go back to
    /// the previous hop, activations forward to the next).
    pub(crate) neighbours: [usize; 2],
    /// Whether those neighbours run on this stage's worker (layers of one pipeline stage).
    pub(crate) same_worker: [bool; 2],
}

impl StageHolder {
    pub fn new(
        who: impl Into<String>,
        stage: Box<dyn Stage>,
        worker: Arc<Worker>,
        backend: Arc<dyn ComputeBackend>,
        device: usize,
    ) -> Self {
        StageHolder {
            who: who.into(),
            stage: Arc::new(std::sync::Mutex::new(Ok(stage))),
            worker,
            backend,
            device,
            neighbours: [device, device],
            same_worker: [false, false],
        }
    }

    /// Places the neighbours: `back` receives this stage's gradients, `forward` its activations
    /// (their devices, and whether they share this stage's worker).
    pub fn with_neighbours(mut self, back: (usize, bool), forward: (usize, bool)) -> Self {
        self.neighbours = [back.0, forward.0];
        self.same_worker = [back.1, forward.1];
        self
    }

    /// Queues a training job of `micro` whose output tensor goes on in direction `forward`
    /// (activations to the next hop, gradients back to the previous one). The job runs at the
    /// schedule's priority; under depth-first it names its successor when the receiving layer
    /// shares this worker ([`Worker::run_then`]); and when the receiver is on another device it
    /// returns only once the tensor is computed ([`ComputeBackend::ready`]), so the receiver,
    /// whose device runs its queue in order, never enqueues work that would idle it until ours
    /// finishes (on one device the queue orders it).
    pub(crate) fn train_job<X: Send + 'static>(
        &self,
        forward: bool,
        micro: MicroBatchId,
        ctx: &StepCtx,
        h: Option<DeviceTensor>,
        f: impl FnOnce(&mut dyn Stage, Option<DeviceTensor>) -> Result<(DeviceTensor, X), EngineError>
        + Send
        + 'static,
    ) -> impl Future<Output = Result<(DeviceTensor, X), EngineError>> + Send + 'static {
        let key = ctx.key(micro);
        let priority = if forward {
            Priority::Forward(key)
        } else {
            Priority::Backward(key)
        };
        let side = usize::from(forward);
        let successor = (ctx.depth_first && self.same_worker[side]).then_some(priority);
        let ready = (self.neighbours[side] != self.device).then(|| self.backend.clone());
        self.submit(priority, successor, h, move |st, h| {
            let (t, x) = f(st, h)?;
            if let Some(backend) = &ready {
                backend.ready(&t)?;
            }
            Ok((t, x))
        })
    }

    pub fn backend(&self) -> &Arc<dyn ComputeBackend> {
        &self.backend
    }

    /// Runs `f` on the stage, on the calling thread (the worker's, inside a job), after moving
    /// `h` (if any) to the stage's device. A panic is caught here, under the lock, and kept in
    /// the slot, so that the jobs queued behind it report what lost the stage (they may reach
    /// the supervisor before the panic itself does); then it goes on to the worker, which
    /// reports it as the job's panic.
    pub(crate) fn run<R>(
        &self,
        h: Option<DeviceTensor>,
        f: impl FnOnce(&mut dyn Stage, Option<DeviceTensor>) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let mut slot = self
            .stage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let st = match &mut *slot {
            Ok(st) => st,
            Err(cause) => {
                return Err(EngineError::Panic(format!(
                    "{} lost its state in an earlier panic ({cause}); restart it from a checkpoint",
                    self.who
                )));
            }
        };
        let run = catch_unwind(AssertUnwindSafe(|| {
            let h = h
                .map(|h| {
                    let t = std::time::Instant::now();
                    let r = self.backend.to_device(h, self.device);
                    worker::add_transfer(t.elapsed());
                    r
                })
                .transpose()?;
            f(&mut **st, h)
        }));
        match run {
            Ok(r) => r,
            Err(p) => {
                *slot = Err(worker::panic_message(&*p));
                drop(slot);
                resume_unwind(p)
            }
        }
    }

    /// Runs `f` on the stage, on the worker, after moving `h` (if any) to the stage's device.
    pub(crate) async fn compute<R: Send + 'static>(
        &mut self,
        priority: Priority,
        h: Option<DeviceTensor>,
        f: impl FnOnce(&mut dyn Stage, Option<DeviceTensor>) -> Result<R, EngineError> + Send + 'static,
    ) -> Result<R, EngineError> {
        self.submit(priority, None, h, f).await
    }

    /// Queues `f` on the worker now and returns its result as a future that does not borrow
    /// the holder, naming the job's `successor` on this worker ([`Worker::run_then`]). Training
    /// messages are answered from a task awaiting it, so the actor takes its next message at
    /// once: an actor that awaited a queued forward could not even queue the backward of an
    /// older micro-batch behind it, and that backward would wait for the forward whatever the
    /// priorities say. Jobs of one stage run in the order the worker picks; a job that panics
    /// loses the stage, and every later job reports that.
    pub(crate) fn submit<R: Send + 'static>(
        &self,
        priority: Priority,
        successor: Option<Priority>,
        h: Option<DeviceTensor>,
        f: impl FnOnce(&mut dyn Stage, Option<DeviceTensor>) -> Result<R, EngineError> + Send + 'static,
    ) -> impl Future<Output = Result<R, EngineError>> + Send + 'static {
        let holder = self.clone();
        let job = self
            .worker
            .run_then(priority, successor, move || holder.run(h, f));
        let who = self.who.clone();
        async move {
            match job.await {
                Ok(r) => r,
                Err(JobPanicked(m)) => Err(EngineError::Panic(format!("{who}: {m}"))),
            }
        }
    }
}
