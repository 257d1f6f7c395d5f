//! AMX BF16 tiles (x86-64 Sapphire Rapids and later): `out = x W^T` for bf16 (or int8 / int4,
//! dequantized to bf16) weights and activations that are already bf16 values, accumulating in f32.
//!
//! Precision: products of bf16 pairs summed into f32 tiles by `tdpbf16ps` (round to nearest
//! even, bf16 denormals read as zero). The driver only takes this path when the activations are
//! rounded to bf16 by the graph (the reference's bf16 semantics), so converting them to bf16 is
//! exact; the result differs from the f32-FMA kernels only in the order of f32 additions.
//!
//! Layout: the weights are the tiles' A operand (16 rows x 32 bf16 per tile), the activations
//! the B operand, packed once per call into the VNNI layout (per 16-token block and 32-wide k
//! step: 16 rows of 16 token pairs `x[t][2r], x[t][2r+1]`). The micro-kernel keeps a 2 x 2 block
//! of C tiles (32 weight rows x 32 tokens) in tmm0-3, weights in tmm4-5 and activations in
//! tmm6-7, and writes C transposed into `out`. With at most 64 tokens each weight is used once
//! or twice, so full 32-row blocks are read in place (row stride `2k` bytes, the next rows
//! prefetched a few steps ahead); with more, k is cut into 512-wide slices (the activations'
//! slice stays in L2 across row blocks) and each block's slice is copied into contiguous tiles
//! (rows 4 KiB apart would all map to the same L1 sets), with C accumulated between slices.
//! Quantized weights ([`Weights::Quant`]) are always dequantized into packed tiles.
//!
//! Activations are packed, and C tiles written out, 16 x 16 at a time with AVX-512 transposes
//! (`pack_tile`, `put_tile`); a C tile goes out right after its last k slice, still in L1.
//!
//! Measured on the project's 2-vCPU Sapphire Rapids VM (`scripts/amx-tile-model.c`): the tile
//! unit runs at one of two rates about 3x apart, switching from run to run with nothing else
//! running in the VM (most likely the host's other hyperthread sharing the core's AMX unit):
//! `tdpbf16ps` every 7 or 15-20 ns, a 1 KiB `tileloadd` from L1 3.4 or 11-15 ns. The kernel's
//! loop shape (2 x 2 C tiles, packed weights in L1, activations from L2, C reloaded every 512 k)
//! reaches 600-630 GMAC/s per core at the fast rate and ~200 at the slow one, against ~1050 with
//! every tile from L1 and ~1180 for the products alone.
//!
//! Linux gives a process the AMX tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
//! [`available`] asks once and reports false when the processor or the kernel says no.

#![cfg(target_arch = "x86_64")]

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use rayon::prelude::*;
use spark_core::DType;

use super::qmatmul::QMat;
use super::SharedOut;

/// The weights of an AMX matmul: bf16 rows (read in place or copied into tiles), or an int8 /
/// int4 matrix dequantized into bf16 tiles as they are packed.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    Bf16(&'a [u16]),
    Quant(&'a QMat),
}

/// Weight rows per micro-kernel block (two A tiles).
const MB: usize = 32;
/// k elements per tile step.
const KS: usize = 32;
/// How many k steps ahead in-place weight rows are prefetched.
const PREFETCH_STEPS: usize = 4;
/// k steps per cache block (512 k).
const KC_STEPS: usize = 16;
/// u16 elements of one packed B tile (16 rows x 64 bytes).
const TILE_U16: usize = 512;

