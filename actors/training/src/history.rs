//! A run's `metrics.jsonl`, read back: what a resumed run keeps of the lines written before
//! its checkpoint, and the series `loss.png` draws ([`curves`], [`draw`]).

use nsactor_engine::error::RuntimeError;
use nsactor_plots::{KStats, TrainingCurves};
use std::collections::BTreeMap;

/// The metrics of steps 1..=`upto` from an earlier part of the run: their losses (for the loss
/// curve; NaN for a skipped step) and the lines to keep: the last line of each of those steps
/// and every event line (recoveries, restarts, checkpoints) but the `eval` scores of steps after
/// `upto`, in the order they were written. A line that is not JSON is kept as it is, with a
/// warning (it is not the resume's to judge), unless it is the last, cut short by the crash
/// the resume follows: that one is dropped, also with a warning.
pub fn previous_metrics(metrics: &std::path::Path, upto: u64) -> (Vec<f64>, String) {
    let text = std::fs::read_to_string(metrics).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let mut kept: BTreeMap<usize, &str> = BTreeMap::new();
    let mut by_step: BTreeMap<u64, (usize, f64)> = BTreeMap::new();
    for (i, line) in lines.iter().enumerate() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            if line.trim().is_empty() {
                continue;
            }
            let last = i + 1 == lines.len();
            tracing::warn!(
                "{} line {}: not a JSON record ({} bytes){}",
                metrics.display(),
                i + 1,
                line.len(),
                if last {
                    ", the last, cut short by the crash: dropped"
                } else {
                    "; kept as it is"
                }
            );
            if !last {
                kept.insert(i, line);
            }
            continue;
        };
        if v["event"] == "eval" && v["step"].as_u64().is_some_and(|s| s > upto) {
            // A held-out score of weights the resume discards: the resumed run scores its own.
            continue;
        } else if v.get("event").is_some() {
            kept.insert(i, line);
        } else if let Some(step) = v["step"].as_u64()
            && step <= upto
        {
            // A step logged twice (redone after a rollback) keeps its last line.
            by_step.insert(step, (i, v["loss"].as_f64().unwrap_or(f64::NAN)));
        }
    }
    for (i, _) in by_step.values() {
        kept.insert(*i, lines[*i]);
    }
    let losses = by_step.values().map(|(_, l)| *l).collect();
    let text = kept.into_values().map(|l| format!("{l}\n")).collect();
    (losses, text)
}

/// The series of `loss.png` from a run's `metrics.jsonl` text: per step (the last line of a
/// step logged twice, as after a rollback) its loss (NaN when it scored nothing), learning rate
/// and E[K]; per `eval` event the held-out loss.
pub fn curves(text: &str, title: String) -> TrainingCurves {
    let mut steps: BTreeMap<u64, serde_json::Value> = BTreeMap::new();
    let mut evals: BTreeMap<u64, f64> = BTreeMap::new();
    for v in text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    {
        let Some(step) = v["step"].as_u64() else {
            continue;
        };
        match v["event"].as_str() {
            Some("eval") => {
                if let Some(l) = v["eval_loss"].as_f64() {
                    evals.insert(step, l);
                }
            }
            Some(_) => {}
            None => {
                steps.insert(step, v);
            }
        }
    }
    let num = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    TrainingCurves {
        title,
        loss: steps.iter().map(|(s, v)| (*s, num(v, "loss"))).collect(),
        eval_loss: evals.into_iter().collect(),
        lr: steps.iter().map(|(s, v)| (*s, num(v, "lr"))).collect(),
        expected_k: steps
            .iter()
            .map(|(s, v)| {
                let stats = KStats {
                    mean: num(v, "expected_k"),
                    min: num(v, "expected_k_min"),
                    max: num(v, "expected_k_max"),
                };
                (*s, stats)
            })
            .collect(),
    }
}

