//! The batcher when a cohort loses a stage: the sessions that ran lose their states, the
//! waiting inputs of those sessions are refused, and the supervisor rebuilds the actors while
//! the other inputs wait (within the restart policy; past it decoding fails).

use super::{BatcherMsg, BatcherState, Waiting};
use crate::heal::{HealTimings, Health, lost_session};
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::supervisor::SupMsg;
use nsactor_plugin_api::SessionId;
use ractor::ActorRef;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;

impl BatcherState {
    /// A cohort lost a stage: every session that has run loses its states, parked streams
    /// end, and the supervisor rebuilds the actors while inputs wait (within the policy;
    /// past it decoding fails).
    pub(super) fn lose_stage(&mut self, myself: &ActorRef<BatcherMsg>, cause: String) {
        if !self.health.is_serving() {
            return; // Already rebuilding (the cohorts of the old actors fail one by one).
        }
        tracing::error!("decoding lost a stage: {cause}");
        self.generation += 1;
        // The health first: whoever is answered below already sees it.
        let rebuild = self.restarts.allow(&self.policy, Instant::now()).is_some();
        let past_policy = format!("{cause}; more than {}", self.policy.describe("rebuild"));
        self.health.set(if rebuild {
            Health::Recovering {
                cause: cause.clone(),
            }
        } else {
            Health::Failed {
                cause: past_policy.clone(),
            }
        });
        let gone: Vec<SessionId> = self.open.difference(&self.fresh).copied().collect();
        for s in &gone {
            self.open.remove(s);
            self.ended.remove(s);
            self.steppers.remove(s);
            self.lost.insert(*s, cause.clone());
        }
        self.stats
            .open
            .fetch_sub(gone.len() as u64, Ordering::Relaxed);
        // Their next inputs (a stream's next token, a fed session's next input, a prompt's
        // next chunk) end now; only the inputs of sessions that have not run wait.
        for (_, _, c) in self.parked.drain(..) {
            c.refuse(lost_session(&cause));
        }
        for (_, _, reply) in self.restoring.drain(..) {
            let _ = reply.send(Err(lost_session(&cause)));
        }
        let (waiting, lost): (VecDeque<Waiting>, VecDeque<Waiting>) =
            std::mem::take(&mut self.waiting)
                .into_iter()
                .partition(|w| !self.lost.contains_key(&w.session));
        self.waiting = waiting;
        for w in lost {
            w.reply.refuse(lost_session(&cause));
        }
        if !rebuild {
            self.fail(past_policy);
            return;
        }
        let (sup, me) = (self.sup.clone(), myself.clone());
        tokio::spawn(async move {
            let r = match sup.call(|reply| SupMsg::Heal { reply }, None).await {
                Ok(ractor::rpc::CallResult::Success(r)) => r,
                _ => Err(RuntimeError::Broken("the supervisor stopped".into())),
            };
            let _ = me.cast(BatcherMsg::Healed(r));
        });
    }

    pub(super) fn healed(&mut self, r: Result<HealTimings, RuntimeError>) {
        match r {
            Ok(t) => self.health.healed(t),
            Err(e) => self.fail(format!("rebuilding after a lost stage failed: {e}")),
        }
    }

    /// Decoding cannot go on: every waiting input is refused, and every later one.
    pub(super) fn fail(&mut self, why: String) {
        tracing::error!("decoding has failed: {why}");
        self.health.set(Health::Failed { cause: why.clone() });
        for w in self.waiting.drain(..) {
            let e = RuntimeError::Broken(format!("decoding has failed: {why}"));
            w.reply.refuse(e);
        }
    }
}
