//! Loading what a command needs: resolve `--model` (demo checkpoint, local path or Hugging
//! Face repo id), choose the backend (`--backend`, `--plugin-dir`: static backends first, then
//! plugins on the search path) and open the model on it, and find the tokenizer and chat
//! template.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context, Result};
use spark_core::chat::ChatTemplate;
use spark_core::gguf::{is_gguf, GgufFile};
use spark_core::plugin::loader::{BackendSpec, Registry, SearchPath};
use spark_core::plugin::{BackendFactory, OpenOptions};
use spark_core::quant::{QFormat, QuantSpec};
use spark_core::tokenizer::Tokenizer;
use spark_core::weights::{Checkpoint, ModelWeights};
use spark_core::{DType, Executor, ModelConfig};

use crate::ModelArgs;

/// The global `--backend` and `--plugin-dir` options.
#[derive(Debug, Clone)]
pub struct BackendChoice {
    pub backend: String,
    pub plugin_dirs: Vec<PathBuf>,
}

impl Default for BackendChoice {
    fn default() -> Self {
        BackendChoice { backend: "auto".into(), plugin_dirs: vec![] }
    }
}

static CHOICE: OnceLock<BackendChoice> = OnceLock::new();

/// Record the global backend options (once, from `main`, before any command runs).
pub fn configure(choice: BackendChoice) {
    // A second call (none is made) would keep the first choice.
    let _ = CHOICE.set(choice);
}

/// The global backend options (`auto` if `configure` was not called).
pub fn choice() -> BackendChoice {
    CHOICE.get().cloned().unwrap_or_default()
}

/// The backends linked into this build, by cargo feature.
pub fn static_backends() -> Vec<BackendFactory> {
    vec![
        #[cfg(feature = "cpu")]
        backend_cpu::plugin::FACTORY,
        #[cfg(feature = "cuda")]
        backend_cuda::plugin::FACTORY,
        #[cfg(feature = "wgpu")]
        backend_wgpu::plugin::FACTORY,
    ]
}

/// The static backends and the plugin search path of this run.
pub fn registry() -> Registry {
    Registry::new(static_backends(), SearchPath::new(&choice().plugin_dirs))
}

/// The demo checkpoint directory: `$SPARK_DEMO_MODEL`, else `models/spark-demo-tiny` in the
/// source tree this binary was built from, else beside the executable.
pub fn demo_dir() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("SPARK_DEMO_MODEL") {
        return Ok(PathBuf::from(p));
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/spark-demo-tiny");
    if built.join("config.json").exists() {
        return Ok(built.canonicalize().unwrap_or(built));
    }
    if let Ok(exe) = std::env::current_exe() {
        for up in exe.ancestors().skip(1).take(4) {
            let p = up.join("models/spark-demo-tiny");
            if p.join("config.json").exists() {
                return Ok(p);
            }
        }
    }
    anyhow::bail!("no --model given and the demo checkpoint (models/spark-demo-tiny) was not found; pass --model DIR or set SPARK_DEMO_MODEL")
}

/// Resolve `--model` to a local path, announcing the demo checkpoint when it is used.
pub fn model_dir(args: &ModelArgs) -> Result<PathBuf> {
    match &args.model {
        Some(spec) => crate::hub::resolve_model(spec),
        None => {
            let d = demo_dir()?;
            eprintln!(
                "note: no --model given; using the demo checkpoint {} — a 7M-parameter toy with Spark-X2.5's architecture trained on English technical prose. It is NOT Spark-X2.5 and has none of its abilities.",
                d.display()
            );
            Ok(d)
        }
    }
}

/// Parse `--dtype`.
pub fn dtype(args: &ModelArgs) -> Result<Option<DType>> {
    args.dtype.as_deref().map(DType::parse).transpose().map_err(|e| anyhow::anyhow!("--dtype: {e}"))
}

/// The config and weights of a checkpoint (directory, .safetensors or .gguf file), memory-mapped.
pub fn open_weights(path: &Path) -> Result<(ModelConfig, ModelWeights)> {
    if is_gguf(path) {
        return Ok(spark_core::gguf::load(path)?);
    }
    let dir = if path.is_file() { path.parent().unwrap_or(Path::new(".")) } else { path };
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(path)?;
    let w = ModelWeights::from_checkpoint(&ckpt, &cfg).with_context(|| path.display().to_string())?;
    Ok((cfg, w))
}

/// The `--quant` / `--quant-group` options.
pub fn quant(args: &ModelArgs) -> Result<Option<QuantSpec>> {
    let Some(f) = args.quant.as_deref() else {
        if let Some(g) = args.quant_group {
            anyhow::bail!("--quant-group {g} needs --quant int8|int6|int4");
        }
        return Ok(None);
    };
    let format = QFormat::parse(f).map_err(|e| anyhow::anyhow!("--quant: {e}"))?;
    Ok(Some(QuantSpec::new(format, args.quant_group)))
}

/// A model ready to run, with what surrounds it.
pub struct Loaded {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub exec: Box<dyn Executor>,
    /// Worker threads asked of the backend.
    pub threads: usize,
    /// What the chosen device runs with (the CPU's SIMD level, ...).
    pub simd: String,
    pub load_time: std::time::Duration,
}

/// `--ctx-size` in 1..=[`MAX_CONTEXT`](spark_core::graph::MAX_CONTEXT).
pub fn check_ctx(ctx: usize) -> Result<()> {
    if ctx == 0 {
        anyhow::bail!("--ctx-size: context size 0 is invalid (it must be at least 1)");
    }
    let max = spark_core::graph::MAX_CONTEXT;
    if ctx > max {
        anyhow::bail!("--ctx-size {ctx}: spark serves at most {max} positions");
    }
    Ok(())
}

