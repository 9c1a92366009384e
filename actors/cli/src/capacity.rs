//! `serve --max-sessions auto` (the default): how many sessions decode at once, sized from the
//! device the model landed on, and the reason, for the log.
//!
//! A session's whole state is its neurons' membranes (~1.15 MB at 0.9B whatever its context),
//! so on a GPU memory almost never binds: the limit is the batcher's largest cohort
//! ([`MAX_BATCH`]). More sessions than that would run as several cohorts a step, adding
//! latency to every client and no throughput (on an H200, 512 sessions made 15.2k tokens/s
//! against 15.1k at 256, BENCHMARKS.md). Where the device's free memory after the weights,
//! a prompt's pass and the prefix cache cannot hold that many states, fewer. A backend that
//! reports no device memory (the CPU) keeps [`CPU_SESSIONS`], where a step's cost grows with
//! its cohort and more would only slow everyone.

use nsactor_decoding::batcher::MAX_BATCH;
use nsactor_plugin_api::{ComputeBackend, Diagnostic, DiagnosticReport, ModelConfig};

/// `--max-sessions`: `auto` or a number of sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxSessions {
    Auto,
    Fixed(usize),
}

impl std::str::FromStr for MaxSessions {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(MaxSessions::Auto),
            n => match n.parse::<usize>() {
                Ok(0) => Err("at least 1 session (or `auto`)".into()),
                Ok(n) => Ok(MaxSessions::Fixed(n)),
                Err(_) => Err(format!("`{n}` is neither `auto` nor a number of sessions")),
            },
        }
    }
}

/// Sessions at once where the backend reports no device memory (the CPU).
pub const CPU_SESSIONS: usize = 64;

/// Device memory kept for the passes themselves: a prompt's pass of 16,384 frame rows holds
/// ~13 GiB of activations on the GPU (`serve --max-num-batched-tokens`).
const PASS_RESERVE: u64 = 14 << 30;

/// Each session is counted at this many copies of its state: its own, a pass's gathered copy
/// and its outputs, and a snapshot of it.
const COPIES: u64 = 4;

/// One device's memory as the backend reports it: `(used, total)` bytes.
pub type Memory = (u64, u64);

/// The sessions at once for `setting`, and why (for the log).
pub fn sessions(
    setting: MaxSessions,
    devices: Option<&[Memory]>,
    model: &ModelConfig,
    prefix_cache_bytes: u64,
) -> (usize, String) {
    if let MaxSessions::Fixed(n) = setting {
        return (n, "as --max-sessions asked".into());
    }
    let Some(devices) = devices.filter(|d| !d.is_empty()) else {
        return (
            CPU_SESSIONS,
            "auto: the backend reports no device memory (the CPU)".into(),
        );
    };
    let state = state_bytes(model);
    // The tightest device holds a whole session's state (conservative for a pipeline).
    let free = devices
        .iter()
        .map(|&(used, total)| total.saturating_sub(used))
        .min()
        .unwrap_or(0);
    let room = free.saturating_sub(PASS_RESERVE + prefix_cache_bytes);
    let by_memory = (room / (COPIES * state).max(1)) as usize;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if by_memory >= MAX_BATCH {
        (
            MAX_BATCH,
            format!(
                "auto: the batcher's largest cohort; {:.1} GiB free on the device, a session's state {:.2} MiB",
                gib(free),
                mib(state)
            ),
        )
    } else {
        (
            by_memory.max(1),
            format!(
                "auto: {:.1} GiB free on the device, less {:.1} GiB for passes and the prefix cache, holds {by_memory} sessions of {:.2} MiB ({COPIES} copies each)",
                gib(free),
                gib(PASS_RESERVE + prefix_cache_bytes),
                mib(state)
            ),
        )
    }
}

/// Bytes of one session's state, in f32 ([`ModelConfig::session_state_values`]).
pub fn state_bytes(m: &ModelConfig) -> u64 {
    (m.session_state_values() * 4) as u64
}

/// Each device's memory as `backend` reports it, or `None` where it reports none (the CPU).
pub fn device_memory(backend: &dyn ComputeBackend) -> Option<Vec<Memory>> {
    match backend.diagnose(&Diagnostic::Memory) {
        Ok(DiagnosticReport::Memory(d)) => {
            Some(d.iter().map(|m| (m.used_bytes, m.total_bytes)).collect())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_parses_and_refuses_nonsense() {
        assert_eq!("auto".parse(), Ok(MaxSessions::Auto));
        assert_eq!("64".parse(), Ok(MaxSessions::Fixed(64)));
        assert!(
            "0".parse::<MaxSessions>()
                .unwrap_err()
                .contains("at least 1")
        );
        assert!(
            "lots"
                .parse::<MaxSessions>()
                .unwrap_err()
                .contains("`lots`")
        );
    }

    #[test]
    fn a_session_of_the_released_model_holds_about_1_15_mb() {
        assert_eq!(state_bytes(&ModelConfig::neuronspark_0_9b()), 1_150_464);
    }

    #[test]
    fn sized_from_the_device() {
        let m = ModelConfig::neuronspark_0_9b();
        let gib = 1u64 << 30;
        let cache = 2 * gib;
        // A number is kept as given, on any device.
        let fixed = sessions(MaxSessions::Fixed(17), None, &m, cache);
        assert_eq!(fixed.0, 17);
        // The CPU.
        assert_eq!(sessions(MaxSessions::Auto, None, &m, cache).0, CPU_SESSIONS);
        assert_eq!(
            sessions(MaxSessions::Auto, Some(&[]), &m, cache).0,
            CPU_SESSIONS
        );
        // An H200 after the weights: the largest cohort.
        let (n, why) = sessions(MaxSessions::Auto, Some(&[(12 * gib, 140 * gib)]), &m, cache);
        assert_eq!(n, MAX_BATCH);
        assert!(why.contains("largest cohort"), "{why}");
        // A nearly full card: what the rest holds, at least one; the tightest device counts.
        let state = state_bytes(&m);
        let tight = 14 * gib + cache + 100 * COPIES * state + 5;
        let (n, why) = sessions(
            MaxSessions::Auto,
            Some(&[(0, 140 * gib), (0, tight)]),
            &m,
            cache,
        );
        assert_eq!(n, 100, "{why}");
        let (n, _) = sessions(
            MaxSessions::Auto,
            Some(&[(139 * gib, 140 * gib)]),
            &m,
            cache,
        );
        assert_eq!(n, 1);
    }
}
