//! backend-cuda: spark's CUDA backend.
//!
//! Implements [`spark_core::Backend`] on one NVIDIA GPU through cudarc, which loads libcuda,
//! libcublas and libnvrtc at run time: the crate builds and links with no CUDA toolkit, and on a
//! machine without a driver [`plugin::probe`] reports the device unusable instead of panicking.
//! Every op mirrors backend-cpu exactly (f32 math, rounding to the compute dtype where the
//! reference casts); activations are f32 on the device, weights and KV f32 or bf16.
//!
//! - [`device`]: library and device discovery, error conversion, panic guard.
//! - [`kernels`]: the CUDA C kernels (`kernels.cu`), compiled by NVRTC or loaded from the
//!   bundled PTX, and the launch helper.
//! - [`gemm`]: `x W^T` with cuBLAS (f32, or bf16 inputs with f32 accumulation), or the fallback
//!   kernel where cuBLAS is missing.
//! - [`kv`]: the K/V cache in device memory (ring for sliding layers, growing for full).
//! - [`plugin`]: the backend as a factory, exported as the `spark_backend_v1` plugin entry.
//! - [`profile`]: `SPARK_CUDA_PROFILE=1`, GPU time per kernel and GEMM shape.
//! - [`step`]: the launches of a step, recorded and run at its end, as a CUDA graph where a step
//!   repeats (decode).

pub mod device;
pub mod gemm;
pub mod kernels;
pub mod kv;
pub mod plugin;
pub mod profile;
pub mod step;

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    ValidAsZeroBits,
};
use spark_core::backend::{AttnChunk, AttnShape, Backend, WeightRole};
use spark_core::config::GateAct;
use spark_core::kv::{KvKind, KvSpec};
use spark_core::rope::RopeTable;
use spark_core::weights::Tensor as HostTensor;
use spark_core::{DType, Error, ErrorKind, Result};

use device::{err, guard, DeviceFacts, Libs};
use kernels::{blocks_for, cfg, launch_now, Arg, Kernels, ATTN_MAX_D, ATTN_THREADS, THREADS};
pub use kv::CudaKv;
use step::{Rec, Step};

/// A row-major `[rows, cols]` f32 activation buffer in device memory; its buffer goes back to
/// the backend's pool when it is dropped.
pub struct CudaTensor {
    pub rows: usize,
    pub cols: usize,
    /// Always Some until the tensor is dropped.
    buf: Option<CudaSlice<f32>>,
    pool: Arc<Mutex<Pool>>,
}

impl CudaTensor {
    pub fn buf(&self) -> &CudaSlice<f32> {
        self.buf.as_ref().expect("a live tensor has its buffer")
    }

    pub fn buf_mut(&mut self) -> &mut CudaSlice<f32> {
        self.buf.as_mut().expect("a live tensor has its buffer")
    }
}

impl Drop for CudaTensor {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            lock(&self.pool).put(buf);
        }
    }
}

/// Activation buffers kept for reuse, by length. The same sequence of allocations in a step gets
/// the same buffers as in the step before (last in, first out), so a repeated decode step
/// launches with the same pointers and can replay a CUDA graph. Reused buffers are not zeroed:
/// every op writes the whole of its output.
#[derive(Default)]
struct Pool {
    free: std::collections::HashMap<usize, Vec<CudaSlice<f32>>>,
    /// Buffers beyond the pool's bounds, freed after the step that may still use them has been
    /// launched (a free is ordered on the stream).
    evicted: Vec<CudaSlice<f32>>,
}

/// Buffers kept per length, and lengths kept.
const POOL_PER_LEN: usize = 16;
const POOL_LENS: usize = 64;

impl Pool {
    fn take(&mut self, len: usize) -> Option<CudaSlice<f32>> {
        self.free.get_mut(&len).and_then(|v| v.pop())
    }

    fn put(&mut self, buf: CudaSlice<f32>) {
        let len = buf.len();
        if !self.free.contains_key(&len) && self.free.len() >= POOL_LENS {
            self.evicted.push(buf);
            return;
        }
        let v = self.free.entry(len).or_default();
        if v.len() >= POOL_PER_LEN {
            self.evicted.push(buf);
        } else {
            v.push(buf);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An uploaded weight: a vector (`rows == 1`) or an `[rows, cols]` matrix, f32 or bf16 bytes.
pub struct CudaWeight {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    pub buf: CudaSlice<u8>,
}

/// A RoPE table in device memory: cos and sin, `[positions, rot_dims / 2]` each.
pub struct CudaRope {
    pub rot_dims: usize,
    pub positions: usize,
    pub cos: CudaSlice<f32>,
    pub sin: CudaSlice<f32>,
}

/// Device buffers reused across calls (grown on demand).
#[derive(Default)]
struct Scratch {
    /// bf16 copy of a GEMM input.
    bf16: Option<CudaSlice<u16>>,
    /// Attention split statistics, scores and partial outputs.
    stats: Option<CudaSlice<f32>>,
    scores: Option<CudaSlice<f32>>,
    /// Dense prefill attention: scores, probabilities (bf16 or f32) and the chunk's bf16 QKV.
    dense_s: Option<CudaSlice<f32>>,
    dense_p: Option<CudaSlice<f32>>,
    dense_q: Option<CudaSlice<u16>>,
    partial: Option<CudaSlice<f32>>,
}

/// Make `slot` hold at least `n` elements. A replaced buffer goes to `keep`: launches recorded
/// earlier in the step may use it.
fn ensure<T: DeviceRepr + ValidAsZeroBits + Send + 'static>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    n: usize,
    keep: &mut Vec<Box<dyn std::any::Any + Send>>,
) -> Result<()> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        if let Some(old) = slot.take() {
            keep.push(Box::new(old));
        }
        *slot = Some(stream.alloc_zeros::<T>(n.max(1)).map_err(|e| err("allocating scratch memory", e))?);
    }
    Ok(())
}

/// The CUDA backend: one context and stream on one device, the kernels, and cuBLAS.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Option<CudaBlas>,
    /// cuBLAS's workspace, only kept alive (declared after `blas`: dropped after the handle).
    _blas_workspace: Option<CudaSlice<u8>>,
    k: Kernels,
    facts: DeviceFacts,
    libs: Libs,
    opts: Options,
    scratch: Mutex<Scratch>,
    step: Mutex<Step>,
    pool: Arc<Mutex<Pool>>,
    /// Page-locked host memory for `read` (with `Options::pinned_read`).
    pinned: Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
    /// Kernels are launched as programmatic dependent launches (`Options::pdl` where the device
    /// and the loaded PTX support it).
    pdl: bool,
    /// Bytes of dynamic shared memory `attn_flash` may take (raised at start-up where the device
    /// allows; 0 with `Options::flash_prefill` off).
    flash_shared: usize,
}

/// Which kernels the backend uses; every choice computes the same arithmetic (the parity tests
/// run each).
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// cuBLAS for the GEMMs where it is found (else the fallback GEMM kernels).
    pub cublas: bool,
    /// The small-batch GEMV kernel for bf16 weights and at most 16 rows.
    pub gemv: bool,
    /// The scored attention kernels where they apply (else the ones that recompute scores).
    pub scored_attention: bool,
    /// Replay repeated steps (decode) as CUDA graphs.
    pub graphs: bool,
    /// Attention of a chunk that starts its sequence as cuBLAS GEMMs (where cuBLAS is found).
    pub dense_prefill: bool,
    /// Other chunks of at least [`FLASH_MIN_ROWS`] tokens through the tiled `attn_flash` kernel
    /// (else the per-query scored kernels).
    pub flash_prefill: bool,
    /// The fewest keys per split where the flash attention splits a chunk's keys (to fill the
    /// device when its row blocks do not); default [`FLASH_SPLIT_KEYS`].
    pub flash_split_keys: usize,
    /// The decode chunks of a step's sequences in one batched attention launch per layer.
    pub batch_attention: bool,
    /// The most rows the GEMV kernels take (more go to cuBLAS), at most 16; default
    /// [`gemm::GEMV_DEFAULT_ROWS`].
    pub gemv_max_rows: usize,
    /// Results read back through page-locked host memory (an experiment, off by default: not
    /// yet measured on a GPU).
    pub pinned_read: bool,
    /// Programmatic dependent launches (compute capability 9.0 and newer, kernels compiled by
    /// NVRTC): a kernel's blocks start, and prefetch their weights, while the kernel before it
    /// finishes. Experimental, off by default (see `fuse`).
    pub pdl: bool,
    /// The kernels of session 6: the RoPE in the QKV GEMV, the head gate in the decode
    /// attention's last kernel, RMSNorm with the row in registers. Experimental, off by default:
    /// on an H200 these (with `pdl`) took batch-1 decode from ~400 to 486 tok/s, but tests that
    /// decode several sequences of different lengths hung there (with `pdl` on or off), from a
    /// scratch-lock self-deadlock since fixed; on the CPU stand-in they now match the default
    /// bit for bit, and they stay off until a GPU run passes; see docs/CUDA.md.
    pub fuse: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            cublas: true,
            gemv: true,
            scored_attention: true,
            graphs: true,
            dense_prefill: true,
            flash_prefill: true,
            flash_split_keys: FLASH_SPLIT_KEYS,
            batch_attention: true,
            gemv_max_rows: gemm::GEMV_DEFAULT_ROWS,
            pinned_read: false,
            pdl: false,
            fuse: false,
        }
    }
}

