//! `spark-run info`: the config in brief, the parameter count and the memory plan (weights,
//! KV bytes per token per layer type, RoPE tables) for the context asked for.

use anyhow::Result;
use clap::Args;
use spark_core::config::{LayerType, ModelConfig};
use spark_core::gguf::{is_gguf, GgufFile};
use spark_core::kv::{sequence_kv_bytes, KvSpec};
use spark_core::weights::Checkpoint;
use spark_core::DType;

use crate::load;
use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct InfoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
}

fn mib(b: f64) -> String {
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    }
}

pub fn run(a: InfoArgs) -> Result<()> {
    load::check_ctx(a.model.ctx_size)?;
    let dir = load::model_dir(&a.model)?;
    // A GGUF file holds the config; its tensors are summarised by ggml type below.
    let gguf = if is_gguf(&dir) { Some(GgufFile::open(&dir)?) } else { None };
    let dir =
        if dir.is_file() && gguf.is_none() { dir.parent().map(|p| p.to_path_buf()).unwrap_or_default() } else { dir };
    let (cfg, stored, total_bytes) = match &gguf {
        Some(g) => {
            let cfg = g.config()?;
            // A quantized file computes in bf16 ([`GgufFile::compute_dtype`]).
            let stored = g
                .compute_dtype()
                .or_else(|| g.tensor("token_embd.weight").and_then(|t| t.kind.float()))
                .unwrap_or(cfg.dtype);
            (cfg, stored, g.data_bytes() as u64)
        }
        None => {
            let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
            let ckpt = Checkpoint::open(&dir)?;
            let stored = ckpt.tensors.get("model.embedding.weight").map(|t| t.dtype).unwrap_or(cfg.dtype);
            (cfg, stored, ckpt.total_bytes)
        }
    };
    let dtype = load::dtype(&a.model)?.unwrap_or(stored);
    let ctx = a.model.ctx_size;
    let n_s = cfg.count_layers(LayerType::Sliding);
    let n_f = cfg.count_layers(LayerType::Full);
    println!("model       {}", dir.display());
    println!(
        "shape       hidden {}, intermediate {}, {} layers ({} sliding + {} full), heads {} / kv {} x {}",
        cfg.hidden, cfg.intermediate, cfg.n_layers, n_s, n_f, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    );
    println!("vocab       {}   tied embeddings: {}", cfg.vocab, cfg.tie_embeddings);
    println!("window      {} (sliding layers)", cfg.sliding_window);
    for t in [LayerType::Sliding, LayerType::Full] {
        let r = cfg.rope_for(t);
        println!("rope        {:<18} theta {:>10}  rotary dims {} of {}", t.name(), r.theta, r.rot_dims, cfg.head_dim);
    }
    println!("gate        head-wise {:?}; GELU (erf); rms eps {:e}", cfg.gate_act, cfg.rms_eps);
    println!("parameters  {} ({:.3} B)", cfg.param_count(), cfg.param_count() as f64 / 1e9);
    println!("\nmemory plan (compute dtype {dtype}, context {ctx}):");
    let weights = total_bytes as f64;
    let quant = load::quant(&a.model)?;
    // As the CPU backend serves it (f16 group scales kept f16 from the VNNI level up; AVX2 int4
    // with sub-scales read through them).
    let plan = super::bench::weight_plan(&dir, quant, dtype.name(), super::bench::cpu_holding())?;
    let (served, precision) = (plan.held, plan.precision);
    let quantized = precision.contains("int");
    let converted = if dtype != stored && !quantized { cfg.param_count() as f64 * dtype.size() as f64 } else { 0.0 };
    println!(
        "  weights (mapped, {} stored)   {}",
        if quantized && quant.is_none() { "quantized".to_string() } else { stored.to_string() },
        mib(weights)
    );
    if let Some(g) = &gguf {
        println!("  GGUF v{} tensors by type (quantized ones are converted to int8/int4 at load):", g.version);
        for (kind, (n, bytes)) in g.kinds_summary() {
            println!("    {:<8} {:>4} tensors  {}", kind.name(), n, mib(bytes as f64));
        }
    }
    if converted > 0.0 {
        println!("  weights converted to {dtype}       {} (anonymous memory)", mib(converted));
    }
    if quantized {
        println!(
            "  weights as served ({precision})   {} (repacked for the kernels: anonymous memory; one matrix at a time while loading)",
            mib(served)
        );
    }
    println!("  weights read per decode step   {}", mib(plan.read));
    let kv_dtype = if dtype == DType::BF16 { DType::BF16 } else { DType::F32 };
    for t in [LayerType::Sliding, LayerType::Full] {
        let s = KvSpec::for_layer(&cfg, t, ctx, kv_dtype);
        let per = s.bytes_per_position();
        let held = match t {
            LayerType::Sliding => format!(
                "ring of {} positions: at most {} per layer",
                s.held(usize::MAX),
                mib((s.held(usize::MAX) * per) as f64)
            ),
            LayerType::Full => format!("grows: {} per layer at {ctx} tokens", mib((ctx * per) as f64)),
        };
        println!("  KV {:<18} {} B/token/layer ({kv_dtype}); {held}", t.name(), per);
    }
    let kv_full_ctx = sequence_kv_bytes(&cfg, ctx, kv_dtype, ctx);
    println!("  KV per sequence at {ctx} tokens  {}", mib(kv_full_ctx as f64));
    let rope: usize = [LayerType::Sliding, LayerType::Full].iter().map(|&t| ctx * cfg.rope_for(t).rot_dims * 4).sum();
    println!("  RoPE tables ({ctx} positions)  {}", mib(rope as f64));
    Ok(())
}
