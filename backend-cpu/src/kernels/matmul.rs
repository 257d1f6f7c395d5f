//! `out = x W^T` for activations `x` `[n, k]` (f32) and a weight `W` `[m, k]` stored as f32,
//! bf16 or f16, accumulating in f32.
//!
//! Work is split over weight-row chunks across the thread pool.
//! - Decode and small batches (n < 16) run a GEMV that streams the weights once per 4 tokens
//!   ([`avx2::gemv`], [`avx2::gemv_multi`]), except where the next item takes them.
//! - Prefill (n >= 16) packs 16 weight rows at a time into an f32 panel `[k][16]` (converting
//!   bf16/f16 once per panel) and runs a broadcast outer-product micro-kernel over 6 (AVX2) or
//!   12 (AVX-512) tokens x 16 rows ([`avx2::panel_kernel`]) for every token.
//! - On CPUs with AVX512_BF16, bf16 weights times bf16-valued activations of a few tokens run
//!   `vdpbf16ps` dot products on the weights in place ([`super::avx512bf16`], see
//!   [`bf16_dot_takes`]; one token included); from 16 tokens, a `vdpbf16ps` prefill on transposed activations
//!   ([`bf16_prefill_takes`]).
//! - At the `Avx512` level on Intel cores, bf16 weights times 2-15 tokens run an f32 FMA kernel
//!   on weights widened in registers ([`super::batch_fma512`], [`fma512_batch_takes`]).
//! - At the `Avx512` level on Intel cores, whose `vdpbf16ps` issues at a quarter of the FMA
//!   rate, prefill (n >= 16) of every weight dtype and rounding runs an f32 FMA kernel on
//!   transposed activations and L2-sized bands of weights instead of both of the above
//!   ([`super::prefill_fma512`], [`fma512_prefill_takes`]).
//! - With AMX ([`Simd::Amx`]), bf16 weights times bf16-valued activations (`round` = bf16) of at
//!   least [`AMX_MIN_TOKENS`] tokens (one) run on AMX tiles ([`super::amx`]): from DRAM its
//!   16-row x 16-token kernel streams weights faster than the GEMVs at any batch size.
//! - The portable path computes plain dot products.

use rayon::prelude::*;
use spark_core::DType;

#[cfg(target_arch = "x86_64")]
use super::avx2::{self, Bf16, Elem, F16, PANEL};
use super::{dot, Row, SharedOut, Simd};

