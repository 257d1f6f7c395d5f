//! `out = x W^T` for activations `x` `[n, k]` (f32) and a weight `W` `[m, k]` (f32 or bf16).
//!
//! - cuBLAS, f32 weights: `cublasGemmEx` all in f32 with `CUBLAS_COMPUTE_32F` (no TF32), the
//!   f32 parity path.
//! - cuBLAS, bf16 weights (the bf16 path, where `round` is bf16): the activations, already
//!   rounded to bf16 by the op that produced them, are converted to bf16 (exactly), multiplied
//!   with f32 accumulation into an f32 output, which is then rounded to bf16 — the reference's
//!   bf16 matmul.
//! - bf16 weights and at most [`GEMV_MAX_ROWS`] rows (decode): the GEMV kernel `gemv_bf16w`,
//!   which streams the weights once with 16-byte loads and rounds its f32 sums itself.
//! - Without cuBLAS (or bf16 weights with an f32 result): the fallback kernel `matmul_*w`, one
//!   warp per output element, f32 accumulation.
//!
//! Row-major `out[n, m] = x[n, k] W[m, k]^T` is, in cuBLAS's column-major terms,
//! `out^T (m x n, ld m) = W^T (op T of a k x m matrix, ld k) * x^T (k x n, ld k)`.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys as bsys};
use spark_core::{DType, Error, Result};

use crate::device::err;
use crate::kernels::{blocks_for, cfg, Arg, GEMV_THREADS, THREADS};
use crate::step::GemmRec;
use crate::{ensure, mode, CudaBackend, CudaRope, CudaTensor, CudaWeight};

fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(format!("cuda backend: GEMM {what} = {v} exceeds cuBLAS's int range")))
}

/// `out = round(x W^T)` (shapes checked by the caller).
pub fn matmul(b: &CudaBackend, x: &CudaTensor, w: &CudaWeight, out: &mut CudaTensor, round: DType) -> Result<()> {
    let (n, k, m) = (x.rows, x.cols, w.rows);
    if n == 0 || m == 0 {
        return Ok(());
    }
    let md = mode(round)?;
    if gemv_takes(b, x, w) {
        return gemv(b, x, w, out, md);
    }
    let use_blas = b.blas.is_some() && (w.dtype == DType::F32 || round == DType::BF16);
    if !use_blas {
        return fallback(b, x, w, out, md);
    }
    let (mi, ni, ki) = (int(m, "m")?, int(n, "n")?, int(k, "k")?);
    let out_ptr = b.ptr_mut(out.buf_mut());
    let w_ptr = b.ptr(&w.buf);
    let x_ptr = match w.dtype {
        DType::F32 => b.ptr(x.buf()),
        _ => {
            let mut s = b.scratch();
            let mut keep = vec![];
            ensure(&b.stream, &mut s.bf16, n * k, &mut keep)?;
            let xb = b.ptr_mut(s.bf16.as_mut().expect("ensured"));
            // Released before the launch, which may record the pending decode attention (that
            // takes the scratch lock itself).
            drop(s);
            b.step().keep.extend(keep);
            // f32_to_bf16_kernel(x, out, n)
            b.launch(
                &b.k.f32_to_bf16_kernel,
                "f32_to_bf16",
                cfg((blocks_for(n * k), 1), THREADS, 0),
                &[Arg::Ptr(b.ptr(x.buf())), Arg::Ptr(xb), Arg::U64((n * k) as u64)],
            )?;
            xb
        }
    };
    // out^T (m x n, ld m) = W^T (op T of a k x m matrix, ld k) * x^T (k x n, ld k).
    b.record_gemm(GemmRec {
        ta: true,
        tb: false,
        m: mi,
        n: ni,
        k: ki,
        a: w_ptr,
        lda: ki,
        stride_a: 0,
        b: x_ptr,
        ldb: ki,
        stride_b: 0,
        c: out_ptr,
        ldc: mi,
        stride_c: 0,
        batch: 1,
        bf16: w.dtype != DType::F32,
    })?;
    if md != 0 {
        // round_inplace(x, n, mode)
        b.launch(
            &b.k.round_inplace,
            "round",
            cfg((blocks_for(n * m), 1), THREADS, 0),
            &[Arg::Ptr(out_ptr), Arg::U64((n * m) as u64), Arg::I32(md)],
        )?;
    }
    Ok(())
}