/// Whether the processor has AMX-TILE + AMX-BF16 + AVX-512F and the kernel granted this process
/// the tile state (asked once, cached).
pub fn available() -> bool {
    static A: OnceLock<bool> = OnceLock::new();
    *A.get_or_init(|| {
        // AVX-512F/BW pack the tiles (`pack_tile`, `put_tile`); every AMX processor has them.
        if !is_x86_feature_detected!("avx512f") || !is_x86_feature_detected!("avx512bw") {
            return false;
        }
        // cpuid leaf 7 exists on every x86-64 processor with AVX-512F.
        let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
        let amx_bf16 = leaf7.edx & (1 << 22) != 0;
        let amx_tile = leaf7.edx & (1 << 24) != 0;
        amx_bf16 && amx_tile && request_tile_permission()
    })
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: true when granted.
#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: a plain Linux x86-64 system call with two integer arguments; it reads and writes
    // no user memory. The syscall instruction clobbers rcx and r11.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// Other systems: not attempted (their AMX enablement differs), so never available.
#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}

/// The 64-byte tile configuration of palette 1.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Eight tiles of 16 rows x 64 bytes.
const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// Load the eight-tile palette-1 configuration (every tile 16 rows x 64 bytes) on this thread.
///
/// # Safety
/// [`available`] returned true; the thread releases the state (`tilerelease`) when done.
#[inline(always)]
pub(super) unsafe fn load_config() {
    asm!("ldtilecfg [{0}]", in(reg) &CONFIG as *const TileConfig, options(nostack, readonly));
}

/// Release this thread's tile state.
///
/// # Safety
/// [`available`] returned true.
#[inline(always)]
pub(super) unsafe fn release() {
    asm!("tilerelease", options(nostack, nomem));
}

/// Pack `x` `[n, k]` into B tiles: for token block `tb` and k step `s`, tile
/// `(tb * ksteps + s)` holds `u32` pairs `[r][t] = (x[16 tb + t][32 s + 2r], ..+1)`; tokens past
/// `n` are zero. `xp` is resized to fit (a buffer reused across calls).
fn pack_activations(x: &[f32], n: usize, k: usize, xp: &mut Vec<u16>) {
    let ksteps = k / KS;
    let tblocks = n.div_ceil(16);
    // Every tile is written whole below (zero pairs for missing tokens), so a reused buffer
    // needs no clearing.
    xp.resize(tblocks * ksteps * TILE_U16, 0);
    xp.truncate(tblocks * ksteps * TILE_U16);
    let block = |(tb, dst): (usize, &mut [u16])| {
        let rows = &x[tb * 16 * k..((tb + 1) * 16).min(n) * k];
        for (s, tile) in dst.chunks_exact_mut(TILE_U16).enumerate() {
            // SAFETY: AVX-512F/BW are present ([`available`], which every caller checked);
            // `rows` holds whole rows of `k >= 32 (s + 1)` values.
            unsafe { pack_tile(rows, k, s * KS, tile) };
        }
    };
    if tblocks > 1 {
        xp.par_chunks_mut(ksteps * TILE_U16).enumerate().for_each(block);
    } else {
        block((0, &mut xp[..]));
    }
}

/// One B tile: `tile[r][t] = (bf16(rows[t][c0 + 2r]), bf16(rows[t][c0 + 2r + 1]))` for the
/// `rows.len() / k <= 16` tokens of `rows` (`k` values each); the other tokens' pairs are zero.
/// Rounds to nearest even as [`spark_core::dtype::round_bf16`] (NaN quieted).
///
/// # Safety
/// AVX-512F and AVX-512BW are present; `c0 + 32 <= k`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_tile(rows: &[f32], k: usize, c0: usize, tile: &mut [u16]) {
    debug_assert!(tile.len() == TILE_U16 && c0 + KS <= k);
    let mut v = [_mm512_setzero_si512(); 16];
    for (t, row) in rows.chunks_exact(k).enumerate() {
        let seg = row[c0..c0 + KS].as_ptr();
        v[t] = round_pairs(_mm512_loadu_ps(seg), _mm512_loadu_ps(seg.add(16)));
    }
    let v = transpose16(v);
    for (r, row) in v.iter().enumerate() {
        _mm512_storeu_si512(tile.as_mut_ptr().add(r * 32).cast(), *row);
    }
}

/// `lo`, `hi` (16 f32 each) rounded to bf16 as [`spark_core::dtype::round_bf16`] and packed in
/// order into 32 words: one row of 32 columns as 16 bf16 pairs.
///
/// # Safety
/// AVX-512F and AVX-512BW are present.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn round_pairs(lo: __m512, hi: __m512) -> __m512i {
    // Word 2i + 1 of (lo, hi): the high halves, i.e. the bf16 of element i of the 32.
    let odd_words = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9,
        7, 5, 3, 1,
    );
    _mm512_permutex2var_epi16(round_bf16_high(lo), odd_words, round_bf16_high(hi))
}

/// `x` rounded to bf16 in the high 16 bits of each lane, as [`spark_core::dtype::round_bf16`]
/// (the low 16 bits are garbage).
///
/// # Safety
/// AVX-512F is present.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn round_bf16_high(x: __m512) -> __m512i {
    let b = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let rounded = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_mask_or_epi32(rounded, nan, b, _mm512_set1_epi32(0x40_0000))
}

