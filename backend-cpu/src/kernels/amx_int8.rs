//! AMX INT8 tiles (x86-64 Sapphire Rapids and later) for quantized weights: `out = x W^T` with
//! `W` a [`QMat`] of format int8 (symmetric) or int4 with one scale per row or per group of a
//! multiple of 32 columns, and `x` quantized per 32-block ([`QAct`]), for decode-sized batches
//! (up to [`MAX_TOKENS`] tokens).
//!
//! Precision: the same as the VNNI kernel ([`super::qmatmul`]): each 32-block's integer dot is
//! exact (`tdpbssd` on signed int8 weights, `tdpbusd` on int4 nibbles with the zero point
//! removed in integers), scaled in f32 by `activation scale * weight scale`, and the blocks are
//! summed in f32 (in another order); the int4 bias term as there.
//!
//! Layout. The weights are the tiles' A operand, read in place: per k step, 16 rows x 64 int8, the
//! rows `row_bytes` apart (each row a memory stream, prefetched a few steps ahead, as in
//! [`super::amx`]'s 16-row kernel). The activations are the B operand. A C tile sums over its
//! whole k, but every 32-block has its own activation scale, so each block gets its own C column:
//! in the B tile of step `s`, token `t`'s block `2s` fills column `2 (t G + s % G)` (B rows 0-7, the
//! block's 32 bytes as 8 rows of 4) and block `2s + 1` the next column (B rows 8-15); every other
//! byte is zero. After `G` steps (a "period") each of the 16 columns holds one block's dot for each
//! of the 16 weight rows: C is stored, converted to f32 and accumulated with the 16 blocks' scales,
//! and zeroed. With `P` tokens per B tile (1, 2, 4 or 8), `G = 8 / P`; more than 8 tokens take up
//! to four B tiles (groups of 8) against the same A tile, and more than 32 run in blocks of 32
//! over row chunks small enough to stay in L2.
//!
//! At one token the B tile is mostly zero (2 of 16 columns per step); it comes from L1/L2 and the
//! kernel is bound by the weights' stream from memory, which is what this layout is for: the VNNI
//! GEMV streamed int8 weights at 17-20 GB/s through a whole model where the 16-row AMX BF16 kernel
//! reached 29 GB/s on the same machine.

#![cfg(target_arch = "x86_64")]

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use rayon::prelude::*;
use spark_core::quant::QFormat;
use spark_core::DType;

use super::qmatmul::{Grid, QAct, QMat, ScaleMode, Side, QBLOCK, QCHUNK, SUPER_BLOCKS};
use super::{Prefetcher, QSimd, SharedOut};

/// The most tokens [`matmul`] takes. Beyond it the AMX BF16 kernel on dequantized tiles is
/// faster: per 16 x 16 C tile this kernel stores and rescales C every k step once there are 8
/// tokens per B tile, and half of each B tile is zeros. Single-thread kernel bench
/// (`bench_kernels` in `tests/qkernels.rs`), GMAC/s for the 1.7B shapes, this kernel vs AMX BF16
/// dequantized: 32 tokens 99-151 vs 50-84; 64 tokens 73-168 vs 84-121; 128 tokens 105-162 vs
/// 94-168; 256 tokens 70-145 vs 94-201.
pub const MAX_TOKENS: usize = 64;
/// int4 at one or two tokens stays on the VNNI GEMV, which unpacks the nibbles in registers: here
/// they go through an L1 tile buffer, which costs about as much per step whatever the token
/// count. Whole-model int4 decode (`spark-run bench -m r17-int4 -p 0 -n 32 --batch B -t 2`,
/// medians of 3 alternations, tok/s, this kernel vs VNNI): batch 1 14.5 vs 18.3, batch 2 24.0 vs
/// 25.0 (a wash), batch 4 41.2 vs 31.6.
pub const INT4_MIN_TOKENS: usize = 3;
/// Tokens per pass over a row block (four B tiles of 8 tokens, C in tmm0-3).
const BLOCK_TOKENS: usize = 32;
/// Bytes of one B tile (16 rows x 64 bytes).
const TILE: usize = 1024;
/// B tiles (token groups) per pass over a row block: C in tmm0-3.
const GROUPS: usize = 4;
/// With more than [`BLOCK_TOKENS`] tokens, weight bytes per row chunk (re-read from L2 by every
/// block of tokens).
const CHUNK_BYTES: usize = 512 * 1024;
/// How many k steps ahead the weight rows are prefetched.
const PREFETCH_STEPS: usize = 4;

