//! Decode GEMV for int8 weights with one scale per row (`spark-run quantize --to int8`) on
//! **16-bit activations** (W8A16), for steps of at most [`MAX_TOKENS`] tokens, at the AVX2 and
//! AVX-512 VNNI levels.
//!
//! The activations are those of the AVX2 16-bit prefill panels ([`super::qpanels16_avx2`]):
//! 16-bit values with one scale per [`SPAN`] columns. The weight bytes are widened to 16 bits as
//! they are loaded (`vpmovsxbw`) and multiplied with the activations in pairs into i32 lanes:
//! VNNI, per 32 columns and row, one widening load and one `vpdpwssd` per token; AVX2, per 16
//! columns, one widening load and a `vpmaddwd` and `vpaddd` per token. A span's i32 sums are exact
//! (at most 256 x 128 x 32767 < 2^31) and go to f32 once per span (one conversion and one FMA by
//! the span's activation scale), the row scale once per row. Against the int8 activations with
//! one scale per 32 columns of the W8A8 kernels ([`super::qavx512`], [`super::qavx2`]), the
//! activations' rounding error drops from `max|x_block| / 254` to `max|x_span| / 65534` per
//! element: the demo checkpoint's int8 fed one token per step (`spark-run bench --quant int8
//! --snr`, Zen 4, VNNI) went from 39.9 dB / 61 of 64 greedy tokens to 42.0 dB / 63, the level of
//! its prefill (42.1 / 63). The instruction count per weight is about the W8A8 kernels' (VNNI:
//! two widening loads and two `vpdpwssd` per 64 weights against a load, a sign flip, `vpdpbusd`,
//! a conversion and an FMA; AVX2: three per 16 against seven per 32): one Zen 4 core ran a 384 x
//! 2048 GEMV in L2 at 47 GB/s against 49 (VNNI), well above what memory delivers.
//! [`super::qmatmul::qmatmul`] routes here.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use rayon::prelude::*;
use spark_core::quant::QFormat;
use spark_core::DType;

use super::qmatmul::{QMat, ScaleMode};
use super::qpanels16_avx2::{Act16, SPAN};
use super::{Prefetcher, QSimd, SharedOut};

/// Most tokens per step this GEMV takes (one token tile: the weights stream once).
pub const MAX_TOKENS: usize = 4;
/// Most rows per tile.
const R: usize = 4;

/// Whether [`matmul`] takes `n` tokens through `w` at level `qs`: the AVX2, VNNI or AMX INT8
/// level (at AMX INT8 the VNNI tile: AMX INT8 tiles would quantize the activations to int8),
/// int8 with one scale per row and no bias, at most [`MAX_TOKENS`] tokens.
pub fn takes(qs: QSimd, w: &QMat, n: usize) -> bool {
    matches!(qs, QSimd::Avx2 | QSimd::Avx512Vnni | QSimd::AmxInt8)
        && w.format == QFormat::I8
        && w.mode == ScaleMode::Row
        && w.bias().is_none()
        && (1..=MAX_TOKENS).contains(&n)
}

/// `out = round(x W^T)` for `x` `[n, k]` and `w` that [`takes`] at level `qs`.
///
/// # Panics
/// If the CPU lacks level `qs`, [`takes`] is false, or the sizes do not match.
pub fn matmul(qs: QSimd, x: &[f32], n: usize, k: usize, w: &QMat, out: &mut [f32], round: DType) {
    assert!(QSimd::detect() >= qs, "qdecode16: this CPU has no {qs:?}");
    assert!(takes(qs, w, n), "qdecode16: int8 per row, at most {MAX_TOKENS} tokens, AVX2, VNNI or AMX INT8");
    let m = w.rows;
    assert_eq!(k, w.cols, "qdecode16: columns");
    assert_eq!(x.len(), n * k, "qdecode16: x has the wrong size");
    assert_eq!(out.len(), n * m, "qdecode16: out has the wrong size");
    let act = Act16::quantize(x, n, k, w);
    let (kp, rb) = (w.kp, w.row_bytes());
    // AVX2 has 16 registers: 4 rows x 3-4 tokens of sums would not fit.
    let rows = if qs == QSimd::Avx2 && n > 2 { 2 } else { R };
    let step = if qs == QSimd::Avx2 { 16 } else { 32 };
    let chunk = super::row_chunk(m, R);
    let outp = SharedOut(out.as_mut_ptr());
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let base = w.packed().as_ptr();
        let (r0, r1) = (c * chunk, ((c + 1) * chunk).min(m));
        let mut r = r0;
        while r < r1 {
            let nr = if r + rows <= r1 { rows } else { 1 };
            // The next tile's rows (about 8 KiB at 2048 columns) stream in meanwhile.
            let pf = Prefetcher::rows(base, rb, r + nr, (r1 - r - nr).min(R), kp / step);
            let t =
                Tile { w: base.wrapping_add(r * rb), rb, q: act.q.as_ptr(), kp, d: act.d.as_ptr(), nspan: act.nspan };
            let mut res = [[0.0f32; MAX_TOKENS]; R];
            // SAFETY: `takes` and the assertions above: level `qs` present, rows r..r + nr of
            // `rb` bytes in `w`'s buffer, n tokens of kp 16-bit values and nspan scales.
            unsafe {
                macro_rules! go {
                    ($tile:ident, $r:literal, $t:literal) => {{
                        let o = $tile::<$r, $t>(&t, &pf);
                        for (i, row) in o.iter().enumerate() {
                            res[i][..$t].copy_from_slice(row);
                        }
                    }};
                }
                match (qs, nr, n) {
                    (QSimd::Avx2, 4, 1) => go!(tile_avx2, 4, 1),
                    (QSimd::Avx2, 4, _) => go!(tile_avx2, 4, 2),
                    (QSimd::Avx2, 2, 3) => go!(tile_avx2, 2, 3),
                    (QSimd::Avx2, 2, _) => go!(tile_avx2, 2, 4),
                    (QSimd::Avx2, _, 1) => go!(tile_avx2, 1, 1),
                    (QSimd::Avx2, _, 2) => go!(tile_avx2, 1, 2),
                    (QSimd::Avx2, _, 3) => go!(tile_avx2, 1, 3),
                    (QSimd::Avx2, _, _) => go!(tile_avx2, 1, 4),
                    (_, 4, 1) => go!(tile_vnni, 4, 1),
                    (_, 4, 2) => go!(tile_vnni, 4, 2),
                    (_, 4, 3) => go!(tile_vnni, 4, 3),
                    (_, 4, _) => go!(tile_vnni, 4, 4),
                    (_, _, 1) => go!(tile_vnni, 1, 1),
                    (_, _, 2) => go!(tile_vnni, 1, 2),
                    (_, _, 3) => go!(tile_vnni, 1, 3),
                    (_, _, _) => go!(tile_vnni, 1, 4),
                }
            }
            for (i, row) in res.iter().enumerate().take(nr) {
                let s = w.scales().get(r + i);
                for (t, &v) in row.iter().enumerate().take(n) {
                    // SAFETY: t < n and r + i < r1 <= m: inside `out`; rows r0..r1 are this
                    // task's alone.
                    unsafe { outp.put(t * m + r + i, round.round(v * s)) };
                }
            }
            r += nr;
        }
    });
}

