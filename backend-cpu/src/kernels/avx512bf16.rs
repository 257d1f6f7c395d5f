//! AVX-512 BF16 small-batch matmul (x86-64): bf16 weights times bf16-valued activations with
//! `vdpbf16ps`, for batches of 1-15 tokens on CPUs with AVX512_BF16 but without AMX (Zen 4 and
//! later; with AMX the tile kernel is faster at every batch size, see `matmul::bf16_dot_takes`).
//!
//! Each `vdpbf16ps` multiplies 32 bf16 weights of a row by 32 bf16 activations of a token and
//! adds the 16 pair sums into 16 f32 lanes, so the weights need no conversion and no repack:
//! rows are read in place, every weight byte streamed once per call. One token reads a row at
//! a time (one address stream per thread, which the hardware prefetcher follows); more go in
//! blocks of up to four tokens over four rows, while the next rows are prefetched
//! (`Prefetcher`; later token blocks find these rows in L1).
//!
//! Prefill ([`prefill`], 16 tokens and more, the `Avx512` level) turns the product around: the
//! activations are transposed once per call into blocks of 32 tokens, `[k / 2][32]` bf16 pairs
//! (two 16-lane vectors per column pair), and a micro-kernel of 12 weight rows x 32 tokens
//! broadcasts each row's column pair from the held weights (`vdpbf16ps` with a 32-bit
//! broadcast) against the two token vectors: 24 accumulators, 14 loads per 24 instructions of
//! 32 multiply-adds each, twice the f32 panel kernel's multiply-adds per instruction. Rows go in
//! L2-sized bands (about 256 KiB of weights) that every token block sweeps before the next band,
//! so the weights come from memory once per call; each band is first copied (bf16) or
//! dequantized (int8/int6/int4) into a buffer whose rows are 64 bytes longer than `k`: rows
//! 4 KiB apart in place (k = 2048) put the tile's 12 broadcast streams in one L1 set of 8 ways
//! (the padding: +7-12 % whole-model pp512 on a Zen 4, bf16 and int8).
//!
//! Precision: a product of two bf16 values is exact in f32, and the sums are f32, as in the
//! float GEMV; only the summation order differs (and inputs below 2^-126 count as zero, which
//! the instruction does: no bf16 activation or weight of a real checkpoint is that small).
//! The activations must hold bf16 values (the graph rounds them when the output rounding is
//! bf16); they are converted to bf16 bits once per call.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::sync::OnceLock;

use spark_core::DType;

use super::qmatmul::QMat;
use super::{Prefetcher, SharedOut};

/// bf16 values per step (one 64-byte register).
const KS: usize = 32;

/// Whether this CPU has AVX512F, AVX512BW and AVX512_BF16 (cached).
pub fn available() -> bool {
    static A: OnceLock<bool> = OnceLock::new();
    *A.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
    })
}

/// `x` (`[n, k]`, bf16 values held in f32) as bf16 bits, each row padded to a multiple of
/// [`KS`] with zeros.
fn pack_activations(x: &[f32], n: usize, k: usize) -> (Vec<u16>, usize) {
    let kp = k.div_ceil(KS) * KS;
    let mut xb = vec![0u16; n * kp];
    for (dst, src) in xb.chunks_exact_mut(kp).zip(x.chunks_exact(k)) {
        for (d, &v) in dst.iter_mut().zip(src) {
            *d = (spark_core::dtype::round_bf16(v).to_bits() >> 16) as u16;
        }
    }
    (xb, kp)
}

/// `out[t*m + r] = round(sum_j x[t*k + j] * W[r, j])` for bf16 `w` `[m, k]` and `n` tokens, rows
/// split across the rayon pool.
///
/// # Safety
/// [`available`] returned true.
pub unsafe fn matmul(x: &[f32], n: usize, k: usize, w: &[u16], m: usize, out: &mut [f32], round: DType) {
    use rayon::prelude::*;
    assert_eq!(x.len(), n * k, "bf16 matmul: x has the wrong size");
    assert_eq!(w.len(), m * k, "bf16 matmul: w has the wrong size");
    assert_eq!(out.len(), n * m, "bf16 matmul: out has the wrong size");
    if n == 0 || m == 0 {
        return;
    }
    let (xb, kp) = pack_activations(x, n, k);
    let chunk = super::row_chunk(m, 16);
    let outp = SharedOut(out.as_mut_ptr());
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let (r0, r1) = (c * chunk, (c * chunk + chunk).min(m));
        // SAFETY: available() (caller); rows r0..r1 lie in w; xb holds n rows of kp; this task
        // alone writes rows r0..r1 of every token.
        unsafe { rows(&xb, kp, n, w, k, r0, r1, outp, m, round) };
    });
}

