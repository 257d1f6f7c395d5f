//! `spark-run`: spark's command-line tool.
//!
//! Subcommands: `generate`, `chat`, `logits`, `info`, `bench`, `gen-random`, `backends`. Each
//! that loads a model takes `--model DIR|REPO_ID`; without it the small demo checkpoint shipped in
//! the repository is used (a toy with Spark-X2.5's architecture, not Spark-X2.5).
//!
//! `--backend auto|cpu|cuda|wgpu|qnn|PATH` and `--plugin-dir DIR` are global (before or after the
//! subcommand): a backend linked into this build (cargo feature `cpu`, on by default) is used
//! first, else a plugin `libspark_backend_NAME.so` on the search path (see `spark-run backends`).

mod backends;
mod commands;
mod hub;
mod load;
mod npy;
mod serve;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// spark: a Spark-X2.5 inference engine.
#[derive(Parser)]
#[command(name = "spark-run", version, about, propagate_version = true)]
struct Cli {
    /// Backend: auto (the best-scoring usable device), a name (cpu, cuda, wgpu, qnn: linked into
    /// this build, else the plugin libspark_backend_NAME.so on the plugin path), or the path of a
    /// plugin library.
    #[arg(long, global = true, default_value = "auto", value_name = "auto|cpu|cuda|wgpu|qnn|PATH.so")]
    backend: String,
    /// A directory to search for backend plugins first (repeatable); then SPARK_PLUGIN_PATH
    /// (colon-separated), the executable's directory and ../lib beside it.
    #[arg(long, global = true, value_name = "DIR")]
    plugin_dir: Vec<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

/// Options shared by every command that loads a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Checkpoint directory, a .safetensors file, or a Hugging Face repo id
    /// (e.g. XHToken/Spark-X2.5-1.7B). Default: the demo checkpoint in the repository.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Worker threads (default: all cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Largest context to serve; sizes the RoPE tables and the full layers' KV cache.
    #[arg(long, default_value_t = 4096)]
    pub ctx_size: usize,
    /// Compute dtype: f32, bf16 or f16 (default: the checkpoint's).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Quantize a float checkpoint's matrices while loading: int8 (per output channel), int6
    /// (groups of 32) or int4 (asymmetric groups, see --quant-group; the tied embedding/head,
    /// and q_k_v_proj and down_proj of about half the layers as in llama.cpp's Q4_K_M, in int6).
    /// Linked-in backends only; `spark-run quantize` writes a quantized checkpoint instead.
    #[arg(long)]
    pub quant: Option<String>,
    /// Group size for --quant int4 (32, 64 or 128; default 32), int6 (default 32) or int8
    /// (default: whole row).
    #[arg(long)]
    pub quant_group: Option<usize>,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text (streamed to stdout) or token ids.
    Generate(commands::generate::GenerateArgs),
    /// Interactive multi-turn chat.
    Chat(commands::chat::ChatArgs),
    /// One forward over --ids; writes float32 [len(ids), vocab] logits as .npy.
    Logits(commands::logits::LogitsArgs),
    /// Config summary, parameter count and memory plan.
    Info(commands::info::InfoArgs),
    /// Prefill and decode speed (tokens/s).
    Bench(commands::bench::BenchArgs),
    /// Write a Spark-shaped checkpoint with random weights.
    GenRandom(commands::gen_random::GenRandomArgs),
    /// Write an int8, int6 or int4 quantized copy of a float checkpoint.
    Quantize(commands::quantize::QuantizeArgs),
    /// List the backends found (linked in or plugins), their devices and scores, and why any
    /// known one is unusable.
    Backends(backends::BackendsArgs),
    /// OpenAI-compatible HTTP server (chat, completions, tool calls, continuous batching).
    Serve(commands::serve::ServeArgs),
}

fn main() {
    // Mesa's Vulkan device-select layer prints "XDG_RUNTIME_DIR is invalid" on headless machines
    // when the wgpu backend probes; it only reorders adapters, which wgpu does not need. Set
    // before any thread exists (set_var is not thread-safe).
    if std::env::var_os("NODEVICE_SELECT").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
    let cli = Cli::parse();
    load::configure(load::BackendChoice { backend: cli.backend, plugin_dirs: cli.plugin_dir });
    let result = match cli.command {
        Command::Generate(a) => commands::generate::run(a),
        Command::Chat(a) => commands::chat::run(a),
        Command::Logits(a) => commands::logits::run(a),
        Command::Info(a) => commands::info::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::GenRandom(a) => commands::gen_random::run(a),
        Command::Quantize(a) => commands::quantize::run(a),
        Command::Backends(a) => backends::run(a),
        Command::Serve(a) => commands::serve::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
