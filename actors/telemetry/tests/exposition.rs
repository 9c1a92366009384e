//! The exposition passes a Prometheus text-format parser (`prometheus-parse`) and carries the
//! values recorded; the training exporter serves it over HTTP and refuses a taken address.

use nsactor_telemetry::serving::DecoderState;
use nsactor_telemetry::training::StepSample;
use nsactor_telemetry::{Exporter, ServingMetrics, TelemetryError, TrainingMetrics};
use prometheus_parse::{Scrape, Value};
use std::io::{Read, Write};

fn parse(text: &str) -> Scrape {
    Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("valid text format")
}

fn value(s: &Scrape, name: &str) -> Option<f64> {
    s.samples
        .iter()
        .find(|x| x.metric == name)
        .map(|x| match &x.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
            Value::Histogram(_) | Value::Summary(_) => f64::NAN,
        })
}

#[test]
fn serving_metrics_parse_with_the_vllm_names_and_values() {
    let m = ServingMetrics::new().expect("registry");
    m.requests.inc_by(3);
    m.running.set(2);
    m.finished("stop", (12, 30), (0.2, 1.4));
    m.finished("length", (5, 64), (0.05, 2.0));
    m.inter_token_latency.observe(0.02);
    let text = m.render(DecoderState {
        queued: 4,
        open_sessions: 2,
        batches: 10,
        batch_inputs: 25,
        window_launches: 3,
        recoveries: 2,
        healthy: true,
        chunk_tokens: 16,
        step_seconds: 0.0055,
        prefix: nsactor_telemetry::PrefixCacheState {
            hits: 7,
            misses: 2,
            tokens_saved: 900,
            device_bytes: 1 << 20,
            entries: 3,
            score_bytes: 4096,
            ..Default::default()
        },
    });
    let s = parse(&text);
    assert_eq!(value(&s, "nsactor_prefill_chunk_tokens"), Some(16.0));
    assert_eq!(value(&s, "nsactor_decode_step_seconds"), Some(0.0055));
    assert_eq!(value(&s, "nsactor_prefix_cache_hits_total"), Some(7.0));
    assert_eq!(value(&s, "nsactor_prefix_cache_misses_total"), Some(2.0));
    assert_eq!(
        value(&s, "nsactor_prefix_cache_tokens_saved_total"),
        Some(900.0)
    );
    assert_eq!(value(&s, "nsactor_prefix_cache_evictions_total"), Some(0.0));
    assert_eq!(
        value(&s, "nsactor_prefix_cache_device_bytes"),
        Some(1048576.0)
    );
    assert_eq!(value(&s, "nsactor_prefix_cache_entries"), Some(3.0));
    assert_eq!(value(&s, "nsactor_prefix_cache_score_bytes"), Some(4096.0));
    assert_eq!(value(&s, "nsactor_requests_total"), Some(3.0));
    assert_eq!(value(&s, "nsactor_num_requests_running"), Some(2.0));
    assert_eq!(value(&s, "nsactor_num_requests_waiting"), Some(4.0));
    assert_eq!(value(&s, "nsactor_prompt_tokens_total"), Some(17.0));
    assert_eq!(value(&s, "nsactor_generation_tokens_total"), Some(94.0));
    assert_eq!(value(&s, "nsactor_decode_batches_total"), Some(10.0));
    assert_eq!(value(&s, "nsactor_decode_window_launches_total"), Some(3.0));
    assert_eq!(value(&s, "nsactor_decode_recoveries_total"), Some(2.0));
    assert_eq!(value(&s, "nsactor_decode_healthy"), Some(1.0));
    let stop = s
        .samples
        .iter()
        .find(|x| {
            x.metric == "nsactor_request_success_total"
                && x.labels.get("finished_reason") == Some("stop")
        })
        .expect("success by reason");
    assert!(matches!(stop.value, Value::Counter(v) if v == 1.0));
    for (name, count, sum) in [
        ("nsactor_time_to_first_token_seconds", 2, 0.25),
        ("nsactor_e2e_request_latency_seconds", 2, 3.4),
        ("nsactor_inter_token_latency_seconds", 1, 0.02),
    ] {
        let h = s
            .samples
            .iter()
            .find(|x| x.metric == name)
            .unwrap_or_else(|| panic!("{name} in {text}"));
        let Value::Histogram(buckets) = &h.value else {
            panic!("{name} is a histogram")
        };
        let inf = buckets
            .iter()
            .find(|b| b.less_than.is_infinite())
            .expect("+Inf");
        assert_eq!(inf.count, count as f64, "{name}");
        assert!(
            text.contains(&format!("{name}_sum {sum}")),
            "{name} sum in {text}"
        );
    }
    assert_eq!(
        s.docs.get("nsactor_requests_total").map(String::as_str),
        Some(
            "Generations started (one per choice: an OpenAI request with n = 4 or a batch of 4 prompts counts 4; one per WebSocket generate)."
        )
    );
    // Counters read from the decoder never go down.
    let again = parse(&m.render(DecoderState {
        batches: 4,
        ..Default::default()
    }));
    assert_eq!(value(&again, "nsactor_decode_batches_total"), Some(10.0));
}

fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut c = std::net::TcpStream::connect(addr).expect("connect");
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut out = String::new();
    c.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn the_training_exporter_serves_the_registry_and_refuses_a_taken_port() {
    let m = TrainingMetrics::new().expect("registry");
    m.record(&StepSample {
        step: 7,
        loss: Some(3.25),
        lr: 1e-3,
        expected_k: 2.5,
        grad_norm: 0.75,
        tokens: 1024,
        tokens_per_second: 512.0,
        seconds: 2.0,
        skipped: false,
    });
    let e = Exporter::start("127.0.0.1:0", m.registry().clone()).expect("listening");
    let reply = get(e.addr(), "/metrics");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("text/plain; version=0.0.4"), "{reply}");
    let body = &reply[reply.find("\r\n\r\n").expect("a body") + 4..];
    let s = parse(body);
    assert_eq!(value(&s, "nsactor_train_step"), Some(7.0));
    assert_eq!(value(&s, "nsactor_train_loss"), Some(3.25));
    assert_eq!(value(&s, "nsactor_train_tokens_total"), Some(1024.0));
    assert_eq!(value(&s, "nsactor_train_expected_k"), Some(2.5));
    assert!(value(&s, "nsactor_train_eval_loss").is_some_and(f64::is_nan));
    // A value recorded later shows in the next scrape.
    m.loss.set(2.0);
    assert!(get(e.addr(), "/metrics").contains("nsactor_train_loss 2\n"));
    assert!(get(e.addr(), "/other").starts_with("HTTP/1.1 404"));
    let taken = Exporter::start(&e.addr().to_string(), m.registry().clone());
    assert!(
        matches!(taken, Err(TelemetryError::Listen { .. })),
        "the port is taken"
    );
    let addr = e.addr();
    drop(e);
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "dropping it stops the listener"
    );
}
