//! `nsactor train --nproc-per-node N [--nnodes H --node-rank K --master-addr A]`: the
//! processes of one host, one rank each, as torchrun starts them.
//!
//! The launcher gives each child its place in the world through the environment
//! (`NSACTOR_RANK` = node rank × N + local rank, `NSACTOR_WORLD_SIZE` = H × N, the master's
//! address and port, the shared secret, `NSACTOR_RESTART_COUNT`), watches them all, and treats
//! the group as one: when one dies, the others are killed and the agent
//! ([`crate::agent::supervise`]) restarts the whole group from the newest checkpoint, like
//! torchrun's static rendezvous. With one host the secret is made up here and the port is a
//! free one unless given; with several, every host must be given the same `NSACTOR_SECRET`
//! (or `NSACTOR_SECRET_FILE`) and `--master-addr`.

use crate::result::CliError;
use nsactor_cluster::World;
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// The launcher's flags, taken out of the children's command lines.
pub const GROUP_FLAGS: [&str; 5] = [
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
];

#[derive(clap::Args, Debug, Clone)]
pub struct GroupArgs {
    /// Training processes on this host, one rank each (one per GPU, say); they split the
    /// `--data-parallel` replicas (default: one per process) and restart together.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Hosts in the run; each runs the same command with its own --node-rank.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This host's place among the --nnodes hosts (0 runs rank 0).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// The address of node 0, where rank 0 listens (default with one host: 127.0.0.1).
    #[arg(long)]
    master_addr: Option<String>,
    /// Rank 0's port (default with one host: a free one; with several: 29400).
    #[arg(long)]
    master_port: Option<u16>,
}

/// The processes this host starts, and the world they form.
#[derive(Debug, Clone)]
pub struct Group {
    pub nproc: usize,
    /// The world of the first local rank; the others differ in rank and local rank.
    pub world: World,
    pub node_rank: usize,
}

impl GroupArgs {
    /// The group to launch; `None` for a run of one process.
    pub fn group(&self) -> Result<Option<Group>, CliError> {
        let (n, h, k) = (self.nproc_per_node, self.nnodes, self.node_rank);
        if n == 0 || h == 0 {
            return Err("--nproc-per-node and --nnodes must be at least 1".into());
        }
        if k >= h {
            return Err(format!("--node-rank {k} is outside --nnodes {h} (0..{h})").into());
        }
        if n * h == 1 {
            return Ok(None);
        }
        let secret = match (std::env::var("NSACTOR_SECRET"), h) {
            (Ok(s), _) => s,
            (Err(_), 1) => nsactor_cluster::world::new_secret()?,
            (Err(_), _) => match std::env::var("NSACTOR_SECRET_FILE") {
                Ok(path) => std::fs::read_to_string(&path)
                    .map_err(|e| format!("NSACTOR_SECRET_FILE {path}: {e}"))?
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string(),
                Err(_) => {
                    return Err(
                        "a run over several hosts needs the same NSACTOR_SECRET (or \
                                NSACTOR_SECRET_FILE) on each: the ranks authenticate with it"
                            .into(),
                    );
                }
            },
        };
        let master_addr = match (&self.master_addr, h) {
            (Some(a), _) => a.clone(),
            (None, 1) => "127.0.0.1".into(),
            (None, _) => return Err("a run over several hosts needs --master-addr".into()),
        };
        let master_port = match (self.master_port, h) {
            (Some(p), _) => p,
            (None, 1) => std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port(),
            (None, _) => nsactor_cluster::world::DEFAULT_MASTER_PORT,
        };
        let vars = [
            ("NSACTOR_WORLD_SIZE", (n * h).to_string()),
            ("NSACTOR_RANK", (k * n).to_string()),
            ("NSACTOR_MASTER_ADDR", master_addr),
            ("NSACTOR_MASTER_PORT", master_port.to_string()),
            ("NSACTOR_SECRET", secret),
        ];
        // The timeouts come from this process's environment, checked once here.
        let timeouts = ["NSACTOR_TIMEOUT_S", "NSACTOR_RENDEZVOUS_TIMEOUT_S"];
        let world = World::from_vars(|name| match vars.iter().find(|(k, _)| *k == name) {
            Some((_, v)) => Some(v.clone()),
            None if timeouts.contains(&name) => std::env::var(name).ok(),
            None => None,
        })?
        .expect("a world of several processes");
        Ok(Some(Group {
            nproc: n,
            world,
            node_rank: k,
        }))
    }
}

impl Group {
    /// Starts this host's ranks: `exe args` with each one's world in its environment
    /// (`restart`: how many times the group was restarted). Ranks after the first log
    /// warnings only unless `NSACTOR_LOG` says otherwise.
    pub fn spawn(
        &self,
        exe: &Path,
        args: &[OsString],
        restart: u32,
    ) -> std::io::Result<Vec<(usize, Child)>> {
        let mut children = Vec::with_capacity(self.nproc);
        for local in 0..self.nproc {
            let world = World {
                rank: self.node_rank * self.nproc + local,
                local_rank: local,
                restart,
                ..self.world.clone()
            };
            let mut cmd = command(exe, args);
            cmd.envs(world.vars());
            if world.rank > 0 && std::env::var_os("NSACTOR_LOG").is_none() {
                cmd.env("NSACTOR_LOG", "warn,ractor_cluster=error");
            }
            children.push((world.rank, cmd.spawn()?));
        }
        Ok(children)
    }
}

/// `exe args` in its own process group (so a terminal's Ctrl-C reaches it once, through the
/// agent), killed with SIGTERM when the agent dies, so it never trains orphaned.
pub fn command(exe: &Path, args: &[OsString]) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(args);
    // The agent holds the run directory's lock; its children run under it.
    cmd.env(
        nsactor_launch::run_dir::LOCK_HELD_BY,
        std::process::id().to_string(),
    );
    cmd.process_group(0);
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    cmd
}

/// Waits for every child: `Ok` once all have succeeded, or the first failure (which rank,
/// how it ended) once the others are killed and reaped. Of ranks that failed together (a
/// rank killed, then the others that lost it), the one a signal ended is the cause.
pub fn wait_all(
    children: &mut [(usize, Child)],
) -> std::io::Result<Result<(), (usize, ExitStatus)>> {
    use std::os::unix::process::ExitStatusExt;
    let mut ended: Vec<Option<ExitStatus>> = vec![None; children.len()];
    loop {
        for (i, (_, child)) in children.iter_mut().enumerate() {
            if ended[i].is_none() {
                ended[i] = child.try_wait()?;
            }
        }
        if ended.iter().flatten().any(|s| !s.success()) {
            // The others that lost it end within moments; then the rest are killed.
            std::thread::sleep(Duration::from_millis(200));
            let mut failed = Vec::new();
            for (i, (rank, child)) in children.iter_mut().enumerate() {
                let status = match ended[i].or(child.try_wait()?) {
                    Some(s) => s,
                    None => {
                        let _ = child.kill();
                        let _ = child.wait();
                        continue;
                    }
                };
                if !status.success() {
                    failed.push((*rank, status));
                }
            }
            let cause = failed
                .iter()
                .find(|(_, s)| s.signal().is_some())
                .or(failed.first())
                .copied()
                .expect("a failure");
            return Ok(Err(cause));
        }
        if ended.iter().all(Option::is_some) {
            return Ok(Ok(()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
