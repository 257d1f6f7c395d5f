//! AVX-512 VNNI prefill for quantized weights (x86-64): int8, int6 and int4 with one scale per
//! row or per multiple of 32 columns (what `spark-run quantize` writes, GGUF Q8_0 / Q4_0 /
//! Q4_K; not Q6_K's 16-column groups), from [`MIN_TOKENS`] tokens on, on CPUs with VNNI and
//! without AMX (Zen 4 and later; Ice Lake and later parts without AMX).
//!
//! The weights go in L2-sized bands (about 256 KiB), each repacked once per call into panels of
//! 16 rows, `[kp / 4][16][4]` bytes held as `q + zero` (unsigned, `vpdpbusd`'s first operand:
//! int8 `q + 128`, int6 `q + 32`, int4 its nibbles, `q + 8`), so one 64-byte load gives four
//! columns of 16 rows. A micro-kernel of 2 panels x 6 tokens broadcasts each token's next four
//! int8 activations (read in place from [`QAct`]) against the two panel vectors: 12 `vpdpbusd`
//! of 64 multiply-adds each (twice a `vdpbf16ps`) per 8 loads. Every 32 columns the integer
//! sums go into f32 accumulators held in registers (a conversion and an FMA by the token's
//! scale; for weights with a scale per block, a multiply by the panel's 16 block scales first;
//! with biases, one more FMA: the block biases times the token's block sum), and the sums leave
//! the registers once per tile as rows of output, rounded there. Loops in L1 on one Zen 4 core:
//! 194-201 GMAC/s, against 110-116 for a `vdpbf16ps` tile on bf16 weights
//! ([`super::avx512bf16::prefill`], which these weights took before at 32+ tokens).
//!
//! Precision: exactly the W8A8 / W6A8 / W4A8 product of [`super::qmatmul`]: the activations are
//! [`QAct::quantize`]'s (int8 per 32-block, `d = max|x| / 127`), the weights the stored integer
//! values; each block's integer sum is exact in i32 (`sum (q + zero) a - zero sum a`, the
//! accumulator starting from `-zero *` the token's sum over the block) and is scaled by `d`
//! (and the block's weight scale) in f32, the bias term added as `bias * d * sum a`; a scale
//! per row without biases multiplies the row's sum at the end. Only the f32 summation order
//! differs from the other integer kernels.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use rayon::prelude::*;
use spark_core::quant::QFormat;
use spark_core::DType;

use super::qmatmul::{I6Layout, QAct, QMat, ScaleMode, QBLOCK};
use super::{QSimd, SharedOut};

/// Fewest tokens for this kernel; fewer go to the VNNI integer tiles, which need no repacking
/// ([`super::qmatmul::qmatmul`]). Whole-model int8 and int4 prefill on a 2-vCPU Zen 4 gained
/// from 12 tokens on (+25 % and +20 % there) and were level at 6-8 (docs/BENCHMARKS.md, session
/// 43).
pub const MIN_TOKENS: usize = 12;
/// Rows per panel (one register of i32 sums).
const PANEL: usize = 16;
/// Panels per micro-kernel call.
const P: usize = 2;
/// Tokens per micro-kernel call.
const T: usize = 6;
/// Bytes of weights per band (they stay in L2 while every token runs over them).
const BAND_BYTES: usize = 256 << 10;

/// Whether [`matmul`] takes this product: the VNNI level (with AMX the int8 tiles take it),
/// weights with a scale per row or per multiple of 32 columns (int6 in
/// [`I6Layout::Groups`] only with AVX-512 VBMI), and at least [`MIN_TOKENS`] tokens.
pub fn takes(qs: QSimd, w: &QMat, n: usize) -> bool {
    qs == QSimd::Avx512Vnni
        && QSimd::detect() >= QSimd::Avx512Vnni
        && matches!(w.mode, ScaleMode::Row | ScaleMode::Chunk | ScaleMode::Block | ScaleMode::Pair)
        && !(w.format == QFormat::I6 && w.i6_layout() == I6Layout::Groups && !super::qavx512::vbmi())
        && n >= MIN_TOKENS
}

/// The zero point [`super::qavx512::column_chunk`] adds to a format's values.
fn zero_point(format: QFormat) -> i32 {
    match format {
        QFormat::I8 => 128,
        QFormat::I6 => 32,
        QFormat::I4 => 8,
    }
}

