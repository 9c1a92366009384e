//! The exact prefix state cache. A NeuronSpark session's whole state is its neurons'
//! membranes, the same size after ten tokens or a hundred thousand, so a prefix is cached as
//! one snapshot of them ([`crate::snapshot`]), and a request whose prompt starts with a
//! cached prefix starts from its snapshot and feeds only the rest.
//!
//! Snapshots sit in a radix tree over token ids ([`tree`]) at the depths they were taken:
//! * where a prompt parts from every path the tree holds (so the next prompt sharing that
//!   much finds it),
//! * at the end of a chat prompt's first message ([`PrefixConfig::boundary`]: a shared system
//!   prompt is found by prompts that arrive together),
//! * every [`PrefixConfig::every`] tokens of a long prompt,
//! * before a prompt's last token (the same prompt again feeds one token), and
//! * at a generation's end (the next turn of a conversation finds its whole history).
//!
//! A hit restores the deepest snapshot at most one token short of the prompt. Snapshots live
//! on the devices under a byte budget, least recently used out first to a host tier (its own
//! budget), from which a hit brings them back. [`PrefixCache::held`] and
//! [`PrefixCache::adopt`] take them out and back in across a restart. A snapshot being restored is pinned; a new
//! request starts from a copy, so concurrent requests share one; a request whose prompt runs
//! through a snapshot another is making waits for it instead of making it again ([`claims`]). The cache is exact: a
//! session restored and fed the rest computes what one fed from the start does, bit for bit
//! (the batch-invariant passes make a prompt's numbers independent of how it is cut).

mod carry;
pub mod claims;
mod feed;
mod persist;
mod score;
pub mod tree;

pub use score::{Scores, parting_depths};

use crate::decoder::AsyncDecoder;
use crate::snapshot::{HostSnapshot, Kept, Snapshot};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::SessionId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tree::Tree;

/// How much the cache keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixConfig {
    /// Device bytes its snapshots may hold, over every stage (0: the cache is off).
    pub device_bytes: u64,
    /// Host bytes of snapshots moved off the devices (0: evicted snapshots are dropped).
    pub host_bytes: u64,
    /// A long prompt keeps a snapshot every this many tokens (0: every pass of the decoder's
    /// budget, its prefill chunks).
    pub every: usize,
    /// Tokens the tree's paths may hold (its host memory: 8 bytes a token and a little more).
    pub max_tokens: usize,
    /// A token that opens a message (ChatML's `<|im_start|>`): a snapshot is kept before the
    /// first one after a prompt's start, so prompts that share their first message (a system
    /// prompt) share a snapshot even when they arrive together.
    pub boundary: Option<i64>,
    /// Host bytes of scored prompts' log-probabilities kept beside their snapshots, so a
    /// prompt scored again past a cached prefix is scored from it ([`score`]; 0: scoring
    /// requests do not use the cache).
    pub score_bytes: u64,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            device_bytes: 2 << 30,
            host_bytes: 8 << 30,
            every: 0,
            max_tokens: 1 << 24,
            boundary: None,
            score_bytes: 256 << 20,
        }
    }
}

/// Where an entry's snapshot is.
enum Tier {
    Device(Snapshot),
    Host(Arc<HostSnapshot>),
    /// Being copied to the host; not usable until it is there.
    Moving,
}

struct Entry {
    tier: Tier,
    /// Requests restoring it: not evicted meanwhile.
    pins: usize,
    /// Unique among the cache's entries: a node named across an `await` may have been
    /// removed and reused by then, and is acted on only if it still holds this entry.
    serial: u64,
    /// The log-probabilities of the prefix's tokens, where a scoring request kept them.
    scores: Option<Arc<Scores>>,
}

/// What the cache has done, for `/metrics`.
#[derive(Debug, Default)]
pub struct PrefixStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// Prompt tokens not fed thanks to hits.
    pub tokens_saved: AtomicU64,
    /// Snapshots moved from the devices to the host, and dropped (from either tier).
    pub to_host: AtomicU64,
    pub evicted: AtomicU64,
}

/// The cache's state now, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixUsage {
    pub device_bytes: u64,
    pub host_bytes: u64,
    pub entries: u64,
    pub tokens: u64,
    /// Host bytes of scored prompts' log-probabilities.
    pub score_bytes: u64,
}

/// [`PrefixStats`] read at one moment, with the [`PrefixUsage`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixReport {
    pub hits: u64,
    pub misses: u64,
    pub tokens_saved: u64,
    pub evicted: u64,
    pub to_host: u64,
    pub usage: PrefixUsage,
}