/// Rows `r0..r1` for all `n` tokens into `out[t*m + r]`.
///
/// # Safety
/// AVX512F/BW/BF16; `w` holds rows `r0..r1` of `k`; `xb` holds `n` rows of `kp >= k` (multiple
/// of [`KS`], zero padded); `out` cells `t*m + r` for these rows are this caller's alone.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows(
    xb: &[u16],
    kp: usize,
    n: usize,
    w: &[u16],
    k: usize,
    r0: usize,
    r1: usize,
    out: SharedOut,
    m: usize,
    round: DType,
) {
    if n == 1 {
        let ahead = decode_prefetch_ahead();
        for r in r0..r1 {
            let wr = w.as_ptr().add(r * k);
            let dot = match ahead {
                Some(d) => row_dot::<true>(xb.as_ptr(), wr, k, d),
                None => row_dot::<false>(xb.as_ptr(), wr, k, 0),
            };
            out.put(r, round.round(dot));
        }
        return;
    }
    let mut r = r0;
    while r < r1 {
        // Four rows x four tokens.
        let nr = match r1 - r {
            left if left >= 4 => 4,
            _ => 1,
        };
        let mut t = 0;
        while t < n {
            let nt = (n - t).min(4);
            // While the first token block streams these rows from memory, the next rows stream
            // in (later blocks find these rows in L1).
            let pf = if t == 0 {
                Prefetcher::rows(w.as_ptr() as *const u8, 2 * k, r + nr, (r1 - r - nr).min(nr), k.div_ceil(KS))
            } else {
                Prefetcher::none()
            };
            let args = Tile { w: w.as_ptr().add(r * k), k, x: xb.as_ptr().add(t * kp), kp, pf };
            macro_rules! go {
                ($r:literal, $t:literal) => {{
                    let o = tile::<$r, $t>(&args);
                    for (j, row) in o.iter().enumerate() {
                        for (i, &v) in row.iter().enumerate() {
                            out.put((t + i) * m + r + j, round.round(v));
                        }
                    }
                }};
            }
            super::tile_shape!(nr, nt, go);
            t += nt;
        }
        r += nr;
    }
}

/// How far ahead in its rows the one-token GEMV prefetches (bytes), if at all: 4 KiB on Intel
/// cores. There the hardware prefetcher alone left a thread's stream short: on an Emerald Rapids
/// VM, whole-model bf16 tg48 (2 threads) went from a median 4.92 to 5.84 tok/s over three
/// alternations, faster in each (a first version that prefetched a row's lines at its start
/// gained as much in seven of seven; 8 KiB ahead no more than 4; docs/BENCHMARKS.md, session
/// 47). On Zen 4, session 44 measured the plain stream as the fastest, so AMD cores keep it.
/// `SPARK_DECODE_PREFETCH=BYTES` (0: none) overrides the vendor rule.
fn decode_prefetch_ahead() -> Option<usize> {
    static A: OnceLock<Option<usize>> = OnceLock::new();
    *A.get_or_init(|| {
        let bytes = match std::env::var("SPARK_DECODE_PREFETCH").ok().and_then(|v| v.parse().ok()) {
            Some(b) => b,
            None if super::matmul::cpu_vendor_is_intel() => 4096,
            None => 0,
        };
        (bytes > 0).then_some(bytes)
    })
}

