//! `nsactor serve` as a test runs it: a trained tiny run to serve, a free loopback port, small
//! HTTP/1.1 requests over a plain socket, and the server's exit and log.

use super::cli::{nsactor, ok, tiny_with};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Child;
use std::time::{Duration, Instant};

/// Sends one HTTP/1.1 request; returns the stream positioned after the request.
pub fn send(addr: SocketAddr, method: &str, path: &str, headers: &str, body: &str) -> TcpStream {
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
pub fn answer(mut s: TcpStream) -> (u16, String) {
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text)
}

pub fn wait_until_serving(addr: SocketAddr, child: &mut Child) {
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
pub fn trained_run(dir: &std::path::Path) -> std::path::PathBuf {
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
pub fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// How the server exited (within `limit`) and what it logged.
pub fn exit_and_log(server: &mut Child, limit: Duration) -> (std::process::ExitStatus, String) {
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