#[derive(Default)]
struct Inner {
    tree: Tree<Entry>,
    device_bytes: u64,
    host_bytes: u64,
    /// The decoder's rebuilds when the device snapshots were taken: a rebuild loses them.
    recoveries: u64,
    /// The next entry's serial.
    serials: u64,
}

impl Inner {
    /// `node`'s entry, if it is still the one with `serial`.
    fn entry_mut(&mut self, node: usize, serial: u64) -> Option<&mut Entry> {
        self.tree.entry_mut(node).filter(|e| e.serial == serial)
    }

    /// A new entry's serial.
    fn serial(&mut self) -> u64 {
        self.serials += 1;
        self.serials
    }
}

/// Work to do outside the lock after the budgets were enforced.
enum Work {
    Drop(Snapshot),
    /// Copy the snapshot of `node`'s entry (of that serial) to the host, then drop it from the
    /// devices.
    ToHost(usize, u64, Snapshot),
}

/// The prefix state cache of one decoder.
#[derive(Default)]
pub struct PrefixCache {
    cfg: PrefixConfig,
    inner: Mutex<Inner>,
    /// Snapshots being made by requests feeding now.
    claims: claims::Claims,
    /// The same for scoring requests, which wait only for snapshots made with scores.
    score_claims: claims::Claims,
    /// Host bytes of scores alive ([`Scores`]).
    score_bytes: Arc<AtomicU64>,
    pub stats: PrefixStats,
}

impl PrefixCache {
    pub fn new(cfg: PrefixConfig) -> Self {
        PrefixCache {
            cfg,
            inner: Mutex::default(),
            claims: claims::Claims::default(),
            score_claims: claims::Claims::default(),
            score_bytes: Arc::default(),
            stats: PrefixStats::default(),
        }
    }

    pub fn config(&self) -> PrefixConfig {
        self.cfg
    }

