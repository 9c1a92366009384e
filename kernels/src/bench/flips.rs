//! Spike flips between a fused selective scan and its composed reference. Spikes are a step
//! function: where a neuron's membrane sits within rounding of its threshold, two correct
//! implementations may spike differently, and that neuron's trajectory differs from then on.
//! The fused kernels compute σ and softplus a few f32 ulp away from burn's compositions, so at
//! tens of millions of neuron steps a few such flips are expected. A check then compares the
//! columns (neurons of one batch row) that did not flip, and accepts the flips only where the
//! reference's membrane was within [`FLIP_MARGIN`] of the threshold at the first flip.

/// The largest `|V_pre − V_th|` of the reference at a column's first flip that counts as a tie
/// between two correct implementations. The fused σ differs from burn's by a few ulp (≈ 5e-7
/// relative); carried through `V = β·V + u` that becomes up to `5e-7 / (1 − β)` of `|V|`, about
/// 5e-5 for β = 0.99.
pub(super) const FLIP_MARGIN: f32 = 1e-4;

/// A reference step's `V_pre − V_th` from its `V_post` and spike: `V_post` itself where it
/// spiked (`V_post = V_pre − V_th`, no rounding added), `V_post − V_th` where it did not.
pub(super) fn margin(spiked: bool, vpost: f32, th: f32) -> f32 {
    if spiked { vpost } else { vpost - th }
}

/// Where the fused spikes differ from the reference's.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Flips {
    /// Spikes that differ.
    pub elements: usize,
    /// Fraction of all spikes that agree.
    pub agree: f64,
    /// Columns with at least one flip.
    pub columns: Vec<bool>,
    /// The largest reference margin `|V_pre − V_th|` over the columns' first flips (0 with no
    /// flips).
    pub worst_margin: f32,
}

impl Flips {
    /// Compares spikes laid out `[steps, cols]`; `threshold(idx)` is the reference's `V_th` of
    /// element `idx` and `ref_vpost` its membrane after the reset. The margin `V_pre − V_th` is
    /// `V_post` itself where the reference spiked (`V_post = V_pre − V_th`, no rounding added)
    /// and `V_post − V_th` where it did not.
    pub(super) fn find(
        fused_spike: &[f32],
        ref_spike: &[f32],
        ref_vpost: &[f32],
        cols: usize,
        threshold: impl Fn(usize) -> f32,
    ) -> Flips {
        let mut columns = vec![false; cols];
        let (mut elements, mut worst_margin) = (0, 0.0f32);
        for (idx, (f, r)) in fused_spike.iter().zip(ref_spike).enumerate() {
            if f == r {
                continue;
            }
            elements += 1;
            let c = idx % cols;
            if !columns[c] {
                columns[c] = true;
                let margin = margin(*r == 1.0, ref_vpost[idx], threshold(idx));
                worst_margin = worst_margin.max(margin.abs());
            }
        }
        Flips {
            elements,
            agree: 1.0 - elements as f64 / ref_spike.len().max(1) as f64,
            columns,
            worst_margin,
        }
    }

    /// Every flip a tie at the threshold ([`FLIP_MARGIN`]).
    pub(super) fn are_ties(&self) -> bool {
        self.worst_margin <= FLIP_MARGIN
    }

    /// The elements of `[steps, cols]` data whose column never flipped.
    pub(super) fn unflipped(&self, data: &[f32]) -> Vec<f32> {
        let cols = self.columns.len();
        data.iter()
            .enumerate()
            .filter(|(idx, _)| !self.columns[idx % cols])
            .map(|(_, &x)| x)
            .collect()
    }

    /// The report's agreement column: the fraction, and where spikes flipped, how many, in
    /// how many columns and the largest reference margin at a first flip.
    pub(super) fn describe(&self) -> String {
        if self.elements == 0 {
            return format!("{:.6}", self.agree);
        }
        let flipped = self.columns.iter().filter(|&&c| c).count();
        format!(
            "{:.6} ({} flipped in {} of {} columns, margin ≤ {:.1e})",
            self.agree,
            self.elements,
            flipped,
            self.columns.len(),
            self.worst_margin
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two steps of three columns; column 1 flips at step 0, where the reference spiked with
    /// `V_pre − V_th = margin` (its `V_post`).
    fn case(margin: f32) -> Flips {
        let th = 0.5;
        let ref_spike = [0.0, 1.0, 0.0, 0.0, 0.0, 1.0];
        let fused_spike = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0];
        let ref_vpost = [0.1, margin, 0.2, 0.3, 0.4, 0.0];
        Flips::find(&fused_spike, &ref_spike, &ref_vpost, 3, |_| th)
    }

    #[test]
    fn a_flip_at_the_threshold_is_a_tie_and_its_column_is_left_out() {
        let f = case(3e-6);
        assert_eq!(f.elements, 2);
        assert_eq!(f.columns, vec![false, true, false]);
        assert!((f.worst_margin - 3e-6).abs() < 1e-7, "{}", f.worst_margin);
        assert!(f.are_ties());
        assert_eq!(
            f.unflipped(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            vec![1.0, 3.0, 4.0, 6.0]
        );
        assert!((f.agree - 4.0 / 6.0).abs() < 1e-12);
        assert!(
            f.describe().contains("2 flipped in 1 of 3 columns"),
            "{}",
            f.describe()
        );
    }

    #[test]
    fn a_margin_far_below_the_thresholds_ulp_is_kept() {
        // `V_post + V_th − V_th` would round 1e-9 to 0 at V_th = 0.5.
        let f = case(1e-9);
        assert!(
            f.worst_margin > 0.0 && f.worst_margin < 1e-8,
            "{}",
            f.worst_margin
        );
    }

    #[test]
    fn where_the_reference_did_not_spike_the_margin_is_its_membrane_below_the_threshold() {
        let f = Flips::find(&[1.0, 0.0], &[0.0, 0.0], &[0.49999, 0.2], 2, |_| 0.5);
        assert_eq!(f.columns, vec![true, false]);
        assert!((f.worst_margin - 1e-5).abs() < 1e-7, "{}", f.worst_margin);
        assert!(f.are_ties());
    }

    #[test]
    fn a_flip_far_from_the_threshold_is_not_a_tie() {
        let f = case(0.4);
        assert!((f.worst_margin - 0.4).abs() < 1e-6, "{}", f.worst_margin);
        assert!(!f.are_ties());
    }

    #[test]
    fn agreeing_spikes_report_the_plain_fraction() {
        let s = [0.0, 1.0, 1.0];
        let f = Flips::find(&s, &s, &[0.0; 3], 3, |_| 0.5);
        assert_eq!((f.elements, f.worst_margin), (0, 0.0));
        assert_eq!(f.describe(), "1.000000");
        assert_eq!(f.unflipped(&[1.0, 2.0, 3.0]), vec![1.0, 2.0, 3.0]);
    }
}
