//! THE Spark-X2.5 decoder, written once over any [`Backend`] (SPARK.md sections 3-4).
//!
//! [`Model`] owns the uploaded weights, the two RoPE tables and every sequence's KV cache, and
//! implements the step-level [`Executor`]: all tokens of a batch go through each projection as
//! one matrix; attention runs per sequence against that sequence's cache.

use std::collections::HashMap;
use std::path::Path;

use crate::backend::{AttnChunk, AttnShape, Backend, Executor, ExecutorInfo, LogitsMode, SeqStep, WeightRole};
use crate::config::{LayerType, ModelConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv::KvSpec;
use crate::quant::{quantize_tensor, QuantSpec};
use crate::rope::RopeTable;
use crate::weights::{Checkpoint, LayerWeights, ModelWeights, Tensor, Weight};

/// The largest context a model is served with (16M positions: 16x Spark-X2.5's 1M). Larger ones
/// would need RoPE tables and KV page tables of many GiB before the first token.
pub const MAX_CONTEXT: usize = 1 << 24;

/// How to serve a model.
#[derive(Debug, Clone, Default)]
pub struct ModelOptions {
    /// Largest context to serve (positions `0..ctx`); sizes RoPE tables and full-layer KV.
    /// `None`: `min(max_position_embeddings, 4096)`.
    pub ctx: Option<usize>,
    /// Compute dtype; `None`: the checkpoint's stored float dtype.
    pub dtype: Option<DType>,
    /// Quantize a float checkpoint's matrices at load (all but the tiny head gate `g_proj`;
    /// the tied embedding/output head included). Ignored for matrices already quantized.
    pub quant: Option<QuantSpec>,
}

struct LayerW<B: Backend> {
    kind: LayerType,
    attn_norm: B::Weight,
    qkv: B::Weight,
    gate: B::Weight,
    out: B::Weight,
    mlp_norm: B::Weight,
    mlp_gate: B::Weight,
    mlp_up: B::Weight,
    mlp_down: B::Weight,
}

struct Seq<B: Backend> {
    len: usize,
    kv: Vec<B::Kv>,
}

/// A loaded model on a backend, serving many sequences.
pub struct Model<B: Backend> {
    cfg: ModelConfig,
    backend: B,
    dtype: DType,
    ctx: usize,
    embedding: B::Weight,
    head: Option<B::Weight>,
    norm: B::Weight,
    layers: Vec<LayerW<B>>,
    ropes: [B::Rope; 2],
    kv_specs: Vec<KvSpec>,
    seqs: HashMap<u64, Seq<B>>,
}

/// Where [`Model::upload`] takes the weights from, one piece at a time (each handed over, so
/// the host copy is dropped as soon as it is uploaded). Layers are asked for in order.
trait WeightSource {
    /// The default compute type ([`ModelWeights::float_dtype`]).
    fn float_dtype(&self) -> DType;
    fn layer(&mut self, i: usize) -> Result<LayerWeights>;
    fn embedding(&mut self) -> Result<Weight>;
    fn lm_head(&mut self) -> Result<Option<Weight>>;
    fn norm(&mut self) -> Result<Tensor>;
}

/// Weights already in memory ([`ModelWeights`]), handed over piece by piece.
struct OwnedSource {
    dtype: DType,
    embedding: Option<Weight>,
    layers: std::vec::IntoIter<LayerWeights>,
    norm: Option<Tensor>,
    lm_head: Option<Weight>,
}

impl WeightSource for OwnedSource {
    fn float_dtype(&self) -> DType {
        self.dtype
    }
    fn layer(&mut self, i: usize) -> Result<LayerWeights> {
        self.layers.next().ok_or_else(|| Error::invalid(format!("the weights have no layer {i}")))
    }
    fn embedding(&mut self) -> Result<Weight> {
        self.embedding.take().ok_or_else(|| Error::internal("embedding taken twice"))
    }
    fn lm_head(&mut self) -> Result<Option<Weight>> {
        Ok(self.lm_head.take())
    }
    fn norm(&mut self) -> Result<Tensor> {
        self.norm.take().ok_or_else(|| Error::internal("final norm taken twice"))
    }
}

/// A GGUF file whose headers [`GgufFile::check_tensors`] accepted: each tensor converted when
/// asked for.
struct GgufSource<'a> {
    file: &'a GgufFile,
    cfg: ModelConfig,
}

