//! AVX2 integer prefill panels for int6 (`spark-run quantize`'s groups of 32, GGUF Q6_K's of 16)
//! and int4 without integer sub-scales (GGUF Q4_K / Q4_0): weights whose scales are floats and
//! whose values fit 6 bits. Int4 with sub-scales has its own panels ([`super::qprefill_avx2`]),
//! int8 16-bit ones ([`super::qpanels16_avx2`]); [`super::qprefill_avx2::matmul`] picks.
//!
//! `vpmaddubsw` multiplies unsigned weight bytes by signed activation bytes and sums pairs into
//! 16-bit lanes. A lane stays exact over 32 columns (16 products) only while a weight byte is at
//! most 15 (16 x 15 x 127 = 30480 < 2^15). So each weight is held as unsigned `u = q + zero`:
//! int4 the nibble itself, int6 `u = q + 32` (at most 63), whose 16-bit sums hold two steps
//! only. A panel of 8 rows is unpacked once per call into `[kp / 4][8 rows][4 columns]` bytes;
//! per 4 columns the micro-kernel loads the panel's vector once and, for each token, broadcasts
//! its 4 activation bytes and issues one `vpmaddubsw` and one `vpaddw` (int6: per two steps two
//! `vpmaddubsw`, a `vpaddw` and a `vpmaddwd` by 1 into i32, 3 multiply-port operations where two
//! nibble planes took 4: int4-mix pp512 +4 %). Every 32 columns (16 where groups are 16) the
//! 16-bit sums go to i32, are converted to f32 and added with the weight row's scale times the
//! activation block's (one FMA; per-row scales are applied once at the end instead). The zero
//! point and the biases come off as in [`super::qprefill_avx2`]: `sum_g (bias[r, g] - zero
//! scale[r, g]) A[t, g]`.
//!
//! Why integer panels rather than f32 ones: the multiply ports are what bounds either (two per
//! cycle on Zen 3, shared by `vfmadd` and `vpmaddubsw`), and one plane gives 32 multiply-adds per
//! port operation against the f32 FMA's 8. Measured on one Zen 3 core (a kernel loop in L1): 150
//! GMAC/s for one int4 plane at 6 tokens, 51 for f32 panels at 16 rows x 6 tokens. (Int8 ran
//! here until session 28 as two nibble planes, `u = q + 128 = 16 h + l`: 79 GMAC/s in that loop,
//! the same speed in the model as the 16-bit panels, which keep 16-bit activations.)
//!
//! Precision: the activations are int8 with one scale per 32-block (as the decode kernels
//! quantize them: [`QAct::quantize`]), the integer sums exact, f32 from each block on.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use spark_core::quant::QFormat;
use spark_core::DType;

use super::qmatmul::{I6Layout, QAct, QMat, I6_CHUNK_BYTES, QBLOCK, QCHUNK};
// Panels of 8 weight rows (one vector of 4-column groups per plane), at most 6 tokens per call:
// the driver's ([`super::qprefill_avx2::run_panels`]).
use super::qprefill_avx2::{MR, ROWS};

/// Bytes of one plane per micro-kernel step (4 columns of 8 rows).
const PLANE: usize = 32;
/// Most tokens per micro-kernel call with one plane (`2 T + 3` registers).
const MR1: usize = MR;

