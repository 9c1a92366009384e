//! `nsactor train --max-restarts N`: the run in a child process that this one watches and
//! restarts, like torchrun's agent. When the child dies from a signal or exits non-zero it
//! is started again (unless it refused its input: exit 78, or 2 for arguments that did not
//! parse, which the same command would meet again) with `--resume` (from the newest valid checkpoint) after a backoff that
//! doubles per restart; each restart is logged with its cause and the step rolled back to, and
//! written to `metrics.jsonl` as an `{"event":"restarted",…}` line. More than N restarts within
//! the window and the agent gives up with a clear message. SIGTERM or SIGINT to the agent is
//! passed on to the child (which checkpoints and exits 0) and no restart follows. With a
//! [`Group`] (`--nproc-per-node`, `--nnodes`) the child is this host's ranks, watched and
//! restarted as one: a rank that dies takes the others down with it.

use crate::group::{GROUP_FLAGS, Group, command, wait_all};
use crate::result::{CliError, CliResult};
use nsactor_checkpoint::checkpoint;
use nsactor_engine::supervision::{RestartPolicy, Restarts};
use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The agent's flags, taken out of the child's command line.
const AGENT_FLAGS: [&str; 3] = ["--max-restarts", "--restart-window", "--restart-backoff"];

/// `args` (the agent's own, program name excluded) without the agent's flags and their values.
pub fn child_args(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let flags: Vec<&str> = AGENT_FLAGS.iter().chain(&GROUP_FLAGS).copied().collect();
    without(args, &flags)
}

/// `args` without the options `flags` (`--flag value` or `--flag=value`).
fn without(args: impl IntoIterator<Item = OsString>, flags: &[&str]) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for a in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let s = a.to_string_lossy();
        if flags.contains(&s.as_ref()) {
            skip_value = true;
        } else if !flags.iter().any(|f| s.starts_with(&format!("{f}="))) {
            out.push(a);
        }
    }
    out
}

/// How a child ended, in words.
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!(
            "was killed by signal {s} ({})",
            nsactor_training::shutdown::signal_name(s)
        ),
        _ => "ended".into(),
    }
}

/// Whether a child's exit says it refused its input ([`crate::result::EXIT_REFUSED`], or 2:
/// its arguments did not parse), which no restart can mend.
fn refused(status: ExitStatus) -> bool {
    matches!(status.code(), Some(2)) || status.code() == Some(crate::result::EXIT_REFUSED.into())
}

/// The step of the newest checkpoint under `root` with a manifest (what a resume starts from;
/// the resume itself verifies the shards), or 0.
fn newest_step(root: &Path) -> u64 {
    checkpoint::list(root)
        .into_iter()
        .find(|(_, dir)| dir.join(checkpoint::MANIFEST).is_file())
        .map_or(0, |(step, _)| step)
}

/// Appends one event line to the run's `metrics.jsonl`.
fn log_event(out_dir: &Path, line: &serde_json::Value) {
    let path = out_dir.join("metrics.jsonl");
    let r = std::fs::create_dir_all(out_dir).and_then(|()| {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        writeln!(f, "{line}")
    });
    if let Err(e) = r {
        tracing::warn!("could not log the restart to {}: {e}", path.display());
    }
}

/// Passes SIGTERM and SIGINT on to the children whose pids are in `children` and records
/// in `stopping` the signal that asked for a stop (0: none yet).
fn forward_signals(
    children: Arc<Mutex<Vec<i32>>>,
    stopping: Arc<AtomicI32>,
) -> Result<(), CliError> {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut term, mut int) = rt.block_on(async {
        Ok::<_, std::io::Error>((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ))
    })?;
    std::thread::Builder::new()
        .name("nsactor-agent-signals".into())
        .spawn(move || {
            rt.block_on(async move {
                loop {
                    let sig = tokio::select! {
                        _ = term.recv() => libc::SIGTERM,
                        _ = int.recv() => libc::SIGINT,
                    };
                    stopping.store(sig, Ordering::SeqCst);
                    for &pid in children.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                        // SAFETY: kill(2) on the pid of a child we have not reaped yet.
                        unsafe { libc::kill(pid, sig) };
                    }
                }
            })
        })?;
    Ok(())
}

/// The error of an agent a signal stopped (exit 128 + the signal), if one did.
fn signalled(stopping: &AtomicI32, message: impl FnOnce() -> String) -> Option<CliError> {
    match stopping.load(Ordering::SeqCst) {
        0 => None,
        signal => Some(Box::new(crate::result::Signalled {
            signal,
            message: message(),
        })),
    }
}

