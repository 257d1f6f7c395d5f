//! `spark-run gen-random`: write a Spark-shaped checkpoint with random weights (norms
//! `1 + 0.1 r`, everything else `0.02 r`, as the golden generator does), for benchmarks and
//! demos. Tensors are generated in parallel blocks with per-block seeds (the same file for any
//! thread count) and streamed to disk, so memory stays small even for the 4B shape.

use std::io::{BufWriter, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use rayon::prelude::*;
use serde_json::json;
use spark_core::sample::Xoshiro256;
use spark_core::{DType, ModelConfig};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Shape {
    #[value(name = "1.7b")]
    B1_7,
    #[value(name = "4b")]
    B4,
    Tiny,
}

#[derive(Args, Debug)]
pub struct GenRandomArgs {
    #[arg(long, value_enum)]
    pub shape: Shape,
    /// Weight dtype: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

fn config(shape: Shape, dtype: DType) -> serde_json::Value {
    let (hidden, inter, layers, heads, kv, vocab, window) = match shape {
        Shape::B1_7 => (2048, 6656, 28, 8, 2, 131072, 512),
        Shape::B4 => (2560, 10240, 36, 16, 4, 131072, 512),
        Shape::Tiny => (128, 384, 8, 4, 2, 4096, 16),
    };
    let head_dim = if matches!(shape, Shape::Tiny) { 64 } else { 256 };
    let layer_types: Vec<&str> =
        (0..layers).map(|i| if i % 4 == 3 { "full_attention" } else { "sliding_attention" }).collect();
    json!({
        "architectures": ["Spark2_5ForCausalLM"],
        "model_type": "spark2_5",
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "dtype": match dtype { DType::F32 => "float32", DType::BF16 => "bfloat16", DType::F16 => "float16" },
        "gate_attn_act_mode": "sigmoid",
        "headwise_attn_output_gate": true,
        "head_dim": head_dim,
        "hidden_act": "gelu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "layer_types": layer_types,
        "max_position_embeddings": 1048576,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 5000000},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000}
        },
        "sliding_window": window,
        "tie_word_embeddings": true,
        "vocab_size": vocab
    })
}

const BLOCK: usize = 1 << 20;

/// Standard normal values for block `b` of tensor `t`.
fn normals(seed: u64, t: usize, b: usize, n: usize) -> Vec<f32> {
    let mut rng = Xoshiro256::new(seed ^ ((t as u64) << 32) ^ (b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        let u1 = rng.next_f64().max(f64::MIN_POSITIVE);
        let u2 = rng.next_f64();
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
        v.push((r * c) as f32);
        v.push((r * s) as f32);
    }
    v.truncate(n);
    v
}

pub fn run(a: GenRandomArgs) -> Result<()> {
    let dtype = DType::parse(&a.dtype)?;
    anyhow::ensure!(dtype != DType::F16, "--dtype: gen-random writes bf16 or f32");
    let cfg_json = config(a.shape, dtype);
    let cfg = ModelConfig::from_json(cfg_json.as_object().context("config")?)?;
    if a.out.join("model.safetensors").exists() || a.out.join("config.json").exists() {
        anyhow::bail!("--out {}: already holds a checkpoint; choose an empty directory", a.out.display());
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("cannot create {}", a.out.display()))?;
    std::fs::write(a.out.join("config.json"), serde_json::to_string_pretty(&cfg_json)?)?;

    let tensors = cfg.expected_tensors();
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, shape) in &tensors {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        header.insert(name.clone(), json!({"dtype": if dtype == DType::BF16 { "BF16" } else { "F32" }, "shape": shape, "data_offsets": [off, off + bytes]}));
        off += bytes;
    }
    header.insert(
        "__metadata__".into(),
        json!({"format": "pt", "generator": "spark-run gen-random", "seed": a.seed.to_string()}),
    );
    let mut h = serde_json::to_string(&header)?.into_bytes();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let path = a.out.join("model.safetensors");
    let file = std::fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    w.write_all(&(h.len() as u64).to_le_bytes())?;
    w.write_all(&h)?;
    let bar = indicatif::ProgressBar::new(off as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message("writing random weights");
    for (ti, (name, shape)) in tensors.iter().enumerate() {
        let n: usize = shape.iter().product();
        let norm = name.ends_with("norm.weight");
        let blocks: Vec<Vec<u8>> = (0..n.div_ceil(BLOCK))
            .into_par_iter()
            .map(|b| {
                let len = BLOCK.min(n - b * BLOCK);
                let vals: Vec<f32> = normals(a.seed, ti, b, len)
                    .into_iter()
                    .map(|r| if norm { 1.0 + 0.1 * r } else { 0.02 * r })
                    .collect();
                spark_core::dtype::encode(dtype, &vals)
            })
            .collect();
        for b in blocks {
            w.write_all(&b)?;
            bar.inc(b.len() as u64);
        }
    }
    w.flush()?;
    bar.finish_and_clear();
    if let Ok(demo) = crate::load::demo_dir() {
        for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
            let _ = std::fs::copy(demo.join(f), a.out.join(f));
        }
    }
    eprintln!(
        "wrote {} ({} parameters, {}, RANDOM weights; tokenizer copied from the demo checkpoint, so text in and out is only good for exercising the pipeline)",
        a.out.display(),
        cfg.param_count(),
        dtype
    );
    Ok(())
}
