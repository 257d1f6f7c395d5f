//! AVX-512 f32 FMA prefill (x86-64): `out = x W^T` for 16 tokens and more, on bf16, f16 or f32
//! weights converted to f32 one band at a time, with `vfmadd231ps`.
//!
//! Where it runs ([`super::matmul::fma512_prefill_takes`]): prefill at the `Avx512` level on
//! CPUs whose `vdpbf16ps` is slow. On an Intel Xeon core (Emerald Rapids, family 6 model 207,
//! AVX512_BF16 without AMX exposed) `vdpbf16ps zmm` issued at 1.31-1.35 G/s against 5.3-5.4 G/s
//! for `vfmadd231ps zmm` (twelve independent chains each, one thread): 16 multiply-adds per cycle
//! against 32, so the `vdpbf16ps` prefill ([`super::avx512bf16::prefill`]) ran at 40 GMAC/s on
//! one thread where this kernel reaches about twice that. AMD's Zen 4 and Zen 5 issue
//! `vdpbf16ps` as fast as an FMA, twice the multiply-adds, and keep it.
//!
//! The layout is the `vdpbf16ps` prefill's, in f32:
//! - the activations are transposed once per call into blocks of [`TOKENS`] (32) tokens,
//!   `[k][32]` f32, so that one column of a block is two 16-lane vectors;
//! - the weight rows go in bands of three quarters of L2, each converted to f32 into a buffer
//!   whose rows are 64 bytes longer than `k` (rows 8 KiB apart, k = 2048, would put the tile's
//!   12 broadcast streams in one L1 set), and every token block sweeps a band before the next,
//!   so the weights come from memory once per call and the activations once per band;
//! - within a band, columns go in chunks of `KC` (256): a block's chunk of activations (32
//!   KiB) stays in L1 while every tile of the band runs over it (+20-30 % at k = 6656);
//! - a micro-kernel of [`ROWS`] (12) rows x 32 tokens broadcasts each row's weight of a column
//!   against the two token vectors: 24 accumulators, 14 loads per 24 FMAs, no spills. It reaches
//!   about 65-70 GMAC/s on one thread there, 75-80 % of the measured FMA peak.
//!
//! Precision: f32 products and f32 sums in column order, as the f32 panels
//! ([`super::avx2::panel_kernel`]). With bf16-valued activations and bf16 weights (the
//! `round = bf16` path) every product is exact, as in `vdpbf16ps`; only the order of the sums
//! differs, and values below 2^-126 are not flushed.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use spark_core::DType;

use super::matmul::Mat;
use super::SharedOut;

/// Weight rows per micro-kernel call.
pub const ROWS: usize = 12;
/// Tokens per transposed activation block (two 16-lane vectors).
pub const TOKENS: usize = 32;
/// Columns per chunk: a block's chunk of activations (`KC x 32` f32, 32 KiB) stays in L1
/// while every tile of a band runs over it.
const KC: usize = 256;
/// The L2 size assumed where sysfs does not tell it.
const L2_FALLBACK: usize = 1 << 20;

/// Bytes of f32 weights per band (rows held while every token block sweeps them): three
/// quarters of the per-core L2. Every band streams all the token blocks once, so the band is as
/// large as L2 keeps: on an Emerald Rapids core (2 MiB L2), 1.5 MiB bands against 256 KiB took
/// the 2048 x 6656 (down) product from 51-54 to 65-70 GMAC/s on one thread, and whole-model
/// bf16 pp512 from 54-60 to 72-75 tok/s on two (docs/BENCHMARKS.md, session 47).
fn band_bytes() -> usize {
    static B: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *B.get_or_init(|| l2_bytes().unwrap_or(L2_FALLBACK) / 4 * 3)
}