/// One token's dot product with one row: `sum_j x[j] * w[j]` over `k` bf16 (`x` zero padded to
/// a multiple of [`KS`]), two accumulators of 64 bytes. With `PF`, each 128-byte step also
/// prefetches the two lines `ahead` bytes past it (past the last row they are lines of other
/// rows or of nothing: a prefetch never faults).
///
/// A decode GEMV reads the rows one after the other, so each thread streams one run of
/// addresses and the hardware prefetcher follows it across page boundaries. Four or eight rows
/// at once with software prefetch (this file's tiles, the AVX2 GEMV) streamed 10-15 % slower on
/// one thread of a Zen 4 from 4 KiB pages (docs/BENCHMARKS.md, session 44); Intel cores gain
/// from the prefetch on the one stream ([`decode_prefetch_ahead`]).
///
/// # Safety
/// AVX512F/BW/BF16; `w` points at `k` readable bf16, `x` at `k.div_ceil(KS) * KS`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn row_dot<const PF: bool>(x: *const u16, w: *const u16, k: usize, ahead: usize) -> f32 {
    let load = |p: *const u16| -> __m512bh { std::mem::transmute(_mm512_loadu_si512(p as *const _)) };
    let mut a0 = _mm512_setzero_ps();
    let mut a1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 2 * KS <= k {
        if PF {
            // A prefetch is a hint: it does not fault, whatever the address.
            let p = (w.add(i) as *const i8).wrapping_add(ahead);
            _mm_prefetch::<_MM_HINT_T0>(p);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
        }
        a0 = _mm512_dpbf16_ps(a0, load(w.add(i)), load(x.add(i)));
        a1 = _mm512_dpbf16_ps(a1, load(w.add(i + KS)), load(x.add(i + KS)));
        i += 2 * KS;
    }
    while i < k {
        // The row tail: only the valid bf16 (the activations' padding is zero too).
        let mask: __mmask32 = if k - i >= KS { u32::MAX } else { (1u32 << (k - i)) - 1 };
        let wv: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, w.add(i) as *const i16));
        a0 = _mm512_dpbf16_ps(a0, wv, load(x.add(i)));
        i += KS;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(a0, a1))
}

/// One register tile's operands.
struct Tile {
    /// The first row (rows `k` apart).
    w: *const u16,
    k: usize,
    /// The first token's packed activations (tokens `kp` apart).
    x: *const u16,
    kp: usize,
    pf: Prefetcher,
}

/// `R` rows x `T` tokens over all `k` columns (the last step masked).
///
/// # Safety
/// AVX512F/BW/BF16; `a` describes `R` rows of `k` bf16 and `T` token rows of `kp` bf16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<const R: usize, const T: usize>(a: &Tile) -> [[f32; T]; R] {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let steps = a.k.div_ceil(KS);
    let full = a.k / KS;
    let mut pf = a.pf.cursor();
    for s in 0..steps {
        pf.advance();
        let mut wv = [_mm512_setzero_si512(); R];
        if s < full {
            for r in 0..R {
                wv[r] = _mm512_loadu_si512(a.w.add(r * a.k + s * KS) as *const _);
            }
        } else {
            // The row tail: only the k % 32 valid bf16 (the activations' padding is zero too).
            let mask: __mmask32 = (1u32 << (a.k % KS)) - 1;
            for r in 0..R {
                wv[r] = _mm512_maskz_loadu_epi16(mask, a.w.add(r * a.k + s * KS) as *const i16);
            }
        }
        for t in 0..T {
            let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(a.x.add(t * a.kp + s * KS) as *const _));
            for r in 0..R {
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], std::mem::transmute::<__m512i, __m512bh>(wv[r]), xv);
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
    out
}

/// Weight rows per prefill micro-kernel call.
pub const PREFILL_ROWS: usize = 12;
/// Tokens per prefill block (two 16-lane vectors).
pub const PREFILL_TOKENS: usize = 32;
/// Bytes of weight rows per band: the band stays in L2 while every token block sweeps it.
const BAND_BYTES: usize = 256 << 10;