/// Load the model named by `args` on the backend chosen by `--backend`.
pub fn load(args: &ModelArgs) -> Result<Loaded> {
    let dir = model_dir(args)?;
    let t0 = std::time::Instant::now();
    if args.threads == Some(0) {
        anyhow::bail!("--threads must be at least 1");
    }
    if let Some(t) = args.threads.filter(|&t| t > MAX_THREADS) {
        anyhow::bail!("--threads {t}: at most {MAX_THREADS} (this machine has {})", cores());
    }
    check_ctx(args.ctx_size)?;
    let opts = OpenOptions {
        threads: args.threads,
        ctx: Some(args.ctx_size),
        dtype: dtype(args)?,
        device: 0,
        quant: quant(args)?,
    };
    let choice = choice();
    let spec = BackendSpec::parse(&choice.backend)?;
    let chosen = registry().choose(&spec).context("--backend")?;
    // A linked-in backend without its device (cuda on a machine with no GPU) is the normal case
    // for `auto`: only plugins that failed to load or probe are worth a warning.
    for s in chosen.skipped.iter().filter(|s| !s.contains("(static)")) {
        eprintln!("warning: skipped backend {s}");
    }
    // A .gguf file is the model itself (config, weights, tokenizer and template inside).
    let gguf = is_gguf(&dir);
    let model_dir =
        if dir.is_file() && !gguf { dir.parent().unwrap_or(Path::new(".")).to_path_buf() } else { dir.clone() };
    let exec = chosen.open(&model_dir, &opts).with_context(|| format!("loading {}", dir.display()))?;
    let config =
        if gguf { GgufFile::open(&dir)?.config()? } else { ModelConfig::from_file(&model_dir.join("config.json"))? };
    let threads = args.threads.unwrap_or_else(cores);
    Ok(Loaded {
        dir: model_dir,
        config,
        exec,
        threads,
        simd: chosen.device.capabilities.clone(),
        load_time: t0.elapsed(),
    })
}

/// The checkpoint's tokenizer, or an error saying how to do without one; refused when it has
/// ids the model's `vocab` rows do not cover (its text would turn into ids the model rejects).
pub fn tokenizer(dir: &Path, vocab: usize) -> Result<Tokenizer> {
    let (tok, from) = if is_gguf(dir) {
        (GgufFile::open(dir)?.tokenizer()?, format!("{}: the tokenizer metadata", dir.display()))
    } else {
        let p = dir.join("tokenizer.json");
        if !p.exists() {
            anyhow::bail!("{} has no tokenizer.json: give token ids with --ids and use --print-ids", dir.display());
        }
        (Tokenizer::from_file(&p)?, p.display().to_string())
    };
    if tok.vocab_size() > vocab {
        anyhow::bail!(
            "{from}: the tokenizer has ids up to {} but the model's vocabulary has {vocab} rows",
            tok.vocab_size() - 1
        );
    }
    Ok(tok)
}

/// The checkpoint's chat template, or the built-in Spark-X2.5 one.
pub fn chat_template(dir: &Path) -> Result<ChatTemplate> {
    if is_gguf(dir) {
        return Ok(GgufFile::open(dir)?.chat_template().unwrap_or(ChatTemplate::Builtin));
    }
    ChatTemplate::for_model_dir(dir)
}

/// Parse `--ids 0,17,5`.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(|x| x.trim())
        .filter(|x| !x.is_empty())
        .map(|x| x.parse::<u32>().with_context(|| format!("--ids: '{x}' is not a token id")))
        .collect()
}

/// The most worker threads `--threads` may ask for (each is an OS thread spinning between the
/// steps' parallel regions; far more than the cores only slows a step down).
const MAX_THREADS: usize = 1024;

/// The cores this process may run on.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The sampling defaults a checkpoint's `generation_config.json` sets (all `None` without the
/// file; a GGUF file has none).
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerationConfig {
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// Read `dir/generation_config.json` when it exists: invalid JSON, a field of the wrong type or
/// an invalid value is an error naming the file and the field (they used to be passed over,
/// leaving other defaults in force unsaid).
pub fn generation_config(dir: &Path) -> Result<GenerationConfig> {
    let p = dir.join("generation_config.json");
    if is_gguf(dir) || !p.exists() {
        return Ok(GenerationConfig::default());
    }
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", p.display()))?;
    let obj = v.as_object().with_context(|| format!("{}: expected a JSON object", p.display()))?;
    let field = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let num = |k: &str| -> Result<Option<f32>> {
        field(k)
            .map(|v| {
                v.as_f64()
                    .map(|x| x as f32)
                    .with_context(|| format!("{}: '{k}' must be a number, got {v}", p.display()))
            })
            .transpose()
    };
    let g = GenerationConfig {
        do_sample: field("do_sample")
            .map(|v| {
                v.as_bool().with_context(|| format!("{}: 'do_sample' must be true or false, got {v}", p.display()))
            })
            .transpose()?,
        temperature: num("temperature")?,
        top_k: field("top_k")
            .map(|v| {
                v.as_u64()
                    .map(|k| k as usize)
                    .with_context(|| format!("{}: 'top_k' must be a whole number >= 0, got {v}", p.display()))
            })
            .transpose()?,
        top_p: num("top_p")?,
        repetition_penalty: num("repetition_penalty")?,
    };
    let check = spark_core::sample::SamplingParams {
        temperature: g.temperature.unwrap_or(1.0),
        top_k: g.top_k.unwrap_or(0),
        top_p: g.top_p.unwrap_or(1.0),
        repetition_penalty: g.repetition_penalty.unwrap_or(1.0),
        ..Default::default()
    };
    check.validate().map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    Ok(g)
}
