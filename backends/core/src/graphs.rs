//! A layer's decoding steps captured once and replayed ([`SnnOps::capture`]: CUDA graphs).
//!
//! A decoding server calls a layer with the same sessions token after token. The first call
//! of a set of sessions runs as usual (it also fills the lazily made caches: the weights'
//! GEMM operands, kernel metadata); the second is captured, with its inputs — the hidden
//! state `h` and the sessions' four membrane states — as the graph's input buffers, and ends
//! with the new states copied back into those state buffers. From then on, a call is one
//! replay: `h` and the states are copied into the graph's buffers unless they already are
//! them (the states always are while the set of sessions stays the same; `h` is when the
//! layer before was replayed too), and the output is the graph's output buffer.
//!
//! What a graph's buffers hold is rewritten by each replay, so the tensors handed out (the
//! output, the states put back into the session table) are read before the next call of the
//! same sessions — as a decoding pass does. New parameters or a load drop every graph. A
//! session that closes drops the graphs of the sets it was in while other sessions of the set
//! live on (their states are views of the graph's buffers). A set of one session leaves its
//! graphs free when it closes, and a later new set of the same shape takes them over: its first
//! call copies its own `h` and states in and replays, so a new request does not pay an
//! uncaptured call and a capture (≈ 10 ms each at the 0.9B).
//!
//! A layer's graph may read the previous layer's output buffer in place (captured that way when
//! the previous layer was replayed), so graphs are taken over only as the chains they were
//! captured in: the first layer a new set reaches picks the most recently freed graph of its
//! shape (or none), and every later layer takes over the graph of that same freed set or none
//! ([`TAKEN_OVER`], shared by every layer of the process). Otherwise two sets could come to
//! share a buffer that one writes while the other reads, on two stages' streams of one GPU.
//!
//! At most [`GRAPHS`] sets of sessions keep graphs per layer (least recently used first out),
//! and as many free graphs are kept, each for calls of at most `NSACTOR_DECODE_GRAPH_ROWS` token
//! rows (sessions × input tokens; the `decode_graph_rows` knob, 64 by default);
//! `NSACTOR_DECODE_GRAPHS=off` turns them off. So the chunks of a prompt fed beside decoding
//! streams (`nsactor_decoding::pacer`: 8–64 tokens of one session, call after call with the
//! same key) replay too: one graph launch a layer where the pass uncaptured launches each of its
//! kernels from the host.
//!
//! [`SnnOps::capture`]: nsactor_kernels::GraphOps::capture

use burn::tensor::{Tensor, TensorPrimitive};
use nsactor_kernels::{KernelError, SnnOps, StepGraph};

/// Sets of sessions with a graph, per layer.
pub const GRAPHS: usize = 4;
/// Keys remembered as having run once uncaptured.
const WARM: usize = 4;
/// Calls between tries after a capture failed.
const RETRY_AFTER: u32 = 64;
/// New sets of sessions whose take-over decision is remembered (oldest out).
const DECISIONS: usize = 64;

/// For each new set of sessions (and shape), the freed set whose graphs it takes over in every
/// layer, or `None` where the first layer it reached had no free graph of its shape.
static TAKEN_OVER: std::sync::Mutex<Vec<(Key, Option<Vec<u64>>)>> =
    std::sync::Mutex::new(Vec::new());

/// Whether decoding steps are captured, and up to how many token rows (sessions × input
/// tokens): from
/// the `decode_graphs` and `decode_graph_rows` knobs of [`nsactor_kernels::tuning`]
/// (`NSACTOR_DECODE_GRAPHS=off` disables, `NSACTOR_DECODE_GRAPH_ROWS`).
pub fn graph_rows() -> usize {
    let t = nsactor_kernels::tuning::current();
    if t.decode_graphs {
        t.decode_graph_rows
    } else {
        0
    }
}

#[derive(Clone, PartialEq, Eq, Debug)]
struct Key {
    sessions: Vec<u64>,
    dims: [usize; 3],
}