/// `x` (`[n, k]`, bf16 values held in f32) transposed into blocks of [`PREFILL_TOKENS`] tokens:
/// block `b` holds `[pairs][32]` u32, each the bf16 bits of columns `2j` (low half) and `2j + 1`
/// (high half) of one token; columns past `k` and tokens past `n` are zero.
///
/// # Safety
/// AVX512F and AVX512BW are present ([`available`] returned true).
unsafe fn transpose_activations(x: &[f32], n: usize, k: usize) -> Vec<u32> {
    use rayon::prelude::*;
    let pairs = k.div_ceil(2);
    let block = pairs * PREFILL_TOKENS;
    let mut xt = vec![0u32; n.div_ceil(PREFILL_TOKENS) * block];
    let bits = |v: f32| spark_core::dtype::round_bf16(v).to_bits() >> 16;
    xt.par_chunks_mut(block).enumerate().for_each(|(b, dst)| {
        let t0 = b * PREFILL_TOKENS;
        let t1 = (t0 + PREFILL_TOKENS).min(n);
        // Groups of 16 tokens, 32 columns at a time, in registers; the rest one by one.
        let mut vector_cols = 0;
        for g in (t0..t1).step_by(16).filter(|g| g + 16 <= t1) {
            vector_cols = k / 32 * 32;
            // SAFETY: AVX512F/BW (this function's contract); rows g..g + 16 of x hold k values;
            // dst holds pairs * 32 from lane g - t0 on.
            unsafe { transpose16_tokens(&x[g * k..(g + 16) * k], k, &mut dst[g - t0..]) };
        }
        for t in t0..t1 {
            let row = &x[t * k..(t + 1) * k];
            let lane = t - t0;
            let cols = if lane < (t1 - t0) / 16 * 16 { vector_cols } else { 0 };
            for (j, pair) in row.chunks(2).enumerate().skip(cols / 2) {
                let hi = pair.get(1).map_or(0, |&v| bits(v));
                dst[j * PREFILL_TOKENS + lane] = bits(pair[0]) | (hi << 16);
            }
        }
    });
    xt
}

/// The first `k / 32 * 32` columns of 16 token rows `x` (`[16][k]` f32) rounded to bf16 pairs
/// and transposed: `dst[j * 32 + t]` = pair `j` of token `t` (as [`transpose_activations`]).
///
/// # Safety
/// AVX512F/BW; `x.len() == 16 * k`; `dst` holds `(k / 2 - 1) * 32 + 16` values.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn transpose16_tokens(x: &[f32], k: usize, dst: &mut [u32]) {
    let (xp, dp) = (x.as_ptr(), dst.as_mut_ptr());
    for c in (0..k / 32 * 32).step_by(32) {
        let mut v = [_mm512_setzero_si512(); 16];
        for (t, vt) in v.iter_mut().enumerate() {
            let row = xp.add(t * k + c);
            // Pairs c/2 .. c/2 + 16 of token t, each rounded as round_bf16.
            *vt = super::amx::round_pairs(_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16)));
        }
        let cols = super::amx::transpose16(v);
        for (j, col) in cols.iter().enumerate() {
            _mm512_storeu_si512(dp.add((c / 2 + j) * PREFILL_TOKENS) as *mut _, *col);
        }
    }
}

