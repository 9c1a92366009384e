//! The charts of `nsactor analyze` (the paper's interpretability figures): E[K] per token of a
//! few sentences, E[K] by token category, E[K] per layer for SNNBlock and SNNFFN, the
//! distribution of the hidden neurons' β with the fast/slow split, and surprisal against E[K].
//! Each takes plain numbers and returns PNG bytes.

use crate::canvas::{Area, FONT, PlotError, draw_err, render_png};
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use std::ops::Range;

/// Ten distinct colours (category `i` is drawn in `PALETTE[i % 10]`).
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
/// SNNBlock's colour in the per-layer chart (and static β in the β chart).
pub const BLOCK: RGBColor = PALETTE[0];
/// SNNFFN's colour in the per-layer chart (and β(t) over the data in the β chart).
pub const FFN: RGBColor = PALETTE[1];
/// Tokens other than BOS in the surprisal scatter.
pub const TOKENS: RGBColor = PALETTE[0];
/// BOS tokens in the surprisal scatter.
pub const BOS: RGBColor = PALETTE[3];

/// A value with its spread and how many it summarises.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stat {
    pub mean: f64,
    pub sd: f64,
    pub count: usize,
}

/// One token of the per-token chart: its text, E[K] and category (an index into the legend).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBar {
    pub label: String,
    pub expected_k: f64,
    pub category: usize,
}

fn style(chart: &mut ChartBuilder<'_, '_, BitMapBackend<'_>>) {
    chart.margin(14).x_label_area_size(46).y_label_area_size(70);
}

fn bars_range(values: impl Iterator<Item = f64>) -> Range<f64> {
    let top = values.filter(|v| v.is_finite()).fold(0.0, f64::max);
    0.0..(top * 1.15).max(1e-9)
}

/// `n` bars on a segmented axis (an integer range's segments include its end).
fn segments(
    n: usize,
) -> plotters::coord::ranged1d::SegmentedCoord<plotters::coord::types::RangedCoordusize> {
    (0..n.max(2) - 1).into_segmented()
}

/// A chart over two `f64` axes.
type XyChart<'b, 'a> = ChartContext<
    'b,
    BitMapBackend<'a>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// The series' legend at `position`, in a framed, nearly opaque box.
fn legend<'b, 'a: 'b>(
    chart: &mut XyChart<'b, 'a>,
    position: SeriesLabelPosition,
    size: u32,
) -> Result<(), PlotError> {
    chart
        .configure_series_labels()
        .position(position)
        .label_font((FONT, size))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .draw()
        .map_err(draw_err)
}

/// Shortened for an axis label; characters the embedded font lacks (CJK) become `·`.
fn axis_text(s: &str) -> String {
    let t: String = s
        .trim()
        .chars()
        .map(|c| if (c as u32) < 0x2000 { c } else { '·' })
        .take(9)
        .collect();
    if t.is_empty() { "␣".into() } else { t }
}

/// E[K] of every token of a few sentences, one panel per sentence, bars coloured by category.
/// `legend` names the categories (by index).
pub fn tokens_png(
    sentences: &[(String, Vec<TokenBar>)],
    legend: &[&str],
) -> Result<Vec<u8>, PlotError> {
    if sentences.iter().all(|s| s.1.is_empty()) {
        return Err(PlotError::Empty("no token to draw"));
    }
    let height = 120 + 260 * sentences.len() as u32;
    render_png((1200, height), |root| {
        root.fill(&WHITE).map_err(draw_err)?;
        let root = root
            .titled(
                "E[K] per token (PLIF steps; mean over layers and sublayers)",
                (FONT, 22),
            )
            .map_err(draw_err)?;
        let (key, panels) = root.split_vertically(40);
        draw_key(&key, legend)?;
        for (area, (caption, bars)) in panels
            .split_evenly((sentences.len(), 1))
            .iter()
            .zip(sentences)
        {
            token_panel(area, caption, bars)?;
        }
        Ok(())
    })
}

