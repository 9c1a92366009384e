//! The few statistics the study needs: mean and standard deviation, Pearson's r, and means
//! over bins of another variable.

use serde::Serialize;

/// Count, mean and (population) standard deviation of a set of values.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub sd: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    /// `None` for no values.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Summary> {
        let v: Vec<f64> = values.into_iter().collect();
        if v.is_empty() {
            return None;
        }
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        Some(Summary {
            count: v.len(),
            mean,
            sd: var.sqrt(),
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        })
    }
}

/// Pearson's correlation of the pairs; `None` for fewer than 3 pairs or a constant variable.
pub fn pearson(pairs: &[(f64, f64)]) -> Option<f64> {
    if pairs.len() < 3 {
        return None;
    }
    let n = pairs.len() as f64;
    let mx = pairs.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pairs.iter().map(|p| p.1).sum::<f64>() / n;
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for &(x, y) in pairs {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx).powi(2);
        syy += (y - my).powi(2);
    }
    (sxx > 0.0 && syy > 0.0).then(|| sxy / (sxx * syy).sqrt())
}

/// The `y` values of the pairs whose `x` falls in `[lo, hi)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Bin {
    pub lo: f64,
    pub hi: f64,
    pub y: Summary,
}

/// Means of `y` over bins of `x` of width `width` starting at 0 (negative `x` joins the first);
/// empty bins are left out.
pub fn binned(pairs: &[(f64, f64)], width: f64) -> Vec<Bin> {
    let Some(top) = pairs.iter().map(|p| p.0).reduce(f64::max) else {
        return Vec::new();
    };
    let n = ((top / width).floor().max(0.0) as usize) + 1;
    (0..n)
        .filter_map(|i| {
            let (lo, hi) = (i as f64 * width, (i + 1) as f64 * width);
            let y = Summary::of(
                pairs
                    .iter()
                    .filter(|p| {
                        let b = ((p.0 / width).floor().max(0.0) as usize).min(n - 1);
                        b == i
                    })
                    .map(|p| p.1),
            )?;
            Some(Bin { lo, hi, y })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_and_correlation_match_hand_values() {
        let s = Summary::of([1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!((s.count, s.mean, s.min, s.max), (4, 2.5, 1.0, 4.0));
        assert!((s.sd - 1.25f64.sqrt()).abs() < 1e-12);
        assert!(Summary::of([]).is_none());
        let line: Vec<_> = (0..10).map(|i| (i as f64, 3.0 - 2.0 * i as f64)).collect();
        assert!((pearson(&line).unwrap() + 1.0).abs() < 1e-12);
        let r = pearson(&[(1.0, 2.0), (2.0, 1.0), (3.0, 4.0), (4.0, 3.0)]).unwrap();
        assert!((r - 0.6).abs() < 1e-12, "{r}");
        assert!(pearson(&[(1.0, 1.0), (2.0, 1.0), (3.0, 1.0)]).is_none());
    }

    #[test]
    fn bins_hold_their_points_and_skip_empty_ones() {
        let b = binned(&[(0.5, 1.0), (0.9, 3.0), (2.5, 10.0), (-1.0, 5.0)], 1.0);
        assert_eq!(b.len(), 2);
        assert_eq!(
            (b[0].lo, b[0].hi, b[0].y.count, b[0].y.mean),
            (0.0, 1.0, 3, 3.0)
        );
        assert_eq!((b[1].lo, b[1].y.count, b[1].y.mean), (2.0, 1, 10.0));
    }
}