/// A weight matrix viewed as rows.
#[derive(Clone, Copy)]
pub enum Mat<'a> {
    F32(&'a [f32]),
    BF16(&'a [u16]),
    F16(&'a [u16]),
}

impl<'a> Mat<'a> {
    #[inline]
    pub fn row(&self, r: usize, k: usize) -> Row<'a> {
        match *self {
            Mat::F32(d) => Row::F32(&d[r * k..(r + 1) * k]),
            Mat::BF16(d) => Row::BF16(&d[r * k..(r + 1) * k]),
            Mat::F16(d) => Row::F16(&d[r * k..(r + 1) * k]),
        }
    }
}

/// Whether a bf16 matmul of `n` tokens with bf16 activations runs `vdpbf16ps` dot products
/// ([`super::avx512bf16`], on CPUs with AVX512_BF16): 1-15 tokens at the `Avx512` level, where it
/// beat the AVX2 multi-token GEMV by 25-35 % at 4 and 8 tokens, and at one token (a row at a
/// time) the AVX2 GEMV's four rows by 10-15 % on one thread of a Zen 4 (docs/BENCHMARKS.md,
/// session 44). With AMX, never: the 16-row tile kernel ([`super::amx`]) beat it by 6 % at 2
/// tokens and 24 % at 4 (whole-model decode, 2 threads, Sapphire Rapids, 3 alternations).
pub fn bf16_dot_takes(simd: Simd, n: usize) -> bool {
    match simd {
        Simd::Avx512 => (1..SMALL_BATCH).contains(&n),
        _ => false,
    }
}
/// Whether a bf16 matmul of `n` tokens with bf16 activations runs the `vdpbf16ps` prefill
/// ([`super::avx512bf16::prefill`], on CPUs with AVX512_BF16): from 16 tokens at the `Avx512`
/// level, in place of the f32 panels (twice the multiply-adds per instruction). With AMX the
/// tiles take it.
pub fn bf16_prefill_takes(simd: Simd, n: usize) -> bool {
    simd == Simd::Avx512 && n >= SMALL_BATCH
}
/// Whether a float matmul (bf16, f16 or f32 weights, any output rounding) of `n` tokens runs the
/// f32 FMA prefill ([`super::prefill_fma512`]): from 16 tokens at the `Avx512` level on Intel
/// cores ([`vdpbf16ps_is_slow`]; also those without AVX512_BF16, where it replaces the f32
/// panels). On one thread of an Emerald Rapids core it ran at 62-70 GMAC/s where the
/// `vdpbf16ps` prefill ran at 40-41 and the f32 panels ([`avx2::panel_kernel`]) at 38-55
/// (docs/BENCHMARKS.md, session 47).
pub fn fma512_prefill_takes(simd: Simd, n: usize) -> bool {
    simd == Simd::Avx512 && n >= SMALL_BATCH && vdpbf16ps_is_slow()
}
/// Whether a bf16 matmul of `n` tokens runs the AVX-512 f32 FMA kernel for a few tokens
/// ([`super::batch_fma512`]): 2-15 tokens at the `Avx512` level on Intel cores
/// ([`vdpbf16ps_is_slow`]), in place of the `vdpbf16ps` tiles ([`bf16_dot_takes`]): whole-model
/// bf16 decode on an Emerald Rapids guest, two threads, `--batch 4` +11 %, `--batch 8` level
/// (docs/BENCHMARKS.md, session 49).
pub fn fma512_batch_takes(simd: Simd, n: usize) -> bool {
    simd == Simd::Avx512 && (2..SMALL_BATCH).contains(&n) && vdpbf16ps_is_slow()
}
/// Whether this CPU's `vdpbf16ps` is slower, per multiply-add, than f32 FMAs: Intel cores (the
/// `GenuineIntel` vendor string). Measured on an Emerald Rapids core: `vdpbf16ps zmm` 1.31-1.35
/// G/s against `vfmadd231ps zmm` 5.3-5.4 G/s, 16 multiply-adds per cycle against 32; with AMX
/// (Sapphire Rapids and later, where exposed) the tiles take bf16 matmuls instead. AMD's Zen 4
/// and Zen 5 issue it as fast as an FMA. `SPARK_BF16_DOT=vdpbf16ps` or `=fma` overrides the
/// vendor rule (to compare the two paths on one machine).
pub fn vdpbf16ps_is_slow() -> bool {
    static SLOW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SLOW.get_or_init(|| match std::env::var("SPARK_BF16_DOT").as_deref() {
        Ok("fma") => true,
        Ok("vdpbf16ps") => false,
        _ => cpu_vendor_is_intel(),
    })
}
/// Whether CPUID leaf 0 names the vendor `GenuineIntel`.
pub(crate) fn cpu_vendor_is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 0 exists on every x86-64 processor.
        #[allow(unused_unsafe)]
        let r = unsafe { std::arch::x86_64::__cpuid(0) };
        let mut vendor = [0u8; 12];
        vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
        &vendor == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}
