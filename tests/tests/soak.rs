//! The real `nsactor serve` under a low file limit (`setrlimit(RLIMIT_NOFILE)` in the child),
//! soaked with thousands of WebSocket and SSE connections that end every way a client ends
//! one: a WebSocket closed by its client mid-generation and after `done`, closed by the server
//! for idleness, and aborted with a TCP reset; an SSE stream read to `[DONE]` and one dropped
//! mid-stream. After each kind the server's open files are back where they started, no socket
//! of its port sits in CLOSE-WAIT, `nsactor_connections` counts only the asking connection,
//! and the server still answers. Every Close the client sends must be answered within the
//! client's read timeout (a stock client, `tungstenite`, judges that).
//!
//! `NSACTOR_SOAK_CYCLES` (800 of each kind: over three times the file limit, so one socket
//! left behind per connection runs the server out of descriptors well before a kind ends) and
//! `NSACTOR_SOAK_NOFILE` (256) scale it.

mod common;

use common::cli::temp_dir;
use common::served::{answer, free_addr, send, trained_run, wait_until_serving};
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::{Message, WebSocket};

/// How long a client waits for any answer: a Close left unanswered fails the test.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `nsactor serve` of `run` on `addr`, with at most `nofile` open files.
fn serve_limited(run: &std::path::Path, addr: SocketAddr, nofile: u64) -> Child {
    let mut cmd = common::cli::nsactor();
    cmd.args(["serve", "--no-warmup", "--checkpoint"])
        .arg(run)
        .args(["--addr", &addr.to_string(), "--ws-idle-timeout", "0.3"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setrlimit(2) is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: nofile,
                rlim_max: nofile,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().unwrap()
}

/// The server's open files.
fn open_files(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Sockets on local port `port` in CLOSE-WAIT (the peer closed, the server never did).
fn close_wait(port: u16) -> usize {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|t| t.lines().skip(1).map(String::from).collect::<Vec<_>>())
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local_port = f
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|h| u16::from_str_radix(h, 16).ok());
            local_port == Some(port) && f.get(3) == Some(&"08")
        })
        .count()
}

/// A WebSocket client connected to `/ws`.
fn ws_open(addr: SocketAddr) -> WebSocket<TcpStream> {
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    tcp.set_nodelay(true).unwrap();
    let (ws, _) = tungstenite::client(format!("ws://{addr}/ws"), tcp)
        .unwrap_or_else(|e| panic!("the WebSocket upgrade failed: {e}"));
    ws
}

fn ws_generate(ws: &mut WebSocket<TcpStream>, max_tokens: usize) {
    let msg = format!(
        r#"{{"type":"generate","id":"g","prompt":"Emma was","max_tokens":{max_tokens},"ignore_eos":true}}"#
    );
    ws.send(Message::text(msg)).unwrap();
}

/// Reads until an event of `kind` arrives.
fn ws_until(ws: &mut WebSocket<TcpStream>, kind: &str) {
    let needle = format!(r#""type":"{kind}""#);
    loop {
        match ws.read() {
            Ok(Message::Text(t)) if t.as_str().contains(&needle) => return,
            Ok(Message::Text(t)) if t.as_str().contains(r#""type":"error""#) => {
                panic!("waiting for {kind}: {t}")
            }
            Ok(_) => {}
            Err(e) => panic!("waiting for {kind}: {e}"),
        }
    }
}

/// Sends a Close and waits for the server's answer and the end of the connection.
fn ws_close(mut ws: WebSocket<TcpStream>) {
    ws.close(None).unwrap();
    loop {
        match ws.read() {
            Ok(_) => {}
            Err(tungstenite::Error::ConnectionClosed) => return,
            Err(e) => panic!("the server did not answer the client's Close: {e}"),
        }
    }
}

/// Ends the connection with a TCP reset (SO_LINGER 0), as a crashed client does.
fn reset(tcp: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt(2) on a socket this test owns, with a correctly sized option.
    let r = unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "SO_LINGER");
}

/// One connection of each ending.
#[derive(Clone, Copy, Debug)]
enum Ending {
    WsCloseMidGeneration,
    WsCloseAfterDone,
    WsIdle,
    WsAbort,
    SseComplete,
    SseDropped,
}

