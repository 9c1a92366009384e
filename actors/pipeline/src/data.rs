//! `DataActor`: owns the sampler. It answers each step's micro-batches with the cursor that
//! follows them, and prepares the next step's batches in the background meanwhile (reading
//! memory-mapped shards can fault pages in, so it runs on the blocking pool).

use nsactor_data::{Cursor, Sampler};
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::Batch;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::task::JoinHandle;

/// One step's rows: `micro_batches` batches of `batch_size × seq_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub micro_batches: usize,
    pub batch_size: usize,
    pub seq_len: usize,
}

/// A step's batches with the cursor before and after them.
pub struct Rows {
    pub batches: Vec<Batch>,
    pub before: Cursor,
    pub after: Cursor,
}

pub type Drawn = Result<Rows, RuntimeError>;

pub enum DataMsg {
    /// The next step's micro-batches and the cursor after them.
    Next {
        shape: Shape,
        reply: RpcReplyPort<Drawn>,
    },
    /// Continue from `cursor` (resume, rollback).
    Seek {
        cursor: Cursor,
        reply: RpcReplyPort<Result<(), RuntimeError>>,
    },
}

// Local only: the cluster build of ractor asks every message type to say so.
impl ractor::Message for DataMsg {}

pub struct DataActor;

type Prefetch = JoinHandle<(Sampler, Cursor, Drawn)>;

pub struct DataState {
    sampler: Option<Sampler>,
    /// Batches drawn ahead for `Shape`, from the cursor held beside them.
    prefetch: Option<(Shape, Prefetch)>,
}

fn draw(mut sampler: Sampler, shape: Shape) -> (Sampler, Cursor, Drawn) {
    let before = sampler.cursor();
    let r = (0..shape.micro_batches)
        .map(|_| sampler.next_batch(shape.batch_size, shape.seq_len))
        .collect::<Result<Vec<_>, _>>()
        .map(|batches| Rows {
            batches,
            before,
            after: sampler.cursor(),
        })
        .map_err(RuntimeError::from);
    (sampler, before, r)
}

impl DataState {
    /// Takes the sampler back from a running prefetch, rewound to where the prefetch began.
    async fn settle(&mut self) -> Result<(), RuntimeError> {
        if let Some((_, job)) = self.prefetch.take() {
            let (mut sampler, before, _) = job
                .await
                .map_err(|e| RuntimeError::Runtime(format!("data prefetch: {e}")))?;
            sampler.resume(before)?;
            self.sampler = Some(sampler);
        }
        Ok(())
    }

    async fn next(&mut self, shape: Shape) -> Drawn {
        let (sampler, drawn) = match self.prefetch.take() {
            Some((s, job)) if s == shape => {
                let (sampler, _, drawn) = job
                    .await
                    .map_err(|e| RuntimeError::Runtime(format!("data prefetch: {e}")))?;
                (sampler, drawn)
            }
            other => {
                self.prefetch = other;
                self.settle().await?;
                let sampler = self
                    .sampler
                    .take()
                    .ok_or_else(|| RuntimeError::Broken("the sampler was lost".into()))?;
                let (sampler, _, drawn) = tokio::task::spawn_blocking(move || draw(sampler, shape))
                    .await
                    .map_err(|e| RuntimeError::Runtime(format!("data: {e}")))?;
                (sampler, drawn)
            }
        };
        if drawn.is_ok() {
            self.prefetch = Some((
                shape,
                tokio::task::spawn_blocking(move || draw(sampler, shape)),
            ));
        } else {
            self.sampler = Some(sampler);
        }
        drawn
    }
}

impl Actor for DataActor {
    type Msg = DataMsg;
    type State = DataState;
    type Arguments = Sampler;

    async fn pre_start(
        &self,
        _myself: ActorRef<DataMsg>,
        sampler: Sampler,
    ) -> Result<DataState, ActorProcessingErr> {
        Ok(DataState {
            sampler: Some(sampler),
            prefetch: None,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<DataMsg>,
        msg: DataMsg,
        s: &mut DataState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DataMsg::Next { shape, reply } => {
                let _ = reply.send(s.next(shape).await);
            }
            DataMsg::Seek { cursor, reply } => {
                let r = async {
                    s.settle().await?;
                    let sampler = s
                        .sampler
                        .as_mut()
                        .ok_or_else(|| RuntimeError::Broken("the sampler was lost".into()))?;
                    Ok(sampler.resume(cursor)?)
                }
                .await;
                let _ = reply.send(r);
            }
        }
        Ok(())
    }
}