/// Whether an int8/int4 matmul of `n` tokens with bf16 activations runs the `vdpbf16ps` prefill
/// on weights dequantized to bf16 ([`super::avx512bf16::prefill`]) at the `Avx512` level (CPUs
/// with AVX512_BF16, no AMX) instead of the W8A8 / W4A8 VNNI kernels, where the VNNI prefill
/// ([`super::qprefill_vnni`], about twice the multiply-adds per instruction; checked first by
/// [`super::qmatmul::quant_matmul`]) does not take the weights (16-column groups): from 32 tokens for int4,
/// 64 for int8, where it overtook them (whole-model prefill, 1.7B shape, 2 threads, Zen 5, 2
/// alternations: int4 pp32 81-84 against 73-75 tok/s, pp24 76-88 against 56-81 the other way;
/// int8 pp64 99-133 against 103, pp32 87-91 against 100-112 the other way).
pub fn avx512_quant_prefill_takes(simd: Simd, format: spark_core::quant::QFormat, n: usize) -> bool {
    use spark_core::quant::QFormat;
    simd == Simd::Avx512
        && match format {
            QFormat::I4 | QFormat::I6 => n >= 32,
            QFormat::I8 => n >= 64,
        }
}
/// From this many tokens, bf16 matmuls with bf16 activations run on AMX tiles when present: from
/// one, since the 16-row tile kernel streams the weights faster than the AVX-512 GEMV even for a
/// single token (batch-1 decode 6.76 -> 7.86 tok/s, medians of 3 alternations, 1.7B shape, 2
/// threads). Products of bf16 values are exact in f32 on both paths; the sums differ in order,
/// and the tiles read bf16 inputs below 2^-126 as zero.
pub const AMX_MIN_TOKENS: usize = 1;
/// From this many tokens, int8/int4 matmuls with bf16 activations that AMX INT8 does not take
/// run on AMX BF16 tiles (weights dequantized to bf16 as they are packed) instead of the
/// W8A8 / W4A8 integer kernels ([`super::qmatmul::quant_matmul`] decides).
pub const AMX_QUANT_MIN_TOKENS: usize = 32;
/// Below this many tokens, matmuls run as a multi-token GEMV (no panel packing).
const SMALL_BATCH: usize = 16;
/// Tokens per AVX2 micro-kernel call.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const MR: usize = 6;
/// Tokens per AVX-512 micro-kernel call.
#[cfg(target_arch = "x86_64")]
const MR_512: usize = super::avx512::MR;
/// Other architectures never take the AVX-512 panels.
#[cfg(not(target_arch = "x86_64"))]
#[allow(dead_code)]
const MR_512: usize = MR;

/// Fewest tokens [`quant_panels`] was dispatched for on CPUs whose integer level is AVX2 (no
/// VNNI, no AMX). No longer dispatched: from [`super::qprefill_avx2::MIN_TOKENS`] tokens every
/// quantized matrix takes integer panels at that level ([`super::qprefill_avx2`] for int4 with
/// sub-scales, [`super::qpanels16_avx2`] for int8, [`super::qpanels_avx2`] for the rest), which beat these f32 panels in whole-model
/// prefill (2-vCPU Zen 3, int8 pp512: 64 against 55 tok/s). The f32 panels stay as the prefill
/// with unquantized activations that the tests and the kernel bench compare against.
pub const AVX2_QUANT_PANEL_MIN_TOKENS: usize = 32;

/// `out = x W^T` for a quantized `w` through the float prefill: each panel of 16 rows
/// dequantized to f32 exactly (`QMat::dequant_f32`: the same values as
/// `QTensor::dequantize`), the activations unquantized. So the only differences from an exact
/// product are f32 summation (no activation quantization error at all).
///
/// The micro-kernel is `simd`'s (AVX2, or AVX-512 from [`Simd::Avx512`]).
///
/// # Panics
/// If `simd` or this CPU is below [`Simd::Avx2`].
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn quant_panels(
    simd: Simd,
    x: &[f32],
    n: usize,
    k: usize,
    w: &super::qmatmul::QMat,
    out: &mut [f32],
    round: DType,
) {
    let m = w.rows;
    assert_eq!(x.len(), n * k, "quant_panels: x has the wrong size");
    assert_eq!(out.len(), n * m, "quant_panels: out has the wrong size");
    assert_eq!(k, w.cols, "quant_panels: columns");
    let simd = simd.min(Simd::detect());
    assert!(simd >= Simd::Avx2, "quant_panels: needs AVX2");
    #[cfg(target_arch = "x86_64")]
    {
        let chunk = super::row_chunk(m, PANEL);
        let outp = SharedOut(out.as_mut_ptr());
        (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
            let r0 = c * chunk;
            let r1 = (r0 + chunk).min(m);
            // Sixteen dequantized rows, `[16][k]`, then packed as an f32 matrix.
            let mut rows = vec![0.0f32; PANEL * k];
            panel_rows(x, n, k, m, r0, r1, outp, round, simd >= Simd::Avx512, |p0, panel| {
                let nr = PANEL.min(m - p0);
                for (j, row) in rows.chunks_exact_mut(k).enumerate().take(nr) {
                    w.dequant_f32(p0 + j, 0, row);
                }
                // SAFETY: Simd::Avx2 was asserted; the panel holds k * 16; `rows` holds nr rows
                // of k (rows past nr are zeroed by pack_panel).
                unsafe { avx2::pack_panel(&rows, k, nr, 0, panel) };
            });
        });
    }
}