fn cycle(addr: SocketAddr, ending: Ending) {
    match ending {
        Ending::WsCloseMidGeneration => {
            let mut ws = ws_open(addr);
            ws_generate(&mut ws, 4000);
            ws_until(&mut ws, "delta");
            ws_close(ws);
        }
        Ending::WsCloseAfterDone => {
            let mut ws = ws_open(addr);
            ws_generate(&mut ws, 2);
            ws_until(&mut ws, "done");
            ws_close(ws);
        }
        Ending::WsIdle => {
            let mut ws = ws_open(addr);
            let mut saw_error = false;
            loop {
                match ws.read() {
                    Ok(Message::Text(t)) => saw_error |= t.as_str().contains("idle"),
                    Ok(Message::Close(f)) => {
                        assert_eq!(f.map(|f| f.code), Some(CloseCode::Away), "idle close code");
                    }
                    Ok(_) => {}
                    Err(tungstenite::Error::ConnectionClosed) => break,
                    Err(e) => panic!("an idle connection was not closed cleanly: {e}"),
                }
            }
            assert!(saw_error, "the idle close came without its error event");
        }
        Ending::WsAbort => {
            let mut ws = ws_open(addr);
            ws_generate(&mut ws, 4000);
            ws_until(&mut ws, "delta");
            reset(ws.get_ref());
        }
        Ending::SseComplete | Ending::SseDropped => {
            let body = r#"{"prompt":"Emma was","max_tokens":4,"ignore_eos":true,"stream":true}"#;
            let tcp = send(addr, "POST", "/v1/completions", "", body);
            let mut r = BufReader::new(tcp);
            let mut line = String::new();
            let want = match ending {
                Ending::SseComplete => "data: [DONE]",
                _ => "data: {",
            };
            loop {
                line.clear();
                assert!(
                    r.read_line(&mut line).unwrap() > 0,
                    "the stream ended early"
                );
                if line.starts_with(want) {
                    break;
                }
            }
            if matches!(ending, Ending::SseDropped) {
                reset(r.get_ref());
            }
        }
    }
}

/// Runs `n` cycles of `ending` from `threads` clients at once.
fn soak(addr: SocketAddr, ending: Ending, n: usize, threads: usize) {
    std::thread::scope(|s| {
        for t in 0..threads {
            let mine = n / threads + usize::from(t < n % threads);
            s.spawn(move || (0..mine).for_each(|_| cycle(addr, ending)));
        }
    });
}

/// Waits until the server holds at most `files` open files and no CLOSE-WAIT socket; panics
/// with what it holds otherwise.
fn settles(server: &Child, port: u16, files: usize, after: &str) {
    let t = Instant::now();
    loop {
        let (now, waiting) = (open_files(server.id()), close_wait(port));
        if now <= files && waiting == 0 {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "after {after}: {now} open files (started with {files}), {waiting} sockets in CLOSE-WAIT"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The server still answers, and counts only the connection that asks.
fn still_serving(addr: SocketAddr) {
    let (status, health) = answer(send(addr, "GET", "/health", "", ""));
    assert_eq!(status, 200, "{health}");
    let (_, metrics) = answer(send(addr, "GET", "/metrics", "", ""));
    assert!(
        metrics.lines().any(|l| l == "nsactor_connections 1"),
        "nsactor_connections should count only this request: {}",
        metrics
            .lines()
            .filter(|l| l.starts_with("nsactor_connections"))
            .collect::<Vec<_>>()
            .join("; ")
    );
}

#[test]
fn thousands_of_websocket_and_sse_endings_leave_no_socket_behind() {
    let cycles = env_or("NSACTOR_SOAK_CYCLES", 800);
    let nofile = env_or("NSACTOR_SOAK_NOFILE", 256) as u64;
    let dir = temp_dir("soak");
    let run = trained_run(&dir);
    let addr = free_addr();
    let mut server = serve_limited(&run, addr, nofile);
    wait_until_serving(addr, &mut server);
    let kinds = [
        (Ending::WsCloseMidGeneration, 4),
        (Ending::WsCloseAfterDone, 4),
        (Ending::WsIdle, 40),
        (Ending::WsAbort, 4),
        (Ending::SseComplete, 4),
        (Ending::SseDropped, 4),
    ];
    // One of each first: whatever the server opens once (and keeps) is in the baseline.
    for (ending, _) in kinds {
        cycle(addr, ending);
    }
    std::thread::sleep(Duration::from_millis(500));
    let files = open_files(server.id());
    for (ending, threads) in kinds {
        let t = Instant::now();
        soak(addr, ending, cycles, threads);
        settles(
            &server,
            addr.port(),
            files,
            &format!("{cycles} × {ending:?}"),
        );
        still_serving(addr);
        eprintln!(
            "{cycles} × {ending:?}: {:.1} s, open files back to {files}",
            t.elapsed().as_secs_f64()
        );
    }
    assert!(server.try_wait().unwrap().is_none(), "the server died");
    server.kill().unwrap();
    server.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
