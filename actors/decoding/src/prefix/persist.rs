//! The cache's snapshots taken out with the tokens they follow (for the server to write them
//! to a directory when it stops) and host copies taken back into the host tier without
//! touching the devices (when a server starts on that directory again).

use super::{Entry, PrefixCache, Tier};
use crate::decoder::AsyncDecoder;
use crate::snapshot::{HostSnapshot, Snapshot};
use std::sync::Arc;

/// Where a held entry's snapshot is, as [`PrefixCache::held`] found it.
enum At {
    /// On the devices, pinned: its node and serial.
    Device(usize, u64, Snapshot),
    Host(Arc<HostSnapshot>),
}

impl PrefixCache {
    /// Every snapshot the cache holds, as host copies with the tokens they follow, the most
    /// recently used first. A device snapshot that cannot be read is left out (and logged).
    pub async fn held(&self, dec: &AsyncDecoder) -> Vec<(Vec<i64>, Arc<HostSnapshot>)> {
        self.check_recoveries(dec);
        let mut found: Vec<(u64, Vec<i64>, At)> = {
            let mut g = self.lock();
            let nodes: Vec<usize> = g.tree.entries().map(|(i, _)| i).collect();
            let mut out = Vec::with_capacity(nodes.len());
            for node in nodes {
                let (used, path) = (g.tree.used(node), g.tree.path(node));
                let e = g.tree.entry_mut(node).expect("an entry");
                let at = match &e.tier {
                    Tier::Device(s) => {
                        e.pins += 1;
                        At::Device(node, e.serial, *s)
                    }
                    Tier::Host(h) => At::Host(h.clone()),
                    Tier::Moving => continue,
                };
                out.push((used, path, at));
            }
            out
        };
        found.sort_by_key(|f| std::cmp::Reverse(f.0));
        let mut out = Vec::with_capacity(found.len());
        for (_, path, at) in found {
            match at {
                At::Host(h) => out.push((path, h)),
                At::Device(node, serial, s) => {
                    let host = dec.read_snapshot(&s).await;
                    if let Some(e) = self.lock().entry_mut(node, serial) {
                        e.pins = e.pins.saturating_sub(1);
                    }
                    match host {
                        Ok(h) => out.push((path, Arc::new(h))),
                        Err(e) => tracing::warn!(
                            "a prefix snapshot of {} tokens could not be read: {e}",
                            path.len()
                        ),
                    }
                }
            }
        }
        out
    }

    /// Keeps `state`, the states after `tokens`, in the host tier without touching the devices
    /// (a hit brings it to them, as any host entry): `false`, keeping nothing, when the cache
    /// is off, the host tier or the tree has no room for it, or `tokens` already have one.
    pub fn adopt(&self, tokens: &[i64], state: HostSnapshot) -> bool {
        let bytes = state.bytes();
        let mut g = self.lock();
        if !self.enabled()
            || tokens.is_empty()
            || g.host_bytes + bytes > self.cfg.host_bytes
            || g.tree.tokens() + tokens.len() > self.cfg.max_tokens
        {
            return false;
        }
        let node = g.tree.insert(tokens);
        if g.tree.entry(node).is_some() {
            return false;
        }
        let serial = g.serial();
        let entry = Entry {
            tier: Tier::Host(Arc::new(state)),
            pins: 0,
            serial,
            scores: None,
        };
        g.tree.set(node, entry);
        g.host_bytes += bytes;
        true
    }
}
