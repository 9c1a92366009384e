//! The chat page at `/` in headless Chromium (Debian's `chromium`, driven over the DevTools
//! protocol): it connects to `/ws`, sends the typed message and shows the streamed answer,
//! which must equal the same request made directly.

mod common;

use common::{connect, generate, serve_model};
use futures_util::{SinkExt, StreamExt};
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

const CHROMIUM: &str = "/usr/bin/chromium";

/// Installs Debian's chromium when it is missing (the test setup; needs root and apt).
fn chromium() -> &'static str {
    if !std::path::Path::new(CHROMIUM).exists() {
        let ok = Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", "chromium"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
            || (Command::new("apt-get")
                .arg("update")
                .status()
                .is_ok_and(|s| s.success())
                && Command::new("apt-get")
                    .args(["install", "-y", "--no-install-recommends", "chromium"])
                    .env("DEBIAN_FRONTEND", "noninteractive")
                    .status()
                    .is_ok_and(|s| s.success()));
        assert!(
            ok && std::path::Path::new(CHROMIUM).exists(),
            "this test needs Debian's chromium at {CHROMIUM}: apt-get install chromium"
        );
    }
    CHROMIUM
}

struct Browser(std::process::Child);

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_chat_page_streams_an_answer_in_headless_chromium() {
    let exe = chromium();
    let profile = tempfile::tempdir().unwrap();
    // The browser itself rather than Debian's shell wrapper around it (one process less).
    let binary = std::path::Path::new("/usr/lib/chromium/chromium");
    let exe = if binary.exists() {
        binary.to_str().unwrap()
    } else {
        exe
    };
    let mut child = Command::new(exe)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--remote-debugging-port=0",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("about:blank")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut browser = Browser(child);
    // "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/…"; the rest of its stderr
    // is drained so the browser never blocks on (or dies of) a full or closed pipe.
    let (port_tx, port_rx) = std::sync::mpsc::channel();
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let log2 = log.clone();
    std::thread::spawn(move || {
        let mut port_tx = Some(port_tx);
        for l in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            log2.lock().unwrap().push(l.clone());
            let port = l
                .split("ws://127.0.0.1:")
                .nth(1)
                .and_then(|r| r.split('/').next())
                .and_then(|p| p.parse::<u16>().ok());
            if let Some(p) = port
                && let Some(tx) = port_tx.take()
            {
                let _ = tx.send(p);
            }
        }
    });
    let port = port_rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|e| {
            let lines = log.lock().map(|l| l.join("\n")).unwrap_or_default();
            panic!(
                "chromium printed no DevTools address ({e}; exit {:?}):\n{lines}",
                browser.0.try_wait()
            )
        });
    let s = serve_model(4, 4, false);
    let addr = s.addr;
    s.pipeline.block_on(async move {
        let devtools: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        // The page target's DevTools socket.
        let t = Instant::now();
        let page_ws = loop {
            let (_, list) = common::http(devtools, "GET", "/json/list", b"").await;
            let v: serde_json::Value = serde_json::from_str(&list).unwrap_or_default();
            let found = v.as_array().and_then(|a| {
                a.iter().find(|t| t["type"] == "page")
                    .and_then(|t| t["webSocketDebuggerUrl"].as_str().map(String::from))
            });
            if let Some(u) = found {
                break u;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "no page target: {list}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let (mut cdp, _) = tokio_tungstenite::connect_async(page_ws).await.unwrap();
        let mut next_id = 0u64;
        let mut eval = async |expr: &str| -> serde_json::Value {
            next_id += 1;
            let msg = serde_json::json!({"id": next_id, "method": "Runtime.evaluate",
                "params": {"expression": expr, "returnByValue": true}});
            cdp.send(Message::Text(msg.to_string().into())).await.unwrap();
            loop {
                let next = tokio::time::timeout(Duration::from_secs(30), cdp.next())
                    .await
                    .expect("DevTools answered within 30 s");
                let Message::Text(t) = next.unwrap().unwrap() else { continue };
                let v: serde_json::Value = serde_json::from_str(&t).unwrap();
                if v["id"] == next_id {
                    return v["result"]["result"]["value"].clone();
                }
            }
        };
        eval(&format!("location.href = 'http://{addr}/'; true")).await;
        let t = Instant::now();
        while eval("document.getElementById('status') && document.getElementById('status').textContent").await != "connected" {
            assert!(t.elapsed() < Duration::from_secs(30), "the page never connected to /ws");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eval("document.getElementById('temperature').value = '0'; \
              document.getElementById('prompt').value = 'Who is Emma?'; \
              document.getElementById('send').click(); true").await;
        let t = Instant::now();
        let shown = loop {
            let v = eval("document.getElementById('done-r1') ? \
                [document.getElementById('answer-1').textContent, document.getElementById('done-r1').textContent] : null").await;
            if !v.is_null() {
                break v;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "no answer was shown");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let answer = shown[0].as_str().unwrap().to_string();
        let meta = shown[1].as_str().unwrap();
        assert!(meta.contains("tokens/s"), "{meta}");
        // The same request made directly.
        let mut ws = connect(addr).await;
        let (want, _, _) = generate(&mut ws, serde_json::json!({"type": "generate", "id": "x",
            "messages": [{"role": "user", "content": "Who is Emma?"}], "temperature": 0,
            "max_tokens": 128, "repetition_penalty": 1.1})).await;
        assert!(!want.is_empty());
        assert_eq!(answer, want);
    });
}
