//! `out = x W^T` for activations `x` `[n, k]` (f32) and a weight `W` `[m, k]` (f32 or bf16).
//!
//! - cuBLAS, f32 weights: `cublasGemmEx` all in f32 with `CUBLAS_COMPUTE_32F` (no TF32), the
//!   f32 parity path.
//! - cuBLAS, bf16 weights (the bf16 path, where `round` is bf16): the activations, already
//!   rounded to bf16 by the op that produced them, are converted to bf16 (exactly), multiplied
//!   with f32 accumulation into an f32 output, which is then rounded to bf16 — the reference's
//!   bf16 matmul.
//! - Without cuBLAS (or bf16 weights with an f32 result): the fallback kernel `matmul_*w`, one
//!   warp per output element, f32 accumulation.
//!
//! Row-major `out[n, m] = x[n, k] W[m, k]^T` is, in cuBLAS's column-major terms,
//! `out^T (m x n, ld m) = W^T (op T of a k x m matrix, ld k) * x^T (k x n, ld k)`.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys as bsys};
use spark_core::{DType, Error, Result};

use crate::device::err;
use crate::kernels::{blocks_for, cfg, launch, Arg, THREADS};
use crate::{ensure, mode, CudaBackend, CudaTensor, CudaWeight};

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
    let use_blas = b.blas.is_some() && (w.dtype == DType::F32 || round == DType::BF16);
    if !use_blas {
        return fallback(b, x, w, out, md);
    }
    let blas_h = *b.blas.as_ref().expect("checked above").handle();
    let (mi, ni, ki) = (int(m, "m")?, int(n, "n")?, int(k, "k")?);
    let alpha = 1.0f32;
    let beta = 0.0f32;
    let out_ptr = b.ptr_mut(&mut out.buf);
    let w_ptr = b.ptr(&w.buf);
    let mut s = b.scratch();
    let (x_ptr, ab_type) = match w.dtype {
        DType::F32 => (b.ptr(&x.buf), bsys::cudaDataType::CUDA_R_32F),
        _ => {
            ensure(&b.stream, &mut s.bf16, n * k)?;
            let xb = b.ptr_mut(s.bf16.as_mut().expect("ensured"));
            // f32_to_bf16_kernel(x, out, n)
            launch(
                &b.stream,
                &b.k.f32_to_bf16_kernel,
                "f32_to_bf16",
                cfg((blocks_for(n * k), 1), THREADS, 0),
                &[Arg::Ptr(b.ptr(&x.buf)), Arg::Ptr(xb), Arg::U64((n * k) as u64)],
            )?;
            (xb, bsys::cudaDataType::CUDA_R_16BF)
        }
    };
    let t0 = crate::profile::start(&b.stream);
    // SAFETY: the handle is bound to this backend's stream; W is `[m, k]` (m*k elements of
    // `ab_type`), x (or its bf16 copy, which `s` keeps alive and unchanged until the stream has
    // run this GEMM: every user of the scratch is on the same stream) is `[n, k]`, out is
    // `[n, m]` f32 (checked by the caller); alpha/beta are host f32 values read during the call.
    unsafe {
        blas::gemm_ex(
            blas_h,
            bsys::cublasOperation_t::CUBLAS_OP_T,
            bsys::cublasOperation_t::CUBLAS_OP_N,
            mi,
            ni,
            ki,
            &alpha as *const f32 as *const c_void,
            w_ptr as *const c_void,
            ab_type,
            ki,
            x_ptr as *const c_void,
            ab_type,
            ki,
            &beta as *const f32 as *const c_void,
            out_ptr as *mut c_void,
            bsys::cudaDataType::CUDA_R_32F,
            mi,
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| err(&format!("cublasGemmEx [{n}, {k}] x [{m}, {k}]^T"), e))?;
    crate::profile::end(&b.stream, t0, || format!("cublas {:?} n={n} k={k} m={m}", w.dtype));
    if crate::kernels::debug_sync() {
        b.stream.synchronize().map_err(|e| err("running cublasGemmEx (SPARK_CUDA_DEBUG_SYNC)", e))?;
    }
    drop(s);
    if md != 0 {
        // round_inplace(x, n, mode)
        launch(
            &b.stream,
            &b.k.round_inplace,
            "round",
            cfg((blocks_for(n * m), 1), THREADS, 0),
            &[Arg::Ptr(out_ptr), Arg::U64((n * m) as u64), Arg::I32(md)],
        )?;
    }
    Ok(())
}

fn fallback(b: &CudaBackend, x: &CudaTensor, w: &CudaWeight, out: &mut CudaTensor, md: i32) -> Result<()> {
    let (n, k, m) = (x.rows, x.cols, w.rows);
    let f = match w.dtype {
        DType::F32 => &b.k.matmul_f32w,
        _ => &b.k.matmul_bf16w,
    };
    let grid = (m.div_ceil((THREADS / 32) as usize) as u32, n.min(65535) as u32);
    // matmul_{f32,bf16}w(x, w, out, n, k, m, mode)
    launch(
        &b.stream,
        f,
        "matmul (fallback)",
        cfg(grid, THREADS, 0),
        &[
            Arg::Ptr(b.ptr(&x.buf)),
            Arg::Ptr(b.ptr(&w.buf)),
            Arg::Ptr(b.ptr_mut(&mut out.buf)),
            Arg::U32(n as u32),
            Arg::U32(k as u32),
            Arg::U32(m as u32),
            Arg::I32(md),
        ],
    )
}
