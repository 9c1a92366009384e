//! `nsactor analyze`: the NeuronSpark paper's interpretability study (§"Biological
//! Interpretability Analysis") run on any checkpoint. Sentences go through the model one at a
//! time, BOS first ([`observe`]); each layer reports every token's E[K] for SNNBlock and
//! SNNFFN and the distribution of its hidden neurons' selective β(t); the edge reports the
//! surprisal of every next token. Tokens are put in categories ([`tags`]); the static β come
//! from the weights file ([`weights`]). [`report`] turns it all into `analysis.json`, and
//! [`write`] draws the charts (with `nsactor-plots`) and prints a summary.

pub mod error;
pub mod observe;
pub mod report;
pub mod sentences;
pub mod stats;
pub mod tags;
pub mod weights;

pub use error::{AnalysisError, Result};
pub use report::Analysis;

use nsactor_plots::analysis::{self as charts, Stat, TokenBar};
use report::FAST_BELOW;
use stats::Summary;
use std::path::{Path, PathBuf};
use tags::Category;

/// The files [`write`] makes in the output directory.
pub const FILES: [&str; 6] = [
    "analysis.json",
    "ek_tokens.png",
    "ek_categories.png",
    "ek_layers.png",
    "beta.png",
    "surprisal_ek.png",
];

fn stat(s: &Summary) -> Stat {
    Stat {
        mean: s.mean,
        sd: s.sd,
        count: s.count,
    }
}

fn save(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    let p = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, &p))
        .map_err(|e| AnalysisError::Io(p.clone(), e))?;
    Ok(p)
}

/// Up to three sentences for the per-token chart: the first ones whose text the chart's
/// font can show (Latin script), else the first ones.
fn token_sentences(a: &Analysis) -> Vec<(String, Vec<TokenBar>)> {
    let latin = |s: &report::SentenceOut| s.text.chars().all(|c| (c as u32) < 0x2000);
    let mut chosen: Vec<_> = a.per_token.iter().filter(|s| latin(s)).take(3).collect();
    if chosen.is_empty() {
        chosen = a.per_token.iter().take(3).collect();
    }
    chosen
        .into_iter()
        .map(|s| {
            let caption: String = s.text.chars().take(110).collect();
            let bars = s
                .tokens
                .iter()
                .map(|t| TokenBar {
                    label: t.text.clone(),
                    expected_k: t.expected_k,
                    category: t.category as usize,
                })
                .collect();
            (caption, bars)
        })
        .collect()
}

/// Writes `analysis.json` and the five charts into `dir` (created), each atomically; returns
/// the paths written.
pub fn write(a: &Analysis, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| AnalysisError::Io(dir.to_path_buf(), e))?;
    let json = serde_json::to_vec_pretty(a).map_err(|e| AnalysisError::Invalid(e.to_string()))?;
    let mut out = vec![save(dir, FILES[0], &json)?];
    let legend: Vec<&str> = Category::ALL.iter().map(|c| c.name()).collect();
    let plot = |name: &'static str, r: std::result::Result<Vec<u8>, nsactor_plots::PlotError>| {
        r.map_err(|e| AnalysisError::Plot(name, e))
    };
    let png = plot(FILES[1], charts::tokens_png(&token_sentences(a), &legend))?;
    out.push(save(dir, FILES[1], &png)?);
    let cats: Vec<(Category, &Summary)> = Category::ALL
        .iter()
        .filter_map(|c| Some((*c, a.expected_k.by_category.get(c.name())?)))
        .collect();
    let bars: Vec<(String, Stat)> = cats
        .iter()
        .map(|(c, s)| (c.name().to_string(), stat(s)))
        .collect();
    let colours: Vec<usize> = cats.iter().map(|(c, _)| *c as usize).collect();
    out.push(save(
        dir,
        FILES[2],
        &plot(FILES[2], charts::categories_png(&bars, &colours))?,
    )?);
    let block: Vec<Stat> = a
        .expected_k
        .per_layer
        .iter()
        .map(|l| stat(&l.block))
        .collect();
    let ffn: Vec<Stat> = a
        .expected_k
        .per_layer
        .iter()
        .map(|l| stat(&l.ffn))
        .collect();
    out.push(save(
        dir,
        FILES[3],
        &plot(FILES[3], charts::layers_png(&block, &ffn))?,
    )?);
    let (s, d) = (&a.beta.hidden_static, &a.beta.hidden_over_data);
    let png = charts::beta_png(
        &s.histogram,
        &d.histogram,
        FAST_BELOW,
        [
            (s.fast_percent, s.slow_percent),
            (d.fast_percent, d.slow_percent),
        ],
    );
    out.push(save(dir, FILES[4], &plot(FILES[4], png)?)?);
    let points: Vec<(f64, f64, bool)> = a
        .per_token
        .iter()
        .flat_map(|s| &s.tokens)
        .filter_map(|t| Some((t.surprisal?, t.expected_k, t.category == Category::Bos)))
        .collect();
    let bins: Vec<_> = a
        .surprisal
        .bins
        .iter()
        .map(|b| (b.lo..b.hi, stat(&b.y)))
        .collect();
    let png = charts::surprisal_png(
        &points,
        (a.surprisal.r_with_bos, a.surprisal.r_without_bos),
        &bins,
    );
    out.push(save(dir, FILES[5], &plot(FILES[5], png)?)?);
    Ok(out)
}

/// A few lines for the terminal: the study's headline numbers.
pub fn summary(a: &Analysis) -> String {
    let m = &a.model;
    let mut s = format!(
        "analysed {} sentences, {} tokens: {} layers, D {}, N {}, K {} on {}\n",
        a.sentences, a.tokens, m.layers, m.d, m.n, m.k, m.backend
    );
    let e = &a.expected_k.all_tokens;
    s += &format!(
        "E[K] per token: mean {:.2} (s.d. {:.2}, {:.2} … {:.2}) of K = {}\n",
        e.mean, e.sd, e.min, e.max, m.k
    );
    let cats: Vec<String> = a
        .expected_k
        .by_category
        .iter()
        .map(|(c, v)| format!("{c} {:.2} (n={})", v.mean, v.count))
        .collect();
    s += &format!("E[K] by category: {}\n", cats.join(", "));
    let layers: Vec<String> = a
        .expected_k
        .per_layer
        .iter()
        .map(|l| format!("{}: {:.2}/{:.2}", l.layer, l.block.mean, l.ffn.mean))
        .collect();
    s += &format!("E[K] per layer (SNNBlock/SNNFFN): {}\n", layers.join(", "));
    let r = |v: Option<f64>| v.map_or("n/a".into(), |r| format!("{r:+.3}"));
    s += &format!(
        "surprisal vs E[K]: r = {} with BOS, {} without ({} tokens)\n",
        r(a.surprisal.r_with_bos),
        r(a.surprisal.r_without_bos),
        a.surprisal.pairs
    );
    let (st, d) = (&a.beta.hidden_static, &a.beta.hidden_over_data);
    s += &format!(
        "hidden neurons: static σ(b_β) {:.1}% fast (β < {FAST_BELOW}), {:.1}% slow, of {}; β(t) over the data {:.1}% fast, {:.1}% slow\n",
        st.fast_percent, st.slow_percent, st.count, d.fast_percent, d.slow_percent
    );
    s
}