/// The kernels' rounding mode for `round` (0 = f32, 1 = bf16).
fn mode(round: DType) -> Result<i32> {
    match round {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        DType::F16 => Err(Error::unsupported("cuda backend: f16 compute is not implemented (use --dtype bf16 or f32)")),
    }
}

/// The most attention scores (f32) the scored kernels keep in device memory at once (256 MiB);
/// a larger chunk-by-context product takes the kernels that recompute them.
const SCORES_MAX: usize = 1 << 26;
/// The most token rows a step may have to be captured as a CUDA graph.
const GRAPH_MAX_ROWS: usize = 64;
/// Bytes of the cuBLAS workspace.
const CUBLAS_WORKSPACE: usize = 32 << 20;
/// Bytes of dynamic shared memory any kernel may take without asking.
const DEFAULT_SHARED: usize = 48 << 10;
/// The scored kernels' score rows are sized to the cache's capacity rounded up to this many
/// positions, so a decode step launches the same (one CUDA graph) for that many positions.
const KEYS_STEP: usize = 256;
/// The fewest rows a chunk needs for the dense prefill attention.
const DENSE_MIN_ROWS: usize = 32;
/// The fewest rows a chunk needs for the flash prefill attention (fewer take the split-K
/// kernels, which spread a few queries' keys over the whole device).
pub const FLASH_MIN_ROWS: usize = 16;
/// The default of [`Options::flash_split_keys`].
pub const FLASH_SPLIT_KEYS: usize = 256;

fn check(cond: bool, what: &str) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::internal(format!("cuda backend: shape mismatch in {what}")))
    }
}

fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid(format!("cuda backend: {what} = {v} does not fit in 32 bits")))
}

impl CudaBackend {
    /// Open device `ordinal`: checks the driver library and the device, loads the kernels and
    /// cuBLAS. `SPARK_CUDA_NO_CUBLAS=1` forces the fallback GEMM kernels, `SPARK_CUDA_NO_GRAPHS=1`
    /// launches every step kernel by kernel, `SPARK_CUDA_NO_BATCH_ATTENTION=1` launches each
    /// sequence's decode attention on its own, `SPARK_CUDA_NO_FLASH=1` sends prefill chunks to
    /// the per-query split-K attention kernels instead of `attn_flash`, `SPARK_CUDA_NO_DENSE=1`
    /// sends whole prompts to `attn_flash` (or those) instead of the cuBLAS attention,
    /// `SPARK_CUDA_GEMV_MAX_ROWS=N` sends steps of more than N rows (at most 16) to cuBLAS instead
    /// of the GEMV kernels, `SPARK_CUDA_PINNED_READ=1` reads results back through page-locked
    /// memory; the experimental `SPARK_CUDA_PDL=1` launches kernels as programmatic dependent
    /// launches and `SPARK_CUDA_FUSE=1` takes the fused kernels (see [`Options`]).
    pub fn new(ordinal: usize) -> Result<Self> {
        let on = |v: &str| std::env::var(v).is_ok_and(|v| v == "1");
        let d = Options::default();
        let gemv_max_rows = match std::env::var("SPARK_CUDA_GEMV_MAX_ROWS") {
            Ok(v) => v.trim().parse::<usize>().ok().filter(|&n| n <= gemm::GEMV_MAX_ROWS).ok_or_else(|| {
                Error::invalid(format!(
                    "SPARK_CUDA_GEMV_MAX_ROWS={v}: expected a number of rows from 0 to {}",
                    gemm::GEMV_MAX_ROWS
                ))
            })?,
            Err(_) => d.gemv_max_rows,
        };
        Self::with_options(
            ordinal,
            Options {
                cublas: !on("SPARK_CUDA_NO_CUBLAS"),
                graphs: !on("SPARK_CUDA_NO_GRAPHS"),
                batch_attention: !on("SPARK_CUDA_NO_BATCH_ATTENTION"),
                flash_prefill: !on("SPARK_CUDA_NO_FLASH"),
                dense_prefill: !on("SPARK_CUDA_NO_DENSE"),
                gemv_max_rows,
                pinned_read: on("SPARK_CUDA_PINNED_READ") || d.pinned_read,
                pdl: on("SPARK_CUDA_PDL") || d.pdl,
                fuse: on("SPARK_CUDA_FUSE") || d.fuse,
                ..d
            },
        )
    }