/// The size of CPU 0's level-2 data (or unified) cache, from Linux's sysfs.
fn l2_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    for entry in dir.flatten() {
        let read = |f: &str| std::fs::read_to_string(entry.path().join(f)).ok().map(|s| s.trim().to_string());
        if read("level").as_deref() == Some("2") && read("type").is_some_and(|t| t != "Instruction") {
            return parse_cache_size(&read("size")?);
        }
    }
    None
}

/// A sysfs cache size (`2048K`, `1M`, `524288`) in bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let v: usize = digits.parse().ok()?;
    match unit {
        "" => Some(v),
        "K" => v.checked_mul(1 << 10),
        "M" => v.checked_mul(1 << 20),
        _ => None,
    }
}

thread_local! {
    /// The band buffer of the calls made on this thread.
    static HELD: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `x` (`[n, k]` f32) transposed into blocks of [`TOKENS`] tokens: block `b` holds `[k][32]`,
/// element `j * 32 + t` = column `j` of token `32 b + t`; tokens past `n` are zero.
///
/// # Safety
/// AVX-512F is present.
unsafe fn transpose_activations(x: &[f32], n: usize, k: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let block = k * TOKENS;
    let mut xt = vec![0.0f32; n.div_ceil(TOKENS) * block];
    xt.par_chunks_mut(block).enumerate().for_each(|(b, dst)| {
        let t0 = b * TOKENS;
        let t1 = (t0 + TOKENS).min(n);
        // Groups of 16 tokens, 16 columns at a time, in registers; the rest one by one.
        let full = k / 16 * 16;
        for g in (t0..t1).step_by(16) {
            let lane = g - t0;
            let vector = g + 16 <= t1;
            if vector {
                // SAFETY: AVX-512F (this function's contract); rows g..g + 16 of x hold k
                // values; dst holds k * 32 values, written from lane `lane` on.
                unsafe { transpose16_tokens(&x[g * k..(g + 16) * k], k, &mut dst[lane..]) };
            }
            for t in g..(g + 16).min(t1) {
                let row = &x[t * k..(t + 1) * k];
                for (j, &v) in row.iter().enumerate().skip(if vector { full } else { 0 }) {
                    dst[j * TOKENS + t - t0] = v;
                }
            }
        }
    });
    xt
}

/// The first `k / 16 * 16` columns of 16 token rows `x` (`[16][k]`) transposed:
/// `dst[j * 32 + t]` = column `j` of token `t`.
///
/// # Safety
/// AVX-512F; `x.len() == 16 * k`; `dst` holds at least `(k / 16 * 16 - 1) * 32 + 16` values.
#[target_feature(enable = "avx512f")]
unsafe fn transpose16_tokens(x: &[f32], k: usize, dst: &mut [f32]) {
    debug_assert!(x.len() == 16 * k && (k < 16 || dst.len() >= (k / 16 * 16 - 1) * TOKENS + 16));
    let (xp, dp) = (x.as_ptr(), dst.as_mut_ptr());
    for c in (0..k / 16 * 16).step_by(16) {
        let mut v = [_mm512_setzero_si512(); 16];
        for (t, vt) in v.iter_mut().enumerate() {
            *vt = _mm512_castps_si512(_mm512_loadu_ps(xp.add(t * k + c)));
        }
        let cols = super::amx::transpose16(v);
        for (j, col) in cols.iter().enumerate() {
            _mm512_storeu_ps(dp.add((c + j) * TOKENS), _mm512_castsi512_ps(*col));
        }
    }
}

/// Prefill: `out[t*m + r] = round(sum_j x[t*k + j] * W[r, j])` for `w` `[m, k]`, `n` tokens of
/// any number (16 and more is where it pays), rows split across the rayon pool (see the module
/// doc for the blocking).
///
/// # Safety
/// The CPU has AVX-512F.
#[allow(clippy::too_many_arguments)]
pub unsafe fn prefill(x: &[f32], n: usize, k: usize, w: Mat<'_>, m: usize, out: &mut [f32], round: DType) {
    use rayon::prelude::*;
    assert_eq!(x.len(), n * k, "f32 prefill: x has the wrong size");
    let wlen = match w {
        Mat::F32(d) => d.len(),
        Mat::BF16(d) | Mat::F16(d) => d.len(),
    };
    assert_eq!(wlen, m * k, "f32 prefill: w has the wrong size");
    assert_eq!(out.len(), n * m, "f32 prefill: out has the wrong size");
    if n == 0 || m == 0 || k == 0 {
        out.fill(0.0);
        return;
    }
    // SAFETY: AVX-512F (this function's contract).
    let xt = unsafe { transpose_activations(x, n, k) };
    let block = k * TOKENS;
    // The held rows' stride: 64 bytes past `k`, so that the tile's 12 rows fall in different
    // L1 sets when `4k` is a multiple of 4 KiB.
    let ks = k + 16;
    let band = (band_bytes() / (4 * ks)).max(1).div_ceil(ROWS) * ROWS;
    let chunk = super::row_chunk(m, ROWS);
    let outp = SharedOut(out.as_mut_ptr());
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let (r0, r1) = (c * chunk, (c * chunk + chunk).min(m));
        let rows_held = band.min(r1 - r0);
        // The band buffer is kept per thread between calls (three quarters of L2 at most), so
        // that it is not allocated and faulted in again for every task.
        let mut held = HELD.with(|h| h.take());
        held.resize(rows_held * ks, 0.0);
        // One token block's outputs for the band, `[token][band row]`, written out together.
        let mut stage = vec![0.0f32; TOKENS * rows_held];
        let mut accs = vec![[[0.0f32; TOKENS]; ROWS]; rows_held.div_ceil(ROWS)];
        for b0 in (r0..r1).step_by(band) {
            let b1 = (b0 + band).min(r1);
            for (i, row) in held.chunks_exact_mut(ks).take(b1 - b0).enumerate() {
                w.row(b0 + i, k).to_f32(&mut row[..k]);
            }
            let base = held.as_ptr();
            let tiles = (b1 - b0).div_ceil(ROWS);
            for (tb, xb) in xt.chunks_exact(block).enumerate() {
                let t0 = tb * TOKENS;
                let nt = TOKENS.min(n - t0);
                // Columns in chunks of KC: the block's chunk (KC x 32 f32) stays in L1 while
                // every tile of the band runs over it, carrying its sums in `acc`.
                for c0 in (0..k).step_by(KC) {
                    let kn = KC.min(k - c0);
                    for (p, acc) in accs.iter_mut().enumerate().take(tiles) {
                        let p0 = b0 + p * ROWS;
                        let nr = ROWS.min(b1 - p0);
                        // Rows past the band repeat its last row; their sums are discarded.
                        // SAFETY: p0 - b0 + i.min(nr - 1) < b1 - b0 <= rows_held rows of `held`,
                        // each ks >= c0 + kn long.
                        let rows: [*const f32; ROWS] =
                            std::array::from_fn(|i| unsafe { base.add((p0 - b0 + i.min(nr - 1)) * ks + c0) });
                        let xc = &xb[c0 * TOKENS..(c0 + kn) * TOKENS];
                        // SAFETY: AVX-512F (contract); each row pointer starts kn readable f32
                        // of `held`; xc holds kn columns x 32 tokens.
                        if nt > 16 {
                            unsafe { tile::<2>(&rows, kn, xc, c0 == 0, acc) }
                        } else {
                            unsafe { tile::<1>(&rows, kn, xc, c0 == 0, acc) }
                        }
                    }
                }
                for (p, acc) in accs.iter().enumerate().take(tiles) {
                    let p0 = b0 + p * ROWS;
                    let nr = ROWS.min(b1 - p0);
                    // SAFETY: AVX-512F (contract); token t < nt's nr sums go to stage[t *
                    // rows_held + p0 - b0..][..nr], inside the band's row of `stage`.
                    unsafe { stage_tile(acc, nr, nt, &mut stage[p0 - b0..], rows_held) };
                }
                for t in 0..nt {
                    // SAFETY: t0 + t < n, b1 <= r1 <= m; rows [r0, r1) belong to this task.
                    unsafe { outp.put_rounded((t0 + t) * m + b0, &stage[t * rows_held..][..b1 - b0], round) };
                }
            }
        }
        HELD.with(|h| h.replace(held));
    });
}

