//! A run's training curves (`loss.png`): three panels over the step axis. The loss panel has
//! the raw loss per step (grey, broken where a step scored no token or was skipped), its
//! centred moving average (blue) and the held-out evaluation loss (orange points); the
//! learning-rate panel the schedule; the ponder panel E[K], the mean number of PLIF steps per
//! token, with the band from the layer with the fewest to the layer with the most.

use crate::canvas::{Area, FONT, PlotError, draw_err, render_png};
use plotters::prelude::*;
use std::ops::Range;

/// The moving average's colour, also what tests look for.
pub const AVERAGE: RGBColor = RGBColor(31, 119, 180);
/// The raw loss's colour.
pub const RAW: RGBColor = RGBColor(170, 170, 170);
/// The evaluation loss's colour.
pub const EVAL: RGBColor = RGBColor(230, 110, 20);
/// The learning rate's colour.
pub const LR: RGBColor = RGBColor(44, 160, 44);
/// E[K]'s colour.
pub const PONDER: RGBColor = RGBColor(148, 103, 189);

/// E[K] of one step: the mean over layers and the extremes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KStats {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

/// The series of one run, by step. A loss of NaN is a step that scored no token (or was
/// skipped): the raw curve breaks there and the average ignores it.
#[derive(Debug, Clone, Default)]
pub struct TrainingCurves {
    /// Written above the panels (the run's model and data, say).
    pub title: String,
    pub loss: Vec<(u64, f64)>,
    pub eval_loss: Vec<(u64, f64)>,
    pub lr: Vec<(u64, f64)>,
    pub expected_k: Vec<(u64, KStats)>,
}

impl TrainingCurves {
    /// The moving average's window: about a fifteenth of the run, 1 to 200 steps.
    pub fn window(&self) -> usize {
        (self.loss.len() / 15).clamp(1, 200)
    }

    /// The centred moving average of the finite losses over [`Self::window`] steps (fewer at
    /// the ends), so the curve does not lag a falling loss.
    pub fn moving_average(&self) -> Vec<(u64, f64)> {
        let finite: Vec<(u64, f64)> = self
            .loss
            .iter()
            .copied()
            .filter(|(_, l)| l.is_finite())
            .collect();
        let mut prefix = vec![0.0];
        for (_, l) in &finite {
            prefix.push(prefix.last().copied().unwrap_or(0.0) + l);
        }
        let half = self.window() / 2;
        (0..finite.len())
            .map(|i| {
                let (lo, hi) = (i.saturating_sub(half), (i + half + 1).min(finite.len()));
                (finite[i].0, (prefix[hi] - prefix[lo]) / (hi - lo) as f64)
            })
            .collect()
    }

    /// `loss.png`: `size` is the picture's width and height in pixels (960 × 900 reads well).
    pub fn to_png(&self, size: (u32, u32)) -> Result<Vec<u8>, PlotError> {
        if self.loss.is_empty() {
            return Err(PlotError::Empty("no step has a loss"));
        }
        let steps = self.steps().ok_or(PlotError::Empty("no step has a loss"))?;
        render_png(size, |root| {
            root.fill(&WHITE).map_err(draw_err)?;
            let root = root
                .titled(&self.title, (FONT, 22).into_font())
                .map_err(draw_err)?;
            let (top, rest) = root.split_vertically(rest_share(size.1, 0.5));
            let (middle, bottom) = rest.split_vertically(rest_share(size.1, 0.22));
            self.loss_panel(&top, steps.clone())?;
            lr_panel(&middle, steps.clone(), &self.lr)?;
            k_panel(&bottom, steps, &self.expected_k)
        })
    }

    /// The step axis: the first to the last step of the losses and evaluations (0, the
    /// evaluation before training, included).
    fn steps(&self) -> Option<Range<u64>> {
        let all = self.loss.iter().chain(&self.eval_loss).map(|p| p.0);
        let (lo, hi) = all.fold(None, |acc: Option<(u64, u64)>, s| match acc {
            None => Some((s, s)),
            Some((lo, hi)) => Some((lo.min(s), hi.max(s))),
        })?;
        Some(lo..hi.max(lo + 1))
    }