/// `out[t*m + r] = round(sum_j x[t*k + j] * W[r, j])` for the quantized weight `w` (`[m, k]`) and
/// `n` tokens of activations `x` (`[n, k]`), rows split across the rayon pool.
pub fn matmul(x: &[f32], n: usize, k: usize, w: &QMat, out: &mut [f32], round: DType) {
    assert!(takes(QSimd::Avx512Vnni, w, MIN_TOKENS), "VNNI prefill: {w:?} on this CPU");
    let m = w.rows;
    assert_eq!(out.len(), n * m, "VNNI prefill: out has the wrong size");
    if n == 0 {
        return;
    }
    let act = QAct::quantize(x, n, k, w);
    let kp = w.kp;
    let (kq, nb) = (kp / 4, kp / QBLOCK);
    let zero = zero_point(w.format);
    // Per token and block: `-zero *` the sum of its int8 values (the accumulators' start) and,
    // for the bias term, that sum times the block's scale.
    let sums: Vec<i32> = act.s4.chunks_exact(QBLOCK / 4).map(|s| s.iter().sum::<i32>()).collect();
    let starts: Vec<i32> = sums.iter().map(|&s| -zero * s).collect();
    let bias = w.bias().is_some();
    let asums: Vec<f32> =
        if bias { sums.iter().zip(&act.d).map(|(&s, &d)| d * s as f32).collect() } else { Vec::new() };
    // A scale per row is applied after the sum, unless a bias term joins it.
    let grouped = w.mode != ScaleMode::Row || bias;
    let rows = P * PANEL;
    let band = (BAND_BYTES / kp).max(1).div_ceil(rows) * rows;
    let chunk = super::row_chunk(m, rows);
    let outp = SharedOut(out.as_mut_ptr());
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let (r0, r1) = (c * chunk, (c * chunk + chunk).min(m));
        let panels = band.min(r1 - r0).div_ceil(rows) * P;
        let mut held = HeldBand::new(panels, kq, nb, w.ng, grouped, bias);
        for b0 in (r0..r1).step_by(band) {
            let b1 = (b0 + band).min(r1);
            held.fill(w, b0, b1);
            for t0 in (0..n).step_by(T) {
                let nt = T.min(n - t0);
                // Tokens past n repeat the last one; their sums are discarded.
                let tok = |i: usize| t0 + i.min(nt - 1);
                let xq: [*const i8; T] = std::array::from_fn(|i| act.q_row(tok(i)).as_ptr());
                let d: [*const f32; T] = std::array::from_fn(|i| act.d_row(tok(i)).as_ptr());
                let st: [*const i32; T] = std::array::from_fn(|i| starts[tok(i) * nb..].as_ptr());
                let ab: [*const f32; T] =
                    std::array::from_fn(|i| if bias { asums[tok(i) * nb..].as_ptr() } else { std::ptr::null() });
                for p0 in (0..(b1 - b0).div_ceil(PANEL)).step_by(P) {
                    let pan: [*const u8; P] = std::array::from_fn(|i| held.panel(p0 + i));
                    let bs: [*const f32; P] = std::array::from_fn(|i| held.block_scales(p0 + i));
                    let rs: [*const f32; P] = std::array::from_fn(|i| held.row_scales(p0 + i));
                    let bb: [*const f32; P] = std::array::from_fn(|i| held.block_biases(p0 + i));
                    let sides = Sides { bs, rs, bb, d, st, ab };
                    // Rows p0 * 16.. of the band, for tokens t0..t0 + nt.
                    let dst = Dst {
                        out: outp,
                        m,
                        row: b0 + p0 * PANEL,
                        rows: b1 - b0 - p0 * PANEL,
                        token: t0,
                        tokens: nt,
                        round,
                    };
                    // SAFETY: takes() (asserted) checked AVX512F/BW/VNNI; each panel holds kq
                    // quads of 16 rows, each block scale and bias pointer nb * 16 values
                    // (grouped, with a bias), each row scale pointer 16; each token pointer kp
                    // values, nb scales, nb starts and (with a bias) nb sums; dst's cells are
                    // inside `out` and in rows [r0, r1), this task's alone.
                    unsafe {
                        match (grouped, bias) {
                            (false, _) => tile::<false, false>(&pan, &sides, nb, &xq, dst),
                            (true, false) => tile::<true, false>(&pan, &sides, nb, &xq, dst),
                            (true, true) => tile::<true, true>(&pan, &sides, nb, &xq, dst),
                        }
                    }
                }
            }
        }
    });
}

/// One band of weight rows repacked for [`tile`].
struct HeldBand {
    kq: usize,
    nb: usize,
    /// `[panel][kq][16][4]` bytes, `q + zero` (rows past the band: zeros).
    data: Vec<u8>,
    /// `[panel][nb][16]` weight scales per 32-block (grouped weights; else empty).
    block: Vec<f32>,
    /// `[panel][nb][16]` weight biases per 32-block (weights with biases; else empty).
    bias: Vec<f32>,
    /// `[panel][16]` weight scales per row (1 for grouped weights; 0 past the band).
    row: Vec<f32>,
    /// One row's scales or biases per group (scratch).
    row_sides: Vec<f32>,
}