/// A tile's operands: its first packed row (`rb` bytes apart), the tokens' 16-bit values (`kp`
/// apart) and span scales (`nspan` apart).
struct Tile {
    w: *const u8,
    rb: usize,
    q: *const i16,
    kp: usize,
    d: *const f32,
    nspan: usize,
}

/// `RR` rows x `T` tokens over all columns, unscaled by the rows' scales: 32 columns per step.
///
/// # Safety
/// AVX-512F/BW/VNNI; `t` describes `RR` packed int8 rows and `T` tokens of `t.kp` columns (a
/// multiple of 64) and `t.nspan` spans; `pf`'s steps are `t.kp / 32`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_vnni<const RR: usize, const T: usize>(t: &Tile, pf: &Prefetcher) -> [[f32; T]; RR] {
    const STEP: usize = 32;
    let mut pf = pf.cursor();
    let mut acc = [[_mm512_setzero_ps(); T]; RR];
    for s in 0..t.nspan {
        let (c0, c1) = (s * SPAN, ((s + 1) * SPAN).min(t.kp));
        let mut sums = [[_mm512_setzero_si512(); T]; RR];
        for c in (c0..c1).step_by(STEP) {
            pf.advance();
            let mut wv = [_mm512_setzero_si512(); RR];
            for r in 0..RR {
                wv[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(t.w.add(r * t.rb + c) as *const __m256i));
            }
            for j in 0..T {
                let q = _mm512_loadu_si512(t.q.add(j * t.kp + c) as *const _);
                for r in 0..RR {
                    sums[r][j] = _mm512_dpwssd_epi32(sums[r][j], wv[r], q);
                }
            }
        }
        for j in 0..T {
            let d = _mm512_set1_ps(*t.d.add(j * t.nspan + s));
            for r in 0..RR {
                acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][j]), d, acc[r][j]);
            }
        }
    }
    let mut out = [[0.0f32; T]; RR];
    for r in 0..RR {
        for j in 0..T {
            out[r][j] = _mm512_reduce_add_ps(acc[r][j]);
        }
    }
    out
}

/// As [`tile_vnni`] with 256-bit AVX2 operations: 16 columns per step, `vpmaddwd` and `vpaddd`.
///
/// # Safety
/// AVX2 and FMA; `t` as for [`tile_vnni`]; `pf`'s steps are `t.kp / 16`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_avx2<const RR: usize, const T: usize>(t: &Tile, pf: &Prefetcher) -> [[f32; T]; RR] {
    const STEP: usize = 16;
    let mut pf = pf.cursor();
    let mut acc = [[_mm256_setzero_ps(); T]; RR];
    for s in 0..t.nspan {
        let (c0, c1) = (s * SPAN, ((s + 1) * SPAN).min(t.kp));
        let mut sums = [[_mm256_setzero_si256(); T]; RR];
        for c in (c0..c1).step_by(STEP) {
            pf.advance();
            let mut wv = [_mm256_setzero_si256(); RR];
            for r in 0..RR {
                wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(t.w.add(r * t.rb + c) as *const __m128i));
            }
            for j in 0..T {
                let q = _mm256_loadu_si256(t.q.add(j * t.kp + c) as *const __m256i);
                for r in 0..RR {
                    sums[r][j] = _mm256_add_epi32(sums[r][j], _mm256_madd_epi16(wv[r], q));
                }
            }
        }
        for j in 0..T {
            let d = _mm256_set1_ps(*t.d.add(j * t.nspan + s));
            for r in 0..RR {
                acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][j]), d, acc[r][j]);
            }
        }
    }
    let mut out = [[0.0f32; T]; RR];
    for r in 0..RR {
        for j in 0..T {
            let v = acc[r][j];
            let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            out[r][j] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
        }
    }
    out
}
