//! `nsactor verify`: the reference's golden runs replayed on a backend.

use clap::Subcommand;
use nsactor_engine::backend;
use nsactor_launch::launch::{self};
use nsactor_plugin_api::{Diagnostic, DiagnosticReport, ScanPrecisions};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum VerifyCommand {
    /// `tiny_a`: forward, one training step (natural gradient, clip, Adam) and greedy decoding.
    TinyA(VerifyArgs),
    /// `plif_scan`: both PLIF scan variants, forward and backward, run by the backend (on the
    /// GPU for CUDA) in fp32 and with bf16 storage; prints every error and the spike agreement.
    PlifScan(VerifyScanArgs),
    /// Batch invariance of decoding: one prompt decoded greedily alone and inside cohorts of
    /// other sessions must give the same tokens and bit-identical logits.
    BatchInvariance(VerifyBatchArgs),
}

#[derive(clap::Args)]
pub struct VerifyBatchArgs {
    /// The run configuration whose `[model]` (freshly initialised) and `[backend]` are used
    /// (default: the embedded tiny config).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Backend: `embedded`, a plugin name or a plugin path (default: the config's).
    #[arg(long)]
    backend: Option<String>,
    /// GEMM arithmetic (default: the config's).
    #[arg(long, value_parser = ["fp32", "bf16"])]
    precision: Option<String>,
    /// Cohort sizes to decode our prompt in (ours included).
    #[arg(long, value_delimiter = ',', default_value = "3,17")]
    cohorts: Vec<usize>,
    /// Greedy tokens decoded (the first from the prompt's prefill).
    #[arg(long, default_value_t = 12)]
    steps: usize,
}

#[derive(clap::Args)]
pub struct VerifyArgs {
    /// The fixture file (`shared/fixtures/tiny_a.safetensors`).
    #[arg(long)]
    fixture: PathBuf,
    /// Backend: `embedded`, a plugin name or a plugin path.
    #[arg(long, default_value = backend::EMBEDDED)]
    backend: String,
    /// Pipeline stages of the actor pipeline that runs the replay.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Devices the stages are spread over, e.g. `0,1` (default: device 0).
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// GEMM arithmetic: `fp32` (the fixture's bounds) or `bf16` (bf16 inputs, fp32
    /// accumulation; CUDA only), held to 1e-2 relative with the greedy agreement reported.
    #[arg(long, value_parser = ["fp32", "bf16"], default_value = "fp32")]
    precision: String,
}

#[derive(clap::Args)]
pub struct VerifyScanArgs {
    /// The fixture file (`shared/fixtures/plif_scan.safetensors`).
    #[arg(long)]
    fixture: PathBuf,
    /// Backend: `embedded`, a plugin name or a plugin path.
    #[arg(long, default_value = backend::EMBEDDED)]
    backend: String,
    /// `fp32` (the fixture README's bounds), `bf16` (bf16 storage, 1e-2 relative) or `both`.
    #[arg(long, value_parser = ["fp32", "bf16", "both"], default_value = "both")]
    precision: String,
}

pub fn verify_cmd(args: VerifyArgs) -> crate::result::CliResult {
    let bytes = std::fs::read(&args.fixture)
        .map_err(|e| format!("cannot read fixture {}: {e}", args.fixture.display()))?;
    let bf16 = args.precision == "bf16";
    let options = if bf16 { "precision=bf16" } else { "" };
    let compute = backend::open_with(&args.backend, &[], options)?;
    let info = compute.info();
    let started = std::time::Instant::now();
    let devices = args.devices.clone().unwrap_or_else(|| vec![0]);
    launch::check_devices(compute.as_ref(), &devices)?;
    let r = nsactor_training::verify::tiny_a(compute, &bytes, args.pipeline, &devices)?;
    println!(
        "tiny_a on {} {} ({}), {} GEMMs, in {:.2} s",
        info.name,
        info.version,
        info.devices.join(", "),
        args.precision,
        started.elapsed().as_secs_f64()
    );
    println!(
        "CE {:.7} (ref {:.7}); loss {:.7} (ref {:.7}); |g| {:.6} (ref {:.6}); worst gradient {} {:.2e}; worst param after the step {} {:.2e}",
        r.ce_before,
        r.ce_want,
        r.loss,
        r.loss_want,
        r.grad_norm,
        r.grad_norm_want,
        r.worst_grad().0,
        r.worst_grad().1,
        r.worst_param.0,
        r.worst_param.1
    );
    println!("greedy {:?}\nref    {:?}", r.greedy, r.greedy_want);
    let (same, generated) = r.greedy_agreement();
    println!("generated tokens equal to the reference's: {same} of {generated}");
    let bound = if bf16 {
        nsactor_training::verify::BF16_REL
    } else {
        nsactor_training::verify::PARAM_REL
    };
    let mut over: Vec<_> = r.grad_errors.iter().filter(|(_, e)| *e > bound).collect();
    over.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!(
        "parameter gradients within {bound:.0e} of the reference's: {} of {}{}",
        r.grad_errors.len() - over.len(),
        r.grad_errors.len(),
        if over.is_empty() {
            ""
        } else {
            "; the farthest:"
        }
    );
    for (name, e) in over.iter().take(6) {
        println!("  {name:<44} {e:.2e}");
    }
    let checks = r.checks_at(bf16);
    for (name, value, bound, ok) in &checks {
        println!(
            "{:<32} {value:>10.3e} ≤ {bound:.0e}  {}",
            name,
            if *ok { "ok" } else { "FAIL" }
        );
    }
    if checks.iter().all(|c| c.3) {
        println!("PASS");
        Ok(())
    } else {
        Err("tiny_a: outside the fixture tolerances".into())
    }
}