    /// As [`CudaBackend::new`], choosing the kernels (tests compare the choices).
    pub fn with_options(ordinal: usize, opts: Options) -> Result<Self> {
        let libs = Libs::detect();
        let n = device::device_count(&libs)?;
        if n == 0 {
            return Err(Error::new(ErrorKind::Unsupported, "no CUDA device (the driver reports 0 devices)"));
        }
        if ordinal >= n {
            return Err(Error::invalid(format!(
                "cuda backend: device {ordinal} does not exist ({n} device(s): 0..{})",
                n - 1
            )));
        }
        let (ctx, facts) = device::open_context(ordinal)?;
        if facts.cc < (8, 0) {
            return Err(Error::unsupported(format!(
                "cuda backend: {} has compute capability {}.{}; 8.0 or newer is needed (bf16)",
                facts.name, facts.cc.0, facts.cc.1
            )));
        }
        // SAFETY: this backend uses one stream for everything, so cudarc's cross-stream event
        // tracking is not needed; it is turned off before any buffer is allocated.
        unsafe { ctx.disable_event_tracking() };
        let stream = guard("creating a stream", || ctx.new_stream().map_err(|e| err("creating a stream", e)))?;
        let k = Kernels::load(&ctx, facts.cc, libs.nvrtc)?;
        // Only PTX compiled for compute_90 or newer has the waits PDL_ENTER puts in every kernel.
        // SPARK_CUDA_NO_PDL=1 turns it off for every backend of the process (a safety switch).
        let pdl = opts.pdl
            && facts.cc.0 >= 9
            && k.source == kernels::NVRTC_SOURCE
            && !std::env::var("SPARK_CUDA_NO_PDL").is_ok_and(|v| v == "1");
        // attn_flash takes more than the default 48 KiB of dynamic shared memory at large head
        // dims: as much as the device allows once asked (an H200 227 KiB, an A100 163 KiB).
        let flash_shared = if opts.flash_prefill {
            let want = kernels::flash_shared_bytes(ATTN_MAX_D).min(facts.shared_optin.max(0) as usize);
            let raised = k.attn_flash.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                want as i32,
            );
            match raised {
                Ok(()) => want.max(DEFAULT_SHARED),
                Err(e) => {
                    eprintln!("warning: cuda: raising attn_flash's shared memory to {want} bytes: {e:?}");
                    DEFAULT_SHARED
                }
            }
        } else {
            0
        };
        let blas = if libs.cublas && opts.cublas {
            match guard("cuBLAS", || CudaBlas::new(stream.clone()).map_err(|e| err("creating a cuBLAS handle", e))) {
                Ok(b) => Some(b),
                Err(e) => {
                    eprintln!("warning: {e}; using the fallback GEMM kernels (slow)");
                    None
                }
            }
        } else {
            None
        };
        // cuBLAS gets its own workspace, so that a GEMM captured into a CUDA graph allocates
        // nothing.
        let blas_workspace = match &blas {
            Some(b) => {
                let mut ws = stream
                    .alloc_zeros::<u8>(CUBLAS_WORKSPACE)
                    .map_err(|e| err("allocating the cuBLAS workspace", e))?;
                let p = ws.device_ptr_mut(&stream).0;
                // SAFETY: the handle is live; the workspace is CUBLAS_WORKSPACE bytes of device
                // memory that this backend keeps (field `blas_workspace`, dropped after `blas`).
                let st = unsafe {
                    cudarc::cublas::sys::cublasSetWorkspace_v2(
                        *b.handle(),
                        p as *mut std::ffi::c_void,
                        CUBLAS_WORKSPACE,
                    )
                };
                if st != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    eprintln!("warning: cuda: cublasSetWorkspace: {st:?}");
                }
                Some(ws)
            }
            None => None,
        };
        Ok(CudaBackend {
            ctx,
            stream,
            blas,
            _blas_workspace: blas_workspace,
            k,
            facts,
            libs,
            opts,
            scratch: Mutex::new(Scratch::default()),
            step: Mutex::new(Step::default()),
            pool: Arc::new(Mutex::new(Pool::default())),
            pinned: Mutex::new(None),
            pdl,
            flash_shared,
        })
    }

    pub fn facts(&self) -> &DeviceFacts {
        &self.facts
    }

    /// What runs the GEMMs and where the kernels came from, for `backends` and bench output.
    pub fn describe(&self) -> String {
        format!(
            "sm_{}{}, {}, kernels: {}{}",
            self.facts.cc.0,
            self.facts.cc.1,
            match (self.blas.is_some(), self.opts.gemv) {
                (true, true) => "cuBLAS + GEMV",
                (true, false) => "cuBLAS",
                (false, true) => "fallback GEMM + GEMV",
                (false, false) => "fallback GEMM",
            },
            self.k.source,
            if self.pdl { ", PDL" } else { "" }
        )
    }

    /// Attention of a chunk that starts its sequence (every key is the chunk's own) as two
    /// batched cuBLAS GEMMs per KV head around the `attn_softmax` kernel (see kernels.cu).
    fn attention_dense(
        &self,
        qkv: &CudaTensor,
        chunk: AttnChunk,
        shape: AttnShape,
        out: &mut CudaTensor,
        md: i32,
    ) -> Result<()> {
        let (h, kvh, d) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
        let (n, c, g) = (chunk.len, qkv.cols, h / kvh);
        let bf16 = md == 1;
        let esz = if bf16 { 2 } else { 4 } as u64;
        let i = |v: usize, what: &str| i32::try_from(v).map_err(|_| Error::invalid(format!("attention: {what} {v}")));
        // Scratch pointers first: no launch (which may record the pending attention, which
        // takes the scratch lock itself) happens while the lock is held.
        let mut s = self.scratch();
        let mut keep = vec![];
        ensure(&self.stream, &mut s.dense_s, h * n * n, &mut keep)?;
        ensure(&self.stream, &mut s.dense_p, h * n * n, &mut keep)?;
        let qb = if bf16 {
            ensure(&self.stream, &mut s.dense_q, n * c, &mut keep)?;
            Some(self.ptr_mut(s.dense_q.as_mut().expect("ensured")))
        } else {
            None
        };
        let sp = self.ptr_mut(s.dense_s.as_mut().expect("ensured"));
        let pp = self.ptr_mut(s.dense_p.as_mut().expect("ensured"));
        drop(s);
        self.step().keep.extend(keep);
        let qkv_rows = self.ptr(qkv.buf()) + (chunk.row * c * 4) as u64;
        let base = match qb {
            Some(qb) => {
                // f32_to_bf16_kernel(x, out, n): the chunk's rows (bf16 values already).
                self.launch(
                    &self.k.f32_to_bf16_kernel,
                    "f32_to_bf16",
                    cfg((blocks_for(n * c), 1), THREADS, 0),
                    &[Arg::Ptr(qkv_rows), Arg::Ptr(qb), Arg::U64((n * c) as u64)],
                )?;
                qb
            }
            None => qkv_rows,
        };
        let (ni, di, ci, nn) = (i(n, "rows")?, i(d, "head_dim")?, i(c, "qkv cols")?, (n * n) as i64);
        let psz = esz;
        for kv_head in 0..kvh {
            let q0 = kv_head * g;
            // S_h (keys x queries, column-major, ld n) = K^T-op(K) Q for the g query heads of
            // this KV head: A = K (d x n, ld c, transposed), B = Q_h (d x n, ld c), stride d.
            self.record_gemm(step::GemmRec {
                ta: true,
                tb: false,
                m: ni,
                n: ni,
                k: di,
                a: base + ((h + kv_head) * d) as u64 * esz,
                lda: ci,
                stride_a: 0,
                b: base + (q0 * d) as u64 * esz,
                ldb: ci,
                stride_b: d as i64,
                c: sp + (q0 * n * n * 4) as u64,
                ldc: ni,
                stride_c: nn,
                batch: i(g, "group")?,
                bf16,
            })?;
        }
        // attn_softmax(S, P, n, n_heads, window, scale, mode, p_bf16); one block per (query, head).
        self.launch(
            &self.k.attn_softmax,
            "attn_softmax",
            cfg((u32_of(n * h, "attention rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(sp),
                Arg::Ptr(pp),
                Arg::U32(n as u32),
                Arg::U32(h as u32),
                Arg::U32(u32_of(shape.window.unwrap_or(0), "window")?),
                Arg::F32(shape.scale),
                Arg::I32(md),
                Arg::I32(bf16 as i32),
            ],
        )?;
        let oc = out.cols;
        let o0 = self.ptr_mut(out.buf_mut()) + (chunk.row * oc * 4) as u64;
        for kv_head in 0..kvh {
            let q0 = kv_head * g;
            // O_h (d x queries, ld out cols) = V (d x keys, ld c) P_h (keys x queries, ld n).
            self.record_gemm(step::GemmRec {
                ta: false,
                tb: false,
                m: di,
                n: ni,
                k: ni,
                a: base + ((h + kvh + kv_head) * d) as u64 * esz,
                lda: ci,
                stride_a: 0,
                b: pp + (q0 * n * n) as u64 * psz,
                ldb: ni,
                stride_b: nn,
                c: o0 + (q0 * d * 4) as u64,
                ldc: i(oc, "out cols")?,
                stride_c: d as i64,
                batch: i(g, "group")?,
                bf16,
            })?;
        }
        if md != 0 {
            // round_inplace(x, n, mode): o = rnd(sum p v).
            self.launch(
                &self.k.round_inplace,
                "round",
                cfg((blocks_for(n * oc), 1), THREADS, 0),
                &[Arg::Ptr(o0), Arg::U64((n * oc) as u64), Arg::I32(md)],
            )?;
        }
        Ok(())
    }

    /// Attention of a prefill chunk (any start) by the tiled `attn_flash` kernel (see kernels.cu).
    /// Where the chunk's row blocks would not fill the device, the keys are split too, and the
    /// split results are summed by `attn_reduce`, which also appends the chunk's K/V: returns
    /// whether it did (else the caller appends).
    #[allow(clippy::too_many_arguments)]
    fn attention_flash(
        &self,
        qkv: &CudaTensor,
        chunk: AttnChunk,
        shape: AttnShape,
        kv: &CudaKv,
        out: &mut CudaTensor,
        md: i32,
        dyn_off: u32,
    ) -> Result<bool> {
        let (h, kvh, d) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
        let rows_h = chunk.len * h;
        let row_blocks = (chunk.len * (h / kvh)).div_ceil(kernels::FLASH_ROWS);
        // Split-K: enough blocks to fill the device twice over, with at least
        // `flash_split_keys` keys per split (of the most keys a row sees).
        let keys = shape.window.map_or(chunk.start_pos + chunk.len, |w| w.min(chunk.start_pos + chunk.len));
        let blocks = row_blocks * kvh;
        let target = 2 * self.facts.sms.max(1) as usize;
        let nsplit = if blocks >= target {
            1
        } else {
            target.div_ceil(blocks).min(keys / self.opts.flash_split_keys.max(1)).clamp(1, 64)
        };
        let (stats, partial) = if nsplit > 1 {
            let mut s = self.scratch();
            let mut keep = vec![];
            ensure(&self.stream, &mut s.stats, 2 * rows_h * nsplit, &mut keep)?;
            ensure(&self.stream, &mut s.partial, rows_h * nsplit * d, &mut keep)?;
            let st = self.ptr_mut(s.stats.as_mut().expect("ensured"));
            let pa = self.ptr_mut(s.partial.as_mut().expect("ensured"));
            // Released before any launch: a launch may record the pending decode attention,
            // which takes the scratch lock itself.
            drop(s);
            self.step().keep.extend(keep);
            (st, pa)
        } else {
            (0, 0)
        };
        let grid = LaunchConfig {
            grid_dim: (u32_of(row_blocks, "attention row blocks")?, kvh as u32, nsplit as u32),
            block_dim: (kernels::FLASH_THREADS, 1, 1),
            shared_mem_bytes: kernels::flash_shared_bytes(d) as u32,
        };
        let out_ptr = self.ptr_mut(out.buf_mut());
        // attn_flash(ATTN_PARAMS, n, out, out_cols, phase, stats, partial)
        let args = |phase: i32| -> Result<Vec<Arg>> {
            let mut a = self.attn_params(qkv, chunk, shape, kv, nsplit, md, dyn_off)?;
            a.extend([
                Arg::U32(u32_of(chunk.len, "chunk rows")?),
                Arg::Ptr(out_ptr),
                Arg::U32(u32_of(out.cols, "cols")?),
                Arg::I32(phase),
                Arg::Ptr(stats),
                Arg::Ptr(partial),
            ]);
            Ok(a)
        };
        if nsplit == 1 {
            self.launch(&self.k.attn_flash, "attn_flash", grid, &args(0)?)?;
            return Ok(false);
        }
        self.launch(&self.k.attn_flash, "attn_flash", grid, &args(1)?)?;
        self.launch(&self.k.attn_flash, "attn_flash", grid, &args(2)?)?;
        // The splits summed, and the KV append.
        self.launch_reduce(qkv, chunk, shape, kv, partial, (out_ptr, out.cols), nsplit, md, dyn_off)?;
        Ok(true)
    }

    /// The `ATTN_PARAMS` arguments of the attention kernels for a chunk (kernels.cu).
    #[allow(clippy::too_many_arguments)]
    fn attn_params(
        &self,
        qkv: &CudaTensor,
        chunk: AttnChunk,
        shape: AttnShape,
        kv: &CudaKv,
        nsplit: usize,
        md: i32,
        dyn_off: u32,
    ) -> Result<Vec<Arg>> {
        let (kc, vc) = kv.ptrs(&self.stream);
        Ok(vec![
            Arg::Ptr(self.ptr(qkv.buf())),
            Arg::Ptr(kc),
            Arg::Ptr(vc),
            Arg::U32(u32_of(qkv.cols, "qkv cols")?),
            Arg::U32(u32_of(chunk.row, "row")?),
            Arg::Stage(dyn_off),
            Arg::U32(shape.n_heads as u32),
            Arg::U32(shape.n_kv_heads as u32),
            Arg::U32(shape.head_dim as u32),
            Arg::U32(u32_of(shape.window.unwrap_or(0), "window")?),
            Arg::U32(u32_of(kv.ring(), "ring")?),
            Arg::U32(u32_of(nsplit, "splits")?),
            Arg::I32(kv.is_bf16() as i32),
            Arg::I32(md),
            Arg::F32(shape.scale),
        ])
    }

    /// Record `attn_reduce`: out = rnd(sum over the `nsplit` splits of `partial`) for the
    /// chunk's rows, then the chunk's KV append (see kernels.cu).
    #[allow(clippy::too_many_arguments)]
    fn launch_reduce(
        &self,
        qkv: &CudaTensor,
        chunk: AttnChunk,
        shape: AttnShape,
        kv: &CudaKv,
        partial: u64,
        out: (u64, usize),
        nsplit: usize,
        md: i32,
        dyn_off: u32,
    ) -> Result<()> {
        let (kc, vc) = kv.ptrs(&self.stream);
        // attn_reduce(partial, out, out_cols, row0, n_heads, head_dim, nsplit, mode, qkv, kc, vc,
        // qkv_cols, dyn = [start, first], n_kv_heads, ring, kv_bf16)
        self.launch(
            &self.k.attn_reduce,
            "attn_reduce",
            cfg((u32_of(chunk.len * shape.n_heads, "attention rows")?, 1), ATTN_THREADS, 0),
            &[
                Arg::Ptr(partial),
                Arg::Ptr(out.0),
                Arg::U32(u32_of(out.1, "cols")?),
                Arg::U32(u32_of(chunk.row, "row")?),
                Arg::U32(shape.n_heads as u32),
                Arg::U32(shape.head_dim as u32),
                Arg::U32(nsplit as u32),
                Arg::I32(md),
                Arg::Ptr(self.ptr(qkv.buf())),
                Arg::Ptr(kc),
                Arg::Ptr(vc),
                Arg::U32(u32_of(qkv.cols, "qkv cols")?),
                Arg::Stage(dyn_off),
                Arg::U32(shape.n_kv_heads as u32),
                Arg::U32(u32_of(kv.ring(), "ring")?),
                Arg::I32(kv.is_bf16() as i32),
            ],
        )
    }

    /// CUDA graphs captured so far, and steps run as a graph.
    pub fn graph_counts(&self) -> (u64, u64) {
        let st = self.step();
        (st.captured, st.replayed)
    }

    pub fn libs(&self) -> Libs {
        self.libs
    }

    fn scratch(&self) -> MutexGuard<'_, Scratch> {
        lock(&self.scratch)
    }

    fn step(&self) -> MutexGuard<'_, Step> {
        lock(&self.step)
    }

    /// The RMSNorm kernel (with the residual add fused: `add`) for norm weight `w`, which must be
    /// f32: the strided one, or with `Options::fuse` the one that holds the row in registers.
    fn norm_kernel(&self, w: &CudaWeight, add: bool) -> Result<&CudaFunction> {
        if w.dtype != DType::F32 {
            return Err(Error::internal("cuda backend: RMSNorm weights must be uploaded as f32"));
        }
        Ok(match (add, self.opts.fuse) {
            (false, false) => &self.k.rms_norm,
            (false, true) => &self.k.rms_norm_vec,
            (true, false) => &self.k.add_rms_norm,
            (true, true) => &self.k.add_rms_norm_vec,
        })
    }

    /// Record a launch of `f` (run when the step runs: see [`step`]).
    fn launch(&self, f: &CudaFunction, what: &'static str, c: LaunchConfig, args: &[Arg]) -> Result<()> {
        if c.grid_dim.0 == 0 || c.grid_dim.1 == 0 || c.grid_dim.2 == 0 {
            return Ok(());
        }
        self.emit_attention()?;
        let mut st = self.step();
        if st.recs.is_empty() && profile::steps() {
            st.first_rec = Some(std::time::Instant::now());
        }
        st.recs.push(Rec::Kernel { f: f.clone(), what, cfg: c, args: args.to_vec() });
        Ok(())
    }

    /// Record a cuBLAS GEMM (run when the step runs).
    fn record_gemm(&self, g: step::GemmRec) -> Result<()> {
        self.emit_attention()?;
        let mut st = self.step();
        if st.recs.is_empty() && profile::steps() {
            st.first_rec = Some(std::time::Instant::now());
        }
        st.recs.push(Rec::Gemm(g));
        Ok(())
    }

    /// Record the launches of the decode chunks' attention waiting in the step (one launch of
    /// each batched kernel for all of them; see kernels.cu).
    fn emit_attention(&self) -> Result<()> {
        let (pend, gate) = {
            let mut st = self.step();
            if st.pending_attn.is_empty() {
                return Ok(());
            }
            (std::mem::take(&mut st.pending_attn), st.pending_gate.take())
        };
        let k = pend[0].key;
        let d = k.head_dim as usize;
        let mut table = Vec::with_capacity(pend.len() * kernels::ATTN_ENTRY);
        let (mut so, mut po, mut sco, mut rows, mut splits) = (0usize, 0usize, 0usize, 0u32, 0u32);
        for p in &pend {
            let (r, n) = (p.rows_h as usize, p.nsplit as usize);
            let mut e = [0u32; kernels::ATTN_ENTRY];
            e[..7].copy_from_slice(&[p.row0, p.start, p.first, p.rows_h, p.nsplit, p.keys, p.ring]);
            e[7..11].copy_from_slice(&[p.kc as u32, (p.kc >> 32) as u32, p.vc as u32, (p.vc >> 32) as u32]);
            e[11] = u32_of(so, "stats offset")?;
            e[12] = u32_of(po, "partial offset")?;
            e[13] = u32_of(sco, "scores offset")?;
            table.extend_from_slice(&e);
            so += 2 * r * n;
            po += r * n * d;
            sco += r * p.keys as usize;
            rows = rows.max(p.rows_h);
            splits = splits.max(p.nsplit);
        }
        let tab = self.step().stage(&table);
        // This runs inside launches: one made while this thread held the scratch lock would
        // deadlock here (the session-6 hang), so that is reported as the bug it is instead.
        let mut s = match self.scratch.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                return Err(Error::internal(
                    "cuda backend: the decode attention was recorded while the scratch buffers were locked \
                     (a launch inside a scratch-lock scope)",
                ))
            }
        };
        let mut keep = vec![];
        ensure(&self.stream, &mut s.stats, so, &mut keep)?;
        ensure(&self.stream, &mut s.partial, po, &mut keep)?;
        ensure(&self.stream, &mut s.scores, sco, &mut keep)?;
        self.step().keep.extend(keep);
        let stats = self.ptr_mut(s.stats.as_mut().expect("ensured"));
        let partial = self.ptr_mut(s.partial.as_mut().expect("ensured"));
        let scores = self.ptr_mut(s.scores.as_mut().expect("ensured"));
        drop(s);
        let common = [
            Arg::Ptr(k.qkv),
            Arg::U32(k.qkv_cols),
            Arg::U32(k.n_heads),
            Arg::U32(k.n_kv_heads),
            Arg::U32(k.head_dim),
            Arg::U32(k.window),
            Arg::I32(k.kv_bf16 as i32),
            Arg::I32(k.mode),
            Arg::F32(f32::from_bits(k.scale_bits)),
            Arg::Stage(tab),
        ];
        let grid = |y: u32| LaunchConfig {
            grid_dim: (rows, y, pend.len() as u32),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // attn_scores_batch(ATTN_BATCH_PARAMS, scores, stats)
        let mut a = common.to_vec();
        a.extend([Arg::Ptr(scores), Arg::Ptr(stats)]);
        self.launch(&self.k.attn_scores_batch, "attn_scores_batch", grid(splits), &a)?;
        // attn_pv_batch(ATTN_BATCH_PARAMS, scores, stats, partial)
        let mut a = common.to_vec();
        a.extend([Arg::Ptr(scores), Arg::Ptr(stats), Arg::Ptr(partial)]);
        let pv = LaunchConfig { shared_mem_bytes: (d * 4) as u32 * (ATTN_THREADS / 32), ..grid(splits) };
        self.launch(&self.k.attn_pv_batch, "attn_pv_batch", pv, &a)?;
        // attn_reduce_batch(ATTN_BATCH_PARAMS, partial, out, out_cols, gate, gate_act): also the KV
        // appends, and the head gate where it was fused (see `head_gate`).
        let (gate, gate_act) = gate.map_or((0, 0), |g| (g.g, g.act));
        let mut a = common.to_vec();
        a.extend([Arg::Ptr(partial), Arg::Ptr(k.out), Arg::U32(k.out_cols), Arg::Ptr(gate), Arg::I32(gate_act)]);
        self.launch(&self.k.attn_reduce_batch, "attn_reduce_batch", grid(1), &a)
    }

    /// Run the recorded step: upload its staged data, then replay a captured graph of the same
    /// launches, capture one (the second time this launch list is seen), or launch one by one.
    fn flush(&self) -> Result<()> {
        self.emit_attention()?;
        let mut st = self.step();
        if st.recs.is_empty() {
            st.clear();
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let r = self.run_step(&mut st);
        if let Some(t) = st.first_rec.take() {
            st.times.steps += 1;
            st.times.record += (t0 - t).as_secs_f64();
            st.times.launch += t0.elapsed().as_secs_f64();
        }
        st.clear();
        // Pool buffers evicted during the step: their frees are ordered after its launches.
        lock(&self.pool).evicted.clear();
        r
    }

    fn run_step(&self, st: &mut Step) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| err("binding the context", e))?;
        let mut base = 0;
        if !st.stage.is_empty() {
            let n = st.stage.len();
            if st.stage_dev.as_ref().is_none_or(|d| d.len() < n) {
                st.stage_dev = None;
                st.stage_dev =
                    Some(self.stream.alloc_zeros::<u32>(n.next_power_of_two()).map_err(|e| err("staging memory", e))?);
            }
            let dev = st.stage_dev.as_mut().expect("allocated above");
            self.stream.memcpy_htod(&st.stage, &mut dev.slice_mut(0..n)).map_err(|e| err("uploading step data", e))?;
            base = dev.device_ptr(&self.stream).0;
        }
        let graphs = self.opts.graphs && !profile::enabled() && !kernels::debug_sync();
        if graphs {
            let sig = st.signature(base);
            if let Some(i) = st.graphs.iter().position(|g| g.sig == sig) {
                st.replayed += 1;
                return st.graphs[i].graph.0.launch().map_err(|e| err("launching a CUDA graph", e));
            }
            // Only decode-like steps are captured: a prefill rarely repeats, and capturing one
            // costs more than launching it.
            if st.rows <= GRAPH_MAX_ROWS && st.should_capture(&sig) {
                self.stream.begin_capture(step::CAPTURE_MODE).map_err(|e| err("beginning a graph capture", e))?;
                let r = self.launch_all(st, base);
                let g = self.stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
                match (r, g) {
                    (Ok(()), Ok(Some(g))) => {
                        st.captured += 1;
                        st.replayed += 1;
                        let g = st.keep_graph(sig, g);
                        return g.launch().map_err(|e| err("launching a CUDA graph", e));
                    }
                    // Nothing ran while capturing: run the step launch by launch, and never try
                    // to capture this list again.
                    (r, g) => {
                        let why = r.err().map(|e| e.to_string()).or_else(|| g.err().map(|e| format!("{e:?}")));
                        eprintln!(
                            "note: cuda: a step could not be captured as a CUDA graph ({}); it runs kernel by kernel",
                            why.unwrap_or_else(|| "empty graph".into())
                        );
                        st.capture_failed(&sig);
                    }
                }
            }
        }
        self.launch_all(st, base)
    }

    /// Launch every recorded operation of `st` in order.
    fn launch_all(&self, st: &Step, base: u64) -> Result<()> {
        // PDL for decode-sized steps only: in a profiled pp2048 (H200) it slowed the elementwise
        // kernels around the prefill GEMMs about 1.5x.
        let pdl = self.pdl && st.rows <= GRAPH_MAX_ROWS;
        for r in &st.recs {
            match r {
                Rec::Kernel { f, what, cfg, args } => launch_now(&self.stream, f, what, *cfg, args, base, pdl)?,
                Rec::Gemm(g) => gemm::run_gemm(self, g)?,
            }
        }
        Ok(())
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        // With event tracking off the returned guard records nothing.
        s.device_ptr(&self.stream).0
    }

    fn ptr_mut<T>(&self, s: &mut CudaSlice<T>) -> u64 {
        s.device_ptr_mut(&self.stream).0
    }

    fn upload<T: DeviceRepr>(&self, v: &[T], what: &str) -> Result<CudaSlice<T>> {
        if v.is_empty() {
            return Err(Error::internal(format!("cuda backend: empty upload of {what}")));
        }
        self.stream.clone_htod(v).map_err(|e| err(&format!("uploading {what}"), e))
    }

    /// A device copy of host bytes of `len` bytes, converted from `from` to `to` in chunks.
    fn upload_converted(&self, bytes: &[u8], from: DType, to: DType, n: usize) -> Result<CudaSlice<u8>> {
        let mut buf = self
            .stream
            .alloc_zeros::<u8>((n * to.size()).max(1))
            .map_err(|e| Error::new(ErrorKind::OutOfMemory, format!("cuda: allocating a weight: {e:?}")))?;
        if from == to {
            self.stream.memcpy_htod(bytes, &mut buf).map_err(|e| err("uploading a weight", e))?;
            return Ok(buf);
        }
        const CHUNK: usize = 1 << 22;
        let mut tmp = Vec::with_capacity(CHUNK);
        for c0 in (0..n).step_by(CHUNK) {
            let c1 = (c0 + CHUNK).min(n);
            tmp.clear();
            spark_core::dtype::decode_into(from, &bytes[c0 * from.size()..c1 * from.size()], &mut tmp);
            let enc = spark_core::dtype::encode(to, &tmp);
            let mut dst = buf.slice_mut(c0 * to.size()..c1 * to.size());
            self.stream.memcpy_htod(&enc[..], &mut dst).map_err(|e| err("uploading a weight", e))?;
        }
        Ok(buf)
    }

    fn elementwise_blocks(n: usize) -> (u32, u32) {
        (blocks_for(n), 1)
    }
}

