//! The two traits every device implements.
//!
//! - [`Backend`] is op-level: upload weights, then embedding, RMSNorm, matmul, RoPE, attention
//!   over the KV layout, head gate, GEGLU, residual add. [`crate::graph::Model`] walks the
//!   decoder over any `Backend`, so the model is written once. A few fused forms of op sequences
//!   (two projections of one input, gate/up with the GEGLU, residual add with the next norm)
//!   default to the sequence itself; a backend overrides them only to run them in fewer passes.
//!   `end_step` closes every step, for backends that defer their work.
//! - [`Executor`] is step-level: "run this batch of (sequence, tokens, start position) and return
//!   logits for the rows asked for". Its data is plain (integers, slices of integers and floats,
//!   a `#[repr(u32)]` enum) so that it maps one to one onto a C ABI.
//!
//! Every op that produces activations takes `round: DType`: the result is rounded to that type,
//! mirroring the reference's casts to the compute dtype (F32 = no rounding).

use crate::config::GateAct;
use crate::dtype::DType;
use crate::error::Result;
use crate::kv::KvSpec;
use crate::quant::QTensor;
use crate::rope::RopeTable;
use crate::weights::Tensor as HostTensor;

/// How an uploaded weight will be used, so a backend can pick its layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightRole {
    /// A vector (RMSNorm weight).
    Norm,
    /// A `[out, in]` matrix multiplied as `x W^T`.
    Matrix,
    /// The embedding table: gathered by row, and also the tied output head.
    Embedding,
}

/// One sequence's share of an attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnChunk {
    /// First row of this sequence's tokens in the batch activations.
    pub row: usize,
    /// Number of new tokens.
    pub len: usize,
    /// Absolute position of the first new token (= positions already in the cache).
    pub start_pos: usize,
}

/// Static shape facts an attention call needs.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// `Some(w)`: a query at `p` sees keys `p-w+1..=p`; `None`: causal over everything.
    pub window: Option<usize>,
    pub scale: f32,
}

/// Device operations. `Tensor`s are row-major `[rows, cols]` activation buffers.
pub trait Backend: Send + Sync {
    type Weight: Send + Sync;
    type Tensor: Send;
    type Rope: Send + Sync;
    /// One layer's K/V cache for one sequence.
    type Kv: Send + Sync;

    /// Backend name (`cpu`, `cuda`, ...).
    fn name(&self) -> &str;

    /// Make a checkpoint tensor usable by the kernels, in `dtype` (a conversion only when the
    /// stored type differs or the layout is unusable; mapped memory is used as is otherwise).
    fn upload_weight(&self, t: &HostTensor, role: WeightRole, dtype: DType) -> Result<Self::Weight>;
    /// Make a quantized matrix usable. Backends with integer kernels repack it; the default
    /// dequantizes it to `dtype` and uploads that (correct everywhere, no memory or speed gain).
    fn upload_quant(&self, q: &QTensor, role: WeightRole, dtype: DType) -> Result<Self::Weight> {
        self.upload_weight(&q.to_tensor(dtype), role, dtype)
    }
    fn upload_rope(&self, table: &RopeTable) -> Result<Self::Rope>;
    /// A zeroed `[rows, cols]` buffer.
    fn alloc(&self, rows: usize, cols: usize) -> Result<Self::Tensor>;
    fn kv_alloc(&self, spec: &KvSpec) -> Result<Self::Kv>;
    /// Forget positions `new_len..` (the caller checked [`KvSpec::can_truncate`]).
    fn kv_truncate(&self, kv: &mut Self::Kv, new_len: usize) -> Result<()>;
    fn kv_clone(&self, kv: &Self::Kv) -> Result<Self::Kv>;
    fn kv_bytes(&self, kv: &Self::Kv) -> usize;

