//! A prompt fed through the cache: restored from the deepest snapshot on its path, then fed
//! the rest a stretch at a time, a snapshot kept at the end of each stretch.

use super::claims::{self, MAX_WAIT};
use super::{Entry, PrefixCache, Scores, Tier};
use crate::decoder::AsyncDecoder;
use crate::snapshot::Snapshot;
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::SessionId;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Tokens past a hit and before a prompt's end within which a message opening keeps no
/// snapshot of its own.
const NEAR: usize = 8;

/// What [`PrefixCache::claim_plan`] found and claimed: the hit (pinned), how far the prompt
/// runs in the tree, the depth planned from and the stops, the claim on them (none after the
/// longest wait), and the time spent waiting for others' snapshots.
pub(super) struct Planned<'a> {
    pub hit: Option<ScoredHit>,
    pub common: usize,
    pub planned: (usize, Vec<usize>),
    pub claim: Option<claims::Claim<'a>>,
    pub waited: std::time::Duration,
}

/// What a lookup pinned: the node and its entry's serial, its depth, and its snapshot where
/// it is.
pub(super) enum Hit {
    Device((usize, u64), usize, Snapshot),
    Host(
        (usize, u64),
        usize,
        std::sync::Arc<crate::snapshot::HostSnapshot>,
    ),
}

/// A hit, with the scores its entry keeps (if any).
pub(super) type ScoredHit = (Hit, Option<Arc<Scores>>);

impl Hit {
    fn at(&self) -> (usize, u64) {
        match self {
            Hit::Device(at, ..) | Hit::Host(at, ..) => *at,
        }
    }

    pub(super) fn depth(&self) -> usize {
        match self {
            Hit::Device(_, d, _) | Hit::Host(_, d, _) => *d,
        }
    }
}

impl PrefixCache {
    /// Feeds all of `prompt` but its last token to new `session`: restored from the deepest
    /// snapshot on the prompt's path, the rest fed with snapshots kept along it. Answers how
    /// many tokens the session has seen (`prompt.len() − 1`, or 0 for a one-token prompt);
    /// the caller feeds the rest. Without the cache it feeds nothing.
    pub async fn prefill(
        &self,
        dec: &AsyncDecoder,
        session: SessionId,
        prompt: &[i64],
    ) -> Result<usize, RuntimeError> {
        self.prefill_parting(dec, session, prompt, &[]).await
    }

    /// [`prefill`](Self::prefill), keeping snapshots also at `parts`: depths where the prompt
    /// parts from prompts fed beside it (a request's other prompts, [`super::parting_depths`]),
    /// so that those wait for the shared stretch and start from it.
    pub async fn prefill_parting(
        &self,
        dec: &AsyncDecoder,
        session: SessionId,
        prompt: &[i64],
        parts: &[usize],
    ) -> Result<usize, RuntimeError> {
        if !self.enabled() || prompt.len() < 2 {
            return Ok(0);
        }
        self.check_recoveries(dec);
        let limit = prompt.len() - 1;
        let every = self.every(dec);
        let started = std::time::Instant::now();
        let p = self
            .claim_plan(&self.claims, prompt, (every, parts), |_| true)
            .await;
        let (common, planned, mut claim, waited) = (p.common, p.planned, p.claim, p.waited);
        let restored = match p.hit {
            Some((hit, _)) => self.restore(dec, session, hit).await?,
            None => None,
        };
        self.count(restored);
        let mut fed = restored.unwrap_or(0);
        let (restored_at, depth) = (started.elapsed(), fed);
        // As planned, unless the restore did not happen (decoding rebuilding its stages).
        let stops = if planned.0 == fed {
            planned.1
        } else {
            self.plan(prompt, (fed, common, limit), every, parts)
        };
        for &end in &stops {
            // The snapshot is taken in the pass's own jobs; a failed one fails only itself.
            let kept = dec.feed_keeping(session, prompt[fed..end].to_vec()).await?;
            fed = end;
            match kept {
                Ok(k) => self.put(dec, &prompt[..end], k.snapshot).await,
                Err(e) => tracing::warn!("{session}: no prefix snapshot at {end} tokens: {e}"),
            }
            if let Some(c) = claim.as_mut() {
                c.kept(end);
            }
        }
        drop(claim);
        tracing::debug!(
            "{session}: a prompt of {} tokens from a snapshot of {depth} ({:.2} ms, {:.2} of \
             them waiting for snapshots others made), then {} fed in {} passes keeping \
             snapshots at {stops:?} ({:.2} ms)",
            prompt.len(),
            restored_at.as_secs_f64() * 1e3,
            waited.as_secs_f64() * 1e3,
            fed - depth,
            stops.len(),
            (started.elapsed() - restored_at).as_secs_f64() * 1e3,
        );
        Ok(fed)
    }