impl HeldBand {
    fn new(panels: usize, kq: usize, nb: usize, ng: usize, grouped: bool, bias: bool) -> HeldBand {
        HeldBand {
            kq,
            nb,
            data: vec![0; panels * kq * 64],
            block: vec![0.0; if grouped { panels * nb * PANEL } else { 0 }],
            bias: vec![0.0; if bias { panels * nb * PANEL } else { 0 }],
            row: vec![0.0; panels * PANEL],
            row_sides: vec![0.0; ng],
        }
    }

    /// Repack rows `b0..b1` of `w` (at most the band's panels).
    fn fill(&mut self, w: &QMat, b0: usize, b1: usize) {
        let (kq, nb) = (self.kq, self.nb);
        let (scales, groups) = (w.scales(), w.half_groups());
        let grouped = !self.block.is_empty();
        let panels = self.row.len() / PANEL;
        let rb = w.row_bytes();
        for p in 0..panels {
            let pr = b0 + p * PANEL;
            let live = b1.saturating_sub(pr).min(PANEL);
            let src: [*const u8; PANEL] = std::array::from_fn(|i| {
                if i < live {
                    w.packed_ptr().wrapping_add((pr + i) * rb)
                } else {
                    std::ptr::null()
                }
            });
            // SAFETY: takes() checked AVX512F/BW/VNNI (and VBMI for int6 groups); each live
            // row pointer starts a packed row of kp columns in w's buffer (with the slack int6
            // reads past a chunk), the others are null; the panel holds kq * 64 bytes.
            unsafe { pack_panel(w, &src, &mut self.data[p * kq * 64..][..kq * 64]) };
            for (i, s) in self.row[p * PANEL..][..PANEL].iter_mut().enumerate() {
                *s = if i >= live {
                    0.0
                } else if grouped {
                    1.0
                } else {
                    scales.get(pr + i)
                };
            }
            // Each live row's scales and biases (a row at a time: grids convert a super-block
            // per unit), spread to its 32-blocks.
            for (side, held) in [(Some(scales), &mut self.block), (w.bias(), &mut self.bias)] {
                let Some(side) = side.filter(|_| !held.is_empty()) else { continue };
                let held = &mut held[p * nb * PANEL..][..nb * PANEL];
                held.fill(0.0);
                for i in 0..live {
                    side.get_into((pr + i) * w.ng, &mut self.row_sides[..w.ng]);
                    for (b, bs) in held.chunks_exact_mut(PANEL).enumerate() {
                        bs[i] = self.row_sides[groups[2 * b] as usize];
                    }
                }
            }
        }
    }

    fn panel(&self, p: usize) -> *const u8 {
        self.data[p * self.kq * 64..].as_ptr()
    }
    fn block_scales(&self, p: usize) -> *const f32 {
        side_at(&self.block, p * self.nb * PANEL)
    }
    fn block_biases(&self, p: usize) -> *const f32 {
        side_at(&self.bias, p * self.nb * PANEL)
    }
    fn row_scales(&self, p: usize) -> *const f32 {
        self.row[p * PANEL..].as_ptr()
    }
}

/// `v[i..]` as a pointer; null when `v` is not held (empty).
fn side_at(v: &[f32], i: usize) -> *const f32 {
    if v.is_empty() {
        std::ptr::null()
    } else {
        v[i..].as_ptr()
    }
}

/// 16 packed rows of `w` (null: zeros) as one panel: `dst[(j * 16 + r) * 4..][..4]` = quad `j`
/// of row `r`, each value `q + zero` ([`super::qavx512::column_chunk`]).
///
/// # Safety
/// AVX512F/BW/VNNI (and VBMI for int6 in groups); each non-null pointer starts a packed row of
/// `w` with its slack; `dst.len() == 16 * w.kp`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn pack_panel(w: &QMat, src: &[*const u8; PANEL], dst: &mut [u8]) {
    let dp = dst.as_mut_ptr();
    let (format, i6) = (w.format, w.i6_layout());
    for c in 0..w.kp / 64 {
        let mut v = [_mm512_setzero_si512(); 16];
        for (r, vr) in v.iter_mut().enumerate() {
            if !src[r].is_null() {
                *vr = super::qavx512::column_chunk(format, i6, src[r], c);
            }
        }
        let cols = super::amx::transpose16(v);
        for (j, col) in cols.iter().enumerate() {
            _mm512_storeu_si512(dp.add((c * 16 + j) * 64) as *mut _, *col);
        }
    }
}

