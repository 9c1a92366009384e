//! A stage's gradients as ordered streams, and their exchange between data-parallel replicas
//! (`HoldGrads`, `GradsOut`, `GradsIn`).
//!
//! Each stream sums micro-batches' gradient sets in micro-batch order: a set that arrives
//! before a smaller micro-batch's waits under its id. A layer has one stream; the edge two
//! (head and embedding, whose backward passes interleave differently under a pipeline). The
//! optimizer phase settles the streams into one set, stream by stream. A replica that
//! *holds* keeps every set apart; its parts are handed, with their ids, to the replica whose
//! micro-batches come first, which adds them in order after its own: the sum is the one the
//! sequential schedule makes, wherever the micro-batches ran.

use crate::{act, wrap};
use burn::tensor::Tensor;
use nsactor_kernels::SnnOps;
use nsactor_model::params::{ParamVisitor, Params};
use nsactor_model::train::GradSet;
use nsactor_plugin_api::{
    DeviceTensor, EngineError, GradPart, GradStream, MicroBatchId, ParamMask, Reply,
};
use std::collections::BTreeMap;

/// Adds `g` to `slot` by name (parameters without a gradient yet are appended).
fn add_into<B: SnnOps>(slot: &mut Option<GradSet<B>>, g: GradSet<B>) {
    let Some(acc) = slot.as_mut() else {
        *slot = Some(g);
        return;
    };
    for (name, t) in g.entries {
        match acc.get_mut(&name) {
            Some(a) => *a = a.clone() + t,
            None => acc.entries.push((name, t)),
        }
    }
}

/// One stream: the sum so far (and the first micro-batch in it) and the sets still waiting.
struct Stream<B: SnnOps> {
    sum: Option<GradSet<B>>,
    first: Option<MicroBatchId>,
    waiting: BTreeMap<MicroBatchId, GradSet<B>>,
}

impl<B: SnnOps> Default for Stream<B> {
    fn default() -> Self {
        Stream {
            sum: None,
            first: None,
            waiting: BTreeMap::new(),
        }
    }
}

impl<B: SnnOps> Stream<B> {
    fn add(&mut self, micro: MicroBatchId, g: GradSet<B>) {
        self.first.get_or_insert(micro);
        add_into(&mut self.sum, g);
    }

    /// Adds the waiting sets up to (not past) `first_in_flight`.
    fn add_ready(&mut self, first_in_flight: Option<MicroBatchId>) {
        while let Some(entry) = self.waiting.first_entry() {
            if first_in_flight.is_some_and(|w| w < *entry.key()) {
                break;
            }
            let (micro, g) = entry.remove_entry();
            self.add(micro, g);
        }
    }
}

/// The gradient streams of a stage, before the optimizer phase settles them.
pub(crate) struct Streams<B: SnnOps> {
    streams: Vec<Stream<B>>,
    /// Keep every set apart ([`HoldGrads`](nsactor_plugin_api::StageCall::HoldGrads)).
    hold: bool,
}

impl<B: SnnOps> Streams<B> {
    pub fn new(count: usize) -> Self {
        Streams {
            streams: (0..count).map(|_| Stream::default()).collect(),
            hold: false,
        }
    }

    fn stream(&mut self, s: GradStream) -> Result<&mut Stream<B>, EngineError> {
        let n = self.streams.len();
        self.streams.get_mut(s.0 as usize).ok_or_else(|| {
            EngineError::InvalidInput(format!("gradient stream {} of a stage with {n}", s.0))
        })
    }

    pub fn set_hold(&mut self, hold: bool) {
        self.hold = hold;
    }

    /// Micro-batch `micro`'s gradients into stream `s`, added in ascending micro-batch order
    /// whatever order the backwards arrive in: a set waits while a smaller micro-batch is
    /// still in flight (`first_in_flight`: its forward seen, its backward not yet), and always
    /// while holding.
    pub fn accumulate(
        &mut self,
        s: GradStream,
        micro: MicroBatchId,
        g: GradSet<B>,
        first_in_flight: Option<MicroBatchId>,
    ) {
        let hold = self.hold;
        let st = self.stream(s).expect("a stage's own stream");
        st.waiting.insert(micro, g);
        if !hold {
            st.add_ready(first_in_flight);
        }
    }

    /// Adds every waiting set, in order, then the streams one after another into `into`.
    pub fn settle(&mut self, into: &mut Option<GradSet<B>>) {
        for st in &mut self.streams {
            st.add_ready(None);
            if let Some(sum) = st.sum.take() {
                add_into(into, sum);
            }
            st.first = None;
        }
    }

    pub fn clear(&mut self) {
        for st in &mut self.streams {
            *st = Stream::default();
        }
    }