/// `out = round(x W^T)` for `w` (no integer sub-scales) at the AVX2 level, `x` `[n, k]`, on the
/// panels this module describes. The caller ([`super::qprefill_avx2::matmul`]) checked AVX2.
pub(super) fn matmul(x: &[f32], n: usize, k: usize, w: &QMat, out: &mut [f32], round: DType) {
    let m = w.rows;
    assert_eq!(out.len(), n * m, "qpanels_avx2: out has the wrong size");
    let act = QAct::quantize_spans(super::QSimd::Avx2, x, n, k, w, 1);
    assert!(w.format != QFormat::I8, "qpanels_avx2: int8 goes to the 16-bit panels");
    let six = w.format == QFormat::I6;
    let row_scale = w.ng == 1;
    // Columns per flush: the 16-bit sums stay exact over 32; groups of 16 (or any not a multiple
    // of 32) flush per 16, so each flush lies in one group.
    let flush = if row_scale || w.group.is_multiple_of(QBLOCK) { QBLOCK } else { 16 };
    let mr = MR1;
    let (kp, ng) = (w.kp, w.ng);
    let nb = kp / QBLOCK;
    super::qprefill_avx2::run_panels(
        n,
        m,
        |rem| if rem >= mr { mr } else { 1 },
        || Panel::new(w),
        // SAFETY: the caller checked the AVX2 level.
        |panel, p0| unsafe { pack(panel, w, p0) },
        |panel, t, tb, res| {
            let ops = Ops {
                w: panel.w.as_ptr(),
                s: panel.s.as_ptr(),
                z: panel.z.as_ptr(),
                q: act.q[t * kp..].as_ptr(),
                d: act.d[t * nb..].as_ptr(),
                a: act.a[t * ng..].as_ptr(),
                kp,
                ng,
                group: w.group,
                steps: flush / 4,
            };
            // SAFETY: AVX2 with FMA (QSimd's AVX2 level, checked by the caller); the panel holds
            // kp / 4 steps of 32 bytes and ng x 8 scales and zero terms; `tb` tokens
            // of kp values, nb block scales and ng group sums start at the token pointers.
            unsafe {
                match (six, row_scale, flush, tb) {
                    (true, true, _, MR1) => tile::<MR1, 6, true, QBLOCK>(&ops, res),
                    (true, true, _, _) => tile::<1, 6, true, QBLOCK>(&ops, res),
                    (true, false, QBLOCK, MR1) => tile::<MR1, 6, false, QBLOCK>(&ops, res),
                    (true, false, QBLOCK, _) => tile::<1, 6, false, QBLOCK>(&ops, res),
                    (true, false, _, MR1) => tile::<MR1, 6, false, 16>(&ops, res),
                    (true, false, _, _) => tile::<1, 6, false, 16>(&ops, res),
                    (_, true, _, MR1) => tile::<MR1, 4, true, QBLOCK>(&ops, res),
                    (_, true, _, _) => tile::<1, 4, true, QBLOCK>(&ops, res),
                    (_, false, QBLOCK, MR1) => tile::<MR1, 4, false, QBLOCK>(&ops, res),
                    (_, false, QBLOCK, _) => tile::<1, 4, false, QBLOCK>(&ops, res),
                    (_, false, _, MR1) => tile::<MR1, 4, false, 16>(&ops, res),
                    (_, false, _, _) => tile::<1, 4, false, 16>(&ops, res),
                }
            }
        },
        out,
        round,
    );
}

/// One panel's operands: rows `p0..p0 + 8` (zero weights past the matrix's last row), of
/// weights as `T` (unsigned bytes here, i16 in [`super::qpanels16_avx2`]).
pub(super) struct Panel<T> {
    /// The interleaved weights: `[kp / 4][8][4]` bytes, or `[kp / 2][8][2]` i16.
    pub(super) w: Vec<T>,
    /// `[ng][8]` scales.
    pub(super) s: Vec<f32>,
    /// `[ng][8]` `bias - zero scale`.
    pub(super) z: Vec<f32>,
    /// The rows' values in column order (`[8][kp]`), before the interleave.
    rows: Vec<T>,
}

impl<T: Copy + Default> Panel<T> {
    pub(super) fn new(w: &QMat) -> Panel<T> {
        Panel {
            w: vec![T::default(); ROWS * w.kp],
            s: vec![0.0; w.ng * ROWS],
            z: vec![0.0; w.ng * ROWS],
            rows: vec![T::default(); ROWS * w.kp],
        }
    }

