//! Hostile and careless clients on loopback: oversized bodies get a 413 the client can read,
//! silent connections are dropped, the connection cap answers 503, a generation past its time
//! budget ends, an idle WebSocket is closed, and 200 streams abandoned mid-way leave no
//! session open and no memory behind.

mod common;

use common::{http, http_head, serve_limited};
use nsactor_server::protocol::Limits;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the peer closes (or `limit` passes); what was read.
async fn read_to_close(s: &mut TcpStream, limit: Duration) -> Option<String> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let r = tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    r.ok().map(|()| String::from_utf8_lossy(&out).into_owned())
}

#[test]
fn oversized_bodies_get_a_413_the_client_can_read() {
    let s = serve_limited(2, true, Limits::default());
    let addr = s.addr;
    s.pipeline.block_on(async move {
        // 10 MB declared and sent in full: the client finishes its upload and reads the 413.
        let body = vec![b'x'; 10 << 20];
        let (status, head, answer) = http_head(addr, "POST", "/v1/completions", "", &body).await;
        assert_eq!(status, 413, "{head}\n{answer}");
        let e: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(e["error"]["code"], "request_too_large", "{e}");
        // Chunked, with no length given: refused once it passes the limit.
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
        tcp.write_all(head.as_bytes()).await.unwrap();
        let chunk = format!("{:x}\r\n{}\r\n", 1 << 16, "y".repeat(1 << 16));
        // 5 MiB, past the default limit (4 MiB).
        for _ in 0..80 {
            if tcp.write_all(chunk.as_bytes()).await.is_err() {
                break;
            }
        }
        let _ = tcp.write_all(b"0\r\n\r\n").await;
        let answer = read_to_close(&mut tcp, Duration::from_secs(20))
            .await
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        // The server goes on.
        let (status, _) = http(
            addr,
            "POST",
            "/v1/completions",
            br#"{"prompt":[87],"max_tokens":2}"#,
        )
        .await;
        assert_eq!(status, 200);
    });
}

#[test]
fn silent_connections_are_dropped_and_the_cap_answers_503() {
    let limits = Limits {
        header_timeout: Duration::from_millis(700),
        max_connections: 3,
        ..Limits::default()
    };
    let s = serve_limited(2, true, limits);
    let (addr, state) = (s.addr, s.state.clone());
    s.pipeline.block_on(async move {
        // Three connections that send nothing fill the cap; a fourth gets a 503 at once.
        let mut silent = Vec::new();
        for _ in 0..3 {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut fourth = TcpStream::connect(addr).await.unwrap();
        let answer = read_to_close(&mut fourth, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(
            answer.to_ascii_lowercase().contains("retry-after: 1"),
            "{answer}"
        );
        assert!(answer.contains("connections open"), "{answer}");
        // The silent ones are closed by the header timeout, half a header or none.
        silent[0].write_all(b"POST /v1/comp").await.unwrap();
        let t = Instant::now();
        for s in &mut silent {
            read_to_close(s, Duration::from_secs(5))
                .await
                .expect("closed by the server");
        }
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        // Their places are free again.
        let (status, body) = http(addr, "GET", "/health", b"").await;
        assert_eq!(status, 200, "{body}");
        let m = state.generator.metrics.render(Default::default());
        assert!(m.contains("nsactor_connections_refused_total 1"), "{m}");
    });
}

#[test]
fn generations_end_at_their_time_limit_and_idle_websockets_close() {
    let limits = Limits {
        request_time_limit: Some(Duration::from_millis(300)),
        ws_idle_timeout: Duration::from_millis(500),
        ..Limits::default()
    };
    let s = serve_limited(2, true, limits);
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let req = br#"{"prompt":[87],"max_tokens":4096,"ignore_eos":true}"#;
        let t = Instant::now();
        let (status, body) = http(addr, "POST", "/v1/completions", req).await;
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        // `length` on OpenAI's endpoint: its reasons are a closed set.
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
        assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 4096);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // A WebSocket with nothing running and nothing said is told and closed.
        let mut ws = common::connect(addr).await;
        let m = common::next_json(&mut ws).await;
        assert_eq!(m["type"], "error", "{m}");
        assert!(m["message"].as_str().unwrap().contains("idle"), "{m}");
        match futures_util::StreamExt::next(&mut ws).await {
            Some(Ok(tokio_tungstenite::tungstenite::Message::Close(Some(f)))) => {
                assert_eq!(u16::from(f.code), 1001, "{f:?}");
            }
            other => panic!("expected a close frame, got {other:?}"),
        }
    });
}

/// The soak: 200 streams (20 at a time) abandoned after their first token. Every session is
/// freed, the process's memory stays within a bound, and the server still answers.
#[test]
fn two_hundred_abandoned_streams_leave_no_sessions_and_no_memory_behind() {
    let s = serve_limited(32, true, Limits::default());
    let (addr, state) = (s.addr, s.state.clone());
    let rss_kib = || -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    s.pipeline.block_on(async move {
        let abandon = || async move {
            let body = br#"{"prompt":[87],"max_tokens":4000,"ignore_eos":true,"stream":true}"#;
            let mut tcp = common::send_request(addr, "POST", "/v1/completions", "", body).await;
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while !String::from_utf8_lossy(&seen).contains("\"text\"") {
                let n = tcp.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed before the first token");
                seen.extend_from_slice(&buf[..n]);
            }
            drop(tcp); // mid-stream
        };
        let wave = || async {
            let tasks: Vec<_> = (0..20).map(|_| tokio::spawn(abandon())).collect();
            for t in tasks {
                t.await.unwrap();
            }
        };
        let settled = || async {
            let g = &state.generator;
            for _ in 0..300 {
                let active = g.metrics.running.get();
                if active == 0 && g.decoder.open_sessions() == 0 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!(
                "sessions left open: {} active, {} held by the actors",
                g.metrics.running.get(),
                g.decoder.open_sessions()
            );
        };
        // Warm up (allocator pools, actor mailboxes), then measure 200 more.
        wave().await;
        settled().await;
        let before = rss_kib();
        for _ in 0..10 {
            wave().await;
        }
        settled().await;
        let grown = rss_kib().saturating_sub(before);
        assert!(
            grown < 64 * 1024,
            "memory grew by {grown} KiB over 200 abandoned streams"
        );
        let (status, body) = http(
            addr,
            "POST",
            "/v1/completions",
            br#"{"prompt":[87],"max_tokens":2}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        eprintln!("soak: 200 abandoned streams, RSS grew {grown} KiB");
    });
}
