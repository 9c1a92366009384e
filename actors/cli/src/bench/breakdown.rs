//! Printing where a training step's device time went.

/// `bench train`'s device-time breakdown: per device, the mean per timed step of the time in
/// GEMMs, in PLIF scans, in other work inside stage calls, and outside every stage call.
pub fn print_device_breakdown(
    r: &super::steps::TrainBench,
    info: &nsactor_plugin_api::BackendInfo,
    executed_flops: f64,
    skipped: bool,
) {
    let devices = r.mean_device();
    if devices.is_empty() {
        println!(
            "device time: {}",
            if skipped {
                "not measured (--no-breakdown)".to_string()
            } else {
                format!(
                    "not reported by this backend ({})",
                    r.device_note.as_deref().unwrap_or("no timing")
                )
            }
        );
        return;
    }
    println!(
        "device time per step (events on the work's streams; overlapping work of two streams counts once):"
    );
    let pct = |x: f64, w: f64| 100.0 * x / w.max(1e-12);
    let idle: Vec<&str> = devices
        .iter()
        .filter(|d| d.calls == 0)
        .map(|d| device_name(info, d.device))
        .collect();
    for d in devices.iter().filter(|d| d.calls > 0) {
        let w = d.window_s;
        println!(
            "  {:<10} {:.3} s: GEMM {:.3} s ({:.1}%, {} calls), PLIF scans {:.3} s ({:.1}%, {} kernels), \
             other work in stage calls {:.3} s ({:.1}%), outside stage calls (actor messaging, host \
             round trips, the supervisor) {:.3} s ({:.1}%)",
            device_name(info, d.device),
            w,
            d.gemm_s,
            pct(d.gemm_s, w),
            d.gemms,
            d.scans_s,
            pct(d.scans_s, w),
            d.scans,
            d.other_s(),
            pct(d.other_s(), w),
            d.outside_calls_s(),
            pct(d.outside_calls_s(), w)
        );
        if d.gemm_sum_s > d.gemm_s * 1.001 || d.scans_sum_s > d.scans_s * 1.001 {
            println!(
                "             summed over streams: GEMM {:.3} s, scans {:.3} s",
                d.gemm_sum_s, d.scans_sum_s
            );
        }
        print_by_call(d);
    }
    if !idle.is_empty() {
        println!("  {}: no stage work", idle.join(", "));
    }
    let gemm: f64 = devices.iter().map(|d| d.gemm_sum_s).sum();
    if gemm > 0.0 {
        println!(
            "  GEMMs while running: {:.0} TFLOP/s ({:.4} GFLOP per token executed, {} tokens per step)",
            executed_flops * r.tokens_per_step as f64 / gemm / 1e12,
            executed_flops / 1e9,
            r.tokens_per_step
        );
    }
}

/// A device's name as the backend gives it (`cuda:0`).
fn device_name(info: &nsactor_plugin_api::BackendInfo, device: usize) -> &str {
    info.devices
        .get(device)
        .and_then(|n| n.split_whitespace().next())
        .unwrap_or("?")
}

/// The "other work" of a device's stage calls by call name, the largest first: each name's
/// device time, its share in GEMMs and scans, and the rest. Names whose rest is under 1 ms are
/// summed into one figure.
fn print_by_call(d: &nsactor_plugin_api::timing::DeviceTime) {
    if d.by_call.is_empty() {
        return;
    }
    println!("             by call (other = outside GEMMs and scans):");
    let (mut small, mut small_n) = (0.0, 0);
    for c in &d.by_call {
        let other = (c.seconds - c.kernels_s).max(0.0);
        if other < 1e-3 {
            small += c.seconds;
            small_n += 1;
            continue;
        }
        println!(
            "               {:<14} {:>5} calls {:8.4} s, other {:8.4} s ({:4.1}% of the window)",
            c.name,
            c.calls,
            c.seconds,
            other,
            100.0 * other / d.window_s.max(1e-12)
        );
    }
    if small_n > 0 {
        println!(
            "               {small_n} more call kinds, {small:.4} s in all, under 1 ms other each"
        );
    }
}