    /// Looks `prompt` up among the entries `usable` accepts and plans its stops from the hit,
    /// then claims them in `claims`; while another request is making one of them, waits for
    /// it (at most [`MAX_WAIT`] all told) and looks up again, since it will then be a hit.
    pub(super) async fn claim_plan<'a>(
        &self,
        claims: &'a claims::Claims,
        prompt: &[i64],
        (every, parts): (usize, &[usize]),
        usable: impl Fn(&Entry) -> bool,
    ) -> Planned<'a> {
        let limit = prompt.len() - 1;
        let mut waited = std::time::Duration::ZERO;
        loop {
            let (hit, common) = self.lookup_where(prompt, limit, &usable);
            let depth = hit.as_ref().map_or(0, |h| h.0.depth());
            let planned = (
                depth,
                self.plan(prompt, (depth, common, limit), every, parts),
            );
            let claim = match claims.claim(prompt, &planned.1) {
                Ok(claim) => Some(claim),
                Err(done) if waited < MAX_WAIT => {
                    if let Some((h, _)) = &hit {
                        self.unpin(h);
                    }
                    waited += claims::wait(done, MAX_WAIT - waited).await;
                    continue;
                }
                Err(_) => None,
            };
            return Planned {
                hit,
                common,
                planned,
                claim,
                waited,
            };
        }
    }

    /// Counts a lookup's outcome: a hit restored at its depth (the tokens it saved), or a miss.
    pub(super) fn count(&self, restored: Option<usize>) {
        match restored {
            Some(depth) => {
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .tokens_saved
                    .fetch_add(depth as u64, Ordering::Relaxed);
            }
            None => {
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Where a prompt fed from `fed` keeps snapshots ([`stops`]). Of the messages, only the
    /// first one's end (a system prompt others share) keeps one of its own: a later turn's
    /// messages are covered by the snapshot at the prompt's end, which the next turn finds.
    /// Each stop costs a pass of its own, so none within a few tokens past `fed` or before
    /// `limit` either; `parts` (where prompts fed beside it part from it) are kept wherever
    /// they fall past `fed` and before `limit`.
    pub(super) fn plan(
        &self,
        prompt: &[i64],
        (fed, common, limit): (usize, usize, usize),
        every: usize,
        parts: &[usize],
    ) -> Vec<usize> {
        let mut opens: Vec<usize> = self.cfg.boundary.map_or(Vec::new(), |b| {
            let first = prompt.iter().skip(1).position(|&t| t == b).map(|i| i + 1);
            first
                .filter(|&i| i >= fed + NEAR && i + NEAR <= limit)
                .into_iter()
                .collect()
        });
        opens.extend(parts.iter().filter(|&&p| p > fed && p < limit));
        stops(fed, common, limit, every, &opens)
    }

    /// Gives back a lookup's pin without restoring it.
    pub(super) fn unpin(&self, hit: &Hit) {
        let (node, serial) = hit.at();
        if let Some(e) = self.lock().entry_mut(node, serial) {
            e.pins = e.pins.saturating_sub(1);
        }
    }

    pub(super) fn every(&self, dec: &AsyncDecoder) -> usize {
        match self.cfg.every {
            0 => dec.pass_tokens(),
            n => n,
        }
    }

    /// The deepest usable entry on `prompt`'s path at most `limit` deep that `also` accepts,
    /// pinned, with its scores; and how far the path runs in the tree.
    fn lookup_where(
        &self,
        prompt: &[i64],
        limit: usize,
        also: impl Fn(&Entry) -> bool,
    ) -> (Option<ScoredHit>, usize) {
        let mut g = self.lock();
        let usable = |e: &Entry| matches!(e.tier, Tier::Device(_) | Tier::Host(_)) && also(e);
        let found = g.tree.find(prompt, limit, usable);
        let Some(node) = found.node else {
            return (None, found.common);
        };
        g.tree.touch(node);
        let e = g.tree.entry_mut(node).expect("found");
        e.pins += 1;
        let at = (node, e.serial);
        let hit = match &e.tier {
            Tier::Device(s) => Hit::Device(at, found.depth, *s),
            Tier::Host(h) => Hit::Host(at, found.depth, h.clone()),
            Tier::Moving => unreachable!("not usable"),
        };
        (Some((hit, e.scores.clone())), found.common)
    }

    /// Starts `session` from the pinned hit (brought back to the devices first if on the
    /// host), then unpins it; answers its depth, or `None` where decoding is not serving now
    /// (rebuilding its stages: the session is then fed from the start). A restore that fails
    /// takes the entry out of the cache.
    pub(super) async fn restore(
        &self,
        dec: &AsyncDecoder,
        session: SessionId,
        hit: Hit,
    ) -> Result<Option<usize>, RuntimeError> {
        let (at, depth, snap) = match hit {
            Hit::Device(at, depth, s) => (at, depth, Ok((s, false))),
            Hit::Host(at, depth, h) => (at, depth, self.promote(dec, at, &h).await),
        };
        let (r, used_once) = match snap {
            Ok((s, once)) => (dec.restore(session, &s, depth).await, once.then_some(s)),
            Err(e) => (Err(e), None),
        };
        if let Some(s) = used_once {
            dec.drop_snapshot(&s).await;
        }
        let mut work = Vec::new();
        {
            let mut g = self.lock();
            if let Some(e) = g.entry_mut(at.0, at.1) {
                e.pins = e.pins.saturating_sub(1);
                if r.is_err() && e.pins == 0 {
                    match g.tree.remove(at.0).map(|e| e.tier) {
                        Some(Tier::Device(s)) => {
                            g.device_bytes -= s.bytes;
                            work.push(super::Work::Drop(s));
                        }
                        // A promotion that failed leaves the entry on the host.
                        Some(Tier::Host(h)) => g.host_bytes -= h.bytes(),
                        _ => {}
                    }
                    self.stats.evicted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.run(dec, work).await;
        Ok(r?.then_some(depth))
    }

    /// Writes the host copy of the entry `at` back to the devices; the entry becomes a device
    /// one. Answers the snapshot, and whether it is the caller's to drop once used (the entry
    /// went meanwhile, or another request brought it back first).
    async fn promote(
        &self,
        dec: &AsyncDecoder,
        (node, serial): (usize, u64),
        host: &crate::snapshot::HostSnapshot,
    ) -> Result<(Snapshot, bool), RuntimeError> {
        let s = dec.write_snapshot(host).await?;
        let work = {
            let mut g = self.lock();
            let Some(e) = g.entry_mut(node, serial) else {
                return Ok((s, true));
            };
            let Tier::Host(h) = &e.tier else {
                return Ok((s, true));
            };
            let freed = h.bytes();
            e.tier = Tier::Device(s);
            g.host_bytes -= freed;
            g.device_bytes += s.bytes;
            self.enforce(&mut g)
        };
        self.run(dec, work).await;
        Ok((s, false))
    }
}

/// Where to keep snapshots while feeding from `fed` to `limit`: where the prompt parts from
/// the tree's paths (`common`, unless within [`NEAR`] tokens past `fed`: the hit covers it),
/// every `every` tokens, before the messages in `opens` (past `fed` and before `limit`), and
/// at `limit`; in order, past `fed`.
fn stops(fed: usize, common: usize, limit: usize, every: usize, opens: &[usize]) -> Vec<usize> {
    let mut at: Vec<usize> = (1..)
        .map(|k| k * every.max(1))
        .skip_while(|&p| p <= fed)
        .take_while(|&p| p < limit)
        .collect();
    if common >= fed + NEAR && common < limit {
        at.push(common);
    }
    at.extend(opens);
    if limit > fed {
        at.push(limit);
    }
    at.sort_unstable();
    at.dedup();
    at
}

#[cfg(test)]
mod tests {
    use super::stops;

    #[test]
    fn snapshots_go_where_the_prompt_parts_on_the_grid_and_before_its_last_token() {
        assert_eq!(stops(0, 0, 9, 4, &[]), vec![4, 8, 9]);
        assert_eq!(stops(0, 6, 9, 4, &[]), vec![4, 8, 9], "6 is near the hit");
        assert_eq!(stops(0, 20, 30, 4, &[]), vec![4, 8, 12, 16, 20, 24, 28, 30]);
        assert_eq!(stops(10, 20, 30, 100, &[]), vec![20, 30]);
        assert_eq!(stops(15, 20, 30, 100, &[]), vec![30], "20 is near the hit");
        assert_eq!(stops(5, 6, 9, 4, &[]), vec![8, 9]);
        assert_eq!(stops(8, 8, 9, 100, &[]), vec![9]);
        assert_eq!(stops(9, 20, 9, 4, &[]), Vec::<usize>::new());
        assert_eq!(stops(0, 9, 9, 100, &[]), vec![9]);
        assert_eq!(stops(2, 0, 9, 100, &[3, 8]), vec![3, 8, 9]);
    }
}