/// The weights of a [`prefill`]: bf16 rows copied, or quantized rows dequantized to bf16,
/// one band at a time ([`QMat::dequant_bf16`]: the exact dequantized value rounded to bf16,
/// relative error at most 2^-9 per weight, as the AMX tiles take them).
#[derive(Clone, Copy)]
pub enum PrefillWeights<'a> {
    Bf16(&'a [u16]),
    Quant(&'a QMat),
}

/// Whether [`prefill`] takes these quantized weights: its dequantization works on 16 columns at
/// a time.
pub fn prefill_supports(w: &QMat) -> bool {
    w.cols.is_multiple_of(16)
}

/// Prefill: `out[t*m + r] = round(sum_j x[t*k + j] * W[r, j])` for `w` `[m, k]` and
/// bf16-valued activations, `n` of any size (16 and more is where it pays), rows split across
/// the rayon pool (see the module doc for the blocking).
///
/// # Safety
/// [`available`] returned true.
pub unsafe fn prefill(x: &[f32], n: usize, k: usize, w: PrefillWeights<'_>, m: usize, out: &mut [f32], round: DType) {
    use rayon::prelude::*;
    assert_eq!(x.len(), n * k, "bf16 prefill: x has the wrong size");
    match w {
        PrefillWeights::Bf16(w) => assert_eq!(w.len(), m * k, "bf16 prefill: w has the wrong size"),
        PrefillWeights::Quant(q) => {
            assert!(q.rows == m && q.cols == k && prefill_supports(q), "bf16 prefill: w has the wrong shape")
        }
    }
    assert_eq!(out.len(), n * m, "bf16 prefill: out has the wrong size");
    if n == 0 || m == 0 || k == 0 {
        out.fill(0.0);
        return;
    }
    // SAFETY: available() (this function's contract) covers AVX512F/BW.
    let xt = unsafe { transpose_activations(x, n, k) };
    let block = k.div_ceil(2) * PREFILL_TOKENS;
    // Bands and tasks in multiples of 48 rows: whole tiles, and whole 64-byte lines of output.
    const ALIGN: usize = 48;
    let band = (BAND_BYTES / (2 * k)).max(1).div_ceil(ALIGN) * ALIGN;
    let chunk = super::row_chunk(m, ALIGN);
    let outp = SharedOut(out.as_mut_ptr());
    // The held rows' stride: 64 bytes past `k`, so that the tile's 12 rows do not share an L1
    // set when `2k` is a multiple of 4 KiB (k = 2048: 8 ways for 12 rows; +7-12 % pp512).
    let ks = k + 32;
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let (r0, r1) = (c * chunk, (c * chunk + chunk).min(m));
        // The band's rows, bf16, `ks` apart (copied or dequantized).
        let mut held = vec![0u16; band.min(r1 - r0) * ks];
        // One token block's outputs for the band, `[token][band row]`, written out together
        // (rows of a dozen outputs per token cost 4-5 % of prefill in partial cache lines).
        let sw = band.min(r1 - r0);
        let mut stage = vec![0.0f32; PREFILL_TOKENS * sw];
        for b0 in (r0..r1).step_by(band) {
            let b1 = (b0 + band).min(r1);
            // The band's first row, rows k apart.
            for (i, row) in held.chunks_exact_mut(ks).take(b1 - b0).enumerate() {
                match w {
                    PrefillWeights::Bf16(w) => row[..k].copy_from_slice(&w[(b0 + i) * k..][..k]),
                    PrefillWeights::Quant(q) => q.dequant_bf16(b0 + i, 0, &mut row[..k]),
                }
            }
            let base = held.as_ptr();
            // With one block of at most 16 tokens, the next band of bf16 rows streams into L2
            // while the tiles run over this one, a share per tile, so that copying it into
            // `held` reads from L2. At 16 tokens the copy from memory, not overlapped, had been a
            // third of the time (pp16 +15-30 %). With more tokens the copy is a smaller part, and
            // the prefetching tile of 32 tokens ran slower (pp24 -25 %; its 24 accumulators and 12 row
            // pointers leave no registers for the prefetch cursor).
            let fetch = n <= 16;
            let (next, next_rows) = (b1, (b1 + band).min(r1) - b1);
            let tiles = (b1 - b0).div_ceil(PREFILL_ROWS);
            let share = next_rows.div_ceil(tiles);
            for (tb, xb) in xt.chunks_exact(block).enumerate() {
                let t0 = tb * PREFILL_TOKENS;
                let nt = PREFILL_TOKENS.min(n - t0);
                for (i, p0) in (b0..b1).step_by(PREFILL_ROWS).enumerate() {
                    let nr = PREFILL_ROWS.min(b1 - p0);
                    let first = (i * share).min(next_rows);
                    let pf = match w {
                        PrefillWeights::Bf16(w) if fetch => Prefetcher::rows(
                            w.as_ptr() as *const u8,
                            2 * k,
                            next + first,
                            share.min(next_rows - first),
                            k.div_ceil(2),
                        ),
                        _ => Prefetcher::none(),
                    };
                    // Rows past the band repeat its last row; their sums are discarded.
                    let rows: [*const u16; PREFILL_ROWS] =
                        std::array::from_fn(|i| base.add((p0 - b0 + i.min(nr - 1)) * ks));
                    let mut acc = [[0.0f32; PREFILL_TOKENS]; PREFILL_ROWS];
                    // bf16 output is rounded in the tile, 16 sums at a time.
                    let bf16 = round == DType::BF16;
                    // SAFETY: available() (caller); each row pointer starts a k-long row of the
                    // band in `held`; xb is one transposed block of k.div_ceil(2) column pairs.
                    match (nt > 16, fetch) {
                        (true, _) => unsafe { prefill_tile::<2, false>(&rows, k, xb, bf16, pf, &mut acc) },
                        (false, true) => unsafe { prefill_tile::<1, true>(&rows, k, xb, bf16, pf, &mut acc) },
                        (false, false) => unsafe { prefill_tile::<1, false>(&rows, k, xb, bf16, pf, &mut acc) },
                    }
                    for (j, a) in acc.iter().enumerate().take(nr) {
                        for (t, &v) in a.iter().enumerate().take(nt) {
                            stage[t * sw + p0 - b0 + j] = v;
                        }
                    }
                }
                let left = if round == DType::BF16 { DType::F32 } else { round };
                for t in 0..nt {
                    // SAFETY: t0 + t < n, b1 <= r1 <= m; rows [r0, r1) belong to this task.
                    unsafe { outp.put_rounded((t0 + t) * m + b0, &stage[t * sw..][..b1 - b0], left) };
                }
            }
        }
    });
}

