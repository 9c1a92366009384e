//! The world a process belongs to, read from its environment the way torchrun, Slurm and
//! Kubernetes hand it over.
//!
//! `NSACTOR_RANK`, `NSACTOR_WORLD_SIZE`, `NSACTOR_LOCAL_RANK`, `NSACTOR_MASTER_ADDR` and
//! `NSACTOR_MASTER_PORT` come first; torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR` and `MASTER_PORT` and Slurm's `SLURM_PROCID`, `SLURM_NTASKS` and
//! `SLURM_LOCALID` stand in for them. The shared secret that authenticates the ranks to one
//! another is `NSACTOR_SECRET` (or the first line of the file `NSACTOR_SECRET_FILE` names);
//! `nsactor train --nproc-per-node` makes one up for its own children. A world of one process
//! is no world: training runs in-process as before.

use crate::error::ClusterError;
use std::time::Duration;

/// How long a rank waits for another before it gives the run up: as long as NCCL's default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);
/// How long rank 0 waits for every rank to join, and a rank for rank 0 to listen.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);
pub const DEFAULT_MASTER_PORT: u16 = 29400;

/// One process's place in a run of several.
#[derive(Debug, Clone, PartialEq)]
pub struct World {
    /// 0 ..`size`; rank 0 coordinates (reduces gradients, writes checkpoints and metrics).
    pub rank: usize,
    pub size: usize,
    /// The rank among the processes of its host (picks its GPU).
    pub local_rank: usize,
    /// Where rank 0 listens.
    pub master_addr: String,
    pub master_port: u16,
    pub secret: String,
    /// The longest wait on another rank during a step.
    pub timeout: Duration,
    /// The longest wait for the ranks to find one another.
    pub rendezvous_timeout: Duration,
    /// How many times the launcher has restarted this group (`NSACTOR_RESTART_COUNT`).
    pub restart: u32,
}

impl World {
    /// The world of this process; `None` when it runs alone.
    pub fn from_env() -> Result<Option<World>, ClusterError> {
        World::from_vars(|k| std::env::var(k).ok())
    }