/// Whether AMX tiles are granted ([`super::amx::available`]) and the processor has AMX-INT8 and
/// AVX-512 BW/VNNI (the row tails run the VNNI kernel) and VL (f16 scales load 256 bits masked).
pub fn available() -> bool {
    static A: OnceLock<bool> = OnceLock::new();
    *A.get_or_init(|| {
        // cpuid leaf 7 exists wherever amx::available() is true (it needs AVX-512F).
        super::amx::available()
            && __cpuid_count(7, 0).edx & (1 << 25) != 0
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
    })
}

/// Whether [`matmul`] takes this weight and token count: int8 without biases (symmetric: ours
/// and Q8_0) or int4 (biases or not), with per-row scales or groups of a multiple of 32 columns
/// (not [`ScaleMode::Half`] / [`ScaleMode::Quad`]: a 16-column group splits a C column), at
/// least one full 16-row block, 1 (int4: [`INT4_MIN_TOKENS`]) to [`MAX_TOKENS`] tokens.
pub fn takes(w: &QMat, n: usize) -> bool {
    let min = if w.format == QFormat::I4 { INT4_MIN_TOKENS } else { 1 };
    // int6 is not packed into tiles: its matrices take the VNNI kernels (decode) or AMX BF16
    // on dequantized tiles (prefill).
    w.format != QFormat::I6
        && (w.format == QFormat::I4 || w.bias().is_none())
        && !matches!(w.mode, ScaleMode::Half | ScaleMode::Quad)
        && w.rows >= 16
        && (min..=MAX_TOKENS).contains(&n)
}

/// How tokens and k steps map onto B tiles and C columns.
#[derive(Clone, Copy)]
struct Plan {
    n: usize,
    /// Token slots per B tile (1, 2, 4 or 8).
    p: usize,
    /// k steps per period (`8 / p`).
    g: usize,
    /// B tiles per step (`n / p` rounded up).
    groups: usize,
    ksteps: usize,
    periods: usize,
}

impl Plan {
    fn new(n: usize, kp: usize) -> Plan {
        let p = n.clamp(1, 8).next_power_of_two();
        let g = 8 / p;
        let ksteps = kp / QCHUNK;
        Plan { n, p, g, groups: n.div_ceil(p), ksteps, periods: ksteps.div_ceil(g) }
    }

    /// The C column of local token `tl`'s block `2s + h`.
    fn col(&self, tl: usize, s: usize, h: usize) -> usize {
        (tl * self.g + s % self.g) * 2 + h
    }
}

/// The B tiles (`[group][step]`, 1 KiB each), and per group and period (`[group][period][16]`,
/// 0 where a column is unused) each column's activation scale and, for int4, its zero-point
/// correction; reused across calls on a thread.
#[derive(Default)]
struct Packed {
    b: Vec<i8>,
    dv: Vec<f32>,
    /// int4: `zero * sum(block's int8 activations)` (zero 8 for the low nibbles, 128 for the
    /// high nibbles kept in place), subtracted from C in integers (exact).
    zv: Vec<i32>,
    /// Per period, with per-group weight scales: which of a row's groups its columns read.
    spread: Vec<Spread>,
}

/// A period's columns and the weight groups they read: column `c` reads block
/// `b = 2 s0 + c % 2g` (`s0` the period's first step), of group `b / (group / 32)`. The period
/// loads groups `first..` (`mask`: those that exist; past the row's last group sit padding
/// blocks, whose weights are zero) and spreads them with `idx[c]` = the column's group - `first`.
#[derive(Clone, Copy)]
struct Spread {
    first: usize,
    mask: __mmask16,
    idx: [i32; 16],
}

type GroupBufs<'a> = (usize, ((&'a mut [i8], &'a mut [f32]), &'a mut [i32]));