/// `out[t*m + r] = round(sum_j x[t*k + j] * W[r, j])`.
#[allow(clippy::too_many_arguments)]
pub fn matmul(simd: Simd, x: &[f32], n: usize, k: usize, w: Mat<'_>, m: usize, out: &mut [f32], round: DType) {
    assert_eq!(x.len(), n * k, "matmul: x has the wrong size");
    assert_eq!(out.len(), n * m, "matmul: out has the wrong size");
    #[cfg(target_arch = "x86_64")]
    if fma512_prefill_takes(simd, n) {
        // SAFETY: the Avx512 level is only detected with AVX-512F present.
        unsafe { super::prefill_fma512::prefill(x, n, k, w, m, out, round) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Mat::BF16(d) = w {
        if fma512_batch_takes(simd, n) {
            // SAFETY: the Avx512 level is only detected with AVX-512F present.
            unsafe { super::batch_fma512::matmul(x, n, k, d, m, out, round) };
            return;
        }
        if bf16_dot_takes(simd, n) && round == DType::BF16 && super::avx512bf16::available() {
            // SAFETY: available() checked AVX512F/BW/BF16.
            unsafe { super::avx512bf16::matmul(x, n, k, d, m, out, round) };
            return;
        }
        if bf16_prefill_takes(simd, n) && round == DType::BF16 && super::avx512bf16::available() {
            // SAFETY: available() checked AVX512F/BW/BF16.
            unsafe { super::avx512bf16::prefill(x, n, k, super::avx512bf16::PrefillWeights::Bf16(d), m, out, round) };
            return;
        }
        if n >= AMX_MIN_TOKENS && super::amx::eligible(simd, round, k) {
            // SAFETY: eligible() checked amx::available() and supports(k).
            unsafe { super::amx::matmul(x, n, k, super::amx::Weights::Bf16(d), m, out, round) };
            return;
        }
    }
    let chunk = super::row_chunk(m, 16);
    let outp = SharedOut(out.as_mut_ptr());
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let r0 = c * chunk;
        let r1 = (r0 + chunk).min(m);
        #[cfg(target_arch = "x86_64")]
        if simd != Simd::Portable {
            let wide = simd >= Simd::Avx512;
            match w {
                Mat::F32(d) => avx2_rows(x, n, k, d, m, r0, r1, outp, round, wide),
                // SAFETY: Bf16 and F16 are repr(transparent) over u16.
                Mat::BF16(d) => {
                    avx2_rows(x, n, k, unsafe { &*(d as *const [u16] as *const [Bf16]) }, m, r0, r1, outp, round, wide)
                }
                // SAFETY: as above.
                Mat::F16(d) => {
                    avx2_rows(x, n, k, unsafe { &*(d as *const [u16] as *const [F16]) }, m, r0, r1, outp, round, wide)
                }
            }
            return;
        }
        for r in r0..r1 {
            let wr = w.row(r, k);
            for t in 0..n {
                // SAFETY: t < n, r < m; rows [r0, r1) belong to this task only.
                unsafe { outp.put(t * m + r, round.round(dot(simd, &x[t * k..(t + 1) * k], wr))) };
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn avx2_rows<E: Elem>(
    x: &[f32],
    n: usize,
    k: usize,
    w: &[E],
    m: usize,
    r0: usize,
    r1: usize,
    outp: SharedOut,
    round: DType,
    avx512: bool,
) {
    if n < SMALL_BATCH {
        // Small batches: multi-token GEMV, weights streamed once per 4 tokens, no packing.
        let mut tmp = vec![vec![0.0f32; r1 - r0]; 4];
        let mut t = 0;
        while t < n {
            let tb = 4.min(n - t);
            let xs = |i: usize| &x[(t + i) * k..(t + i + 1) * k];
            {
                let (a, rest) = tmp.split_at_mut(1);
                let (b, rest) = rest.split_at_mut(1);
                let (c, d) = rest.split_at_mut(1);
                // SAFETY: Simd::Avx2 (or better) was detected; w holds m >= r1 rows of k; every
                // x row has k elements; every tmp row holds r1 - r0.
                unsafe {
                    match tb {
                        4 => avx2::gemv_multi::<E, 4>(
                            [xs(0), xs(1), xs(2), xs(3)],
                            w,
                            k,
                            r0,
                            r1,
                            &mut [&mut a[0], &mut b[0], &mut c[0], &mut d[0]],
                        ),
                        3 => avx2::gemv_multi::<E, 3>(
                            [xs(0), xs(1), xs(2)],
                            w,
                            k,
                            r0,
                            r1,
                            &mut [&mut a[0], &mut b[0], &mut c[0]],
                        ),
                        2 => avx2::gemv_multi::<E, 2>([xs(0), xs(1)], w, k, r0, r1, &mut [&mut a[0], &mut b[0]]),
                        _ => avx2::gemv(xs(0), w, k, r0, r1, &mut a[0]),
                    }
                }
            }
            for (i, row) in tmp.iter().enumerate().take(tb) {
                for (j, &v) in row.iter().enumerate() {
                    // SAFETY: t + i < n, r0 + j < r1 <= m; rows [r0, r1) belong to this task only.
                    unsafe { outp.put((t + i) * m + r0 + j, round.round(v)) };
                }
            }
            t += tb;
        }
        return;
    }
    // SAFETY: Simd::Avx2 was detected; the panel holds k * 16; w holds m * k.
    panel_rows(x, n, k, m, r0, r1, outp, round, avx512, |p0, panel| unsafe { avx2::pack_panel(w, k, m, p0, panel) });
}

/// Prefill over rows `r0..r1` of an `m`-row weight in panels of 16: `pack(p0, panel)` fills the
/// `[k][16]` f32 panel of rows `p0..p0 + 16` (zeros past `m`), then the micro-kernel runs every
/// token over it.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn panel_rows(
    x: &[f32],
    n: usize,
    k: usize,
    m: usize,
    r0: usize,
    r1: usize,
    outp: SharedOut,
    round: DType,
    avx512: bool,
    mut pack: impl FnMut(usize, &mut [f32]),
) {
    let mut panel = vec![0.0f32; k * PANEL];
    let mut acc = [[0.0f32; PANEL]; MR_512];
    for p0 in (r0..r1).step_by(PANEL) {
        pack(p0, &mut panel);
        {
            let (t0, t1) = (0, n);
            let rows = PANEL.min(r1 - p0);
            let mut t = t0;
            let mr = if avx512 { MR_512 } else { MR };
            while t < t1 {
                let tb = mr.min(t1 - t);
                let xp = |i: usize| x[(t + i.min(tb - 1)) * k..].as_ptr();
                let ptrs: [*const f32; MR_512] = std::array::from_fn(xp);
                if avx512 {
                    // SAFETY: Simd::Avx512 was detected; every pointer is the start of a k-long
                    // row of x (rows past tb repeat the last one; their results are discarded).
                    unsafe { super::avx512::panel_kernel::<MR_512>(&ptrs, &panel, k, &mut acc) };
                } else {
                    let (head, _) = acc.split_at_mut(MR);
                    let head: &mut [[f32; PANEL]; MR] = head.try_into().expect("MR rows");
                    let p6: &[*const f32; MR] = ptrs[..MR].try_into().expect("MR pointers");
                    // SAFETY: Simd::Avx2 was detected; pointers as above.
                    unsafe { avx2::panel_kernel::<MR>(p6, &panel, k, head) };
                }
                for (i, a) in acc.iter().enumerate().take(tb) {
                    // SAFETY: t + i < n, p0 + rows <= r1 <= m; rows [r0, r1) belong to this task.
                    unsafe { outp.put_rounded((t + i) * m + p0, &a[..rows], round) };
                }
                t += tb;
            }
        }
    }
}
