//! `spark-run quantize`: write an int8, int6 or int4 copy of a float checkpoint.
//!
//! Every matrix is quantized (the tied embedding / output head included: left in bf16 it would
//! cost more per decode step than the whole 4-bit saving) except the tiny head gate `g_proj`,
//! which stays in its stored precision; norms stay as stored. With `--to int4` the matrices get
//! asymmetric int4 groups (scale and bias), and the embedding / output head and the Q4_K_M-style
//! int8 matrices (`q_k_v_proj`, `down_proj` of half the layers) int8 per channel
//! (`QuantSpec::plan`). The output directory gets
//! `model.safetensors` in the format of `spark_core::quant`, a `config.json` with
//! `quantization_config`, and the source's tokenizer, template and other side files.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use spark_core::quant::{quantize_tensor, QFormat, QuantSpec};
use spark_core::weights::{write_weights, Checkpoint, ModelWeights, NamedRef, Weight};
use spark_core::ModelConfig;

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Float checkpoint directory (default: the demo checkpoint).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// int8 (symmetric, per output channel unless --group), int6 (symmetric groups of 32) or
    /// int4 (asymmetric groups with a scale and a bias each; the embedding / output head, and
    /// q_k_v_proj and down_proj of llama.cpp's Q4_K_M "more bits" layers, in int6 groups of 32).
    #[arg(long)]
    pub to: String,
    /// Columns per scale: 32, 64 or 128 for int4 (default 32); int6 default 32; int8 default is
    /// the whole row.
    #[arg(long)]
    pub group: Option<usize>,
    /// Output directory (created; must not already hold a checkpoint).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(a: QuantizeArgs) -> Result<()> {
    let src = match &a.model {
        Some(p) => p.clone(),
        None => crate::load::demo_dir()?,
    };
    anyhow::ensure!(src.is_dir(), "--model {}: not a checkpoint directory", src.display());
    let format = QFormat::parse(&a.to).map_err(|e| anyhow::anyhow!("--to: {e}"))?;
    if format == QFormat::I4 {
        if let Some(g) = a.group {
            anyhow::ensure!(matches!(g, 32 | 64 | 128), "--group {g}: int4 groups are 32, 64 or 128");
        }
    }
    let cfg_path = src.join("config.json");
    let cfg_text = std::fs::read_to_string(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?;
    let cfg = ModelConfig::from_json_str(&cfg_text).with_context(|| cfg_path.display().to_string())?;
    let spec = QuantSpec::new(format, a.group).for_layers(cfg.n_layers);
    let ckpt = Checkpoint::open(&src)?;
    let w = ModelWeights::from_checkpoint(&ckpt, &cfg).with_context(|| src.display().to_string())?;
    if let Some((name, _)) = w.named().iter().find(|(_, r)| matches!(r, NamedRef::W(Weight::Quant(_)))) {
        anyhow::bail!("{}: already quantized ('{name}'); quantize a float checkpoint", src.display());
    }
    if a.out.join("model.safetensors").exists() || a.out.join("config.json").exists() {
        anyhow::bail!("--out {}: already holds a checkpoint; choose an empty directory", a.out.display());
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;

    let t0 = Instant::now();
    let before = w.nbytes();
    let mut out = vec![];
    let mut group = None;
    let mut in_int6 = vec![];
    for (name, r) in w.named() {
        let t = match r {
            NamedRef::T(t) => Weight::Float(t.clone()),
            NamedRef::W(Weight::Float(t)) if name.ends_with("g_proj.weight") => Weight::Float(t.clone()),
            NamedRef::W(Weight::Float(t)) => {
                let q = quantize_tensor(t, spec)?;
                if q.format == format {
                    group.get_or_insert(q.group);
                } else {
                    in_int6.push(name.clone());
                }
                Weight::Quant(q)
            }
            NamedRef::W(Weight::Quant(_)) => unreachable!("checked above"),
        };
        out.push(t);
    }
    let after: usize = out.iter().map(|t| t.nbytes()).sum();
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    meta.insert("spark_quantization".to_string(), format.name().to_string());
    let st = a.out.join("model.safetensors");
    write_weights(&st, &out, Some(meta))?;

    // config.json: the source's, plus the quantization record.
    let mut obj: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&cfg_text)?;
    let group_size = match (format, a.group) {
        (_, Some(g)) => serde_json::json!(g),
        (QFormat::I8, None) => serde_json::json!("per_channel"),
        (QFormat::I4 | QFormat::I6, None) => serde_json::json!(group.unwrap_or(32)),
    };
    let mut qc = serde_json::json!({"quant_method": "spark", "format": format.name(), "group_size": group_size,
        "symmetric": format != QFormat::I4, "modules_not_converted": ["g_proj"],
        "activations": "int8 per 32-block at run time (CPU)",
        "scale_dtype": {"groups": "float16", "per_channel": "float32"}});
    if format == QFormat::I4 {
        // Asymmetric int4 groups (f16 scale and bias each); these tensors are symmetric int6 in
        // groups of 32 (an f16 scale each).
        qc["bias"] = serde_json::json!(true);
        qc["modules_in_int6"] = serde_json::json!(in_int6);
    }
    obj.insert("quantization_config".into(), qc);
    std::fs::write(a.out.join("config.json"), serde_json::to_string_pretty(&obj)? + "\n")?;
    // Side files: tokenizer, chat template, generation config, README...
    for e in std::fs::read_dir(&src)? {
        let p = e?.path();
        let n = p.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
        if p.is_file() && !n.ends_with(".safetensors") && n != "model.safetensors.index.json" && n != "config.json" {
            std::fs::copy(&p, a.out.join(&n)).with_context(|| format!("copying {}", p.display()))?;
        }
    }
    let params: usize = w
        .named()
        .iter()
        .map(|(_, r)| match r {
            NamedRef::T(t) => t.numel(),
            NamedRef::W(w) => w.shape().iter().product(),
        })
        .sum();
    eprintln!(
        "wrote {} ({}): {:.1} MB -> {:.1} MB ({:.2} bits/weight overall) in {:.1} s",
        a.out.display(),
        format,
        before as f64 / 1e6,
        after as f64 / 1e6,
        after as f64 * 8.0 / params as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
