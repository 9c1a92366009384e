//! A WebSocket connection's conversations where messages meet (found by driving the server
//! with a stock client): `forget` while a turn runs, `generate` sent right behind an `import`,
//! a chat turn after a state exported from `messages`, and the refusals that must say what
//! is wrong (an empty prompt to export, an empty name, a state file of another model).

mod common;

use common::{connect, http_bytes, next_json, serve_limited, tokenize, ws_send};
use nsactor_server::protocol::Limits;
use serde_json::{Value, json};

fn limits() -> Limits {
    Limits {
        max_prompt_tokens: 4096,
        ..Limits::default()
    }
}

/// The next event for request `id` (events of other requests skipped).
async fn event_of(ws: &mut common::Ws, id: &str) -> Value {
    loop {
        let e = next_json(ws).await;
        if e["id"] == id {
            return e;
        }
    }
}

/// Events of request `id` up to its `done` or `error`: the last one.
async fn end_of(ws: &mut common::Ws, id: &str) -> Value {
    loop {
        let e = event_of(ws, id).await;
        if e["type"] == "done" || e["type"] == "error" {
            return e;
        }
    }
}

#[test]
fn forget_while_a_turn_runs_is_refused_and_the_conversation_stays() {
    let s = serve_limited(4, false, limits());
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let mut ws = connect(addr).await;
        ws_send(
            &mut ws,
            json!({"type": "generate", "id": "t1", "conversation": "c", "prompt": "Once",
                "max_tokens": 2, "temperature": 0, "ignore_eos": true}),
        )
        .await;
        let done = end_of(&mut ws, "t1").await;
        assert_eq!(done["type"], "done", "{done}");
        let kept = done["conversation_tokens"].as_u64().unwrap();
        ws_send(
            &mut ws,
            json!({"type": "generate", "id": "t2", "conversation": "c", "prompt": " upon",
                "max_tokens": 200, "temperature": 0, "ignore_eos": true}),
        )
        .await;
        ws_send(
            &mut ws,
            json!({"type": "forget", "id": "f", "conversation": "c"}),
        )
        .await;
        // The turn was started before the `forget` was read: the refusal names it.
        let e = event_of(&mut ws, "f").await;
        assert_eq!(
            (&e["type"], &e["code"]),
            (&json!("error"), &json!("invalid_request"))
        );
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("has a turn running"),
            "{e}"
        );
        let done = end_of(&mut ws, "t2").await;
        assert_eq!(done["type"], "done", "{done}");
        let after_t2 = done["conversation_tokens"].as_u64().unwrap();
        assert!(after_t2 > kept + 200, "{done}");
        // Kept, as the refusal said: the next turn goes on from it.
        ws_send(
            &mut ws,
            json!({"type": "generate", "id": "t3", "conversation": "c", "prompt": " a",
                "conversation_continue": true, "max_tokens": 1, "temperature": 0}),
        )
        .await;
        let done = end_of(&mut ws, "t3").await;
        assert_eq!(done["conversation_started"], false, "{done}");
        // Idle, a `forget` is obeyed (no answer) and the conversation starts again.
        ws_send(
            &mut ws,
            json!({"type": "forget", "id": "g", "conversation": "c"}),
        )
        .await;
        ws_send(
            &mut ws,
            json!({"type": "generate", "id": "t4", "conversation": "c", "prompt": "Once",
                "max_tokens": 2, "temperature": 0, "ignore_eos": true}),
        )
        .await;
        // Nothing answers the obeyed `forget`: the next event is the turn's.
        let first = next_json(&mut ws).await;
        assert_eq!(
            (&first["id"], &first["type"]),
            (&json!("t4"), &json!("delta"))
        );
        let done = end_of(&mut ws, "t4").await;
        assert_eq!(done["conversation_started"], true, "{done}");
        assert_eq!(done["conversation_tokens"].as_u64().unwrap(), kept);
    });
}

