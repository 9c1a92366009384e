//! `nsactor bench serve --turns N`: clients each holding an N-turn conversation through
//! `POST /v1/chat/completions` (streamed), as a chat front end does: every turn resends the
//! whole history, the assistant's answers included. It prints the time to first token of
//! each turn over the clients, and what the prefix state cache did: with it, a turn's first
//! token should not wait for the history before it.

use super::sse::{Sender, connect, data_events, post};
use crate::result::CliResult;
use http_body_util::BodyExt;
use nsactor_decoding::prefix::PrefixCache;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// What the conversations are made of.
#[derive(Debug, Clone, Copy)]
pub struct Turns {
    pub clients: usize,
    /// The first client's number: each run of `--sessions` numbers its clients after the
    /// runs before it, so a run's conversations are new to the cache (a second wave of the
    /// same size shows what the first one's new shapes cost).
    pub first: usize,
    pub turns: usize,
    /// Bytes of each user message (English words).
    pub user_bytes: usize,
    /// Bytes of the system prompt every conversation starts with (at least its first
    /// sentence).
    pub system_bytes: usize,
    /// Tokens each answer may have.
    pub answer_tokens: usize,
    pub temperature: f32,
}

/// One turn of one client: seconds to its first token, its prompt's tokens, its answer.
type Turn = (f64, usize, String);

/// Runs the conversations against the server at `addr` and prints a row per turn, then the
/// cache's counters over the run, and, for a burst of one-turn clients, the least time its
/// prefill could take at the `ceiling` (where its peak is known).
pub async fn run(
    addr: std::net::SocketAddr,
    t: Turns,
    cache: &Arc<PrefixCache>,
    ceiling: &super::flops::Ceiling,
) -> CliResult {
    let s0 = counters(cache);
    let start = Instant::now();
    let clients: Vec<_> = (0..t.clients)
        .map(|i| tokio::spawn(conversation(addr, t.first + i, t)))
        .collect();
    let mut per_turn: Vec<Vec<Turn>> = vec![Vec::new(); t.turns];
    // Every answer in (client, turn) order: equal digests, equal conversations (a run with the
    // cache against one without it).
    let mut digest = std::collections::hash_map::DefaultHasher::new();
    for c in clients {
        for (k, turn) in c.await??.into_iter().enumerate() {
            std::hash::Hash::hash(&turn.2, &mut digest);
            per_turn[k].push(turn);
        }
    }
    let wall = start.elapsed().as_secs_f64();
    println!(
        "{:>6} {:>8} {:>14} {:>14} {:>16}",
        "turn", "clients", "TTFT p50 (ms)", "TTFT p99 (ms)", "prompt tokens"
    );
    for (k, rows) in per_turn.iter().enumerate() {
        let mut ttft: Vec<f64> = rows.iter().map(|r| r.0 * 1e3).collect();
        let tokens = rows.iter().map(|r| r.1).sum::<usize>() / rows.len().max(1);
        println!(
            "{:>6} {:>8} {:>14.1} {:>14.1} {:>16}",
            k + 1,
            rows.len(),
            super::stats::pct(&mut ttft, 0.5),
            super::stats::pct(&mut ttft, 0.99),
            tokens
        );
    }
    let s1 = counters(cache);
    let [hits, misses, saved] = [0, 1, 2].map(|i| s1[i] - s0[i]);
    let u = cache.usage();
    println!(
        "prefix cache: {hits} hits, {misses} misses ({:.1} % hit rate), {saved} prompt tokens not prefilled; {} snapshots, {:.1} MiB on the devices, {:.1} MiB on the host; {} conversations of {} turns in {wall:.1} s; answers' digest {:016x}",
        100.0 * hits as f64 / (hits + misses).max(1) as f64,
        u.entries,
        u.device_bytes as f64 / (1 << 20) as f64,
        u.host_bytes as f64 / (1 << 20) as f64,
        t.clients,
        t.turns,
        std::hash::Hasher::finish(&digest)
    );
    if t.turns == 1 && t.clients > 1 {
        // Every client's prompt less its share of what the cache saved (the system prompt
        // they all start with: the same for each).
        let share = saved as f64 / t.clients as f64;
        let fed: Vec<f64> = per_turn[0]
            .iter()
            .map(|r| (r.1 as f64 - share).max(0.0))
            .collect();
        if let Some(line) = burst_floor(ceiling, &fed) {
            println!("{line}");
        }
    }
    Ok(())
}