/// A tile's sums `acc` (`[row][token]`) into `stage` by token: `stage[t * ld + j] = acc[j][t]`
/// for rows `j < nr` and tokens `t < nt`, sixteen tokens at a time through a 16 x 16 transpose
/// (the scalar stores it replaces, 384 per tile and token block, each to another line: the
/// stage's share of whole-model bf16 pp512's CPU samples 2.25 % -> 0.84 % here plus 0.62 % left
/// in the driver; `perf record`, docs/BENCHMARKS.md, session 48).
///
/// # Safety
/// AVX-512F; `nr <= ROWS`, `nt <= TOKENS`, `stage.len() >= (nt - 1) * ld + nr` when `nt > 0`.
#[target_feature(enable = "avx512f")]
unsafe fn stage_tile(acc: &[[f32; TOKENS]; ROWS], nr: usize, nt: usize, stage: &mut [f32], ld: usize) {
    debug_assert!(nr <= ROWS && nt <= TOKENS && (nt == 0 || stage.len() >= (nt - 1) * ld + nr));
    let sp = stage.as_mut_ptr();
    let mask: __mmask16 = (1 << nr) - 1;
    for t0 in (0..nt).step_by(16) {
        let mut v = [_mm512_setzero_si512(); 16];
        for (j, vj) in v.iter_mut().enumerate().take(ROWS) {
            *vj = _mm512_castps_si512(_mm512_loadu_ps(acc[j].as_ptr().add(t0)));
        }
        let by_token = super::amx::transpose16(v);
        for (i, col) in by_token.iter().enumerate().take(nt - t0) {
            _mm512_mask_storeu_ps(sp.add((t0 + i) * ld), mask, _mm512_castsi512_ps(*col));
        }
    }
}