#[test]
fn a_turn_sent_right_behind_an_import_never_starts_the_conversation_afresh() {
    let s = serve_limited(4, false, limits());
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let body = json!({"prompt": "Tea or coffee, and"}).to_string();
        let (status, file) = http_bytes(addr, "/v1/state/export", body.as_bytes()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&file));
        let state = {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD.encode(&file)
        };
        let imported = tokenize(addr, "Tea or coffee, and", true).await.len() as u64;
        let more = tokenize(addr, " milk", false).await.len() as u64;
        let mut ws = connect(addr).await;
        for round in 0..4 {
            let name = format!("p{round}");
            ws_send(
                &mut ws,
                json!({"type": "import", "id": format!("i{round}"), "conversation": name,
                    "state": state}),
            )
            .await;
            ws_send(
                &mut ws,
                json!({"type": "generate", "id": format!("g{round}"), "conversation": name,
                    "prompt": " milk", "max_tokens": 1, "temperature": 0, "ignore_eos": true}),
            )
            .await;
            // The two answers in whichever order they come.
            let (mut i, mut g) = (None, None);
            while i.is_none() || g.is_none() {
                let e = next_json(&mut ws).await;
                let end = matches!(e["type"].as_str(), Some("imported" | "done" | "error"));
                if e["id"] == format!("i{round}") {
                    i = Some(e);
                } else if e["id"] == format!("g{round}") && end {
                    g = Some(e);
                }
            }
            let (i, g) = (i.unwrap(), g.unwrap());
            assert_eq!(i["type"], "imported", "{i}");
            // Either the turn came while the file was still going in and was refused, saying
            // so, or it came after and went on from the imported history: never a fresh start
            // that drops what `imported` reported.
            if g["type"] == "error" {
                let m = g["message"].as_str().unwrap();
                assert!(m.contains("is being imported"), "{g}");
            } else {
                assert_eq!(g["conversation_started"], false, "{g}");
                assert_eq!(
                    g["conversation_tokens"].as_u64().unwrap(),
                    imported + more + 1,
                    "{g}"
                );
            }
        }
    });
}

#[test]
fn a_chat_turn_after_a_state_exported_from_messages_reads_well_formed_chatml() {
    let s = serve_limited(4, false, limits());
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let body = json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"}]})
        .to_string();
        let (status, file) = http_bytes(addr, "/v1/state/export", body.as_bytes()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&file));
        let state = {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD.encode(&file)
        };
        let mut ws = connect(addr).await;
        ws_send(
            &mut ws,
            json!({"type": "import", "id": "i", "conversation": "m", "state": state}),
        )
        .await;
        assert_eq!(event_of(&mut ws, "i").await["type"], "imported");
        ws_send(
            &mut ws,
            json!({"type": "generate", "id": "g", "conversation": "m", "max_tokens": 1,
                "temperature": 0, "prompt_logprobs": 0,
                "messages": [{"role": "user", "content": "Again"}]}),
        )
        .await;
        let prompt = event_of(&mut ws, "g").await;
        assert_eq!(prompt["type"], "prompt", "{prompt}");
        let read: Vec<i64> = prompt["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap())
            .collect();
        let want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n\
                    <|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(read, tokenize(addr, want, true).await);
        assert_eq!(end_of(&mut ws, "g").await["type"], "done");
    });
}

#[test]
fn refusals_say_what_is_wrong() {
    let s = serve_limited(4, false, limits());
    let addr = s.addr;
    s.pipeline.block_on(async move {
        // A prompt of no tokens has no state after it: the client's mistake (400), not an
        // unavailable server (503, which clients retry).
        let body = json!({"prompt": "", "add_special_tokens": false}).to_string();
        let (status, e) = http_bytes(addr, "/v1/state/export", body.as_bytes()).await;
        let e = String::from_utf8_lossy(&e);
        assert_eq!(status, 400, "{e}");
        assert!(e.contains("the prompt is empty"), "{e}");
        // A conversation needs a name.
        let mut ws = connect(addr).await;
        for msg in [
            json!({"type": "generate", "id": "a", "conversation": "", "prompt": "x",
                "max_tokens": 1}),
            json!({"type": "forget", "id": "a", "conversation": ""}),
            json!({"type": "export", "id": "a", "conversation": ""}),
            json!({"type": "import", "id": "a", "conversation": "", "state": "AAAA"}),
        ] {
            ws_send(&mut ws, msg.clone()).await;
            let e = event_of(&mut ws, "a").await;
            assert_eq!(
                (&e["type"], &e["code"]),
                (&json!("error"), &json!("invalid_request"))
            );
            assert!(
                e["message"].as_str().unwrap().contains("1 to 256 bytes"),
                "{msg} {e}"
            );
        }
        // A file signed by this server whose state fields are not this model's (another model
        // served under the same name and vocabulary): refused as the file's fault.
        let body = json!({"prompt": "Tea"}).to_string();
        let (_, file) = http_bytes(addr, "/v1/state/export", body.as_bytes()).await;
        use nsactor_server::saved;
        use nsactor_server::state_key::StateKey;
        let mut read = saved::decode(&file, &StateKey::process()).unwrap();
        let field = &mut read.state.layers[0][0];
        let w = *field.shape.last().unwrap();
        field.shape = vec![1, 1, 2 * w];
        field.data = [field.data.clone(), field.data.clone()].concat();
        let other = saved::encode(&read, &StateKey::process());
        let (status, e) = http_bytes(addr, "/v1/state/import", &other).await;
        let e = String::from_utf8_lossy(&e);
        assert_eq!(status, 400, "{e}");
        assert!(e.contains("do not fit this model"), "{e}");
        // The server serves on.
        let (status, _) = http_bytes(addr, "/v1/state/export", body.as_bytes()).await;
        assert_eq!(status, 200);
    });
}
