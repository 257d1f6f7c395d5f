//! CPU kernels: SIMD selection at run time, and the dot products every op is built from.
//!
//! [`Simd::detect`] picks AMX-BF16, AVX-512F or AVX2+FMA(+F16C) when the processor has them, else
//! the portable path.
//! `SPARK_CPU_SIMD=portable`, `=avx2` or `=avx512` caps the level (tests compare the paths).
//! AVX-512F changes the prefill micro-kernel and the GEGLU loop ([`gelu`]); on Intel cores at the
//! `Avx512` level (no AMX), where `vdpbf16ps` issues at a quarter of the FMA rate, every float
//! prefill of 16 tokens and more runs an f32 FMA kernel on transposed activations
//! ([`prefill_fma512`], [`matmul::vdpbf16ps_is_slow`]); AVX512_BF16 without
//! AMX (Zen 4/5) the matmuls with bf16 activations of 2-15 tokens (bf16 weights) and of prefill
//! (bf16 weights from 16 tokens, int4 from 32, int8 from 64, the quantized ones dequantized to
//! bf16) ([`avx512bf16`], `vdpbf16ps`), and prefill attention (the AMX path's layouts, products
//! in `vdpbf16ps`: [`attn_amx`]); AMX the
//! matmuls whose activations are bf16: bf16 weights from one token (16 weight rows at a time up
//! to 16 tokens), int8/int4 weights of more than 64 tokens (dequantized into bf16 tiles; also
//! the int8 layouts AMX INT8 does not take, from 32) ([`amx`]), and prefill attention with bf16
//! activations ([`attn_amx`]); everything else runs the AVX2 code. The decode GEMVs prefetch
//! the next tile's rows (`Prefetcher`).
//!
//! The integer (quantized-weight) kernels have their own level, [`QSimd`]: where the float level
//! is AMX and the processor has AMX-INT8, AMX INT8 tiles for symmetric int8 weights at 1 to 64
//! tokens and int4 at 3 to 64 (per-row scales or groups of a multiple of 32, [`amx_int8`]) and
//! VNNI for the rest; else AVX-512 VNNI (with AVX-512BW) when present, else AVX2, else portable.
//! `SPARK_CPU_SIMD=amx-bf16` caps it at VNNI (keeping AMX BF16), `=avx512` below VNNI (AVX-512
//! without VNNI runs the AVX2 integer kernels), `=avx2` and `=portable` as above.

pub mod amx;
pub mod amx_int8;
pub mod attn_amx;
pub mod attn_avx2;
pub mod attn_avx512;
pub mod avx2;
pub mod avx512;
pub mod avx512bf16;
pub mod batch_fma512;
pub mod gelu;
pub mod matmul;
pub mod portable;
pub mod prefill_fma512;
pub mod qavx2;
pub mod qavx512;
pub mod qdecode16;
pub mod qmatmul;
pub mod qpanels16_avx2;
pub mod qpanels_avx2;
pub mod qprefill_avx2;
pub mod qprefill_vnni;

pub use gelu::gelu_erf;

use std::sync::OnceLock;

/// The instruction set a kernel uses, in increasing order of capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    Portable,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 + FMA + F16C + AVX-512F (prefill micro-kernel on 16-float vectors).
    Avx512,
    /// All of the above + AMX-TILE/AMX-BF16 granted by the OS (bf16 matmul tiles).
    Amx,
}

impl Simd {
    /// What this processor supports (cached), honouring `SPARK_CPU_SIMD=portable|avx2|avx512`.
    pub fn detect() -> Simd {
        static S: OnceLock<Simd> = OnceLock::new();
        *S.get_or_init(|| {
            let cap = std::env::var("SPARK_CPU_SIMD").unwrap_or_default();
            if cap == "portable" {
                return Simd::Portable;
            }
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
                {
                    if cap != "avx2" && is_x86_feature_detected!("avx512f") {
                        if cap != "avx512" && amx::available() {
                            return Simd::Amx;
                        }
                        return Simd::Avx512;
                    }
                    return Simd::Avx2;
                }
            }
            Simd::Portable
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Simd::Portable => "portable",
            Simd::Avx2 => "avx2+fma",
            Simd::Avx512 => "avx512f",
            Simd::Amx => "avx512f+amx-bf16",
        }
    }