struct Entry<B: SnnOps> {
    key: Key,
    h_in: Tensor<B, 3>,
    state_in: Vec<Tensor<B, 2>>,
    h_out: Tensor<B, 3>,
    graph: StepGraph,
}

/// One layer's captured decoding steps.
pub struct DecodeGraphs<B: SnnOps> {
    /// Most recently used first.
    entries: Vec<Entry<B>>,
    /// Graphs whose sessions have all closed, most recently freed first: a new set of sessions
    /// of the same shape takes one over.
    free: Vec<Entry<B>>,
    /// The last [`WARM`] keys that ran uncaptured, most recent first: the next call with one of
    /// them is captured. More than one, so a decoding cohort's next step still finds its key
    /// after a prompt's pass ran between.
    warm: Vec<Key>,
    /// Calls left before a failed key is tried again, and the key.
    failed: Option<(Key, u32)>,
    /// Free graphs taken over so far.
    taken_over: usize,
}

impl<B: SnnOps> Default for DecodeGraphs<B> {
    fn default() -> Self {
        DecodeGraphs {
            entries: Vec::new(),
            free: Vec::new(),
            warm: Vec::new(),
            failed: None,
            taken_over: 0,
        }
    }
}

fn prim<B: SnnOps, const D: usize>(t: Tensor<B, D>) -> B::FloatTensorPrimitive {
    t.into_primitive().tensor()
}