/// Run a recorded cuBLAS GEMM now (see [`matmul`]).
pub fn run_gemm(b: &CudaBackend, g: &GemmRec) -> Result<()> {
    let blas_h = *b.blas.as_ref().ok_or_else(|| Error::internal("cuda: a GEMM was recorded without cuBLAS"))?.handle();
    let ab_type = if g.bf16 { bsys::cudaDataType::CUDA_R_16BF } else { bsys::cudaDataType::CUDA_R_32F };
    let alpha = 1.0f32;
    let beta = 0.0f32;
    let op = |t: bool| if t { bsys::cublasOperation_t::CUBLAS_OP_T } else { bsys::cublasOperation_t::CUBLAS_OP_N };
    let t0 = crate::profile::start(&b.stream);
    // SAFETY: the handle is bound to this backend's stream; the recorder of `g` checked that A,
    // B and C hold the `batch` matrices its dimensions, leading dimensions and strides address
    // (device buffers kept alive until the step has been launched); alpha/beta are host f32
    // values read during the call.
    unsafe {
        if g.batch == 1 {
            blas::gemm_ex(
                blas_h,
                op(g.ta),
                op(g.tb),
                g.m,
                g.n,
                g.k,
                &alpha as *const f32 as *const c_void,
                g.a as *const c_void,
                ab_type,
                g.lda,
                g.b as *const c_void,
                ab_type,
                g.ldb,
                &beta as *const f32 as *const c_void,
                g.c as *mut c_void,
                bsys::cudaDataType::CUDA_R_32F,
                g.ldc,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        } else {
            blas::gemm_strided_batched_ex(
                blas_h,
                op(g.ta),
                op(g.tb),
                g.m,
                g.n,
                g.k,
                &alpha as *const f32 as *const c_void,
                g.a as *const c_void,
                ab_type,
                g.lda,
                g.stride_a,
                g.b as *const c_void,
                ab_type,
                g.ldb,
                g.stride_b,
                &beta as *const f32 as *const c_void,
                g.c as *mut c_void,
                bsys::cudaDataType::CUDA_R_32F,
                g.ldc,
                g.stride_c,
                g.batch,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
    }
    .map_err(|e| err(&format!("cuBLAS GEMM m={} n={} k={} batch={}", g.m, g.n, g.k, g.batch), e))?;
    crate::profile::end(&b.stream, t0, || {
        format!("cublas {} m={} n={} k={} batch={}", if g.bf16 { "bf16" } else { "f32" }, g.m, g.n, g.k, g.batch)
    });
    if crate::kernels::debug_sync() {
        b.stream.synchronize().map_err(|e| err("running cublasGemmEx (SPARK_CUDA_DEBUG_SYNC)", e))?;
    }
    Ok(())
}

/// The most activation rows the GEMV kernel takes.
pub const GEMV_MAX_ROWS: usize = 16;
/// The most rows sent to the GEMV kernels by default (more go to cuBLAS). The GEMV kernels read
/// the activations once per weight row, so their cost grows with the rows: on an H200 (session
/// 6, per-kernel profile of the 1.7B shape) a 16-row step spent 6.7x the one-row time in each
/// o/down projection (89.7 vs 13.3 us) and 9x in the output head (1290 vs 141 us), where a cuBLAS
/// GEMM of 16 rows still streams the weights about once.
pub const GEMV_DEFAULT_ROWS: usize = 4;

/// Whether the GEMV kernels take `x W^T` (bf16 weights, few rows, k a multiple of 8).
pub fn gemv_takes(b: &CudaBackend, x: &CudaTensor, w: &CudaWeight) -> bool {
    b.opts.gemv
        && w.dtype == DType::BF16
        && x.rows <= b.opts.gemv_max_rows.min(GEMV_MAX_ROWS)
        && x.cols.is_multiple_of(8)
        && w.cols == x.cols
}

fn gemv(b: &CudaBackend, x: &CudaTensor, w: &CudaWeight, out: &mut CudaTensor, md: i32) -> Result<()> {
    gemv_launch(b, x, (w, out), None, md)
}

/// `out1 = x W1^T` and `out2 = x W2^T` in one launch (both GEMV-eligible, shapes checked by the
/// caller).
pub fn gemv_pair(
    b: &CudaBackend,
    x: &CudaTensor,
    first: (&CudaWeight, &mut CudaTensor),
    second: (&CudaWeight, &mut CudaTensor),
    round: DType,
) -> Result<()> {
    gemv_launch(b, x, first, Some(second), mode(round)?)
}

fn gemv_launch(
    b: &CudaBackend,
    x: &CudaTensor,
    (w1, out1): (&CudaWeight, &mut CudaTensor),
    second: Option<(&CudaWeight, &mut CudaTensor)>,
    md: i32,
) -> Result<()> {
    let (n, k, m1) = (x.rows, x.cols, w1.rows);
    let (w2, out2, m2) = match second {
        Some((w, o)) => (b.ptr(&w.buf), b.ptr_mut(o.buf_mut()), w.rows),
        None => (0, 0, 0),
    };
    // gemv_bf16w(x, w1, out1, m1, w2, out2, m2, n, k, mode): one warp per output row.
    b.launch(
        &b.k.gemv_bf16w,
        "gemv",
        cfg(
            (u32::try_from((m1 + m2).div_ceil(GEMV_WARPS)).map_err(|_| Error::invalid("GEMV rows"))?, 1),
            GEMV_THREADS,
            0,
        ),
        &[
            Arg::Ptr(b.ptr(x.buf())),
            Arg::Ptr(b.ptr(&w1.buf)),
            Arg::Ptr(b.ptr_mut(out1.buf_mut())),
            Arg::U32(m1 as u32),
            Arg::Ptr(w2),
            Arg::Ptr(out2),
            Arg::U32(m2 as u32),
            Arg::U32(n as u32),
            Arg::U32(k as u32),
            Arg::I32(md),
        ],
    )
}

/// `out = geglu(x Wg^T, x Wu^T)` in one launch (both GEMV-eligible, shapes checked by the
/// caller).
pub fn gemv_geglu(
    b: &CudaBackend,
    x: &CudaTensor,
    wg: &CudaWeight,
    wu: &CudaWeight,
    out: &mut CudaTensor,
    round: DType,
) -> Result<()> {
    let (n, k, m) = (x.rows, x.cols, wg.rows);
    // gemv_geglu_bf16w(x, wg, wu, out, m, n, k, mode): one warp per output row.
    b.launch(
        &b.k.gemv_geglu_bf16w,
        "gemv_geglu",
        cfg((u32::try_from(m.div_ceil(GEMV_WARPS)).map_err(|_| Error::invalid("GEMV rows"))?, 1), GEMV_THREADS, 0),
        &[
            Arg::Ptr(b.ptr(x.buf())),
            Arg::Ptr(b.ptr(&wg.buf)),
            Arg::Ptr(b.ptr(&wu.buf)),
            Arg::Ptr(b.ptr_mut(out.buf_mut())),
            Arg::U32(m as u32),
            Arg::U32(n as u32),
            Arg::U32(k as u32),
            Arg::I32(mode(round)?),
        ],
    )
}

/// `out1 = x W1^T` and `out2 = x W2^T` in one launch with the RoPE of the first `n_rot_heads`
/// heads of `out1` applied (positions staged at `pos`; both weights GEMV-eligible, shapes checked
/// by the caller).
pub fn gemv_qkv_rope(
    b: &CudaBackend,
    x: &CudaTensor,
    (w1, out1): (&CudaWeight, &mut CudaTensor),
    (w2, out2): (&CudaWeight, &mut CudaTensor),
    (pos, table): (u32, &CudaRope),
    (n_rot_heads, head_dim): (usize, usize),
    round: DType,
) -> Result<()> {
    let (n, k, m1, m2) = (x.rows, x.cols, w1.rows, w2.rows);
    let half = table.rot_dims / 2;
    let tasks = m1 + m2 - n_rot_heads * half;
    // gemv_qkv_rope(x, w1, out1, m1, w2, out2, m2, n, k, mode, pos, cos, sin, n_rot_heads,
    // head_dim, half): one warp per task (a rotated pair of rows, or one row).
    b.launch(
        &b.k.gemv_qkv_rope,
        "gemv_qkv_rope",
        cfg((u32::try_from(tasks.div_ceil(GEMV_WARPS)).map_err(|_| Error::invalid("GEMV rows"))?, 1), GEMV_THREADS, 0),
        &[
            Arg::Ptr(b.ptr(x.buf())),
            Arg::Ptr(b.ptr(&w1.buf)),
            Arg::Ptr(b.ptr_mut(out1.buf_mut())),
            Arg::U32(m1 as u32),
            Arg::Ptr(b.ptr(&w2.buf)),
            Arg::Ptr(b.ptr_mut(out2.buf_mut())),
            Arg::U32(m2 as u32),
            Arg::U32(n as u32),
            Arg::U32(k as u32),
            Arg::I32(mode(round)?),
            Arg::Stage(pos),
            Arg::Ptr(b.ptr(&table.cos)),
            Arg::Ptr(b.ptr(&table.sin)),
            Arg::U32(n_rot_heads as u32),
            Arg::U32(head_dim as u32),
            Arg::U32(half as u32),
        ],
    )
}

/// Warps (output rows) per block of the GEMV kernels.
const GEMV_WARPS: usize = (GEMV_THREADS / 32) as usize;

fn fallback(b: &CudaBackend, x: &CudaTensor, w: &CudaWeight, out: &mut CudaTensor, md: i32) -> Result<()> {
    let (n, k, m) = (x.rows, x.cols, w.rows);
    let f = match w.dtype {
        DType::F32 => &b.k.matmul_f32w,
        _ => &b.k.matmul_bf16w,
    };
    let grid = (m.div_ceil((THREADS / 32) as usize) as u32, n.min(65535) as u32);
    // matmul_{f32,bf16}w(x, w, out, n, k, m, mode)
    b.launch(
        f,
        "matmul (fallback)",
        cfg(grid, THREADS, 0),
        &[
            Arg::Ptr(b.ptr(x.buf())),
            Arg::Ptr(b.ptr(&w.buf)),
            Arg::Ptr(b.ptr_mut(out.buf_mut())),
            Arg::U32(n as u32),
            Arg::U32(k as u32),
            Arg::U32(m as u32),
            Arg::I32(md),
        ],
    )
}
