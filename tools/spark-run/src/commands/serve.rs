//! `spark-run serve`: an OpenAI-compatible HTTP server (chat and text completions, streaming,
//! Spark tool calls, reasoning, continuous batching). See docs/SERVING.md.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use spark_core::scheduler::SchedulerConfig;

use crate::load;
use crate::serve::{self, ServeConfig};
use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// KV-cache budget for all running sequences (bytes, or with KiB/MiB/GiB, KB/MB/GB).
    #[arg(long, default_value = "512MiB")]
    pub kv_budget: String,
    /// KV bytes kept for reuse by later requests that start with the same tokens (a
    /// conversation's earlier turns, a shared system prompt); 0 turns the prefix cache off.
    #[arg(long, default_value = "256MiB")]
    pub prefix_cache: String,
    /// Most sequences decoded together.
    #[arg(long, default_value_t = 16)]
    pub max_seqs: usize,
    /// Most requests waiting for a slot; more get 429.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Most tokens (decode + prefill chunks) in one batched step.
    #[arg(long, default_value_t = 256)]
    pub step_tokens: usize,
    /// Largest request body.
    #[arg(long, default_value = "8MiB")]
    pub max_body: String,
    /// Most client connections open at once (more wait to be accepted).
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Seconds a client may take to send a request's headers, or between pieces of its body,
    /// before its connection is closed.
    #[arg(long, default_value_t = 30)]
    pub read_timeout: u64,
    /// TEST HOOK: emit these scripted model outputs (separated by lines `---`) for chat
    /// completions instead of sampling. For tests only.
    #[arg(long, hide = true, value_name = "FILE")]
    pub scripted_reply: Option<PathBuf>,
}

/// Parse a byte size: `512MiB`, `1GiB`, `64KB`, `1000`.
pub fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| anyhow::anyhow!("'{s}' is not a size (e.g. 512MiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        u => bail!("'{s}': unknown size unit '{u}' (use B, KiB, MiB, GiB, KB, MB or GB)"),
    };
    Ok((n * mult) as usize)
}

pub fn run(a: ServeArgs) -> Result<()> {
    let kv_budget = parse_bytes(&a.kv_budget).map_err(|e| anyhow::anyhow!("--kv-budget: {e}"))?;
    let prefix_cache = parse_bytes(&a.prefix_cache).map_err(|e| anyhow::anyhow!("--prefix-cache: {e}"))?;
    let body_limit = parse_bytes(&a.max_body).map_err(|e| anyhow::anyhow!("--max-body: {e}"))?;
    if a.max_seqs == 0 {
        bail!("--max-seqs must be at least 1");
    }
    if a.max_queue == 0 {
        bail!("--max-queue must be at least 1 (every request waits in the queue for a slot)");
    }
    if a.step_tokens == 0 {
        bail!("--step-tokens must be at least 1");
    }
    if a.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    if a.read_timeout == 0 {
        bail!("--read-timeout must be at least 1 (seconds)");
    }
    let loaded = load::load(&a.model)?;
    let cfg = ServeConfig {
        host: a.host,
        port: a.port,
        scheduler: SchedulerConfig {
            max_seqs: a.max_seqs,
            step_tokens: a.step_tokens,
            kv_budget,
            max_queue: a.max_queue,
            prefix_cache,
        },
        body_limit,
        max_connections: a.max_connections,
        read_timeout: std::time::Duration::from_secs(a.read_timeout),
        scripted_reply: a.scripted_reply,
    };
    serve::run(cfg, loaded)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse_bytes("100").unwrap(), 100);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("5 parsecs").is_err());
    }
}
