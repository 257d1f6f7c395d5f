//! AVX2 int8 prefill on panels of 16-bit weights times 16-bit activations (`vpmaddwd`), for
//! int8 per row or in groups (`spark-run quantize --to int8`, GGUF Q8_0, the int8 forms of
//! other K-quants).
//!
//! Each panel of 8 weight rows is unpacked once per call into 16-bit values, `[kp / 2][8
//! rows][2 columns]`: one vector per 2 columns. Per 2 columns the micro-kernel loads it once
//! and, for each of up to 6 tokens, broadcasts the token's two 16-bit activations, issues one
//! `vpmaddwd` (8 rows x 2 columns into 8 i32 lanes) and one `vpaddd`: 16 multiply-adds per
//! multiply-port operation, as many as int8 got from the two nibble planes it ran on before
//! (`vpmaddubsw` on `u = q + 128 = 16 h + l`, whose 16-bit sums had to go to i32 every 32
//! columns). The i32 sums here go to f32 (one conversion and one FMA per token) only where a
//! scale changes: every [`SPAN`] columns for per-row weight scales, every group otherwise.
//!
//! Measured (session 28, one Zen 3 core, 512 tokens, on-CPU time, `bench_kernels`), GMAC/s of
//! these panels against the two nibble planes: int8 per row 2048x2048 53.7 / 52.0-53.7,
//! 1024x2048 49.7-51.6 / 49.7, 6656x2048 54.5-56.3 / 51.3-52.9, 2048x6656 48.5-54.6 /
//! 43.6-54.5; groups of 32 (Q8_0) level; groups of 16 5-8 % faster. Int6 and int4 (one byte
//! plane, one `vpmaddubsw` per 32 multiply-adds) ran 38.8-49.9 here against 62.3-74.2 on
//! [`super::qpanels_avx2`]'s byte panels, where they stay.
//!
//! Precision: the activations are 16-bit with one scale per [`SPAN`] columns (`max |x| /
//! 32767`, rounded half to even), finer than the int8 activations with one scale per 32
//! columns that decode and the byte panels use (demo checkpoint, int8, 64-token prompt: logit
//! SNR 42.9 dB and 63 of 64 greedy tokens against 40.0 dB and 62 on the nibble planes; the f32
//! panels on unquantized activations gave 42.9 and 63); the integer sums are exact (a span's
//! sum is at most 256 x 128 x 32767 < 2^31), each rounded to f32 once; then f32 accumulation.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use rayon::prelude::*;
use spark_core::quant::QFormat;
use spark_core::DType;

use super::qmatmul::QMat;
use super::qpanels_avx2::Panel;
use super::qprefill_avx2::{MR, ROWS};

/// Columns sharing one activation scale (and, with per-row weight scales, one i32 sum): the
/// most for which a sum of products of 8-bit weights and 16-bit activations stays inside i32.
pub const SPAN: usize = 256;
/// Largest activation magnitude (never -32768, so a `vpmaddwd` pair cannot overflow).
const QMAX: f32 = 32767.0;

/// The activations as [`matmul`] (and the VNNI W8A16 decode GEMV,
/// [`super::qdecode16`]) read them.
pub(crate) struct Act16 {
    /// `[n][kp]`, zero past the `k` real columns.
    pub(crate) q: Vec<i16>,
    /// `[n][nspan]` scales.
    pub(crate) d: Vec<f32>,
    /// `[n][ng]` sums of each weight group's columns (empty without weight biases).
    pub(crate) a: Vec<f32>,
    pub(crate) nspan: usize,
}

