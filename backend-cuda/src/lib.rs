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

pub mod device;
pub mod gemm;
pub mod kernels;
pub mod kv;
pub mod plugin;
pub mod profile;

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use spark_core::backend::{AttnChunk, AttnShape, Backend, WeightRole};
use spark_core::config::GateAct;
use spark_core::kv::{KvKind, KvSpec};
use spark_core::rope::RopeTable;
use spark_core::weights::Tensor as HostTensor;
use spark_core::{DType, Error, ErrorKind, Result};

use device::{err, guard, DeviceFacts, Libs};
use kernels::{blocks_for, cfg, launch, Arg, Kernels, ATTN_MAX_D, ATTN_THREADS, THREADS};
pub use kv::CudaKv;

/// A row-major `[rows, cols]` f32 activation buffer in device memory.
pub struct CudaTensor {
    pub rows: usize,
    pub cols: usize,
    pub buf: CudaSlice<f32>,
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
    /// Attention split statistics and partial outputs.
    stats: Option<CudaSlice<f32>>,
    partial: Option<CudaSlice<f32>>,
    /// The positions last given to `rope`, and their device copy (every layer of a step passes
    /// the same positions: one upload per step).
    positions: Vec<u32>,
    positions_dev: Option<CudaSlice<u32>>,
}

/// Make `slot` hold at least `n` elements.
fn ensure<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    n: usize,
) -> Result<()> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        *slot = Some(stream.alloc_zeros::<T>(n.max(1)).map_err(|e| err("allocating scratch memory", e))?);
    }
    Ok(())
}

/// The CUDA backend: one context and stream on one device, the kernels, and cuBLAS.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Option<CudaBlas>,
    k: Kernels,
    facts: DeviceFacts,
    libs: Libs,
    scratch: Mutex<Scratch>,
}