/// The shape checks of the RoPE op: `n_rot_heads` heads of `head_dim` in each row of `qkv`, one
/// position per row, each within the table.
fn rope_check(
    qkv: &CudaTensor,
    positions: &[u32],
    table: &CudaRope,
    n_rot_heads: usize,
    head_dim: usize,
) -> Result<()> {
    check(qkv.rows == positions.len() && qkv.cols >= n_rot_heads * head_dim, "rope")?;
    check(table.rot_dims <= head_dim && table.rot_dims.is_multiple_of(2), "rope (rotary dims)")?;
    if let Some(&p) = positions.iter().find(|&&p| p as usize >= table.positions) {
        return Err(Error::invalid(format!("position {p} is beyond the RoPE table ({} positions)", table.positions)));
    }
    Ok(())
}

impl Backend for CudaBackend {
    type Weight = CudaWeight;
    type Tensor = CudaTensor;
    type Rope = CudaRope;
    type Kv = CudaKv;

    fn name(&self) -> &str {
        "cuda"
    }

    fn upload_weight(&self, t: &HostTensor, _role: WeightRole, dtype: DType) -> Result<CudaWeight> {
        let (rows, cols) = match t.shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            s => return Err(Error::model(format!("tensor '{}' has shape {s:?}; expected 1 or 2 dims", t.name))),
        };
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(Error::unsupported(format!(
                "cuda backend: {dtype} weights are not implemented (tensor '{}'; use --dtype bf16 or f32)",
                t.name
            )));
        }
        let n = rows * cols;
        if t.bytes().len() != n * t.dtype.size() {
            return Err(Error::model(format!(
                "tensor '{}': {} bytes for shape {:?} of {}",
                t.name,
                t.bytes().len(),
                t.shape,
                t.dtype
            )));
        }
        self.ctx.bind_to_thread().map_err(|e| err("binding the context", e))?;
        let buf = self.upload_converted(t.bytes(), t.dtype, dtype, n)?;
        Ok(CudaWeight { rows, cols, dtype, buf })
    }

    fn upload_rope(&self, table: &RopeTable) -> Result<CudaRope> {
        let half = table.rot_dims / 2;
        check(table.cos.len() == table.positions * half && table.sin.len() == table.cos.len(), "upload_rope")?;
        let (cos, sin) = if table.cos.is_empty() {
            (self.upload(&[0.0f32], "rope")?, self.upload(&[0.0f32], "rope")?)
        } else {
            (self.upload(&table.cos, "rope cos")?, self.upload(&table.sin, "rope sin")?)
        };
        Ok(CudaRope { rot_dims: table.rot_dims, positions: table.positions, cos, sin })
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        self.ctx.bind_to_thread().map_err(|e| err("binding the context", e))?;
        let len = (rows * cols).max(1);
        let reused = lock(&self.pool).take(len);
        let buf = match reused {
            Some(b) => b,
            None => self.stream.alloc_zeros::<f32>(len).map_err(|e| {
                Error::new(
                    ErrorKind::OutOfMemory,
                    format!("cuda: allocating a [{rows}, {cols}] activation buffer: {e:?}"),
                )
            })?,
        };
        Ok(CudaTensor { rows, cols, buf: Some(buf), pool: self.pool.clone() })
    }

    fn kv_alloc(&self, spec: &KvSpec) -> Result<CudaKv> {
        CudaKv::new(&self.stream, *spec)
    }

    fn kv_truncate(&self, kv: &mut CudaKv, new_len: usize) -> Result<()> {
        kv.truncate(new_len);
        Ok(())
    }

    fn kv_clone(&self, kv: &CudaKv) -> Result<CudaKv> {
        self.flush()?;
        kv.try_clone(&self.stream)
    }

    fn kv_bytes(&self, kv: &CudaKv) -> usize {
        kv.bytes()
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32], out: &mut CudaTensor) -> Result<()> {
        check(out.rows == ids.len() && out.cols == table.cols, "embed")?;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
            return Err(Error::invalid(format!("token id {bad} is outside the embedding table ({} rows)", table.rows)));
        }
        // A new step begins: run what an earlier one left unread (a prefill chunk with no logits).
        self.flush()?;
        if ids.is_empty() {
            return Ok(());
        }
        let ids_off = {
            let mut st = self.step();
            st.rows = ids.len();
            st.stage(ids)
        };
        let f = match table.dtype {
            DType::F32 => &self.k.embed_f32,
            _ => &self.k.embed_bf16,
        };
        // embed_{f32,bf16}(table, ids, out, cols); one block per row.
        self.launch(
            f,
            "embed",
            cfg((u32_of(ids.len(), "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr(&table.buf)),
                Arg::Stage(ids_off),
                Arg::Ptr(self.ptr_mut(out.buf_mut())),
                Arg::U32(u32_of(out.cols, "cols")?),
            ],
        )
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaWeight, eps: f32, out: &mut CudaTensor, round: DType) -> Result<()> {
        check(x.rows == out.rows && x.cols == out.cols && w.rows * w.cols == x.cols, "rms_norm")?;
        let f = self.norm_kernel(w, false)?;
        // rms_norm(x, w, out, cols, eps, mode); one block per row.
        self.launch(
            f,
            "rms_norm",
            cfg((u32_of(x.rows, "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr(x.buf())),
                Arg::Ptr(self.ptr(&w.buf)),
                Arg::Ptr(self.ptr_mut(out.buf_mut())),
                Arg::U32(u32_of(x.cols, "cols")?),
                Arg::F32(eps),
                Arg::I32(mode(round)?),
            ],
        )
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight, out: &mut CudaTensor, round: DType) -> Result<()> {
        check(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows, "matmul")?;
        gemm::matmul(self, x, w, out, round)
    }

    fn rope(
        &self,
        qkv: &mut CudaTensor,
        positions: &[u32],
        table: &CudaRope,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        round: DType,
    ) -> Result<()> {
        rope_check(qkv, positions, table, n_heads + n_kv_heads, head_dim)?;
        let half = table.rot_dims / 2;
        if positions.is_empty() || half == 0 {
            return Ok(());
        }
        let pos = self.step().stage_positions(positions);
        // rope(qkv, pos, cos, sin, cols, n_rot_heads, head_dim, half, mode); one block per row.
        self.launch(
            &self.k.rope,
            "rope",
            cfg((u32_of(qkv.rows, "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr_mut(qkv.buf_mut())),
                Arg::Stage(pos),
                Arg::Ptr(self.ptr(&table.cos)),
                Arg::Ptr(self.ptr(&table.sin)),
                Arg::U32(u32_of(qkv.cols, "cols")?),
                Arg::U32(u32_of(n_heads + n_kv_heads, "heads")?),
                Arg::U32(u32_of(head_dim, "head_dim")?),
                Arg::U32(u32_of(half, "rot_dims")?),
                Arg::I32(mode(round)?),
            ],
        )
    }

    fn attention(
        &self,
        qkv: &CudaTensor,
        chunk: AttnChunk,
        shape: AttnShape,
        kv: &mut CudaKv,
        out: &mut CudaTensor,
        round: DType,
    ) -> Result<()> {
        let (h, kvh, d) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
        check(
            out.cols == h * d
                && chunk.row + chunk.len <= qkv.rows
                && chunk.row + chunk.len <= out.rows
                && qkv.cols >= (h + 2 * kvh) * d
                && kvh > 0
                && h.is_multiple_of(kvh)
                && kv.spec.kv_heads == kvh
                && kv.spec.head_dim == d,
            "attention",
        )?;
        if d > ATTN_MAX_D {
            return Err(Error::unsupported(format!("cuda backend: head_dim {d} > {ATTN_MAX_D} is not implemented")));
        }
        if kv.len != chunk.start_pos {
            return Err(Error::internal(format!(
                "attention: cache holds {} positions, chunk starts at {}",
                kv.len, chunk.start_pos
            )));
        }
        if chunk.len == 0 {
            return Ok(());
        }
        let end = chunk.start_pos + chunk.len;
        kv.reserve(&self.stream, chunk.start_pos, end)?;
        let md = mode(round)?;
        // Append the chunk's K/V after the attention (only the last `window` positions, for a
        // ring); the chunk's start and first appended position are staged.
        let first = match kv.spec.kind {
            KvKind::Ring { window } => end.saturating_sub(window).max(chunk.start_pos),
            KvKind::Grow { .. } => chunk.start_pos,
        };
        let dyn_off = self.step().stage(&[u32_of(chunk.start_pos, "start position")?, u32_of(first, "first")?]);
        let dense = self.opts.dense_prefill
            && self.blas.is_some()
            && chunk.start_pos == 0
            && chunk.len >= DENSE_MIN_ROWS
            && h * chunk.len * chunk.len <= SCORES_MAX;
        // attn_flash reads q, k and v rows with 16-byte loads (qkv.cols % 4 == 0).
        let flash = !dense
            && chunk.len >= FLASH_MIN_ROWS
            && qkv.cols.is_multiple_of(4)
            && d.is_power_of_two()
            && (32..=ATTN_MAX_D).contains(&d)
            && kernels::flash_shared_bytes(d) <= self.flash_shared;
        if dense {
            self.attention_dense(qkv, chunk, shape, out, md)?;
        } else if flash {
            if self.attention_flash(qkv, chunk, shape, kv, out, md, dyn_off)? {
                kv.len = end;
                return Ok(());
            }
        } else {
            let rows_h = chunk.len * h;
            let max_keys = shape.window.map_or(end, |w| w.min(end));
            // The scored kernels (each score computed once, vector loads) take head dims that are
            // powers of two from 32 to 512, where the scores fit the scratch limit; else the
            // kernels that recompute the scores in the second pass.
            let scored = self.opts.scored_attention
                && d.is_power_of_two()
                && (32..=512).contains(&d)
                && rows_h * max_keys <= SCORES_MAX;
            // The scores' row stride and the split count follow the cache's capacity where that
            // fits (a decode step then launches the same at every position: one CUDA graph), else
            // the keys this chunk sees.
            let slots = kv.slots.next_multiple_of(KEYS_STEP);
            let cap_keys = shape.window.map_or(slots, |w| w.min(slots)).max(max_keys);
            let keys = if scored && rows_h * cap_keys <= SCORES_MAX { cap_keys } else { max_keys };
            // Split-K: enough blocks to fill the device twice over, with at least 32 (scored) or 64
            // keys per split.
            let target = 2 * self.facts.sms.max(1) as usize;
            let per_split = if scored { 32 } else { 64 };
            let nsplit =
                if rows_h >= target { 1 } else { target.div_ceil(rows_h).min(keys.div_ceil(per_split)).clamp(1, 64) };
            if self.opts.batch_attention && scored && rows_h < target {
                // A decode chunk: launched with the step's other sequences' chunks of this layer.
                let (kc, vc) = kv.ptrs(&self.stream);
                let (first, start) = (u32_of(first, "first")?, u32_of(chunk.start_pos, "start position")?);
                let key = step::AttnKey {
                    qkv: self.ptr(qkv.buf()),
                    qkv_cols: u32_of(qkv.cols, "qkv cols")?,
                    out: self.ptr_mut(out.buf_mut()),
                    out_cols: u32_of(out.cols, "cols")?,
                    n_heads: h as u32,
                    n_kv_heads: kvh as u32,
                    head_dim: d as u32,
                    window: u32_of(shape.window.unwrap_or(0), "window")?,
                    scale_bits: shape.scale.to_bits(),
                    mode: md,
                    kv_bf16: kv.is_bf16(),
                };
                let differs = self.step().pending_attn.first().is_some_and(|p| p.key != key);
                if differs {
                    self.emit_attention()?;
                }
                self.step().pending_attn.push(step::PendingAttn {
                    key,
                    row0: u32_of(chunk.row, "row")?,
                    start,
                    first,
                    rows_h: rows_h as u32,
                    nsplit: nsplit as u32,
                    keys: u32_of(keys, "keys")?,
                    ring: u32_of(kv.ring(), "ring")?,
                    kc,
                    vc,
                });
                kv.len = end;
                return Ok(());
            }
            let mut s = self.scratch();
            let mut keep = vec![];
            ensure(&self.stream, &mut s.stats, 2 * rows_h * nsplit, &mut keep)?;
            ensure(&self.stream, &mut s.partial, rows_h * nsplit * d, &mut keep)?;
            if scored {
                ensure(&self.stream, &mut s.scores, rows_h * keys, &mut keep)?;
            }
            let stats = self.ptr_mut(s.stats.as_mut().expect("ensured"));
            let partial = self.ptr_mut(s.partial.as_mut().expect("ensured"));
            let scores = if scored { self.ptr_mut(s.scores.as_mut().expect("ensured")) } else { 0 };
            // Released before any launch: a launch may record the pending decode attention,
            // which takes the scratch lock itself.
            drop(s);
            self.step().keep.extend(keep);
            let common = self.attn_params(qkv, chunk, shape, kv, nsplit, md, dyn_off)?;
            let grid = (u32_of(rows_h, "attention rows")?, nsplit as u32);
            let d4 = (d * 4) as u32;
            if scored {
                // attn_scores(ATTN_PARAMS, max_keys, scores, stats)
                let mut a = common.to_vec();
                a.extend([Arg::U32(u32_of(keys, "keys")?), Arg::Ptr(scores), Arg::Ptr(stats)]);
                self.launch(&self.k.attn_scores, "attn_scores", cfg(grid, ATTN_THREADS, 0), &a)?;
                // attn_pv(ATTN_PARAMS, max_keys, scores, stats, partial)
                let mut a = common.to_vec();
                a.extend([Arg::U32(keys as u32), Arg::Ptr(scores), Arg::Ptr(stats), Arg::Ptr(partial)]);
                self.launch(&self.k.attn_pv, "attn_pv", cfg(grid, ATTN_THREADS, d4 * (ATTN_THREADS / 32)), &a)?;
            } else {
                // attn_stats(ATTN_PARAMS, stats)
                let mut a = common.to_vec();
                a.push(Arg::Ptr(stats));
                self.launch(&self.k.attn_stats, "attn_stats", cfg(grid, ATTN_THREADS, d4), &a)?;
                // attn_accum(ATTN_PARAMS, stats, partial)
                let mut a = common.to_vec();
                a.push(Arg::Ptr(stats));
                a.push(Arg::Ptr(partial));
                let shared = d4 * (1 + ATTN_THREADS / 32);
                self.launch(&self.k.attn_accum, "attn_accum", cfg(grid, ATTN_THREADS, shared), &a)?;
            }
            // attn_reduce: the splits summed, and the KV append.
            let out_ptr = self.ptr_mut(out.buf_mut());
            self.launch_reduce(qkv, chunk, shape, kv, partial, (out_ptr, out.cols), nsplit, md, dyn_off)?;
            kv.len = end;
            return Ok(());
        }
        let (kc, vc) = kv.ptrs(&self.stream);
        // The dense path's KV append: kv_append(qkv, kc, vc, qkv_cols, row0, dyn = [start, first],
        // qd, kvd, ring, kv_bf16); one block per position.
        self.launch(
            &self.k.kv_append,
            "kv_append",
            cfg((u32_of(end - first, "positions")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr(qkv.buf())),
                Arg::Ptr(kc),
                Arg::Ptr(vc),
                Arg::U32(qkv.cols as u32),
                Arg::U32(chunk.row as u32),
                Arg::Stage(dyn_off),
                Arg::U32((h * d) as u32),
                Arg::U32((kvh * d) as u32),
                Arg::U32(kv.ring() as u32),
                Arg::I32(kv.is_bf16() as i32),
            ],
        )?;
        kv.len = end;
        Ok(())
    }

    fn head_gate(
        &self,
        attn: &mut CudaTensor,
        g: &CudaTensor,
        act: GateAct,
        head_dim: usize,
        round: DType,
    ) -> Result<()> {
        check(attn.rows == g.rows && attn.cols == g.cols * head_dim, "head_gate")?;
        let act = match act {
            GateAct::Sigmoid => 0,
            GateAct::Silu => 1,
        };
        let md = mode(round)?;
        if self.opts.fuse {
            // The decode attention of every row of `attn` is still waiting to be launched: its
            // last kernel applies the gate as it writes `attn` (the same arithmetic).
            let out = self.ptr(attn.buf());
            let mut st = self.step();
            let covered: usize = st.pending_attn.iter().map(|p| (p.rows_h / p.key.n_heads.max(1)) as usize).sum();
            let fits = st.pending_attn.first().is_some_and(|p| {
                p.key.out == out
                    && p.key.mode == md
                    && p.key.n_heads as usize == g.cols
                    && p.key.head_dim as usize == head_dim
            });
            if fits && covered == attn.rows && st.pending_gate.is_none() {
                st.pending_gate = Some(step::PendingGate { g: self.ptr(g.buf()), act });
                return Ok(());
            }
        }
        // head_gate(attn, g, n_heads, head_dim, act, mode); one block per row.
        self.launch(
            &self.k.head_gate,
            "head_gate",
            cfg((u32_of(attn.rows, "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr_mut(attn.buf_mut())),
                Arg::Ptr(self.ptr(g.buf())),
                Arg::U32(u32_of(g.cols, "heads")?),
                Arg::U32(u32_of(head_dim, "head_dim")?),
                Arg::I32(act),
                Arg::I32(md),
            ],
        )
    }

    fn geglu(&self, gate: &CudaTensor, up: &CudaTensor, out: &mut CudaTensor, round: DType) -> Result<()> {
        let n = gate.rows * gate.cols;
        check(up.rows * up.cols == n && out.rows * out.cols == n, "geglu")?;
        // geglu(g, u, out, n, mode)
        self.launch(
            &self.k.geglu,
            "geglu",
            cfg(Self::elementwise_blocks(n), THREADS, 0),
            &[
                Arg::Ptr(self.ptr(gate.buf())),
                Arg::Ptr(self.ptr(up.buf())),
                Arg::Ptr(self.ptr_mut(out.buf_mut())),
                Arg::U64(n as u64),
                Arg::I32(mode(round)?),
            ],
        )
    }

    fn add(&self, h: &mut CudaTensor, x: &CudaTensor) -> Result<()> {
        let n = h.rows * h.cols;
        check(x.rows * x.cols == n, "add")?;
        // add_inplace(h, x, n)
        self.launch(
            &self.k.add_inplace,
            "add",
            cfg(Self::elementwise_blocks(n), THREADS, 0),
            &[Arg::Ptr(self.ptr_mut(h.buf_mut())), Arg::Ptr(self.ptr(x.buf())), Arg::U64(n as u64)],
        )
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize], out: &mut CudaTensor) -> Result<()> {
        check(out.rows == rows.len() && out.cols == x.cols && rows.iter().all(|&r| r < x.rows), "gather_rows")?;
        if rows.is_empty() {
            return Ok(());
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx_off = self.step().stage(&idx);
        // gather_rows(x, rows, out, cols); one block per output row.
        self.launch(
            &self.k.gather_rows,
            "gather_rows",
            cfg((u32_of(rows.len(), "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr(x.buf())),
                Arg::Stage(idx_off),
                Arg::Ptr(self.ptr_mut(out.buf_mut())),
                Arg::U32(u32_of(x.cols, "cols")?),
            ],
        )
    }

    fn read(&self, x: &CudaTensor, out: &mut [f32]) -> Result<()> {
        let n = x.rows * x.cols;
        check(out.len() == n, "read")?;
        self.flush()?;
        if n == 0 {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        if self.opts.pinned_read {
            // Through page-locked host memory (not write-combined: the CPU reads it back).
            let mut p = lock(&self.pinned);
            if p.as_ref().is_none_or(|b| b.len() < n) {
                *p = None;
                // SAFETY: the buffer's contents are only read after a copy of n elements into it.
                *p = Some(
                    unsafe { self.ctx.alloc_pinned_with_flags::<f32>(n, 0) }.map_err(|e| err("pinned memory", e))?,
                );
            }
            let buf = p.as_mut().expect("allocated above");
            self.stream.memcpy_dtoh(&x.buf().slice(0..n), buf).map_err(|e| err("reading results", e))?;
            self.stream.synchronize().map_err(|e| err("running the step", e))?;
            out.copy_from_slice(&buf.as_slice().map_err(|e| err("reading results", e))?[..n]);
        } else {
            self.stream.memcpy_dtoh(&x.buf().slice(0..n), out).map_err(|e| err("reading results", e))?;
            self.stream.synchronize().map_err(|e| err("running the step", e))?;
        }
        if profile::steps() {
            self.step().times.wait += t0.elapsed().as_secs_f64();
        }
        self.ctx.check_err().map_err(|e| err("an earlier asynchronous operation", e))?;
        profile::collect();
        Ok(())
    }

    fn end_step(&self) -> Result<()> {
        self.flush()
    }

    fn matmul_pair(
        &self,
        x: &CudaTensor,
        w1: &CudaWeight,
        out1: &mut CudaTensor,
        w2: &CudaWeight,
        out2: &mut CudaTensor,
        round: DType,
    ) -> Result<()> {
        if !(gemm::gemv_takes(self, x, w1) && gemm::gemv_takes(self, x, w2)) {
            self.matmul(x, w1, out1, round)?;
            return self.matmul(x, w2, out2, round);
        }
        check(
            out1.rows == x.rows && out1.cols == w1.rows && out2.rows == x.rows && out2.cols == w2.rows,
            "matmul_pair",
        )?;
        gemm::gemv_pair(self, x, (w1, out1), (w2, out2), round)
    }

    fn matmul_pair_rope(
        &self,
        x: &CudaTensor,
        w1: &CudaWeight,
        out1: &mut CudaTensor,
        w2: &CudaWeight,
        out2: &mut CudaTensor,
        positions: &[u32],
        table: &CudaRope,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        round: DType,
    ) -> Result<()> {
        let half = table.rot_dims / 2;
        let fused = self.opts.fuse
            && half > 0
            && !positions.is_empty()
            && gemm::gemv_takes(self, x, w1)
            && gemm::gemv_takes(self, x, w2);
        if !fused {
            self.matmul_pair(x, w1, out1, w2, out2, round)?;
            return self.rope(out1, positions, table, n_heads, n_kv_heads, head_dim, round);
        }
        check(
            out1.rows == x.rows && out1.cols == w1.rows && out2.rows == x.rows && out2.cols == w2.rows,
            "matmul_pair_rope",
        )?;
        rope_check(out1, positions, table, n_heads + n_kv_heads, head_dim)?;
        let pos = self.step().stage_positions(positions);
        gemm::gemv_qkv_rope(self, x, (w1, out1), (w2, out2), (pos, table), (n_heads + n_kv_heads, head_dim), round)
    }

    fn matmul_geglu(
        &self,
        x: &CudaTensor,
        w_gate: &CudaWeight,
        w_up: &CudaWeight,
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
        out: &mut CudaTensor,
        round: DType,
    ) -> Result<()> {
        let fused = gemm::gemv_takes(self, x, w_gate) && gemm::gemv_takes(self, x, w_up) && w_gate.rows == w_up.rows;
        if !fused {
            self.matmul(x, w_gate, gate, round)?;
            self.matmul(x, w_up, up, round)?;
            return self.geglu(gate, up, out, round);
        }
        check(out.rows == x.rows && out.cols == w_gate.rows, "matmul_geglu")?;
        gemm::gemv_geglu(self, x, w_gate, w_up, out, round)
    }

    fn add_rms_norm(
        &self,
        h: &mut CudaTensor,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        out: &mut CudaTensor,
        round: DType,
    ) -> Result<()> {
        check(
            x.rows == h.rows
                && x.cols == h.cols
                && out.rows == h.rows
                && out.cols == h.cols
                && w.rows * w.cols == h.cols,
            "add_rms_norm",
        )?;
        let f = self.norm_kernel(w, true)?;
        // add_rms_norm(h, x, w, out, cols, eps, mode); one block per row.
        self.launch(
            f,
            "add_rms_norm",
            cfg((u32_of(h.rows, "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr_mut(h.buf_mut())),
                Arg::Ptr(self.ptr(x.buf())),
                Arg::Ptr(self.ptr(&w.buf)),
                Arg::Ptr(self.ptr_mut(out.buf_mut())),
                Arg::U32(u32_of(h.cols, "cols")?),
                Arg::F32(eps),
                Arg::I32(mode(round)?),
            ],
        )
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if profile::steps() {
            let st = self.step();
            let t = st.times;
            let per = |v: f64| 1e6 * v / t.steps.max(1) as f64;
            eprintln!(
                "cuda steps: {} ({} as CUDA graphs, {} captured); host time per step: recording {:.1} us, \
                 uploading and launching {:.1} us, waiting for the result {:.1} us",
                t.steps,
                st.replayed,
                st.captured,
                per(t.record),
                per(t.launch),
                per(t.wait)
            );
        }
        profile::report();
    }
}
