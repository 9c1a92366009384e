//! `bench serve --long-prompt`'s long prompt: its request, and the check that the prompt cut
//! in chunks beside decoding streams gives the numbers it gives alone, bit for bit.

use super::stats::LongPrompt;
use crate::result::CliResult;

/// The long prompt's request: `n` token ids, 4 greedy tokens with their log-probabilities,
/// fed from its first token (not from the prefix cache, which the first sending fills).
pub fn request(n: usize) -> serde_json::Value {
    serde_json::json!({"type": "generate", "id": "long",
        "prompt": (0..n).map(|j| 5 + (j * 7919) % 1000).collect::<Vec<_>>(),
        "max_tokens": 4, "temperature": 0, "ignore_eos": true, "token_ids": true,
        "logprobs": 1, "cache_prompt": false})
}

/// The long prompt sent alone (nothing else open: passes of the whole budget): its tokens and
/// log-probabilities, as JSON text.
async fn alone(addr: std::net::SocketAddr, n: usize) -> CliResult<(Vec<i64>, Vec<String>)> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/ws")).await?;
    ws.send(Message::Text(request(n).to_string().into()))
        .await?;
    let (mut ids, mut logprobs) = (Vec::new(), Vec::new());
    while let Some(m) = ws.next().await {
        let Ok(Message::Text(t)) = m else { continue };
        let v: serde_json::Value = serde_json::from_str(&t)?;
        match v["type"].as_str() {
            Some("delta") => {
                let got = v["token_ids"].as_array().cloned().unwrap_or_default();
                ids.extend(got.iter().filter_map(|t| t.as_i64()));
                if let Some(l) = v["logprobs"].as_array() {
                    logprobs.extend(l.iter().map(|x| x.to_string()));
                }
            }
            Some("done") => break,
            _ => return Err(format!("server: {v}").into()),
        }
    }
    Ok((ids, logprobs))
}

/// Sends the `n`-token prompt again with nothing else running and fails unless it gets what
/// `beside` (the same prompt cut in chunks beside the streams) got, bit for bit: the passes
/// are batch invariant, so how a prompt is cut changes none of its numbers. Prints the
/// finding under `label`.
pub async fn check_alone(
    addr: std::net::SocketAddr,
    n: usize,
    beside: &LongPrompt,
    label: &str,
) -> CliResult {
    let (ids, logprobs) = alone(addr, n).await?;
    let same = (&beside.ids, &beside.logprobs) == (&ids, &logprobs);
    println!(
        "{label:>18} the same prompt alone: {} tokens {ids:?}, {})",
        ids.len(),
        if same {
            "the same tokens and log-probabilities bit for bit as beside the streams"
        } else {
            "DIFFERENT from beside the streams"
        }
    );
    if !same || beside.logprobs.is_empty() {
        return Err(format!(
            "the long prompt beside the streams gave {:?} {:?}, alone {ids:?} {logprobs:?}",
            beside.ids, beside.logprobs
        )
        .into());
    }
    Ok(())
}