/// Transpose 16 x 16 32-bit lanes: `out[c]` lane `r` = `v[r]` lane `c`.
///
/// # Safety
/// AVX-512F is present.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose16(v: [__m512i; 16]) -> [__m512i; 16] {
    // Plain loops, not closures: a closure does not inherit this function's target features, so
    // it would not inline and would pass its vectors through memory.
    let mut r = [_mm512_setzero_ps(); 16];
    for i in 0..16 {
        r[i] = _mm512_castsi512_ps(v[i]);
    }
    // Within 128-bit lanes: t[2i] / t[2i + 1] interleave rows 2i and 2i + 1.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4i + c], 128-bit lane l: column 4l + c of rows 4i..4i + 4.
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        u[4 * i] = _mm512_shuffle_ps::<0x44>(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_shuffle_ps::<0xee>(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_shuffle_ps::<0x44>(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_shuffle_ps::<0xee>(t[4 * i + 1], t[4 * i + 3]);
    }
    // Gather the four row groups' 128-bit lanes: column 4l + c = lanes l of u[c], u[4 + c],
    // u[8 + c], u[12 + c].
    let mut out = [_mm512_setzero_si512(); 16];
    for c in 0..4 {
        let v01 = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
        let w01 = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
        let v23 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
        let w23 = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
        out[c] = _mm512_castps_si512(_mm512_shuffle_f32x4::<0x88>(v01, v23));
        out[8 + c] = _mm512_castps_si512(_mm512_shuffle_f32x4::<0xdd>(v01, v23));
        out[4 + c] = _mm512_castps_si512(_mm512_shuffle_f32x4::<0x88>(w01, w23));
        out[12 + c] = _mm512_castps_si512(_mm512_shuffle_f32x4::<0xdd>(w01, w23));
    }
    out
}

/// Below this many tokens [`put_tile`] gathers columns rather than transposing.
const GATHER_TOKENS: usize = 4;

/// Write C tile `tile` (16 weight rows x 16 tokens, f32) rounded to `round`: token `j < tokens`
/// gets its `rows` outputs at `out[base + j * m..][..rows]`.
///
/// # Safety
/// AVX-512F is present; those cells are inside the output and written by no other thread.
#[target_feature(enable = "avx512f")]
unsafe fn put_tile(out: SharedOut, tile: &[f32; 256], tokens: usize, base: usize, m: usize, rows: usize, round: DType) {
    debug_assert!(tokens <= 16 && rows <= 16);
    let mut v = [_mm512_setzero_si512(); 16];
    if tokens < GATHER_TOKENS {
        // Decode-sized: gather the few columns instead of transposing the whole tile.
        let stride = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
        for (j, col) in v.iter_mut().enumerate().take(tokens) {
            *col = _mm512_castps_si512(_mm512_i32gather_ps::<4>(stride, tile.as_ptr().add(j)));
        }
    } else {
        for (i, row) in v.iter_mut().enumerate() {
            *row = _mm512_loadu_si512(tile.as_ptr().add(16 * i).cast());
        }
        v = transpose16(v);
    }
    let mask: __mmask16 = ((1u32 << rows) - 1) as u16;
    for (j, col) in v.iter().enumerate().take(tokens) {
        let dst = out.get().add(base + j * m);
        match round {
            DType::F32 => _mm512_mask_storeu_ps(dst, mask, _mm512_castsi512_ps(*col)),
            DType::BF16 => {
                let x = _mm512_castsi512_ps(*col);
                let r = _mm512_and_si512(round_bf16_high(x), _mm512_set1_epi32(0xffff_0000u32 as i32));
                _mm512_mask_storeu_ps(dst, mask, _mm512_castsi512_ps(r));
            }
            DType::F16 => {
                let mut vals = [0.0f32; 16];
                _mm512_storeu_ps(vals.as_mut_ptr(), _mm512_castsi512_ps(*col));
                for (i, &v) in vals.iter().enumerate().take(rows) {
                    *dst.add(i) = round.round(v);
                }
            }
        }
    }
}

/// The largest packed activations kept for reuse (1 MiB: 32 tokens at k = 16384, 128 at
/// k = 4096); prefill's are allocated per call rather than held for the thread's life.
const REUSE_BYTES: usize = 1 << 20;

thread_local! {
    /// The packed activations of the calls made on this thread (decode calls it ~150 times per
    /// token: one buffer instead of an allocation each).
    static PACKED_X: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// The largest C buffer [`BLOCK_BUFS`] keeps (8 MiB: the C of a 512-token row chunk of up to
/// 4096 rows; the 1.7B shape's largest projection, 6656 rows, takes 1.6 MiB on 2 threads).
const REUSE_C_BYTES: usize = 8 << 20;

thread_local! {
    /// The packed weight slice and the C accumulators of [`matmul_packed`]'s blocked path, kept
    /// between calls on this thread (their sizes depend only on the row chunk and token count).
    static BLOCK_BUFS: RefCell<(Vec<u16>, Vec<[f32; 256]>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Copy weight rows `rb..rb+valid` (zero rows up to 32), k steps `s0..s0+ns`, into A tiles:
/// tile `(a * ns + s)` holds rows `rb + 16a ..+16`, columns `32 (s0 + s)..+32`, 64 bytes per row.
/// Contiguous tiles stay in L1 (rows 4 KiB apart in place would all map to the same L1 sets).
///
/// # Safety
/// AVX-512F is present.
#[target_feature(enable = "avx512f")]
unsafe fn pack_weights(w: Weights<'_>, k: usize, rb: usize, valid: usize, s0: usize, ns: usize, apack: &mut [u16]) {
    let mut row = vec![0u16; ns * KS];
    for r in 0..MB {
        let (a, i) = (r / 16, r % 16);
        if r < valid {
            let src: &[u16] = match w {
                Weights::Bf16(w) => &w[(rb + r) * k + s0 * KS..][..ns * KS],
                Weights::Quant(q) => {
                    q.dequant_bf16(rb + r, s0 * KS, &mut row);
                    &row
                }
            };
            for (s, seg) in src.chunks_exact(KS).enumerate() {
                let dst = &mut apack[(a * ns + s) * TILE_U16 + i * 32..][..KS];
                // SAFETY: both sides are 32 u16 (64 bytes) in bounds.
                unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), _mm512_loadu_si512(seg.as_ptr().cast())) };
            }
        } else {
            for s in 0..ns {
                apack[(a * ns + s) * TILE_U16 + i * 32..][..32].fill(0);
            }
        }
    }
}

/// Prefetch into L2 the stored weights of row `r`, k steps `s0..s0 + ns` (what
/// [`pack_weights`] will read).
fn prefetch_slice_row(w: Weights<'_>, k: usize, r: usize, s0: usize, ns: usize) {
    let bytes: &[u8] = match w {
        Weights::Bf16(w) => bytemuck::cast_slice(&w[r * k + s0 * KS..][..ns * KS]),
        Weights::Quant(q) => q.row_columns(r, s0 * KS, ns * KS),
    };
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch never faults; the address is inside `bytes`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
    }
}

