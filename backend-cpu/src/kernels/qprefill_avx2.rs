//! AVX2 int4 prefill (W4A8) on panels of 8 weight rows, for int4 whose 32-blocks need no float
//! scaling inside a 256-column super-block: groups of 32 with integer sub-scales
//! (`SubScales`, what `spark-run quantize` writes). The activations are int8 with one scale
//! per super-block (as for the AVX2 batched decode).
//!
//! Each panel is unpacked once per call into `[kp / 4][8 rows][4 columns]` nibbles `0..=15`
//! (one vector per 4 columns), beside its rows' sub-scales (`k` as i16 pairs), super-block units
//! and bias terms. The micro-kernel runs 8 rows x up to 6 tokens: per 4 columns it broadcasts
//! each token's 4 activation bytes and issues one `vpmaddubsw` and one `vpaddw`. A lane's
//! 16-bit sum stays exact over a whole 32-block (16 products of at most 15 x 127: 30480 <
//! 2^15), so the multiply by the block's `k` (`vpmaddwd`, into i32) comes once per 32 columns,
//! and the conversion to f32 and the FMA by `u * d` once per super-block. Per 32 multiply-adds
//! that is one multiply and one add, where the row-major kernels ([`super::qavx2`]) and the f32
//! panels ([`super::matmul::quant_panels`]) spend two multiplies (or FMAs) and more.
//!
//! The int4 zero point of 8 and the group biases come off after the integer sums, as one small
//! f32 product: `sum_g (bias[r, g] - 8 scale[r, g]) A[t, g]` with `A` the activations' group
//! sums (the term `TileArgs::bias_term` adds).
//!
//! Int8 goes to the 16-bit panels of [`super::qpanels16_avx2`], int6 and int4 without
//! sub-scales to the byte panels of [`super::qpanels_avx2`] (float scales per block). Tried
//! before them, in session 13 (128 tokens, one thread, 1.7B shapes): i16 panels times i16
//! activations (`vpmaddwd`, 16 multiply-adds per instruction; an earlier form than
//! [`super::qpanels16_avx2`]'s) ran 31.0-34.4 GMAC/s against the f32 panels' 30.1-31.2; the row-major super-block kernel
//! ([`super::qavx2`]) 34.9-40.9, but whole-model int8 pp512 through it was level with the f32
//! panels (25.5 / 26.6 against 25.7 / 26.3 tok/s), and the panels keep float activations.
//!
//! Precision: int8 activations with one scale per 256 columns; exact integer sums; each
//! super-block's i32 sum (up to 1.2e8) is rounded to f32 once; then f32 accumulation.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use rayon::prelude::*;
use spark_core::DType;

use super::qmatmul::{QAct, QMat, QBLOCK, SUPER_BLOCKS};
use super::SharedOut;

/// Weight rows per panel (one vector of 4-column groups). A panel of 8 rows (16 KiB at 2048
/// columns) stays in L1 while every token runs over it; with 16 rows (two vectors per step)
/// whole-model pp512 was 7 % slower (medians of 4 interleaved runs: 34.95 against 37.6 tok/s).
pub(super) const ROWS: usize = 8;
/// Bytes per micro-kernel step of a panel (4 columns of 8 rows).
const STEP: usize = 32;
/// Most tokens per micro-kernel call ([`tile`]).
pub(super) const MR: usize = 6;

/// Fewest tokens for [`matmul`] (the panels' packing is paid once per call): at 16 tokens the
/// row-major super-block kernel ([`super::qavx2`]) was ahead (kernel bench, one thread, 1.7B
/// shapes: 16.8-24.4 against 12.6-14.7 GMAC/s), at 32 these panels (21.0-36.4 against
/// 16.5-21.8).
pub const MIN_TOKENS: usize = 32;

