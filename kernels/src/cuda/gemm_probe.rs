//! The probes behind a batch-invariant decoding GEMM's pick ([`crate::cuda::gemm_invariant`]):
//! every candidate kernel run on scratch operands of random values at the probe row counts,
//! timed ([`time_candidates`]) and its output's bits read back ([`signatures`]).
//!
//! A candidate's **signature** is a digest of what it writes for sampled rows of the largest
//! probe: its first 64 rows, and the first 8 and the last 8 rows of every checked row count (at
//! the 0.9B's merged block input, 100 rows of 57 KB). The candidate is kept only
//! where the same rows come out bit for bit the same when it runs the smaller row counts (the
//! probes and three odd counts between them, the passes of 3, 17 and 100 sessions): its results
//! do not depend on the cohort. Two candidates with equal signatures sum every dot product in
//! the same order (on random operands a different order changes some of the sampled values
//! almost surely), so a problem may run either of them at any row count and give the same bits.

use crate::cuda::gemm_lt::{PlanKey, reference_key, workspace_bytes};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::result as drv;
use std::ffi::c_void;

/// The layouts of `B`, `D` (and `C`) of `key`'s problem at `rows` rows (`A`, the weight, does
/// not depend on them); destroyed on drop.
pub(crate) struct Layouts {
    /// The row count they lay out.
    pub(crate) rows: u64,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    c: Option<sys::cublasLtMatrixLayout_t>,
}

impl Layouts {
    pub(crate) fn new(key: &PlanKey, rows: u64) -> Layouts {
        let make = |t, r: u64, c: u64, ld: i64| {
            lt::create_matrix_layout(t, r, c, ld)
                .unwrap_or_else(|e| panic!("cuBLASLt reference layout: {e:?}"))
        };
        // The problem at `rows`, as a plan of it would lay out `B`, `D` and `C`.
        let k = reference_key(key, rows);
        let b = make(k.input_type(), k.b.rows, k.b.cols, k.b.ld);
        let d = make(k.output_type(), k.n, k.m, k.n as i64);
        let f32t = sys::cudaDataType_t::CUDA_R_32F;
        let c = k.c_ld.map(|ld| make(f32t, k.n, k.m, ld as i64));
        Layouts { rows, b, d, c }
    }

    /// `[A, B, C, D]` with `a` the weight's layout.
    pub(crate) fn with_a(
        &self,
        a: sys::cublasLtMatrixLayout_t,
    ) -> [sys::cublasLtMatrixLayout_t; 4] {
        [a, self.b, self.c.unwrap_or(self.d), self.d]
    }
}

impl Drop for Layouts {
    fn drop(&mut self) {
        // SAFETY: each layout was created once by `Layouts::new` and is destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            if let Some(c) = self.c {
                let _ = lt::destroy_matrix_layout(c);
            }
        }
    }
}

/// What the probes run on: the calling plan's handle, descriptor and weight layout, the
/// problem, and a stream with its workspace (not being captured).
pub(crate) struct Bench<'a> {
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    key: &'a PlanKey,
    workspace_ptr: u64,
    stream: cudarc::driver::sys::CUstream,
    /// Operands of the largest layout's size, random values.
    scratch: Scratch,
}

/// Microseconds per call of each candidate (rows) at each probe size (columns); `None` where a
/// call failed.
pub(crate) type Times<const P: usize> = Vec<[Option<f32>; P]>;

/// How many row counts a candidate is timed at.
pub(crate) const PROBES: usize = 5;

/// Timed calls per candidate and size.
const PROBE_REPS: usize = 5;

/// Rows sampled at each end of a checked row count.
const SAMPLE_ROWS: u64 = 8;

/// Rows of the largest count read into a signature from its start.
const SIGNATURE_ROWS: u64 = 64;