/// One 32-row x 32-token block over `ksteps` k steps: `c[2a + b]` (rows `16a..` x tokens
/// `16b..`, each tile 16 x 16 f32) is set to the product when `first`, else accumulated into.
///
/// The A tiles of step `s` are 16 rows at `w0 + s * a_step` / `w1 + s * a_step` with row stride
/// `a_stride` bytes (packed tiles: 512 and 64; weights in place: 32 and 2k).
///
/// # Safety
/// AMX is [`available`] and this thread has loaded [`CONFIG`]; `w0`/`w1` address `ksteps` A
/// tiles as above and `b0`/`b1` each point at `ksteps` consecutive packed tiles (see
/// [`pack_weights`], [`pack_activations`]); `c` holds at least 4 tiles.
#[allow(clippy::too_many_arguments)]
#[inline(never)]
unsafe fn block(
    w0: *const u16,
    w1: *const u16,
    a_step: usize,
    a_stride: usize,
    b0: *const u16,
    b1: *const u16,
    ksteps: usize,
    c: &mut [[f32; 256]],
    first: bool,
) {
    debug_assert!(c.len() >= 4);
    if first {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    } else {
        asm!(
            "tileloadd tmm0, [{c0} + {s}*1]",
            "tileloadd tmm1, [{c1} + {s}*1]",
            "tileloadd tmm2, [{c2} + {s}*1]",
            "tileloadd tmm3, [{c3} + {s}*1]",
            c0 = in(reg) c[0].as_ptr(),
            c1 = in(reg) c[1].as_ptr(),
            c2 = in(reg) c[2].as_ptr(),
            c3 = in(reg) c[3].as_ptr(),
            s = in(reg) 64usize,
            options(nostack, readonly),
        );
    }
    let in_place = a_stride != 64;
    for s in 0..ksteps {
        if in_place && s + PREFETCH_STEPS < ksteps {
            // Rows 2k bytes apart are 32 separate streams: fetch each one's segment a few steps
            // ahead so the tile loads find it in cache.
            prefetch_rows(w0.add((s + PREFETCH_STEPS) * a_step), a_stride);
            prefetch_rows(w1.add((s + PREFETCH_STEPS) * a_step), a_stride);
        }
        asm!(
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tileloadd tmm6, [{b0} + {sb}*1]",
            "tileloadd tmm7, [{b1} + {sb}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) w0.add(s * a_step),
            a1 = in(reg) w1.add(s * a_step),
            sa = in(reg) a_stride,
            b0 = in(reg) b0.add(s * TILE_U16),
            b1 = in(reg) b1.add(s * TILE_U16),
            sb = in(reg) 64usize,
            options(nostack, readonly),
        );
    }
    store_c(c);
}

