//! `spark-run logits`: one forward over `--ids`, every position's logits written as float32
//! `[len(ids), vocab]` in .npy format.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use spark_core::{LogitsMode, SeqStep};

use crate::load::{self, parse_ids};
use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Token ids, comma separated.
    #[arg(long)]
    pub ids: String,
    /// Output .npy file.
    #[arg(long, short = 'o')]
    pub output: PathBuf,
}

pub fn run(a: LogitsArgs) -> Result<()> {
    let ids = parse_ids(&a.ids)?;
    anyhow::ensure!(!ids.is_empty(), "--ids is empty");
    let mut loaded = load::load(&a.model)?;
    let vocab = loaded.config.vocab;
    let mut out = vec![0.0f32; ids.len() * vocab];
    loaded.exec.forward(&[SeqStep { seq_id: 0, tokens: &ids, start_pos: 0, logits: LogitsMode::All }], &mut out)?;
    crate::npy::write_f32(&a.output, &[ids.len(), vocab], &out)?;
    eprintln!("wrote {} ({} x {} float32)", a.output.display(), ids.len(), vocab);
    Ok(())
}
