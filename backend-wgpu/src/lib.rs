//! backend-wgpu: spark's wgpu backend (WGSL compute kernels on Vulkan, Metal or DX12).
//!
//! Implements [`spark_core::Backend`] op for op as backend-cpu does, so [`spark_core::Model`]
//! (the one decoder) runs on any adapter wgpu finds, lavapipe included. Arithmetic is f32 with
//! rounding to the compute type where backend-cpu rounds; weights stay in the compute type (f32,
//! or bf16/f16 packed and decoded in the shader, which needs no optional adapter feature).
//! The ops of a step are recorded into one command encoder and submitted once, when the logits
//! are read.
//!
//! - [`gpu`]: adapters, device, pipelines, bind-group cache, buffer pool, the step recorder.
//! - [`shaders`]: the WGSL kernels.
//! - [`weights`]: weights (split by rows to fit bindings) and RoPE tables on the device.
//! - [`kv`]: the KV cache (ring for sliding layers, growing for full ones).
//! - [`plugin`]: the backend as a factory, exported as the `spark_backend_v1` plugin entry.

pub mod gpu;
pub mod kv;
pub mod plugin;
pub mod shaders;
pub mod weights;

use std::sync::Arc;

use spark_core::backend::{AttnChunk, AttnShape, Backend, WeightRole};
use spark_core::config::GateAct;
use spark_core::kv::KvSpec;
use spark_core::rope::RopeTable;
use spark_core::weights::Tensor as HostTensor;
use spark_core::{DType, Error, Result};

use gpu::{Gpu, GpuBuf, Grid};
use shaders::{Elem, Kernel};

pub use kv::WgpuKv;
pub use weights::{WgpuRope, WgpuWeight};

/// Largest head dimension the attention kernel handles.
pub const MAX_HEAD_DIM: usize = 512;
/// At most this many tokens use the matrix-vector kernel; more use the tiled GEMM.
const GEMV_MAX_TOKENS: usize = 8;

/// A row-major `[rows, cols]` f32 activation buffer on the device.
pub struct WgpuTensor {
    pub rows: usize,
    pub cols: usize,
    buf: GpuBuf,
}

impl WgpuTensor {
    fn len(&self) -> usize {
        self.rows * self.cols
    }
}

/// The wgpu backend: one adapter's device.
pub struct WgpuBackend {
    gpu: Arc<Gpu>,
}

/// How to open the backend.
#[derive(Debug, Clone, Copy)]
pub struct WgpuOptions {
    /// Index into [`gpu::adapters`].
    pub device: usize,
    /// Use subgroup operations where the adapter has them (`false`: the shared-memory fallback).
    pub subgroups: bool,
}

impl Default for WgpuOptions {
    fn default() -> Self {
        WgpuOptions { device: 0, subgroups: true }
    }
}

fn check(cond: bool, what: &str) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::internal(format!("wgpu backend: shape mismatch in {what}")))
    }
}

fn mode(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    }
}

fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid(format!("wgpu backend: {what} = {v} does not fit 32 bits")))
}

fn groups(items: usize, per: usize) -> Result<Grid> {
    Ok(Grid::Groups(u32_of(items.div_ceil(per), "workgroup count")?))
}

impl WgpuBackend {
    /// Open an adapter.
    pub fn new(opts: WgpuOptions) -> Result<Self> {
        Ok(WgpuBackend { gpu: Arc::new(Gpu::open(opts.device, opts.subgroups)?) })
    }

    /// The adapter's name and graphics API.
    pub fn adapter(&self) -> String {
        format!("{} ({:?})", self.gpu.info.name, self.gpu.info.backend)
    }

    /// Whether the kernels use subgroup operations.
    pub fn uses_subgroups(&self) -> bool {
        self.gpu.subgroups
    }

    /// Wait for all recorded work (tests, benchmarks).
    pub fn sync(&self) -> Result<()> {
        self.gpu.sync()
    }
}

impl Backend for WgpuBackend {
    type Weight = WgpuWeight;
    type Tensor = WgpuTensor;
    type Rope = WgpuRope;
    type Kv = WgpuKv;

    fn name(&self) -> &str {
        "wgpu"
    }

    fn upload_weight(&self, t: &HostTensor, role: WeightRole, dtype: DType) -> Result<WgpuWeight> {
        WgpuWeight::upload(&self.gpu, t, role, dtype)
    }

