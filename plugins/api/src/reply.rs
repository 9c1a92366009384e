//! Named replies: what each [`StageCall`](crate::StageCall) that returns numbers answers, as
//! fields. A [`Reply`] carries tensors and scalars in flat lists (that is how they cross the C
//! boundary); the position of every value is written here and nowhere else: backends build
//! their replies with `Reply::from(…)`, the runtime reads them with `…::try_from(reply)`.

use crate::{DeviceTensor, EngineError, Reply};

/// Mean, least and largest of a set of values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

/// `Forward`: the layer's output and its halting statistics.
#[derive(Debug)]
pub struct ForwardOut {
    /// `h_out` `[T, B, D]`.
    pub h: DeviceTensor,
    /// The layer's ponder cost (mean over tokens of the expected frame count; SPEC §5).
    pub ponder_cost: f64,
    /// The expected frame count E[K] over the layer's tokens.
    pub expected_k: Spread,
}

/// Equal-width bins over `[0, 1]` of the β(t) histogram a [`Probe`] replies.
pub const BETA_BINS: usize = 50;

/// `Probe`: a layer's output and what the interpretability study reads from it.
#[derive(Debug)]
pub struct Probe {
    /// `h_out` `[T, B, D]`.
    pub h: DeviceTensor,
    /// E[K] of every token, SNNBlock then SNNFFN: `[2, T, B]`.
    pub expected_k: DeviceTensor,
    /// How many values of the hidden neurons' selective β(t) = σ(W_β·x + b_β), over all
    /// frames, rows and neurons of the call, fall in each of [`BETA_BINS`] equal bins of
    /// `[0, 1]` (the last bin includes 1): `[1, 1, BETA_BINS]`.
    pub beta_hist: DeviceTensor,
    /// Each hidden neuron's mean β(t) over the call's frames and rows: `[1, 1, D·N]`.
    pub beta_mean: DeviceTensor,
}

impl From<Probe> for Reply {
    fn from(p: Probe) -> Reply {
        Reply {
            tensors: vec![p.h, p.expected_k, p.beta_hist, p.beta_mean],
            scalars: Vec::new(),
        }
    }
}

impl TryFrom<Reply> for Probe {
    type Error = EngineError;
    fn try_from(r: Reply) -> Result<Self, EngineError> {
        scalars(&r, 0, "Probe")?;
        let [h, expected_k, beta_hist, beta_mean]: [DeviceTensor; 4] =
            r.tensors.try_into().map_err(|t: Vec<DeviceTensor>| {
                EngineError::Backend(format!("Probe replied {} tensors, expected 4", t.len()))
            })?;
        Ok(Probe {
            h,
            expected_k,
            beta_hist,
            beta_mean,
        })
    }
}

/// Masked mean cross entropy and the number of scored targets it averages over.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Loss {
    pub ce: f64,
    pub mask_sum: f64,
}

/// `Head`: the loss and its gradient with respect to the head's input.
#[derive(Debug)]
pub struct HeadOut {
    /// ∂(loss_scale·ce)/∂h.
    pub grad: DeviceTensor,
    pub loss: Loss,
}

/// `GradStats`: the L2 norms of the modulation-bias gradients after phase 1 (a layer); `None`
/// where a bias has no gradient. The edge has no modulation biases and answers all `None`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BiasGradNorms {
    pub b_beta: Option<f64>,
    pub b_alpha: Option<f64>,
    pub b_th: Option<f64>,
}

impl BiasGradNorms {
    /// In the order of `ScaleGrads::scales`.
    pub fn as_array(&self) -> [Option<f64>; 3] {
        [self.b_beta, self.b_alpha, self.b_th]
    }
}

/// `ScaleGrads`: Σ g² over every gradient of the stage after scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradSumSquares(pub f64);

fn scalars(r: &Reply, n: usize, call: &str) -> Result<(), EngineError> {
    if r.scalars.len() != n {
        return Err(EngineError::Backend(format!(
            "{call} replied {} scalars, expected {n}",
            r.scalars.len()
        )));
    }
    Ok(())
}

impl From<ForwardOut> for Reply {
    fn from(o: ForwardOut) -> Reply {
        Reply {
            tensors: vec![o.h],
            scalars: vec![
                o.ponder_cost,
                o.expected_k.mean,
                o.expected_k.min,
                o.expected_k.max,
            ],
        }
    }
}

