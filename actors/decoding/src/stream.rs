//! Decoding streams: a session that hands the batcher its prompt once and gets every chosen
//! token back on a channel. The batcher feeds each token back as the session's next input
//! itself, in the same message that answers the cohort, so a running session is never away
//! from the batcher between steps: every step is one cohort of all running sessions, and no
//! step waits for a session's task to be scheduled, its client to read, or the launch window
//! (as vLLM's engine loop keeps its running requests, apart from the detokenizing front end).
//!
//! A stream ends after its token budget, at one of its end tokens, on an error, or when its
//! session is closed; a receiver that is dropped ends it at the next answer. A stream whose
//! reader falls [`MAX_UNREAD`] tokens behind (its client does not read) is parked: the batcher
//! holds its next input until the reader catches up, so a stalled client costs no steps.

use super::cohort::{Answer, Answered, PickRequest, Picked};
use nsactor_engine::error::RuntimeError;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::mpsc;

/// Most tokens a stream runs ahead of its reader before the batcher parks it.
pub const MAX_UNREAD: usize = 16;

/// One chosen token, or why the stream stopped early.
pub type StreamItem = Result<Picked, RuntimeError>;

/// How a stream chooses its tokens: the first as `pick` says, then up to `more` after it,
/// ending after any of `end_tokens` (which is still sent).
#[derive(Debug, Clone, PartialEq)]
pub struct StreamPlan {
    pub pick: PickRequest,
    pub more: usize,
    pub end_tokens: Vec<i64>,
}

/// The batcher's side of a stream: how the next token is chosen, how many more may be chosen,
/// and where they go.
pub struct Continuation {
    pick: PickRequest,
    /// Tokens still to choose after the answer in flight.
    remaining: usize,
    /// A chosen token among these ends the stream (it is still sent).
    end_tokens: Vec<i64>,
    tx: mpsc::UnboundedSender<StreamItem>,
    /// Tokens sent and not yet read.
    unread: Arc<AtomicUsize>,
}

impl Continuation {
    /// Its reader is [`MAX_UNREAD`] tokens behind: hold its next input.
    pub(super) fn lagging(&self) -> bool {
        self.unread.load(Ordering::SeqCst) >= MAX_UNREAD
    }

    /// The pick the session's next input carries.
    pub(super) fn pick(&self) -> &PickRequest {
        &self.pick
    }

    /// Ends the stream with `e` (before it ran, or in its place of a token). Counted unread
    /// like a token, so the reader's count of what it took stays exact.
    pub(super) fn refuse(self, e: RuntimeError) {
        self.unread.fetch_add(1, Ordering::SeqCst);
        let _ = self.tx.send(Err(e));
    }

    /// Sends `answer` on; the session's next input and the continuation when the stream goes
    /// on (the chosen token, its history and step advanced).
    pub(super) fn answer(mut self, answer: Answered) -> Option<(Vec<i64>, Continuation)> {
        let picked = match answer {
            Ok(Answer::Picked(p)) => p,
            Ok(Answer::Logits(_) | Answer::Every(_)) => {
                self.refuse(RuntimeError::Runtime(
                    "a decoding stream got logits instead of a token".into(),
                ));
                return None;
            }
            Err(e) => {
                self.refuse(e);
                return None;
            }
        };
        let token = picked.token;
        let goes_on = self.remaining > 0 && !self.end_tokens.contains(&token);
        self.unread.fetch_add(1, Ordering::SeqCst);
        if self.tx.send(Ok(picked)).is_err() || !goes_on {
            return None;
        }
        self.remaining -= 1;
        self.pick.advance(token);
        Some((vec![token], self))
    }
}

/// The session's side of a stream: the chosen tokens in order
/// ([`AsyncDecoder::stream`](super::AsyncDecoder::stream)).
pub struct DecodeStream {
    rx: mpsc::UnboundedReceiver<StreamItem>,
    unread: Arc<AtomicUsize>,
    /// Asks the batcher to take a parked stream's next input (a no-op when it is not parked).
    resume: Box<dyn Fn() + Send + Sync>,
}

impl DecodeStream {
    /// The next chosen token; `None` once the stream has ended (its budget spent, an end
    /// token sent, or its session closed).
    pub async fn next(&mut self) -> Option<StreamItem> {
        let item = self.rx.recv().await?;
        // Reading below the limit is what may unpark it; the batcher checks after each send,
        // so whichever of the two comes second sees the other's count.
        if self.unread.fetch_sub(1, Ordering::SeqCst) == MAX_UNREAD {
            (self.resume)();
        }
        Some(item)
    }
}