    /// The integer-kernel level that goes with this float level: VNNI from `Avx512`, AMX INT8
    /// only at `Amx`, each on a processor that has it (and no `SPARK_CPU_SIMD` cap below it).
    pub fn qsimd(self) -> QSimd {
        match self {
            Simd::Portable => QSimd::Portable,
            Simd::Avx2 => QSimd::Avx2,
            Simd::Avx512 => QSimd::detect().clamp(QSimd::Avx2, QSimd::Avx512Vnni),
            Simd::Amx => QSimd::detect().max(QSimd::Avx2),
        }
    }
}

/// The instruction set of the integer (W8A8 / W4A8) matmul kernels, in increasing order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum QSimd {
    /// Scalar integer dot products (the reference).
    Portable,
    /// AVX2 `vpmaddubsw` (sign trick for int8); also used on AVX-512 without VNNI.
    Avx2,
    /// AVX-512 `vpdpbusd` on 64 bytes at a time (needs AVX-512F, BW and VNNI).
    Avx512Vnni,
    /// VNNI plus AMX INT8 tiles (`tdpbssd` / `tdpbusd`) for the int8 and int4 weights of
    /// decode-sized batches ([`amx_int8::takes`]); everything else at this level runs the VNNI
    /// kernels.
    AmxInt8,
}

impl QSimd {
    /// What this processor supports (cached), honouring
    /// `SPARK_CPU_SIMD=portable|avx2|avx512|amx-bf16`.
    pub fn detect() -> QSimd {
        static S: OnceLock<QSimd> = OnceLock::new();
        *S.get_or_init(|| match Simd::detect() {
            Simd::Portable => QSimd::Portable,
            Simd::Avx2 => QSimd::Avx2,
            Simd::Avx512 | Simd::Amx => {
                #[cfg(target_arch = "x86_64")]
                {
                    let cap = std::env::var("SPARK_CPU_SIMD").unwrap_or_default();
                    if cap != "avx512" && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vnni")
                    {
                        if cap != "amx-bf16" && Simd::detect() == Simd::Amx && amx_int8::available() {
                            return QSimd::AmxInt8;
                        }
                        return QSimd::Avx512Vnni;
                    }
                }
                QSimd::Avx2
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            QSimd::Portable => "portable",
            QSimd::Avx2 => "avx2",
            QSimd::Avx512Vnni => "avx512-vnni",
            QSimd::AmxInt8 => "avx512-vnni+amx-int8",
        }
    }
}

/// Runs `$go!(R, T)` for a register tile of `$nr` rows (4, or 1 for the last rows) and `$nt`
/// tokens (1 to 4), turning the run-time tile shape into a kernel's const generics.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_macros))]
macro_rules! tile_shape {
    ($nr:expr, $nt:expr, $go:ident) => {
        match ($nr, $nt) {
            (4, 1) => $go!(4, 1),
            (4, 2) => $go!(4, 2),
            (4, 3) => $go!(4, 3),
            (4, _) => $go!(4, 4),
            (_, 1) => $go!(1, 1),
            (_, 2) => $go!(1, 2),
            (_, 3) => $go!(1, 3),
            (_, _) => $go!(1, 4),
        }
    };
}
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_imports))]
pub(crate) use tile_shape;