/// Draws the curves of the run whose `metrics.jsonl` is `metrics` into `png` (written
/// atomically), 960 × 900 pixels.
pub fn draw(
    metrics: &std::path::Path,
    png: &std::path::Path,
    title: String,
) -> Result<(), RuntimeError> {
    let text = std::fs::read_to_string(metrics).map_err(|e| RuntimeError::Io(metrics.into(), e))?;
    let bytes = curves(&text, title)
        .to_png((960, 900))
        .map_err(|e| RuntimeError::Invalid(format!("{}: {e}", png.display())))?;
    nsactor_checkpoint::weights::write_atomic(png, &bytes)
        .map_err(|e| RuntimeError::Io(png.into(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curves_keep_a_redone_steps_last_line_and_the_evaluations() {
        let text = [
            r#"{"step":1,"loss":5.0,"lr":0.001,"expected_k":2.0,"expected_k_min":1.5,"expected_k_max":2.5}"#,
            r#"{"step":2,"loss":9.0,"lr":0.001,"expected_k":2.0,"expected_k_min":1.5,"expected_k_max":2.5}"#,
            r#"{"event":"loss_spike","step":2,"to_step":1}"#,
            r#"{"step":2,"loss":4.0,"lr":0.002,"expected_k":2.1,"expected_k_min":1.6,"expected_k_max":2.6}"#,
            r#"{"step":3,"loss":null,"lr":0.003,"expected_k":2.2,"expected_k_min":1.7,"expected_k_max":2.7}"#,
            r#"{"event":"eval","step":3,"eval_loss":4.5}"#,
            "not json",
        ]
        .join("\n");
        let c = curves(&text, "t".into());
        assert_eq!(c.loss.len(), 3);
        assert_eq!(c.loss[1], (2, 4.0), "the redone step's last line");
        assert!(c.loss[2].1.is_nan(), "an unscored step is NaN");
        assert_eq!(c.lr[2], (3, 0.003));
        assert_eq!(c.expected_k[1].1.max, 2.6);
        assert_eq!(c.eval_loss, [(3, 4.5)]);
    }

    /// [`previous_metrics`] of a `metrics.jsonl` holding `lines`, in a temporary directory
    /// named `name`.
    fn kept_of(lines: &[&str], name: &str, upto: u64) -> (Vec<f64>, String) {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.jsonl");
        std::fs::write(&path, lines.join("\n")).unwrap();
        let kept = previous_metrics(&path, upto);
        std::fs::remove_dir_all(&dir).unwrap();
        kept
    }

    #[test]
    fn a_resume_keeps_the_steps_and_events_up_to_its_checkpoint_and_no_later_score() {
        let lines = [
            r#"{"step":1,"loss":5.0}"#,
            r#"{"event":"eval","step":1,"eval_loss":5.5}"#,
            r#"{"step":2,"loss":4.0}"#,
            r#"{"event":"checkpoint","step":2}"#,
            r#"{"step":3,"loss":3.0}"#,
            r#"{"event":"eval","step":3,"eval_loss":3.5}"#,
            r#"{"event":"restart","step":3}"#,
        ];
        let (losses, text) = kept_of(&lines, "nsactor-history", 2);
        assert_eq!(losses, [5.0, 4.0]);
        let want = [lines[0], lines[1], lines[2], lines[3], lines[6]];
        assert_eq!(text, want.map(|l| format!("{l}\n")).concat());
    }

    #[test]
    fn a_resume_keeps_a_damaged_line_but_drops_the_torn_last_one() {
        let lines = [
            r#"{"step":1,"loss":5.0}"#,
            r#"{"step":2,"lo"#,
            r#"{"step":3,"loss":3.0}"#,
            r#"{"step":4,"lo"#,
        ];
        let (losses, text) = kept_of(&lines, "nsactor-torn", 3);
        assert_eq!(losses, [5.0, 3.0]);
        let want = [lines[0], lines[1], lines[2]];
        assert_eq!(text, want.map(|l| format!("{l}\n")).concat());
    }
}