impl Act16 {
    /// Quantize `x` (`[n, k]`) for `w`: 16-bit values with one scale per [`SPAN`] columns,
    /// tokens in parallel on the current rayon pool. Needs AVX2.
    pub(crate) fn quantize(x: &[f32], n: usize, k: usize, w: &QMat) -> Act16 {
        let kp = w.kp;
        let nspan = kp.div_ceil(SPAN);
        let sums = w.bias().is_some();
        let ng = if sums { w.ng } else { 0 };
        let mut act = Act16 { q: vec![0; n * kp], d: vec![0.0; n * nspan], a: vec![0.0; n * ng], nspan };
        let (q, d) = (act.q.par_chunks_mut(kp), act.d.par_chunks_mut(nspan));
        let a = act.a.par_chunks_mut(ng.max(1));
        let xs = x.par_chunks(k);
        let per_token = |((xt, qt), dt): ((&[f32], &mut [i16]), &mut [f32])| {
            for (s, ds) in dt.iter_mut().enumerate() {
                let (c0, c1) = (s * SPAN, ((s + 1) * SPAN).min(k));
                if c0 >= k {
                    break;
                }
                let span = &xt[c0..c1];
                // One pass for the largest magnitude and for NaN (which `max` passes over).
                let (amax, nan) = span.iter().fold((0.0f32, false), |(m, nan), v| (m.max(v.abs()), nan | v.is_nan()));
                if !amax.is_finite() || nan {
                    // A non-finite value makes the span's outputs NaN, as the float kernels'.
                    *ds = f32::NAN;
                    continue;
                }
                if amax == 0.0 {
                    continue;
                }
                *ds = amax / QMAX;
                // SAFETY: AVX2 (the caller's level); both slices hold c1 - c0 values from c0.
                unsafe { round16(&xt[c0..c1], QMAX / amax, &mut qt[c0..c1]) };
            }
        };
        if ng == 0 {
            xs.zip(q).zip(d).for_each(per_token);
        } else {
            let group = w.group;
            xs.zip(q).zip(d).zip(a).for_each(|(((xt, qt), dt), at)| {
                per_token(((xt, qt), dt));
                for (g, ag) in at.iter_mut().enumerate() {
                    *ag = xt[g * group..((g + 1) * group).min(k)].iter().sum();
                }
            });
        }
        act
    }
}

/// `out[i] = round_half_even(x[i] * inv)` as i16 (`|x[i] * inv| <= 32767` by the caller's
/// choice of `inv`).
///
/// # Safety
/// AVX2; `out.len() == x.len()`.
#[target_feature(enable = "avx2")]
unsafe fn round16(x: &[f32], inv: f32, out: &mut [i16]) {
    let n16 = x.len() / 16 * 16;
    let iv = _mm256_set1_ps(inv);
    for c in (0..n16).step_by(16) {
        // SAFETY: c + 16 <= len of both slices.
        unsafe {
            let a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(c)), iv));
            let b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(c + 8)), iv));
            // packs interleaves the 128-bit halves: a0 b0 a1 b1 -> a0 a1 b0 b1.
            let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
            _mm256_storeu_si256(out.as_mut_ptr().add(c) as *mut __m256i, p);
        }
    }
    for c in n16..x.len() {
        out[c] = (x[c] * inv).round_ties_even() as i16;
    }
}

/// Whether [`matmul`] takes `w`: int8.
pub fn takes(w: &QMat) -> bool {
    w.format == QFormat::I8
}

