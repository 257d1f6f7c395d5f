//! `spark-run chat`: interactive multi-turn chat. The conversation's token history is kept
//! append-only (each new turn adds only the template's delta), so the KV cache is reused from
//! turn to turn. Reasoning is shown dimmed, or hidden with `--hide-reasoning`.
//!
//! Commands at the prompt: `/reset` starts over, `/think on|off` toggles thinking, `/exit` quits.

use std::io::{BufRead, Write};

use anyhow::Result;
use clap::Args;
use serde_json::{json, Map, Value};
use spark_core::engine::Session;
use spark_core::sample::Sampler;

use super::generate::SamplingArgs;
use crate::load;
use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Most tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    pub n: usize,
    /// A system message.
    #[arg(long)]
    pub system: Option<String>,
    /// Start with thinking off.
    #[arg(long)]
    pub no_think: bool,
    /// Do not print the reasoning part of replies.
    #[arg(long)]
    pub hide_reasoning: bool,
}

/// ANSI dim / reset, only when stdout is a terminal.
fn styles() -> (&'static str, &'static str) {
    use std::io::IsTerminal;
    if std::io::stdout().is_terminal() {
        ("\x1b[2m", "\x1b[0m")
    } else {
        ("", "")
    }
}

pub fn run(a: ChatArgs) -> Result<()> {
    let mut loaded = load::load(&a.model)?;
    let dir = loaded.dir.clone();
    let tok = load::tokenizer(&dir, loaded.config.vocab)?;
    let tmpl = load::chat_template(&dir)?;
    let mut sampler = Sampler::new(a.sampling.params(&dir)?).map_err(|e| anyhow::anyhow!("{e}"))?;
    let end_think = tok.special_ids().end_think;
    let eos = loaded.config.eos.clone();
    let (dim, reset) = styles();
    let mut think = !a.no_think;
    let mut session = Session::new(1);
    let mut messages: Vec<Value> = vec![];
    if let Some(s) = &a.system {
        messages.push(json!({"role": "system", "content": s}));
    }
    let initial = messages.clone();
    let mut history: Vec<u32> = vec![];
    let mut rendered_prev = String::new();

    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    eprintln!(
        "spark chat — {} (thinking {}). /reset, /think on|off, /exit. Ctrl-D quits.",
        dir.display(),
        if think { "on" } else { "off" }
    );
    loop {
        write!(out, "\n> ")?;
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            writeln!(out)?;
            return Ok(());
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/reset" => {
                messages = initial.clone();
                history.clear();
                rendered_prev.clear();
                session.reset(loaded.exec.as_mut());
                eprintln!("(conversation cleared)");
                continue;
            }
            "/think on" | "/think off" => {
                think = line.trim().ends_with("on");
                eprintln!("(thinking {})", if think { "on" } else { "off" });
                continue;
            }
            _ => {}
        }
        messages.push(json!({"role": "user", "content": line}));
        let mut kw = Map::new();
        kw.insert("enable_thinking".into(), think.into());
        let full = tmpl.render(&Value::Array(messages.clone()), None, true, &kw)?;
        let prompt: Vec<u32> = if !history.is_empty() && full.starts_with(&rendered_prev) {
            let mut p = history.clone();
            p.extend(tok.encode(&full[rendered_prev.len()..])?);
            p
        } else {
            tok.encode(&full)?
        };

        let mut in_reasoning = think;
        let mut reasoning_ids = vec![];
        let mut content_ids = vec![];
        let mut dec = tok.stream_decoder(true);
        if in_reasoning && !a.hide_reasoning {
            write!(out, "{dim}")?;
        }
        let hide = a.hide_reasoning;
        let result = session.generate(loaded.exec.as_mut(), &prompt, a.n, &mut sampler, &eos, &mut |id| {
            if eos.contains(&id) {
                return true;
            }
            if in_reasoning && Some(id) == end_think {
                in_reasoning = false;
                let _ = dec.flush();
                if !hide {
                    let _ = writeln!(out, "{reset}");
                }
                return true;
            }
            if in_reasoning {
                reasoning_ids.push(id)
            } else {
                content_ids.push(id)
            }
            if let Ok(Some(t)) = dec.step(id) {
                if !(in_reasoning && hide) {
                    let _ = write!(out, "{t}");
                    let _ = out.flush();
                }
            }
            true
        });
        if let Ok(Some(t)) = dec.flush() {
            if !(in_reasoning && hide) {
                write!(out, "{t}")?;
            }
        }
        write!(out, "{reset}")?;
        writeln!(out)?;
        let outcome = match result {
            Ok(o) => o,
            Err(e) => {
                eprintln!("error: {e}");
                messages.pop();
                continue;
            }
        };
        let reasoning = tok.decode(&reasoning_ids, true)?;
        let content = tok.decode(&content_ids, true)?;
        history = prompt;
        history.extend(&outcome.tokens);
        if !outcome.tokens.last().is_some_and(|t| eos.contains(t)) {
            if in_reasoning {
                if let Some(e) = end_think {
                    history.push(e);
                }
            }
            history.extend(eos.first());
        }
        let mut msg = json!({"role": "assistant", "content": content});
        if think && !reasoning.is_empty() {
            msg["reasoning_content"] = Value::String(reasoning);
        }
        messages.push(msg);
        rendered_prev = tmpl.render(&Value::Array(messages.clone()), None, false, &kw)?;
    }
}
