//! `spark-run bench`: prefill (ppN) and decode (tgN) throughput, in llama-bench's spirit:
//! each test repeated `-r` times, mean and standard deviation of tokens/s reported, plus the
//! weight bytes a decode step reads.

use std::time::Instant;

use anyhow::Result;
use clap::Args;
use spark_core::sample::Xoshiro256;
use spark_core::{LogitsMode, SeqStep};

use crate::load;
use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length of the prefill test (0 = skip).
    #[arg(short = 'p', long, default_value_t = 512)]
    pub prompt: usize,
    /// Tokens of the decode test (0 = skip).
    #[arg(short = 'n', long, default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions.
    #[arg(short = 'r', long, default_value_t = 3)]
    pub reps: usize,
    /// One JSON object per test instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn stats(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let var = if v.len() > 1 { v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64 } else { 0.0 };
    (m, var.sqrt())
}

pub fn run(a: BenchArgs) -> Result<()> {
    anyhow::ensure!(a.reps > 0, "-r must be at least 1");
    let mut l = load::load(&a.model)?;
    let cfg = l.config.clone();
    let info = l.exec.info();
    anyhow::ensure!(a.prompt + a.n_gen < info.ctx, "-p + -n must fit in --ctx-size {}", info.ctx);
    let mut rng = Xoshiro256::new(42);
    let mut tok = || 3 + (rng.next_u64() % (cfg.vocab as u64 - 3)) as u32;
    let mut logits = vec![0.0f32; cfg.vocab];
    let model_name = l.dir.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    // Bytes of weights one decode step reads: every matrix once, plus the output head.
    let per_layer = cfg.qkv_dim() * cfg.hidden
        + cfg.n_heads * cfg.hidden
        + cfg.hidden * cfg.q_dim()
        + 3 * cfg.intermediate * cfg.hidden;
    let bytes_per_token = ((per_layer * cfg.n_layers + cfg.vocab * cfg.hidden) * info.dtype.size()) as f64;
    let mut rows = vec![];
    let mut seq = 100u64;
    if a.prompt > 0 {
        let mut v = vec![];
        for _ in 0..a.reps {
            let ids: Vec<u32> = (0..a.prompt).map(|_| tok()).collect();
            seq += 1;
            let t = Instant::now();
            l.exec.forward(
                &[SeqStep { seq_id: seq, tokens: &ids, start_pos: 0, logits: LogitsMode::Last }],
                &mut logits,
            )?;
            v.push(a.prompt as f64 / t.elapsed().as_secs_f64());
            l.exec.release(seq);
        }
        rows.push((format!("pp{}", a.prompt), stats(&v), None));
    }
    if a.n_gen > 0 {
        let mut v = vec![];
        for _ in 0..a.reps {
            seq += 1;
            let first = [tok()];
            l.exec.forward(
                &[SeqStep { seq_id: seq, tokens: &first, start_pos: 0, logits: LogitsMode::Last }],
                &mut logits,
            )?;
            let t = Instant::now();
            for i in 0..a.n_gen {
                let id = [tok()];
                l.exec.forward(
                    &[SeqStep { seq_id: seq, tokens: &id, start_pos: (i + 1) as u32, logits: LogitsMode::Last }],
                    &mut logits,
                )?;
            }
            v.push(a.n_gen as f64 / t.elapsed().as_secs_f64());
            l.exec.release(seq);
        }
        rows.push((format!("tg{}", a.n_gen), stats(&v), Some(bytes_per_token)));
    }
    if a.json {
        for (test, (m, sd), bpt) in &rows {
            println!(
                "{}",
                serde_json::json!({"model": model_name, "backend": info.backend, "precision": info.dtype.name(), "threads": l.threads, "simd": l.simd,
                    "test": test, "tok_s_mean": m, "tok_s_sd": sd, "reps": a.reps, "bytes_per_token": bpt, "load_s": l.load_time.as_secs_f64()})
            );
        }
    } else {
        println!("| model | backend | precision | threads | test | tok/s | GB/s of weights |");
        println!("| --- | --- | --- | ---: | --- | ---: | ---: |");
        for (test, (m, sd), bpt) in &rows {
            let bw = bpt.map(|b| format!("{:.1}", b * m / 1e9)).unwrap_or_else(|| "-".into());
            println!(
                "| {model_name} | {} ({}) | {} | {} | {test} | {m:.2} ± {sd:.2} | {bw} |",
                info.backend, l.simd, info.dtype, l.threads
            );
        }
    }
    Ok(())
}