fn draw_key(area: &Area<'_>, legend: &[&str]) -> Result<(), PlotError> {
    let mut x = 20;
    for (i, name) in legend.iter().enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        area.draw(&Rectangle::new([(x, 12), (x + 16, 28)], c.filled()))
            .map_err(draw_err)?;
        area.draw(&Text::new(name.to_string(), (x + 22, 12), (FONT, 15)))
            .map_err(draw_err)?;
        x += 40 + 9 * name.len() as i32;
    }
    Ok(())
}

fn token_panel(area: &Area<'_>, caption: &str, bars: &[TokenBar]) -> Result<(), PlotError> {
    let n = bars.len().max(1);
    let y = bars_range(bars.iter().map(|b| b.expected_k));
    let mut builder = ChartBuilder::on(area);
    style(&mut builder);
    let mut chart = builder
        .caption(caption, (FONT, 15))
        .build_cartesian_2d(segments(n), y)
        .map_err(draw_err)?;
    let labels: Vec<String> = bars.iter().map(|b| axis_text(&b.label)).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .x_label_style((FONT, if n > 24 { 9 } else { 12 }))
        .light_line_style(WHITE)
        .y_desc("E[K]")
        .axis_desc_style((FONT, 15))
        .label_style((FONT, 12))
        .draw()
        .map_err(draw_err)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, b)| {
            let mut r = Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::Exact(i + 1), b.expected_k),
                ],
                PALETTE[b.category % PALETTE.len()].filled(),
            );
            r.set_margin(0, 0, 2, 2);
            r
        }))
        .map_err(draw_err)?;
    Ok(())
}

/// Mean E[K] by token category with ±1 s.d. and the token count above each bar.
pub fn categories_png(bars: &[(String, Stat)], colours: &[usize]) -> Result<Vec<u8>, PlotError> {
    if bars.is_empty() {
        return Err(PlotError::Empty("no category has a token"));
    }
    render_png((960, 600), |root| {
        root.fill(&WHITE).map_err(draw_err)?;
        let n = bars.len();
        let y = bars_range(bars.iter().map(|b| b.1.mean + b.1.sd));
        let mut builder = ChartBuilder::on(root);
        style(&mut builder);
        let mut chart = builder
            .caption("E[K] by token category (mean ± s.d.)", (FONT, 22))
            .build_cartesian_2d(segments(n), y)
            .map_err(draw_err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => bars.get(*i).map(|b| b.0.clone()).unwrap_or_default(),
                _ => String::new(),
            })
            .y_desc("E[K] (PLIF steps per token)")
            .x_desc("token category")
            .light_line_style(WHITE)
            .axis_desc_style((FONT, 16))
            .label_style((FONT, 14))
            .draw()
            .map_err(draw_err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, s))| {
                let c = PALETTE[colours.get(i).copied().unwrap_or(i) % PALETTE.len()];
                let mut r = Rectangle::new(
                    [
                        (SegmentValue::Exact(i), 0.0),
                        (SegmentValue::Exact(i + 1), s.mean),
                    ],
                    c.filled(),
                );
                r.set_margin(0, 0, 14, 14);
                r
            }))
            .map_err(draw_err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, s))| {
                ErrorBar::new_vertical(
                    SegmentValue::CenterOf(i),
                    s.mean - s.sd,
                    s.mean,
                    s.mean + s.sd,
                    BLACK.stroke_width(2),
                    12,
                )
            }))
            .map_err(draw_err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, s))| {
                Text::new(
                    format!("{:.2} (n={})", s.mean, s.count),
                    (SegmentValue::CenterOf(i), s.mean + s.sd),
                    TextStyle::from((FONT, 13).into_font()).pos(
                        plotters::style::text_anchor::Pos::new(
                            plotters::style::text_anchor::HPos::Center,
                            plotters::style::text_anchor::VPos::Bottom,
                        ),
                    ),
                )
            }))
            .map_err(draw_err)?;
        Ok(())
    })
}

