//! Seeded, shuffling, multi-epoch batch sampler with a resumable cursor.
//!
//! A [`Sampler`] draws rows from a [`RowSource`] in the order of a per-epoch permutation (a
//! Fisher–Yates shuffle driven by SplitMix64 from `(seed, epoch)`), so the stream of batches is
//! a pure function of the data, the seed and the [`Cursor`]: saving the cursor and resuming from
//! it yields exactly the batches an uninterrupted run would.

use crate::error::{DataError, Result};
use crate::sample::{self, Row};
use nsactor_plugin_api::Batch;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::Arc;

/// Tokenized documents, each stored as `BOS ids… EOS`, concatenated into one stream.
pub trait TokenSource: Send + Sync {
    /// Length of the stream.
    fn total_tokens(&self) -> u64;
    fn documents(&self) -> u64;
    /// Stream range of document `d` (`BOS` … `EOS` inclusive).
    fn document(&self, d: u64) -> Range<u64>;
    /// Appends the ids of `range` (within the stream) to `out`.
    fn read(&self, range: Range<u64>, out: &mut Vec<i64>);
}

/// An in-memory [`TokenSource`] (the bundled corpus, `--corpus` files).
#[derive(Debug, Clone, Default)]
pub struct MemTokens {
    pub tokens: Vec<u32>,
    /// Start of each document in `tokens`, ascending.
    pub doc_starts: Vec<u64>,
}

impl MemTokens {
    /// Appends one document as `bos ids… eos`.
    pub fn push(&mut self, bos: u32, ids: &[u32], eos: u32) {
        self.doc_starts.push(self.tokens.len() as u64);
        self.tokens.push(bos);
        self.tokens.extend_from_slice(ids);
        self.tokens.push(eos);
    }
}

impl TokenSource for MemTokens {
    fn total_tokens(&self) -> u64 {
        self.tokens.len() as u64
    }
    fn documents(&self) -> u64 {
        self.doc_starts.len() as u64
    }
    fn document(&self, d: u64) -> Range<u64> {
        let d = d as usize;
        let end = self
            .doc_starts
            .get(d + 1)
            .copied()
            .unwrap_or(self.tokens.len() as u64);
        self.doc_starts[d]..end
    }
    fn read(&self, r: Range<u64>, out: &mut Vec<i64>) {
        out.extend(
            self.tokens[r.start as usize..r.end as usize]
                .iter()
                .map(|&t| i64::from(t)),
        );
    }
}

/// Rows a sampler can draw, by index.
pub trait RowSource: Send + Sync {
    /// Rows per epoch.
    fn rows(&self) -> u64;
    /// Row `i` (`0 ≤ i < rows()`), `ctx` ids long.
    fn row(&self, i: u64) -> Row;
    /// `seq_len + 1`.
    fn ctx(&self) -> usize;
}

/// How pretraining rows are cut from documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// Windows over the concatenated stream (`BOS doc EOS BOS doc EOS …`), stride `seq_len`, so
    /// every id but the first is a target exactly once per epoch and nothing is padding.
    Packed,
    /// The reference: one document per row, `BOS + text` truncated and padded with 0 (SPEC §8).
    Padded,
}

/// Packed windows over a token stream.
pub struct PackedRows {
    source: Arc<dyn TokenSource>,
    ctx: usize,
}

impl RowSource for PackedRows {
    fn rows(&self) -> u64 {
        let n = self.source.total_tokens();
        let stride = (self.ctx - 1) as u64;
        if n < self.ctx as u64 {
            0
        } else {
            (n - 1) / stride
        }
    }
    fn row(&self, i: u64) -> Row {
        let start = i * (self.ctx - 1) as u64;
        let mut ids = Vec::with_capacity(self.ctx);
        self.source.read(start..start + self.ctx as u64, &mut ids);
        sample::packed_row(&ids)
    }
    fn ctx(&self) -> usize {
        self.ctx
    }
}

/// One reference row per document.
pub struct PaddedRows {
    source: Arc<dyn TokenSource>,
    ctx: usize,
}

impl RowSource for PaddedRows {
    fn rows(&self) -> u64 {
        self.source.documents()
    }
    fn row(&self, i: u64) -> Row {
        let r = self.source.document(i);
        // Drop the stored EOS: the reference appends none. Read at most `ctx` ids.
        let end = (r.end - 1).min(r.start + self.ctx as u64);
        let mut ids = Vec::with_capacity(self.ctx);
        self.source.read(r.start..end, &mut ids);
        sample::padded_row(&ids, self.ctx)
    }
    fn ctx(&self) -> usize {
        self.ctx
    }
}