/// Where a tile's sums go: rows `row..row + min(rows, 32)` of tokens `token..token + tokens`.
#[derive(Clone, Copy)]
struct Dst {
    out: SharedOut,
    m: usize,
    row: usize,
    rows: usize,
    token: usize,
    tokens: usize,
    round: DType,
}

/// The scales, sums and biases a [`tile`] reads (see [`matmul`]'s SAFETY for their extents).
struct Sides {
    /// Per panel: block scales (grouped), row scales, block biases (with a bias).
    bs: [*const f32; P],
    rs: [*const f32; P],
    bb: [*const f32; P],
    /// Per token: block scales, accumulator starts, block sums (with a bias).
    d: [*const f32; T],
    st: [*const i32; T],
    ab: [*const f32; T],
}

/// [`P`] panels x [`T`] tokens over `nb` 32-blocks: per block, the accumulators start from the
/// tokens' starts, each quad of the block is broadcast from every token against the panel
/// vectors, and the block's sums go into f32 accumulators times the token's scale (when
/// `GROUPED`, times the panel's block scales first; with `BIAS`, plus the block biases times
/// the token's block sum). The sums times the row scales, rounded, go to `dst`.
///
/// # Safety
/// AVX512F/BW/VNNI; each `pan[p]` holds `8 nb` quads of 16 rows; in `sd`, each panel's block
/// scales (when `GROUPED`) and biases (with `BIAS`) `16 nb` values, row scales 16; each
/// token's `xq` `32 nb` values, scales and starts (and sums, with `BIAS`) `nb`; `dst`'s live
/// cells are inside the output and this thread's alone.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<const GROUPED: bool, const BIAS: bool>(
    pan: &[*const u8; P],
    sd: &Sides,
    nb: usize,
    xq: &[*const i8; T],
    dst: Dst,
) {
    let mut f = [[_mm512_setzero_ps(); T]; P];
    for blk in 0..nb {
        let mut a = [[_mm512_setzero_si512(); T]; P];
        for t in 0..T {
            let s = _mm512_set1_epi32(*sd.st[t].add(blk));
            for p in 0..P {
                a[p][t] = s;
            }
        }
        for j in 8 * blk..8 * blk + 8 {
            let mut wv = [_mm512_setzero_si512(); P];
            for p in 0..P {
                wv[p] = _mm512_loadu_si512(pan[p].add(64 * j) as *const _);
            }
            for t in 0..T {
                let xv = _mm512_set1_epi32((xq[t].add(4 * j) as *const i32).read_unaligned());
                for p in 0..P {
                    a[p][t] = _mm512_dpbusd_epi32(a[p][t], wv[p], xv);
                }
            }
        }
        for p in 0..P {
            let sc = if GROUPED { _mm512_loadu_ps(sd.bs[p].add(blk * PANEL)) } else { _mm512_setzero_ps() };
            let bv = if BIAS { _mm512_loadu_ps(sd.bb[p].add(blk * PANEL)) } else { _mm512_setzero_ps() };
            for t in 0..T {
                let mut v = _mm512_cvtepi32_ps(a[p][t]);
                if GROUPED {
                    v = _mm512_mul_ps(v, sc);
                }
                f[p][t] = _mm512_fmadd_ps(v, _mm512_set1_ps(*sd.d[t].add(blk)), f[p][t]);
                if BIAS {
                    f[p][t] = _mm512_fmadd_ps(bv, _mm512_set1_ps(*sd.ab[t].add(blk)), f[p][t]);
                }
            }
        }
    }
    for p in 0..P {
        let live = dst.rows.saturating_sub(p * PANEL).min(PANEL);
        if live == 0 {
            continue;
        }
        let mask: __mmask16 = if live == PANEL { !0 } else { (1u16 << live) - 1 };
        let r = _mm512_loadu_ps(sd.rs[p]);
        // Constant indices (t < T, tested inside), so that `f` stays in registers.
        for t in 0..T {
            if t >= dst.tokens {
                break;
            }
            let mut v = _mm512_mul_ps(f[p][t], r);
            let o = dst.out.get().add((dst.token + t) * dst.m + dst.row + p * PANEL);
            match dst.round {
                DType::F32 => {}
                DType::BF16 => {
                    let high = _mm512_and_si512(super::amx::round_bf16_high(v), _mm512_set1_epi32(!0xffff));
                    v = _mm512_castsi512_ps(high);
                }
                DType::F16 => {
                    let mut tmp = [0.0f32; PANEL];
                    _mm512_storeu_ps(tmp.as_mut_ptr(), v);
                    for x in tmp.iter_mut() {
                        *x = DType::F16.round(*x);
                    }
                    v = _mm512_loadu_ps(tmp.as_ptr());
                }
            }
            _mm512_mask_storeu_ps(o, mask, v);
        }
    }
}
