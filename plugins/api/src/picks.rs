//! What [`StageCall::SessionSample`](crate::StageCall::SessionSample) carries: how each batch row
//! chooses its next token on the device (greedy or sampled with temperature, top-k, min-p, top-p, the
//! repetition, presence and frequency penalties, logit biases and banned tokens), as one flat
//! block of floats and one of integers, so the C boundary moves two slices and both sides read
//! them through this one codec.
//!
//! The random draw of a sampled row is a Gumbel-max draw keyed by the row's seed and its step
//! ([`row_key`]): a session's tokens depend on its own seed and position only, never on which
//! other sessions share its cohort.

/// One row's sampling settings (the scalars of [`RowPick`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PickParams {
    /// 0 picks the most likely token; otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    pub top_k: u32,
    /// Keep the smallest set of most likely tokens whose probability reaches p (1: all).
    pub top_p: f32,
    /// Keep only tokens at least this fraction as likely as the most likely one (0: all).
    pub min_p: f32,
    /// CTRL's penalty on tokens of `history` (1: off).
    pub repetition_penalty: f32,
    /// Subtracted once from every token of `generated` (0: off).
    pub presence_penalty: f32,
    /// Subtracted once per occurrence in `generated` (0: off).
    pub frequency_penalty: f32,
    /// The row's seed and how many tokens it has drawn before: the key of its draw.
    pub seed: u64,
    pub step: u64,
    /// The row's logits also go to the host (for log-probabilities beyond the chosen token's).
    pub want_logits: bool,
}

/// One row of a [`Picks`] block.
#[derive(Debug, Clone, PartialEq)]
pub struct RowPick<'a> {
    pub params: PickParams,
    /// Prompt and generated tokens (the repetition penalty's set).
    pub history: &'a [i64],
    /// Generated tokens only (the presence and frequency penalties count them).
    pub generated: &'a [i64],
    /// Added to a token's logit before anything else; `-inf` bans the token.
    pub bias: &'a [(u32, f32)],
}

/// Floats per row at the head of [`Picks::floats`].
const FLOATS: usize = 8;
/// Integers per row at the head of [`Picks::ints`]: four 16-bit round keys and three lengths.
const INTS: usize = 7;

/// Rows of picks, borrowed: what the call carries.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Picks<'a> {
    /// Per row `[temperature, top_k, top_p, repetition, presence, frequency, want_logits,
    /// min_p]`,
    /// then every row's bias values in row order.
    pub floats: &'a [f32],
    /// Per row `[key0, key1, key2, key3, n_history, n_generated, n_bias]`, then every row's
    /// history, generated tokens and biased token ids, in row order.
    pub ints: &'a [i64],
    pub rows: usize,
}

/// One row as the device reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct PickRow<'a> {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub want_logits: bool,
    /// Four 16-bit round keys of the row's draw.
    pub keys: [u16; 4],
    pub history: &'a [i64],
    pub generated: &'a [i64],
    pub bias_ids: &'a [i64],
    pub bias: &'a [f32],
}

/// The owned block a host builds row by row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PicksBuf {
    head_f: Vec<f32>,
    head_i: Vec<i64>,
    tail_f: Vec<f32>,
    tail_i: Vec<i64>,
    floats: Vec<f32>,
    ints: Vec<i64>,
    rows: usize,
}

/// The four 16-bit round keys of a draw with `seed` at `step` (SplitMix64 of both).
pub fn row_key(seed: u64, step: u64) -> [u16; 4] {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let k = mix(seed ^ mix(step));
    [
        k as u16,
        (k >> 16) as u16,
        (k >> 32) as u16,
        (k >> 48) as u16,
    ]
}

impl PicksBuf {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a row.
    pub fn push(&mut self, row: &RowPick<'_>) {
        let p = row.params;
        self.head_f.extend_from_slice(&[
            p.temperature,
            p.top_k as f32,
            p.top_p,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
            if p.want_logits { 1.0 } else { 0.0 },
            p.min_p,
        ]);
        let keys = row_key(p.seed, p.step);
        self.head_i.extend(keys.iter().map(|&k| k as i64));
        self.head_i.extend_from_slice(&[
            row.history.len() as i64,
            row.generated.len() as i64,
            row.bias.len() as i64,
        ]);
        self.tail_i.extend_from_slice(row.history);
        self.tail_i.extend_from_slice(row.generated);
        self.tail_i.extend(row.bias.iter().map(|&(t, _)| t as i64));
        self.tail_f.extend(row.bias.iter().map(|&(_, b)| b));
        self.rows += 1;
    }

    /// The block as the call carries it.
    pub fn picks(&mut self) -> Picks<'_> {
        self.floats = [self.head_f.as_slice(), &self.tail_f].concat();
        self.ints = [self.head_i.as_slice(), &self.tail_i].concat();
        Picks {
            floats: &self.floats,
            ints: &self.ints,
            rows: self.rows,
        }
    }
}