/// Whether [`matmul`] takes `w` for `n` tokens at integer level `qs`: the AVX2 level, from
/// [`MIN_TOKENS`] tokens, any quantized matrix (int4 with sub-scales on this module's panels,
/// int8 on [`super::qpanels16_avx2`]'s, the rest on [`super::qpanels_avx2`]'s).
pub fn takes(qs: super::QSimd, _w: &QMat, n: usize) -> bool {
    qs == super::QSimd::Avx2 && super::QSimd::detect() >= super::QSimd::Avx2 && n >= MIN_TOKENS
}

/// One panel's operands: rows `p0..p0 + 8` (zeros past the matrix's last row).
struct Panel {
    /// `[kp / 4][8][4]` nibbles.
    w: Vec<u8>,
    /// `[nb][8]` i32 lanes `k | k << 16` (the sub-scales as a `vpmaddwd` operand).
    k: Vec<i32>,
    /// `[nsb][8]` super-block units.
    u: Vec<f32>,
    /// `[ng][8]` `bias - 8 scale`.
    z: Vec<f32>,
}

impl Panel {
    fn new(w: &QMat) -> Panel {
        let nb = w.kp / QBLOCK;
        Panel {
            w: vec![0; w.kp / 4 * STEP],
            k: vec![0; nb * ROWS],
            u: vec![0.0; nb.div_ceil(SUPER_BLOCKS) * ROWS],
            z: vec![0.0; w.ng * ROWS],
        }
    }