pub fn verify_scan_cmd(args: VerifyScanArgs) -> crate::result::CliResult {
    // The plugin reads the file itself; read it here first so a bad path is our error.
    std::fs::metadata(&args.fixture)
        .map_err(|e| format!("cannot read fixture {}: {e}", args.fixture.display()))?;
    let path = args
        .fixture
        .to_str()
        .ok_or_else(|| format!("the fixture path {} must be UTF-8", args.fixture.display()))?;
    let compute = backend::open(&args.backend, &[])?;
    let info = compute.info();
    println!(
        "plif_scan on {} {} ({})",
        info.name,
        info.version,
        info.devices.join(", ")
    );
    let precisions = match args.precision.as_str() {
        "fp32" => ScanPrecisions::Fp32,
        "bf16" => ScanPrecisions::Bf16,
        _ => ScanPrecisions::Both,
    };
    let what = Diagnostic::VerifyPlifScan {
        fixture: path.to_string(),
        precisions,
    };
    match compute.diagnose(&what)? {
        DiagnosticReport::Verdict {
            passed: true,
            report,
        } => {
            print!("{report}");
            println!("PASS");
            Ok(())
        }
        DiagnosticReport::Verdict {
            passed: false,
            report,
        } => {
            print!("{report}");
            println!("some checks FAILED");
            Err("plif_scan: outside the fixture tolerances".into())
        }
        other => Err(format!("verify-plif-scan answered a {} report", other.kind()).into()),
    }
}

pub fn verify_batch_cmd(a: VerifyBatchArgs) -> crate::result::CliResult {
    let mut cfg = nsactor_engine::config::RunConfig::load(a.config.as_deref())?;
    if a.precision.is_some() {
        cfg.backend.precision = a.precision.clone();
    }
    let compute = launch::open_backend(&cfg, a.backend.as_deref())?;
    let info = compute.info();
    println!(
        "batch invariance on {} {} ({}), model D = {}, {} GEMMs, {} steps",
        info.name,
        info.version,
        info.devices.first().map_or("", String::as_str),
        cfg.model.d,
        cfg.backend.precision.as_deref().unwrap_or("fp32"),
        a.steps
    );
    let t = std::time::Instant::now();
    let checks = nsactor_decoding::invariance::check(
        compute,
        &cfg.model,
        cfg.train.seed,
        &a.cohorts,
        a.steps,
    )?;
    for c in &checks {
        println!(
            "cohort of {:>4}: tokens differing {} of {}; logits differing {} of {} (max |diff| {:.3e}); device picks unlike the host's argmax {}  {}",
            c.sessions,
            c.tokens_differing,
            a.steps,
            c.logits_differing,
            c.logits,
            c.max_abs_diff,
            c.picks_differing,
            if c.invariant() { "ok" } else { "FAIL" }
        );
    }
    println!("{:.1} s", t.elapsed().as_secs_f64());
    if checks.iter().all(|c| c.invariant()) {
        println!("PASS");
        Ok(())
    } else {
        Err("batch invariance: a session's logits depend on its cohort".into())
    }
}

/// Runs a `verify` subcommand.
pub fn run(c: VerifyCommand) -> crate::result::CliResult {
    match c {
        VerifyCommand::TinyA(a) => verify_cmd(a),
        VerifyCommand::PlifScan(a) => verify_scan_cmd(a),
        VerifyCommand::BatchInvariance(a) => verify_batch_cmd(a),
    }
}
