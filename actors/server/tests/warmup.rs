//! A server that warms up first: `/health` answers 503 `warming` with its progress, and every
//! way of asking for a generation (HTTP, WebSocket) gets a 503 saying so, with `Retry-After`;
//! after the real warm-up of the decoder the server is ready and decodes the fixture's greedy
//! continuation exactly.

mod common;

use common::{connect, generate, http_head, next_json, serve_warming};
use futures_util::SinkExt;
use nsactor_decoding::warmup::WarmupPlan;
use nsactor_server::ready::Readiness;
use std::sync::Arc;
use tokio_tungstenite::tungstenite::Message;

#[test]
fn a_warming_server_says_so_refuses_generations_then_serves_once_ready() {
    let ready = Arc::new(Readiness::warming(3));
    let s = serve_warming(ready.clone());
    let (addr, prompt, greedy) = (s.addr, s.prompt.clone(), s.greedy.clone());
    let decoder = s.state.generator.decoder.clone();
    let n = greedy.len() - prompt.len();
    s.pipeline.block_on(async move {
        let (status, _, body) = http_head(addr, "GET", "/health", "", b"").await;
        assert_eq!(status, 503, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (v["status"].as_str(), v["of"].as_u64()),
            (Some("warming"), Some(3))
        );

        let req = serde_json::json!({"prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": true})
        .to_string();
        let (status, head, body) =
            http_head(addr, "POST", "/v1/completions", "", req.as_bytes()).await;
        assert_eq!(status, 503, "{body}");
        assert!(
            head.to_ascii_lowercase().contains("retry-after: 1"),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "unavailable");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("warming up (0 of 3"),
            "{body}"
        );

        let mut ws = connect(addr).await;
        let request = serde_json::json!({"type": "generate", "id": "w", "prompt": prompt,
            "max_tokens": n, "temperature": 0, "token_ids": true, "ignore_eos": true});
        ws.send(Message::Text(request.to_string().into()))
            .await
            .unwrap();
        let e = next_json(&mut ws).await;
        assert_eq!(
            (e["type"].as_str(), e["code"].as_str()),
            (Some("error"), Some("unavailable")),
            "{e}"
        );

        // The real warm-up, reporting its progress.
        let plan = WarmupPlan {
            sizes: vec![1, 2, 4],
            passes: Default::default(),
        };
        decoder
            .warm_up(&plan, |done, _, _| ready.progress(done))
            .await
            .unwrap();
        let (_, _, body) = http_head(addr, "GET", "/health", "", b"").await;
        assert!(body.contains(r#""warmed":3"#), "{body}");
        ready.set_ready();
        let (status, _, body) = http_head(addr, "GET", "/health", "", b"").await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(r#""status":"ok""#), "{body}");
        let (_, ids, _) = generate(&mut ws, request).await;
        assert_eq!([&prompt[..], &ids[..]].concat(), greedy);
    });
}
