//! `nsactor serve` as a deployer runs it: behind an API key, and stopped by SIGTERM while a
//! stream is running: `/health` says `draining` and new requests get 503 during the grace
//! period, the running stream ends with finish reason `shutdown` and `[DONE]`, WebSocket
//! clients get their final `done` and then a Close frame 1001, and the process exits 0; a
//! second signal exits at once with 143. A layer that panics
//! while decoding is rebuilt from the checkpoint, or, past `--max-rebuilds`, ends the command.
//! Models by Hugging Face Hub name, against a loopback Hub: `serve/hub.rs`.

mod common;

// More tests of this binary, by topic.
#[path = "serve/hub.rs"]
mod hub;
#[path = "serve/loopback_hub.rs"]
mod loopback_hub;

use common::cli::{nsactor, ok, temp_dir};
use common::served::{answer, exit_and_log, free_addr, send, trained_run, wait_until_serving};
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tungstenite::client::IntoClientRequest;
use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::{Message, WebSocket};

/// A WebSocket client with `key`, connected to `/ws` of `addr`.
fn ws_keyed(addr: SocketAddr, key: &str) -> WebSocket<TcpStream> {
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!("ws://{addr}/ws").into_client_request().unwrap();
    req.headers_mut()
        .insert("authorization", format!("Bearer {key}").parse().unwrap());
    tungstenite::client(req, tcp).unwrap().0
}

/// Every text event until the server's Close, and the Close's code; panics when the
/// connection ends without one.
fn ws_until_close(ws: &mut WebSocket<TcpStream>) -> (Vec<String>, CloseCode) {
    let mut events = Vec::new();
    loop {
        match ws.read() {
            Ok(Message::Text(t)) => events.push(t.to_string()),
            Ok(Message::Close(f)) => {
                let code = f.map_or(CloseCode::Status, |f| f.code);
                // Answered by the library; read on to the end of the connection.
                while ws.read().is_ok() {}
                return (events, code);
            }
            Ok(_) => {}
            Err(e) => panic!("the connection ended without a Close frame: {e} after {events:?}"),
        }
    }
}