impl<'a> Picks<'a> {
    /// Every row, checked against the block's lengths and the vocabulary.
    pub fn parse(&self, vocab: usize) -> Result<Vec<PickRow<'a>>, String> {
        let n = self.rows;
        let (floats, ints) = (self.floats, self.ints);
        if floats.len() < n * FLOATS || ints.len() < n * INTS {
            return Err(format!(
                "{n} rows need at least {} floats and {} integers, got {} and {}",
                n * FLOATS,
                n * INTS,
                floats.len(),
                ints.len()
            ));
        }
        let (mut fi, mut ii) = (n * FLOATS, n * INTS);
        let mut rows = Vec::with_capacity(n);
        for r in 0..n {
            let f = &floats[r * FLOATS..(r + 1) * FLOATS];
            let h = &ints[r * INTS..(r + 1) * INTS];
            let len = |x: i64| usize::try_from(x).map_err(|_| format!("row {r}: length {x}"));
            let (nh, ng, nb) = (len(h[4])?, len(h[5])?, len(h[6])?);
            let mut take = |k: usize| {
                let s = ints
                    .get(ii..ii + k)
                    .ok_or_else(|| format!("row {r}: its token lists run past the block"))?;
                ii += k;
                Ok::<_, String>(s)
            };
            let (history, generated, bias_ids) = (take(nh)?, take(ng)?, take(nb)?);
            let bias = floats
                .get(fi..fi + nb)
                .ok_or_else(|| format!("row {r}: its biases run past the block"))?;
            fi += nb;
            if let Some(t) = [history, generated, bias_ids]
                .iter()
                .flat_map(|s| s.iter())
                .find(|&&t| t < 0 || t as usize >= vocab)
            {
                return Err(format!(
                    "row {r}: token {t} outside the vocabulary of {vocab}"
                ));
            }
            let key = |x: i64| u16::try_from(x).map_err(|_| format!("row {r}: key {x}"));
            let row = PickRow {
                temperature: f[0],
                top_k: f[1] as u32,
                top_p: f[2],
                repetition_penalty: f[3],
                presence_penalty: f[4],
                frequency_penalty: f[5],
                want_logits: f[6] != 0.0,
                min_p: f[7],
                keys: [key(h[0])?, key(h[1])?, key(h[2])?, key(h[3])?],
                history,
                generated,
                bias_ids,
                bias,
            };
            let ok = row.temperature.is_finite()
                && row.temperature >= 0.0
                && row.top_p > 0.0
                && row.top_p <= 1.0
                && (0.0..=1.0).contains(&row.min_p)
                && row.repetition_penalty.is_finite()
                && row.repetition_penalty > 0.0
                && row.presence_penalty.is_finite()
                && row.frequency_penalty.is_finite();
            if !ok {
                return Err(format!("row {r}: sampling settings out of range: {row:?}"));
            }
            rows.push(row);
        }
        if fi != floats.len() || ii != ints.len() {
            return Err(format!(
                "{} floats and {} integers left over after {n} rows",
                floats.len() - fi,
                ints.len() - ii
            ));
        }
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(seed: u64) -> PickParams {
        PickParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            presence_penalty: 0.2,
            frequency_penalty: -0.1,
            seed,
            step: 3,
            want_logits: seed == 1,
        }
    }

    #[test]
    fn rows_round_trip_through_the_flat_block() {
        let mut buf = PicksBuf::new();
        buf.push(&RowPick {
            params: params(1),
            history: &[5, 6, 7],
            generated: &[7],
            bias: &[(3, -f32::INFINITY), (9, 2.5)],
        });
        buf.push(&RowPick {
            params: params(2),
            history: &[],
            generated: &[],
            bias: &[],
        });
        let picks = buf.picks();
        let rows = picks.parse(10).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].history, [5, 6, 7]);
        assert_eq!(rows[0].generated, [7]);
        assert_eq!(rows[0].bias_ids, [3, 9]);
        assert_eq!(rows[0].bias, [-f32::INFINITY, 2.5]);
        assert!(rows[0].want_logits && !rows[1].want_logits);
        assert_eq!(
            (rows[1].top_k, rows[1].top_p, rows[1].min_p),
            (40, 0.9, 0.05)
        );
        assert_eq!(rows[0].keys, row_key(1, 3));
        assert_ne!(rows[0].keys, rows[1].keys);
        // A token outside the vocabulary and a truncated block are refused.
        assert!(
            picks
                .parse(7)
                .unwrap_err()
                .contains("outside the vocabulary")
        );
        let short = Picks {
            ints: &picks.ints[..picks.ints.len() - 1],
            ..picks
        };
        assert!(short.parse(10).is_err());
    }

    #[test]
    fn draw_keys_differ_by_seed_and_step() {
        assert_ne!(row_key(1, 0), row_key(1, 1));
        assert_ne!(row_key(1, 0), row_key(2, 0));
        assert_eq!(row_key(5, 9), row_key(5, 9));
    }
}