/// 16 weight rows x one 16-token block over all `ksteps`: `c` = the rows x the 16 tokens.
/// Weights in place (`a_stride` bytes between rows), prefetched a few steps ahead; C in tmm0, A in
/// tmm4, B in tmm7.
///
/// Why only 16 rows per block: the weights are read in place, one 64-byte segment of each row
/// per step, so every row of a block is a concurrent memory stream. 64 rows at a time (four A
/// tiles against the B tile) streamed 12-15 GB/s in a batch-16 decode; 16 rows at a time
/// 17-21 GB/s (+29 %, `spark-run bench --batch 16`, 3 alternations). AMX has cycles to spare
/// here (two tile loads per product instead of 1.25); memory is what binds.
///
/// # Safety
/// AMX is [`available`] and this thread has loaded [`CONFIG`]; `w` starts 16 rows of
/// `ksteps * 32` readable bf16, `a_stride` bytes apart; `b` points at `ksteps` packed tiles.
#[inline(never)]
unsafe fn block_rows16(w: *const u16, a_stride: usize, b: *const u16, ksteps: usize, c: &mut [f32; 256]) {
    asm!("tilezero tmm0", options(nostack, nomem));
    for s in 0..ksteps {
        if s + PREFETCH_STEPS < ksteps {
            prefetch_rows(w.add((s + PREFETCH_STEPS) * KS), a_stride);
        }
        asm!(
            "tileloadd tmm7, [{b} + {sb}*1]",
            "tileloadd tmm4, [{a} + {sa}*1]",
            "tdpbf16ps tmm0, tmm4, tmm7",
            a = in(reg) w.add(s * KS),
            sa = in(reg) a_stride,
            b = in(reg) b.add(s * TILE_U16),
            sb = in(reg) 64usize,
            options(nostack, readonly),
        );
    }
    asm!("tilestored [{c} + {s}*1], tmm0", c = in(reg) c.as_mut_ptr(), s = in(reg) 64usize, options(nostack));
}

/// Store tmm0-3 into `c[0..4]` (16 x 16 f32 each).
///
/// # Safety
/// AMX is [`available`], this thread has loaded [`CONFIG`], and `c` holds at least 4 tiles.
#[inline(always)]
unsafe fn store_c(c: &mut [[f32; 256]]) {
    asm!(
        "tilestored [{c0} + {s}*1], tmm0",
        "tilestored [{c1} + {s}*1], tmm1",
        "tilestored [{c2} + {s}*1], tmm2",
        "tilestored [{c3} + {s}*1], tmm3",
        c0 = in(reg) c[0].as_mut_ptr(),
        c1 = in(reg) c[1].as_mut_ptr(),
        c2 = in(reg) c[2].as_mut_ptr(),
        c3 = in(reg) c[3].as_mut_ptr(),
        s = in(reg) 64usize,
        options(nostack),
    );
}