/// [`ROWS`] rows x `16 V` tokens over `k` columns: per column, each row's weight broadcast
/// against the `V` token vectors of the transposed chunk `xb`. Adds to `acc[r][t]` for
/// `t < 16 V` (sets it when `first`).
///
/// # Safety
/// AVX-512F; each `rows[r]` has `k` readable f32; `xb` holds `k * 32` f32.
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<const V: usize>(
    rows: &[*const f32; ROWS],
    k: usize,
    xb: &[f32],
    first: bool,
    acc: &mut [[f32; TOKENS]; ROWS],
) {
    debug_assert!(xb.len() >= k * TOKENS);
    let mut a = [[_mm512_setzero_ps(); V]; ROWS];
    if !first {
        for r in 0..ROWS {
            for v in 0..V {
                a[r][v] = _mm512_loadu_ps(acc[r].as_ptr().add(16 * v));
            }
        }
    }
    let xp = xb.as_ptr();
    for j in 0..k {
        let mut xv = [_mm512_setzero_ps(); V];
        for v in 0..V {
            xv[v] = _mm512_loadu_ps(xp.add(j * TOKENS + 16 * v));
        }
        for r in 0..ROWS {
            let wv = _mm512_set1_ps(*rows[r].add(j));
            for v in 0..V {
                a[r][v] = _mm512_fmadd_ps(wv, xv[v], a[r][v]);
            }
        }
    }
    for r in 0..ROWS {
        for v in 0..V {
            _mm512_storeu_ps(acc[r].as_mut_ptr().add(16 * v), a[r][v]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_cache_size;

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("2048K"), Some(2 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("524288"), Some(524288));
        assert_eq!(parse_cache_size("12Q"), None);
        assert_eq!(parse_cache_size(""), None);
    }
}
