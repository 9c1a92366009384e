//! States carried out of the cache and back in: the state after a token sequence as a host
//! copy (a conversation's export), and a host copy kept under its tokens (an import), so the
//! next request that starts with them goes on from it.

use super::{Entry, PrefixCache, Tier};
use crate::decoder::AsyncDecoder;
use crate::snapshot::HostSnapshot;
use nsactor_engine::error::RuntimeError;

impl PrefixCache {
    /// The states after `tokens`, on the host: the cache's snapshot of exactly them if it has
    /// one, else computed by a session that starts from the deepest snapshot on their path
    /// (the snapshot taken at their end is kept, when the cache is on).
    pub async fn state_after(
        &self,
        dec: &AsyncDecoder,
        tokens: &[i64],
    ) -> Result<HostSnapshot, RuntimeError> {
        if tokens.is_empty() {
            return Err(RuntimeError::Runtime("no tokens: no state to take".into()));
        }
        self.check_recoveries(dec);
        if let Some(host) = self.exact(dec, tokens).await {
            return Ok(host);
        }
        let session = dec.session();
        let r = async {
            let fed = self.prefill(dec, session, tokens).await?;
            dec.feed(session, tokens[fed..].to_vec()).await?;
            let snap = dec.save(session).await?;
            let host = dec.read_snapshot(&snap).await;
            if self.enabled() && host.is_ok() {
                self.put(dec, tokens, snap).await;
            } else {
                dec.drop_snapshot(&snap).await;
            }
            host
        }
        .await;
        dec.close(session).await;
        r
    }

    /// A host copy of the snapshot kept at exactly `tokens`, if there is one.
    async fn exact(&self, dec: &AsyncDecoder, tokens: &[i64]) -> Option<HostSnapshot> {
        let tier = {
            let mut g = self.lock();
            let usable = |e: &Entry| matches!(e.tier, Tier::Device(_) | Tier::Host(_));
            let found = g.tree.find(tokens, tokens.len(), usable);
            let node = found.node.filter(|_| found.depth == tokens.len())?;
            let e = g.tree.entry_mut(node).expect("found");
            match &e.tier {
                Tier::Device(s) => {
                    e.pins += 1;
                    Ok((node, e.serial, *s))
                }
                Tier::Host(h) => Err(h.clone()),
                Tier::Moving => unreachable!("not usable"),
            }
        };
        match tier {
            Err(host) => Some((*host).clone()),
            Ok((node, serial, s)) => {
                let host = dec.read_snapshot(&s).await.ok();
                if let Some(e) = self.lock().entry_mut(node, serial) {
                    e.pins = e.pins.saturating_sub(1);
                }
                host
            }
        }
    }

    /// Keeps `state`, the states after `tokens` (a conversation's export), so the next
    /// request starting with them goes on from it.
    pub async fn import(
        &self,
        dec: &AsyncDecoder,
        tokens: &[i64],
        state: &HostSnapshot,
    ) -> Result<(), RuntimeError> {
        if !self.enabled() {
            // The server's setting, not a passing state: the client's request cannot be met here.
            return Err(RuntimeError::Invalid(
                "this server keeps no prefix cache (--no-prefix-cache or --prefix-cache-mib 0): an imported state has nowhere to go".into(),
            ));
        }
        if tokens.is_empty() {
            return Err(RuntimeError::Invalid("a state of no tokens".into()));
        }
        let snap = dec.write_snapshot(state).await?;
        self.put(dec, tokens, snap).await;
        Ok(())
    }
}
