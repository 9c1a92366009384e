//! Parity of a backend's PLIF scans with the reference implementation's golden data
//! (`shared/fixtures/plif_scan.safetensors`): both scan variants run forward and backward
//! through [`plif_elem`]/[`plif_row`] under burn's autodiff on the backend given, and every
//! output and gradient is set against the fixture. `nsactor verify plif-scan` runs it inside a
//! backend plugin (so on the GPU for CUDA); the kernels' own tests run it on the CPU.
//!
//! In [`ScanPrecision::Bf16`] the activations are rounded to bf16 where bf16 storage would hold
//! them (the current `u` and the upstream gradient going in, `V_post` and `∂u` coming out); β,
//! V_th, the state and the gradients bound for fp32 parameters or state stay fp32, and the
//! kernel computes in fp32. The fixture stays the fp32 yardstick, so the figures are the whole
//! error bf16 storage costs.

use crate::KernelError;
use crate::ops::scan::{plif_elem, plif_row};
use crate::ops::snn::SnnOps;
use burn::backend::Autodiff;
use burn::tensor::{Tensor, TensorData, backend::Backend};

/// The arithmetic of a parity run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanPrecision {
    /// fp32 everywhere: the fixture README's tolerances (outputs 1e-4 absolute, gradients 1e-4
    /// relative to each tensor's norm, spikes equal).
    F32,
    /// bf16 storage of inputs, outputs and gradients, fp32 arithmetic: 1e-2 relative.
    Bf16,
}

impl ScanPrecision {
    pub fn name(self) -> &'static str {
        match self {
            ScanPrecision::F32 => "fp32",
            ScanPrecision::Bf16 => "bf16 storage",
        }
    }

    /// `x` as this precision stores it.
    fn store(self, x: f32) -> f32 {
        match self {
            ScanPrecision::F32 => x,
            ScanPrecision::Bf16 => round_bf16(x),
        }
    }
}

/// `x` rounded to the nearest bf16 (ties to even), back in an f32; NaN stays NaN.
pub fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    f32::from_bits(bits.wrapping_add(0x7fff + lsb) & 0xffff_0000)
}

/// One compared tensor: its worst absolute difference and `‖got − want‖ / ‖want‖`, over all
/// positions and over the neurons (batch row, channel) none of whose spikes flipped.
///
/// A spike is a step function of `V − V_th`: where rounding moves a membrane across its
/// threshold, the neuron's reset differs by `V_th` and its later steps (and, backwards, its
/// earlier gradients) follow another trajectory. Those neurons are counted in the spike
/// agreement; the bound holds the others (the fixture README: report the agreement rather
/// than loosen every tolerance). In fp32 no spike may flip, so both measures are the same.
#[derive(Debug, Clone)]
pub struct Compared {
    pub name: &'static str,
    pub max_abs: f32,
    pub rel: f32,
    /// The same over the neurons without a flipped spike.
    pub clean_max_abs: f32,
    pub clean_rel: f32,
    /// The bound this tensor is held to, and on which measure.
    pub bound: f32,
    pub on_rel: bool,
}

impl Compared {
    pub fn passed(&self) -> bool {
        let v = if self.on_rel {
            self.clean_rel
        } else {
            self.clean_max_abs
        };
        v <= self.bound
    }
}

/// One scan variant's run against the fixture.
#[derive(Debug, Clone)]
pub struct VariantReport {
    /// `elem` (per-element parameters) or `row` (row parameters).
    pub variant: &'static str,
    pub precision: ScanPrecision,
    pub elements: usize,
    /// Spikes in the fixture, and positions where ours differ.
    pub spikes: usize,
    pub flips: usize,
    /// Neurons (batch row, channel) and those with at least one flipped spike.
    pub neurons: usize,
    pub flipped_neurons: usize,
    pub compared: Vec<Compared>,
}

impl VariantReport {
    /// Fraction of positions whose spike equals the fixture's.
    pub fn spike_agreement(&self) -> f64 {
        1.0 - self.flips as f64 / self.elements.max(1) as f64
    }

    /// Every tensor within its bound; in fp32 also every spike equal (the fixture README asks
    /// for the agreement rate to be reported where a flip happens, and `render` does).
    pub fn passed(&self) -> bool {
        self.compared.iter().all(Compared::passed)
            && (self.precision == ScanPrecision::Bf16 || self.flips == 0)
    }

