//! A prompt scored through the cache: every token's log-probability given the ones before it,
//! from the deepest snapshot whose prefix a scoring request has scored before (its tokens'
//! log-probabilities, and the logits that score the token after it, kept beside the snapshot
//! as [`Scores`]); the rest is fed a pass at a time with every position's logits, and
//! snapshots with their scores are kept on the way, where the plain prefill keeps them and
//! where the prompt parts from the prompts scored beside it (`parts`: a request's other
//! prompts). Multiple-choice evaluation sends one context once per answer: the context is fed
//! once, and a one-token answer (" A", " B", …) then costs no pass at all.
//!
//! The numbers are those of feeding the prompt from the start, bit for bit: a restored
//! session computes what one fed from the start does (the cache is exact), and a position's
//! log-probability is a function of its logits alone ([`token_logprob`]). Scores kept with
//! `k` alternatives serve requests asking for `k` or fewer (the alternatives come most
//! likely first, ties by id, so the first `j` of `k` are those a request for `j` gets).

use super::claims;
use super::{Entry, PrefixCache, Tier};
use crate::decoder::AsyncDecoder;
use crate::logprobs::{TokenLogprob, token_logprob};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::SessionId;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Host bytes of scores alive, shared by the cache and every [`Piece`] and [`Scores`] it made:
/// each adds its bytes when made and takes them off when its last holder lets it go (an entry,
/// a deeper entry sharing it, a request reading it), so the count is the memory held.
type Counter = Arc<AtomicU64>;

/// A stretch of positions' log-probabilities, shared by the entries scored past it.
struct Piece {
    rows: Box<[Option<TokenLogprob>]>,
    bytes: u64,
    counter: Counter,
}

impl Piece {
    fn new(rows: &[Option<TokenLogprob>], counter: &Counter) -> Arc<Self> {
        let position = |l: &Option<TokenLogprob>| {
            size_of::<Option<TokenLogprob>>()
                + l.as_ref()
                    .map_or(0, |l| l.top.len() * size_of::<(i64, f32)>())
        };
        let bytes = rows.iter().map(position).sum::<usize>() as u64;
        counter.fetch_add(bytes, Ordering::Relaxed);
        Arc::new(Piece {
            rows: rows.into(),
            bytes,
            counter: counter.clone(),
        })
    }
}

impl Drop for Piece {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A prefix's scores: its tokens' log-probabilities and what scores the next token.
pub struct Scores {
    /// Alternatives kept at each position.
    top: usize,
    /// Tokens `0..depth`'s log-probabilities (the first `None`), in pieces shared with the
    /// shallower entries they were scored from.
    pieces: Vec<Arc<Piece>>,
    /// The logits after the prefix's last token: they score whichever token comes next.
    next: Box<[f32]>,
    counter: Counter,
}

impl Scores {
    fn new(top: usize, pieces: Vec<Arc<Piece>>, next: &[f32], counter: &Counter) -> Self {
        counter.fetch_add(std::mem::size_of_val(next) as u64, Ordering::Relaxed);
        Scores {
            top,
            pieces,
            next: next.into(),
            counter: counter.clone(),
        }
    }