/// [`PREFILL_ROWS`] rows x `16 V` tokens over all `k` columns: per column pair, each row's pair
/// broadcast against the `V` token vectors of the transposed block `xb`. Writes `acc[r][t]` for
/// `t < 16 V`, rounded to bf16 as [`spark_core::dtype::round_bf16`] when `bf16`. With `PF`, `pf`'s
/// lines are fetched into L2 over the `k / 2` column steps (otherwise `pf` is not read).
///
/// # Safety
/// AVX512F/BW/BF16; each `rows[r]` has `k` readable bf16; `xb` holds `k.div_ceil(2) * 32` u32.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::needless_range_loop)]
unsafe fn prefill_tile<const V: usize, const PF: bool>(
    rows: &[*const u16; PREFILL_ROWS],
    k: usize,
    xb: &[u32],
    bf16: bool,
    pf: Prefetcher,
    acc: &mut [[f32; PREFILL_TOKENS]; PREFILL_ROWS],
) {
    let mut a = [[_mm512_setzero_ps(); V]; PREFILL_ROWS];
    let xp = xb.as_ptr();
    let mut pf = pf.cursor();
    // One column pair `$j`: the token vectors, then each row's pair `$wpair(r)` broadcast.
    macro_rules! step {
        ($j:expr, $wpair:expr) => {{
            let mut xv = [_mm512_setzero_si512(); V];
            for v in 0..V {
                xv[v] = _mm512_loadu_si512(xp.add($j * PREFILL_TOKENS + 16 * v) as *const _);
            }
            for r in 0..PREFILL_ROWS {
                let wv: __m512bh = std::mem::transmute(_mm512_set1_epi32($wpair(r) as i32));
                for v in 0..V {
                    a[r][v] = _mm512_dpbf16_ps(a[r][v], wv, std::mem::transmute::<__m512i, __m512bh>(xv[v]));
                }
            }
        }};
    }
    let full = k / 2;
    for j in 0..full {
        if PF {
            pf.advance();
        }
        // Unaligned 32-bit reads of columns 2j and 2j + 1 (low half first, as the activations).
        step!(j, |r: usize| (rows[r].add(2 * j) as *const u32).read_unaligned());
    }
    if k % 2 == 1 {
        // The last column alone: its partner would be the next row's first weight.
        step!(full, |r: usize| *rows[r].add(k - 1) as u32);
    }
    for r in 0..PREFILL_ROWS {
        for v in 0..V {
            let mut sum = a[r][v];
            if bf16 {
                let high = _mm512_and_si512(super::amx::round_bf16_high(sum), _mm512_set1_epi32(!0xffff));
                sum = _mm512_castsi512_ps(high);
            }
            _mm512_storeu_ps(acc[r].as_mut_ptr().add(16 * v), sum);
        }
    }
}