    /// `out[i] = table[ids[i]]` as f32.
    fn embed(&self, table: &Self::Weight, ids: &[u32], out: &mut Self::Tensor) -> Result<()>;
    /// `out = x * rsqrt(mean(x^2) + eps) * w`, computed in f32.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
        out: &mut Self::Tensor,
        round: DType,
    ) -> Result<()>;
    /// `out = x W^T` for `W` `[out, in]`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight, out: &mut Self::Tensor, round: DType) -> Result<()>;
    /// Rotate, in place, the Q heads (cols `0..n_heads*head_dim`) and K heads (the next
    /// `n_kv_heads*head_dim` cols) of a fused QKV buffer, row `i` at `positions[i]`.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        qkv: &mut Self::Tensor,
        positions: &[u32],
        table: &Self::Rope,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        round: DType,
    ) -> Result<()>;
    /// Attention of each chunk's queries (from the fused `qkv`) over its cached keys and its own
    /// new keys, writing `[rows, n_heads*head_dim]` into `out`; then append the new K/V to `kv`.
    fn attention(
        &self,
        qkv: &Self::Tensor,
        chunk: AttnChunk,
        shape: AttnShape,
        kv: &mut Self::Kv,
        out: &mut Self::Tensor,
        round: DType,
    ) -> Result<()>;
    /// `attn[r, h*d..(h+1)*d] *= act(g[r, h])`.
    fn head_gate(
        &self,
        attn: &mut Self::Tensor,
        g: &Self::Tensor,
        act: GateAct,
        head_dim: usize,
        round: DType,
    ) -> Result<()>;
    /// `out = gelu_erf(gate) * up`.
    fn geglu(&self, gate: &Self::Tensor, up: &Self::Tensor, out: &mut Self::Tensor, round: DType) -> Result<()>;
    /// `h += x`.
    fn add(&self, h: &mut Self::Tensor, x: &Self::Tensor) -> Result<()>;
    /// `out[i] = x[rows[i]]`.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize], out: &mut Self::Tensor) -> Result<()>;
    /// Copy to host memory (`out.len() == rows * cols`).
    fn read(&self, x: &Self::Tensor, out: &mut [f32]) -> Result<()>;

    // Fused forms of op sequences the graph runs. Each default is the sequence itself, so a
    // backend overrides one only to run it in fewer passes, with the same arithmetic.

    /// `out1 = x W1^T; out2 = x W2^T` (two projections of the same input).
    #[allow(clippy::too_many_arguments)]
    fn matmul_pair(
        &self,
        x: &Self::Tensor,
        w1: &Self::Weight,
        out1: &mut Self::Tensor,
        w2: &Self::Weight,
        out2: &mut Self::Tensor,
        round: DType,
    ) -> Result<()> {
        self.matmul(x, w1, out1, round)?;
        self.matmul(x, w2, out2, round)
    }
    /// `out1 = x W1^T; out2 = x W2^T`, then the RoPE of `out1` (the fused QKV projection, its
    /// rotation, and the head-gate projection).
    #[allow(clippy::too_many_arguments)]
    fn matmul_pair_rope(
        &self,
        x: &Self::Tensor,
        w1: &Self::Weight,
        out1: &mut Self::Tensor,
        w2: &Self::Weight,
        out2: &mut Self::Tensor,
        positions: &[u32],
        table: &Self::Rope,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        round: DType,
    ) -> Result<()> {
        self.matmul_pair(x, w1, out1, w2, out2, round)?;
        self.rope(out1, positions, table, n_heads, n_kv_heads, head_dim, round)
    }
    /// `gate = x Wg^T; up = x Wu^T; out = geglu(gate, up)` (`gate` and `up` are scratch: a fused
    /// form need not write them).
    #[allow(clippy::too_many_arguments)]
    fn matmul_geglu(
        &self,
        x: &Self::Tensor,
        w_gate: &Self::Weight,
        w_up: &Self::Weight,
        gate: &mut Self::Tensor,
        up: &mut Self::Tensor,
        out: &mut Self::Tensor,
        round: DType,
    ) -> Result<()> {
        self.matmul(x, w_gate, gate, round)?;
        self.matmul(x, w_up, up, round)?;
        self.geglu(gate, up, out, round)
    }
    /// `h += x; out = rms_norm(h, w)`.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        h: &mut Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
        out: &mut Self::Tensor,
        round: DType,
    ) -> Result<()> {
        self.add(h, x)?;
        self.rms_norm(h, w, eps, out, round)
    }
    /// The end of a step, whether or not it read anything back (and also after a step that
    /// failed): a backend that defers its work (the CUDA backend records a step and runs it as a
    /// whole) must have issued all of it before this returns, so that memory freed afterwards
    /// (a released sequence's KV) is not used by work still pending.
    fn end_step(&self) -> Result<()> {
        Ok(())
    }
    /// Runs `step`, the ops of one forward step, where this backend issues ops best. Default:
    /// here, on the calling thread. The CPU backend enters its thread pool once for the whole
    /// step: each op's parallel loop then starts on a worker thread, instead of waking the pool
    /// from outside and putting the caller to sleep until it is done (two cross-thread hand-offs
    /// per op, a few hundred per decode step).
    fn run_step<R: Send>(&self, step: impl FnOnce() -> R + Send) -> R {
        step()
    }
}

/// Which logits a sequence wants back from a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum LogitsMode {
    None = 0,
    /// The row of the last token only.
    Last = 1,
    /// One row per token.
    All = 2,
}

impl LogitsMode {
    pub fn rows(self, n_tokens: usize) -> usize {
        match self {
            LogitsMode::None => 0,
            LogitsMode::Last => n_tokens.min(1),
            LogitsMode::All => n_tokens,
        }
    }
}

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub seq_id: u64,
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`. Must equal the sequence's cached length, or be smaller to
    /// rewind (refused where a sliding window has already dropped what would be needed).
    pub start_pos: u32,
    pub logits: LogitsMode,
}

/// Facts about a loaded model that callers of an [`Executor`] need.
#[derive(Debug, Clone)]
pub struct ExecutorInfo {
    pub backend: String,
    pub vocab: usize,
    /// Largest position + 1 that can be served.
    pub ctx: usize,
    /// Compute dtype of the activations.
    pub dtype: DType,
}

/// Step-level execution: the engine, the server and the plugin ABI talk only to this.
pub trait Executor: Send {
    fn info(&self) -> ExecutorInfo;
    /// Run one step. `out` receives the requested logits rows, in batch order, each `vocab`
    /// wide; its length must be the sum of `logits.rows(tokens.len())` times `vocab`.
    fn forward(&mut self, batch: &[SeqStep<'_>], out: &mut [f32]) -> Result<()>;
    /// Drop a sequence's KV (no-op if unknown).
    fn release(&mut self, seq_id: u64);
    /// Copy `src`'s KV to a new sequence `dst` (replacing `dst` if it exists).
    fn fork(&mut self, src: u64, dst: u64) -> Result<()>;
    /// Cached length of a sequence, if it exists.
    fn seq_len(&self, seq_id: u64) -> Option<usize>;
    /// KV bytes in use over all sequences.
    fn kv_bytes(&self) -> usize;
}

/// Rows of logits a batch asks for.
pub fn logits_rows(batch: &[SeqStep<'_>]) -> usize {
    batch.iter().map(|s| s.logits.rows(s.tokens.len())).sum()
}