    /// Fill with rows `p0..` of `w`: each packed row through `unpack` (into `kp` values in
    /// column order), its sides with `zero` ([`row_sides`]), then the interleave.
    ///
    /// # Safety
    /// AVX2; `T` is `u8` or `i16` (the interleave moves `kp` of them per row as bytes).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn fill(&mut self, w: &QMat, p0: usize, zero: f32, mut unpack: impl FnMut(&[u8], &mut [T])) {
        let (kp, rb) = (w.kp, w.row_bytes());
        let nr = ROWS.min(w.rows - p0);
        if nr < ROWS {
            self.rows.fill(T::default());
            self.s.fill(0.0);
            self.z.fill(0.0);
        }
        for j in 0..nr {
            let r = p0 + j;
            unpack(&w.packed()[r * rb..(r + 1) * rb], &mut self.rows[j * kp..(j + 1) * kp]);
            row_sides(w, r, j, zero, &mut self.s, &mut self.z);
        }
        let row_bytes = kp * std::mem::size_of::<T>();
        // SAFETY: AVX2 (this function's precondition); `self.rows` holds 8 rows of `row_bytes`
        // bytes and `self.w` as many; `row_bytes` is a multiple of 64 (kp is).
        unsafe { interleave(self.rows.as_ptr() as *const u8, row_bytes, self.w.as_mut_ptr() as *mut u8) };
    }
}

/// Rows `p0..` of an int6 or int4 `w` into `panel`: their unsigned values `q + zero`.
///
/// # Safety
/// AVX2.
#[target_feature(enable = "avx2")]
unsafe fn pack(panel: &mut Panel<u8>, w: &QMat, p0: usize) {
    let zero = if w.format == QFormat::I6 { 32.0 } else { 8.0 };
    let (format, layout, kp) = (w.format, w.i6_layout(), w.kp);
    // SAFETY: AVX2 (this function's precondition), and for `unpack_row`: each source is one
    // packed row of `w`'s format, each destination a panel row of kp bytes.
    unsafe { panel.fill(w, p0, zero, |src, dst| unpack_row(format, layout, src, kp, dst)) };
}

/// Row `r` of `w` as row `j` of a panel's sides: its group scales into `s[g * 8 + j]` and
/// `bias - zero scale` into `z[g * 8 + j]` (`[ng][8]` each; zero 0 for signed values). For
/// these panels and [`super::qpanels16_avx2`]'s.
pub(super) fn row_sides(w: &QMat, r: usize, j: usize, zero: f32, s: &mut [f32], z: &mut [f32]) {
    let ng = w.ng;
    for g in 0..ng {
        let scale = w.scales().get(r * ng + g);
        let bias = w.bias().map_or(0.0, |b| b.get(r * ng + g));
        s[g * ROWS + j] = scale;
        z[g * ROWS + j] = bias + -zero * scale;
    }
}

/// The panel layout from 8 rows of `row_bytes` bytes each (`rows`, one after the other): per 4
/// bytes of the rows, a step of 32 bytes holding each row's 4 in row order, `out[(i / 4) * 32 +
/// 4 j..][..4] = rows[j][i..i + 4]` (an 8 x 8 transpose of 32-bit lanes per 32 bytes). Bytes in
/// fours here, 16-bit values in pairs in [`super::qpanels16_avx2`].
///
/// # Safety
/// AVX; `rows` holds 8 x `row_bytes` bytes and `out` as many; `row_bytes` is a multiple of 32.
#[target_feature(enable = "avx")]
pub(super) unsafe fn interleave(rows: *const u8, row_bytes: usize, out: *mut u8) {
    for c in (0..row_bytes).step_by(32) {
        // SAFETY: row j's 32 bytes at j row_bytes + c lie inside `rows` (c + 32 <= row_bytes);
        // steps c / 4 .. c / 4 + 8 inside `out` (row_bytes / 4 steps of 32 bytes).
        unsafe {
            let mut v = [_mm256_setzero_ps(); ROWS];
            for (j, vj) in v.iter_mut().enumerate() {
                *vj = _mm256_loadu_ps(rows.add(j * row_bytes + c) as *const f32);
            }
            super::avx2::transpose8(&mut v);
            let dst = out.add(c / 4 * PLANE);
            for (i, &vi) in v.iter().enumerate() {
                _mm256_storeu_ps(dst.add(i * PLANE) as *mut f32, vi);
            }
        }
    }
}

