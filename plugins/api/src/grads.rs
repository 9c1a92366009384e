//! Gradients leaving and entering a stage, for data parallelism: a stage's gradient is one or
//! two ordered streams (a layer's parameters; the edge's head and, apart, its embedding),
//! each a sum over micro-batches in micro-batch order. [`StageCall::GradsOut`] hands one
//! part of a stream to the host as a flat tensor with a [`ParamMask`] saying whose gradients
//! it holds; [`StageCall::GradsIn`] gives such a part to another replica's stage, which adds
//! it in the order of its key. Sums then come out in one order however the micro-batches
//! were spread over replicas.
//!
//! [`StageCall::GradsOut`]: crate::StageCall::GradsOut
//! [`StageCall::GradsIn`]: crate::StageCall::GradsIn

use crate::{DeviceTensor, EngineError, MicroBatchId, Reply};

/// The gradient stream of a stage: a layer has [`LAYER`](Self::LAYER); the edge sums its
/// head's gradients in [`HEAD`](Self::HEAD) and its embedding's in
/// [`EMBEDDING`](Self::EMBEDDING), added together only in the optimizer phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GradStream(pub u32);

impl GradStream {
    pub const LAYER: GradStream = GradStream(0);
    pub const HEAD: GradStream = GradStream(0);
    pub const EMBEDDING: GradStream = GradStream(1);
}

/// Bits of the mask per C-boundary word (each word travels as an exactly representable f64
/// or i64).
const WORD_BITS: usize = 32;

/// The most parameters a stage may have for its gradients to travel in parts (the mask's
/// words fill the reply's scalars after the stream and the key).
pub const MAX_MASK_PARAMS: usize = 6 * WORD_BITS;

/// Which of a stage's parameters (declaration order) a gradient part holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParamMask {
    words: Vec<u32>,
}

impl ParamMask {
    /// The mask of `present[i]` for every parameter `i`.
    pub fn from_present(present: &[bool]) -> Result<Self, EngineError> {
        if present.len() > MAX_MASK_PARAMS {
            return Err(EngineError::InvalidInput(format!(
                "a stage of {} parameters cannot hand its gradients over: at most {MAX_MASK_PARAMS}",
                present.len()
            )));
        }
        let mut words = vec![0u32; present.len().div_ceil(WORD_BITS)];
        for (i, &p) in present.iter().enumerate() {
            if p {
                words[i / WORD_BITS] |= 1 << (i % WORD_BITS);
            }
        }
        Ok(ParamMask { words })
    }

    /// Whether parameter `i` is in the part.
    pub fn contains(&self, i: usize) -> bool {
        self.words
            .get(i / WORD_BITS)
            .is_some_and(|w| w & (1 << (i % WORD_BITS)) != 0)
    }

    /// The words as they cross the C boundary.
    pub fn words(&self) -> Vec<i64> {
        self.words.iter().map(|&w| i64::from(w)).collect()
    }

    pub fn from_words(words: &[i64]) -> Result<Self, EngineError> {
        let words = words
            .iter()
            .map(|&w| {
                u32::try_from(w).map_err(|_| {
                    EngineError::InvalidInput(format!("parameter mask word {w} is not 32-bit"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ParamMask { words })
    }
}

/// `GradsOut`: one part of a stage's gradients.
#[derive(Debug)]
pub struct GradPart {
    pub stream: GradStream,
    /// The first micro-batch the part sums; parts are added in key order.
    pub key: MicroBatchId,
    /// The gradients of the parameters in `mask`, flattened and back to back in declaration
    /// order: `[1, 1, n]` f32.
    pub flat: DeviceTensor,
    pub mask: ParamMask,
}

impl From<GradPart> for Reply {
    fn from(p: GradPart) -> Reply {
        let mut scalars = vec![f64::from(p.stream.0), p.key.0 as f64];
        scalars.extend(p.mask.words().into_iter().map(|w| w as f64));
        Reply {
            tensors: vec![p.flat],
            scalars,
        }
    }
}

impl GradPart {
    /// The part a `GradsOut` reply holds, or `None` when the stage had no gradient left.
    pub fn from_reply(r: Reply) -> Result<Option<Self>, EngineError> {
        if r.tensors.is_empty() && r.scalars.is_empty() {
            return Ok(None);
        }
        if r.scalars.len() < 2 {
            return Err(EngineError::Backend(format!(
                "GradsOut replied {} scalars, expected the stream, the key and the mask",
                r.scalars.len()
            )));
        }
        let words: Vec<i64> = r.scalars[2..].iter().map(|&w| w as i64).collect();
        let (stream, key) = (r.scalars[0], r.scalars[1]);
        Ok(Some(GradPart {
            stream: GradStream(stream as u32),
            key: MicroBatchId(key as u64),
            mask: ParamMask::from_words(&words)?,
            flat: r.into_tensor("GradsOut")?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_round_trip_through_words() {
        let present: Vec<bool> = (0..70).map(|i| i % 3 == 0 || i == 69).collect();
        let m = ParamMask::from_present(&present).unwrap();
        assert_eq!(m.words().len(), 3);
        let back = ParamMask::from_words(&m.words()).unwrap();
        for (i, &p) in present.iter().enumerate() {
            assert_eq!(back.contains(i), p, "parameter {i}");
        }
        assert!(!back.contains(500));
        assert!(ParamMask::from_present(&[true; MAX_MASK_PARAMS + 1]).is_err());
        assert!(ParamMask::from_words(&[-1]).is_err());
    }

    #[test]
    fn an_empty_reply_is_no_part() {
        assert!(GradPart::from_reply(Reply::none()).unwrap().is_none());
        let r = Reply {
            tensors: Vec::new(),
            scalars: vec![0.0],
        };
        assert!(GradPart::from_reply(r).is_err());
    }
}