/// The kernels' rounding mode for `round` (0 = f32, 1 = bf16).
fn mode(round: DType) -> Result<i32> {
    match round {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        DType::F16 => Err(Error::unsupported("cuda backend: f16 compute is not implemented (use --dtype bf16 or f32)")),
    }
}

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
    /// cuBLAS. `SPARK_CUDA_NO_CUBLAS=1` forces the fallback GEMM kernels.
    pub fn new(ordinal: usize) -> Result<Self> {
        let no_cublas = std::env::var("SPARK_CUDA_NO_CUBLAS").is_ok_and(|v| v == "1");
        Self::with_options(ordinal, !no_cublas)
    }

    /// As [`CudaBackend::new`], choosing whether to use cuBLAS (where it is found) or the
    /// fallback GEMM kernels (tests compare the two).
    pub fn with_options(ordinal: usize, cublas: bool) -> Result<Self> {
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
        let blas = if libs.cublas && cublas {
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
        Ok(CudaBackend { ctx, stream, blas, k, facts, libs, scratch: Mutex::new(Scratch::default()) })
    }

    pub fn facts(&self) -> &DeviceFacts {
        &self.facts
    }

    /// What runs the GEMMs and where the kernels came from, for `backends` and bench output.
    pub fn describe(&self) -> String {
        format!(
            "sm_{}{}, {}, kernels: {}",
            self.facts.cc.0,
            self.facts.cc.1,
            if self.blas.is_some() { "cuBLAS" } else { "fallback GEMM" },
            self.k.source
        )
    }

    pub fn libs(&self) -> Libs {
        self.libs
    }

    fn scratch(&self) -> MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|p| p.into_inner())
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
        let buf = self.stream.alloc_zeros::<f32>((rows * cols).max(1)).map_err(|e| {
            Error::new(ErrorKind::OutOfMemory, format!("cuda: allocating a [{rows}, {cols}] activation buffer: {e:?}"))
        })?;
        Ok(CudaTensor { rows, cols, buf })
    }

    fn kv_alloc(&self, spec: &KvSpec) -> Result<CudaKv> {
        CudaKv::new(&self.stream, *spec)
    }

    fn kv_truncate(&self, kv: &mut CudaKv, new_len: usize) -> Result<()> {
        kv.truncate(new_len);
        Ok(())
    }

    fn kv_clone(&self, kv: &CudaKv) -> Result<CudaKv> {
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
        if ids.is_empty() {
            return Ok(());
        }
        let ids_dev = self.upload(ids, "token ids")?;
        let f = match table.dtype {
            DType::F32 => &self.k.embed_f32,
            _ => &self.k.embed_bf16,
        };
        // embed_{f32,bf16}(table, ids, out, cols); one block per row.
        launch(
            &self.stream,
            f,
            "embed",
            cfg((u32_of(ids.len(), "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr(&table.buf)),
                Arg::Ptr(self.ptr(&ids_dev)),
                Arg::Ptr(self.ptr_mut(&mut out.buf)),
                Arg::U32(u32_of(out.cols, "cols")?),
            ],
        )
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaWeight, eps: f32, out: &mut CudaTensor, round: DType) -> Result<()> {
        check(x.rows == out.rows && x.cols == out.cols && w.rows * w.cols == x.cols, "rms_norm")?;
        if w.dtype != DType::F32 {
            return Err(Error::internal("cuda backend: RMSNorm weights must be uploaded as f32"));
        }
        // rms_norm(x, w, out, cols, eps, mode); one block per row.
        launch(
            &self.stream,
            &self.k.rms_norm,
            "rms_norm",
            cfg((u32_of(x.rows, "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr(&x.buf)),
                Arg::Ptr(self.ptr(&w.buf)),
                Arg::Ptr(self.ptr_mut(&mut out.buf)),
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
        check(qkv.rows == positions.len() && qkv.cols >= (n_heads + n_kv_heads) * head_dim, "rope")?;
        check(table.rot_dims <= head_dim && table.rot_dims.is_multiple_of(2), "rope (rotary dims)")?;
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= table.positions) {
            return Err(Error::invalid(format!(
                "position {p} is beyond the RoPE table ({} positions)",
                table.positions
            )));
        }
        let half = table.rot_dims / 2;
        if positions.is_empty() || half == 0 {
            return Ok(());
        }
        let mut s = self.scratch();
        if s.positions != positions || s.positions_dev.is_none() {
            s.positions_dev = Some(self.upload(positions, "positions")?);
            s.positions = positions.to_vec();
        }
        let pos = self.ptr(s.positions_dev.as_ref().expect("uploaded above"));
        // rope(qkv, pos, cos, sin, cols, n_rot_heads, head_dim, half, mode); one block per row.
        launch(
            &self.stream,
            &self.k.rope,
            "rope",
            cfg((u32_of(qkv.rows, "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr_mut(&mut qkv.buf)),
                Arg::Ptr(pos),
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
        kv.reserve(&self.stream, end)?;
        let md = mode(round)?;
        let rows_h = chunk.len * h;
        // Split-K: enough blocks to fill the device twice over, at least 64 keys per split.
        let max_keys = shape.window.map_or(end, |w| w.min(end));
        let target = 2 * self.facts.sms.max(1) as usize;
        let nsplit = if rows_h >= target { 1 } else { target.div_ceil(rows_h).min(max_keys.div_ceil(64)).clamp(1, 64) };
        let mut s = self.scratch();
        ensure(&self.stream, &mut s.stats, 2 * rows_h * nsplit)?;
        ensure(&self.stream, &mut s.partial, rows_h * nsplit * d)?;
        let stats = self.ptr_mut(s.stats.as_mut().expect("ensured"));
        let partial = self.ptr_mut(s.partial.as_mut().expect("ensured"));
        let (kc, vc) = kv.ptrs(&self.stream);
        let common = [
            Arg::Ptr(self.ptr(&qkv.buf)),
            Arg::Ptr(kc),
            Arg::Ptr(vc),
            Arg::U32(u32_of(qkv.cols, "qkv cols")?),
            Arg::U32(u32_of(chunk.row, "row")?),
            Arg::U32(u32_of(chunk.start_pos, "start position")?),
            Arg::U32(h as u32),
            Arg::U32(kvh as u32),
            Arg::U32(d as u32),
            Arg::U32(u32_of(shape.window.unwrap_or(0), "window")?),
            Arg::U32(u32_of(kv.ring(), "ring")?),
            Arg::U32(nsplit as u32),
            Arg::I32(kv.is_bf16() as i32),
            Arg::I32(md),
            Arg::F32(shape.scale),
        ];
        let grid = (u32_of(rows_h, "attention rows")?, nsplit as u32);
        let d4 = (d * 4) as u32;
        // attn_stats(ATTN_PARAMS, stats)
        let mut a = common.to_vec();
        a.push(Arg::Ptr(stats));
        launch(&self.stream, &self.k.attn_stats, "attn_stats", cfg(grid, ATTN_THREADS, d4), &a)?;
        // attn_accum(ATTN_PARAMS, stats, partial)
        let mut a = common.to_vec();
        a.push(Arg::Ptr(stats));
        a.push(Arg::Ptr(partial));
        let shared = d4 * (1 + ATTN_THREADS / 32);
        launch(&self.stream, &self.k.attn_accum, "attn_accum", cfg(grid, ATTN_THREADS, shared), &a)?;
        // attn_reduce(partial, out, out_cols, row0, n_heads, head_dim, nsplit, mode)
        launch(
            &self.stream,
            &self.k.attn_reduce,
            "attn_reduce",
            cfg((grid.0, 1), ATTN_THREADS, 0),
            &[
                Arg::Ptr(partial),
                Arg::Ptr(self.ptr_mut(&mut out.buf)),
                Arg::U32(u32_of(out.cols, "cols")?),
                Arg::U32(chunk.row as u32),
                Arg::U32(h as u32),
                Arg::U32(d as u32),
                Arg::U32(nsplit as u32),
                Arg::I32(md),
            ],
        )?;
        drop(s);
        // Append the chunk's K/V (only the last `window` positions, for a ring).
        let first = match kv.spec.kind {
            KvKind::Ring { window } => end.saturating_sub(window).max(chunk.start_pos),
            KvKind::Grow { .. } => chunk.start_pos,
        };
        let (kc, vc) = kv.ptrs(&self.stream);
        // kv_append(qkv, kc, vc, qkv_cols, row0, start, first, qd, kvd, ring, kv_bf16); one block per position.
        launch(
            &self.stream,
            &self.k.kv_append,
            "kv_append",
            cfg((u32_of(end - first, "positions")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr(&qkv.buf)),
                Arg::Ptr(kc),
                Arg::Ptr(vc),
                Arg::U32(qkv.cols as u32),
                Arg::U32(chunk.row as u32),
                Arg::U32(chunk.start_pos as u32),
                Arg::U32(u32_of(first, "first")?),
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
        // head_gate(attn, g, n_heads, head_dim, act, mode); one block per row.
        launch(
            &self.stream,
            &self.k.head_gate,
            "head_gate",
            cfg((u32_of(attn.rows, "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr_mut(&mut attn.buf)),
                Arg::Ptr(self.ptr(&g.buf)),
                Arg::U32(u32_of(g.cols, "heads")?),
                Arg::U32(u32_of(head_dim, "head_dim")?),
                Arg::I32(act),
                Arg::I32(mode(round)?),
            ],
        )
    }

    fn geglu(&self, gate: &CudaTensor, up: &CudaTensor, out: &mut CudaTensor, round: DType) -> Result<()> {
        let n = gate.rows * gate.cols;
        check(up.rows * up.cols == n && out.rows * out.cols == n, "geglu")?;
        // geglu(g, u, out, n, mode)
        launch(
            &self.stream,
            &self.k.geglu,
            "geglu",
            cfg(Self::elementwise_blocks(n), THREADS, 0),
            &[
                Arg::Ptr(self.ptr(&gate.buf)),
                Arg::Ptr(self.ptr(&up.buf)),
                Arg::Ptr(self.ptr_mut(&mut out.buf)),
                Arg::U64(n as u64),
                Arg::I32(mode(round)?),
            ],
        )
    }

    fn add(&self, h: &mut CudaTensor, x: &CudaTensor) -> Result<()> {
        let n = h.rows * h.cols;
        check(x.rows * x.cols == n, "add")?;
        // add_inplace(h, x, n)
        launch(
            &self.stream,
            &self.k.add_inplace,
            "add",
            cfg(Self::elementwise_blocks(n), THREADS, 0),
            &[Arg::Ptr(self.ptr_mut(&mut h.buf)), Arg::Ptr(self.ptr(&x.buf)), Arg::U64(n as u64)],
        )
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize], out: &mut CudaTensor) -> Result<()> {
        check(out.rows == rows.len() && out.cols == x.cols && rows.iter().all(|&r| r < x.rows), "gather_rows")?;
        if rows.is_empty() {
            return Ok(());
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx_dev = self.upload(&idx, "row indices")?;
        // gather_rows(x, rows, out, cols); one block per output row.
        launch(
            &self.stream,
            &self.k.gather_rows,
            "gather_rows",
            cfg((u32_of(rows.len(), "rows")?, 1), THREADS, 0),
            &[
                Arg::Ptr(self.ptr(&x.buf)),
                Arg::Ptr(self.ptr(&idx_dev)),
                Arg::Ptr(self.ptr_mut(&mut out.buf)),
                Arg::U32(u32_of(x.cols, "cols")?),
            ],
        )
    }

    fn read(&self, x: &CudaTensor, out: &mut [f32]) -> Result<()> {
        let n = x.rows * x.cols;
        check(out.len() == n, "read")?;
        if n == 0 {
            return Ok(());
        }
        self.stream.memcpy_dtoh(&x.buf.slice(0..n), out).map_err(|e| err("reading results", e))?;
        self.stream.synchronize().map_err(|e| err("running the step", e))?;
        self.ctx.check_err().map_err(|e| err("an earlier asynchronous operation", e))?;
        profile::collect();
        Ok(())
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        profile::report();
    }
}