impl<'a> Bench<'a> {
    /// Scratch operands for `key`'s problem at up to `rows` rows, filled with random values.
    ///
    /// # Safety
    /// Live handle, descriptor and layout; `stream` a live stream of the current context.
    pub(crate) unsafe fn new(
        handle: sys::cublasLtHandle_t,
        desc: sys::cublasLtMatmulDesc_t,
        a: sys::cublasLtMatrixLayout_t,
        key: &'a PlanKey,
        rows: u64,
        (workspace_ptr, stream): (u64, cudarc::driver::sys::CUstream),
    ) -> Result<Bench<'a>, String> {
        let input = key.input_bytes();
        let bytes = [
            key.a.elements() * input,
            reference_key(key, rows).b.elements() * input,
            key.c_ld.map_or(0, |ld| (ld * rows) as usize * 4),
            (key.n * rows) as usize * key.output_bytes(),
        ];
        // Inputs in their type, the addend in f32; the output is overwritten.
        let widths = [input, input, 4, 0];
        let scratch = Scratch::new(bytes, widths)?;
        Ok(Bench {
            handle,
            desc,
            a,
            key,
            workspace_ptr,
            stream,
            scratch,
        })
    }

    /// Enqueues `algo` on the problem at `l`'s row count.
    fn call(&self, l: &Layouts, algo: &sys::cublasLtMatmulAlgo_t) -> Result<(), lt::CublasError> {
        let [la, lb, lc, ld] = l.with_a(self.a);
        let p = self.scratch.ptr;
        let (c, beta) = if l.c.is_some() {
            (p[2], 1.0f32)
        } else {
            (p[3], 0.0f32)
        };
        // SAFETY: the scratch buffers hold the largest size; handle, descriptor and layouts
        // live (the caller's of `new`).
        unsafe {
            lt::matmul(
                self.handle,
                self.desc,
                &1.0f32 as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                p[0] as *const c_void,
                la,
                p[1] as *const c_void,
                lb,
                c as *const c_void,
                lc,
                p[3] as *mut c_void,
                ld,
                algo,
                self.workspace_ptr as *mut c_void,
                workspace_bytes(),
                self.stream as sys::cudaStream_t,
            )
        }
    }

    /// Times every candidate at each of `layouts`' row counts.
    pub(crate) fn time_candidates<const P: usize>(
        &self,
        layouts: &[&Layouts; P],
        candidates: &[sys::cublasLtMatmulAlgo_t],
    ) -> Result<Times<P>, String> {
        let err = |e: cudarc::driver::DriverError| format!("{e:?}");
        let mut times = Vec::with_capacity(candidates.len());
        for algo in candidates {
            let mut row = [None; P];
            for (i, l) in layouts.iter().enumerate() {
                // SAFETY: the stream as `new`'s, not captured (checked by the pick).
                row[i] = unsafe {
                    crate::cuda::gemm_lt::time_calls(self.stream, PROBE_REPS, || self.call(l, algo))
                }
                .map_err(err)?
                .map(|ms| ms * 1000.0);
            }
            times.push(row);
        }
        Ok(times)
    }

    /// Each candidate's signature (the module's text), or `None` where it fails at some row
    /// count or a smaller count's sampled rows differ from the largest's. `layouts` are the
    /// checked row counts, the largest last.
    pub(crate) fn signatures(
        &self,
        layouts: &[Layouts],
        candidates: &[sys::cublasLtMatmulAlgo_t],
    ) -> Result<Vec<Option<u64>>, String> {
        let (full, smaller) = layouts.split_last().ok_or("no layouts")?;
        // The first rows of the largest count too: a bf16 output hides most differences in the
        // f32 sums (a value changes only where it sits at a rounding boundary), so classes are
        // told apart on many rows.
        let ranges = merged(
            std::iter::once((0, full.rows.min(SIGNATURE_ROWS)))
                .chain(layouts.iter().flat_map(|l| sampled(l.rows)))
                .collect(),
        );
        let row = self.row_bytes();
        let mut out = Vec::with_capacity(candidates.len());
        for algo in candidates {
            let Some(reference) = self.run_and_read(full, algo, &ranges)? else {
                out.push(None);
                continue;
            };
            let mut invariant = true;
            for l in smaller {
                let own = sampled(l.rows);
                let got = self.run_and_read(l, algo, &own)?;
                invariant = got.is_some_and(|got| {
                    own.iter().all(|&r| {
                        rows_in(&own, &got, r, row) == rows_in(&ranges, &reference, r, row)
                    })
                });
                if !invariant {
                    break;
                }
            }
            out.push(invariant.then(|| digest(&reference)));
        }
        Ok(out)
    }

    /// Bytes of one row of `D`.
    fn row_bytes(&self) -> usize {
        self.key.n as usize * self.key.output_bytes()
    }

    /// Runs `algo` at `l`'s row count and reads `D`'s rows in `ranges` (`[start, end)`), in
    /// order; `None` where the call fails.
    fn run_and_read(
        &self,
        l: &Layouts,
        algo: &sys::cublasLtMatmulAlgo_t,
        ranges: &[(u64, u64)],
    ) -> Result<Option<Vec<u8>>, String> {
        let err = |e: cudarc::driver::DriverError| format!("{e:?}");
        if self.call(l, algo).is_err() {
            // SAFETY: a live stream; drained before the next candidate.
            unsafe { drv::stream::synchronize(self.stream) }.map_err(err)?;
            return Ok(None);
        }
        // SAFETY: as above; after it the output is written.
        unsafe { drv::stream::synchronize(self.stream) }.map_err(err)?;
        let row = self.row_bytes();
        let total: u64 = ranges.iter().map(|r| r.1 - r.0).sum();
        let mut bytes = vec![0u8; total as usize * row];
        let mut at = 0usize;
        for &(start, end) in ranges {
            let len = (end - start) as usize * row;
            let from = self.scratch.ptr[3] + start * row as u64;
            // SAFETY: rows below the largest size, inside the output buffer.
            unsafe { drv::memcpy_dtoh_sync(&mut bytes[at..at + len], from) }.map_err(err)?;
            at += len;
        }
        Ok(Some(bytes))
    }
}

