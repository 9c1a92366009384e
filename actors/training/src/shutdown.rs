//! Stopping a run on request, the way schedulers ask: SIGTERM (or SIGINT, Ctrl-C) asks the
//! training loop to finish the step it is in, write a checkpoint and exit 0; a second signal
//! ends the process at once, and so does the grace period running out (the newest complete
//! checkpoint is then what a resume starts from: checkpoints are written atomically).

use nsactor_engine::error::RuntimeError;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

/// The exit code of a process a signal ended before it finished: 128 + the signal's number,
/// the shell's convention (143 for SIGTERM, 130 for SIGINT), so a process manager reads
/// "terminated" or "interrupted" as the user meant.
pub fn exit_code(signal: i32) -> i32 {
    128 + signal
}

/// Whether a stop was asked for, and by which signal; and whether the process has begun the
/// work a stop lets finish ([`StopRequest::arm`]).
#[derive(Debug, Default)]
pub struct StopRequest {
    signal: AtomicI32,
    armed: AtomicBool,
}

impl StopRequest {
    pub fn new() -> Arc<Self> {
        Arc::new(StopRequest::default())
    }

    /// Asks for a stop (the signal's number, or any positive number).
    pub fn request(&self, signal: i32) {
        let _ = self
            .signal
            .compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Says the process has begun the work a stop lets finish (the training loop's first
    /// step, the server's accepting): a signal before it exits at once, as there is nothing to
    /// finish or save, and waiting out the grace period behind a blocked read (a corpus on a
    /// stalled network mount, a FIFO) helps nobody.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Whether [`StopRequest::arm`] was called.
    pub fn armed(&self) -> bool {
        self.armed.load(Ordering::SeqCst)
    }

    /// The signal that asked for a stop, once one has.
    pub fn requested(&self) -> Option<i32> {
        match self.signal.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

/// The name of a signal number, for messages.
pub fn signal_name(signal: i32) -> &'static str {
    match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        15 => "SIGTERM",
        _ => "a signal",
    }
}

/// Listens for SIGTERM and SIGINT on a thread of its own from now on: the first sets the
/// returned request (the training loop polls it between steps; the server drains), or, before
/// the caller [arms](StopRequest::arm) it, exits the process at once; a second,
/// or `grace` after the first, exits the process with [`exit_code`] of the signal that ended it
/// (the second, or the first when the grace period ran out). `doing` says in
/// the log what the process does before it exits (`finishing this step and writing a
/// checkpoint`).
pub fn stop_on_signals(
    grace: Duration,
    doing: &'static str,
) -> Result<Arc<StopRequest>, RuntimeError> {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| RuntimeError::Runtime(format!("signal listener: {e}")))?;
    // Registered before returning, so no signal in between takes its default action.
    let (mut term, mut int) = rt
        .block_on(async {
            Ok::<_, std::io::Error>((
                signal(SignalKind::terminate())?,
                signal(SignalKind::interrupt())?,
            ))
        })
        .map_err(|e| RuntimeError::Runtime(format!("signal listener: {e}")))?;
    let stop = StopRequest::new();
    let request = stop.clone();
    std::thread::Builder::new()
        .name("nsactor-signals".into())
        .spawn(move || {
            rt.block_on(async move {
                let first = tokio::select! {
                    _ = term.recv() => 15,
                    _ = int.recv() => 2,
                };
                request.request(first);
                if !request.armed() {
                    eprintln!(
                        "nsactor: {}: exiting at once, while starting (nothing to finish or \
                         save yet)",
                        signal_name(first)
                    );
                    std::process::exit(exit_code(first));
                }
                tracing::warn!(
                    "{}: {doing}, then exiting (within {:.0} s; a second signal exits now)",
                    signal_name(first),
                    grace.as_secs_f64()
                );
                let (why, by) = tokio::select! {
                    _ = term.recv() => ("a second signal (SIGTERM)", 15),
                    _ = int.recv() => ("a second signal (SIGINT)", 2),
                    _ = tokio::time::sleep(grace) => ("the grace period ran out", first),
                };
                eprintln!("nsactor: {why}: exiting at once; it was {doing}");
                std::process::exit(exit_code(by));
            })
        })
        .map_err(|e| RuntimeError::Runtime(format!("signal listener: {e}")))?;
    Ok(stop)
}