    /// Tokens `0..depth`'s log-probabilities with `top` alternatives (at most those kept).
    fn read(&self, top: usize) -> Vec<Option<TokenLogprob>> {
        let cut = |l: &Option<TokenLogprob>| {
            l.as_ref().map(|l| TokenLogprob {
                top: l.top[..top.min(l.top.len())].to_vec(),
                ..l.clone()
            })
        };
        self.pieces
            .iter()
            .flat_map(|p| p.rows.iter())
            .map(cut)
            .collect()
    }
}

impl Drop for Scores {
    fn drop(&mut self) {
        let bytes = std::mem::size_of_val(&*self.next) as u64;
        self.counter.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// Each position's log-probability of the token after it: `logits` holds one row of `vocab`
/// per target, in order. Rows are scored on the blocking pool, in parallel (a 512-token
/// prompt's 3 M logits of the 0.9B took ~60 ms on one core).
async fn score_rows(
    logits: Vec<f32>,
    vocab: usize,
    targets: Vec<i64>,
    top: usize,
) -> Result<(Vec<Option<TokenLogprob>>, Vec<f32>), RuntimeError> {
    tokio::task::spawn_blocking(move || {
        use rayon::prelude::*;
        let rows = logits
            .par_chunks(vocab)
            .zip(targets)
            .map(|(row, t)| Some(token_logprob(row, t, top)))
            .collect();
        (rows, logits)
    })
    .await
    .map_err(|e| RuntimeError::Runtime(format!("scoring a prompt failed: {e}")))
}

impl PrefixCache {
    /// Scores `prompt` in new `session`: each token's log-probability given the ones before
    /// it with its `top` alternatives (`None` for the first), feeding all but the last token
    /// (the caller feeds that one to generate). Through the cache where `cached` (the
    /// request's opt-out) and the cache keeps scores; `parts` are depths where the prompt
    /// parts from prompts scored beside it, kept as snapshots so that those start there.
    pub async fn score(
        &self,
        dec: &AsyncDecoder,
        session: SessionId,
        prompt: &[i64],
        top: usize,
        (parts, cached): (&[usize], bool),
    ) -> Result<Vec<Option<TokenLogprob>>, RuntimeError> {
        let limit = prompt.len().saturating_sub(1);
        let mut out = vec![None];
        if !(cached && self.enabled() && self.cfg.score_bytes > 0) || limit == 0 {
            self.score_from(dec, session, prompt, top, 0, &mut out, &[], None)
                .await?;
            return Ok(out);
        }
        self.check_recoveries(dec);
        let every = self.every(dec);
        let usable = |e: &Entry| e.scores.as_ref().is_some_and(|s| s.top >= top);
        let p = self
            .claim_plan(&self.score_claims, prompt, (every, parts), usable)
            .await;
        let (common, planned, claim) = (p.common, p.planned, p.claim);
        let (mut fed, mut pieces) = (0, Vec::new());
        let hit = p
            .hit
            .map(|(h, s)| (h, s.expect("usable entries hold scores")));
        if let Some((hit, scores)) = hit
            && let Some(depth) = self.restore(dec, session, hit).await?
        {
            fed = depth;
            out = scores.read(top);
            out.push(Some(token_logprob(&scores.next, prompt[depth], top)));
            pieces = scores.pieces.clone();
            self.count(Some(depth));
        } else {
            self.count(None);
        }
        let stops = if planned.0 == fed {
            planned.1
        } else {
            self.plan(prompt, (fed, common, limit), every, parts)
        };
        let mut claim = claim;
        self.score_from(
            dec,
            session,
            prompt,
            top,
            fed,
            &mut out,
            &stops,
            Some((&mut pieces, &mut claim)),
        )
        .await?;
        Ok(out)
    }

    /// Feeds `prompt[fed..limit]` a pass at a time, adding each position's score of the
    /// token after it to `out` (which holds tokens `0..=fed`'s); at each of `stops` a pass
    /// ends, and where `keep` is given, a snapshot with the scores so far is kept there (the
    /// pieces grow by the stretch fed since the last one; the claim's stop is released).
    #[allow(clippy::too_many_arguments)]
    async fn score_from(
        &self,
        dec: &AsyncDecoder,
        session: SessionId,
        prompt: &[i64],
        top: usize,
        mut fed: usize,
        out: &mut Vec<Option<TokenLogprob>>,
        stops: &[usize],
        mut keep: Option<Keeping<'_, '_>>,
    ) -> Result<(), RuntimeError> {
        let limit = prompt.len().saturating_sub(1);
        let vocab = dec.vocab();
        let mut last_kept = fed;
        while fed < limit {
            let stop = stops.iter().copied().find(|&s| s > fed).unwrap_or(limit);
            let end = stop.min(fed + dec.pass_tokens()).min(limit);
            let ids = prompt[fed..end].to_vec();
            let keeping = keep.is_some() && end == stop && !self.holds(&prompt[..end], top);
            let (logits, kept) = if keeping {
                let (l, k) = dec.feed_every_keeping(session, ids).await?;
                (l, Some(k))
            } else {
                (dec.feed_every(session, ids).await?, None)
            };
            // Position i's logits score the token after it.
            let targets = prompt[fed + 1..=end].to_vec();
            let (rows, logits) = match score_rows(logits, vocab, targets, top).await {
                Ok(r) => r,
                Err(e) => {
                    if let Some(Ok(k)) = kept {
                        dec.drop_snapshot(&k.snapshot).await;
                    }
                    return Err(e);
                }
            };
            out.extend(rows);
            fed = end;
            let Some((pieces, claim)) = keep.as_mut() else {
                continue;
            };
            if end != stop {
                continue;
            }
            pieces.push(Piece::new(&out[last_kept..end], &self.score_bytes));
            last_kept = end;
            let next = &logits[logits.len() - vocab..];
            let scores = Arc::new(Scores::new(top, pieces.clone(), next, &self.score_bytes));
            let snapshot = match kept {
                Some(Ok(k)) => Some(k.snapshot),
                Some(Err(e)) => {
                    tracing::warn!("{session}: no prefix snapshot at {end} tokens: {e}");
                    None
                }
                None => None,
            };
            self.put_scored(dec, &prompt[..end], snapshot, scores).await;
            if let Some(c) = claim.as_mut() {
                c.kept(end);
            }
        }
        Ok(())
    }

    /// Whether `path` has a usable entry whose scores serve `top` alternatives.
    fn holds(&self, path: &[i64], top: usize) -> bool {
        let g = self.lock();
        let f = g.tree.find(path, path.len(), |e: &Entry| {
            matches!(e.tier, Tier::Device(_) | Tier::Host(_))
                && e.scores.as_ref().is_some_and(|s| s.top >= top)
        });
        f.node.is_some() && f.depth == path.len()
    }

    /// Keeps `scores` for `path`: with `snapshot` as a new entry, or on the entry already
    /// there (whose snapshot stays; `snapshot` is dropped), replacing scores with fewer
    /// alternatives. Without either, nothing is kept.
    async fn put_scored(
        &self,
        dec: &AsyncDecoder,
        path: &[i64],
        snapshot: Option<crate::snapshot::Snapshot>,
        scores: Arc<Scores>,
    ) {
        self.check_recoveries(dec);
        let (work, unused) = {
            let mut g = self.lock();
            let node = g.tree.insert(path);
            match (g.tree.entry(node).is_some(), snapshot) {
                (true, snap) => {
                    g.tree.touch(node);
                    let e = g.tree.entry_mut(node).expect("there");
                    if e.scores.as_ref().is_none_or(|s| s.top < scores.top) {
                        e.scores = Some(scores);
                    }
                    (self.enforce(&mut g), snap)
                }
                (false, Some(snap)) => {
                    let serial = g.serial();
                    let entry = Entry {
                        tier: Tier::Device(snap),
                        pins: 0,
                        serial,
                        scores: Some(scores),
                    };
                    g.tree.set(node, entry);
                    g.device_bytes += snap.bytes;
                    (self.enforce(&mut g), None)
                }
                (false, None) => {
                    // The node was made for nothing: take it out again.
                    g.tree.remove(node);
                    (Vec::new(), None)
                }
            }
        };
        if let Some(s) = unused {
            dec.drop_snapshot(&s).await;
        }
        self.run(dec, work).await;
    }
}

/// What a scoring feed keeps as it goes: the pieces of its scores so far, and its claim.
type Keeping<'p, 'c> = (&'p mut Vec<Arc<Piece>>, &'p mut Option<claims::Claim<'c>>);

/// Shared prefixes shorter than this keep no snapshot of their own (a stop costs a pass).
const PART_MIN: usize = 8;

/// For each of `prompts` scored together, the depths where it parts from the others (each
/// shared prefix of at least [`PART_MIN`] tokens with another, ascending): passed to
/// [`PrefixCache::score`] as `parts`, so that prompts sharing a context (a question's
/// answers, a few-shot prefix) keep it once and start from it.
pub fn parting_depths(prompts: &[&[i64]]) -> Vec<Vec<usize>> {
    let shared = |a: &[i64], b: &[i64]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let mut order: Vec<usize> = (0..prompts.len()).collect();
    order.sort_by(|&a, &b| prompts[a].cmp(prompts[b]));
    // In sorted order, what a prompt shares with a later one is the least of what each
    // neighbour shares with the next in between.
    let next: Vec<usize> = order
        .windows(2)
        .map(|w| shared(prompts[w[0]], prompts[w[1]]))
        .collect();
    let mut out = vec![Vec::new(); prompts.len()];
    for (k, &i) in order.iter().enumerate() {
        let mut depths = Vec::new();
        let mut least = usize::MAX;
        for &s in &next[k..] {
            least = least.min(s);
            if least < PART_MIN {
                break;
            }
            depths.push(least);
        }
        least = usize::MAX;
        for &s in next[..k].iter().rev() {
            least = least.min(s);
            if least < PART_MIN {
                break;
            }
            depths.push(least);
        }
        depths.sort_unstable();
        depths.dedup();
        out[i] = depths;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::parting_depths;

    #[test]
    fn prompts_part_where_they_share_a_context_with_another() {
        let few_shot: Vec<i64> = (0..20).collect();
        let with = |q: &[i64], a: i64| -> Vec<i64> {
            few_shot.iter().chain(q).copied().chain([a]).collect()
        };
        let q1: Vec<i64> = (100..110).collect();
        let q2: Vec<i64> = (200..230).collect();
        let prompts = [
            with(&q1, 7),
            with(&q2, 7),
            with(&q1, 8),
            vec![1, 2, 3],
            with(&q1, 9),
            with(&q2, 8),
        ];
        let refs: Vec<&[i64]> = prompts.iter().map(Vec::as_slice).collect();
        let d = parting_depths(&refs);
        // q1's answers part from each other after 30 tokens and from q2's after the 20
        // shared few-shot ones; q2's after 50; the short prompt shares nothing.
        assert_eq!(d[0], vec![20, 30]);
        assert_eq!(d[2], vec![20, 30]);
        assert_eq!(d[4], vec![20, 30]);
        assert_eq!(d[1], vec![20, 50]);
        assert_eq!(d[5], vec![20, 50]);
        assert!(d[3].is_empty());
        // Identical prompts part at their end; one prompt parts from nothing.
        assert_eq!(
            parting_depths(&[&few_shot, &few_shot]),
            vec![vec![20], vec![20]]
        );
        assert_eq!(parting_depths(&[&few_shot]), vec![Vec::<usize>::new()]);
    }
}
