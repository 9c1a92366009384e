//! `nsactor serve` as a deployer runs it: behind an API key, and stopped by SIGTERM while a
//! stream is running: new requests get 503 during the grace period, the running stream ends
//! with finish reason `shutdown` and `[DONE]`, and the process exits 0.

mod common;

use common::cli::{nsactor, ok, temp_dir, tiny_with};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Sends one HTTP/1.1 request; returns the stream positioned after the request.
fn send(addr: SocketAddr, method: &str, path: &str, headers: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{headers}Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// The status and the whole body of a closed-connection answer.
fn answer(mut s: TcpStream) -> (u16, String) {
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text)
}

fn wait_until_serving(addr: SocketAddr, child: &mut Child) {
    let t = Instant::now();
    loop {
        if let Ok(s) = TcpStream::connect(addr) {
            drop(s);
            let (status, _) = answer(send(addr, "GET", "/health", "", ""));
            if status == 200 {
                return;
            }
        }
        assert!(child.try_wait().unwrap().is_none(), "serve exited early");
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "serve never listened"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn sigterm_drains_running_streams_refuses_new_ones_and_exits_0() {
    let dir = temp_dir("serve-drain");
    let cfg = tiny_with(&dir, "tiny.toml", "");
    let run = dir.join("run");
    ok(nsactor()
        .args(["train", "--steps", "1", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&run));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut server = nsactor()
        .args(["serve", "--checkpoint"])
        .arg(&run)
        .args(["--addr", &addr.to_string(), "--shutdown-grace", "2"])
        .args(["--api-key", "sk-drain"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until_serving(addr, &mut server);
    let key = "Authorization: Bearer sk-drain\r\n";
    let (status, _) = answer(send(
        addr,
        "POST",
        "/v1/completions",
        "",
        r#"{"prompt":"x"}"#,
    ));
    assert_eq!(status, 401, "no key");

    // A long stream: it cannot finish within the grace period.
    let body = r#"{"prompt":[87],"max_tokens":4096,"ignore_eos":true,"stream":true}"#;
    let mut stream = BufReader::new(send(addr, "POST", "/v1/completions", key, body));
    let mut line = String::new();
    let mut events = Vec::new();
    while events.is_empty() {
        line.clear();
        assert!(
            stream.read_line(&mut line).unwrap() > 0,
            "the stream ended early"
        );
        if let Some(d) = line.trim().strip_prefix("data: ") {
            events.push(d.to_string());
        }
    }
    // SAFETY: kill(2) on the child this test started.
    assert_eq!(unsafe { libc::kill(server.id() as i32, libc::SIGTERM) }, 0);
    std::thread::sleep(Duration::from_millis(300));
    let (status, refused) = answer(send(
        addr,
        "POST",
        "/v1/completions",
        key,
        r#"{"prompt":[87],"max_tokens":2}"#,
    ));
    assert_eq!(status, 503, "{refused}");
    assert!(refused.contains("shutting down"), "{refused}");
    loop {
        line.clear();
        if stream.read_line(&mut line).unwrap() == 0 {
            break;
        }
        if let Some(d) = line.trim().strip_prefix("data: ") {
            events.push(d.to_string());
        }
    }
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let last: serde_json::Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "shutdown", "{last}");
    assert!(
        events.len() > 3,
        "the stream ran on during the grace period: {events:?}"
    );

    let t = Instant::now();
    let status = loop {
        if let Some(s) = server.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "serve did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut log = String::new();
    server
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(status.success(), "exit {status:?}: {log}");
    assert!(log.contains("1 ended by the grace period"), "{log}");
    assert!(!log.contains("sk-drain"), "the key is in the log: {log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Limits that cannot work are refused by name before anything is loaded.
#[test]
fn bad_limits_are_refused_by_name() {
    for (flag, value, needle) in [
        (
            "--header-timeout",
            "0",
            "--header-timeout must be more than 0",
        ),
        (
            "--request-timeout",
            "-3",
            "--request-timeout must be seconds >= 0",
        ),
        (
            "--max-body-bytes",
            "10",
            "--max-body-bytes must be at least 1024",
        ),
    ] {
        let out = nsactor()
            .args(["serve", "--checkpoint", "no-such-run"])
            .arg(format!("{flag}={value}"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag}={value} was accepted");
        assert!(err.contains(needle), "{flag}={value}: {err}");
    }
}
