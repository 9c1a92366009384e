//! `bench serve --long-prompt`'s long prompt: its request, and the check that the prompt cut
//! in chunks beside decoding streams gives the numbers it gives alone, bit for bit.

use crate::result::CliResult;

/// The long prompt's request: `n` token ids, 4 greedy tokens with their log-probabilities,
/// fed from its first token (not from the prefix cache, which the first sending fills).
pub fn request(n: usize) -> serde_json::Value {
    serde_json::json!({"type": "generate", "id": "long",
        "prompt": (0..n).map(|j| 5 + (j * 7919) % 1000).collect::<Vec<_>>(),
        "max_tokens": 4, "temperature": 0, "ignore_eos": true, "token_ids": true,
        "logprobs": 1, "cache_prompt": false})
}

/// What the long prompt sent beside a benchmark's clients got.
#[derive(Debug, Clone)]
pub struct LongPrompt {
    pub ttft_ms: f64,
    pub got: Generated,
}

/// A WebSocket generation's tokens and their log-probabilities (each entry as the server's
/// JSON), gathered from its `delta` events.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Generated {
    pub ids: Vec<i64>,
    pub logprobs: Vec<String>,
}

impl Generated {
    /// Takes a `delta` event's tokens and log-probabilities; how many tokens it carried.
    pub fn take(&mut self, delta: &serde_json::Value) -> usize {
        let ids = delta["token_ids"].as_array().map_or(&[][..], Vec::as_slice);
        self.ids.extend(ids.iter().filter_map(|t| t.as_i64()));
        if let Some(l) = delta["logprobs"].as_array() {
            self.logprobs.extend(l.iter().map(|x| x.to_string()));
        }
        ids.len()
    }
}

/// The long prompt sent alone (nothing else open: passes of the whole budget).
async fn alone(addr: std::net::SocketAddr, n: usize) -> CliResult<Generated> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/ws")).await?;
    ws.send(Message::Text(request(n).to_string().into()))
        .await?;
    let mut got = Generated::default();
    while let Some(m) = ws.next().await {
        let Ok(Message::Text(t)) = m else { continue };
        let v: serde_json::Value = serde_json::from_str(&t)?;
        match v["type"].as_str() {
            Some("delta") => {
                got.take(&v);
            }
            Some("done") => break,
            _ => return Err(format!("server: {v}").into()),
        }
    }
    Ok(got)
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
    let got = alone(addr, n).await?;
    let same = beside.got == got;
    println!(
        "{label:>18} the same prompt alone: {} tokens {:?}, {})",
        got.ids.len(),
        got.ids,
        if same {
            "the same tokens and log-probabilities bit for bit as beside the streams"
        } else {
            "DIFFERENT from beside the streams"
        }
    );
    if !same || beside.got.logprobs.is_empty() {
        return Err(format!(
            "the long prompt beside the streams gave {:?}, alone {got:?}",
            beside.got
        )
        .into());
    }
    Ok(())
}