    /// [`World::from_env`] over any source of variables.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<World>, ClusterError> {
        let first = |names: &[&'static str]| names.iter().find_map(|n| get(n).map(|v| (*n, v)));
        let num = |names: &[&'static str]| -> Result<Option<usize>, ClusterError> {
            first(names)
                .map(|(n, v)| {
                    v.trim().parse::<usize>().map_err(|_| {
                        ClusterError::World(format!("{n}={v:?} is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        let size = num(&["NSACTOR_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS"])?.unwrap_or(1);
        if size <= 1 {
            return Ok(None);
        }
        let rank = num(&["NSACTOR_RANK", "RANK", "SLURM_PROCID"])?.ok_or_else(|| {
            ClusterError::World(format!(
                "a world of {size} processes needs NSACTOR_RANK (0..{size}) for each"
            ))
        })?;
        if rank >= size {
            return Err(ClusterError::World(format!(
                "NSACTOR_RANK {rank} is outside a world of {size} (0..{size})"
            )));
        }
        let local_rank = num(&["NSACTOR_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID"])?.unwrap_or(0);
        let master_addr = first(&["NSACTOR_MASTER_ADDR", "MASTER_ADDR"])
            .map(|(_, v)| v)
            .unwrap_or_else(|| "127.0.0.1".into());
        let master_port = match first(&["NSACTOR_MASTER_PORT", "MASTER_PORT"]) {
            Some((n, v)) => v
                .trim()
                .parse::<u16>()
                .map_err(|_| ClusterError::World(format!("{n}={v:?} is not a port")))?,
            None => DEFAULT_MASTER_PORT,
        };
        let secret = match (get("NSACTOR_SECRET"), get("NSACTOR_SECRET_FILE")) {
            (Some(s), _) => s,
            (None, Some(path)) => std::fs::read_to_string(&path)
                .map_err(|e| ClusterError::World(format!("NSACTOR_SECRET_FILE {path}: {e}")))?
                .lines()
                .next()
                .unwrap_or_default()
                .to_string(),
            (None, None) => {
                return Err(ClusterError::World(
                    "a world of several processes needs the same NSACTOR_SECRET (or \
                     NSACTOR_SECRET_FILE) in every one: the ranks authenticate with it"
                        .into(),
                ));
            }
        };
        if secret.trim().len() < 8 {
            return Err(ClusterError::World(
                "NSACTOR_SECRET is shorter than 8 characters".into(),
            ));
        }
        let secs = |name: &str, default: Duration| -> Result<Duration, ClusterError> {
            match get(name) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .map(Duration::from_secs_f64)
                    .ok_or_else(|| {
                        ClusterError::World(format!("{name}={v:?} is not a number of seconds > 0"))
                    }),
            }
        };
        Ok(Some(World {
            rank,
            size,
            local_rank,
            master_addr,
            master_port,
            secret,
            timeout: secs("NSACTOR_TIMEOUT_S", DEFAULT_TIMEOUT)?,
            rendezvous_timeout: secs("NSACTOR_RENDEZVOUS_TIMEOUT_S", DEFAULT_RENDEZVOUS_TIMEOUT)?,
            restart: num(&["NSACTOR_RESTART_COUNT"])?.unwrap_or(0) as u32,
        }))
    }

    /// The variables that put a child process at `rank` of this world.
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("NSACTOR_RANK", self.rank.to_string()),
            ("NSACTOR_WORLD_SIZE", self.size.to_string()),
            ("NSACTOR_LOCAL_RANK", self.local_rank.to_string()),
            ("NSACTOR_MASTER_ADDR", self.master_addr.clone()),
            ("NSACTOR_MASTER_PORT", self.master_port.to_string()),
            ("NSACTOR_SECRET", self.secret.clone()),
            ("NSACTOR_TIMEOUT_S", self.timeout.as_secs_f64().to_string()),
            (
                "NSACTOR_RENDEZVOUS_TIMEOUT_S",
                self.rendezvous_timeout.as_secs_f64().to_string(),
            ),
            ("NSACTOR_RESTART_COUNT", self.restart.to_string()),
        ]
    }

    /// `rank 1/4`.
    pub fn describe(&self) -> String {
        format!("rank {}/{}", self.rank, self.size)
    }
}

/// A fresh secret for a launcher's own children: 128 bits from the OS, in hex.
pub fn new_secret() -> Result<String, ClusterError> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| ClusterError::World(format!("no random secret (/dev/urandom: {e})")))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn world(vars: &[(&str, &str)]) -> Result<Option<World>, ClusterError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn one_process_is_no_world() {
        assert_eq!(world(&[]).unwrap(), None);
        assert_eq!(world(&[("NSACTOR_WORLD_SIZE", "1")]).unwrap(), None);
    }

    #[test]
    fn torchrun_and_slurm_variables_stand_in() {
        let w = world(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("NSACTOR_SECRET", "0123456789abcdef"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((w.rank, w.size, w.master_port), (2, 4, 1234));
        assert_eq!(w.master_addr, "10.0.0.1");
        let w = world(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
            ("NSACTOR_SECRET", "0123456789abcdef"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((w.rank, w.size, w.local_rank), (1, 2, 1));
        assert_eq!(w.master_port, DEFAULT_MASTER_PORT);
        // The launcher's variables give the same world back.
        let back: HashMap<String, String> = w
            .vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(World::from_vars(|k| back.get(k).cloned()).unwrap(), Some(w));
    }

    #[test]
    fn a_bad_world_says_what_is_wrong() {
        let err = |vars: &[(&str, &str)]| world(vars).unwrap_err().to_string();
        let s = ("NSACTOR_SECRET", "0123456789abcdef");
        assert!(err(&[("NSACTOR_WORLD_SIZE", "2"), s]).contains("NSACTOR_RANK"));
        assert!(err(&[("NSACTOR_WORLD_SIZE", "2"), ("NSACTOR_RANK", "2"), s]).contains("outside"));
        assert!(err(&[("NSACTOR_WORLD_SIZE", "two")]).contains("not a non-negative integer"));
        assert!(
            err(&[("NSACTOR_WORLD_SIZE", "2"), ("NSACTOR_RANK", "1")]).contains("NSACTOR_SECRET")
        );
        let e = err(&[
            ("NSACTOR_WORLD_SIZE", "2"),
            ("NSACTOR_RANK", "1"),
            ("NSACTOR_MASTER_PORT", "99999"),
            s,
        ]);
        assert!(e.contains("not a port"), "{e}");
        let e = err(&[
            ("NSACTOR_WORLD_SIZE", "2"),
            ("NSACTOR_RANK", "1"),
            ("NSACTOR_TIMEOUT_S", "-3"),
            s,
        ]);
        assert!(e.contains("NSACTOR_TIMEOUT_S"), "{e}");
    }

    #[test]
    fn secrets_are_fresh() {
        let (a, b) = (new_secret().unwrap(), new_secret().unwrap());
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }
}
