//! `spark-run backends`: every backend this program can use — linked in (static) or a plugin on
//! the search path — with its origin, ABI version, devices and scores; every known backend that
//! cannot be used, with the reason; and what `--backend auto` would pick.

use anyhow::Result;
use clap::Args;
use spark_core::plugin::loader::BackendSpec;
use spark_core::plugin::DeviceInfo;

use crate::load;

#[derive(Args, Debug)]
pub struct BackendsArgs {
    /// One JSON object per backend (and a last one for the automatic choice) instead of text.
    #[arg(long)]
    pub json: bool,
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

fn device_line(d: &DeviceInfo) -> String {
    let mut s = format!("device {}: {} [{}] score {}", d.index, d.name, d.capabilities, d.score);
    if d.memory_total > 0 {
        s += &format!(", memory {} ({} free)", gib(d.memory_total), gib(d.memory_free));
    }
    if !d.usable {
        s += ", unusable";
    }
    if !d.note.is_empty() {
        s += &format!(" — {}", d.note);
    }
    s
}

fn device_json(d: &DeviceInfo) -> serde_json::Value {
    serde_json::json!({"index": d.index, "name": d.name, "capabilities": d.capabilities, "score": d.score,
        "usable": d.usable, "memory_total": d.memory_total, "memory_free": d.memory_free, "note": d.note})
}

pub fn run(a: BackendsArgs) -> Result<()> {
    let reg = load::registry();
    let reports = reg.report();
    let auto = reg.choose(&BackendSpec::Auto);
    if a.json {
        for r in &reports {
            let devices: Vec<_> = r.devices.iter().map(device_json).collect();
            println!(
                "{}",
                serde_json::json!({"backend": r.name, "origin": r.origin, "abi_version": r.abi_version,
                    "usable": r.problem.is_none(), "problem": r.problem, "note": r.note, "devices": devices})
            );
        }
        let choice = match &auto {
            Ok(c) => {
                serde_json::json!({"auto": {"backend": c.source.name(), "origin": c.source.origin(), "device": c.device.index, "score": c.device.score}})
            }
            Err(e) => serde_json::json!({"auto": null, "problem": e.message}),
        };
        println!("{choice}");
        return Ok(());
    }
    println!("plugin search path: {}", reg.search.describe());
    for r in &reports {
        match &r.problem {
            None => println!("{} ({}, ABI {})", r.name, r.origin, r.abi_version.map_or("?".into(), |v| v.to_string())),
            // Not found anywhere: the problem says so, naming the backend and the search path.
            Some(p) if r.origin.is_empty() => println!("{p}"),
            Some(p) => println!(
                "{} ({}{}): unusable: {p}",
                r.name,
                r.origin,
                r.abi_version.map_or(String::new(), |v| format!(", ABI {v}"))
            ),
        }
        for d in &r.devices {
            println!("  {}", device_line(d));
        }
        if let Some(n) = &r.note {
            println!("  note: {n}");
        }
    }
    match auto {
        Ok(c) => println!(
            "auto: {} ({}), device {} (score {})",
            c.source.name(),
            c.source.origin(),
            c.device.index,
            c.device.score
        ),
        Err(e) => println!("auto: no usable backend: {}", e.message),
    }
    Ok(())
}