/// Prebuilt rows (SFT conversations).
pub struct MemRows {
    rows: Vec<Row>,
    ctx: usize,
}

impl MemRows {
    pub fn new(rows: Vec<Row>, ctx: usize) -> Self {
        assert!(
            rows.iter()
                .all(|r| r.ids.len() == ctx && r.mask.len() == ctx)
        );
        MemRows { rows, ctx }
    }
}

impl RowSource for MemRows {
    fn rows(&self) -> u64 {
        self.rows.len() as u64
    }
    fn row(&self, i: u64) -> Row {
        self.rows[i as usize].clone()
    }
    fn ctx(&self) -> usize {
        self.ctx
    }
}

/// One side of a held-out split of another source: the rows `held` (sorted, distinct), or
/// every other row.
struct Split {
    inner: Arc<dyn RowSource>,
    held: Arc<Vec<u64>>,
    /// The held rows (true) or the rest (false).
    side: bool,
}

impl Split {
    /// The index in `inner` of this side's row `i`.
    fn source_row(&self, i: u64) -> u64 {
        if self.side {
            return self.held[i as usize];
        }
        // The i-th row not held: i plus the held rows at or before it (a fixed point).
        let mut r = i;
        loop {
            let before = self.held.partition_point(|&h| h <= r) as u64;
            if i + before == r {
                return r;
            }
            r = i + before;
        }
    }
}

impl RowSource for Split {
    fn rows(&self) -> u64 {
        let held = self.held.len() as u64;
        if self.side {
            held
        } else {
            self.inner.rows() - held
        }
    }
    fn row(&self, i: u64) -> Row {
        self.inner.row(self.source_row(i))
    }
    fn ctx(&self) -> usize {
        self.inner.ctx()
    }
}

/// `k` row indices spread evenly over `0..n` (`k ≤ n`): the middle row of each of `k` equal
/// stretches, so a held-out set samples the whole corpus, not its last document.
pub fn spread(k: u64, n: u64) -> Vec<u64> {
    (0..k)
        .map(|i| ((2 * i + 1) as u128 * n as u128 / (2 * k as u128)) as u64)
        .collect()
}

/// Where a sampler stands: the next row is `permutation(epoch)[position]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Cursor {
    pub epoch: u64,
    pub position: u64,
}

/// The seeded batch sampler.
pub struct Sampler {
    rows: Box<dyn RowSource>,
    seed: u64,
    cursor: Cursor,
    /// Permutation of the cursor's epoch.
    order: Vec<u64>,
}

impl Sampler {
    /// A sampler over `rows`; fails when there is not one full row.
    pub fn new(rows: Box<dyn RowSource>, seed: u64) -> Result<Self> {
        if rows.rows() == 0 {
            return Err(DataError::Invalid(format!(
                "the data has no training row of {} tokens (too little text for seq_len {})",
                rows.ctx(),
                rows.ctx() - 1
            )));
        }
        let order = permutation(rows.rows(), seed, 0);
        Ok(Sampler {
            rows,
            seed,
            cursor: Cursor::default(),
            order,
        })
    }

    /// Pretraining rows of `seq_len` from `source`, cut as `mode` says.
    pub fn pretrain(
        source: Arc<dyn TokenSource>,
        mode: Mode,
        seq_len: usize,
        seed: u64,
    ) -> Result<Self> {
        let ctx = seq_len + 1;
        let rows: Box<dyn RowSource> = match mode {
            Mode::Packed => Box::new(PackedRows { source, ctx }),
            Mode::Padded => Box::new(PaddedRows { source, ctx }),
        };
        Self::new(rows, seed)
    }

    /// Splits off `held_out` rows spread evenly over the data ([`spread`], in the source's
    /// order, before any shuffling) as a held-out set: `(training sampler over the rest,
    /// held-out sampler)`, both seeded as this one and at their start. Fails unless both
    /// sides keep a row.
    pub fn hold_out(self, held_out: u64) -> Result<(Sampler, Sampler)> {
        let n = self.rows.rows();
        if held_out == 0 || held_out >= n {
            return Err(DataError::Invalid(format!(
                "holding out {held_out} rows for evaluation needs more than that: the data has \
                 {n} rows of {} tokens (lower eval_batches or batch_size, or add data)",
                self.rows.ctx() - 1
            )));
        }
        let inner: Arc<dyn RowSource> = Arc::from(self.rows);
        let held = Arc::new(spread(held_out, n));
        let side = |side| -> Box<dyn RowSource> {
            Box::new(Split {
                inner: inner.clone(),
                held: held.clone(),
                side,
            })
        };
        Ok((
            Sampler::new(side(false), self.seed)?,
            Sampler::new(side(true), self.seed)?,
        ))
    }