/// Prefetch the 64-byte segment at `p` of 16 rows `stride` bytes apart.
///
/// # Safety
/// Prefetches never fault; `p + 15 * stride` must not overflow the address space.
#[inline(always)]
unsafe fn prefetch_rows(p: *const u16, stride: usize) {
    for r in 0..16 {
        _mm_prefetch::<_MM_HINT_T0>(p.cast::<u8>().wrapping_add(r * stride).cast());
    }
}

/// Whether a matmul at SIMD level `simd`, output rounding `round` and row length `k` can run on
/// AMX tiles: AMX granted, activations bf16 (the graph rounds them when `round` is bf16), `k` a
/// multiple of 32. Callers add their own minimum token count.
pub fn eligible(simd: super::Simd, round: DType, k: usize) -> bool {
    simd == super::Simd::Amx && round == DType::BF16 && supports(k) && available()
}

/// Whether [`matmul`] takes these shapes: `k` a multiple of 32.
pub fn supports(k: usize) -> bool {
    k > 0 && k.is_multiple_of(KS)
}

/// `out[t*m + r] = round(sum_j x[t*k + j] * W[r, j])` for `w` `[m, k]`, on AMX tiles.
/// `x` must hold bf16 values (see the module doc); rows are split across the rayon pool.
/// Quantized weights are dequantized exactly ([`QMat::dequant_bf16`]) and rounded to bf16
/// (relative error at most 2^-9 per weight) as their tiles are packed.
///
/// # Safety
/// [`available`] returned true; [`supports`]`(k)`.
pub unsafe fn matmul(x: &[f32], n: usize, k: usize, w: Weights<'_>, m: usize, out: &mut [f32], round: DType) {
    assert_eq!(x.len(), n * k, "amx matmul: x has the wrong size");
    match w {
        Weights::Bf16(w) => assert_eq!(w.len(), m * k, "amx matmul: w has the wrong size"),
        Weights::Quant(q) => assert!(q.rows == m && q.cols == k, "amx matmul: w has the wrong shape"),
    }
    assert_eq!(out.len(), n * m, "amx matmul: out has the wrong size");
    let bytes = n.div_ceil(16) * (k / KS) * TILE_U16 * 2;
    PACKED_X.with(|cell| match cell.try_borrow_mut() {
        Ok(mut xp) if bytes <= REUSE_BYTES => {
            pack_activations(x, n, k, &mut xp);
            // SAFETY: as this function's own contract.
            unsafe { matmul_packed(&xp, n, k, w, m, out, round) }
        }
        // Prefill-sized (not kept for the thread's life), or re-entered on this thread (a nested
        // call): a buffer of its own.
        _ => {
            let mut xp = Vec::new();
            pack_activations(x, n, k, &mut xp);
            // SAFETY: as this function's own contract.
            unsafe { matmul_packed(&xp, n, k, w, m, out, round) }
        }
    });
}

