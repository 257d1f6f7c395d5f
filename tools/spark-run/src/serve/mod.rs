//! `spark-run serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.
//!
//! - `engine`: the thread that owns the executor and runs the scheduler loop.
//! - `listen`: the accept loop (connection cap, header deadline, graceful shutdown).
//! - `routes`: the HTTP endpoints (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
//!   `/health`, `/metrics`).
//! - `openai`: error objects and request-field parsing.
//! - `output`: token ids -> text, stop strings, reasoning / content / tool calls.
//!
//! See docs/SERVING.md.

mod engine;
mod listen;
mod openai;
mod output;
mod routes;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use spark_core::chat::ChatTemplate;
use spark_core::sample::SamplingParams;
use spark_core::scheduler::{Scheduler, SchedulerConfig};
use spark_core::tokenizer::Tokenizer;

use crate::load::Loaded;

/// Server settings (from the command line).
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    pub scheduler: SchedulerConfig,
    /// Largest request body in bytes.
    pub body_limit: usize,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Longest wait for a request's headers, and for the next piece of its body.
    pub read_timeout: std::time::Duration,
    /// TEST HOOK: a file of scripted model outputs (see [`Scripted`]).
    pub scripted_reply: Option<PathBuf>,
}

/// TEST HOOK (`--scripted-reply FILE`, or `SPARK_SCRIPTED_REPLY=FILE`): chat completions emit
/// these model outputs, in turn, instead of sampled tokens. The text is tokenized and forced
/// through the real scheduler, decoder and tool-call parser, so a test gets a deterministic tool
/// call from a model that cannot make one. Replies are separated by a line `---`. Never use it
/// to serve real traffic.
pub struct Scripted {
    pub replies: Vec<String>,
    pub next: AtomicU64,
}

/// What every handler shares.
pub struct AppState {
    pub model_id: String,
    pub tok: Tokenizer,
    pub template: ChatTemplate,
    pub eos: Vec<u32>,
    pub ctx: usize,
    /// Most tokens (prompt + completion) one sequence can hold within the KV budget (<= ctx).
    pub seq_tokens: usize,
    /// Every token's bytes, for JSON mode.
    pub token_bytes: spark_core::constraint::TokenBytes,
    pub defaults: SamplingParams,
    pub engine: engine::EngineHandle,
    pub scripted: Option<Scripted>,
    pub http: Mutex<HttpCounters>,
    pub next_id: AtomicU64,
    pub started: std::time::Instant,
}

/// HTTP-level counters for /metrics.
#[derive(Debug, Default, Clone)]
pub struct HttpCounters {
    /// (endpoint, status) -> count
    pub responses: std::collections::BTreeMap<(String, u16), u64>,
}

/// Sampling defaults from the checkpoint's generation_config.json.
fn default_params(dir: &std::path::Path) -> Result<SamplingParams> {
    let gc = crate::load::generation_config(dir)?;
    Ok(SamplingParams {
        temperature: gc.temperature.unwrap_or(1.0),
        top_k: gc.top_k.unwrap_or(0),
        top_p: gc.top_p.unwrap_or(1.0),
        ..SamplingParams::default()
    })
}

/// The most tokens one sequence can hold within the KV budget. A budget that cannot hold a
/// sequence of `min(ctx, 256)` tokens is refused (every request would be).
fn sequence_limit(sch: &Scheduler, budget: usize) -> Result<usize> {
    let ctx = sch.ctx();
    let floor = ctx.min(256);
    if sch.kv_bytes_for(floor) > budget {
        anyhow::bail!(
            "--kv-budget {budget} bytes cannot hold one sequence of {floor} tokens ({} bytes); raise it",
            sch.kv_bytes_for(floor)
        );
    }
    let (mut lo, mut hi) = (floor, ctx);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if sch.kv_bytes_for(mid) <= budget {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    if lo < ctx {
        eprintln!(
            "note: --kv-budget holds {lo} tokens per sequence (the context is {ctx}); requests without max_tokens stop there"
        );
    }
    Ok(lo)
}

/// Run the server until Ctrl-C / SIGTERM.
pub fn run(cfg: ServeConfig, loaded: Loaded) -> Result<()> {
    let dir = loaded.dir.clone();
    let tok = crate::load::tokenizer(&dir, loaded.config.vocab)?;
    let template = crate::load::chat_template(&dir)?;
    let info = loaded.exec.info();
    let model_id = dir.file_name().map_or_else(|| "spark".to_string(), |n| n.to_string_lossy().into_owned());
    let scripted_path =
        cfg.scripted_reply.clone().or_else(|| std::env::var_os("SPARK_SCRIPTED_REPLY").map(PathBuf::from));
    let scripted = match scripted_path {
        Some(p) => {
            let text = std::fs::read_to_string(&p).with_context(|| format!("--scripted-reply {}", p.display()))?;
            let replies: Vec<String> =
                text.split("\n---\n").map(|s| s.trim_end_matches('\n').to_string()).filter(|s| !s.is_empty()).collect();
            eprintln!(
                "warning: TEST HOOK active: chat replies are scripted from {} ({} replies)",
                p.display(),
                replies.len()
            );
            Some(Scripted { replies, next: AtomicU64::new(0) })
        }
        None => None,
    };
    let sch = Scheduler::new(cfg.scheduler.clone(), loaded.config.clone(), loaded.exec.as_ref());
    let seq_tokens = sequence_limit(&sch, cfg.scheduler.kv_budget)?;
    let token_bytes = Arc::new((0..tok.vocab_size() as u32).map(|i| tok.token_bytes(i)).collect());
    let engine = engine::EngineHandle::start(loaded.exec, sch).context("starting the engine thread")?;
    let state = Arc::new(AppState {
        model_id,
        tok,
        template,
        eos: loaded.config.eos.clone(),
        ctx: info.ctx,
        seq_tokens,
        token_bytes,
        defaults: default_params(&dir)?,
        engine,
        scripted,
        http: Mutex::new(HttpCounters::default()),
        next_id: AtomicU64::new(1),
        started: std::time::Instant::now(),
    });
    let app = routes::router(state.clone(), cfg.body_limit, cfg.read_timeout);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", cfg.host, cfg.port)
            .parse()
            .or_else(|_| {
                std::net::ToSocketAddrs::to_socket_addrs(&(cfg.host.as_str(), cfg.port))
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or(())
            })
            .map_err(|_| anyhow::anyhow!("--host {}: not an address", cfg.host))?;
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        eprintln!(
            "spark serving {} (ctx {}, backend {}) on http://{} — OpenAI API at /v1",
            state.model_id,
            state.ctx,
            info.backend,
            listener.local_addr().map_or(addr.to_string(), |a| a.to_string())
        );
        let limits = listen::ConnLimits { max_connections: cfg.max_connections, header_timeout: cfg.read_timeout };
        listen::serve(listener, app, limits, shutdown()).await.context("serving")?;
        Ok::<(), anyhow::Error>(())
    })?;
    Ok(())
}

async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("shutting down");
}