#[test]
fn sigterm_drains_running_streams_refuses_new_ones_and_exits_0() {
    let dir = temp_dir("serve-drain");
    let run = trained_run(&dir);
    let addr = free_addr();
    let cache = dir.join("prefix-cache");
    // Where the default state key would go cannot hold a folder (a file is there): the server
    // serves on with a key of its own, and says so.
    let no_config = dir.join("config-is-a-file");
    std::fs::write(&no_config, "").unwrap();
    let mut server = nsactor()
        .env("XDG_CONFIG_HOME", &no_config)
        .env_remove("NSACTOR_STATE_KEY")
        .args(["serve", "--checkpoint"])
        .arg(&run)
        .arg("--prefix-cache-dir")
        .arg(&cache)
        .args(["--addr", &addr.to_string(), "--shutdown-grace", "2"])
        .args(["--api-key", "sk-drain"])
        // Passes of at most 3 sessions: the warm-up runs no larger cohort.
        .args(["--max-num-seqs", "3"])
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
    // A WebSocket with a long generation running, and one with nothing running.
    let mut busy = ws_keyed(addr, "sk-drain");
    busy.send(Message::text(
        r#"{"type":"generate","id":"w","prompt":[87],"max_tokens":4096,"ignore_eos":true}"#,
    ))
    .unwrap();
    while !busy
        .read()
        .unwrap()
        .to_string()
        .contains(r#""type":"delta""#)
    {}
    let mut idle = ws_keyed(addr, "sk-drain");
    // SAFETY: kill(2) on the child this test started.
    assert_eq!(unsafe { libc::kill(server.id() as i32, libc::SIGTERM) }, 0);
    std::thread::sleep(Duration::from_millis(300));
    let (status, health) = answer(send(addr, "GET", "/health", "", ""));
    assert_eq!(status, 503, "a draining server is not healthy: {health}");
    assert!(health.contains(r#""status":"draining""#), "{health}");
    // The idle WebSocket is closed at once: 1001, going away.
    let (said, code) = ws_until_close(&mut idle);
    assert_eq!(code, CloseCode::Away, "{said:?}");
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
    // OpenAI's reasons are a closed set: a stream cut by the shutdown ends as `length`.
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{last}");
    assert!(
        events.len() > 3,
        "the stream ran on during the grace period: {events:?}"
    );

    // The running WebSocket generation ends with `shutdown`, its `done`, then Close 1001.
    let (said, code) = ws_until_close(&mut busy);
    assert_eq!(code, CloseCode::Away, "{said:?}");
    let done = said.last().expect("events before the Close");
    assert!(
        done.contains(r#""type":"done""#) && done.contains(r#""finish_reason":"shutdown""#),
        "the final event before the Close: {done}"
    );

    let (status, log) = exit_and_log(&mut server, Duration::from_secs(30));
    assert!(status.success(), "exit {status:?}: {log}");
    assert!(log.contains("2 ended by the grace period"), "{log}");
    assert!(
        log.contains("warming up at 3 cohort sizes (1, 2, 3)"),
        "{log}"
    );
    assert!(
        log.contains("state files are signed with a key of this process alone"),
        "{log}"
    );
    // The prefix cache was looked for at the start and written after the drain.
    assert!(log.contains("in the host tier"), "{log}");
    let written = log
        .lines()
        .find(|l| l.contains("written to"))
        .expect("the cache written");
    let folder = written.rsplit("written to ").next().unwrap().trim();
    assert!(
        std::path::Path::new(folder).starts_with(&cache),
        "{written}"
    );
    assert!(std::fs::read_dir(folder).is_ok(), "{written}");
    assert!(!log.contains("sk-drain"), "the key is in the log: {log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A second SIGTERM during the drain exits at once with 143 (128 + SIGTERM), as a shell
/// reports a process a signal ended, not 130 (an interrupt).
#[test]
fn a_second_sigterm_exits_at_once_with_143() {
    let dir = temp_dir("serve-twice");
    let run = trained_run(&dir);
    let addr = free_addr();
    let mut server = nsactor()
        .args(["serve", "--no-warmup", "--checkpoint"])
        .arg(&run)
        .args(["--addr", &addr.to_string(), "--shutdown-grace", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until_serving(addr, &mut server);
    let body = r#"{"prompt":[87],"max_tokens":4096,"ignore_eos":true,"stream":true}"#;
    let mut stream = BufReader::new(send(addr, "POST", "/v1/completions", "", body));
    let mut line = String::new();
    while !line.starts_with("data: {") {
        line.clear();
        assert!(stream.read_line(&mut line).unwrap() > 0, "no first chunk");
    }
    for _ in 0..2 {
        // SAFETY: kill(2) on the child this test started.
        assert_eq!(unsafe { libc::kill(server.id() as i32, libc::SIGTERM) }, 0);
        std::thread::sleep(Duration::from_millis(300));
    }
    let (status, log) = exit_and_log(&mut server, Duration::from_secs(10));
    assert_eq!(status.code(), Some(143), "{log}");
    assert!(log.contains("a second signal (SIGTERM)"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A server whose layer panics mid-stream: that stream ends with an error, `/health` comes
/// back to 200 after the rebuild (which read the checkpoint, or the Hugging Face export,
/// again) and the next request is served; with `--max-rebuilds 0` the same fault makes the
/// command exit with the cause.
#[test]
fn a_panicking_layer_fails_its_stream_and_the_server_heals_or_exits_past_max_rebuilds() {
    let dir = temp_dir("serve-heal");
    let run = trained_run(&dir);
    // The Hugging Face export of the same run: its rebuild reads `model.safetensors` again.
    let hf = dir.join("hf");
    ok(nsactor()
        .args(["export", "--checkpoint"])
        .arg(&run)
        .arg("--out")
        .arg(&hf));
    // The last case names the flag by its former name, `--max-restarts`, still accepted.
    let cases = [
        (&run, "1", "--max-rebuilds"),
        (&hf, "1", "--max-rebuilds"),
        (&run, "0", "--max-restarts"),
    ];
    for (from, max_rebuilds, flag) in cases {
        let addr = free_addr();
        let mut server = nsactor()
            .args(["serve", "--no-warmup", "--checkpoint"])
            .arg(from)
            .args(["--addr", &addr.to_string(), flag, max_rebuilds])
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
        if max_rebuilds == "1" {
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
            "--max-prompt-tokens",
            "0",
            "--max-prompt-tokens must be at least 1",
        ),
        (
            "--max-new-tokens",
            "0",
            "--max-new-tokens must be at least 1",
        ),
        (
            "--rebuild-window",
            "0",
            "--rebuild-window must be seconds > 0",
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