/// Mean E[K] per layer of SNNBlock and SNNFFN, each with a ±1 s.d. band over tokens.
pub fn layers_png(block: &[Stat], ffn: &[Stat]) -> Result<Vec<u8>, PlotError> {
    let n = block.len().max(ffn.len());
    if n == 0 {
        return Err(PlotError::Empty("no layer"));
    }
    render_png((960, 600), |root| {
        root.fill(&WHITE).map_err(draw_err)?;
        let all = block
            .iter()
            .chain(ffn)
            .flat_map(|s| [s.mean - s.sd, s.mean + s.sd]);
        let (lo, hi) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
        let pad = ((hi - lo) * 0.08).max(0.05);
        let mut builder = ChartBuilder::on(root);
        style(&mut builder);
        let x_hi = (n as f64 - 0.5).max(0.5);
        let mut chart = builder
            .caption(
                "E[K] per layer: SNNBlock vs SNNFFN (mean ± s.d. over tokens)",
                (FONT, 20),
            )
            .build_cartesian_2d(-0.5..x_hi, (lo - pad).max(0.0)..hi + pad)
            .map_err(draw_err)?;
        chart
            .configure_mesh()
            .x_desc("layer")
            .y_desc("E[K] (PLIF steps per token)")
            .x_labels(n + 1)
            .x_label_formatter(&|v| {
                if (v - v.round()).abs() < 1e-6 && *v >= 0.0 {
                    format!("{v:.0}")
                } else {
                    String::new()
                }
            })
            .axis_desc_style((FONT, 16))
            .label_style((FONT, 14))
            .light_line_style(RGBColor(238, 238, 238))
            .draw()
            .map_err(draw_err)?;
        for (stats, colour, name) in [(block, BLOCK, "SNNBlock"), (ffn, FFN, "SNNFFN")] {
            let band: Vec<(f64, f64)> = stats
                .iter()
                .enumerate()
                .map(|(i, s)| (i as f64, s.mean + s.sd))
                .chain(
                    stats
                        .iter()
                        .enumerate()
                        .rev()
                        .map(|(i, s)| (i as f64, s.mean - s.sd)),
                )
                .collect();
            chart
                .draw_series(std::iter::once(Polygon::new(band, colour.mix(0.15))))
                .map_err(draw_err)?;
            let line: Vec<(f64, f64)> = stats
                .iter()
                .enumerate()
                .map(|(i, s)| (i as f64, s.mean))
                .collect();
            chart
                .draw_series(LineSeries::new(line.clone(), colour.stroke_width(2)))
                .map_err(draw_err)?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            chart
                .draw_series(line.into_iter().map(|p| Circle::new(p, 4, colour.filled())))
                .map_err(draw_err)?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft, 15)
    })
}

/// The hidden neurons' β: `static_hist` (σ(b_β) per neuron) and `data_hist` (β(t) over the
/// data), each counts in equal bins of `[0, 1]`, drawn as shares; a line marks `threshold`.
pub fn beta_png(
    static_hist: &[f64],
    data_hist: &[f64],
    threshold: f64,
    split: [(f64, f64); 2],
) -> Result<Vec<u8>, PlotError> {
    let shares = |h: &[f64]| {
        let total: f64 = h.iter().sum();
        h.iter()
            .map(|c| if total > 0.0 { c / total } else { 0.0 })
            .collect::<Vec<f64>>()
    };
    let (s, d) = (shares(static_hist), shares(data_hist));
    if s.iter().chain(&d).all(|&v| v == 0.0) {
        return Err(PlotError::Empty("no β value"));
    }
    render_png((960, 600), |root| {
        root.fill(&WHITE).map_err(draw_err)?;
        let y = bars_range(s.iter().chain(&d).copied());
        let mut builder = ChartBuilder::on(root);
        style(&mut builder);
        let mut chart = builder
            .caption("Hidden-neuron decay β: learned timescales", (FONT, 22))
            .build_cartesian_2d(0.0..1.0, y.clone())
            .map_err(draw_err)?;
        chart
            .configure_mesh()
            .x_desc("β (decay per PLIF step; larger = slower, longer memory)")
            .y_desc("share of values per bin")
            .axis_desc_style((FONT, 16))
            .label_style((FONT, 14))
            .light_line_style(RGBColor(238, 238, 238))
            .draw()
            .map_err(draw_err)?;
        let width = 1.0 / s.len().max(1) as f64;
        chart
            .draw_series(s.iter().enumerate().map(|(i, &v)| {
                let x = i as f64 * width;
                Rectangle::new([(x, 0.0), (x + width, v)], BLOCK.mix(0.75).filled())
            }))
            .map_err(draw_err)?
            .label(format!(
                "static σ(b_β) per neuron: {:.1}% fast, {:.1}% slow",
                split[0].0, split[0].1
            ))
            .legend(|(x, y)| {
                Rectangle::new([(x, y - 5), (x + 20, y + 5)], BLOCK.mix(0.75).filled())
            });
        let wd = 1.0 / d.len().max(1) as f64;
        chart
            .draw_series(LineSeries::new(
                d.iter()
                    .enumerate()
                    .map(|(i, &v)| ((i as f64 + 0.5) * wd, v)),
                FFN.stroke_width(3),
            ))
            .map_err(draw_err)?
            .label(format!(
                "β(t) over the data: {:.1}% fast, {:.1}% slow",
                split[1].0, split[1].1
            ))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], FFN.stroke_width(3)));
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(threshold, 0.0), (threshold, y.end)],
                BLACK.stroke_width(2),
            )))
            .map_err(draw_err)?
            .label(format!("fast < {threshold} ≤ slow"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(2)));
        legend(&mut chart, SeriesLabelPosition::UpperLeft, 15)
    })
}

