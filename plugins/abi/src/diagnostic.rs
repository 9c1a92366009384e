//! [`Diagnostic`] and [`DiagnosticReport`] on the C boundary: versioned JSON.
//!
//! Every message is one JSON object with `"schema": "nsactor.diagnostic/1"` and a `"kind"`;
//! the other members are the variant's fields under their Rust names:
//!
//! | message | kind | members |
//! |---|---|---|
//! | request | `kernels`, `decode-profile` | `options` (string) |
//! | request | `verify-plif-scan` | `fixture` (string), `precisions` (`fp32`, `bf16`, `both`) |
//! | request | `memory`, `timing-start`, `timing-report` | — |
//! | report | `text` | `text` (string) |
//! | report | `verdict` | `passed` (bool), `report` (string) |
//! | report | `memory` | `devices`: `[{device, used_bytes, total_bytes}]` |
//! | report | `timing` | `devices`: `[{device, window_s, calls_s, gemm_s, scans_s, gemm_or_scans_s, gemm_sum_s, scans_sum_s, gemms, scans, calls}]` |
//! | report | `done` | — |
//!
//! A reader refuses another schema, a missing or mistyped member, and an unknown kind, with an
//! error that names what it read.

use nsactor_plugin_api::EngineError;
use nsactor_plugin_api::diagnose::{DeviceMemory, Diagnostic, DiagnosticReport, ScanPrecisions};
use nsactor_plugin_api::timing::{CallTime, DeviceTime};
use serde_json::{Map, Value, json};

/// The schema every message names.
pub const SCHEMA: &str = "nsactor.diagnostic/1";

fn message(kind: &str, members: Value) -> String {
    let mut m = match members {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    m.insert("schema".into(), SCHEMA.into());
    m.insert("kind".into(), kind.into());
    Value::Object(m).to_string()
}

/// A message's members, after checking its schema; and its kind.
fn open(text: &str) -> Result<(String, Map<String, Value>), EngineError> {
    let bad = |m: String| EngineError::Plugin(format!("diagnostic message: {m}"));
    let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Value::Object(m) = v else {
        return Err(bad(format!("not an object: {text}")));
    };
    match m.get("schema").and_then(Value::as_str) {
        Some(SCHEMA) => {}
        other => return Err(bad(format!("schema {other:?}, expected {SCHEMA:?}"))),
    }
    let kind = m
        .get("kind")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("no kind in {text}")))?
        .to_string();
    Ok((kind, m))
}

fn member<'a>(m: &'a Map<String, Value>, key: &str, kind: &str) -> Result<&'a Value, EngineError> {
    m.get(key)
        .ok_or_else(|| EngineError::Plugin(format!("diagnostic `{kind}` has no `{key}`")))
}

fn string(m: &Map<String, Value>, key: &str, kind: &str) -> Result<String, EngineError> {
    member(m, key, kind)?
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| EngineError::Plugin(format!("diagnostic `{kind}`: `{key}` is not a string")))
}

fn number<T>(
    v: &Value,
    key: &str,
    kind: &str,
    get: fn(&Value) -> Option<T>,
) -> Result<T, EngineError> {
    let x = v.get(key).ok_or_else(|| {
        EngineError::Plugin(format!("diagnostic `{kind}`: a device has no `{key}`"))
    })?;
    get(x).ok_or_else(|| {
        EngineError::Plugin(format!(
            "diagnostic `{kind}`: `{key}` is {x}, not a number of its kind"
        ))
    })
}

fn devices(m: &Map<String, Value>, kind: &str) -> Result<Vec<Value>, EngineError> {
    member(m, "devices", kind)?
        .as_array()
        .cloned()
        .ok_or_else(|| EngineError::Plugin(format!("diagnostic `{kind}`: `devices` is not a list")))
}

/// The request as JSON.
pub fn encode_request(d: &Diagnostic) -> String {
    let members = match d {
        Diagnostic::Kernels { options } | Diagnostic::DecodeProfile { options } => {
            json!({ "options": options })
        }
        Diagnostic::VerifyPlifScan {
            fixture,
            precisions,
        } => json!({
            "fixture": fixture,
            "precisions": match precisions {
                ScanPrecisions::Fp32 => "fp32",
                ScanPrecisions::Bf16 => "bf16",
                ScanPrecisions::Both => "both",
            },
        }),
        Diagnostic::Memory | Diagnostic::TimingStart | Diagnostic::TimingReport => json!({}),
    };
    message(d.name(), members)
}

