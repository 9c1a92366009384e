//! `nsactor serve` as a deployer runs it: behind an API key, and stopped by SIGTERM while a
//! stream is running: new requests get 503 during the grace period, the running stream ends
//! with finish reason `shutdown` and `[DONE]`, and the process exits 0. A layer that panics
//! while decoding is rebuilt from the checkpoint, or, past `--max-restarts`, ends the command.

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

/// A run of one training step on the tiny config, under `dir`.
fn trained_run(dir: &std::path::Path) -> std::path::PathBuf {
    let cfg = tiny_with(dir, "tiny.toml", "");
    let run = dir.join("run");
    ok(nsactor()
        .args(["train", "--steps", "1", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&run));
    run
}

/// A loopback address with a port that was free a moment ago.
fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// How the server exited (within `limit`) and what it logged.
fn exit_and_log(server: &mut Child, limit: Duration) -> (std::process::ExitStatus, String) {
    let t = Instant::now();
    let status = loop {
        if let Some(s) = server.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < limit, "serve did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut log = String::new();
    server
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    (status, log)
}

#[test]
fn sigterm_drains_running_streams_refuses_new_ones_and_exits_0() {
    let dir = temp_dir("serve-drain");
    let run = trained_run(&dir);
    let addr = free_addr();
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

    let (status, log) = exit_and_log(&mut server, Duration::from_secs(30));
    assert!(status.success(), "exit {status:?}: {log}");
    assert!(log.contains("1 ended by the grace period"), "{log}");
    assert!(!log.contains("sk-drain"), "the key is in the log: {log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A server whose layer panics mid-stream: that stream ends with an error, `/health` comes
/// back to 200 after the rebuild (which read the checkpoint, or the Hugging Face export,
/// again) and the next request is served; with `--max-restarts 0` the same fault makes the
/// command exit with the cause.
#[test]
fn a_panicking_layer_fails_its_stream_and_the_server_heals_or_exits_past_max_restarts() {
    let dir = temp_dir("serve-heal");
    let run = trained_run(&dir);
    // The Hugging Face export of the same run: its rebuild reads `model.safetensors` again.
    let hf = dir.join("hf");
    ok(nsactor()
        .args(["export", "--checkpoint"])
        .arg(&run)
        .arg("--out")
        .arg(&hf));
    for (from, max_restarts) in [(&run, "1"), (&hf, "1"), (&run, "0")] {
        let addr = free_addr();
        let mut server = nsactor()
            .args(["serve", "--no-warmup", "--checkpoint"])
            .arg(from)
            .args(["--addr", &addr.to_string(), "--max-restarts", max_restarts])
            .args(["--inject-fault", "session-panic:1:3"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_until_serving(addr, &mut server);
        // Passes 1 and 2 choose tokens; pass 3 panics in layer 1.
        let body = r#"{"prompt":[87],"max_tokens":8,"ignore_eos":true,"stream":true}"#;
        let (status, sse) = answer(send(addr, "POST", "/v1/completions", "", body));
        assert_eq!(status, 200, "{sse}");
        assert!(sse.contains("error") && sse.contains("panic"), "{sse}");
        if max_restarts == "1" {
            let t = Instant::now();
            while answer(send(addr, "GET", "/health", "", "")).0 != 200 {
                assert!(t.elapsed() < Duration::from_secs(60), "never healed");
                std::thread::sleep(Duration::from_millis(50));
            }
            let body = r#"{"prompt":[87],"max_tokens":3,"ignore_eos":true}"#;
            let (status, done) = answer(send(addr, "POST", "/v1/completions", "", body));
            assert_eq!(status, 200, "{done}");
            assert!(done.contains("\"completion_tokens\":3"), "{done}");
            let (_, metrics) = answer(send(addr, "GET", "/metrics", "", ""));
            assert!(
                metrics.contains("nsactor_decode_recoveries_total 1"),
                "{metrics}"
            );
            server.kill().unwrap();
            server.wait().unwrap();
            continue;
        }
        let (status, log) = exit_and_log(&mut server, Duration::from_secs(60));
        assert!(!status.success(), "{log}");
        assert!(log.contains("decoding has failed, exiting"), "{log}");
        assert!(log.contains("more than 0 rebuild"), "{log}");
    }
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
        (
            "--restart-window",
            "0",
            "--restart-window must be seconds > 0",
        ),
        (
            "--inject-fault",
            "layer-panic:1:1",
            "a server can only inject `session-panic:LAYER:PASS`",
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