    /// Fill with rows `p0..` of `w` ([`takes`]).
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn pack(&mut self, w: &QMat, p0: usize) {
        let (kp, ng, rb) = (w.kp, w.ng, w.row_bytes());
        let nb = kp / QBLOCK;
        let nsb = nb.div_ceil(SUPER_BLOCKS);
        let nr = ROWS.min(w.rows - p0);
        if nr < ROWS {
            self.w.fill(0);
            self.k.fill(0);
            self.u.fill(0.0);
            self.z.fill(0.0);
        }
        let packed = w.packed();
        let sub = w.sub_scales().expect("takes() checked the sub-scales");
        let mask = _mm256_set1_epi8(0x0F);
        let mut quads = [0u32; 16];
        let q = quads.as_mut_ptr() as *mut __m256i;
        for j in 0..nr {
            let r = p0 + j;
            let row = &packed[r * rb..(r + 1) * rb];
            let out = self.w.as_mut_ptr().add(4 * j);
            // Per 64-column chunk, byte i holds column i (low nibble) and i + 32 (high): each 4
            // columns' nibbles to `w[(c / 4) * 32 + 4 j]`.
            for (ci, chunk) in row.chunks_exact(32).enumerate() {
                let v = _mm256_loadu_si256(chunk.as_ptr() as *const __m256i);
                _mm256_storeu_si256(q, _mm256_and_si256(v, mask));
                _mm256_storeu_si256(q.add(1), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
                for (i, &v) in quads.iter().enumerate() {
                    // In bounds: step ci * 16 + i < kp / 4 (the row has kp / 2 bytes), row j < 8.
                    std::ptr::write_unaligned(out.add((ci * 16 + i) * STEP) as *mut u32, v);
                }
            }
            for b in 0..nb {
                let k = sub.k[r * ng + b] as i32;
                self.k[b * ROWS + j] = k | (k << 16);
            }
            for sb in 0..nsb {
                self.u[sb * ROWS + j] = sub.unit[r * nsb + sb];
            }
            for g in 0..ng {
                let bias = w.bias().map_or(0.0, |b| b.get(r * ng + g));
                // The scale is `k * u` exactly (the scale array is not read).
                let scale = sub.k[r * ng + g] as f32 * sub.unit[r * nsb + g / SUPER_BLOCKS];
                self.z[g * ROWS + j] = bias + -8.0 * scale;
            }
        }
    }
}

/// `out = round(x W^T)` for `w` that [`takes`] at the AVX2 level, `x` `[n, k]` (matrices without
/// int4 sub-scales go on to [`super::qpanels16_avx2`] (int8) or [`super::qpanels_avx2`]).
///
/// # Panics
/// If [`takes`] is false for `w` and `n` at the AVX2 level, or the sizes do not match.
pub fn matmul(x: &[f32], n: usize, k: usize, w: &QMat, out: &mut [f32], round: DType) {
    assert!(takes(super::QSimd::Avx2, w, n), "qprefill_avx2: needs AVX2 and {MIN_TOKENS} tokens");
    if w.sub_scales().is_none() {
        if w.format == spark_core::quant::QFormat::I8 {
            super::qpanels16_avx2::matmul(x, n, k, w, out, round);
        } else {
            super::qpanels_avx2::matmul(x, n, k, w, out, round);
        }
        return;
    }
    let m = w.rows;
    assert_eq!(out.len(), n * m, "qprefill_avx2: out has the wrong size");
    let act = QAct::quantize_spans(super::QSimd::Avx2, x, n, k, w, SUPER_BLOCKS);
    let (kp, nb, ng) = (w.kp, w.kp / QBLOCK, w.ng);
    run_panels(
        n,
        m,
        |rem| MR.min(rem),
        || Panel::new(w),
        // SAFETY: takes() checked the AVX2 level.
        |panel, p0| unsafe { panel.pack(w, p0) },
        |panel, t, tb, res| {
            let ops = Ops {
                w: panel.w.as_ptr(),
                k: panel.k.as_ptr(),
                u: panel.u.as_ptr(),
                z: panel.z.as_ptr(),
                q: act.q[t * kp..].as_ptr(),
                d: act.d[t * nb..].as_ptr(),
                a: act.a[t * ng..].as_ptr(),
                kp,
                ng,
            };
            // SAFETY: takes() checked AVX2 (with FMA and F16C, QSimd's AVX2 level); the panel
            // holds kp / 4 x 32 bytes, nb x 8 sub-scales, nsb x 8 units and ng x 8 bias terms;
            // `tb` tokens of kp values, nb scales and ng group sums start at the token pointers.
            unsafe {
                match tb {
                    6 => tile::<6>(&ops, res),
                    5 => tile::<5>(&ops, res),
                    4 => tile::<4>(&ops, res),
                    3 => tile::<3>(&ops, res),
                    2 => tile::<2>(&ops, res),
                    _ => tile::<1>(&ops, res),
                }
            }
        },
        out,
        round,
    );
}

/// The panel driver of this module, [`super::qpanels_avx2`] and [`super::qpanels16_avx2`]: rows `0..m` in chunks over
/// the rayon pool; in each chunk, panels of 8 rows packed once (`pack(panel, p0)`), then the
/// `n` tokens in tiles of `pick(remaining)` (at most [`MR`]) through `tile(panel, t, tb,
/// res)`, whose `res[i]` (token `t + i`, the panel's rows) goes to `out` rounded as `round`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_panels<P>(
    n: usize,
    m: usize,
    pick: impl Fn(usize) -> usize + Sync,
    new_panel: impl Fn() -> P + Sync,
    pack: impl Fn(&mut P, usize) + Sync,
    tile: impl Fn(&P, usize, usize, &mut [[f32; ROWS]; MR]) + Sync,
    out: &mut [f32],
    round: DType,
) {
    let chunk = super::row_chunk(m, ROWS);
    let outp = SharedOut(out.as_mut_ptr());
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let r0 = c * chunk;
        let r1 = (r0 + chunk).min(m);
        let mut panel = new_panel();
        for p0 in (r0..r1).step_by(ROWS) {
            pack(&mut panel, p0);
            let rows = ROWS.min(r1 - p0);
            let mut t = 0;
            while t < n {
                let tb = pick(n - t).clamp(1, MR);
                let mut res = [[0.0f32; ROWS]; MR];
                tile(&panel, t, tb, &mut res);
                for (i, r) in res.iter().enumerate().take(tb) {
                    // SAFETY: t + i < n and p0 + rows <= r1 <= m; rows [r0, r1) belong to this
                    // task only.
                    unsafe { outp.put_rounded((t + i) * m + p0, &r[..rows], round) };
                }
                t += tb;
            }
        }
    });
}

