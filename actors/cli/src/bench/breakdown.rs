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
    for d in &devices {
        let w = d.window_s;
        println!(
            "  {:<10} {:.3} s: GEMM {:.3} s ({:.1}%, {} calls), PLIF scans {:.3} s ({:.1}%, {} kernels), \
             other work in stage calls {:.3} s ({:.1}%), outside stage calls (actor messaging, host \
             round trips, the supervisor) {:.3} s ({:.1}%)",
            info.devices
                .get(d.device)
                .and_then(|n| n.split_whitespace().next())
                .unwrap_or("?"),
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