/// The assembly text of one step of the AVX2 integer panels' 8-row x 6-token micro-kernels
/// ([`qprefill_avx2`], [`qpanels16_avx2`]): the panel vector at byte `$w` from `{wp}` into
/// `{w}`, then for each token `t` its 4 bytes at `$q` from its row (`{q0}`, `{q0} + {kp}`,
/// `{q0} + 2 {kp}`, `{q3}`, `{q3} + {kp}`, `{q3} + 2 {kp}`) broadcast into `{b}`, multiplied by
/// `$mul` (`vpmaddubsw` or `vpmaddwd`) and added into `{a<t>}` by `$add`.
///
/// Written out because the compiled intrinsics left work in these loops: for int4 LLVM loaded
/// later steps' weight vectors ahead and spilled accumulators across the block, for int8 it kept
/// one step per loop iteration. Kernel bench at the AVX2 level on a Zen 4 (`bench_kernels`, 512
/// tokens, one thread, 2048 x 2048 and 2048 x 6656, GMAC/s): int4 with sub-scales 89.5 -> 99.4
/// and 96.9 -> 109.1, int8 per row 65.1 -> 72.3 and 71.2 -> 77.6, Q8_0 55.5 -> 59.7 and 58.2 ->
/// 64.6. The same treatment of int6's step pairs ([`qpanels_avx2`]) ran slower (82.6 -> 76.8)
/// and was not kept.
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
macro_rules! panel_step_6 {
    ($mul:literal, $add:literal, $w:literal, $q:literal) => {
        concat!(
            "vmovdqu {w}, ymmword ptr [{wp} + ", $w, "]\n",
            "vpbroadcastd {b}, dword ptr [{q0} + ", $q, "]\n", $mul, " {b}, {w}, {b}\n", $add, " {a0}, {a0}, {b}\n",
            "vpbroadcastd {b}, dword ptr [{q0} + {kp} + ", $q, "]\n", $mul, " {b}, {w}, {b}\n", $add, " {a1}, {a1}, {b}\n",
            "vpbroadcastd {b}, dword ptr [{q0} + {kp}*2 + ", $q, "]\n", $mul, " {b}, {w}, {b}\n", $add, " {a2}, {a2}, {b}\n",
            "vpbroadcastd {b}, dword ptr [{q3} + ", $q, "]\n", $mul, " {b}, {w}, {b}\n", $add, " {a3}, {a3}, {b}\n",
            "vpbroadcastd {b}, dword ptr [{q3} + {kp} + ", $q, "]\n", $mul, " {b}, {w}, {b}\n", $add, " {a4}, {a4}, {b}\n",
            "vpbroadcastd {b}, dword ptr [{q3} + {kp}*2 + ", $q, "]\n", $mul, " {b}, {w}, {b}\n", $add, " {a5}, {a5}, {b}\n",
        )
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use panel_step_6;

/// The six accumulators (from zero) of `$n` (at least 1) rounds of [`panel_step_6`] at the
/// `($w, $q)` offsets given, with `$mul` and `$add`; after each round the panel pointer `$wp`
/// moves `$wstep` bytes and the token pointers `$q0` (token 0) and `$q3` (token 3) `$qstep`;
/// tokens are `$kp` bytes apart. An expression of type `[__m256i; 6]`; needs `unsafe` and AVX2.
#[cfg(target_arch = "x86_64")]
macro_rules! panel_loop_6 {
    (
        $mul:literal, $add:literal, [$(($w:literal, $q:literal)),*],
        wp: $wp:expr, q0: $q0:expr, q3: $q3:expr, kp: $kp:expr, n: $n:expr,
        wstep: $wstep:literal, qstep: $qstep:literal
    ) => {{
        let [mut a0, mut a1, mut a2, mut a3, mut a4, mut a5] = [_mm256_setzero_si256(); 6];
        std::arch::asm!(
            "2:",
            $($crate::kernels::panel_step_6!($mul, $add, $w, $q),)*
            concat!("add {wp}, ", $wstep),
            concat!("add {q0}, ", $qstep),
            concat!("add {q3}, ", $qstep),
            "dec {n}",
            "jnz 2b",
            wp = inout(reg) $wp => _,
            q0 = inout(reg) $q0 => _,
            q3 = inout(reg) $q3 => _,
            kp = in(reg) $kp,
            n = inout(reg) $n => _,
            w = out(ymm_reg) _,
            b = out(ymm_reg) _,
            a0 = inout(ymm_reg) a0,
            a1 = inout(ymm_reg) a1,
            a2 = inout(ymm_reg) a2,
            a3 = inout(ymm_reg) a3,
            a4 = inout(ymm_reg) a4,
            a5 = inout(ymm_reg) a5,
            options(pure, readonly, nostack),
        );
        [a0, a1, a2, a3, a4, a5]
    }};
}
#[cfg(target_arch = "x86_64")]
pub(crate) use panel_loop_6;

/// Calls `$run::<$f, $s, E>($args)` with `E` the type of the weight's scales and biases: f16
/// ([`qmatmul::H16`]) when `$half`, else `f32` (the integer kernels' dispatch).
#[cfg(target_arch = "x86_64")]
macro_rules! by_side {
    ($half:expr, $run:ident::<$f:ty, $s:ty>($($a:expr),*)) => {
        if $half {
            $run::<$f, $s, super::qmatmul::H16>($($a),*)
        } else {
            $run::<$f, $s, f32>($($a),*)
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use by_side;

/// Streams the rows the next tile of a GEMV will read into L2 while the current tile runs, one
/// slice per step of it ([`PrefetchCursor`]). A tile's rows are a few KiB each: runs too short for the hardware
/// prefetcher to keep a decode GEMV at the memory's pace on its own (measured: +15-25 % decode
/// speed on Sapphire Rapids).
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Prefetcher {
    next: *const u8,
    /// Bytes per step (0: nothing to prefetch).
    step: usize,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl Prefetcher {
    /// Nothing to prefetch.
    pub(crate) fn none() -> Prefetcher {
        Prefetcher { next: std::ptr::null(), step: 0 }
    }

    /// `bytes` from `next` (inside one allocation; `next` may be null when `bytes == 0`) over
    /// `steps` steps.
    pub(crate) fn new(next: *const u8, bytes: usize, steps: usize) -> Prefetcher {
        if steps == 0 || bytes == 0 {
            return Prefetcher::none();
        }
        Prefetcher { next, step: bytes.div_ceil(steps) }
    }

    /// `rows` rows of `row_bytes` bytes from row `first` of the matrix at `base` (rows past
    /// `first` that the caller has checked exist) over `steps` steps.
    pub(crate) fn rows(base: *const u8, row_bytes: usize, first: usize, rows: usize, steps: usize) -> Prefetcher {
        Prefetcher::new(base.wrapping_add(first * row_bytes), rows * row_bytes, steps)
    }

    /// This prefetcher's steps, taken in order.
    pub(crate) fn cursor(self) -> PrefetchCursor {
        PrefetchCursor { next: self.next, off: 0, hi: 0, step: self.step }
    }
}

/// A [`Prefetcher`] walked in order ([`Prefetcher::cursor`]): each [`PrefetchCursor::advance`]
/// fetches the next step's lines, each line once, with an add and a compare (forming step
/// `i`'s slice from `i`, two multiplies and a mask per call, took about a tenth of an
/// L2-resident int4 GEMV's time on Sapphire Rapids).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct PrefetchCursor {
    next: *const u8,
    /// Offset of the next line to fetch, and the end of the steps taken so far.
    off: usize,
    hi: usize,
    step: usize,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl PrefetchCursor {
    /// Prefetch the next step's slice into L2.
    ///
    /// # Safety
    /// None beyond the [`Prefetcher`]'s: a prefetch never faults (called more often than the
    /// step count, it fetches past the region).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(crate) unsafe fn advance(&mut self) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        self.hi += self.step;
        while self.off < self.hi {
            _mm_prefetch::<_MM_HINT_T1>(self.next.wrapping_add(self.off) as *const i8);
            self.off += 64;
        }
    }
}

/// Rows per task when `m` weight rows are split over the current thread pool: enough chunks to
/// balance the threads (about four per thread), each a multiple of `multiple` rows (a tile or
/// panel height).
pub(crate) fn row_chunk(m: usize, multiple: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    (m.div_ceil(threads * 4)).div_ceil(multiple).max(1) * multiple
}

/// An output pointer shared by threads that each write their own disjoint cells (the matmul
/// and attention drivers split rows and heads across the pool).
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: used only to write disjoint cells from different threads.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Write `v` at `out[idx]`.
    ///
    /// # Safety
    /// The cell must be inside the buffer and written by no other thread.
    #[inline]
    pub(crate) unsafe fn put(self, idx: usize, v: f32) {
        *self.0.add(idx) = v;
    }
    /// Write `src` rounded to `round` at `out[idx..idx + src.len()]` (the rounding chosen once,
    /// so the loop vectorizes).
    ///
    /// # Safety
    /// The cells must be inside the buffer and written by no other thread.
    #[inline]
    pub(crate) unsafe fn put_rounded(self, idx: usize, src: &[f32], round: spark_core::DType) {
        // SAFETY: the caller's cells are inside the buffer and this thread's alone.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.0.add(idx), src.len()) };
        match round {
            spark_core::DType::F32 => dst.copy_from_slice(src),
            spark_core::DType::BF16 => {
                for (o, &v) in dst.iter_mut().zip(src) {
                    *o = spark_core::dtype::round_bf16(v);
                }
            }
            spark_core::DType::F16 => {
                for (o, &v) in dst.iter_mut().zip(src) {
                    *o = round.round(v);
                }
            }
        }
    }
    /// The raw pointer (for a task that owns a whole slice of the output).
    #[inline]
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// A key / value element the attention tile loops ([`attn_avx512`], [`attn_avx2`]) read: f32,
/// or bf16 bits (`u16`).
#[cfg(target_arch = "x86_64")]
pub trait KvEl: Copy {
    /// 16 values from `p` as f32 (exact).
    ///
    /// # Safety
    /// AVX-512F; `p` holds 16 elements.
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    /// 8 values from `p` as f32 (exact).
    ///
    /// # Safety
    /// AVX2; `p` holds 8 elements.
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

#[cfg(target_arch = "x86_64")]
impl KvEl for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

#[cfg(target_arch = "x86_64")]
impl KvEl for u16 {
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))))
    }
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
    }
}

