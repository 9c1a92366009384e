//! Two real processes forming a world over loopback: they authenticate, agree, exchange
//! packets and finish; a configuration mismatch is refused on both sides; a wrong secret
//! never joins; a rank killed with SIGKILL breaks the other's wait within seconds.
//!
//! Each rank is this test binary run again with the scenario in its environment (the
//! `rank_process` test does the rank's part and exits); the orchestrating tests only start
//! the two processes and read how they ended.

use nsactor_cluster::{Body, Kind, Peers, WirePart, World};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const SCENARIO: &str = "NSX_TEST_SCENARIO";

fn world(rank: usize, port: u16, secret: &str) -> World {
    World {
        rank,
        size: 2,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        secret: secret.into(),
        timeout: Duration::from_secs(20),
        rendezvous_timeout: Duration::from_secs(4),
        restart: 0,
    }
}

/// One rank's part of `scenario`; panics (a failed process) where it goes wrong.
async fn rank_main(scenario: &str, rank: usize, port: u16) {
    let secret = match (scenario, rank) {
        ("bad-secret", 1) => "another-secret-entirely",
        _ => "the-shared-secret-0123",
    };
    let joined = Peers::join(world(rank, port, secret)).await;
    if scenario == "bad-secret" {
        let e = joined
            .err()
            .expect("a wrong secret must not join")
            .to_string();
        println!("JOIN-ERROR {e}");
        return;
    }
    let peers = joined.expect("join");
    let fingerprint = match (scenario, rank) {
        ("refuse", 1) => 8,
        _ => 7,
    };
    let agreed = peers.agree(fingerprint, 3).await;
    if scenario == "refuse" {
        println!(
            "AGREE-ERROR {}",
            agreed.expect_err("a mismatch must be refused")
        );
        return;
    }
    agreed.expect("agree");
    match (scenario, rank) {
        ("exchange", 0) => {
            let part = WirePart {
                stream: 1,
                index: 2,
                mask: vec![5],
                // Larger than ractor_cluster's default 16 MiB frame.
                values: (0..5_000_000).map(|i| i as f32 * 0.5).collect(),
            };
            peers.send(1, 9, 2, Body::Part(part.clone())).unwrap();
            let back = peers.recv(1, Kind::Grads(2)).await.unwrap();
            assert_eq!((back.from, back.step, back.stage), (1, 9, 2));
            let Body::Part(b) = back.body else {
                panic!("{:?}", back.body)
            };
            let doubled: Vec<f32> = part.values.iter().map(|v| v * 2.0).collect();
            assert!(b.values == doubled && b.mask == part.mask && b.index == 2);
            peers.finish().await.unwrap();
            println!("EXCHANGED {}", b.values.len());
        }
        ("exchange", _) => {
            let p = peers.recv(0, Kind::Grads(2)).await.unwrap();
            let Body::Part(mut w) = p.body else {
                panic!("{:?}", p.body)
            };
            w.values.iter_mut().for_each(|v| *v *= 2.0);
            peers.send(0, p.step, p.stage, Body::Part(w)).unwrap();
            peers.finish().await.unwrap();
            println!("EXCHANGED");
        }
        ("die", 1) => {
            // SAFETY: kill(2) on this process's own pid.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        ("die", _) => {
            let t = Instant::now();
            let e = peers.recv(1, Kind::Results).await.unwrap_err().to_string();
            println!("BROKEN after {:.2} s: {e}", t.elapsed().as_secs_f64());
        }
        _ => unreachable!("{scenario}"),
    }
}

/// The rank half of a scenario: a no-op unless this binary was started as a rank.
#[test]
fn rank_process() {
    let Ok(s) = std::env::var(SCENARIO) else {
        return;
    };
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    let port: u16 = std::env::var("PORT").unwrap().parse().unwrap();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(rank_main(&s, rank, port));
}

/// Runs `scenario` as two processes; their outputs, rank 0 first.
fn run(scenario: &str) -> (Output, Output) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let spawn = |rank: usize| {
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "rank_process", "--nocapture", "--test-threads=1"])
            .env(SCENARIO, scenario)
            .env("RANK", rank.to_string())
            .env("PORT", port.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let r0 = spawn(0);
    let r1 = spawn(1);
    (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    )
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn two_processes_agree_exchange_and_finish() {
    let (a, b) = run("exchange");
    assert!(a.status.success(), "rank 0: {}", text(&a));
    assert!(b.status.success(), "rank 1: {}", text(&b));
    assert!(text(&a).contains("EXCHANGED 5000000"), "{}", text(&a));
}

#[test]
fn a_configuration_mismatch_is_refused_on_both_sides() {
    let (a, b) = run("refuse");
    assert!(a.status.success() && b.status.success());
    assert!(text(&a).contains("another configuration"), "{}", text(&a));
    assert!(text(&b).contains("rank 0 refused"), "{}", text(&b));
}

#[test]
fn a_wrong_secret_never_joins() {
    let (a, b) = run("bad-secret");
    assert!(a.status.success() && b.status.success());
    assert!(
        text(&a).contains("JOIN-ERROR rank 1 did not join"),
        "{}",
        text(&a)
    );
    assert!(text(&b).contains("JOIN-ERROR"), "{}", text(&b));
}

#[test]
fn a_killed_rank_breaks_the_others_wait_at_once() {
    let (a, b) = run("die");
    assert!(!b.status.success(), "rank 1 should have been killed");
    let out = text(&a);
    assert!(a.status.success(), "{out}");
    let line = out
        .lines()
        .find_map(|l| l.split_once("BROKEN after ").map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("closed"), "{line}");
    let secs: f64 = line.split_whitespace().next().unwrap().parse().unwrap();
    assert!(secs < 10.0, "{line}");
}