/// What a burst of prompts arriving together needs, `fed` the tokens each client's prompt has
/// prefilled (the rest came from the cache): their FLOPs, and the least time at the device's
/// dense peak for all of them and for the median client's first token (no first token before
/// its prompt is through the model, so half the clients' prompts must be: at best the half
/// with the fewest tokens). `None` without a known peak.
fn burst_floor(ceiling: &super::flops::Ceiling, fed: &[f64]) -> Option<String> {
    let peak = ceiling.peak_tflops?;
    let ms = |tokens: f64| tokens * ceiling.flops_per_token / (peak * 1e12) * 1e3;
    let mut sorted = fed.to_vec();
    sorted.sort_by(f64::total_cmp);
    let all: f64 = sorted.iter().sum();
    let half: f64 = sorted[..fed.len().div_ceil(2)].iter().sum();
    Some(format!(
        "burst floor: {all:.0} prompt tokens prefilled ({:.1} a client), {:.1} TFLOP: {:.1} ms for all and ≥ {:.1} ms to the median client's first token (the half with the fewest tokens first) at the dense peak ({peak} TFLOP/s)",
        all / fed.len().max(1) as f64,
        all * ceiling.flops_per_token / 1e12,
        ms(all),
        ms(half)
    ))
}

fn counters(c: &PrefixCache) -> [u64; 3] {
    let s = &c.stats;
    [&s.hits, &s.misses, &s.tokens_saved].map(|a| a.load(Ordering::Relaxed))
}

/// `bytes` of English words, different for each `(client, turn)`.
fn user_text(client: usize, turn: usize, bytes: usize) -> String {
    const WORDS: [&str; 16] = [
        "the", "river", "quiet", "morning", "found", "a", "small", "garden", "where", "light",
        "fell", "on", "old", "stones", "and", "birds",
    ];
    let mut x = (client as u64 * 7919 + turn as u64 * 104_729) | 1;
    let mut s = format!("Question {turn} from client {client}:");
    while s.len() < bytes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push(' ');
        s.push_str(WORDS[(x % 16) as usize]);
    }
    s.push('?');
    s
}

/// One client's conversation: each turn's time to first token and prompt tokens.
async fn conversation(addr: std::net::SocketAddr, client: usize, t: Turns) -> CliResult<Vec<Turn>> {
    let mut sender = connect(addr).await?;
    let mut system = "You are a helpful assistant who answers briefly.".to_string();
    while system.len() < t.system_bytes {
        system.push_str(" Keep to the facts of the garden and the river.");
    }
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    let mut out = Vec::with_capacity(t.turns);
    for turn in 0..t.turns {
        messages.push(serde_json::json!({"role": "user",
            "content": user_text(client, turn, t.user_bytes)}));
        let body = serde_json::json!({"messages": messages, "max_tokens": t.answer_tokens,
            "temperature": t.temperature, "seed": client, "stream": true,
            "stream_options": {"include_usage": true}});
        let (ttft, answer, prompt_tokens) = chat_turn(&mut sender, addr, &body).await?;
        let prompt_tokens = prompt_tokens.ok_or("the stream ended without its usage")? as usize;
        messages.push(serde_json::json!({"role": "assistant", "content": answer.clone()}));
        out.push((ttft, prompt_tokens, answer));
    }
    Ok(out)
}

/// `POST path` of raw `body` (`content_type`) on a new connection: the answer's bytes, or an
/// error with the server's answer when it is not a success.
async fn post_bytes(
    addr: std::net::SocketAddr,
    path: &str,
    content_type: &str,
    body: Vec<u8>,
) -> CliResult<Vec<u8>> {
    let mut sender = connect(addr).await?;
    let req = hyper::Request::post(path)
        .header("host", addr.to_string())
        .header("content-type", content_type)
        .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
        .map_err(|e| format!("request: {e}"))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("POST {path}: {e}"))?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("reading {path}: {e}"))?
        .to_bytes()
        .to_vec();
    if !status.is_success() {
        return Err(format!("{path}: {status} {}", String::from_utf8_lossy(&bytes)).into());
    }
    Ok(bytes)
}