/// One packed int6 or int4 row (`kp` columns) into its unsigned values `u = q + zero` (6 and 4
/// bits), in column order (int6 in `layout`).
///
/// # Panics
/// For int8 ([`matmul`] refuses it: the 16-bit panels take int8).
///
/// # Safety
/// AVX2; `src` holds the row's bytes in [`QMat`]'s layout, `out` at least `kp` bytes.
#[target_feature(enable = "avx2")]
unsafe fn unpack_row(format: QFormat, layout: I6Layout, src: &[u8], kp: usize, out: &mut [u8]) {
    let mask = _mm256_set1_epi8(0x0F);
    let o = out.as_mut_ptr();
    // SAFETY (all blocks below): every load reads inside `src` (the row's kp, kp / 2 or
    // kp / 64 x 48 bytes) and every store writes inside `out` (kp bytes).
    match format {
        QFormat::I8 => unreachable!("qpanels_avx2::matmul refuses int8"),
        QFormat::I4 => {
            for (ci, chunk) in src[..kp / 2].chunks_exact(QCHUNK / 2).enumerate() {
                let v = unsafe { _mm256_loadu_si256(chunk.as_ptr() as *const __m256i) };
                let c = ci * QCHUNK;
                unsafe {
                    _mm256_storeu_si256(o.add(c) as *mut __m256i, _mm256_and_si256(v, mask));
                    let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                    _mm256_storeu_si256(o.add(c + 32) as *mut __m256i, hi);
                }
            }
        }
        QFormat::I6 if layout == I6Layout::Split => {
            let three = _mm256_set1_epi8(3);
            // Columns 0..32 of a chunk take bits 0-1 (lane 0) and 2-3 (lane 1) of the top-bit
            // bytes, columns 32..64 bits 4-5 and 6-7.
            let (sh0, sh1) = (_mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6));
            for (ci, chunk) in src[..kp / QCHUNK * I6_CHUNK_BYTES].chunks_exact(I6_CHUNK_BYTES).enumerate() {
                let c = ci * QCHUNK;
                unsafe {
                    let v = _mm256_loadu_si256(chunk.as_ptr() as *const __m256i);
                    let tb = _mm256_broadcastsi128_si256(_mm_loadu_si128(chunk.as_ptr().add(32) as *const __m128i));
                    // The top bits to bits 4-5 (no carry across bytes: at most 48), or'd with the
                    // low nibbles: the 6-bit values.
                    let h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi32(tb, sh0), three), 4);
                    let h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi32(tb, sh1), three), 4);
                    let lo0 = _mm256_and_si256(v, mask);
                    let lo1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                    _mm256_storeu_si256(o.add(c) as *mut __m256i, _mm256_or_si256(h0, lo0));
                    _mm256_storeu_si256(o.add(c + 32) as *mut __m256i, _mm256_or_si256(h1, lo1));
                }
            }
        }
        QFormat::I6 => {
            for (ci, chunk) in src[..kp / QCHUNK * I6_CHUNK_BYTES].chunks_exact(I6_CHUNK_BYTES).enumerate() {
                let c = ci * QCHUNK;
                unsafe {
                    for h in 0..2 {
                        let v = super::qavx2::i6_block(chunk.as_ptr(), h);
                        _mm256_storeu_si256(o.add(c + 32 * h) as *mut __m256i, v);
                    }
                }
            }
        }
    }
}

/// A micro-kernel call's operands: the panel's, and the first token's (the others follow at
/// `kp` values, `kp / 32` block scales and `ng` group sums).
struct Ops {
    w: *const u8,
    s: *const f32,
    z: *const f32,
    q: *const i8,
    d: *const f32,
    a: *const f32,
    kp: usize,
    ng: usize,
    group: usize,
    /// Steps of 4 columns per flush (`F / 4`).
    steps: usize,
}