/// Reads a request.
pub fn decode_request(text: &str) -> Result<Diagnostic, EngineError> {
    let (kind, m) = open(text)?;
    Ok(match kind.as_str() {
        "kernels" => Diagnostic::Kernels {
            options: string(&m, "options", &kind)?,
        },
        "decode-profile" => Diagnostic::DecodeProfile {
            options: string(&m, "options", &kind)?,
        },
        "verify-plif-scan" => Diagnostic::VerifyPlifScan {
            fixture: string(&m, "fixture", &kind)?,
            precisions: match string(&m, "precisions", &kind)?.as_str() {
                "fp32" => ScanPrecisions::Fp32,
                "bf16" => ScanPrecisions::Bf16,
                "both" => ScanPrecisions::Both,
                other => {
                    return Err(EngineError::InvalidInput(format!(
                        "verify-plif-scan: precisions `{other}` (fp32, bf16 or both)"
                    )));
                }
            },
        },
        "memory" => Diagnostic::Memory,
        "timing-start" => Diagnostic::TimingStart,
        "timing-report" => Diagnostic::TimingReport,
        other => {
            return Err(EngineError::InvalidInput(format!(
                "unknown diagnostic `{other}`"
            )));
        }
    })
}

/// The report as JSON.
pub fn encode_report(r: &DiagnosticReport) -> String {
    let members = match r {
        DiagnosticReport::Text(text) => json!({ "text": text }),
        DiagnosticReport::Verdict { passed, report } => {
            json!({ "passed": passed, "report": report })
        }
        DiagnosticReport::Memory(devices) => json!({
            "devices": devices.iter().map(|d| json!({
                "device": d.device,
                "used_bytes": d.used_bytes,
                "total_bytes": d.total_bytes,
            })).collect::<Vec<_>>(),
        }),
        DiagnosticReport::Timing(devices) => json!({
            "devices": devices.iter().map(|t| json!({
                "device": t.device,
                "window_s": t.window_s,
                "calls_s": t.calls_s,
                "gemm_s": t.gemm_s,
                "scans_s": t.scans_s,
                "gemm_or_scans_s": t.gemm_or_scans_s,
                "gemm_sum_s": t.gemm_sum_s,
                "scans_sum_s": t.scans_sum_s,
                "gemms": t.gemms,
                "scans": t.scans,
                "calls": t.calls,
                "by_call": t.by_call.iter().map(|c| json!({
                    "name": c.name,
                    "calls": c.calls,
                    "seconds": c.seconds,
                    "kernels_s": c.kernels_s,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        }),
        DiagnosticReport::Done => json!({}),
    };
    message(r.kind(), members)
}

/// Reads a report.
pub fn decode_report(text: &str) -> Result<DiagnosticReport, EngineError> {
    let (kind, m) = open(text)?;
    let k = kind.as_str();
    let u = |v: &Value, key: &str| number(v, key, k, Value::as_u64);
    let f = |v: &Value, key: &str| number(v, key, k, Value::as_f64);
    Ok(match k {
        "text" => DiagnosticReport::Text(string(&m, "text", k)?),
        "verdict" => DiagnosticReport::Verdict {
            passed: member(&m, "passed", k)?.as_bool().ok_or_else(|| {
                EngineError::Plugin("diagnostic `verdict`: `passed` is not a bool".into())
            })?,
            report: string(&m, "report", k)?,
        },
        "memory" => DiagnosticReport::Memory(
            devices(&m, k)?
                .iter()
                .map(|d| {
                    Ok(DeviceMemory {
                        device: u(d, "device")? as usize,
                        used_bytes: u(d, "used_bytes")?,
                        total_bytes: u(d, "total_bytes")?,
                    })
                })
                .collect::<Result<_, EngineError>>()?,
        ),
        "timing" => DiagnosticReport::Timing(
            devices(&m, k)?
                .iter()
                .map(|d| {
                    Ok(DeviceTime {
                        device: u(d, "device")? as usize,
                        window_s: f(d, "window_s")?,
                        calls_s: f(d, "calls_s")?,
                        gemm_s: f(d, "gemm_s")?,
                        scans_s: f(d, "scans_s")?,
                        gemm_or_scans_s: f(d, "gemm_or_scans_s")?,
                        gemm_sum_s: f(d, "gemm_sum_s")?,
                        scans_sum_s: f(d, "scans_sum_s")?,
                        gemms: u(d, "gemms")?,
                        scans: u(d, "scans")?,
                        calls: u(d, "calls")?,
                        // Optional: a plugin built before calls were named sends none.
                        by_call: match d.get("by_call").and_then(Value::as_array) {
                            None => Vec::new(),
                            Some(cs) => cs
                                .iter()
                                .map(|c| {
                                    Ok(CallTime {
                                        name: c
                                            .get("name")
                                            .and_then(Value::as_str)
                                            .ok_or_else(|| {
                                                EngineError::Plugin(format!(
                                                    "diagnostic `{k}`: a call's `name` is not a string"
                                                ))
                                            })?
                                            .to_string(),
                                        calls: u(c, "calls")?,
                                        seconds: f(c, "seconds")?,
                                        kernels_s: f(c, "kernels_s")?,
                                    })
                                })
                                .collect::<Result<_, EngineError>>()?,
                        },
                    })
                })
                .collect::<Result<_, EngineError>>()?,
        ),
        "done" => DiagnosticReport::Done,
        other => {
            return Err(EngineError::Plugin(format!(
                "diagnostic report of unknown kind `{other}`"
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nsactor_plugin_api::timing::SpanKind;

    #[test]
    fn every_request_and_report_round_trips() {
        for d in [
            Diagnostic::Kernels {
                options: "reps=3".into(),
            },
            Diagnostic::DecodeProfile {
                options: "batch=64".into(),
            },
            Diagnostic::VerifyPlifScan {
                fixture: "/f/plif_scan.safetensors".into(),
                precisions: ScanPrecisions::Bf16,
            },
            Diagnostic::Memory,
            Diagnostic::TimingStart,
            Diagnostic::TimingReport,
        ] {
            assert_eq!(decode_request(&encode_request(&d)).unwrap(), d);
        }
        let t = DeviceTime::from_spans(
            1,
            2.5,
            &[
                (SpanKind::Call("Backward"), 0.0, 2.0),
                (SpanKind::Gemm, 0.5, 1.25),
            ],
        );
        for r in [
            DiagnosticReport::Text("a table\n".into()),
            DiagnosticReport::Verdict {
                passed: false,
                report: "x FAILED".into(),
            },
            DiagnosticReport::Memory(vec![DeviceMemory {
                device: 0,
                used_bytes: 3 << 30,
                total_bytes: 80 << 30,
            }]),
            DiagnosticReport::Timing(vec![t.clone(), t]),
            DiagnosticReport::Done,
        ] {
            assert_eq!(decode_report(&encode_report(&r)).unwrap(), r);
        }
    }

    #[test]
    fn other_schemas_missing_or_mistyped_members_and_unknown_kinds_are_refused() {
        let t = DeviceTime::from_spans(0, 1.0, &[(SpanKind::Call("Step"), 0.0, 1.0)]);
        let good = encode_report(&DiagnosticReport::Timing(vec![t]));
        for (bad, says) in [
            (
                good.replace("nsactor.diagnostic/1", "nsactor.diagnostic/2"),
                "schema",
            ),
            (good.replace("\"gemms\"", "\"flops\""), "no `gemms`"),
            (good.replace("\"calls\":1", "\"calls\":\"one\""), "calls"),
            (
                good.replace("\"kind\":\"timing\"", "\"kind\":\"timings\""),
                "timings",
            ),
            ("device-time device=0".to_string(), "not JSON"),
        ] {
            let e = decode_report(&bad).unwrap_err().to_string();
            assert!(e.contains(says), "`{bad}` gave `{e}`");
        }
        let e = decode_request(&message("flops", json!({})))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown diagnostic `flops`"), "{e}");
    }
}