impl<B: SnnOps> DecodeGraphs<B> {
    /// Graphs held by open sets of sessions (free ones not counted).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops every graph (new parameters, a load, cleared sessions).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.free.clear();
        self.warm.clear();
        self.failed = None;
    }

    /// Graphs free for a new set of sessions.
    pub fn free_len(&self) -> usize {
        self.free.len()
    }

    /// Free graphs taken over by new sets of sessions so far.
    pub fn taken_over(&self) -> usize {
        self.taken_over
    }

    /// The free graph `key` takes over, if any: the one of the freed set the first layer chose
    /// for `key` (see the module documentation), choosing now where this is that first layer.
    fn take_over(&self, key: &Key) -> Option<usize> {
        let free: Vec<&Key> = self.free.iter().map(|e| &e.key).collect();
        let mut decisions = TAKEN_OVER.lock().unwrap_or_else(|e| e.into_inner());
        decide(&mut decisions, &free, key)
    }

    /// Frees the graphs of the set of `session` alone; drops those of sets that include it with
    /// others (their states are views of the graph's buffers).
    pub fn close(&mut self, session: u64) {
        let mut kept = Vec::with_capacity(self.entries.len());
        for e in std::mem::take(&mut self.entries) {
            if e.key.sessions == [session] {
                self.free.insert(0, e);
            } else if !e.key.sessions.contains(&session) {
                kept.push(e);
            }
        }
        self.entries = kept;
        // One-token graphs first (a new client's steps take them over), then most recently
        // freed first within each kind.
        self.free.sort_by_key(|e| e.key.dims[0] != 1);
        self.free.truncate(GRAPHS);
        TAKEN_OVER
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(k, _)| !k.sessions.contains(&session));
        self.warm.retain(|k| !k.sessions.contains(&session));
    }

    /// `f(h, state)` — the layer's step — replayed, captured or run as it is (see the module
    /// documentation); the result is the same either way.
    pub fn step(
        &mut self,
        sessions: &[u64],
        h: Tensor<B, 3>,
        state: Vec<Tensor<B, 2>>,
        device: &B::Device,
        f: impl Fn(Tensor<B, 3>, Vec<Tensor<B, 2>>) -> (Tensor<B, 3>, Vec<Tensor<B, 2>>),
    ) -> (Tensor<B, 3>, Vec<Tensor<B, 2>>) {
        let dims = h.dims();
        // Token rows: a decoding step of B sessions has B, a prompt's chunk of T tokens T.
        if !B::captures_steps() || dims[0] * dims[1] > graph_rows() {
            return f(h, state);
        }
        let key = Key {
            sessions: sessions.to_vec(),
            dims,
        };
        if let Some(i) = self.entries.iter().position(|e| e.key == key) {
            let entry = self.entries.remove(i);
            return self
                .replay_first(entry, h, state, f)
                .unwrap_or_else(|(h, state, f)| f(h, state));
        }
        // A new set of sessions takes over a free graph of its shape: the copies in and one
        // replay instead of a call uncaptured and a capture.
        if let Some(i) = self.take_over(&key) {
            let mut entry = self.free.remove(i);
            entry.key = key;
            let out = self.replay_first(entry, h, state, f);
            self.taken_over += usize::from(out.is_ok());
            return out.unwrap_or_else(|(h, state, f)| f(h, state));
        }
        if let Some((k, left)) = self.failed.as_mut()
            && *k == key
        {
            if *left > 0 {
                *left -= 1;
                return f(h, state);
            }
            self.failed = None;
        }
        match self.warm.iter().position(|k| *k == key) {
            Some(i) => {
                self.warm.remove(i);
            }
            None => {
                self.warm.insert(0, key);
                self.warm.truncate(WARM);
                return f(h, state);
            }
        }
        // The graph's input buffers are copied into whole: contiguous ones.
        let contiguous = |t| B::contiguous(t);
        let h_in = Tensor::from_primitive(TensorPrimitive::Float(contiguous(prim(h.clone()))));
        let state_in = state
            .iter()
            .map(|s| Tensor::from_primitive(TensorPrimitive::Float(contiguous(prim(s.clone())))))
            .collect();
        match self.capture(key.clone(), h_in, state_in, device, &f) {
            Ok(entry) => {
                let out = (entry.h_out.clone(), entry.state_in.clone());
                self.entries.insert(0, entry);
                self.entries.truncate(GRAPHS);
                out
            }
            Err(e) => {
                eprintln!(
                    "nsactor: decoding step not captured ({} sessions, {dims:?}), running uncaptured: {e}",
                    sessions.len()
                );
                self.failed = Some((key, RETRY_AFTER));
                f(h, state)
            }
        }
    }

    /// Replays `entry` on `h` and `state` and keeps it as the most recently used; where the
    /// replay is refused, says so and hands the inputs back to run uncaptured.
    #[allow(clippy::type_complexity)]
    fn replay_first<F>(
        &mut self,
        entry: Entry<B>,
        h: Tensor<B, 3>,
        state: Vec<Tensor<B, 2>>,
        f: F,
    ) -> Result<(Tensor<B, 3>, Vec<Tensor<B, 2>>), (Tensor<B, 3>, Vec<Tensor<B, 2>>, F)> {
        match self.replay(&entry, h.clone(), state.clone()) {
            Ok(()) => {
                let out = (entry.h_out.clone(), entry.state_in.clone());
                self.entries.insert(0, entry);
                self.entries.truncate(GRAPHS);
                Ok(out)
            }
            Err(e) => {
                eprintln!("nsactor: decoding graph replay refused, running uncaptured: {e}");
                Err((h, state, f))
            }
        }
    }

    fn replay(
        &self,
        entry: &Entry<B>,
        h: Tensor<B, 3>,
        state: Vec<Tensor<B, 2>>,
    ) -> Result<(), KernelError> {
        let mut inputs = vec![(prim(h), prim(entry.h_in.clone()))];
        inputs.extend(
            state
                .into_iter()
                .zip(&entry.state_in)
                .map(|(s, d)| (prim(s), prim(d.clone()))),
        );
        B::replay(&entry.graph, inputs, &entry.written())
    }

    fn capture(
        &self,
        key: Key,
        h_in: Tensor<B, 3>,
        state_in: Vec<Tensor<B, 2>>,
        device: &B::Device,
        f: &impl Fn(Tensor<B, 3>, Vec<Tensor<B, 2>>) -> (Tensor<B, 3>, Vec<Tensor<B, 2>>),
    ) -> Result<Entry<B>, KernelError> {
        let mut read = vec![prim(h_in.clone())];
        read.extend(state_in.iter().map(|s| prim(s.clone())));
        let (h_out, graph) = B::capture(device, &read, || {
            let (h_out, state_out) = f(h_in.clone(), state_in.clone());
            for (s, d) in state_out.into_iter().zip(&state_in) {
                B::capture_copy(prim(s), &prim(d.clone()))?;
            }
            Ok::<_, KernelError>(h_out)
        })?;
        let h_out = h_out?;
        let entry = Entry {
            key,
            h_in,
            state_in,
            h_out,
            graph,
        };
        // Nothing ran while capturing: the first replay computes this step.
        B::replay(&entry.graph, Vec::new(), &entry.written())?;
        Ok(entry)
    }
}