impl Packed {
    fn fill(&mut self, act: &QAct, plan: &Plan, w: &QMat) {
        let i4 = w.format == QFormat::I4;
        self.spread.clear();
        if w.mode != ScaleMode::Row {
            let gb = w.group / QBLOCK;
            self.spread.extend((0..plan.periods).map(|p| {
                let s0 = p * plan.g;
                let first = 2 * s0 / gb;
                let last = (2 * s0 + 2 * plan.g - 1) / gb;
                let valid = (last + 1 - first).min(w.ng - first);
                let mut idx = [0i32; 16];
                for (c, v) in idx.iter_mut().enumerate() {
                    *v = ((2 * s0 + c % (2 * plan.g)) / gb - first) as i32;
                }
                Spread { first, mask: ((1u32 << valid) - 1) as __mmask16, idx }
            }));
        }
        self.b.clear();
        self.b.resize(plan.groups * plan.ksteps * TILE, 0);
        self.dv.clear();
        self.dv.resize(plan.groups * plan.periods * 16, 0.0);
        self.zv.clear();
        self.zv.resize(plan.groups * plan.periods * 16, 0);
        let group = |(j, ((b, dv), zv)): GroupBufs<'_>| {
            for tl in 0..plan.p.min(plan.n - j * plan.p) {
                let t = j * plan.p + tl;
                let (q, d) = (act.q_row(t), act.d_row(t));
                // The 4-column sums the VNNI kernels use; a block is 8 of them.
                let s4 = &act.s4[t * act.kp / 4..][..act.kp / 4];
                for (s, tile) in b.chunks_exact_mut(TILE).enumerate() {
                    for r in 0..16 {
                        let c = plan.col(tl, s, r / 8);
                        tile[r * 64 + c * 4..][..4].copy_from_slice(&q[QCHUNK * s + 4 * r..][..4]);
                    }
                    for h in 0..2 {
                        let at = (s / plan.g) * 16 + plan.col(tl, s, h);
                        dv[at] = d[2 * s + h];
                        if i4 {
                            // The high nibbles are in place (x16): scale 1/16 (a power of two).
                            let sum: i32 = s4[8 * (2 * s + h)..][..8].iter().sum();
                            dv[at] *= if h == 0 { 1.0 } else { 1.0 / 16.0 };
                            zv[at] = if h == 0 { 8 * sum } else { 128 * sum };
                        }
                    }
                }
            }
        };
        let tiles = self.b.par_chunks_mut(plan.ksteps * TILE);
        let scales = self.dv.par_chunks_mut(plan.periods * 16);
        let zeros = self.zv.par_chunks_mut(plan.periods * 16);
        if plan.groups > 1 {
            tiles.zip(scales).zip(zeros).enumerate().for_each(group);
        } else {
            group((0, ((&mut self.b[..], &mut self.dv[..]), &mut self.zv[..])));
        }
    }
}

thread_local! {
    static PACKED: RefCell<Packed> = RefCell::new(Packed::default());
}

/// `out[t*m + r] = round(sum_c x[t, c] * W[r, c])` on AMX INT8 tiles, for activations already
/// quantized ([`QAct`]); rows are split across the rayon pool, and rows past the last full
/// 16-row block of a chunk run the VNNI kernel.
///
/// # Safety
/// [`available`] returned true and [`takes`]`(w, act.n)`.
pub unsafe fn matmul(act: &QAct, w: &QMat, out: &mut [f32], round: DType) {
    let (n, m) = (act.n, w.rows);
    assert_eq!(out.len(), n * m, "amx int8 matmul: out has the wrong size");
    assert_eq!(act.kp, w.kp, "amx int8 matmul: activations quantized for another weight");
    assert!(takes(w, n), "amx int8 matmul: unsupported weight or token count");
    let plan = Plan::new(n, w.kp);
    let outp = SharedOut(out.as_mut_ptr());
    let run = |packed: &Packed| {
        let mut chunk = super::row_chunk(m, 16);
        if n > BLOCK_TOKENS {
            // Every token block re-reads the chunk's weights: keep them within L2.
            chunk = chunk.min((CHUNK_BYTES / w.row_bytes()) / 16 * 16).max(16);
        }
        (0..m.div_ceil(chunk)).into_par_iter().for_each(|ci| {
            let (r0, r1) = (ci * chunk, (ci * chunk + chunk).min(m));
            let full = r0 + (r1 - r0) / 16 * 16;
            let mut res = [[0.0f32; 16]; BLOCK_TOKENS];
            // SAFETY: AMX is available (caller); released below.
            unsafe { super::amx::load_config() };
            for j0 in (0..plan.groups).step_by(GROUPS) {
                let t0 = j0 * plan.p;
                let nt = (n - t0).min(GROUPS * plan.p);
                for rb in (r0..full).step_by(16) {
                    let next = if rb + 16 < full {
                        w.packed()[(rb + 16) * w.row_bytes()..].as_ptr()
                    } else {
                        std::ptr::null()
                    };
                    // SAFETY: the config is loaded; rows rb..rb + 16 exist (rb + 16 <= full <= m);
                    // `packed` was filled for this plan; `next` starts 16 existing rows or is null.
                    unsafe { block16(w, act, rb, next, &plan, j0, packed, &mut res) };
                    for (tl, row) in res.iter().enumerate().take(nt) {
                        for (i, &v) in row.iter().enumerate() {
                            // SAFETY: t0 + tl < n, rb + i < full <= r1: this task's rows.
                            unsafe { outp.put((t0 + tl) * m + rb + i, round.round(v)) };
                        }
                    }
                }
            }
            // SAFETY: releases this thread's tile state.
            unsafe { super::amx::release() };
            if full < r1 {
                let ld = r1 - full;
                let mut tmp = vec![0.0f32; n * ld];
                super::qmatmul::rows_tokens(QSimd::Avx512Vnni, act, w, full, r1, 0, n, &mut tmp);
                for t in 0..n {
                    for r in full..r1 {
                        // SAFETY: t < n and r in this task's rows.
                        unsafe { outp.put(t * m + r, round.round(tmp[t * ld + r - full])) };
                    }
                }
            }
        });
    };
    PACKED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut packed) => {
            packed.fill(act, &plan, w);
            run(&packed);
        }
        // Re-entered on this thread (a nested call): a buffer of its own.
        Err(_) => {
            let mut packed = Packed::default();
            packed.fill(act, &plan, w);
            run(&packed);
        }
    });
}