/// The panel's 8 rows x `T` tokens into `res[t]`: `P` bits per value (4 or 6), flushed every
/// `F` columns (32, or 16 for groups of 16); `ROW`: one scale per row, applied after the sum.
///
/// # Safety
/// AVX2 and FMA; `o` as [`Ops`] describes it for `T` tokens.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<const T: usize, const P: usize, const ROW: bool, const F: usize>(o: &Ops, res: &mut [[f32; ROWS]; MR]) {
    let nb = o.kp / QBLOCK;
    let zero = _mm256_setzero_si256();
    let c1 = _mm256_set1_epi16(1);
    let step = PLANE;
    let mut facc = [_mm256_setzero_ps(); T];
    for c0 in (0..o.kp).step_by(F) {
        let mut lo = [zero; T];
        // SAFETY (the loads): step c0 / 4 + s < kp / 4 of the panel; token t's value c0 + 4 s
        // + 3 < kp.
        let wb = unsafe { o.w.add(c0 / 4 * step) };
        let qb = unsafe { o.q.add(c0) };
        // A run-time trip count (`F / 4` steps): with the constant one LLVM unrolled the steps,
        // ran the tokens outermost and spilled the weight vectors (whole-model int8 pp512, on
        // the two nibble planes int8 had then, no faster than the f32 panels).
        if P == 6 {
            // 6-bit values (at most 63): a pair's 16-bit sum holds two steps (4 products of at
            // most 63 x 127 = 32004 < 2^15), then it goes to i32 (in `lo`).
            for s in (0..o.steps).step_by(2) {
                let w0 = unsafe { _mm256_loadu_si256(wb.add(s * step) as *const __m256i) };
                let w1 = unsafe { _mm256_loadu_si256(wb.add((s + 1) * step) as *const __m256i) };
                for t in 0..T {
                    let qt = unsafe { qb.add(t * o.kp + 4 * s) };
                    let q0 = _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(qt as *const i32) });
                    let q1 = _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(qt.add(4) as *const i32) });
                    let p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, q0), _mm256_maddubs_epi16(w1, q1));
                    lo[t] = _mm256_add_epi32(lo[t], _mm256_madd_epi16(p, c1));
                }
            }
        } else {
            for s in 0..o.steps {
                let wl = unsafe { _mm256_loadu_si256(wb.add(s * step) as *const __m256i) };
                for t in 0..T {
                    let q =
                        _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(qb.add(t * o.kp + 4 * s) as *const i32) });
                    lo[t] = _mm256_add_epi16(lo[t], _mm256_maddubs_epi16(wl, q));
                }
            }
        }
        // SAFETY: group c0 / group < ng of the panel's scales.
        let sv = if ROW { _mm256_setzero_ps() } else { unsafe { _mm256_loadu_ps(o.s.add(c0 / o.group * ROWS)) } };
        for t in 0..T {
            let i = if P == 6 { lo[t] } else { _mm256_madd_epi16(lo[t], c1) };
            // SAFETY: block c0 / 32 < nb of token t's scales.
            let d = _mm256_set1_ps(unsafe { *o.d.add(t * nb + c0 / QBLOCK) });
            let m = if ROW { d } else { _mm256_mul_ps(sv, d) };
            facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), m, facc[t]);
        }
    }
    if ROW {
        // SAFETY: the panel holds ng >= 1 x 8 scales.
        let s = unsafe { _mm256_loadu_ps(o.s) };
        for t in 0..T {
            facc[t] = _mm256_mul_ps(facc[t], s);
        }
    }
    // The zero point and the biases: sum_g (bias - zero scale) A[t, g].
    for g in 0..o.ng {
        // SAFETY: g < ng of the panel's zero terms and of each token's group sums.
        let z = unsafe { _mm256_loadu_ps(o.z.add(g * ROWS)) };
        for t in 0..T {
            facc[t] = _mm256_fmadd_ps(z, _mm256_set1_ps(unsafe { *o.a.add(t * o.ng + g) }), facc[t]);
        }
    }
    for t in 0..T {
        // SAFETY: res[t] holds 8 floats.
        unsafe { _mm256_storeu_ps(res[t].as_mut_ptr(), facc[t]) };
    }
}