/// [`DecodeGraphs::take_over`] on the free graphs' keys (most recently freed first) with the
/// decisions so far: the index of the free graph `key` takes over, if any.
fn decide(decisions: &mut Vec<(Key, Option<Vec<u64>>)>, free: &[&Key], key: &Key) -> Option<usize> {
    if let Some((_, from)) = decisions.iter().find(|(k, _)| k == key) {
        let from = from.as_ref()?;
        return free
            .iter()
            .position(|k| k.dims == key.dims && &k.sessions == from);
    }
    let i = free.iter().position(|k| k.dims == key.dims);
    decisions.push((key.clone(), i.map(|i| free[i].sessions.clone())));
    if decisions.len() > DECISIONS {
        decisions.remove(0);
    }
    i
}

impl<B: SnnOps> Entry<B> {
    /// The buffers a replay rewrites that the caller reads: the output and the states.
    fn written(&self) -> Vec<B::FloatTensorPrimitive> {
        let mut w = vec![prim(self.h_out.clone())];
        w.extend(self.state_in.iter().map(|s| prim(s.clone())));
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Tensor;

    type B = burn_ndarray::NdArray<f32>;

    #[test]
    fn every_layer_takes_over_the_graphs_of_the_set_the_first_one_chose() {
        let key = |s: &[u64]| Key {
            sessions: s.to_vec(),
            dims: [1, 1, 4],
        };
        let other_shape = Key {
            sessions: vec![9],
            dims: [1, 2, 4],
        };
        let (a, b, n, m) = (key(&[1]), key(&[2]), key(&[5]), key(&[6]));
        let mut decisions = Vec::new();
        // Layer 0 has A and B free (B freed last), layer 1 only A so far (B's close not there
        // yet): the first layer chooses B, so layer 1 takes over nothing rather than A.
        assert_eq!(decide(&mut decisions, &[&other_shape, &b, &a], &n), Some(1));
        assert_eq!(decide(&mut decisions, &[&a], &n), None);
        // Once B is free there too, a later layer follows the decision.
        assert_eq!(decide(&mut decisions, &[&a, &b], &n), Some(1));
        // A new set whose first layer had nothing free of its shape takes over nothing anywhere.
        assert_eq!(decide(&mut decisions, &[&other_shape], &m), None);
        assert_eq!(decide(&mut decisions, &[&a], &m), None);
        // The decisions are bounded, oldest out.
        for s in 100..100 + DECISIONS as u64 {
            decide(&mut decisions, &[], &key(&[s]));
        }
        assert_eq!(decisions.len(), DECISIONS);
        assert!(decisions.iter().all(|(k, _)| k != &n));
    }

    #[test]
    fn a_backend_that_cannot_capture_runs_every_step_as_it_is() {
        let device = Default::default();
        let mut graphs = DecodeGraphs::<B>::default();
        let h = Tensor::<B, 3>::ones([1, 1, 4], &device);
        let state = vec![Tensor::<B, 2>::zeros([1, 4], &device)];
        let calls = std::cell::Cell::new(0);
        for step in 0..4 {
            let (out, st) = graphs.step(&[7], h.clone(), state.clone(), &device, |h, s| {
                calls.set(calls.get() + 1);
                (h * 2.0, s.into_iter().map(|s| s + 1.0).collect())
            });
            assert_eq!(out.into_data().to_vec::<f32>().unwrap(), vec![2.0; 4]);
            assert_eq!(
                st[0].clone().into_data().to_vec::<f32>().unwrap(),
                vec![1.0; 4]
            );
            assert_eq!(calls.get(), step + 1);
        }
        assert!(graphs.is_empty());
    }
}