    pub fn enabled(&self) -> bool {
        self.cfg.device_bytes > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counters and usage together, as `/metrics` reports them.
    pub fn report(&self) -> PrefixReport {
        let s = &self.stats;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PrefixReport {
            hits: load(&s.hits),
            misses: load(&s.misses),
            tokens_saved: load(&s.tokens_saved),
            evicted: load(&s.evicted),
            to_host: load(&s.to_host),
            usage: self.usage(),
        }
    }

    pub fn usage(&self) -> PrefixUsage {
        let g = self.lock();
        PrefixUsage {
            device_bytes: g.device_bytes,
            host_bytes: g.host_bytes,
            entries: g.tree.entries().count() as u64,
            tokens: g.tree.tokens() as u64,
            score_bytes: self.score_bytes.load(Ordering::Relaxed),
        }
    }

    /// Forgets the device snapshots if the decoder has rebuilt its stages since they were
    /// taken (they went with the old stages); host copies stay.
    fn check_recoveries(&self, dec: &AsyncDecoder) {
        let now = dec.recoveries();
        let mut g = self.lock();
        if g.recoveries == now {
            return;
        }
        g.recoveries = now;
        let gone: Vec<usize> = g
            .tree
            .entries()
            .filter(|(_, e)| !matches!(e.tier, Tier::Host(_)))
            .map(|(i, _)| i)
            .collect();
        for i in gone {
            g.tree.remove(i);
        }
        g.device_bytes = 0;
    }

    /// Keeps `snap`, a snapshot of the states after `path`; a snapshot already kept there
    /// stays, and `snap` is dropped.
    async fn put(&self, dec: &AsyncDecoder, path: &[i64], snap: Snapshot) {
        self.check_recoveries(dec);
        let work = {
            let mut g = self.lock();
            let node = g.tree.insert(path);
            if g.tree.entry(node).is_some() {
                g.tree.touch(node);
                vec![Work::Drop(snap)]
            } else {
                let (tier, serial) = (Tier::Device(snap), g.serial());
                g.tree.set(
                    node,
                    Entry {
                        tier,
                        pins: 0,
                        serial,
                        scores: None,
                    },
                );
                g.device_bytes += snap.bytes;
                self.enforce(&mut g)
            }
        };
        self.run(dec, work).await;
    }

    /// Brings the budgets back within bounds: the work to do outside the lock.
    fn enforce(&self, g: &mut Inner) -> Vec<Work> {
        let mut work = Vec::new();
        let free = |e: &Entry| e.pins == 0;
        while g.device_bytes > self.cfg.device_bytes || g.tree.tokens() > self.cfg.max_tokens {
            let over_tokens = g.tree.tokens() > self.cfg.max_tokens;
            // A moving entry is never picked: its copy to the host is under way.
            let pick = |e: &Entry| {
                free(e)
                    && match e.tier {
                        Tier::Device(_) => true,
                        Tier::Host(_) => over_tokens,
                        Tier::Moving => false,
                    }
            };
            let Some(node) = g.tree.oldest(pick) else {
                break;
            };
            let entry = g.tree.entry_mut(node).expect("picked");
            let serial = entry.serial;
            match std::mem::replace(&mut entry.tier, Tier::Moving) {
                Tier::Device(s) => {
                    g.device_bytes -= s.bytes;
                    if self.cfg.host_bytes > 0 && !over_tokens {
                        work.push(Work::ToHost(node, serial, s));
                        self.stats.to_host.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    work.push(Work::Drop(s));
                }
                Tier::Host(h) => g.host_bytes -= h.bytes(),
                Tier::Moving => unreachable!("a moving entry is never picked"),
            }
            g.tree.remove(node);
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
        }
        while g.host_bytes > self.cfg.host_bytes {
            let host = |e: &Entry| free(e) && matches!(e.tier, Tier::Host(_));
            let Some(node) = g.tree.oldest(host) else {
                break;
            };
            if let Some(Entry {
                tier: Tier::Host(h),
                ..
            }) = g.tree.remove(node)
            {
                g.host_bytes -= h.bytes();
            }
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
        }
        // Scores go before their snapshots: the oldest first, the snapshot staying. Their
        // bytes are those alive (a piece shared with other entries, or read by a request now,
        // is freed with its last holder), so this may drop more than one entry's.
        while self.score_bytes.load(Ordering::Relaxed) > self.cfg.score_bytes {
            let Some(node) = g.tree.oldest(|e| e.scores.is_some()) else {
                break;
            };
            g.tree.entry_mut(node).expect("picked").scores = None;
        }
        work
    }

    /// Does the work, and the work that doing it brings (a copy that lands on the host may
    /// push the host tier over its budget).
    async fn run(&self, dec: &AsyncDecoder, work: Vec<Work>) {
        let mut work: std::collections::VecDeque<Work> = work.into();
        while let Some(w) = work.pop_front() {
            match w {
                Work::Drop(s) => dec.drop_snapshot(&s).await,
                Work::ToHost(node, serial, s) => {
                    let host = dec.read_snapshot(&s).await;
                    dec.drop_snapshot(&s).await;
                    let mut g = self.lock();
                    let moving = g
                        .entry_mut(node, serial)
                        .is_some_and(|e| matches!(e.tier, Tier::Moving));
                    match host {
                        Ok(h) if moving => {
                            g.host_bytes += h.bytes();
                            let e = g.entry_mut(node, serial).expect("moving");
                            e.tier = Tier::Host(Arc::new(h));
                            work.extend(self.enforce(&mut g));
                        }
                        _ if moving => {
                            g.tree.remove(node);
                            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }
            }
        }
    }

    /// Closes `session`, keeping its states under the tokens it has seen: `known` are the
    /// tokens fed to it as far as the caller knows (prompt, then generated); the close is
    /// queued at once, the snapshot kept when it is done. Without the cache, a plain close.
    pub fn close(
        self: &Arc<Self>,
        dec: &AsyncDecoder,
        session: SessionId,
        known: Vec<i64>,
    ) -> impl Future<Output = ()> + use<> {
        let keep = self.enabled().then(|| dec.close_keeping(session));
        let plain = keep.is_none().then(|| dec.begin_close(session));
        let (me, dec) = (self.clone(), dec.clone());
        async move {
            if let Some(p) = plain {
                p.await;
            }
            if let Some(k) = keep {
                me.keep(&dec, k.await, &known).await;
            }
        }
    }

    async fn keep(&self, dec: &AsyncDecoder, kept: Result<Kept, RuntimeError>, known: &[i64]) {
        let Ok(Kept { snapshot, fed }) = kept else {
            return;
        };
        if fed == 0 || fed > known.len() {
            // A token fed that the caller never saw (its stream ran one step past the end), or
            // a pass that failed on the way (`usize::MAX`).
            dec.drop_snapshot(&snapshot).await;
            return;
        }
        self.put(dec, &known[..fed], snapshot).await;
    }
}
