//! The server through a lost stage, on the `tiny_a` fixture's weights: a layer that panics
//! mid-generation ends that generation with an error event, `/health` says `recovering` and
//! then `ok`, `/metrics` counts the recovery, and the next generation is the fixture's greedy
//! output again (the rebuilt pipeline reloaded the weights).

mod common;

use common::{connect, generate, http, next_json, serve_faulty};
use futures_util::SinkExt;
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

#[test]
fn a_generation_that_loses_a_stage_fails_alone_and_the_server_heals() {
    // tiny_a has two layers; greedy decoding of n tokens is n passes after the prompt's
    // prefix cache pass (all of the prompt but its last token, kept as a snapshot): the first
    // generation takes n + 1 passes, the second starts from that snapshot, and its third pass
    // panics. The third generation comes after the rebuild, which lost the snapshots.
    let bytes = common::fixture();
    let fx = nsactor_training::verify::TinyAFixture::parse(&bytes).unwrap();
    let n = fx.i64s("gen.greedy").unwrap().len() - fx.i64s("gen.prompt").unwrap().len();
    let s = serve_faulty(&format!("session-panic:1:{}", n + 4));
    let (prompt, greedy, addr) = (s.prompt.clone(), s.greedy.clone(), s.addr);
    let p = prompt.clone();
    let req = move |id: &str| {
        serde_json::json!({"type": "generate", "id": id, "prompt": p, "max_tokens": n,
            "temperature": 0, "token_ids": true, "ignore_eos": true})
    };
    s.pipeline.block_on(async move {
        let mut ws = connect(addr).await;
        let (_, ids, _) = generate(&mut ws, req("a")).await;
        assert_eq!([&prompt[..], &ids[..]].concat(), greedy);
        // The victim: two tokens, then an error event naming the panic, and no `done`.
        ws.send(Message::Text(req("b").to_string().into()))
            .await
            .unwrap();
        let mut deltas = 0;
        let err = loop {
            let m = next_json(&mut ws).await;
            match m["type"].as_str().unwrap() {
                "delta" => deltas += 1,
                "error" => break m,
                _ => panic!("unexpected {m}"),
            }
        };
        assert_eq!(deltas, 2, "{err}");
        assert_eq!(err["id"], "b", "{err}");
        assert!(err["message"].as_str().unwrap().contains("panic"), "{err}");
        // `/health` is 503 `recovering` until the rebuild is done (reading the weights again
        // takes 300 ms here), then `ok`.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut recovering = 0;
        loop {
            let (status, health) = http(addr, "GET", "/health", b"").await;
            if status == 200 {
                assert!(health.contains("\"ok\""), "{health}");
                break;
            }
            assert_eq!(status, 503, "{health}");
            assert!(health.contains("recovering"), "{health}");
            recovering += 1;
            assert!(Instant::now() < deadline, "still {health} after 60 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(recovering > 0, "`/health` never said `recovering`");
        let (_, metrics) = http(addr, "GET", "/metrics", b"").await;
        assert!(
            metrics.contains("nsactor_decode_recoveries_total 1"),
            "{metrics}"
        );
        assert!(metrics.contains("nsactor_decode_healthy 1"), "{metrics}");
        assert!(
            metrics.contains("nsactor_prefix_cache_hits_total 1"),
            "{metrics}"
        );
        // The same connection, and a new one, decode the fixture's greedy tokens again.
        let (_, ids, done) = generate(&mut ws, req("c")).await;
        assert_eq!([&prompt[..], &ids[..]].concat(), greedy, "{done}");
        let body = serde_json::json!({"prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": true})
        .to_string();
        let (status, body) = http(addr, "POST", "/v1/completions", body.as_bytes()).await;
        assert_eq!(status, 200, "{body}");
    });
}
