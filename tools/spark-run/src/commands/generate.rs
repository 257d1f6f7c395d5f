//! `spark-run generate`: complete a prompt (text, chat-wrapped text, or raw ids), streaming text
//! to stdout, or printing the generated ids with `--print-ids`.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use clap::Args;
use spark_core::engine::Session;
use spark_core::sample::{Sampler, SamplingParams};

use crate::load::{self, parse_ids};
use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text.
    #[arg(long, short = 'p', conflicts_with = "ids")]
    pub prompt: Option<String>,
    /// Prompt as token ids, comma separated (e.g. 0,17,5).
    #[arg(long)]
    pub ids: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    pub n: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Wrap the prompt in the chat template (a user turn, then the assistant's turn).
    #[arg(long)]
    pub chat: bool,
    /// With --chat: turn thinking off (enable_thinking=false).
    #[arg(long)]
    pub no_think: bool,
    /// Print the generated token ids, comma separated, on one line, instead of text.
    #[arg(long)]
    pub print_ids: bool,
    /// Keep going after the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print timing to stderr at the end.
    #[arg(long)]
    pub verbose: bool,
}

/// Sampling options shared by `generate` and `chat`.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy. Default: the checkpoint's generation_config.json, else 0.8.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Keep tokens with p >= min_p * p_max (0 = off).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Repetition penalty over prompt and output (1 = off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// Parameters from the flags, defaulting to the checkpoint's generation_config.json.
    pub fn params(&self, dir: &Path) -> Result<SamplingParams> {
        let gc = load::generation_config(dir)?;
        let default_temp = if gc.do_sample.unwrap_or(true) { gc.temperature.unwrap_or(0.8) } else { 0.0 };
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(default_temp),
            top_k: self.top_k.unwrap_or(gc.top_k.unwrap_or(0)),
            top_p: self.top_p.unwrap_or(gc.top_p.unwrap_or(1.0)),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(gc.repetition_penalty.unwrap_or(1.0)),
            seed: self.seed,
            ..SamplingParams::default()
        };
        p.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(p)
    }
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let mut loaded = load::load(&a.model)?;
    let dir = loaded.dir.clone();
    let tok = if a.print_ids && a.prompt.is_none() && !a.chat {
        None
    } else {
        Some(load::tokenizer(&dir, loaded.config.vocab)?)
    };
    let prompt: Vec<u32> = match (&a.prompt, &a.ids) {
        (_, Some(ids)) => parse_ids(ids)?,
        (Some(text), None) => {
            let tok = tok.as_ref().context("a tokenizer is needed for --prompt")?;
            if a.chat {
                let tmpl = load::chat_template(&dir)?;
                let msgs = serde_json::json!([{"role": "user", "content": text}]);
                let mut kw = serde_json::Map::new();
                kw.insert("enable_thinking".into(), (!a.no_think).into());
                tok.encode(&tmpl.render(&msgs, None, true, &kw)?)?
            } else {
                tok.encode(text)?
            }
        }
        (None, None) => anyhow::bail!("give a prompt with --prompt TEXT or --ids 0,17,5"),
    };
    anyhow::ensure!(!prompt.is_empty(), "the prompt encodes to no tokens");
    let ctx = loaded.exec.info().ctx;
    anyhow::ensure!(
        prompt.len() < ctx,
        "the prompt is {} tokens: it must be shorter than the context (--ctx-size {ctx}) to leave room for a \
         generated token",
        prompt.len()
    );
    let params = a.sampling.params(&dir)?;
    let mut sampler = Sampler::new(params).map_err(|e| anyhow::anyhow!("{e}"))?;
    let stop: Vec<u32> = if a.ignore_eos { vec![] } else { loaded.config.eos.clone() };

    let stdout = std::io::stdout();
    let mut ids_out = Vec::new();
    let mut decoder = tok.as_ref().map(|t| t.stream_decoder(true));
    let mut write_err = None;
    let mut session = Session::new(1);
    let outcome = session.generate(loaded.exec.as_mut(), &prompt, a.n, &mut sampler, &stop, &mut |id| {
        ids_out.push(id);
        if a.print_ids {
            return true;
        }
        if let Some(d) = decoder.as_mut() {
            match d.step(id) {
                Ok(Some(text)) => {
                    let mut lock = stdout.lock();
                    if let Err(e) = lock.write_all(text.as_bytes()).and_then(|_| lock.flush()) {
                        write_err = Some(e);
                        return false;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    write_err = Some(std::io::Error::other(e.to_string()));
                    return false;
                }
            }
        }
        true
    })?;
    if let Some(e) = write_err {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
        return Ok(());
    }
    let mut lock = stdout.lock();
    if a.print_ids {
        let s: Vec<String> = ids_out.iter().map(|i| i.to_string()).collect();
        writeln!(lock, "{}", s.join(","))?;
    } else {
        if let Some(d) = decoder.as_mut() {
            if let Some(rest) = d.flush()? {
                write!(lock, "{rest}")?;
            }
        }
        writeln!(lock)?;
    }
    if a.verbose {
        let pf = outcome.prefilled as f64 / outcome.prefill_time.as_secs_f64().max(1e-9);
        let dec = outcome.tokens.len().saturating_sub(1) as f64 / outcome.decode_time.as_secs_f64().max(1e-9);
        eprintln!(
            "[{} prompt tokens, {:.1} tok/s prefill; {} generated, {:.1} tok/s decode; stop: {:?}; {} threads, {}; load {:.2}s]",
            outcome.prefilled, pf, outcome.tokens.len(), dec, outcome.stop, loaded.threads, loaded.simd, loaded.load_time.as_secs_f64()
        );
    }
    Ok(())
}
