//! [`AsyncDecoder`]: asynchronous decoding sessions through the layer actors, for servers on
//! the pipeline's runtime.

use super::batcher::{Answer, BatchStats, BatcherMsg, Closing, PickRequest, Picked};
use super::buckets::CohortBuckets;
use super::heal::{HealTimings, Health, HealthCell, RestartPolicy};
use super::stream::{DecodeStream, StreamPlan};
use nsactor_engine::error::RuntimeError;
use nsactor_pipeline::msg::{EdgeMsg, ask};
use nsactor_pipeline::topology::Children;
use nsactor_plugin_api::{DeviceTensor, IdAllocator, SessionId};
use ractor::ActorRef;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};

/// Asynchronous decoding through the layer actors, for servers running on the pipeline's
/// runtime ([`Pipeline::decoder`]). Cheap to clone; every method is a chain of actor calls, so
/// many sessions decode concurrently, each at its own layer.
#[derive(Clone)]
pub struct AsyncDecoder {
    pub(crate) children: Arc<RwLock<Children>>,
    pub(crate) batcher: ActorRef<BatcherMsg>,
    pub(crate) stats: Arc<BatchStats>,
    pub(crate) health: Arc<HealthCell>,
    pub(crate) ids: Arc<IdAllocator>,
    pub(crate) vocab: usize,
    /// Most input tokens of one pass ([`Batching::max_tokens`](super::batcher::Batching)):
    /// a longer prompt fed while no other session is open goes in chunks of this size.
    pub(crate) max_tokens: usize,
    /// Sessions whose work was given up ([`give_up`](AsyncDecoder::give_up)).
    pub(crate) given_up: Arc<GivenUp>,
}

/// Sessions whose client went away while their prompt was fed: no further pass runs for
/// them. A session's mark goes with its close.
#[derive(Debug, Default)]
pub(crate) struct GivenUp(std::sync::Mutex<std::collections::HashSet<SessionId>>);