    fn upload_rope(&self, table: &RopeTable) -> Result<WgpuRope> {
        WgpuRope::upload(&self.gpu, table)
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<WgpuTensor> {
        let buf = self.gpu.buffer_pooled((rows * cols * 4) as u64)?;
        Ok(WgpuTensor { rows, cols, buf })
    }

    fn kv_alloc(&self, spec: &KvSpec) -> Result<WgpuKv> {
        WgpuKv::new(&self.gpu, *spec)
    }

    fn kv_truncate(&self, kv: &mut WgpuKv, new_len: usize) -> Result<()> {
        kv.truncate(new_len);
        Ok(())
    }

    fn kv_clone(&self, kv: &WgpuKv) -> Result<WgpuKv> {
        kv.duplicate(&self.gpu)
    }

    fn kv_bytes(&self, kv: &WgpuKv) -> usize {
        kv.bytes()
    }

    fn embed(&self, table: &WgpuWeight, ids: &[u32], out: &mut WgpuTensor) -> Result<()> {
        check(out.rows == ids.len() && out.cols == table.cols, "embed")?;
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(Error::invalid(format!("token id {bad} is outside the embedding ({} rows)", table.rows)));
        }
        for part in &table.parts {
            let params = [u32_of(ids.len(), "tokens")?, u32_of(table.cols, "cols")?, part.r0 as u32, part.rows as u32];
            self.gpu.dispatch(
                Kernel::Embed(table.elem()),
                &params,
                Some(ids),
                &[&part.buf, &out.buf],
                groups(out.len(), 256)?,
            )?;
        }
        Ok(())
    }

    fn rms_norm(&self, x: &WgpuTensor, w: &WgpuWeight, eps: f32, out: &mut WgpuTensor, round: DType) -> Result<()> {
        check(x.rows == out.rows && x.cols == out.cols && w.cols == x.cols && w.rows == 1, "rms_norm")?;
        if w.dtype != DType::F32 || w.parts.len() != 1 {
            return Err(Error::internal("wgpu backend: rms_norm needs an f32 weight uploaded as WeightRole::Norm"));
        }
        let params = [x.rows as u32, u32_of(x.cols, "cols")?, eps.to_bits(), mode(round)];
        self.gpu.dispatch(
            Kernel::RmsNorm,
            &params,
            None,
            &[&x.buf, &w.parts[0].buf, &out.buf],
            Grid::Groups(u32_of(x.rows, "rows")?),
        )
    }

    fn matmul(&self, x: &WgpuTensor, w: &WgpuWeight, out: &mut WgpuTensor, round: DType) -> Result<()> {
        check(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows, "matmul")?;
        let (n, k, m) = (u32_of(x.rows, "rows")?, u32_of(x.cols, "k")?, u32_of(w.rows, "m")?);
        for part in &w.parts {
            let (r0, nrows) = (part.r0 as u32, part.rows as u32);
            let bufs = [&x.buf, &part.buf, &out.buf];
            if x.rows <= GEMV_MAX_TOKENS {
                let sg = self.gpu.subgroups;
                let params = [n, k, m, r0, nrows, mode(round), 0, n];
                let wgs = if sg { nrows.div_ceil(8) } else { nrows };
                self.gpu.dispatch(Kernel::Gemv(w.elem(), sg), &params, None, &bufs, Grid::Groups(wgs))?;
            } else {
                let params = [n, k, m, r0, nrows, mode(round)];
                let grid = Grid::Xy(nrows.div_ceil(64), n.div_ceil(64));
                self.gpu.dispatch(Kernel::Gemm(w.elem()), &params, None, &bufs, grid)?;
            }
        }
        Ok(())
    }

