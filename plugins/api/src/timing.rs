//! The device-time breakdown a backend reports for
//! [`Diagnostic::TimingReport`](crate::diagnose::Diagnostic::TimingReport): how much of a
//! window of device time went to GEMMs, to the PLIF scans, to other work inside stage calls, and
//! to nothing a stage call had queued (the actors' messaging, host round trips, the
//! supervisor's work between calls).
//!
//! A backend measures spans — `[start, end]` in seconds from the window's start, one per GEMM,
//! per scan kernel and per stage call, on whichever stream ran them — and [`DeviceTime::from_spans`]
//! turns them into lengths of *unions*, so work that overlapped on two streams counts once. The
//! report is a [`DiagnosticReport::Timing`](crate::diagnose::DiagnosticReport::Timing).

/// What a measured span ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// A projection GEMM (one cuBLASLt call).
    Gemm,
    /// A PLIF scan kernel (selective, element, row, FFN or norm-fused neurons; forward or backward).
    Scan,
    /// A whole stage call, by its name (`StageCall::name`): from its first queued work to its
    /// last.
    Call(&'static str),
}

impl SpanKind {
    fn is_call(self) -> bool {
        matches!(self, SpanKind::Call(_))
    }
}

/// The total length of the union of `intervals` (each `(start, end)`, `end < start` counting as
/// empty).
pub fn union_len(intervals: &mut [(f64, f64)]) -> f64 {
    intervals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut open: Option<(f64, f64)> = None;
    for &(s, e) in intervals.iter() {
        if e <= s {
            continue;
        }
        open = match open {
            Some((os, oe)) if s <= oe => Some((os, oe.max(e))),
            Some((os, oe)) => {
                total += oe - os;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    total + open.map_or(0.0, |(s, e)| e - s)
}

/// The device time of the stage calls of one name over a window.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CallTime {
    pub name: String,
    pub calls: u64,
    /// The union of these calls' spans.
    pub seconds: f64,
    /// Of it, time some GEMM or scan ran (the rest is other kernels, copies and gaps).
    pub kernels_s: f64,
}

/// One device's breakdown over a window (seconds; lengths of unions unless named `_sum`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeviceTime {
    pub device: usize,
    /// The window: from `start` until every queued piece of work had finished.
    pub window_s: f64,
    /// Time some stage call had work queued or running.
    pub calls_s: f64,
    pub gemm_s: f64,
    pub scans_s: f64,
    /// GEMMs or scans (their union; less than their sum where they overlapped).
    pub gemm_or_scans_s: f64,
    /// Sums over spans: above the unions where streams overlapped.
    pub gemm_sum_s: f64,
    pub scans_sum_s: f64,
    pub gemms: u64,
    pub scans: u64,
    pub calls: u64,
    /// The calls by name, most time outside GEMMs and scans first.
    pub by_call: Vec<CallTime>,
}

impl DeviceTime {
    /// The breakdown of `spans` over a window of `window_s`.
    pub fn from_spans(device: usize, window_s: f64, spans: &[(SpanKind, f64, f64)]) -> Self {
        let of = |keep: &dyn Fn(SpanKind) -> bool| -> Vec<(f64, f64)> {
            spans
                .iter()
                .filter(|s| keep(s.0))
                .map(|s| (s.1, s.2))
                .collect()
        };
        let is = |k: SpanKind| move |x: SpanKind| x == k;
        let kernel = |x: SpanKind| x == SpanKind::Gemm || x == SpanKind::Scan;
        let sum = |k: SpanKind| of(&is(k)).iter().map(|(s, e)| (e - s).max(0.0)).sum();
        let count = |keep: &dyn Fn(SpanKind) -> bool| spans.iter().filter(|s| keep(s.0)).count();
        let kernels_s = union_len(&mut of(&kernel));
        let mut names: Vec<&'static str> = Vec::new();
        for (k, _, _) in spans {
            if let SpanKind::Call(n) = k
                && !names.contains(n)
            {
                names.push(n);
            }
        }
        let mut by_call: Vec<CallTime> = names
            .into_iter()
            .map(|n| {
                let this = |x: SpanKind| x == SpanKind::Call(n);
                let seconds = union_len(&mut of(&this));
                // |calls ∩ kernels| = |calls| + |kernels| − |calls ∪ kernels|.
                let both = union_len(&mut of(&|x| this(x) || kernel(x)));
                CallTime {
                    name: n.to_string(),
                    calls: count(&this) as u64,
                    seconds,
                    kernels_s: (seconds + kernels_s - both).max(0.0),
                }
            })
            .collect();
        by_call.sort_by(|a, b| (b.seconds - b.kernels_s).total_cmp(&(a.seconds - a.kernels_s)));
        DeviceTime {
            device,
            window_s,
            calls_s: union_len(&mut of(&SpanKind::is_call)),
            gemm_s: union_len(&mut of(&is(SpanKind::Gemm))),
            scans_s: union_len(&mut of(&is(SpanKind::Scan))),
            gemm_or_scans_s: kernels_s,
            gemm_sum_s: sum(SpanKind::Gemm),
            scans_sum_s: sum(SpanKind::Scan),
            gemms: count(&is(SpanKind::Gemm)) as u64,
            scans: count(&is(SpanKind::Scan)) as u64,
            calls: count(&SpanKind::is_call) as u64,
            by_call,
        }
    }

    /// Time inside stage calls that was neither a GEMM nor a scan: other kernels, copies, and
    /// gaps while a call's host side had not queued its next work yet.
    pub fn other_s(&self) -> f64 {
        (self.calls_s - self.gemm_or_scans_s).max(0.0)
    }

    /// Time no stage call had work on the device: the actors' messaging, host round trips and
    /// the runtime's own work between calls.
    pub fn outside_calls_s(&self) -> f64 {
        (self.window_s - self.calls_s).max(0.0)
    }

    /// Adds `o`'s times and counts (the same device over another window).
    pub fn add(&mut self, o: &DeviceTime) {
        self.window_s += o.window_s;
        self.calls_s += o.calls_s;
        self.gemm_s += o.gemm_s;
        self.scans_s += o.scans_s;
        self.gemm_or_scans_s += o.gemm_or_scans_s;
        self.gemm_sum_s += o.gemm_sum_s;
        self.scans_sum_s += o.scans_sum_s;
        self.gemms += o.gemms;
        self.scans += o.scans;
        self.calls += o.calls;
        for c in &o.by_call {
            match self.by_call.iter_mut().find(|x| x.name == c.name) {
                Some(x) => {
                    x.calls += c.calls;
                    x.seconds += c.seconds;
                    x.kernels_s += c.kernels_s;
                }
                None => self.by_call.push(c.clone()),
            }
        }
    }

    /// Multiplies every time and count by `f` (counts rounded): `add` over n windows, then
    /// `scale(1/n)`, is their mean.
    pub fn scale(&mut self, f: f64) {
        for t in [
            &mut self.window_s,
            &mut self.calls_s,
            &mut self.gemm_s,
            &mut self.scans_s,
            &mut self.gemm_or_scans_s,
            &mut self.gemm_sum_s,
            &mut self.scans_sum_s,
        ] {
            *t *= f;
        }
        for c in [&mut self.gemms, &mut self.scans, &mut self.calls] {
            *c = (*c as f64 * f).round() as u64;
        }
        for c in &mut self.by_call {
            c.seconds *= f;
            c.kernels_s *= f;
            c.calls = (c.calls as f64 * f).round() as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_counts_overlapping_intervals_once_and_skips_empty_ones() {
        let mut v = vec![(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 3.0), (2.5, 2.75)];
        assert_eq!(union_len(&mut v), 4.0);
        assert_eq!(union_len(&mut []), 0.0);
        // Touching intervals merge; a reversed one is empty.
        assert_eq!(union_len(&mut [(0.0, 1.0), (1.0, 2.0), (4.0, 3.0)]), 2.0);
    }

    #[test]
    fn breakdown_of_two_overlapping_streams() {
        use SpanKind::*;
        // Stream 1: a call [0, 10] with a GEMM [1, 4] and a scan [5, 7].
        // Stream 2: a call [8, 12] with a GEMM [8, 11] (overlaps the first call's tail).
        let spans = [
            (Call("Forward"), 0.0, 10.0),
            (Gemm, 1.0, 4.0),
            (Scan, 5.0, 7.0),
            (Call("Step"), 8.0, 12.0),
            (Gemm, 8.0, 11.0),
        ];
        let t = DeviceTime::from_spans(3, 20.0, &spans);
        assert_eq!(t.calls_s, 12.0);
        assert_eq!(t.gemm_s, 6.0);
        assert_eq!(t.gemm_sum_s, 6.0);
        assert_eq!(t.scans_s, 2.0);
        assert_eq!(t.gemm_or_scans_s, 8.0);
        assert_eq!(t.other_s(), 4.0);
        assert_eq!(t.outside_calls_s(), 8.0);
        assert_eq!((t.gemms, t.scans, t.calls), (2, 1, 2));
        // By name, most time outside kernels first: Forward [0, 10] holds 3 + 2 + 2 (the
        // second GEMM's [8, 10]) of kernels; Step [8, 12] holds 3.
        let names: Vec<_> = t.by_call.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["Forward", "Step"]);
        assert_eq!((t.by_call[0].seconds, t.by_call[0].kernels_s), (10.0, 7.0));
        assert_eq!((t.by_call[1].seconds, t.by_call[1].kernels_s), (4.0, 3.0));
        // Overlapping GEMMs on two streams: the union is less than the sum.
        let t = DeviceTime::from_spans(0, 4.0, &[(Gemm, 0.0, 2.0), (Gemm, 1.0, 3.0)]);
        assert_eq!((t.gemm_s, t.gemm_sum_s), (3.0, 4.0));
    }
}