    /// Rows per epoch.
    pub fn rows_per_epoch(&self) -> u64 {
        self.rows.rows()
    }

    /// `seq_len` of every batch.
    pub fn seq_len(&self) -> usize {
        self.rows.ctx() - 1
    }

    /// Where the next batch starts; store it in a checkpoint.
    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// Continues from `cursor` (as returned by [`cursor`](Self::cursor) on a sampler over the
    /// same data and seed).
    pub fn resume(&mut self, cursor: Cursor) -> Result<()> {
        if cursor.position >= self.rows.rows() {
            return Err(DataError::Invalid(format!(
                "cursor position {} is past the {} rows of an epoch: it belongs to other data",
                cursor.position,
                self.rows.rows()
            )));
        }
        if cursor.epoch != self.cursor.epoch {
            self.order = permutation(self.rows.rows(), self.seed, cursor.epoch);
        }
        self.cursor = cursor;
        Ok(())
    }

    /// The next `batch` rows, shifted; epochs roll over inside a batch when needed.
    pub fn next_batch(&mut self, batch: usize, seq_len: usize) -> Result<Batch> {
        if seq_len != self.seq_len() {
            return Err(DataError::Invalid(format!(
                "the sampler was built for seq_len {}, asked for {seq_len}",
                self.seq_len()
            )));
        }
        if batch == 0 {
            return Err(DataError::Invalid("batch size must be positive".into()));
        }
        let mut rows = Vec::with_capacity(batch);
        for _ in 0..batch {
            rows.push(self.rows.row(self.order[self.cursor.position as usize]));
            self.cursor.position += 1;
            if self.cursor.position == self.rows.rows() {
                self.cursor = Cursor {
                    epoch: self.cursor.epoch + 1,
                    position: 0,
                };
                self.order = permutation(self.rows.rows(), self.seed, self.cursor.epoch);
            }
        }
        Ok(sample::shift(&rows))
    }
}