impl GivenUp {
    fn set(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<SessionId>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets `session`'s mark (at its close).
    pub(crate) fn forget(&self, session: SessionId) {
        self.set().remove(&session);
    }
}

impl AsyncDecoder {
    pub(crate) fn children(&self) -> Children {
        self.children
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Vocabulary size of the model (length of a logits vector).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// A new session id.
    pub fn session(&self) -> SessionId {
        self.ids.session()
    }

    /// Gives up `session`'s work, its client gone: no pass not yet asked for runs for it (the
    /// one in flight ends as it would), so a feed, scoring or stream call still feeding its
    /// prompt ends at the next chunk with [`RuntimeError::Cancelled`], its numbers as they
    /// were. Close the session as ever: the close frees its states and forgets the mark.
    pub fn give_up(&self, session: SessionId) {
        self.given_up.set().insert(session);
    }

    /// [`RuntimeError::Cancelled`] where `session` was given up.
    fn going_on(&self, session: SessionId) -> Result<(), RuntimeError> {
        match self.given_up.set().contains(&session) {
            true => Err(RuntimeError::Cancelled(session.0)),
            false => Ok(()),
        }
    }

    /// Embeds `ids` (row-major `[batch, seq_len]`) for an evaluation or a probe, computed
    /// before it is handed on ([`nsactor_pipeline::layers::evaluate_layers`] says why).
    pub(crate) async fn embed(
        &self,
        ids: Vec<i64>,
        batch: usize,
        seq_len: usize,
    ) -> Result<DeviceTensor, RuntimeError> {
        let edge = self.children().edge;
        crate::order::pass(ask(&edge, "edge", |reply| EdgeMsg::SessionEmbed {
            ids,
            batch,
            seq_len,
            ready: true,
            reply,
        }))
        .await
    }

    /// Runs `ids` through `session` (a prompt, or one token); the last position's logits.
    /// Concurrent sessions are batched together at every layer (see [`batcher`]).
    pub async fn feed(&self, session: SessionId, ids: Vec<i64>) -> Result<Vec<f32>, RuntimeError> {
        match self.ask(session, ids, None).await? {
            Answer::Logits(l) => Ok(l),
            other => Err(unexpected(&other, "logits")),
        }
    }

    /// Most input tokens of one pass: [`feed_every`](Self::feed_every) takes at most this
    /// many.
    pub fn pass_tokens(&self) -> usize {
        self.max_tokens.max(1)
    }

    /// This decoder, and from now on every pass of the pipeline's batcher, with at most
    /// `tokens` input tokens per pass (by default [`PASS_FRAME_ROWS`](crate::batcher::PASS_FRAME_ROWS) /
    /// K, the rows the decoding GEMMs' batch-invariant kernels are chosen at; a larger pass
    /// runs the same kernels where they fit). Longer prompts are fed in passes of this size.
    pub fn with_pass_tokens(mut self, tokens: usize) -> Self {
        self.max_tokens = tokens.max(1);
        self.stats.pacer.cap(self.max_tokens);
        let _ = self.batcher.cast(BatcherMsg::PassTokens(self.max_tokens));
        self
    }

    /// This decoder, and from now on every handle of the pipeline's decoder, with at most
    /// `sessions` in one pass (by default [`MAX_BATCH`](crate::batching::MAX_BATCH)): more
    /// waiting sessions go in further cohorts, as many in flight at once as the pipeline has
    /// stages.
    pub fn with_pass_sessions(self, sessions: usize) -> Self {
        let _ = self.batcher.cast(BatcherMsg::PassSessions(sessions));
        self
    }

    /// This decoder, and from now on every handle of the pipeline's decoder, with a prompt fed
    /// while other sessions are open cut into chunks of at most `tokens` (by default
    /// [`CHUNK_FRAME_ROWS`](crate::batching::CHUNK_FRAME_ROWS) / K): the others' decoding steps
    /// run between its chunks, each waiting for one chunk at most. The chunks are shorter
    /// where a pass of this many would take more than the pacer's share of a decoding step
    /// ([`with_chunk_share`](Self::with_chunk_share)).
    pub fn with_chunk_tokens(self, tokens: usize) -> Self {
        self.stats.pacer.set_max(tokens);
        self.stats.pacer.cap(self.pass_tokens());
        self
    }

    /// This decoder, and every handle of the pipeline's decoder, with a prompt's chunk beside
    /// decoding streams held to `share` of one decoding step's time (its length halved or
    /// doubled between [`MIN_CHUNK`](crate::pacer::MIN_CHUNK) tokens and
    /// [`with_chunk_tokens`](Self::with_chunk_tokens)'s; [`crate::pacer`]). 0: every chunk
    /// that long.
    pub fn with_chunk_share(self, share: f64) -> Self {
        self.stats.pacer.set_share(share);
        self
    }

    /// Most input tokens of the next chunk of a prompt fed while other sessions are open
    /// ([`with_chunk_tokens`](Self::with_chunk_tokens), paced by [`crate::pacer`]).
    pub fn chunk_tokens(&self) -> usize {
        self.stats.pacer.chunk().clamp(1, self.pass_tokens())
    }

    /// What paces the chunks of prompts fed beside decoding streams (shared by every handle).
    pub fn pacer(&self) -> &crate::pacer::ChunkPacer {
        &self.stats.pacer
    }

    /// Runs `ids` (at most [`pass_tokens`](Self::pass_tokens)) through `session` in one pass
    /// and answers every position's logits, position after position (`ids.len() × V`): the
    /// logits after each input, equal to those of feeding the inputs one at a time. Scoring
    /// inputs batch with each other, never with other inputs.
    pub async fn feed_every(
        &self,
        session: SessionId,
        ids: Vec<i64>,
    ) -> Result<Vec<f32>, RuntimeError> {
        if ids.len() > self.pass_tokens() {
            return Err(RuntimeError::Runtime(format!(
                "{} inputs to score in one pass; a pass takes at most {}",
                ids.len(),
                self.pass_tokens()
            )));
        }
        match self.ask_once(session, ids, None, true, None).await? {
            Answer::Every(l) => Ok(l),
            other => Err(unexpected(&other, "every position's logits")),
        }
    }

    /// Runs `ids` through `session` and chooses its next token on the device as `pick` says:
    /// only the token (and the logits, when `pick.want_logits`) cross to the host.
    pub async fn feed_pick(
        &self,
        session: SessionId,
        ids: Vec<i64>,
        pick: PickRequest,
    ) -> Result<Picked, RuntimeError> {
        match self.ask(session, ids, Some(pick)).await? {
            Answer::Picked(p) => Ok(p),
            other => Err(unexpected(&other, "a token")),
        }
    }

    /// Runs `ids` through `session`, then the tokens `plan` chooses, each fed back by the
    /// batcher as the session's next input (`super::stream`). The tokens come back on the
    /// stream; closing the session ([`close`](Self::close)) ends it. A long prompt is fed in
    /// chunks first, as [`feed`](Self::feed) does.
    pub async fn stream(
        &self,
        session: SessionId,
        ids: Vec<i64>,
        plan: StreamPlan,
    ) -> Result<DecodeStream, RuntimeError> {
        // Counted by the pacer while its chunks are fed (its last goes with the stream).
        let feeding = self.stats.pacer.feeding();
        let ids = self.feed_all_but_last_chunk(session, ids).await?;
        drop(feeding);
        self.going_on(session)?;
        let batcher = self.batcher.clone();
        let resume = Box::new(move || {
            let _ = batcher.cast(BatcherMsg::Resume { session });
        });
        let (cont, rx) = super::stream::stream(plan, resume);
        self.batcher
            .cast(BatcherMsg::Stream { session, ids, cont })
            .map_err(|_| RuntimeError::Broken("the decode batcher stopped".into()))?;
        Ok(rx)
    }

    /// Feeds `ids`; a prompt longer than one pass's budget goes in chunks, the last with
    /// `pick`.
    async fn ask(
        &self,
        session: SessionId,
        ids: Vec<i64>,
        pick: Option<PickRequest>,
    ) -> Result<Answer, RuntimeError> {
        // Counted by the pacer as a prompt being fed until its last pass is answered.
        let _feeding = (ids.len() > 1).then(|| self.stats.pacer.feeding());
        let ids = self.feed_all_but_last_chunk(session, ids).await?;
        self.ask_once(session, ids, pick, false, None).await
    }

    /// Feeds `ids` in chunks but the last, which it returns (the neuron states carry from
    /// chunk to chunk, as they do from token to token): of one pass's budget while no other
    /// session is open, else of [`chunk_tokens`](Self::chunk_tokens), so the others' decoding
    /// steps run between the chunks (chunked prefill; [`next_piece`]). How a prompt is cut
    /// changes none of its numbers.
    pub(crate) async fn feed_all_but_last_chunk(
        &self,
        session: SessionId,
        mut ids: Vec<i64>,
    ) -> Result<Vec<i64>, RuntimeError> {
        let mut fed = false;
        loop {
            // Open sessions count this one once it has fed.
            let others = self.open_sessions().saturating_sub(u64::from(fed));
            let piece = next_piece(
                ids.len(),
                others > 0,
                self.chunk_tokens(),
                self.pass_tokens(),
            );
            if piece >= ids.len() {
                return Ok(ids);
            }
            let rest = ids.split_off(piece);
            self.ask_once(session, ids, None, false, None).await?;
            fed = true;
            ids = rest;
        }
    }

    pub(crate) async fn ask_once(
        &self,
        session: SessionId,
        ids: Vec<i64>,
        pick: Option<PickRequest>,
        every: bool,
        keep: Option<crate::batcher::Keep>,
    ) -> Result<Answer, RuntimeError> {
        self.going_on(session)?;
        match self
            .batcher
            .call(
                |reply| BatcherMsg::Feed {
                    session,
                    ids,
                    pick,
                    every,
                    keep,
                    port: reply,
                },
                None,
            )
            .await
        {
            Ok(ractor::rpc::CallResult::Success(r)) => r,
            _ => Err(RuntimeError::Broken("the decode batcher stopped".into())),
        }
    }

    /// Sessions whose neuron states the actors hold (fed, and not closed yet).
    pub fn open_sessions(&self) -> u64 {
        self.stats.open.load(Ordering::Relaxed)
    }

    /// Seconds the cohorts have spent so far in `[embed, layers, decode, whole cohort]`, as the
    /// batcher sees them ([`CohortPhases`](super::cohort::CohortPhases)).
    pub fn cohort_phases(&self) -> [f64; 4] {
        self.stats.phases.seconds()
    }

    /// From now on, cohorts are padded up to `buckets`.
    pub fn set_buckets(&self, buckets: CohortBuckets) {
        let _ = self.batcher.cast(BatcherMsg::Buckets(buckets));
    }

    /// From now on, a lost stage is rebuilt as often as `policy` allows (`super::heal`).
    pub fn set_heal_policy(&self, policy: RestartPolicy) {
        let _ = self.batcher.cast(BatcherMsg::Policy(policy));
    }

    /// Where decoding stands: serving, rebuilding after a lost stage, or failed.
    pub fn health(&self) -> Health {
        self.health.state()
    }

    /// Every change of [`health`](Self::health) from now on.
    pub fn health_changes(&self) -> tokio::sync::watch::Receiver<Health> {
        self.health.subscribe()
    }

    /// Rebuilds after a lost stage that brought decoding back.
    pub fn recoveries(&self) -> u64 {
        self.health.recoveries()
    }

    /// The last of those rebuilds, by phase.
    pub fn last_heal(&self) -> Option<HealTimings> {
        self.health.last_heal()
    }

    /// Pad rows run so far to fill cohorts up to their bucket.
    pub fn padded_rows(&self) -> u64 {
        self.stats.padded.load(Ordering::Relaxed)
    }

    /// Cohorts run so far and the session inputs they carried (their ratio is the mean batch).
    pub fn batch_counts(&self) -> (u64, u64) {
        (
            self.stats.cohorts.load(Ordering::Relaxed),
            self.stats.inputs.load(Ordering::Relaxed),
        )
    }

    /// Cohorts launched so far when the launch window ran out with open sessions still away
    /// ([`BatchStats::window_launches`]).
    pub fn window_launches(&self) -> u64 {
        self.stats.window_launches.load(Ordering::Relaxed)
    }

    /// Frees `session`'s neuron states in every actor (after its input in flight, if any).
    pub async fn close(&self, session: SessionId) {
        self.begin_close(session).await;
    }

    /// [`close`](Self::close) in two halves: the close is queued at the batcher now, before
    /// anything this caller does next (a new session admitted in its place is ordered after
    /// it), and the returned future finishes when the states are freed.
    pub fn begin_close(&self, session: SessionId) -> impl Future<Output = ()> + use<> {
        self.given_up.forget(session);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let _ = self.batcher.cast(BatcherMsg::Close(Closing {
            session,
            reply: tx.into(),
            keep: None,
        }));
        async move {
            let _ = rx.await;
        }
    }
}

/// The error for an answer of another kind than the one asked for.
fn unexpected(got: &Answer, wanted: &str) -> RuntimeError {
    let got = match got {
        Answer::Logits(_) => "the last position's logits",
        Answer::Every(_) => "every position's logits",
        Answer::Picked(_) => "a token",
    };
    RuntimeError::Runtime(format!("{got} instead of {wanted}"))
}

/// The length of the next piece of `left` prompt tokens: a pass's budget (`pass`) alone,
/// `chunk` tokens beside other open sessions (their steps run between the pieces).
///
/// Cutting the rest into powers of two, so that prompts of different lengths meet in a few
/// lengths and share passes, was measured on the H200 (s45, g25/g26): at eight chatting
/// clients those passes held 1.1 sessions on average, so it only multiplied the passes.
pub(crate) fn next_piece(left: usize, others: bool, chunk: usize, pass: usize) -> usize {
    let most = if others { chunk } else { pass };
    left.min(most.max(1))
}

#[cfg(test)]
mod tests {
    use super::next_piece;

    fn cut(mut left: usize, others: bool) -> Vec<usize> {
        let mut out = Vec::new();
        while left > 0 {
            let p = next_piece(left, others, 128, 1024);
            out.push(p);
            left -= p;
        }
        out
    }

    #[test]
    fn a_prompt_beside_others_goes_in_chunks_and_alone_in_passes() {
        assert_eq!(cut(100, true), vec![100]);
        assert_eq!(cut(300, true), vec![128, 128, 44]);
        assert_eq!(cut(128, true), vec![128]);
        assert_eq!(cut(1, true), vec![1]);
        assert_eq!(cut(3000, false), vec![1024, 1024, 952]);
        assert_eq!(cut(100, false), vec![100]);
    }
}