    fn rope(
        &self,
        qkv: &mut WgpuTensor,
        positions: &[u32],
        table: &WgpuRope,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        round: DType,
    ) -> Result<()> {
        check(
            qkv.rows == positions.len() && qkv.cols >= (n_heads + n_kv_heads) * head_dim && table.rot_dims <= head_dim,
            "rope",
        )?;
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= table.positions) {
            return Err(Error::invalid(format!(
                "position {p} is beyond the RoPE table ({} positions)",
                table.positions
            )));
        }
        let half = table.rot_dims / 2;
        if half == 0 || positions.is_empty() {
            return Ok(());
        }
        let nh = n_heads + n_kv_heads;
        let params = [qkv.rows as u32, u32_of(qkv.cols, "cols")?, nh as u32, head_dim as u32, half as u32, mode(round)];
        self.gpu.dispatch(
            Kernel::Rope,
            &params,
            Some(positions),
            &[&table.cos, &table.sin, &qkv.buf],
            groups(qkv.rows * nh * half, 256)?,
        )
    }

    fn attention(
        &self,
        qkv: &WgpuTensor,
        chunk: AttnChunk,
        shape: AttnShape,
        kv: &mut WgpuKv,
        out: &mut WgpuTensor,
        round: DType,
    ) -> Result<()> {
        let (nh, nkv, hd) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
        let qd = nh * hd;
        let kvd = nkv * hd;
        check(
            out.cols == qd
                && chunk.row + chunk.len <= qkv.rows
                && chunk.row + chunk.len <= out.rows
                && qkv.cols >= qd + 2 * kvd
                && kv.spec.kv_heads == nkv
                && kv.spec.head_dim == hd,
            "attention",
        )?;
        if nkv == 0 || nh % nkv != 0 || hd > MAX_HEAD_DIM {
            return Err(Error::unsupported(format!(
                "wgpu backend: attention with {nh} heads, {nkv} KV heads, head_dim {hd} (needs heads divisible by KV heads and head_dim <= {MAX_HEAD_DIM})"
            )));
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
        kv.reserve(&self.gpu, end)?;
        let (Some(kb), Some(vb)) = (&kv.k, &kv.v) else {
            return Err(Error::internal("wgpu backend: KV cache has no buffers"));
        };
        let slots = kv.ring_slots();
        let params = [
            u32_of(qkv.cols, "cols")?,
            u32_of(chunk.row, "row")?,
            u32_of(chunk.len, "len")?,
            u32_of(chunk.start_pos, "start")?,
            nh as u32,
            nkv as u32,
            hd as u32,
            u32_of(shape.window.unwrap_or(0), "window")?,
            u32_of(slots, "slots")?,
            shape.scale.to_bits(),
            mode(round),
            qd as u32,
        ];
        self.gpu.dispatch(
            Kernel::Attention(kv.elem),
            &params,
            None,
            &[&qkv.buf, kb, vb, &out.buf],
            groups(chunk.len * nh, 1)?,
        )?;
        // Append the chunk's K/V (only the last `window` of them, for a ring).
        let first = if slots > 0 { end.saturating_sub(slots).max(chunk.start_pos) } else { chunk.start_pos };
        let count = end - first;
        let per_pos = if kv.elem == Elem::F32 { kvd } else { kvd / 2 };
        let params = [
            qkv.cols as u32,
            chunk.row as u32,
            chunk.start_pos as u32,
            first as u32,
            count as u32,
            kvd as u32,
            qd as u32,
            slots as u32,
        ];
        self.gpu.dispatch(
            Kernel::KvAppend(kv.elem),
            &params,
            None,
            &[&qkv.buf, kb, vb],
            groups(count * per_pos, 256)?,
        )?;
        kv.len = end;
        Ok(())
    }

    fn head_gate(
        &self,
        attn: &mut WgpuTensor,
        g: &WgpuTensor,
        act: GateAct,
        head_dim: usize,
        round: DType,
    ) -> Result<()> {
        check(attn.rows == g.rows && attn.cols == g.cols * head_dim && head_dim > 0, "head_gate")?;
        let act = match act {
            GateAct::Sigmoid => 0,
            GateAct::Silu => 1,
        };
        let params = [attn.rows as u32, u32_of(attn.cols, "cols")?, g.cols as u32, head_dim as u32, act, mode(round)];
        self.gpu.dispatch(Kernel::HeadGate, &params, None, &[&g.buf, &attn.buf], groups(attn.len(), 256)?)
    }

    fn geglu(&self, gate: &WgpuTensor, up: &WgpuTensor, out: &mut WgpuTensor, round: DType) -> Result<()> {
        check(gate.len() == up.len() && out.len() == up.len(), "geglu")?;
        let params = [u32_of(out.len(), "elements")?, mode(round)];
        self.gpu.dispatch(Kernel::Geglu, &params, None, &[&gate.buf, &up.buf, &out.buf], groups(out.len(), 256)?)
    }

    fn add(&self, h: &mut WgpuTensor, x: &WgpuTensor) -> Result<()> {
        check(h.len() == x.len(), "add")?;
        let params = [u32_of(h.len(), "elements")?];
        self.gpu.dispatch(Kernel::Add, &params, None, &[&x.buf, &h.buf], groups(h.len(), 256)?)
    }

    fn gather_rows(&self, x: &WgpuTensor, rows: &[usize], out: &mut WgpuTensor) -> Result<()> {
        check(out.rows == rows.len() && out.cols == x.cols && rows.iter().all(|&r| r < x.rows), "gather_rows")?;
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let params = [rows.len() as u32, u32_of(x.cols, "cols")?];
        self.gpu.dispatch(Kernel::Gather, &params, Some(&idx), &[&x.buf, &out.buf], groups(out.len(), 256)?)
    }

    fn read(&self, x: &WgpuTensor, out: &mut [f32]) -> Result<()> {
        check(out.len() == x.len(), "read")?;
        self.gpu.read(&x.buf, out)
    }
}