/// SplitMix64 (Steele et al.): tiny, deterministic on every platform.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is < n/2⁶⁴, irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// The shuffled row order of `epoch`.
pub fn permutation(n: u64, seed: u64, epoch: u64) -> Vec<u64> {
    let mut rng = SplitMix64(seed ^ 0xda7a_5a3b_1e00_0000);
    let mix = rng.next_u64() ^ epoch.wrapping_mul(0xa076_1d64_78bd_642f);
    let mut rng = SplitMix64(mix);
    let mut order: Vec<u64> = (0..n).collect();
    for i in (1..n as usize).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// A seeded sampler over the SFT rows of `files` (conversations that overflow the window
/// handled by `overflow`), and how the conversations fitted.
pub fn sft_sampler(
    tok: &crate::tokenizer::Tokenizer,
    files: &[std::path::PathBuf],
    system: Option<&str>,
    (seq_len, overflow): (usize, sample::SftOverflow),
    seed: u64,
) -> Result<(Sampler, sample::SftReport)> {
    let ctx = seq_len + 1;
    let (rows, report) = sample::sft_rows(tok, files, system, ctx, overflow)?;
    Ok((
        Sampler::new(Box::new(MemRows::new(rows, ctx)), seed)?,
        report,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(docs: &[&[u32]]) -> Arc<MemTokens> {
        let mut m = MemTokens::default();
        for d in docs {
            m.push(3, d, 4);
        }
        Arc::new(m)
    }

    #[test]
    fn a_held_out_split_spreads_over_the_data_and_stays_out_of_training() {
        let rows: Vec<Row> = (0..10)
            .map(|i| sample::packed_row(&[i, i + 100, i + 200]))
            .collect();
        let sampler = Sampler::new(Box::new(MemRows::new(rows, 3)), 5).expect("sampler");
        let (mut train, mut held) = sampler.hold_out(4).expect("split");
        assert_eq!((train.rows_per_epoch(), held.rows_per_epoch()), (6, 4));
        let firsts = |b: &Batch| b.inputs.chunks(2).map(|r| r[0]).collect::<Vec<_>>();
        let mut seen: Vec<i64> = (0..3)
            .flat_map(|_| firsts(&train.next_batch(2, 2).expect("batch")))
            .collect();
        seen.sort();
        let mut out: Vec<i64> = firsts(&held.next_batch(4, 2).expect("batch"));
        out.sort();
        assert_eq!(
            out,
            [1, 3, 6, 8],
            "the held-out rows: the middles of four stretches"
        );
        assert_eq!(
            seen,
            [0, 2, 4, 5, 7, 9],
            "one training epoch is every other row"
        );
        let again = Sampler::new(
            Box::new(MemRows::new(vec![sample::packed_row(&[1, 2, 3])], 3)),
            5,
        )
        .expect("sampler");
        let err = again.hold_out(1).err().expect("nothing left to train on");
        assert!(err.to_string().contains("eval_batches"), "{err}");
    }

    proptest::proptest! {
        #[test]
        fn the_two_sides_of_a_split_partition_the_rows(n in 2u64..400, k in 1u64..400) {
            let k = k.min(n - 1);
            let held = Arc::new(spread(k, n));
            proptest::prop_assert!(held.windows(2).all(|w| w[0] < w[1]), "distinct, sorted");
            let inner: Arc<dyn RowSource> = Arc::new(MemRows::new(
                (0..n as i64).map(|i| sample::packed_row(&[i, i, i])).collect(),
                3,
            ));
            let side = |side| Split { inner: inner.clone(), held: held.clone(), side };
            let mut all: Vec<u64> = (0..n - k).map(|i| side(false).source_row(i)).collect();
            all.extend((0..k).map(|i| side(true).source_row(i)));
            all.sort();
            proptest::prop_assert_eq!(all, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn permutations_are_seeded_and_differ_by_epoch() {
        let a = permutation(100, 7, 0);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(a, permutation(100, 7, 0));
        assert_ne!(a, permutation(100, 7, 1));
        assert_ne!(a, permutation(100, 8, 0));
        assert_ne!(a, sorted);
    }

    #[test]
    fn packed_windows_cover_the_stream_with_stride_seq_len() {
        // Stream: 3 10 11 12 4 3 20 21 4 (9 tokens); seq_len 4 → windows at 0 and 4.
        let src = stream(&[&[10, 11, 12], &[20, 21]]);
        let rows = PackedRows {
            source: src,
            ctx: 5,
        };
        assert_eq!(rows.rows(), 2);
        assert_eq!(rows.row(0).ids, [3, 10, 11, 12, 4]);
        assert_eq!(rows.row(1).ids, [4, 3, 20, 21, 4]);
        assert!(rows.row(1).mask.iter().all(|&m| m == 1.0));
    }

    #[test]
    fn padded_rows_are_bos_plus_text_without_eos() {
        let src = stream(&[&[10, 11, 12, 13, 14, 15], &[20]]);
        let rows = PaddedRows {
            source: src,
            ctx: 4,
        };
        assert_eq!(rows.rows(), 2);
        assert_eq!(rows.row(0).ids, [3, 10, 11, 12]);
        assert_eq!(rows.row(1).ids, [3, 20, 0, 0]);
        assert_eq!(rows.row(1).mask, [1.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn every_row_is_seen_once_per_epoch() {
        let docs: Vec<Vec<u32>> = (0..10).map(|i| vec![100 + i]).collect();
        let refs: Vec<&[u32]> = docs.iter().map(|d| d.as_slice()).collect();
        let mut s = Sampler::pretrain(stream(&refs), Mode::Padded, 2, 1).unwrap();
        let mut seen = Vec::new();
        for _ in 0..5 {
            let b = s.next_batch(2, 2).unwrap();
            seen.extend(b.inputs.chunks(2).map(|r| r[1]));
        }
        seen.sort();
        assert_eq!(seen, (100..110).collect::<Vec<i64>>());
        assert_eq!(
            s.cursor(),
            Cursor {
                epoch: 1,
                position: 0
            }
        );
        assert!(s.next_batch(2, 3).is_err(), "seq_len must match");
    }

    #[test]
    fn too_little_data_is_an_error() {
        let e = Sampler::pretrain(stream(&[&[10]]), Mode::Packed, 8, 0)
            .err()
            .unwrap();
        assert!(e.to_string().contains("no training row"), "{e}");
    }
}