    /// A few lines for a terminal.
    pub fn render(&self) -> String {
        let mut s = format!(
            "{} scan, {}: spikes {} of {} positions, agreement {:.4}% ({} flipped, in {} of {} neurons)\n",
            self.variant,
            self.precision.name(),
            self.spikes,
            self.elements,
            100.0 * self.spike_agreement(),
            self.flips,
            self.flipped_neurons,
            self.neurons
        );
        let clean = self.flipped_neurons > 0;
        for c in &self.compared {
            s += &format!(
                "  {:<11} max |Δ| {:>9.2e}  ‖Δ‖/‖ref‖ {:>9.2e}",
                c.name, c.max_abs, c.rel
            );
            if clean {
                s += &format!(
                    "  without the flipped neurons: {:>9.2e} {:>9.2e}",
                    c.clean_max_abs, c.clean_rel
                );
            }
            s += &format!(
                "  ≤ {:.0e} ({})  {}\n",
                c.bound,
                if c.on_rel { "relative" } else { "absolute" },
                if c.passed() { "ok" } else { "FAIL" }
            );
        }
        s
    }
}

/// The fixture's tensors, read from its safetensors bytes.
struct Fixture<'a>(safetensors::SafeTensors<'a>);

impl Fixture<'_> {
    fn raw(&self, key: &str) -> Result<(Vec<f32>, Vec<usize>), KernelError> {
        let view = self
            .0
            .tensor(key)
            .map_err(|e| KernelError::Fixture(format!("plif_scan: key `{key}`: {e}")))?;
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(KernelError::Fixture(format!(
                "plif_scan fixture: `{key}` is {:?}, not F32",
                view.dtype()
            )));
        }
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok((values, view.shape().to_vec()))
    }
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

/// `got` against `want`; `flipped[n]` marks neuron `n` (position `i` is neuron
/// `i % flipped.len()`: tensors are `[TK, B, dim]` or `[B, dim]`).
fn compare(
    name: &'static str,
    got: &[f32],
    want: &[f32],
    flipped: &[bool],
    bound: f32,
    on_rel: bool,
) -> Result<Compared, KernelError> {
    if got.len() != want.len() || !want.len().is_multiple_of(flipped.len()) {
        return Err(KernelError::Fixture(format!(
            "{name}: {} values against the fixture's {} ({} neurons)",
            got.len(),
            want.len(),
            flipped.len()
        )));
    }
    // [all, clean]: max |Δ|, Σ Δ², Σ want².
    let mut acc = [(0f32, 0f64, 0f64); 2];
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let d = a - b;
        let parts = if flipped[i % flipped.len()] { 1 } else { 2 };
        for m in &mut acc[..parts] {
            m.0 = m.0.max(d.abs());
            m.1 += f64::from(d) * f64::from(d);
            m.2 += f64::from(*b) * f64::from(*b);
        }
    }
    let rel = |m: (f32, f64, f64)| (m.1.sqrt() / m.2.sqrt().max(1e-30)) as f32;
    Ok(Compared {
        name,
        max_abs: acc[0].0,
        rel: rel(acc[0]),
        clean_max_abs: acc[1].0,
        clean_rel: rel(acc[1]),
        bound,
        on_rel,
    })
}