    fn loss_panel<'b, 'a>(&self, area: &'b Area<'a>, steps: Range<u64>) -> Result<(), PlotError> {
        let values = self.loss.iter().chain(&self.eval_loss).map(|p| p.1);
        let y = padded(values).ok_or(PlotError::Empty("no step scored a token"))?;
        let mut chart = panel(area, steps, y)?;
        mesh(&mut chart, "loss (nats per scored token)", |v| {
            format!("{v:.2}")
        })?;
        for run in finite_runs(&self.loss) {
            chart
                .draw_series(LineSeries::new(run, RAW.stroke_width(1)))
                .map_err(draw_err)?;
        }
        chart
            .draw_series(std::iter::empty::<Circle<(u64, f64), u32>>())
            .map_err(draw_err)?
            .label("loss per step")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RAW.stroke_width(2)));
        let w = self.window();
        chart
            .draw_series(LineSeries::new(
                self.moving_average(),
                AVERAGE.stroke_width(2),
            ))
            .map_err(draw_err)?
            .label(format!("moving average ({w} steps, centred)"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], AVERAGE.stroke_width(2)));
        if !self.eval_loss.is_empty() {
            chart
                .draw_series(LineSeries::new(
                    self.eval_loss.iter().copied(),
                    EVAL.stroke_width(1),
                ))
                .map_err(draw_err)?;
            chart
                .draw_series(
                    self.eval_loss
                        .iter()
                        .map(|&p| Circle::new(p, 4, EVAL.filled())),
                )
                .map_err(draw_err)?
                .label("held-out evaluation")
                .legend(|(x, y)| Circle::new((x + 10, y), 4, EVAL.filled()));
        }
        legend(&mut chart)
    }
}

/// Pixels for the upper part when a `share` of the height goes to it.
fn rest_share(height: u32, share: f64) -> u32 {
    (height as f64 * share) as u32
}

/// The range of the finite `values`, padded by 5 % (a flat series gets ±1 % of its value).
fn padded(values: impl Iterator<Item = f64>) -> Option<Range<f64>> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold(None, |acc: Option<(f64, f64)>, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
        })?;
    let pad = match hi - lo {
        d if d > 0.0 => d * 0.05,
        _ => (lo.abs() * 0.01).max(1e-12),
    };
    Some(lo - pad..hi + pad)
}

/// The stretches of `points` between non-finite values.
fn finite_runs(points: &[(u64, f64)]) -> Vec<Vec<(u64, f64)>> {
    points
        .split(|p| !p.1.is_finite())
        .filter(|r| !r.is_empty())
        .map(<[_]>::to_vec)
        .collect()
}

type Chart<'b, 'a> = ChartContext<
    'b,
    BitMapBackend<'a>,
    Cartesian2d<plotters::coord::types::RangedCoordu64, plotters::coord::types::RangedCoordf64>,
>;

fn panel<'b, 'a>(
    area: &'b Area<'a>,
    steps: Range<u64>,
    y: Range<f64>,
) -> Result<Chart<'b, 'a>, PlotError> {
    ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(78)
        .build_cartesian_2d(steps, y)
        .map_err(draw_err)
}

fn mesh<'b, 'a>(
    chart: &mut Chart<'b, 'a>,
    y_title: &str,
    y_label: impl Fn(&f64) -> String,
) -> Result<(), PlotError> {
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_title)
        .axis_desc_style((FONT, 16))
        .label_style((FONT, 13))
        .y_label_formatter(&y_label)
        .max_light_lines(2)
        .light_line_style(RGBColor(238, 238, 238))
        .draw()
        .map_err(draw_err)
}

fn legend<'b, 'a: 'b>(chart: &mut Chart<'b, 'a>) -> Result<(), PlotError> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .draw()
        .map_err(draw_err)
}

fn lr_panel<'b, 'a>(
    area: &'b Area<'a>,
    steps: Range<u64>,
    lr: &[(u64, f64)],
) -> Result<(), PlotError> {
    let y = padded(lr.iter().map(|p| p.1)).unwrap_or(0.0..1.0);
    let mut chart = panel(area, steps, y.start.max(0.0)..y.end)?;
    mesh(&mut chart, "learning rate", |v| format!("{v:.1e}"))?;
    chart
        .draw_series(LineSeries::new(lr.iter().copied(), LR.stroke_width(2)))
        .map_err(draw_err)?;
    Ok(())
}