/// `ranges` sorted, overlapping and touching ones joined.
fn merged(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.0 <= last.1 => last.1 = last.1.max(r.1),
            _ => out.push(r),
        }
    }
    out
}

/// The bytes of rows `want` in `bytes`, which holds the disjoint sorted `ranges` back to back;
/// `None` unless one range holds all of them.
fn rows_in<'b>(
    ranges: &[(u64, u64)],
    bytes: &'b [u8],
    want: (u64, u64),
    row: usize,
) -> Option<&'b [u8]> {
    let mut at = 0usize;
    for &r in ranges {
        if r.0 <= want.0 && want.1 <= r.1 {
            let start = at + (want.0 - r.0) as usize * row;
            return bytes.get(start..start + (want.1 - want.0) as usize * row);
        }
        at += (r.1 - r.0) as usize * row;
    }
    None
}

/// A 64-bit digest of `bytes` (SplitMix64's finalizer over each 8-byte word, chained): equal
/// signatures, equal digests; different ones collide with a chance of about 2⁻⁶⁴.
fn digest(bytes: &[u8]) -> u64 {
    let mut h = mix(bytes.len() as u64);
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = mix(h ^ u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    let mut tail = [0u8; 8];
    tail[..words.remainder().len()].copy_from_slice(words.remainder());
    mix(h ^ u64::from_le_bytes(tail).rotate_left(7))
}

/// The rows sampled at `rows`: the first and the last [`SAMPLE_ROWS`] (one range when they
/// overlap).
fn sampled(rows: u64) -> Vec<(u64, u64)> {
    let n = SAMPLE_ROWS.min(rows);
    if rows <= 2 * n {
        vec![(0, rows)]
    } else {
        vec![(0, n), (rows - n, rows)]
    }
}

/// Device buffers for the probes, freed on drop.
struct Scratch {
    ptr: [u64; 4],
}

impl Scratch {
    /// Buffers of `bytes`; those with a `width` of 2 (bf16) or 4 (f32) hold random values in
    /// [−1, 1), the others are left unset (outputs).
    fn new(bytes: [usize; 4], widths: [usize; 4]) -> Result<Scratch, String> {
        let mut s = Scratch { ptr: [0; 4] };
        for (i, n) in bytes.into_iter().enumerate() {
            if n == 0 {
                continue;
            }
            // SAFETY: a fresh allocation of `n` bytes, filled before any read (outputs are
            // written by the GEMM before they are read back).
            unsafe {
                let p = drv::malloc_sync(n).map_err(|e| format!("scratch of {n} bytes: {e:?}"))?;
                s.ptr[i] = p;
                if widths[i] != 0 {
                    let values = random_bytes(n, widths[i], i as u64 + 1);
                    drv::memcpy_htod_sync(p, &values).map_err(|e| format!("{e:?}"))?;
                }
            }
        }
        Ok(s)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for p in self.ptr {
            if p != 0 {
                // SAFETY: allocated by `Scratch::new`, freed once, after the probes waited for
                // the calls that used it (on their error paths the stream may still hold some:
                // `cuMemFree` of device memory synchronises the device in practice, which is not
                // a documented guarantee).
                let _ = unsafe { drv::free_sync(p) };
            }
        }
    }
}

/// SplitMix64's output function.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `n` bytes of values uniform in [−1, 1), as f32 (`width` 4) or bf16 (2, the f32's upper
/// half), from a SplitMix64 stream seeded by `seed`.
pub(crate) fn random_bytes(n: usize, width: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let z = mix(state);
        for half in [z as u32, (z >> 32) as u32] {
            // 24 random bits → [−1, 1).
            let x = (half >> 8) as f32 / (1u32 << 23) as f32 - 1.0;
            let b = x.to_le_bytes();
            out.extend_from_slice(if width == 2 { &b[2..] } else { &b });
        }
    }
    out.truncate(n);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampled_rows_are_both_ends_or_all() {
        assert_eq!(sampled(1), vec![(0, 1)]);
        assert_eq!(sampled(16), vec![(0, 16)]);
        assert_eq!(sampled(48), vec![(0, 8), (40, 48)]);
        assert_eq!(sampled(4096), vec![(0, 8), (4088, 4096)]);
    }

    #[test]
    fn ranges_are_joined_and_rows_found_inside_them() {
        let r = merged(vec![(40, 48), (0, 64), (0, 8), (4088, 4096), (64, 72)]);
        assert_eq!(r, vec![(0, 72), (4088, 4096)]);
        let bytes: Vec<u8> = (0u8..80).collect();
        assert_eq!(rows_in(&r, &bytes, (40, 48), 1), Some(&bytes[40..48]));
        assert_eq!(rows_in(&r, &bytes, (4088, 4096), 1), Some(&bytes[72..80]));
        assert_eq!(rows_in(&r, &bytes, (70, 80), 1), None);
        // Rows of two bytes each.
        let two: Vec<u8> = (0u8..160).collect();
        assert_eq!(rows_in(&r, &two, (4090, 4092), 2), Some(&two[148..152]));
    }

    #[test]
    fn digests_tell_one_changed_bit_apart() {
        let a: Vec<u8> = (0..1001u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut b = a.clone();
        assert_eq!(digest(&a), digest(&b));
        b[1000] ^= 1;
        assert_ne!(digest(&a), digest(&b));
        b[1000] ^= 1;
        b[3] ^= 0x80;
        assert_ne!(digest(&a), digest(&b));
        assert_ne!(digest(&a[..1000]), digest(&a));
    }

    #[test]
    fn random_values_are_finite_and_in_range() {
        let f = random_bytes(4000, 4, 1);
        let v: Vec<f32> = f
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        assert!(v.iter().any(|x| *x < -0.5) && v.iter().any(|x| *x > 0.5));
        let h = random_bytes(4001, 2, 1);
        assert_eq!(h.len(), 4001);
        for c in h.chunks_exact(2) {
            let x = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            assert!(x.is_finite() && (-1.0..1.0).contains(&x));
        }
        assert_ne!(random_bytes(64, 4, 1), random_bytes(64, 4, 2));
    }
}