    /// `GradsOut`: the first part left (module docs), flattened over `module`'s parameters;
    /// with `keep` a copy, the part staying where it is.
    pub fn take_part<M: Params<crate::Ad<B>>>(
        &mut self,
        module: &M,
        prefix: &str,
        keep: bool,
    ) -> Result<Reply, EngineError> {
        let hold = self.hold;
        for (i, st) in self.streams.iter_mut().enumerate() {
            if !hold {
                st.add_ready(None);
            }
            let part = match (&st.sum, st.first, keep) {
                (Some(sum), Some(first), true) => Some((first, sum.clone())),
                (Some(_), Some(_), false) => st.first.take().zip(st.sum.take()),
                (_, _, true) => st.waiting.first_key_value().map(|(k, g)| (*k, g.clone())),
                (_, _, false) => st.waiting.pop_first(),
            };
            if let Some((key, set)) = part {
                let (flat, mask) = flatten(module, prefix, set)?;
                return Ok(GradPart {
                    stream: GradStream(i as u32),
                    key,
                    flat,
                    mask,
                }
                .into());
            }
        }
        Ok(Reply::none())
    }

    /// `GradsIn`: `grad` waits in stream `s` under `micro`, after the stream's sum so far.
    pub fn put_part<M: Params<crate::Ad<B>>>(
        &mut self,
        module: &M,
        prefix: &str,
        s: GradStream,
        micro: MicroBatchId,
        mask: &ParamMask,
        grad: DeviceTensor,
    ) -> Result<(), EngineError> {
        let set = unflatten(module, prefix, mask, act::<B>(grad, "GradsIn")?)?;
        let st = self.stream(s)?;
        if st.first.is_some_and(|f| micro <= f) || st.waiting.contains_key(&micro) {
            return Err(EngineError::InvalidInput(format!(
                "GradsIn: stream {} already holds {micro} or a later micro-batch's sum",
                s.0
            )));
        }
        st.waiting.insert(micro, set);
        Ok(())
    }
}

/// Every parameter of `module` (named with `prefix`, declaration order) and its length.
fn param_list<B: SnnOps, M: Params<crate::Ad<B>>>(
    module: &M,
    prefix: &str,
) -> Vec<(String, usize)> {
    struct List(Vec<(String, usize)>);
    impl<AB: burn::tensor::backend::Backend> ParamVisitor<AB> for List {
        fn visit<const D: usize>(&mut self, name: &str, p: &Tensor<AB, D>) {
            self.0.push((name.to_string(), p.shape().num_elements()));
        }
    }
    let mut l = List(Vec::new());
    module.visit_params(prefix, &mut l);
    l.0
}

/// `set` as one `[1, 1, n]` tensor, its entries in the module's parameter order, and the mask
/// of the parameters it has.
fn flatten<B: SnnOps, M: Params<crate::Ad<B>>>(
    module: &M,
    prefix: &str,
    set: GradSet<B>,
) -> Result<(DeviceTensor, ParamMask), EngineError> {
    let params = param_list::<B, M>(module, prefix);
    let mut entries: BTreeMap<String, Tensor<B, 1>> = set.entries.into_iter().collect();
    let mut present = Vec::with_capacity(params.len());
    let mut parts = Vec::new();
    for (name, _) in &params {
        let g = entries.remove(name);
        present.push(g.is_some());
        parts.extend(g);
    }
    if let Some(name) = entries.keys().next() {
        return Err(EngineError::Backend(format!(
            "a gradient of `{name}`, which is not a parameter of the stage"
        )));
    }
    let mask = ParamMask::from_present(&present)?;
    let flat = Tensor::cat(parts, 0);
    let n = flat.dims()[0];
    Ok((wrap(flat.reshape([1, 1, n])), mask))
}

/// The gradient set a [`flatten`]ed part holds.
fn unflatten<B: SnnOps, M: Params<crate::Ad<B>>>(
    module: &M,
    prefix: &str,
    mask: &ParamMask,
    flat: Tensor<B, 3>,
) -> Result<GradSet<B>, EngineError> {
    let params = param_list::<B, M>(module, prefix);
    let n = flat.shape().num_elements();
    let flat = flat.reshape([n]);
    let want: usize = (0..params.len())
        .filter(|&i| mask.contains(i))
        .map(|i| params[i].1)
        .sum();
    if want != n {
        return Err(EngineError::InvalidInput(format!(
            "GradsIn: {n} values for parameters of {want}"
        )));
    }
    let mut entries = Vec::new();
    let mut at = 0;
    for (i, (name, len)) in params.into_iter().enumerate() {
        if mask.contains(i) {
            entries.push((name, flat.clone().slice(at..at + len)));
            at += len;
        }
    }
    Ok(GradSet { entries })
}
