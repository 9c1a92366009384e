//! Where a batched input's answer goes ([`Reply`]): back to the caller of one feed, with what
//! the feed asked of its pass (its token chosen on the device, every position's logits, a
//! snapshot kept), or to a stream.

use super::{Answered, Keep, PickRequest};
use crate::stream::Continuation;
use nsactor_engine::error::RuntimeError;
use ractor::RpcReplyPort;

/// Where a session's answer goes.
pub(super) enum Reply {
    /// To the caller of one [`BatcherMsg::Feed`](super::BatcherMsg::Feed), with how its token is chosen, if on the
    /// device, whether it wants every position's logits, and the snapshot it keeps.
    Once {
        port: RpcReplyPort<Answered>,
        pick: Option<PickRequest>,
        every: bool,
        keep: Option<Keep>,
    },
    /// To a stream, which chooses its tokens on the device and may queue the session's next
    /// input.
    Stream(Continuation),
}

impl Reply {
    /// Answers the input with `e` instead of running it.
    pub(super) fn refuse(self, e: RuntimeError) {
        match self {
            Reply::Once { port, keep, .. } => {
                if let Some((_, k)) = keep {
                    let _ = k.send(Err(e.for_each_session()));
                }
                let _ = port.send(Err(e));
            }
            Reply::Stream(c) => c.refuse(e),
        }
    }

    /// Whether the input wants every position's logits (scoring runs only with scoring).
    pub(super) fn every(&self) -> bool {
        matches!(self, Reply::Once { every: true, .. })
    }

    /// How the input's token is chosen, for the cohort (a stream keeps its own).
    pub(super) fn pick(&mut self) -> Option<PickRequest> {
        match self {
            Reply::Once { pick, .. } => pick.take(),
            Reply::Stream(c) => Some(c.pick().clone()),
        }
    }
}