/// A micro-kernel call's operands: the panel's, and the first token's (the others follow at
/// `kp` values, `kp / 32` scales and `ng` group sums).
struct Ops {
    w: *const u8,
    k: *const i32,
    u: *const f32,
    z: *const f32,
    q: *const i8,
    d: *const f32,
    a: *const f32,
    kp: usize,
    ng: usize,
}

/// The panel's 8 rows x `T` tokens into `res[t]`.
///
/// Registers: `T` 16-bit and `T` 32-bit accumulators, the weights, the broadcast activations
/// and a product: 15 of the 16 at six tokens, so nothing spills in the block loop (16 rows x 4
/// tokens, with two weight vectors, spilled).
///
/// # Safety
/// AVX2 and FMA; `o` as [`Ops`] describes it for `T` tokens.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<const T: usize>(o: &Ops, res: &mut [[f32; ROWS]; MR]) {
    let nb = o.kp / QBLOCK;
    let nsb = nb.div_ceil(SUPER_BLOCKS);
    let zero = _mm256_setzero_si256();
    let mut facc = [_mm256_setzero_ps(); T];
    for sb in 0..nsb {
        let (b0, b1) = (sb * SUPER_BLOCKS, ((sb + 1) * SUPER_BLOCKS).min(nb));
        let mut iacc = [zero; T];
        for b in b0..b1 {
            let mut acc = [zero; T];
            let wb = o.w.add(b * QBLOCK / 4 * STEP);
            let qb = o.q.add(b * QBLOCK);
            if T == 6 {
                // The 8 steps of the block as [`super::panel_step_6`] writes them, one round.
                // SAFETY: as the loop below: 8 steps of 32 panel bytes from `wb`, each token's 32
                // activation bytes from `qb + t kp`; AVX2 (this function's).
                let a = super::panel_loop_6!(
                    "vpmaddubsw", "vpaddw",
                    [("0", "0"), ("32", "4"), ("64", "8"), ("96", "12"), ("128", "16"), ("160", "20"), ("192", "24"), ("224", "28")],
                    wp: wb, q0: qb, q3: qb.add(3 * o.kp), kp: o.kp, n: 1usize, wstep: "256", qstep: "32"
                );
                acc.copy_from_slice(&a[..T]);
            } else {
                for s in 0..QBLOCK / 4 {
                    let w = _mm256_loadu_si256(wb.add(s * STEP) as *const __m256i);
                    for t in 0..T {
                        let q = std::ptr::read_unaligned(qb.add(t * o.kp + 4 * s) as *const i32);
                        acc[t] = _mm256_add_epi16(acc[t], _mm256_maddubs_epi16(w, _mm256_set1_epi32(q)));
                    }
                }
            }
            let kv = _mm256_loadu_si256(o.k.add(b * ROWS) as *const __m256i);
            for t in 0..T {
                iacc[t] = _mm256_add_epi32(iacc[t], _mm256_madd_epi16(acc[t], kv));
            }
        }
        let u = _mm256_loadu_ps(o.u.add(sb * ROWS));
        for t in 0..T {
            let d = _mm256_set1_ps(*o.d.add(t * nb + b0));
            facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[t]), _mm256_mul_ps(u, d), facc[t]);
        }
    }
    // The zero point and the biases: sum_g (bias - 8 scale) A[t, g].
    for g in 0..o.ng {
        let z = _mm256_loadu_ps(o.z.add(g * ROWS));
        for t in 0..T {
            facc[t] = _mm256_fmadd_ps(z, _mm256_set1_ps(*o.a.add(t * o.ng + g)), facc[t]);
        }
    }
    for t in 0..T {
        _mm256_storeu_ps(res[t].as_mut_ptr(), facc[t]);
    }
}
