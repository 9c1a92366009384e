//! Where a run's start goes: the phases from the process's start to the end of its first
//! step (tokenizer and data, the backend, the stages, a resume, the step-0 evaluation, the
//! step itself), timed one after another and logged once as a line and a `startup` event, so
//! a slow start says what it waited for. The end of a run is timed the same way.

use std::time::Instant;

/// Phases timed back to back from [`Startup::new`].
#[derive(Debug, Clone)]
pub struct Startup {
    origin: Instant,
    last: Instant,
    phases: Vec<(&'static str, f64)>,
}

impl Default for Startup {
    fn default() -> Self {
        Self::new()
    }
}

impl Startup {
    /// Starts the clock (call it first thing).
    pub fn new() -> Self {
        let now = Instant::now();
        Startup {
            origin: now,
            last: now,
            phases: Vec::new(),
        }
    }

    /// Ends phase `name` now: its time is from the previous mark (or the start) to here.
    pub fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.phases
            .push((name, now.duration_since(self.last).as_secs_f64()));
        self.last = now;
    }

    /// When the clock started.
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// Seconds from the start to the last mark.
    pub fn total(&self) -> f64 {
        self.last.duration_since(self.origin).as_secs_f64()
    }

    /// The phases in order, with their seconds.
    pub fn phases(&self) -> &[(&'static str, f64)] {
        &self.phases
    }

    /// `"first step 7.9 s after the start: tokenizer and data 0.31 s, …"`.
    pub fn line(&self) -> String {
        format!(
            "first step {:.1} s after the start: {}",
            self.total(),
            self.phases_line()
        )
    }

    /// `"7.9 s: tokenizer and data 0.31 s, …"`: the total, then every phase.
    pub fn phases_line(&self) -> String {
        let parts: Vec<String> = self
            .phases
            .iter()
            .map(|(n, s)| format!("{n} {s:.2} s"))
            .collect();
        format!("{:.2} s: {}", self.total(), parts.join(", "))
    }

    /// The `metrics.jsonl` record: the total and every phase by name.
    pub fn event(&self) -> serde_json::Value {
        self.event_named("startup")
    }

    /// [`event`](Self::event) under another event name (the end of a run's is `end`).
    pub fn event_named(&self, event: &str) -> serde_json::Value {
        let phases: serde_json::Map<String, serde_json::Value> = self
            .phases
            .iter()
            .map(|(n, s)| (n.to_string(), serde_json::json!(s)))
            .collect();
        serde_json::json!({"event": event, "seconds": self.total(), "phases": phases})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_add_up_to_the_total_and_name_themselves() {
        let mut s = Startup::new();
        std::thread::sleep(std::time::Duration::from_millis(20));
        s.mark("a");
        std::thread::sleep(std::time::Duration::from_millis(30));
        s.mark("b");
        let sum: f64 = s.phases().iter().map(|p| p.1).sum();
        assert!((sum - s.total()).abs() < 1e-9, "{sum} vs {}", s.total());
        assert!(s.phases()[0].1 >= 0.02 && s.phases()[1].1 >= 0.03);
        assert!(s.line().starts_with("first step 0.") && s.line().contains("a 0.0"));
        assert!(s.phases_line().contains(", b 0.0"));
        let e = s.event();
        assert_eq!(e["event"], "startup");
        assert_eq!(s.event_named("end")["event"], "end");
        assert!(e["phases"]["b"].as_f64().unwrap() >= 0.03);
    }
}
