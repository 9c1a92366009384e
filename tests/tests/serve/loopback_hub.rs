//! A loopback Hugging Face Hub for the tests: `GET`/`HEAD {endpoint}/{owner}/{name}/resolve/
//! {revision}/{file}` with the headers `hf-hub` reads (`x-repo-commit`, `etag`,
//! `Content-Range` for a ranged read, `Content-Length`), the Hub's error answers (404 with
//! `x-error-code: RepoNotFound`, `RevisionNotFound` or `EntryNotFound`; 401 for a gated
//! repository asked without its token), and a log of every request line and `Authorization`
//! header it saw. One thread per connection, `Connection: close`; [`LoopbackHub::stop`] closes
//! the port.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// One repository: its commit, its files, and the token it needs (a gated one).
pub struct HubRepo {
    pub commit: String,
    pub files: HashMap<String, Vec<u8>>,
    pub token: Option<String>,
}

/// What the server saw: request lines (`GET /o/n/resolve/main/config.json`) and
/// `Authorization` values.
#[derive(Default)]
pub struct Seen {
    pub requests: Vec<String>,
    pub authorization: Vec<String>,
}

pub struct LoopbackHub {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LoopbackHub {
    /// Serves `repos` (by `owner/name`) on a free loopback port.
    pub fn start(repos: HashMap<String, HubRepo>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let repos = Arc::new(repos);
        let (s, st) = (seen.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (repos, seen) = (repos.clone(), s.clone());
                std::thread::spawn(move || {
                    let _ = handle(conn, &repos, &seen);
                });
            }
        });
        LoopbackHub {
            addr,
            seen,
            stop,
            thread: Some(thread),
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Closes the port: later connections are refused.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for LoopbackHub {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Answers one request on `conn`.
fn handle(
    conn: TcpStream,
    repos: &HashMap<String, HubRepo>,
    seen: &Mutex<Seen>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    {
        let mut s = seen.lock().unwrap();
        s.requests.push(format!("{method} {path}"));
        if let Some(a) = headers.get("authorization") {
            s.authorization.push(a.clone());
        }
    }
    let (status, head, body) = answer(path, &headers, repos);
    let mut out = conn;
    let body = if method == "HEAD" { &[][..] } else { &body[..] };
    write!(
        out,
        "HTTP/1.1 {status}\r\n{head}Connection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )?;
    out.write_all(body)?;
    out.flush()
}

/// Status line, headers and body for `path`.
fn answer(
    path: &str,
    headers: &HashMap<String, String>,
    repos: &HashMap<String, HubRepo>,
) -> (String, String, Vec<u8>) {
    let error = |status: &str, code: &str| {
        let head = if code.is_empty() {
            String::new()
        } else {
            format!("x-error-code: {code}\r\n")
        };
        (
            status.to_string(),
            head,
            format!("{status} {code}").into_bytes(),
        )
    };
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    let [owner, name, "resolve", revision, file] = parts[..] else {
        return error("404 Not Found", "");
    };
    let Some(repo) = repos.get(&format!("{owner}/{name}")) else {
        return error("404 Not Found", "RepoNotFound");
    };
    if let Some(t) = &repo.token
        && headers.get("authorization") != Some(&format!("Bearer {t}"))
    {
        return error("401 Unauthorized", "");
    }
    if revision != "main" && revision != repo.commit {
        return error("404 Not Found", "RevisionNotFound");
    }
    let commit = format!("x-repo-commit: {}\r\n", repo.commit);
    let Some(bytes) = repo.files.get(file) else {
        let (status, head, body) = error("404 Not Found", "EntryNotFound");
        return (status, format!("{head}{commit}"), body);
    };
    let etag = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut h);
        format!("etag: \"{:016x}{:08x}\"\r\n", h.finish(), bytes.len())
    };
    let size = bytes.len();
    // `Range: bytes=A-B` or `bytes=A-`.
    let range = headers
        .get("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .and_then(|(a, b)| {
            let a: usize = a.parse().ok()?;
            let b: usize = if b.is_empty() {
                size.checked_sub(1)?
            } else {
                b.parse::<usize>().ok()?.min(size.checked_sub(1)?)
            };
            (a <= b).then_some((a, b))
        });
    match range {
        Some((a, b)) => (
            "206 Partial Content".into(),
            format!("{commit}{etag}Content-Range: bytes {a}-{b}/{size}\r\n"),
            bytes[a..=b].to_vec(),
        ),
        None => ("200 OK".into(), format!("{commit}{etag}"), bytes.clone()),
    }
}