impl WeightSource for GgufSource<'_> {
    fn float_dtype(&self) -> DType {
        self.file.compute_dtype().unwrap_or_else(|| {
            let emb = self.file.tensor("token_embd.weight").and_then(|t| t.kind.float());
            let norm = self.file.tensor("output_norm.weight").and_then(|t| t.kind.float());
            emb.or(norm).unwrap_or(DType::F32)
        })
    }
    fn layer(&mut self, i: usize) -> Result<LayerWeights> {
        self.file.layer_weights(&self.cfg, i)
    }
    fn embedding(&mut self) -> Result<Weight> {
        self.file.embedding_weight(&self.cfg)
    }
    fn lm_head(&mut self) -> Result<Option<Weight>> {
        self.file.lm_head_weight(&self.cfg)
    }
    fn norm(&mut self) -> Result<Tensor> {
        self.file.norm_weight(&self.cfg, "output_norm.weight")
    }
}

impl<B: Backend> Model<B> {
    /// Load `config.json` and the safetensors of a checkpoint directory.
    /// A `.gguf` file (see [`crate::gguf`]) is loaded as well.
    pub fn load(backend: B, dir: &Path, opts: &ModelOptions) -> Result<Self> {
        if crate::gguf::is_gguf(dir) {
            // Headers checked first; each tensor converted only when its turn to upload comes.
            let file = GgufFile::open(dir)?;
            let cfg = file.config()?;
            file.check_tensors(&cfg)?;
            let src = GgufSource { file: &file, cfg: cfg.clone() };
            return Self::upload(backend, cfg, src, opts);
        }
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        let weights = ModelWeights::from_checkpoint(&ckpt, &cfg)
            .map_err(|e| Error::new(e.kind, format!("{}: {}", dir.display(), e.message)))?;
        Self::from_weights(backend, cfg, weights, opts)
    }

    /// Upload validated weights to `backend` (the caller keeps its copy: see
    /// [`Model::from_weights`] for the load-time memory peak).
    pub fn new(backend: B, cfg: ModelConfig, w: &ModelWeights, opts: &ModelOptions) -> Result<Self> {
        // A clone shares every tensor's bytes (reference-counted), so this costs no copy.
        Self::from_weights(backend, cfg, w.clone(), opts)
    }

    /// Upload validated weights to `backend`, dropping each layer's host copy as soon as it is
    /// uploaded: where that copy is anonymous memory (the f32 scales of a quantized checkpoint),
    /// the load peak is about the larger of the two copies plus one layer, not their sum;
    /// mapped file bytes cost nothing either way. ([`Model::load`] goes further for a GGUF file:
    /// it converts each tensor only when it is uploaded.)
    pub fn from_weights(backend: B, cfg: ModelConfig, w: ModelWeights, opts: &ModelOptions) -> Result<Self> {
        let dtype = w.float_dtype();
        let ModelWeights { embedding, layers, norm, lm_head, .. } = w;
        let src =
            OwnedSource { dtype, embedding: Some(embedding), layers: layers.into_iter(), norm: Some(norm), lm_head };
        Self::upload(backend, cfg, src, opts)
    }