/// Runs `nsactor train` with this process's arguments (less the agent's flags) as a child, or
/// as `group`'s ranks, until it succeeds, restarting it under `policy`. `out_dir` holds the
/// run's metrics and its `checkpoints/`.
pub fn supervise(policy: RestartPolicy, out_dir: &Path, group: Option<Group>) -> CliResult {
    // The run directory is locked for the agent's life, restarts included (node 0's agent:
    // its rank 0 writes the run's files); the children run under its lock.
    let _lock = match &group {
        Some(g) if g.node_rank > 0 => None,
        _ => Some(nsactor_launch::run_dir::RunLock::acquire(out_dir)?),
    };
    let exe = std::env::current_exe()?;
    let args = child_args(std::env::args_os().skip(1));
    // An injected fault fires once per run: the first child only.
    // The first child cleared the directory it was told to overwrite; restarts resume.
    let mut restart_args: Vec<OsString> = without(args.clone(), &["--inject-fault"])
        .into_iter()
        .filter(|a| a != "--overwrite")
        .collect();
    if !restart_args.iter().any(|a| a == "--resume") {
        restart_args.push("--resume".into());
    }
    let pids = Arc::new(Mutex::new(Vec::new()));
    let stopping = Arc::new(AtomicI32::new(0));
    forward_signals(pids.clone(), stopping.clone())?;
    let root = out_dir.join("checkpoints");
    let mut recent = Restarts::default();
    let mut restarts = 0u32;
    loop {
        let a = if restarts == 0 { &args } else { &restart_args };
        let mut children = match &group {
            Some(g) => g.spawn(&exe, a, restarts)?,
            None => vec![(0, command(&exe, a).spawn()?)],
        };
        *pids.lock().unwrap_or_else(|e| e.into_inner()) =
            children.iter().map(|(_, c)| c.id() as i32).collect();
        let ended = wait_all(&mut children)?;
        pids.lock().unwrap_or_else(|e| e.into_inner()).clear();
        let (cause, refused) = match ended {
            Ok(()) => return Ok(()),
            Err((rank, status)) if group.is_some() => (
                format!("(rank {rank}) {}", describe(status)),
                refused(status),
            ),
            Err((_, status)) => (describe(status), refused(status)),
        };
        if refused {
            return Err(Box::new(crate::result::Refused(format!(
                "the training process {cause}: it refused its input (see its error above), \
                 and the same command would fail the same way, so it is not restarted"
            ))));
        }
        if let Some(stopped) = signalled(&stopping, || {
            format!("stopped on request; the training process {cause}")
        }) {
            return Err(stopped);
        }
        let Some(allowed) = recent.allow(&policy, Instant::now()) else {
            let step = newest_step(&root);
            log_event(
                out_dir,
                &serde_json::json!({
                    "event": "gave_up", "restarts": recent.len(), "cause": cause,
                    "resume_step": step, "max_restarts": policy.max_restarts,
                    "window_s": policy.window.as_secs_f64(),
                }),
            );
            return Err(format!(
                "the training process {cause}; giving up after {} restart(s) within {:.0} s \
                 (--max-restarts {}, --restart-window); `nsactor train --resume` continues \
                 from step {step}",
                recent.len(),
                policy.window.as_secs_f64(),
                policy.max_restarts,
            )
            .into());
        };
        restarts += 1;
        let delay = allowed.delay;
        let to_step = newest_step(&root);
        tracing::warn!(
            "the training process {cause}; restart {restarts} ({} of {} within {:.0} s) from \
             step {to_step} in {:.1} s",
            recent.len(),
            policy.max_restarts,
            policy.window.as_secs_f64(),
            delay.as_secs_f64()
        );
        log_event(
            out_dir,
            &serde_json::json!({
                "event": "restarted", "restart": restarts, "cause": cause,
                "to_step": to_step, "backoff_s": delay.as_secs_f64(),
            }),
        );
        let until = Instant::now() + delay;
        while Instant::now() < until {
            if let Some(stopped) = signalled(&stopping, || {
                format!("stopped on request while waiting to restart; the training process {cause}")
            }) {
                return Err(stopped);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_flags_leave_the_childs_command_line() {
        let args = [
            "train",
            "--max-restarts",
            "3",
            "--steps",
            "8",
            "--restart-window=60",
            "--restart-backoff",
            "0.1",
            "--resume",
        ]
        .map(OsString::from);
        let child: Vec<_> = child_args(args).into_iter().collect();
        assert_eq!(
            child,
            ["train", "--steps", "8", "--resume"].map(OsString::from)
        );
    }
}