/// `out = round(x W^T)` for `w` that [`takes`], `x` `[n, k]`, on the panels this module
/// describes (driven by `qprefill_avx2::run_panels`, as the other integer panels are).
///
/// # Panics
/// If the CPU lacks AVX2 and FMA, [`takes`] is false, or the sizes do not match.
pub fn matmul(x: &[f32], n: usize, k: usize, w: &QMat, out: &mut [f32], round: DType) {
    assert!(super::QSimd::detect() >= super::QSimd::Avx2, "qpanels16_avx2: needs AVX2");
    assert!(takes(w), "qpanels16_avx2: int8 only");
    let m = w.rows;
    assert_eq!(k, w.cols, "qpanels16_avx2: columns");
    assert_eq!(x.len(), n * k, "qpanels16_avx2: x has the wrong size");
    assert_eq!(out.len(), n * m, "qpanels16_avx2: out has the wrong size");
    let act = Act16::quantize(x, n, k, w);
    let row_scale = w.ng == 1;
    // Columns per flush: a span with per-row scales, else the largest run inside one group and
    // one span.
    let flush = if row_scale { SPAN } else { gcd(w.group, SPAN) };
    let (kp, ng) = (w.kp, w.ng);
    let bias = w.bias().is_some();
    super::qprefill_avx2::run_panels(
        n,
        m,
        |rem| MR.min(rem),
        || Panel::new(w),
        // SAFETY: the assertion above checked AVX2.
        |panel, p0| unsafe { pack(panel, w, p0) },
        |panel, t, tb, res| {
            let ops = Ops {
                w: panel.w.as_ptr(),
                s: panel.s.as_ptr(),
                z: panel.z.as_ptr(),
                q: act.q[t * kp..].as_ptr(),
                d: act.d[t * act.nspan..].as_ptr(),
                a: if bias { act.a[t * ng..].as_ptr() } else { std::ptr::null() },
                kp,
                ng,
                group: w.group,
                flush,
                nspan: act.nspan,
            };
            // SAFETY: AVX2 with FMA (checked above); the panel holds kp / 2 steps of 16 i16 and
            // ng x 8 scales and biases; `tb` tokens of kp values, nspan scales and (with
            // biases) ng group sums start at the token pointers.
            unsafe {
                match (row_scale, tb) {
                    (true, 6) => tile::<6, true>(&ops, res),
                    (true, 5) => tile::<5, true>(&ops, res),
                    (true, 4) => tile::<4, true>(&ops, res),
                    (true, 3) => tile::<3, true>(&ops, res),
                    (true, 2) => tile::<2, true>(&ops, res),
                    (true, _) => tile::<1, true>(&ops, res),
                    (false, 6) => tile::<6, false>(&ops, res),
                    (false, 5) => tile::<5, false>(&ops, res),
                    (false, 4) => tile::<4, false>(&ops, res),
                    (false, 3) => tile::<3, false>(&ops, res),
                    (false, 2) => tile::<2, false>(&ops, res),
                    (false, _) => tile::<1, false>(&ops, res),
                }
            }
        },
        out,
        round,
    );
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Rows `p0..` of an int8 `w` into `panel`, widened to i16 (sides with no zero point).
///
/// # Safety
/// AVX2.
#[target_feature(enable = "avx2")]
unsafe fn pack(panel: &mut Panel<i16>, w: &QMat, p0: usize) {
    // SAFETY: AVX2 (this function's precondition), and for `widen_row`: each source is one
    // packed int8 row of kp bytes, each destination a panel row of kp i16.
    unsafe { panel.fill(w, p0, 0.0, |src, dst| widen_row(src, dst)) };
}

/// Int8 values to i16, 16 at a time (`dst.len()` of them, a multiple of 16).
///
/// # Safety
/// AVX2; `src` holds at least `dst.len()` bytes.
#[target_feature(enable = "avx2")]
unsafe fn widen_row(src: &[u8], dst: &mut [i16]) {
    for (c, d) in dst.chunks_exact_mut(16).enumerate() {
        // SAFETY: 16 bytes at 16 c of the row (16 c + 16 <= dst.len() <= src.len()); 16 i16 in
        // `d`.
        unsafe {
            let v = _mm256_cvtepi8_epi16(_mm_loadu_si128(src.as_ptr().add(16 * c) as *const __m128i));
            _mm256_storeu_si256(d.as_mut_ptr() as *mut __m256i, v);
        }
    }
}

/// A micro-kernel call's operands: the panel's, and the first token's (the others follow at
/// `kp` values, `nspan` scales and `ng` group sums).
struct Ops {
    w: *const i16,
    s: *const f32,
    z: *const f32,
    q: *const i16,
    d: *const f32,
    /// Null without weight biases.
    a: *const f32,
    kp: usize,
    ng: usize,
    group: usize,
    /// Columns per conversion to f32 (a divisor of [`SPAN`], and of the group unless `ROW`).
    flush: usize,
    nspan: usize,
}

/// The panel's 8 rows x `T` tokens into `res[t]`; `ROW`: one scale per row, applied after the
/// sum.
///
/// Registers: `T` i32 and `T` f32 accumulators, the weights, the broadcast activations and a
/// product: 15 of the 16 at six tokens.
///
/// # Safety
/// AVX2 and FMA; `o` as [`Ops`] describes it for `T` tokens.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<const T: usize, const ROW: bool>(o: &Ops, res: &mut [[f32; ROWS]; MR]) {
    let zero = _mm256_setzero_si256();
    let mut facc = [_mm256_setzero_ps(); T];
    let mut c = 0;
    while c < o.kp {
        let end = (c + o.flush).min(o.kp);
        let mut acc = [zero; T];
        if T == 6 && (end - c).is_multiple_of(8) && end > c {
            // Four steps per round as [`super::panel_step_6`] writes them.
            // SAFETY: the steps c / 2..end / 2 of the panel (32 bytes each from `w`) and each
            // token's values c..end (`kp` i16 apart); AVX2 (this function's).
            let a = unsafe {
                super::panel_loop_6!(
                    "vpmaddwd", "vpaddd", [("0", "0"), ("32", "4"), ("64", "8"), ("96", "12")],
                    wp: o.w.add(c / 2 * 16), q0: o.q.add(c), q3: o.q.add(3 * o.kp + c), kp: 2 * o.kp,
                    n: (end - c) / 8, wstep: "128", qstep: "16"
                )
            };
            acc.copy_from_slice(&a[..T]);
        } else {
            // A run-time trip count (as in the other panels: a constant one gets unrolled, the
            // tokens run outermost and the weight vectors spill).
            for s in c / 2..end / 2 {
                // SAFETY: step s < kp / 2 of the panel; token t's values 2 s, 2 s + 1 < kp.
                let w = unsafe { _mm256_loadu_si256(o.w.add(s * 16) as *const __m256i) };
                for t in 0..T {
                    let q = unsafe { std::ptr::read_unaligned(o.q.add(t * o.kp + 2 * s) as *const i32) };
                    acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(w, _mm256_set1_epi32(q)));
                }
            }
        }
        // SAFETY: the group index is clamped to the panel's ng groups (columns past the last
        // group are padding, whose weights are zero).
        let sv = if ROW {
            _mm256_setzero_ps()
        } else {
            unsafe { _mm256_loadu_ps(o.s.add((c / o.group).min(o.ng - 1) * ROWS)) }
        };
        for t in 0..T {
            // SAFETY: span c / SPAN < nspan of token t's scales.
            let d = _mm256_set1_ps(unsafe { *o.d.add(t * o.nspan + c / SPAN) });
            let m = if ROW { d } else { _mm256_mul_ps(sv, d) };
            facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), m, facc[t]);
        }
        c = end;
    }
    if ROW {
        // SAFETY: the panel holds ng >= 1 x 8 scales.
        let s = unsafe { _mm256_loadu_ps(o.s) };
        for t in 0..T {
            facc[t] = _mm256_mul_ps(facc[t], s);
        }
    }
    if !o.a.is_null() {
        // The biases: sum_g bias[r, g] A[t, g].
        for g in 0..o.ng {
            // SAFETY: g < ng of the panel's biases and of each token's group sums.
            let z = unsafe { _mm256_loadu_ps(o.z.add(g * ROWS)) };
            for t in 0..T {
                facc[t] = _mm256_fmadd_ps(z, _mm256_set1_ps(unsafe { *o.a.add(t * o.ng + g) }), facc[t]);
            }
        }
    }
    for t in 0..T {
        // SAFETY: res[t] holds 8 floats.
        unsafe { _mm256_storeu_ps(res[t].as_mut_ptr(), facc[t]) };
    }
}
