//! Snapshots being made: concurrent prompts that share a prefix share one pass over it.
//!
//! A burst of requests sharing a system prompt all find the same deepest snapshot, and each
//! would feed the same stretch past it to keep the same snapshot (where their prompts part
//! from the tree's paths, or at a message's end): 256 clients fed the same 15 tokens 256
//! times, in extra cohorts, before any fed its own (s69). So a request claims the stops it is
//! about to keep; a request whose plan runs through a stop another has claimed waits until
//! that snapshot is kept (or its feed has failed), looks up again and starts from it. A
//! request that claims never waits afterwards, so no two wait for each other, and a wait is
//! bounded by [`MAX_WAIT`] all told.

use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::watch;

/// The longest a request waits, all told, for snapshots others are making.
pub const MAX_WAIT: Duration = Duration::from_secs(2);

struct Making {
    /// The tokens the snapshot will be kept under: how many, and their digest
    /// ([`digests`]). Two prompts whose digests collide wait once for nothing: the lookup
    /// after the wait finds what is really there.
    depth: usize,
    digest: u64,
    claim: u64,
    /// Closed when the snapshot is kept or will not be.
    done: watch::Receiver<()>,
}

/// The stops claimed by requests now feeding.
#[derive(Default)]
pub struct Claims {
    making: Mutex<(u64, Vec<Making>)>,
}

/// One request's claimed stops; each is released when its snapshot is kept
/// ([`Claim::kept`]), the rest when the claim is dropped.
pub struct Claim<'a> {
    claims: &'a Claims,
    id: u64,
    /// Per stop claimed: its depth and the sender whose drop wakes the waiters.
    held: Vec<(usize, watch::Sender<()>)>,
}

impl Claims {
    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, Vec<Making>)> {
        self.making.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Claims `stops` of `prompt` (depths), unless another request is making a snapshot at
    /// one of them: then the channel to wait on, and nothing is claimed.
    pub fn claim<'a>(
        &'a self,
        prompt: &[i64],
        stops: &[usize],
    ) -> Result<Claim<'a>, watch::Receiver<()>> {
        let digests = digests(prompt, stops);
        let mut g = self.lock();
        for (&depth, &digest) in stops.iter().zip(&digests) {
            if let Some(m) = g.1.iter().find(|m| m.depth == depth && m.digest == digest) {
                return Err(m.done.clone());
            }
        }
        g.0 += 1;
        let id = g.0;
        let mut held = Vec::with_capacity(stops.len());
        for (&depth, &digest) in stops.iter().zip(&digests) {
            let (tx, rx) = watch::channel(());
            g.1.push(Making {
                depth,
                digest,
                claim: id,
                done: rx,
            });
            held.push((depth, tx));
        }
        Ok(Claim {
            claims: self,
            id,
            held,
        })
    }

    /// Stops being made now (for tests and `/metrics`-style checks).
    pub fn making(&self) -> usize {
        self.lock().1.len()
    }
}

impl Claim<'_> {
    /// The snapshot at `depth` is kept (or will not be): requests waiting for it go on.
    pub fn kept(&mut self, depth: usize) {
        let Some(i) = self.held.iter().position(|(d, _)| *d == depth) else {
            return;
        };
        let mut g = self.claims.lock();
        g.1.retain(|m| !(m.claim == self.id && m.depth == depth));
        drop(g);
        // Dropping the sender closes the channel: every waiter wakes.
        self.held.swap_remove(i);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut g = self.claims.lock();
        g.1.retain(|m| m.claim != self.id);
        drop(g);
        self.held.clear();
    }
}

/// The digest of `prompt[..s]` for each of `stops` (ascending), in one walk over the prompt:
/// a 131,072-token prompt with a stop every 1,024 tokens is hashed once, not copied 128 times.
fn digests(prompt: &[i64], stops: &[usize]) -> Vec<u64> {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut out = Vec::with_capacity(stops.len());
    let mut at = 0;
    for &s in stops {
        let s = s.min(prompt.len());
        for &t in &prompt[at.min(s)..s] {
            h.write_i64(t);
        }
        at = at.max(s);
        out.push(h.finish());
    }
    out
}

/// Waits until `done` closes or `left` runs out; answers the time spent.
pub async fn wait(mut done: watch::Receiver<()>, left: Duration) -> Duration {
    let t = std::time::Instant::now();
    // `changed` errs once the sender is gone; nothing is ever sent.
    let _ = tokio::time::timeout(left, done.changed()).await;
    t.elapsed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stop_claimed_makes_others_wait_until_it_is_kept_or_dropped() {
        let c = Claims::default();
        let a: Vec<i64> = (0..10).collect();
        let mut b = a.clone();
        b[8] = 99;
        let mut first = c.claim(&a, &[6, 9]).expect("nothing claimed yet");
        assert_eq!(c.making(), 2);
        // b shares a's first 8 tokens: its stop at 6 is a's; at 9 it is its own.
        let wait6 = c.claim(&b, &[6, 9]).err().expect("6 is being made");
        let mine = c.claim(&b, &[9]).expect("b's own 9 differs from a's");
        drop(mine);
        let waiter = tokio::spawn(wait(wait6, Duration::from_secs(5)));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "waits while 6 is being made");
        first.kept(6);
        let waited = waiter.await.unwrap();
        assert!(waited < Duration::from_secs(5), "woke when 6 was kept");
        assert!(c.claim(&b, &[6]).is_ok(), "6 is no longer being made");
        // The rest of a claim goes with it, and wakes its waiters.
        let w9 = c.claim(&a, &[9]).err().expect("a's 9 still being made");
        drop(first);
        assert_eq!(c.making(), 0);
        assert!(wait(w9, Duration::from_secs(5)).await < Duration::from_secs(5));
        // A wait is bounded.
        let _hold = c.claim(&a, &[3]).expect("claimed");
        let w = c.claim(&a, &[3]).err().unwrap();
        let took = wait(w, Duration::from_millis(30)).await;
        assert!(took >= Duration::from_millis(30) && took < Duration::from_secs(5));
    }
}