/// [`matmul`] on activations already packed by [`pack_activations`].
///
/// # Safety
/// As [`matmul`].
unsafe fn matmul_packed(xp: &[u16], n: usize, k: usize, w: Weights<'_>, m: usize, out: &mut [f32], round: DType) {
    let ksteps = k / KS;
    let tblocks = n.div_ceil(16);
    let chunk = super::row_chunk(m, MB);
    let outp = SharedOut(out.as_mut_ptr());
    let tpairs = tblocks.div_ceil(2);
    // Rows r0..r1 of any shape, C blocks of 32 rows x 32 tokens (the tile config is loaded).
    let general = |r0: usize, r1: usize| {
        let rblocks = (r1 - r0).div_ceil(MB);
        // Cache blocking: k in slices of KC_STEPS steps (outer), so the activations' slice
        // (n x 512 bf16) stays in L2 across all row blocks and each row block's weight slice
        // (32 x 512 bf16) in L1 across all token blocks; C accumulates in `cbuf` between slices.
        // Reused per thread (a fresh 0.5 MiB C buffer per call cost page faults); every C tile is
        // set by its first k slice (`tilezero`) before it is read, the packed weights by their
        // pack.
        let mut bufs = BLOCK_BUFS.with(|b| b.take());
        let (apack, cbuf) = &mut bufs;
        apack.resize(2 * KC_STEPS * TILE_U16, 0);
        cbuf.resize(rblocks * tpairs * 4, [0.0; 256]);
        for s0 in (0..ksteps).step_by(KC_STEPS) {
            let ns = KC_STEPS.min(ksteps - s0);
            for rbi in 0..rblocks {
                let rb = r0 + rbi * MB;
                let valid = MB.min(r1 - rb);
                // Few token blocks use each weight slice at most twice: read full row blocks in place.
                let in_place = matches!(w, Weights::Bf16(_)) && tpairs <= 2 && valid == MB;
                let (w0, w1, a_step, a_stride) = if let (Weights::Bf16(w), true) = (w, in_place) {
                    (w[rb * k + s0 * KS..].as_ptr(), w[(rb + 16) * k + s0 * KS..].as_ptr(), KS, 2 * k)
                } else {
                    // SAFETY: AVX-512F ([`available`]).
                    unsafe { pack_weights(w, k, rb, valid, s0, ns, apack) };
                    (apack.as_ptr(), apack[ns * TILE_U16..].as_ptr(), TILE_U16, 64)
                };
                // The next slice to pack (the next row block, or the first one of the next k
                // slice) streams into L2 while this one computes, a share per token pair.
                let next = if in_place {
                    None
                } else if rbi + 1 < rblocks {
                    Some((rb + MB, s0))
                } else {
                    (s0 + KC_STEPS < ksteps).then_some((r0, s0 + KC_STEPS))
                };
                for tp in 0..tpairs {
                    if let Some((nrb, ns0)) = next {
                        let rows = MB.min(r1 - nrb);
                        let nsteps = KC_STEPS.min(ksteps - ns0);
                        for r in nrb + tp * rows / tpairs..nrb + (tp + 1) * rows / tpairs {
                            prefetch_slice_row(w, k, r, ns0, nsteps);
                        }
                    }
                    let tb = 2 * tp;
                    let b0 = xp[(tb * ksteps + s0) * TILE_U16..].as_ptr();
                    let b1 = if tb + 1 < tblocks { xp[((tb + 1) * ksteps + s0) * TILE_U16..].as_ptr() } else { b0 };
                    let c = &mut cbuf[(rbi * tpairs + tp) * 4..][..4];
                    // SAFETY: the tile config is loaded on this thread; w0/w1 address ns A tiles
                    // (packed, or 16 full rows of k in place from column 32 s0), b0/b1 ns packed
                    // tiles from step s0 of their token block; c holds four 16 x 16 f32 tiles.
                    unsafe { block(w0, w1, a_step, a_stride, b0, b1, ns, c, s0 == 0) };
                    if s0 + ns == ksteps {
                        // The last k slice: C is final and in L1. C is [row][token], out
                        // [token][row]: each tile goes out transposed.
                        for (i, tile) in c.iter().enumerate() {
                            let (a, b) = (i / 2, i % 2);
                            let t0 = (tb + b) * 16;
                            let tokens = 16.min(n.saturating_sub(t0));
                            let rows = 16.min(valid.saturating_sub(16 * a));
                            if tokens > 0 && rows > 0 {
                                // SAFETY: AVX-512F ([`available`]); tokens t0 .. t0 + tokens <= n,
                                // rows rb + 16a .. + rows lie in [r0, r1), this task's rows.
                                unsafe { put_tile(outp, tile, tokens, t0 * m + rb + 16 * a, m, rows, round) };
                            }
                        }
                    }
                }
            }
        }
        // Kept only up to REUSE_C_BYTES of C: a vocabulary-sized output (every token's logits)
        // would otherwise hold tens of MiB per thread for the process's life.
        if bufs.1.capacity() * 1024 <= REUSE_C_BYTES {
            BLOCK_BUFS.with(|b| b.replace(bufs));
        }
    };
    (0..m.div_ceil(chunk)).into_par_iter().for_each(|ci| {
        let (mut r0, r1) = (ci * chunk, (ci * chunk + chunk).min(m));
        // SAFETY: AMX is available (caller); the thread releases the state below.
        unsafe { load_config() };
        // Up to 16 tokens (decode-sized batches): one B tile against one A tile per step, 16
        // weight rows at a time (see `block_rows16` for why not more).
        if let (Weights::Bf16(wb), 1) = (w, tblocks) {
            let mut c = [0.0f32; 256];
            while r0 + 16 <= r1 {
                // SAFETY: the tile config is loaded on this thread; wb[r0 * k..] starts 16 full
                // rows of k bf16 (r0 + 16 <= r1 <= m); xp holds ksteps packed tiles of the one
                // block.
                unsafe { block_rows16(wb[r0 * k..].as_ptr(), 2 * k, xp.as_ptr(), ksteps, &mut c) };
                // SAFETY: AVX-512F ([`available`]); tokens 0..n, rows r0 .. r0 + 16 lie in
                // [r0, r1), this task's rows.
                unsafe { put_tile(outp, &c, n, r0, m, 16, round) };
                r0 += 16;
            }
        }
        if r0 < r1 {
            general(r0, r1);
        }
        // SAFETY: releases this thread's tile state (AMX available).
        unsafe { release() };
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit patterns that exercise the rounding: ties to even both ways, values just off a tie,
    /// NaNs (quiet and signalling), infinities, a value that rounds up to infinity, denormals.
    const SPECIAL: [u32; 12] = [
        0x3f80_8000,
        0x3f81_8000,
        0x3f80_8001,
        0x3f80_7fff,
        0x7fc0_0001,
        0xff80_0001,
        0x7f80_0000,
        0xff80_0000,
        0x7f7f_ffff,
        0x0000_8000,
        0x8001_8000,
        0x0000_0000,
    ];

    fn value(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let bits = (*seed >> 32) as u32;
        if bits.is_multiple_of(5) {
            f32::from_bits(SPECIAL[(bits as usize / 5) % SPECIAL.len()])
        } else {
            f32::from_bits(bits & 0xbfff_ffff) // finite, any sign
        }
    }

    fn bf16_bits(v: f32) -> u16 {
        (spark_core::dtype::round_bf16(v).to_bits() >> 16) as u16
    }

    /// `pack_tile` puts token `t`'s pair `r` at `[r][t]`, rounded as `round_bf16`, with zero
    /// pairs for the tokens it is not given.
    #[test]
    fn pack_tile_matches_scalar_packing() {
        if !available() {
            eprintln!("skipped: this CPU has no AMX");
            return;
        }
        let mut seed = 3u64;
        let k = 96;
        for tokens in [1usize, 7, 16] {
            let x: Vec<f32> = (0..tokens * k).map(|_| value(&mut seed)).collect();
            for c0 in [0, 32, 64] {
                let mut tile = vec![0xaaaau16; TILE_U16];
                // SAFETY: AVX-512F/BW come with AMX (`available`); c0 + 32 <= k.
                unsafe { pack_tile(&x, k, c0, &mut tile) };
                for r in 0..16 {
                    for t in 0..16 {
                        let want = if t < tokens {
                            [bf16_bits(x[t * k + c0 + 2 * r]), bf16_bits(x[t * k + c0 + 2 * r + 1])]
                        } else {
                            [0, 0]
                        };
                        let got = [tile[r * 32 + 2 * t], tile[r * 32 + 2 * t + 1]];
                        assert_eq!(got, want, "tokens {tokens} c0 {c0} [{r}][{t}]");
                    }
                }
            }
        }
    }

    /// `put_tile` writes column `j` of a C tile as token `j`'s run of outputs, rounded, and
    /// nothing outside the given tokens and rows.
    #[test]
    fn put_tile_writes_rounded_columns_only() {
        if !available() {
            eprintln!("skipped: this CPU has no AMX");
            return;
        }
        let mut seed = 5u64;
        let tile: [f32; 256] = std::array::from_fn(|_| value(&mut seed));
        let m = 40;
        for round in [DType::F32, DType::BF16, DType::F16] {
            for (tokens, rows) in [(16usize, 16usize), (5, 16), (16, 3), (1, 1), (3, 16), (2, 7)] {
                let base = 7;
                let mut out = vec![-1.5f32; base + 16 * m];
                // SAFETY: AVX-512F comes with AMX; tokens * m + rows cells from `base` fit.
                unsafe { put_tile(SharedOut(out.as_mut_ptr()), &tile, tokens, base, m, rows, round) };
                for (idx, &got) in out.iter().enumerate() {
                    let (j, i) = ((idx.wrapping_sub(base)) / m, (idx.wrapping_sub(base)) % m);
                    let want = if idx >= base && j < tokens && i < rows { round.round(tile[i * 16 + j]) } else { -1.5 };
                    assert_eq!(got.to_bits(), want.to_bits(), "{round:?} tokens {tokens} rows {rows}: out[{idx}]");
                }
            }
        }
    }
}