/// `C[j] += A x B[j]` for group `j` (tmm0-3; A in tmm4; B in tmm5-7, group 3 reusing tmm5):
/// `tdpbssd` (signed int8 weights) or, with `unsigned_a`, `tdpbusd` (int4 nibbles as unsigned
/// bytes).
///
/// # Safety
/// The tile config is loaded; tmm4 holds the step's A tile; `b` points at a readable 1 KiB tile.
#[inline(always)]
unsafe fn product(j: usize, b: *const i8, unsigned_a: bool) {
    macro_rules! go {
        ($op:literal, $bt:literal, $ct:literal) => {
            asm!(
                concat!("tileloadd ", $bt, ", [{b} + {s}*1]"),
                concat!($op, " ", $ct, ", tmm4, ", $bt),
                b = in(reg) b,
                s = in(reg) 64usize,
                options(nostack, readonly),
            )
        };
    }
    match (unsigned_a, j) {
        (false, 0) => go!("tdpbssd", "tmm5", "tmm0"),
        (false, 1) => go!("tdpbssd", "tmm6", "tmm1"),
        (false, 2) => go!("tdpbssd", "tmm7", "tmm2"),
        (false, _) => go!("tdpbssd", "tmm5", "tmm3"),
        (true, 0) => go!("tdpbusd", "tmm5", "tmm0"),
        (true, 1) => go!("tdpbusd", "tmm6", "tmm1"),
        (true, 2) => go!("tdpbusd", "tmm7", "tmm2"),
        (true, _) => go!("tdpbusd", "tmm5", "tmm3"),
    }
}

/// One A tile (16 rows x 64 bytes), 64-byte aligned.
#[repr(C, align(64))]
struct ATile([u8; TILE]);