fn k_panel<'b, 'a>(
    area: &'b Area<'a>,
    steps: Range<u64>,
    k: &[(u64, KStats)],
) -> Result<(), PlotError> {
    let values = k.iter().flat_map(|(_, s)| [s.min, s.max, s.mean]);
    let y = padded(values).unwrap_or(0.0..1.0);
    let mut chart = panel(area, steps, y)?;
    mesh(&mut chart, "E[K] (PLIF steps per token)", |v| {
        format!("{v:.2}")
    })?;
    if k.len() > 1 {
        let band: Vec<(u64, f64)> = k
            .iter()
            .map(|(s, v)| (*s, v.max))
            .chain(k.iter().rev().map(|(s, v)| (*s, v.min)))
            .collect();
        chart
            .draw_series(std::iter::once(Polygon::new(band, PONDER.mix(0.18))))
            .map_err(draw_err)?
            .label("layer min … max")
            .legend(|(x, y)| {
                Rectangle::new([(x, y - 5), (x + 20, y + 5)], PONDER.mix(0.18).filled())
            });
    }
    chart
        .draw_series(LineSeries::new(
            k.iter().map(|(s, v)| (*s, v.mean)),
            PONDER.stroke_width(2),
        ))
        .map_err(draw_err)?
        .label("mean over layers")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], PONDER.stroke_width(2)));
    legend(&mut chart)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn falling(n: u64) -> TrainingCurves {
        TrainingCurves {
            title: "test run".into(),
            loss: (1..=n)
                .map(|s| {
                    (
                        s,
                        if s == 7 {
                            f64::NAN
                        } else {
                            8.0 / (1.0 + s as f64 * 0.05)
                        },
                    )
                })
                .collect(),
            eval_loss: vec![(n / 2, 5.0), (n, 4.0)],
            lr: (1..=n).map(|s| (s, 1e-3 * s as f64 / n as f64)).collect(),
            expected_k: (1..=n)
                .map(|s| {
                    let m = 2.0 + s as f64 / n as f64;
                    (
                        s,
                        KStats {
                            mean: m,
                            min: m - 0.5,
                            max: m + 0.5,
                        },
                    )
                })
                .collect(),
        }
    }

    /// Where pixels of `colour` lie in the picture: (x, y) of each.
    fn pixels(rgb: &[u8], width: u32, colour: RGBColor) -> Vec<(u32, u32)> {
        rgb.chunks(3)
            .enumerate()
            .filter(|(_, p)| p == &[colour.0, colour.1, colour.2])
            .map(|(i, _)| (i as u32 % width, i as u32 / width))
            .collect()
    }

    #[test]
    fn a_falling_loss_is_drawn_falling_with_every_panel() {
        let png = falling(300).to_png((960, 900)).expect("drawn");
        let (w, h, rgb) = crate::canvas::decode_png(&png).expect("a PNG");
        assert_eq!((w, h), (960, 900));
        let avg = pixels(&rgb, w, AVERAGE);
        assert!(
            avg.len() > 500,
            "the average is drawn: {} pixels",
            avg.len()
        );
        // Left end higher on the picture (smaller y) than the right end.
        let left = avg
            .iter()
            .filter(|p| p.0 < 200)
            .map(|p| p.1)
            .min()
            .expect("left");
        let right = avg
            .iter()
            .filter(|p| p.0 > 800)
            .map(|p| p.1)
            .max()
            .expect("right");
        assert!(left < right, "falling: left y {left}, right y {right}");
        // Each panel has its own colour in its own band of the picture.
        let in_band = |c, lo: u32, hi: u32| pixels(&rgb, w, c).iter().any(|p| p.1 > lo && p.1 < hi);
        assert!(in_band(AVERAGE, 0, 450), "loss panel");
        assert!(in_band(EVAL, 0, 450), "evaluation points");
        assert!(in_band(LR, 450, 650), "learning-rate panel");
        assert!(in_band(PONDER, 650, 900), "E[K] panel");
        // Text was set: many dark pixels (labels, titles), more than the axes alone give.
        let dark = rgb.chunks(3).filter(|p| p.iter().all(|&c| c < 90)).count();
        assert!(dark > 3000, "text drawn: {dark} dark pixels");
    }

    #[test]
    fn the_average_skips_unscored_steps_and_empty_runs_are_refused() {
        let c = falling(10);
        let avg = c.moving_average();
        assert_eq!(avg.len(), 9, "step 7 scored nothing");
        assert!(avg.iter().all(|p| p.1.is_finite()));
        assert_eq!(
            finite_runs(&c.loss).len(),
            2,
            "the raw curve breaks at step 7"
        );
        let empty = TrainingCurves::default();
        assert!(matches!(empty.to_png((400, 300)), Err(PlotError::Empty(_))));
        let unscored = TrainingCurves {
            loss: vec![(1, f64::NAN), (2, f64::NAN)],
            ..Default::default()
        };
        assert!(matches!(
            unscored.to_png((400, 300)),
            Err(PlotError::Empty(_))
        ));
    }
}