    /// Upload the weights `src` hands out: the embedding, the head, then one layer at a time
    /// and the final norm, each host copy dropped (and its memory given back) once uploaded.
    fn upload(backend: B, cfg: ModelConfig, mut src: impl WeightSource, opts: &ModelOptions) -> Result<Self> {
        let dtype = opts.dtype.unwrap_or(src.float_dtype());
        let ctx = opts.ctx.unwrap_or(cfg.max_positions.min(4096));
        if ctx == 0 || ctx > cfg.max_positions {
            return Err(Error::invalid(format!(
                "context size {ctx} is outside 1..={} (max_position_embeddings)",
                cfg.max_positions
            )));
        }
        if ctx > MAX_CONTEXT {
            return Err(Error::invalid(format!(
                "context size {ctx} is more than spark serves ({MAX_CONTEXT} positions; Spark-X2.5 is trained for \
                 1M): its RoPE tables alone would take {} GiB",
                (ctx as u128 * cfg.head_dim as u128 * 8) >> 30
            )));
        }
        let b = &backend;
        // Matrices one at a time, so at most one float copy of a quantized-at-load matrix lives.
        let up_q = |w: &Weight, role, quantize: bool| match (w, opts.quant) {
            (Weight::Quant(q), _) => b.upload_quant(q, role, dtype),
            (Weight::Float(t), Some(spec)) if quantize => {
                b.upload_quant(&quantize_tensor(t, spec.for_layers(cfg.n_layers))?, role, dtype)
            }
            (Weight::Float(t), _) => b.upload_weight(t, role, dtype),
        };
        let up = |w: &Weight, role| up_q(w, role, true);
        // The embedding (the largest matrix) first: while it is converted and repacked, nothing
        // else is resident yet, so the two copies of it do not add to the whole model.
        let embedding = up(&src.embedding()?, WeightRole::Embedding)?;
        crate::memory::release_free_heap();
        let head = match src.lm_head()? {
            Some(t) => Some(up(&t, WeightRole::Matrix)?),
            None => None,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for (i, &kind) in cfg.layer_types.iter().enumerate() {
            let l = src.layer(i)?;
            layers.push(LayerW {
                kind,
                attn_norm: b.upload_weight(&l.attn_norm, WeightRole::Norm, DType::F32)?,
                qkv: up(&l.qkv, WeightRole::Matrix)?,
                gate: up_q(&l.gate, WeightRole::Matrix, false)?,
                out: up(&l.out, WeightRole::Matrix)?,
                mlp_norm: b.upload_weight(&l.mlp_norm, WeightRole::Norm, DType::F32)?,
                mlp_gate: up(&l.mlp_gate, WeightRole::Matrix)?,
                mlp_up: up(&l.mlp_up, WeightRole::Matrix)?,
                mlp_down: up(&l.mlp_down, WeightRole::Matrix)?,
            });
            // This layer's host copy is gone: give its memory back before the next.
            drop(l);
            crate::memory::release_free_heap();
        }
        let norm = b.upload_weight(&src.norm()?, WeightRole::Norm, DType::F32)?;
        crate::memory::release_free_heap();
        let ropes = [
            b.upload_rope(&RopeTable::new(cfg.rope_for(LayerType::Sliding), ctx))?,
            b.upload_rope(&RopeTable::new(cfg.rope_for(LayerType::Full), ctx))?,
        ];
        let kv_specs = cfg.layer_types.iter().map(|&t| KvSpec::for_layer(&cfg, t, ctx, dtype)).collect();
        Ok(Model { cfg, backend, dtype, ctx, embedding, head, norm, layers, ropes, kv_specs, seqs: HashMap::new() })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    pub fn backend(&self) -> &B {
        &self.backend
    }
    pub fn kv_specs(&self) -> &[KvSpec] {
        &self.kv_specs
    }

    fn check_batch(&self, batch: &[SeqStep<'_>], out_len: usize) -> Result<()> {
        let mut rows = 0;
        for (i, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(Error::invalid(format!("sequence {}: no tokens in this step", s.seq_id)));
            }
            if batch[..i].iter().any(|o| o.seq_id == s.seq_id) {
                return Err(Error::invalid(format!("sequence {} appears twice in one step", s.seq_id)));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
                return Err(Error::invalid(format!(
                    "sequence {}: token id {bad} is outside the vocabulary (size {})",
                    s.seq_id, self.cfg.vocab
                )));
            }
            let start = s.start_pos as usize;
            let len = self.seqs.get(&s.seq_id).map_or(0, |q| q.len);
            if start > len {
                return Err(Error::invalid(format!(
                    "sequence {}: start position {start} is past its cached length {len}",
                    s.seq_id
                )));
            }
            if start < len && !self.kv_specs.iter().all(|k| k.can_truncate(len, start)) {
                return Err(Error::invalid(format!(
                    "sequence {}: cannot rewind from {len} to {start}: the sliding window has dropped those positions (start again from 0)",
                    s.seq_id
                )));
            }
            if start + s.tokens.len() > self.ctx {
                return Err(Error::invalid(format!(
                    "sequence {}: positions up to {} exceed the context size {}",
                    s.seq_id,
                    start + s.tokens.len(),
                    self.ctx
                )));
            }
            rows += s.logits.rows(s.tokens.len());
        }
        if out_len != rows * self.cfg.vocab {
            return Err(Error::invalid(format!(
                "logits buffer holds {out_len} floats, the step needs {} ({rows} rows x vocab {})",
                rows * self.cfg.vocab,
                self.cfg.vocab
            )));
        }
        Ok(())
    }

    /// One step's ops, on the backend's step context ([`Backend::run_step`]); `seqs` is
    /// `self.seqs`, lent apart from the rest of `self`.
    fn run(&self, seqs: &mut HashMap<u64, Seq<B>>, batch: &[SeqStep<'_>], out: &mut [f32]) -> Result<()> {
        let cfg = &self.cfg;
        let b = &self.backend;
        let act = self.dtype;
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let ids: Vec<u32> = batch.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let positions: Vec<u32> =
            batch.iter().flat_map(|s| (0..s.tokens.len() as u32).map(move |i| s.start_pos + i)).collect();
        let mut chunks = Vec::with_capacity(batch.len());
        let mut row = 0;
        for s in batch {
            chunks.push(AttnChunk { row, len: s.tokens.len(), start_pos: s.start_pos as usize });
            row += s.tokens.len();
        }

        let mut h = b.alloc(n, cfg.hidden)?;
        b.embed(&self.embedding, &ids, &mut h)?;
        let mut x = b.alloc(n, cfg.hidden)?;
        let mut qkv = b.alloc(n, cfg.qkv_dim())?;
        let mut g = b.alloc(n, cfg.n_heads)?;
        let mut attn = b.alloc(n, cfg.q_dim())?;
        let mut o = b.alloc(n, cfg.hidden)?;
        let mut gate = b.alloc(n, cfg.intermediate)?;
        let mut up = b.alloc(n, cfg.intermediate)?;
        let mut gu = b.alloc(n, cfg.intermediate)?;
        let scale = 1.0 / (cfg.head_dim as f32).sqrt();

        // Each layer starts with x = attn_norm(h); the residual add that ends a layer is fused
        // with the next layer's norm.
        if let Some(l0) = self.layers.first() {
            b.rms_norm(&h, &l0.attn_norm, cfg.rms_eps, &mut x, act)?;
        }
        for (li, l) in self.layers.iter().enumerate() {
            let rope = &self.ropes[l.kind.index()];
            let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
            b.matmul_pair_rope(&x, &l.qkv, &mut qkv, &l.gate, &mut g, &positions, rope, nh, nkv, hd, act)?;
            let shape = AttnShape {
                n_heads: cfg.n_heads,
                n_kv_heads: cfg.n_kv_heads,
                head_dim: cfg.head_dim,
                window: (l.kind == LayerType::Sliding).then_some(cfg.sliding_window),
                scale,
            };
            for (s, c) in batch.iter().zip(&chunks) {
                let seq = seqs
                    .get_mut(&s.seq_id)
                    .ok_or_else(|| Error::internal(format!("sequence {} vanished", s.seq_id)))?;
                b.attention(&qkv, *c, shape, &mut seq.kv[li], &mut attn, act)?;
            }
            b.head_gate(&mut attn, &g, cfg.gate_act, cfg.head_dim, act)?;
            b.matmul(&attn, &l.out, &mut o, act)?;
            b.add_rms_norm(&mut h, &o, &l.mlp_norm, cfg.rms_eps, &mut x, act)?;

            b.matmul_geglu(&x, &l.mlp_gate, &l.mlp_up, &mut gate, &mut up, &mut gu, act)?;
            b.matmul(&gu, &l.mlp_down, &mut o, act)?;
            match self.layers.get(li + 1) {
                Some(next) => b.add_rms_norm(&mut h, &o, &next.attn_norm, cfg.rms_eps, &mut x, act)?,
                None => b.add(&mut h, &o)?,
            }
        }

        let mut want = Vec::new();
        for (s, c) in batch.iter().zip(&chunks) {
            match s.logits {
                LogitsMode::None => {}
                LogitsMode::Last => want.push(c.row + c.len - 1),
                LogitsMode::All => want.extend(c.row..c.row + c.len),
            }
        }
        if want.is_empty() {
            return Ok(());
        }
        let mut hs = b.alloc(want.len(), cfg.hidden)?;
        b.gather_rows(&h, &want, &mut hs)?;
        let mut hn = b.alloc(want.len(), cfg.hidden)?;
        b.rms_norm(&hs, &self.norm, cfg.rms_eps, &mut hn, act)?;
        let mut logits = b.alloc(want.len(), cfg.vocab)?;
        b.matmul(&hn, self.head.as_ref().unwrap_or(&self.embedding), &mut logits, act)?;
        b.read(&logits, out)
    }
}

impl<B: Backend> Executor for Model<B> {
    fn info(&self) -> ExecutorInfo {
        ExecutorInfo {
            backend: self.backend.name().to_string(),
            vocab: self.cfg.vocab,
            ctx: self.ctx,
            dtype: self.dtype,
        }
    }

    fn forward(&mut self, batch: &[SeqStep<'_>], out: &mut [f32]) -> Result<()> {
        self.check_batch(batch, out.len())?;
        for s in batch {
            let start = s.start_pos as usize;
            match self.seqs.get_mut(&s.seq_id) {
                Some(seq) if start < seq.len => {
                    for kv in &mut seq.kv {
                        self.backend.kv_truncate(kv, start)?;
                    }
                    seq.len = start;
                }
                Some(_) => {}
                None => {
                    let kv = self.kv_specs.iter().map(|k| self.backend.kv_alloc(k)).collect::<Result<Vec<_>>>()?;
                    self.seqs.insert(s.seq_id, Seq { len: 0, kv });
                }
            }
        }
        let mut seqs = std::mem::take(&mut self.seqs);
        let this = &*self;
        // A panic inside the step is held here until the sequences are back in place (this
        // step's then released, as after an error), then goes on to the caller.
        let caught = this
            .backend
            .run_step(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| this.run(&mut seqs, batch, out))));
        self.seqs = seqs;
        let r = match caught {
            Ok(r) => r,
            Err(panic) => {
                let _ = self.backend.end_step();
                for s in batch {
                    self.seqs.remove(&s.seq_id);
                }
                std::panic::resume_unwind(panic)
            }
        };
        // Also after an error: work issued before it runs before anything is freed.
        let ended = self.backend.end_step();
        match r.and(ended) {
            Ok(()) => {
                for s in batch {
                    if let Some(seq) = self.seqs.get_mut(&s.seq_id) {
                        seq.len = s.start_pos as usize + s.tokens.len();
                    }
                }
                Ok(())
            }
            Err(e) => {
                // A failed step may have appended part of its K/V: those caches are no longer
                // consistent, so the sequences are dropped and the error says so.
                for s in batch {
                    self.seqs.remove(&s.seq_id);
                }
                Err(Error::new(e.kind, format!("{} (the sequences of this step were released)", e.message)))
            }
        }
    }

    fn release(&mut self, seq_id: u64) {
        self.seqs.remove(&seq_id);
    }

    fn fork(&mut self, src: u64, dst: u64) -> Result<()> {
        let s = self.seqs.get(&src).ok_or_else(|| Error::invalid(format!("fork: no sequence {src}")))?;
        let kv = s.kv.iter().map(|k| self.backend.kv_clone(k)).collect::<Result<Vec<_>>>()?;
        let len = s.len;
        self.seqs.insert(dst, Seq { len, kv });
        Ok(())
    }

    fn seq_len(&self, seq_id: u64) -> Option<usize> {
        self.seqs.get(&seq_id).map(|s| s.len)
    }

    fn kv_bytes(&self) -> usize {
        self.seqs.values().flat_map(|s| s.kv.iter()).map(|k| self.backend.kv_bytes(k)).sum()
    }
}