/// Surprisal against E[K]: (a) every token (`points`: surprisal, E[K], is BOS) with Pearson's
/// r with and without BOS; (b) mean E[K] ± s.d. in surprisal bins (`bins`: range and stat).
pub fn surprisal_png(
    points: &[(f64, f64, bool)],
    r: (Option<f64>, Option<f64>),
    bins: &[(Range<f64>, Stat)],
) -> Result<Vec<u8>, PlotError> {
    if points.is_empty() {
        return Err(PlotError::Empty("no token has a surprisal"));
    }
    render_png((1280, 580), |root| {
        root.fill(&WHITE).map_err(draw_err)?;
        let root = root
            .titled("Surprisal vs E[K]", (FONT, 22))
            .map_err(draw_err)?;
        let (left, right) = root.split_horizontally(660);
        let xs = points.iter().map(|p| p.0);
        let x_hi = xs.fold(0.0, f64::max) * 1.05 + 0.1;
        let ys = points.iter().map(|p| p.1);
        let (lo, hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
        let pad = ((hi - lo) * 0.08).max(0.1);
        let fmt = |v: Option<f64>| v.map_or("n/a".into(), |r| format!("{r:+.2}"));
        let mut builder = ChartBuilder::on(&left);
        style(&mut builder);
        let mut chart = builder
            .caption(
                format!("(a) r = {} with BOS, {} without", fmt(r.0), fmt(r.1)),
                (FONT, 16),
            )
            .build_cartesian_2d(0.0..x_hi, lo - pad..hi + pad)
            .map_err(draw_err)?;
        chart
            .configure_mesh()
            .x_desc("surprisal of the next token (nats)")
            .y_desc("E[K] (PLIF steps per token)")
            .axis_desc_style((FONT, 15))
            .label_style((FONT, 13))
            .light_line_style(RGBColor(238, 238, 238))
            .draw()
            .map_err(draw_err)?;
        for (bos, colour, name) in [(false, TOKENS, "tokens"), (true, BOS, "BOS")] {
            chart
                .draw_series(
                    points
                        .iter()
                        .filter(|p| p.2 == bos)
                        .map(|p| Circle::new((p.0, p.1), 3, colour.mix(0.55).filled())),
                )
                .map_err(draw_err)?
                .label(name)
                .legend(move |(x, y)| Circle::new((x + 10, y), 4, colour.filled()));
        }
        legend(&mut chart, SeriesLabelPosition::LowerRight, 14)?;
        binned_panel(&right, bins, x_hi, lo - pad..hi + pad)
    })
}

fn binned_panel(
    area: &Area<'_>,
    bins: &[(Range<f64>, Stat)],
    x_hi: f64,
    y: Range<f64>,
) -> Result<(), PlotError> {
    let mut builder = ChartBuilder::on(area);
    style(&mut builder);
    let mut chart = builder
        .caption("(b) mean E[K] per surprisal bin (without BOS)", (FONT, 16))
        .build_cartesian_2d(0.0..x_hi, y)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .x_desc("surprisal of the next token (nats)")
        .y_desc("E[K] (mean ± s.d.)")
        .axis_desc_style((FONT, 15))
        .label_style((FONT, 13))
        .light_line_style(RGBColor(238, 238, 238))
        .draw()
        .map_err(draw_err)?;
    let centre = |r: &Range<f64>| (r.start + r.end) / 2.0;
    chart
        .draw_series(bins.iter().map(|(r, s)| {
            ErrorBar::new_vertical(
                centre(r),
                s.mean - s.sd,
                s.mean,
                s.mean + s.sd,
                FFN.stroke_width(2),
                10,
            )
        }))
        .map_err(draw_err)?;
    chart
        .draw_series(LineSeries::new(
            bins.iter().map(|(r, s)| (centre(r), s.mean)),
            FFN.stroke_width(2),
        ))
        .map_err(draw_err)?;
    chart
        .draw_series(bins.iter().map(|(r, s)| {
            Text::new(
                format!("n={}", s.count),
                (centre(r), s.mean + s.sd),
                (FONT, 12),
            )
        }))
        .map_err(draw_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn has(rgb: &[u8], c: RGBColor) -> usize {
        rgb.chunks(3).filter(|p| p == &[c.0, c.1, c.2]).count()
    }

    #[test]
    fn every_chart_draws_its_series_in_their_colours() {
        let s = |mean| Stat {
            mean,
            sd: 0.2,
            count: 9,
        };
        let bars = [("bos".to_string(), s(3.2)), ("punct".into(), s(5.7))];
        let png = categories_png(&bars, &[0, 2]).unwrap();
        let (_, _, rgb) = crate::canvas::decode_png(&png).unwrap();
        assert!(has(&rgb, PALETTE[0]) > 1000 && has(&rgb, PALETTE[2]) > 1000);
        let png = layers_png(&[s(4.0), s(8.0), s(12.0)], &[s(7.5); 3]).unwrap();
        let (_, _, rgb) = crate::canvas::decode_png(&png).unwrap();
        assert!(has(&rgb, BLOCK) > 300 && has(&rgb, FFN) > 300);
        let mut hist = vec![0.0; 50];
        hist[40] = 3.0;
        hist[47] = 1.0;
        let png = beta_png(&hist, &hist, 0.9, [(75.0, 25.0); 2]).unwrap();
        let (_, _, rgb) = crate::canvas::decode_png(&png).unwrap();
        assert!(has(&rgb, FFN) > 100, "the data line");
        let points = [(8.9, 3.2, true), (2.0, 7.5, false), (4.0, 7.9, false)];
        let png = surprisal_png(&points, (Some(-0.5), None), &[(0.0..1.0, s(7.5))]).unwrap();
        let (_, _, rgb) = crate::canvas::decode_png(&png).unwrap();
        assert!(has(&rgb, FFN) > 50, "the binned means");
        let tokens = vec![TokenBar {
            label: "的".into(),
            expected_k: 7.0,
            category: 4,
        }];
        assert!(tokens_png(&[("s".into(), tokens)], &["a", "b"]).is_ok());
    }

    #[test]
    fn empty_inputs_are_refused_and_labels_fit_the_font() {
        assert!(matches!(categories_png(&[], &[]), Err(PlotError::Empty(_))));
        assert!(matches!(layers_png(&[], &[]), Err(PlotError::Empty(_))));
        assert!(matches!(
            beta_png(&[0.0; 4], &[], 0.9, [(0.0, 0.0); 2]),
            Err(PlotError::Empty(_))
        ));
        assert!(matches!(
            surprisal_png(&[], (None, None), &[]),
            Err(PlotError::Empty(_))
        ));
        assert_eq!(axis_text(" the"), "the");
        assert_eq!(axis_text("学习"), "··");
        assert_eq!(axis_text(" "), "␣");
    }
}
