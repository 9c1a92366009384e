//! Cohort sizes in buckets: the batcher pads a cohort of `n` sessions up to the smallest
//! bucket that holds it, with **pad sessions** fed token 0 whose answers are dropped.
//!
//! A GPU backend pays once per new batch shape (kernel compilation, GEMM plans, pool growth);
//! with buckets a server meets only a handful of shapes, all of which it runs before it says
//! it is ready ([`warmup`](super::warmup)). The decoding GEMMs are batch-invariant
//! (`nsactor_kernels::decoding_gemms`) and every other kernel of a pass works row by row, so a
//! real session's logits are the same whether its cohort was padded or not (the CPU test
//! `actors/runtime/tests/invariance.rs` checks it bit for bit).
//!
//! The default ladder is of vLLM's kind: 1, 2, 3, 4, then steps of 4 up to 16, of 8 up to 64,
//! of 16 up to 256 and of 64 beyond — at most 3/8 of a pass is padding, and under 1/5 from 64 sessions on.

use nsactor_plugin_api::SessionId;
use std::fmt;

/// Pad sessions take the ids from here down (a session allocator never gets near them).
const PAD_BASE: u64 = u64::MAX;

/// The id of pad session `i` (0-based).
pub fn pad_session(i: usize) -> SessionId {
    SessionId(PAD_BASE - i as u64)
}

/// The cohort sizes a batcher runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CohortBuckets {
    /// Every cohort runs at its own size (no padding).
    Exact,
    /// Cohorts are padded up to the smallest of these sizes (ascending) that holds them; a
    /// cohort larger than the largest runs at its own size.
    Sizes(Vec<usize>),
}

impl Default for CohortBuckets {
    fn default() -> Self {
        CohortBuckets::ladder(4096)
    }
}

impl CohortBuckets {
    /// The default ladder up to `max` sessions (module docs), `max` included.
    pub fn ladder(max: usize) -> Self {
        let max = max.max(1);
        let mut sizes = Vec::new();
        let mut n = 1;
        while n < max {
            sizes.push(n);
            n += match n {
                ..4 => 1,
                4..16 => 4,
                16..64 => 8,
                64..256 => 16,
                _ => 64,
            };
        }
        sizes.push(max);
        CohortBuckets::Sizes(sizes)
    }

    /// Parses `exact`, `ladder` (the default ladder up to `max`) or a comma-separated list of
    /// sizes.
    pub fn parse(s: &str, max: usize) -> Result<Self, String> {
        match s.trim() {
            "exact" => Ok(CohortBuckets::Exact),
            "ladder" => Ok(CohortBuckets::ladder(max)),
            list => {
                let mut sizes = list
                    .split(',')
                    .map(|v| match v.trim().parse::<usize>() {
                        Ok(n) if n > 0 => Ok(n),
                        _ => Err(format!(
                            "cohort buckets: `{v}` is not a size ≥ 1 (expected `exact`, `ladder` or sizes like `1,2,4,8`)"
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                sizes.sort_unstable();
                sizes.dedup();
                Ok(CohortBuckets::Sizes(sizes))
            }
        }
    }

    /// The ladder cut at `max` sessions (with `max` itself as the last size), or `self` when
    /// exact.
    pub fn up_to(&self, max: usize) -> Self {
        match self {
            CohortBuckets::Exact => CohortBuckets::Exact,
            CohortBuckets::Sizes(s) => {
                let mut sizes: Vec<usize> = s.iter().copied().filter(|&n| n < max).collect();
                sizes.push(max.max(1));
                CohortBuckets::Sizes(sizes)
            }
        }
    }

    /// The sizes (empty when exact).
    pub fn sizes(&self) -> &[usize] {
        match self {
            CohortBuckets::Exact => &[],
            CohortBuckets::Sizes(s) => s,
        }
    }

    /// The size a cohort of `n` sessions with `len` inputs each runs at, when a pass holds at
    /// most `max_tokens` inputs: its bucket, cut to what fits, and never less than `n`.
    pub fn size_for(&self, n: usize, len: usize, max_tokens: usize) -> usize {
        let bucket = match self {
            CohortBuckets::Exact => n,
            CohortBuckets::Sizes(s) => s.iter().copied().find(|&b| b >= n).unwrap_or(n),
        };
        let fits = (max_tokens / len.max(1)).max(1);
        bucket.min(fits).max(n)
    }
}

impl fmt::Display for CohortBuckets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CohortBuckets::Exact => write!(f, "exact"),
            CohortBuckets::Sizes(s) => {
                let s: Vec<String> = s.iter().map(usize::to_string).collect();
                write!(f, "{}", s.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ladder_pads_little_and_ends_at_its_max() {
        let CohortBuckets::Sizes(s) = CohortBuckets::ladder(256) else {
            unreachable!()
        };
        assert_eq!(&s[..8], &[1, 2, 3, 4, 8, 12, 16, 24]);
        assert_eq!(*s.last().unwrap(), 256);
        assert!(s.windows(2).all(|w| w[0] < w[1]), "{s:?}");
        for n in 1..=256usize {
            let b = CohortBuckets::Sizes(s.clone()).size_for(n, 1, 4096);
            assert!(b >= n && s.contains(&b), "{n} -> {b}");
            assert!((b - n) * 8 <= 3 * b, "{n} -> {b}: more than 3/8 padding");
            if n >= 64 {
                assert!((b - n) * 5 < b, "{n} -> {b}: 1/5 padding or more");
            }
        }
        assert_eq!(s.len(), 25, "{s:?}");
    }

    #[test]
    fn a_bucket_never_takes_more_inputs_than_a_pass_holds() {
        let b = CohortBuckets::ladder(256);
        // 5 sessions of 40 tokens: the bucket (8) would be 320 tokens; 6 fit in 256.
        assert_eq!(b.size_for(5, 40, 256), 6);
        // Too long for even one more session: its own size.
        assert_eq!(b.size_for(3, 80, 256), 3);
        assert_eq!(b.size_for(300, 1, 4096), 300, "past the largest bucket");
        assert_eq!(CohortBuckets::Exact.size_for(5, 1, 256), 5);
    }

    #[test]
    fn buckets_parse_from_words_and_lists() {
        assert_eq!(
            CohortBuckets::parse("exact", 64).unwrap(),
            CohortBuckets::Exact
        );
        assert_eq!(
            CohortBuckets::parse("ladder", 64).unwrap(),
            CohortBuckets::ladder(64)
        );
        assert_eq!(
            CohortBuckets::parse(" 8, 2,2 ,4", 64).unwrap().sizes(),
            &[2, 4, 8]
        );
        let e = CohortBuckets::parse("1,x", 64).unwrap_err();
        assert!(e.contains("`x`") && e.contains("exact"), "{e}");
        assert!(CohortBuckets::parse("0", 64).is_err());
        assert_eq!(
            CohortBuckets::ladder(64).up_to(10).sizes(),
            &[1, 2, 3, 4, 8, 10]
        );
        assert_eq!(
            CohortBuckets::ladder(64).to_string(),
            "1,2,3,4,8,12,16,24,32,40,48,56,64"
        );
    }

    #[test]
    fn pad_sessions_are_told_apart() {
        assert_ne!(pad_session(0), pad_session(1));
        assert!(
            pad_session(4095).0 > 1 << 62,
            "far above any allocated session id"
        );
    }
}