/// Runs `variant` (`elem` or `row`) of the fixture in `bytes` on `device`.
pub fn plif_fixture<B: SnnOps>(
    device: &B::Device,
    bytes: &[u8],
    variant: &'static str,
    precision: ScanPrecision,
) -> Result<VariantReport, KernelError> {
    type Ad<B> = Autodiff<B>;
    if !["elem", "row"].contains(&variant) {
        return Err(KernelError::Misuse(format!(
            "unknown scan variant `{variant}` (elem, row)"
        )));
    }
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| KernelError::Fixture(format!("plif_scan is not valid safetensors: {e}")))?;
    let fx = Fixture(st);
    let key = |k: &str| format!("{variant}.{k}");
    // What bf16 storage rounds: the activations (the current `u`, the upstream gradient, and
    // below `V_post` and `∂u`). β and V_th stay fp32 (row parameters are fp32 master weights;
    // per-element ones are computed in the kernel from the projections, never stored), and so
    // do the state `v0` and the gradients that go to fp32 parameters or state.
    let stored = |k: &str, v: Vec<f32>| -> Vec<f32> {
        if matches!(k, "u" | "grad_vpost" | "vpost" | "grad_u") {
            v.into_iter().map(|x| precision.store(x)).collect()
        } else {
            v
        }
    };
    let input = |k: &str| -> Result<TensorData, KernelError> {
        let (v, shape) = fx.raw(&key(k))?;
        Ok(TensorData::new(stored(k, v), shape))
    };
    let leaf3 = |k: &str| -> Result<Tensor<Ad<B>, 3>, KernelError> {
        Ok(Tensor::from_data(input(k)?, device).require_grad())
    };
    let leaf2 = |k: &str| -> Result<Tensor<Ad<B>, 2>, KernelError> {
        Ok(Tensor::from_data(input(k)?, device).require_grad())
    };
    let u = leaf3("u")?;
    let v0 = leaf2("v0")?;
    let grad_vpost: Tensor<Ad<B>, 3> = Tensor::from_data(input("grad_vpost")?, device);
    let (spike, vpost, grads, gb, gt) = match variant {
        "elem" => {
            let (beta, vth) = (leaf3("beta")?, leaf3("vth")?);
            let (spike, vpost) = plif_elem(beta.clone(), u.clone(), vth.clone(), v0.clone());
            let grads = (vpost.clone() * grad_vpost).sum().backward();
            let gb = beta.grad(&grads).map(values);
            let gt = vth.grad(&grads).map(values);
            (spike, vpost, grads, gb, gt)
        }
        "row" => {
            let (beta, vth) = (leaf2("beta")?, leaf2("vth")?);
            let (spike, vpost) = plif_row(beta.clone(), u.clone(), vth.clone(), v0.clone());
            let grads = (vpost.clone() * grad_vpost).sum().backward();
            let gb = beta.grad(&grads).map(values);
            let gt = vth.grad(&grads).map(values);
            (spike, vpost, grads, gb, gt)
        }
        other => {
            return Err(KernelError::Misuse(format!(
                "unknown scan variant `{other}` (elem, row)"
            )));
        }
    };
    let missing = |n: &str| KernelError::Mismatch {
        report: format!("{variant}: no gradient reached {n}"),
    };
    let want_spike = fx.raw(&key("spike"))?.0;
    let got_spike = values(spike);
    if got_spike.len() != want_spike.len() {
        return Err(KernelError::Fixture(format!(
            "{variant}: {} spikes against the fixture's {}",
            got_spike.len(),
            want_spike.len()
        )));
    }
    let neurons = v0.dims().iter().product::<usize>();
    let mut flipped = vec![false; neurons];
    let mut flips = 0;
    for (i, (a, b)) in got_spike.iter().zip(&want_spike).enumerate() {
        if a != b {
            flips += 1;
            flipped[i % neurons] = true;
        }
    }
    let (out_bound, out_rel, grad_bound) = match precision {
        ScanPrecision::F32 => (1e-4, false, 1e-4),
        ScanPrecision::Bf16 => (1e-2, true, 1e-2),
    };
    let mut compared = vec![compare(
        "V_post",
        &stored("vpost", values(vpost)),
        &fx.raw(&key("vpost"))?.0,
        &flipped,
        out_bound,
        out_rel,
    )?];
    let grads = [
        ("grad_beta", gb.ok_or_else(|| missing("beta"))?),
        (
            "grad_u",
            u.grad(&grads).map(values).ok_or_else(|| missing("u"))?,
        ),
        ("grad_vth", gt.ok_or_else(|| missing("vth"))?),
        (
            "grad_v0",
            v0.grad(&grads).map(values).ok_or_else(|| missing("v0"))?,
        ),
    ];
    for (name, got) in grads {
        compared.push(compare(
            name,
            &stored(name, got),
            &fx.raw(&key(name))?.0,
            &flipped,
            grad_bound,
            true,
        )?);
    }
    Ok(VariantReport {
        variant,
        precision,
        elements: want_spike.len(),
        spikes: want_spike.iter().filter(|&&s| s != 0.0).count(),
        flips,
        neurons,
        flipped_neurons: flipped.iter().filter(|&&f| f).count(),
        compared,
    })
}

/// Both variants in both precisions, as `nsactor verify plif-scan` prints them.
pub fn plif_fixture_all<B: SnnOps>(
    device: &B::Device,
    bytes: &[u8],
    precisions: &[ScanPrecision],
) -> Result<Vec<VariantReport>, KernelError> {
    let mut out = Vec::new();
    for &p in precisions {
        for variant in ["elem", "row"] {
            out.push(plif_fixture::<B>(device, bytes, variant, p)?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::round_bf16;

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        assert_eq!(round_bf16(1.0), 1.0);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert_eq!(round_bf16(1.0 + 1.0 / 128.0 + 1e-4), 1.0 + 1.0 / 128.0);
        assert_eq!(round_bf16(-2.5), -2.5);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
    }
}