/// Store C tile `j` (16 rows x 16 i32) into `c` and zero it.
///
/// # Safety
/// The tile config is loaded.
#[inline(always)]
unsafe fn drain(j: usize, c: &mut [[i32; 16]; 16]) {
    macro_rules! go {
        ($ct:literal) => {
            asm!(
                concat!("tilestored [{c} + {s}*1], ", $ct),
                concat!("tilezero ", $ct),
                c = in(reg) c.as_mut_ptr(),
                s = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    match j {
        0 => go!("tmm0"),
        1 => go!("tmm1"),
        2 => go!("tmm2"),
        _ => go!("tmm3"),
    }
}

/// Prefetch the 64-byte segment at `p` of 16 rows `stride` bytes apart.
#[inline(always)]
fn prefetch_rows(p: *const u8, stride: usize) {
    for r in 0..16 {
        // SAFETY: a prefetch never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(r * stride).cast()) };
    }
}

/// Rows `rb..rb + 16` x the tokens of groups `j0..j0 + 4` of `plan`: `res[tl][i]` = row
/// `rb + i`, token `j0 * plan.p + tl`.
///
/// Per k step the A tile is the 16 rows' 64 int8 weights in place, or (int4) their 32 packed
/// bytes unpacked into `abuf`: low nibbles in bytes 0-31, high nibbles left in place (x16) in
/// bytes 32-63, as in the VNNI kernel. The int4 zero point comes off C in integers, the 1/16 of
/// the high nibbles with the activation scales, and the bias term `sum_g bias[r, g] * A[t, g]`
/// is added at the end.
///
/// # Safety
/// The tile config is loaded on this thread; rows `rb..rb + 16` exist in `w`; `packed` was
/// filled for `plan` (and `w`'s padded columns and format); `next` is null or is row `rb + 16`,
/// the first of 16 more rows of `w`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn block16(
    w: &QMat,
    act: &QAct,
    rb: usize,
    next: *const u8,
    plan: &Plan,
    j0: usize,
    packed: &Packed,
    res: &mut [[f32; 16]; BLOCK_TOKENS],
) {
    let stride = w.row_bytes();
    let a = w.packed()[rb * stride..].as_ptr();
    let i4 = w.format == QFormat::I4;
    // Bytes of a row per k step.
    let step_bytes = if i4 { QCHUNK / 2 } else { QCHUNK };
    let ahead = PREFETCH_STEPS * QCHUNK;
    let (ksteps, g) = (plan.ksteps, plan.g);
    let b = packed.b.as_ptr();
    let groups = GROUPS.min(plan.groups - j0);
    let mut acc = [[_mm512_setzero_ps(); 16]; GROUPS];
    let mut cbuf = [[0i32; 16]; 16];
    let mut abuf = ATile([0; TILE]);
    // Low nibbles in bytes 0-31, high nibbles (in place) in bytes 32-63.
    let mask = super::qavx512::I4_MASK.v;
    // Per-group scales: every mode but Row (the spread of each period is in `packed`).
    let grouped = w.mode != ScaleMode::Row;
    let (scales, ng) = (w.scales(), w.ng);
    let bias = w.bias();
    // The next block's scales and biases (separate arrays) stream in over this block's steps.
    let side = |arr: Option<&Side>| match arr {
        Some(v) if !next.is_null() && ng > 1 => {
            let (p, es) = v.raw();
            Prefetcher::rows(p, ng * es, rb + 16, 16, ksteps)
        }
        _ => Prefetcher::none(),
    };
    let (mut ps, mut pb) = (side(Some(scales)).cursor(), side(bias).cursor());
    asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    for p in 0..plan.periods {
        let s0 = p * g;
        for s in s0..(s0 + g).min(ksteps) {
            let off = s * step_bytes;
            if off % 64 == 0 {
                // Each row's line `ahead` bytes on (past the row's end: the next block's start,
                // so its rows are under way when it begins).
                if off + ahead < stride {
                    prefetch_rows(a.wrapping_add(off + ahead), stride);
                } else if !next.is_null() {
                    prefetch_rows(next.wrapping_add(off + ahead - stride), stride);
                }
            }
            ps.advance();
            pb.advance();
            let (at, sa) = if i4 {
                for r in 0..16 {
                    let v = _mm512_broadcast_i64x4(_mm256_loadu_si256(a.add(r * stride + off).cast()));
                    _mm512_store_si512(abuf.0.as_mut_ptr().add(r * 64).cast(), _mm512_and_si512(v, mask));
                }
                (abuf.0.as_ptr(), 64)
            } else {
                (a.add(off), stride)
            };
            asm!(
                "tileloadd tmm4, [{a} + {sa}*1]",
                a = in(reg) at,
                sa = in(reg) sa,
                options(nostack, readonly),
            );
            for j in 0..groups {
                product(j, b.add(((j0 + j) * ksteps + s) * TILE), i4);
            }
        }
        // Per-row weight scales of this period's 16 columns ([`Spread`]).
        let mut sv = [_mm512_setzero_ps(); 16];
        if grouped {
            let sp = &packed.spread[p];
            let idx = _mm512_loadu_si512(sp.idx.as_ptr().cast());
            for (i, v) in sv.iter_mut().enumerate() {
                let at = (rb + i) * ng + sp.first;
                let loaded = match scales {
                    Side::F32(s) => _mm512_maskz_loadu_ps(sp.mask, s[at..].as_ptr()),
                    Side::F16(s) => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sp.mask, s[at..].as_ptr().cast())),
                    Side::Grid(g) => grid_lanes(g, at, sp.mask),
                };
                *v = _mm512_permutexvar_ps(idx, loaded);
            }
        }
        for (j, accj) in acc.iter_mut().enumerate().take(groups) {
            drain(j, &mut cbuf);
            let at = ((j0 + j) * plan.periods + p) * 16;
            let d = _mm512_loadu_ps(packed.dv[at..].as_ptr());
            let z = if i4 { _mm512_loadu_si512(packed.zv[at..].as_ptr().cast()) } else { _mm512_setzero_si512() };
            for (i, acci) in accj.iter_mut().enumerate() {
                let ci = _mm512_sub_epi32(_mm512_loadu_si512(cbuf[i].as_ptr().cast()), z);
                let scale = if grouped { _mm512_mul_ps(d, sv[i]) } else { d };
                *acci = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ci), scale, *acci);
            }
        }
    }
    // Token t's columns are 2g consecutive ones of its group's tile.
    let lanes: __mmask16 = ((1u32 << (2 * g)) - 1) as __mmask16;
    for (t, out) in res.iter_mut().enumerate().take((plan.n - j0 * plan.p).min(GROUPS * plan.p)) {
        let (j, tl) = (t / plan.p, t % plan.p);
        let cols = lanes << (tl * 2 * g);
        for (i, o) in out.iter_mut().enumerate() {
            let v = _mm512_mask_reduce_add_ps(cols, acc[j][i]);
            *o = if grouped { v } else { v * scales.get(rb + i) };
            if let Some(bias) = bias {
                *o += dot(bias, (rb + i) * ng, ng, act.a_row(j0 * plan.p + t));
            }
        }
    }
}