/// A stream that runs as `plan` says; `resume` asks the batcher to take it back when parked.
pub(super) fn stream(
    plan: StreamPlan,
    resume: Box<dyn Fn() + Send + Sync>,
) -> (Continuation, DecodeStream) {
    let (tx, rx) = mpsc::unbounded_channel();
    let unread = Arc::new(AtomicUsize::new(0));
    let c = Continuation {
        pick: plan.pick,
        remaining: plan.more,
        end_tokens: plan.end_tokens,
        tx,
        unread: unread.clone(),
    };
    (c, DecodeStream { rx, unread, resume })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nsactor_engine::decode::SamplingParams;

    fn picked(token: i64) -> Answered {
        Ok(Answer::Picked(Picked {
            token,
            logprob: -1.0,
            logits: None,
        }))
    }

    fn plan(more: usize, end_tokens: Vec<i64>) -> StreamPlan {
        StreamPlan {
            pick: PickRequest::new(
                SamplingParams {
                    repetition_penalty: 1.2,
                    frequency_penalty: 0.5,
                    ..SamplingParams::greedy()
                },
                &[7],
                &[],
                Vec::new(),
                false,
            ),
            more,
            end_tokens,
        }
    }

    #[tokio::test]
    async fn a_stream_feeds_each_token_back_until_its_budget_or_an_end_token() {
        let (c, mut rx) = stream(plan(2, vec![2]), Box::new(|| ()));
        let (ids, c) = c.answer(picked(5)).expect("goes on");
        assert_eq!(ids, [5]);
        assert_eq!(
            (c.pick().history.clone(), c.pick().generated.clone()),
            (vec![7, 5], vec![5])
        );
        assert_eq!(c.pick().step, 1);
        let (_, c) = c.answer(picked(6)).expect("one more");
        // The budget is spent: the third token is sent and the stream stops.
        assert!(c.answer(picked(8)).is_none());
        let got: Vec<i64> = [rx.next().await, rx.next().await, rx.next().await]
            .into_iter()
            .map(|p| p.unwrap().unwrap().token)
            .collect();
        assert_eq!(got, [5, 6, 8]);
        assert!(rx.next().await.is_none(), "the stream ended");

        let (c, mut rx) = stream(plan(10, vec![2]), Box::new(|| ()));
        assert!(c.answer(picked(2)).is_none(), "an end token stops it");
        assert_eq!(rx.next().await.unwrap().unwrap().token, 2);
        assert!(rx.next().await.is_none());

        let (c, mut rx) = stream(plan(10, vec![2]), Box::new(|| ()));
        let (_, c) = c.answer(picked(5)).expect("goes on");
        let e = c.answer(Err(RuntimeError::Broken("gone".into())));
        assert!(e.is_none());
        assert_eq!(rx.next().await.unwrap().unwrap().token, 5);
        assert!(rx.next().await.unwrap().is_err());
        // The error counted as sent, so the reader's count ends at zero, not wrapped.
        assert_eq!(rx.unread.load(Ordering::SeqCst), 0);

        let (c, rx) = stream(plan(10, vec![]), Box::new(|| ()));
        drop(rx);
        assert!(c.answer(picked(5)).is_none(), "nobody listens");
    }

    /// The stream asks to be resumed exactly when its reader brings the unread count below the
    /// limit, and says it lags from the limit on.
    #[tokio::test]
    async fn a_stream_lags_at_the_limit_and_asks_back_when_read_below_it() {
        let asked = Arc::new(AtomicUsize::new(0));
        let a = asked.clone();
        let resume = Box::new(move || {
            a.fetch_add(1, Ordering::SeqCst);
        });
        let (mut c, mut rx) = stream(plan(100, vec![]), resume);
        for t in 0..MAX_UNREAD {
            assert!(!c.lagging(), "{t} unread");
            c = c.answer(picked(5)).expect("goes on").1;
        }
        assert!(c.lagging());
        rx.next().await.unwrap().unwrap();
        assert!(!c.lagging());
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        rx.next().await.unwrap().unwrap();
        assert_eq!(asked.load(Ordering::SeqCst), 1, "only at the crossing");
    }
}