impl TryFrom<Reply> for ForwardOut {
    type Error = EngineError;
    fn try_from(r: Reply) -> Result<Self, EngineError> {
        scalars(&r, 4, "Forward")?;
        let s = [r.scalars[0], r.scalars[1], r.scalars[2], r.scalars[3]];
        Ok(ForwardOut {
            h: r.into_tensor("Forward")?,
            ponder_cost: s[0],
            expected_k: Spread {
                mean: s[1],
                min: s[2],
                max: s[3],
            },
        })
    }
}

impl From<Loss> for Reply {
    fn from(l: Loss) -> Reply {
        Reply {
            tensors: Vec::new(),
            scalars: vec![l.ce, l.mask_sum],
        }
    }
}

impl TryFrom<Reply> for Loss {
    type Error = EngineError;
    fn try_from(r: Reply) -> Result<Self, EngineError> {
        scalars(&r, 2, "HeadEval")?;
        Ok(Loss {
            ce: r.scalars[0],
            mask_sum: r.scalars[1],
        })
    }
}

impl From<HeadOut> for Reply {
    fn from(o: HeadOut) -> Reply {
        Reply {
            tensors: vec![o.grad],
            ..Reply::from(o.loss)
        }
    }
}

impl TryFrom<Reply> for HeadOut {
    type Error = EngineError;
    fn try_from(r: Reply) -> Result<Self, EngineError> {
        scalars(&r, 2, "Head")?;
        let loss = Loss {
            ce: r.scalars[0],
            mask_sum: r.scalars[1],
        };
        Ok(HeadOut {
            grad: r.into_tensor("Head")?,
            loss,
        })
    }
}

impl From<BiasGradNorms> for Reply {
    fn from(n: BiasGradNorms) -> Reply {
        Reply {
            tensors: Vec::new(),
            scalars: n.as_array().map(|v| v.unwrap_or(f64::NAN)).to_vec(),
        }
    }
}

impl TryFrom<Reply> for BiasGradNorms {
    type Error = EngineError;
    fn try_from(r: Reply) -> Result<Self, EngineError> {
        if r.scalars.is_empty() {
            return Ok(BiasGradNorms::default());
        }
        scalars(&r, 3, "GradStats")?;
        let v = |i: usize| Some(r.scalars[i]).filter(|x| x.is_finite());
        Ok(BiasGradNorms {
            b_beta: v(0),
            b_alpha: v(1),
            b_th: v(2),
        })
    }
}

impl From<GradSumSquares> for Reply {
    fn from(s: GradSumSquares) -> Reply {
        Reply {
            tensors: Vec::new(),
            scalars: vec![s.0],
        }
    }
}

impl TryFrom<Reply> for GradSumSquares {
    type Error = EngineError;
    fn try_from(r: Reply) -> Result<Self, EngineError> {
        scalars(&r, 1, "ScaleGrads")?;
        Ok(GradSumSquares(r.scalars[0]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_replies_round_trip_by_name() {
        let l = Loss {
            ce: 2.5,
            mask_sum: 7.0,
        };
        assert_eq!(Loss::try_from(Reply::from(l)).unwrap(), l);
        let n = BiasGradNorms {
            b_beta: Some(1.0),
            b_alpha: None,
            b_th: Some(3.0),
        };
        assert_eq!(BiasGradNorms::try_from(Reply::from(n)).unwrap(), n);
        assert_eq!(
            BiasGradNorms::try_from(Reply::none()).unwrap(),
            BiasGradNorms::default()
        );
        let s = GradSumSquares(4.0);
        assert_eq!(GradSumSquares::try_from(Reply::from(s)).unwrap(), s);
    }

    #[test]
    fn a_reply_of_the_wrong_length_is_an_error_naming_the_call() {
        let e = GradSumSquares::try_from(Reply::none()).unwrap_err();
        assert!(
            e.to_string().contains("ScaleGrads replied 0 scalars"),
            "{e}"
        );
        let e = Loss::try_from(Reply::from(GradSumSquares(1.0))).unwrap_err();
        assert!(e.to_string().contains("HeadEval"), "{e}");
    }
}