/// Values `at + l` of a [`Grid`] in the lanes `l` of `mask` (zero elsewhere): each lane's `k`
/// times its super-block's `2^e`, the product [`Grid::get`] forms (exact, the same bits).
///
/// # Safety
/// AVX-512F/BW/VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn grid_lanes(g: &Grid, at: usize, mask: __mmask16) -> __m512 {
    if mask == 0 {
        return _mm512_setzero_ps();
    }
    // The last lane read, and the super-blocks the lanes span (at most three for 16 lanes).
    let last = at + 15 - mask.leading_zeros() as usize;
    assert!(last < g.k.len(), "amx int8 grid lanes: {last} past {} values", g.k.len());
    // `ng` is a multiple of SUPER_BLOCKS, so value i's super-block exponent is exp[i / 8].
    let (e0, e1) = (at / SUPER_BLOCKS, last / SUPER_BLOCKS);
    // SAFETY: the masked loads read only lanes of `mask` (all below `last`, checked above) and
    // exponents e0..=e1 (e1 < exp.len() since last < k.len()); masked lanes do not fault.
    let kb = _mm_maskz_loadu_epi8(mask, g.k.as_ptr().add(at).cast());
    let k = if g.signed { _mm512_cvtepi8_epi32(kb) } else { _mm512_cvtepu8_epi32(kb) };
    let emask = ((1u32 << (e1 - e0 + 1)) - 1) as __mmask16;
    let ev = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(emask, g.exp.as_ptr().add(e0).cast()));
    let lane = _mm512_add_epi32(
        _mm512_set1_epi32((at % SUPER_BLOCKS) as i32),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
    );
    let e = _mm512_permutexvar_epi32(_mm512_srli_epi32::<3>(lane), ev);
    // 2^e as Grid::unit builds it: the biased exponent in the float's exponent field.
    let unit = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(e, _mm512_set1_epi32(127))));
    _mm512_mul_ps(_mm512_cvtepi32_ps(k), unit)
}

const _: () = assert!(SUPER_BLOCKS == 8, "grid_lanes finds a lane's super-block by a shift of 3");

/// `sum_i b[at + i] * a[i]` for `i < n` on 16-lane vectors (the bias term).
///
/// # Safety
/// AVX-512F/BW/VL and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn dot(b: &Side, at: usize, n: usize, a: &[f32]) -> f32 {
    assert!(a.len() >= n && b.len() >= at + n, "amx int8 bias term: lengths");
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let m: __mmask16 = if n - i >= 16 { 0xFFFF } else { ((1u32 << (n - i)) - 1) as __mmask16 };
        let bv = match b {
            Side::F32(v) => _mm512_maskz_loadu_ps(m, v.as_ptr().add(at + i)),
            Side::F16(v) => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, v.as_ptr().add(at + i).cast())),
            Side::Grid(g) => grid_lanes(g, at + i, m),
        };
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a.as_ptr().add(i)), bv, acc);
        i += 16;
    }
    _mm512_reduce_add_ps(acc)
}

const _: () = assert!(QCHUNK == 2 * QBLOCK, "a tile step is two activation blocks");