/// A streamed chat turn: seconds to its first token, its answer, its prompt tokens.
async fn timed_turn(
    addr: std::net::SocketAddr,
    messages: &[serde_json::Value],
    tokens: usize,
) -> CliResult<(f64, String, u64)> {
    let body = serde_json::json!({"messages": messages, "max_tokens": tokens,
        "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let mut sender = connect(addr).await?;
    let (ttft, answer, prompt) = chat_turn(&mut sender, addr, &body).await?;
    Ok((ttft, answer, prompt.unwrap_or(0)))
}

/// Sends one streamed chat completion on `sender` and reads it to its end: seconds to its
/// first token (NaN without one), its answer, and the prompt tokens its usage names.
async fn chat_turn(
    sender: &mut Sender,
    addr: std::net::SocketAddr,
    body: &serde_json::Value,
) -> CliResult<(f64, String, Option<u64>)> {
    let sent = Instant::now();
    let mut stream = post(sender, addr, "/v1/chat/completions", body).await?;
    let (mut ttft, mut answer, mut prompt) = (None, String::new(), None);
    let mut buf = String::new();
    while let Some(frame) = stream.frame().await {
        let frame = frame.map_err(|e| format!("reading the stream: {e}"))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        for p in data_events(&mut buf, data) {
            // Read on to the body's end: the connection carries the next turn.
            if p == "[DONE]" {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&p)?;
            prompt = v["usage"]["prompt_tokens"].as_u64().or(prompt);
            let c = &v["choices"][0];
            if c.is_object() && c["finish_reason"].is_null() {
                ttft.get_or_insert(sent.elapsed().as_secs_f64());
                answer.push_str(c["delta"]["content"].as_str().unwrap_or(""));
            }
        }
    }
    Ok((ttft.unwrap_or(f64::NAN), answer, prompt))
}

/// `--carry N`: a conversation of about `n` tokens (a long system prompt and a question) is
/// answered on the server at `a`, and its state exported; the server at `b` (the same model,
/// its cache empty: a restarted server) imports it, and the conversation's next turn is timed
/// there, beside the same turn on the server at `c`, which prefills it all. Greedy, so the two
/// answers must agree.
pub async fn carry(
    [a, b, c]: [std::net::SocketAddr; 3],
    n: usize,
    answer_tokens: usize,
) -> CliResult {
    let mut system = String::from("You are a careful assistant.");
    let filler = " The garden by the river keeps its old stones, and the birds come at dawn.";
    // Bytes a token of the served model's tokenizer, counted by the server on the filler
    // (the 0.9B's cuts English into about 1.1 bytes a token, the bundled one into ~2.5).
    let sample = filler.repeat(32);
    let body = serde_json::json!({"prompt": sample, "add_special_tokens": false});
    let counted = post_bytes(
        a,
        "/tokenize",
        "application/json",
        body.to_string().into_bytes(),
    )
    .await?;
    let counted: serde_json::Value = serde_json::from_slice(&counted)?;
    let tokens = counted["count"]
        .as_u64()
        .filter(|&c| c > 0)
        .ok_or_else(|| {
            format!(
                "the server's /tokenize answered no count for the carried conversation: {counted}"
            )
        })?;
    let bytes_per_token = sample.len() as f64 / tokens as f64;
    while (system.len() as f64) < n as f64 * bytes_per_token {
        system.push_str(filler);
    }
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": system}),
        serde_json::json!({"role": "user", "content": "What do the birds do?"}),
    ];
    let (first, answer, prompt) = timed_turn(a, &messages, answer_tokens).await?;
    messages.push(serde_json::json!({"role": "assistant", "content": answer}));
    let t = Instant::now();
    let body = serde_json::json!({"messages": messages})
        .to_string()
        .into_bytes();
    let file = post_bytes(a, "/v1/state/export", "application/json", body).await?;
    let export_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let imported = post_bytes(
        b,
        "/v1/state/import",
        "application/octet-stream",
        file.clone(),
    )
    .await?;
    let import_ms = t.elapsed().as_secs_f64() * 1e3;
    let imported: serde_json::Value = serde_json::from_slice(&imported)?;
    messages.push(serde_json::json!({"role": "user", "content": "And then?"}));
    let (warm, on_b, tokens_b) = timed_turn(b, &messages, answer_tokens).await?;
    let (cold, on_c, tokens_c) = timed_turn(c, &messages, answer_tokens).await?;
    println!(
        "carry: a conversation of {} tokens (first turn {prompt} prompt tokens, TTFT {:.1} ms); export {export_ms:.1} ms, {:.2} MB file; import on a server with an empty cache {import_ms:.1} ms",
        imported["tokens"],
        first * 1e3,
        file.len() as f64 / 1e6,
    );
    println!(
        "carry: next turn ({tokens_b} prompt tokens) TTFT {:.1} ms after the import, {:.1} ms prefilling it all ({tokens_c} tokens); answers {}",
        warm * 1e3,
        cold * 1e3,
        if on_b == on_c { "equal" } else { "DIFFER" }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_floor_counts_the_shortest_half_for_the_median() {
        let c = super::super::flops::Ceiling {
            flops_per_token: 26.2e9,
            peak_tflops: Some(989.0),
        };
        // 256 clients, half with 18 new tokens and half with 26 (5,632 in all): 147.6 TFLOP,
        // 149.2 ms at 989; the median client waits at least for the 128 shortest, 2,304 tokens.
        let fed: Vec<f64> = (0..256)
            .map(|i| if i % 2 == 0 { 26.0 } else { 18.0 })
            .collect();
        let line = burst_floor(&c, &fed).unwrap();
        assert!(
            line.contains("5632 prompt tokens prefilled (22.0 a client)"),
            "{line}"
        );
        assert!(line.contains("147.6 TFLOP: 149.2 ms for all"), "{line}");
        assert!(line.contains("≥ 61.0 ms to the median"), "{line}");
        let cpu = super::super::flops::Ceiling {
            flops_per_token: 1.0,
            peak_tflops: None,
        };
        assert!(burst_floor(&cpu, &[10.0, 2.0]).is_none());
    }
}