/// A row of weights in its stored type.
#[derive(Clone, Copy)]
pub enum Row<'a> {
    F32(&'a [f32]),
    BF16(&'a [u16]),
    F16(&'a [u16]),
}

impl Row<'_> {
    pub fn len(&self) -> usize {
        match self {
            Row::F32(r) => r.len(),
            Row::BF16(r) | Row::F16(r) => r.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `len` elements from `start`.
    pub fn slice(self, start: usize, len: usize) -> Self {
        match self {
            Row::F32(r) => Row::F32(&r[start..start + len]),
            Row::BF16(r) => Row::BF16(&r[start..start + len]),
            Row::F16(r) => Row::F16(&r[start..start + len]),
        }
    }
    /// The row as f32 into `out` (`len` long; exact for every storage type).
    pub fn to_f32(&self, out: &mut [f32]) {
        match self {
            Row::F32(r) => out.copy_from_slice(r),
            Row::BF16(r) => {
                assert_eq!(out.len(), r.len(), "Row::to_f32: output length");
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: AVX-512F detected; both slices hold `r.len()` elements.
                    unsafe { avx512::bf16_to_f32(r, out) };
                    return;
                }
                for (o, &b) in out.iter_mut().zip(r.iter()) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            Row::F16(r) => {
                assert_eq!(out.len(), r.len(), "Row::to_f32: output length");
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: AVX-512F detected; both slices hold `r.len()` elements.
                    unsafe { avx512::f16_to_f32(r, out) };
                    return;
                }
                for (o, &b) in out.iter_mut().zip(r.iter()) {
                    *o = half::f16::from_bits(b).to_f32();
                }
            }
        }
    }
    /// Element `i` as f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Row::F32(r) => r[i],
            Row::BF16(r) => half::bf16::from_bits(r[i]).to_f32(),
            Row::F16(r) => half::f16::from_bits(r[i]).to_f32(),
        }
    }
}

/// `sum_i x[i] * w[i]`.
#[inline]
pub fn dot(simd: Simd, x: &[f32], w: Row<'_>) -> f32 {
    debug_assert_eq!(x.len(), w.len());
    match simd {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Simd::Avx2`/`Avx512` are only produced by `detect` after checking avx2, fma
        // and f16c.
        Simd::Avx2 | Simd::Avx512 | Simd::Amx => unsafe { avx2::dot(x, w) },
        // Other architectures: `detect` never returns an x86 level there.
        _ => portable::dot(x, w),
    }
}

/// `out[i] += a * w[i]`.
#[inline]
pub fn axpy(simd: Simd, a: f32, w: Row<'_>, out: &mut [f32]) {
    debug_assert_eq!(out.len(), w.len());
    match simd {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot`.
        Simd::Avx2 | Simd::Avx512 | Simd::Amx => unsafe { avx2::axpy(a, w, out) },
        // Other architectures: `detect` never returns an x86 level there.
        _ => portable::axpy(a, w, out),
    }
}
