//! Bad checkpoints give clear errors naming the file, tensor or field, never a crash: malformed
//! and truncated safetensors, missing / unexpected / mis-shaped tensors, unsupported dtypes,
//! sharded indexes with missing shards; and a sharded checkpoint loads like a single file.

mod common;

use std::path::Path;

use backend_cpu::CpuBackend;
use common::repo;
use spark_core::weights::{write_safetensors, Checkpoint, Tensor};
use spark_core::{DType, Executor, LogitsMode, Model, ModelConfig, ModelOptions, SeqStep};

fn golden_dir() -> std::path::PathBuf {
    repo().join("testdata/golden/m8/ckpt_f32")
}

fn copy_config(to: &Path) {
    std::fs::copy(golden_dir().join("config.json"), to.join("config.json")).unwrap();
}

fn load_err(dir: &Path) -> String {
    match Model::load(CpuBackend::new(Some(1)).unwrap(), dir, &ModelOptions::default()) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.message,
    }
}

fn golden_tensors() -> Vec<Tensor> {
    let ck = Checkpoint::open(&golden_dir()).unwrap();
    let mut v: Vec<Tensor> = ck.tensors.values().cloned().collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

#[test]
fn truncated_file_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    copy_config(d.path());
    let bytes = std::fs::read(golden_dir().join("model.safetensors")).unwrap();
    std::fs::write(d.path().join("model.safetensors"), &bytes[..bytes.len() - 1000]).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors") && e.contains("truncated or corrupt"), "{e}");
}

#[test]
fn garbage_header_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    copy_config(d.path());
    for bytes in [
        b"hello".to_vec(),
        {
            let mut b = 1_000_000u64.to_le_bytes().to_vec();
            b.extend(b"{}");
            b
        },
        {
            let mut b = 4u64.to_le_bytes().to_vec();
            b.extend(b"{no}");
            b
        },
    ] {
        std::fs::write(d.path().join("model.safetensors"), &bytes).unwrap();
        let e = load_err(d.path());
        assert!(e.contains("not a valid safetensors file"), "{e}");
    }
}

#[test]
fn missing_unexpected_and_misshaped_tensors() {
    let all = golden_tensors();
    let d = tempfile::tempdir().unwrap();
    copy_config(d.path());
    let file = d.path().join("model.safetensors");

    let without: Vec<Tensor> = all.iter().filter(|t| t.name != "model.layers.3.mlp.up_proj.weight").cloned().collect();
    write_safetensors(&file, &without).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("missing tensor(s) 'model.layers.3.mlp.up_proj.weight'"), "{e}");

    let mut extra = all.clone();
    extra.push(Tensor::from_f32("model.layers.0.self_attn.q_proj.bias", vec![4], DType::F32, &[0.0; 4]));
    write_safetensors(&file, &extra).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"), "{e}");

    let mut bad = all.clone();
    let i = bad.iter().position(|t| t.name == "model.layers.0.self_attn.g_proj.weight").unwrap();
    bad[i] = Tensor::from_f32(&bad[i].name.clone(), vec![5, 128], DType::F32, &[0.0; 640]);
    write_safetensors(&file, &bad).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("'model.layers.0.self_attn.g_proj.weight' has shape [5, 128]") && e.contains("[4, 128]"), "{e}");
}

#[test]
fn unsupported_dtype_names_the_tensor() {
    let d = tempfile::tempdir().unwrap();
    copy_config(d.path());
    let data = [0u8; 8];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![1], &data).unwrap();
    safetensors::serialize_to_file(vec![("model.norm.weight", view)], None, &d.path().join("model.safetensors"))
        .unwrap();
    let e = load_err(d.path());
    assert!(e.contains("'model.norm.weight'") && e.contains("I64"), "{e}");
}

#[test]
fn missing_files_are_named() {
    let d = tempfile::tempdir().unwrap();
    let e = load_err(d.path());
    assert!(e.contains("config.json"), "{e}");
    copy_config(d.path());
    let e = load_err(d.path());
    assert!(e.contains("no model.safetensors"), "{e}");
    std::fs::write(d.path().join("config.json"), "{\"hidden_size\": 1").unwrap();
    let e = load_err(d.path());
    assert!(e.contains("config.json") && e.contains("not valid JSON"), "{e}");
}

#[test]
fn sharded_checkpoint_loads_and_matches() {
    let all = golden_tensors();
    let d = tempfile::tempdir().unwrap();
    copy_config(d.path());
    let (a, b) = all.split_at(all.len() / 2);
    write_safetensors(&d.path().join("model-00001-of-00002.safetensors"), a).unwrap();
    write_safetensors(&d.path().join("model-00002-of-00002.safetensors"), b).unwrap();
    let mut map = serde_json::Map::new();
    for t in a {
        map.insert(t.name.clone(), "model-00001-of-00002.safetensors".into());
    }
    for t in b {
        map.insert(t.name.clone(), "model-00002-of-00002.safetensors".into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(d.path().join("model.safetensors.index.json"), index.to_string()).unwrap();

    let logits = |dir: &Path| {
        let mut m = Model::load(CpuBackend::new(Some(1)).unwrap(), dir, &ModelOptions::default()).unwrap();
        let mut out = vec![0.0; 512];
        m.forward(&[SeqStep { seq_id: 0, tokens: &[0, 5, 9], start_pos: 0, logits: LogitsMode::Last }], &mut out)
            .unwrap();
        out
    };
    assert_eq!(logits(d.path()), logits(&golden_dir()));

    std::fs::remove_file(d.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("shard") && e.contains("model-00002-of-00002.safetensors") && e.contains("missing"), "{e}");
}

#[test]
fn executor_rejects_bad_steps() {
    let cfg = ModelConfig::from_file(&golden_dir().join("config.json")).unwrap();
    let mut m = Model::load(
        CpuBackend::new(Some(1)).unwrap(),
        &golden_dir(),
        &ModelOptions { ctx: Some(32), ..Default::default() },
    )
    .unwrap();
    let mut out = vec![0.0; cfg.vocab];
    let mut step = |tokens: &[u32], start: u32, out: &mut [f32]| {
        m.forward(&[SeqStep { seq_id: 1, tokens, start_pos: start, logits: LogitsMode::Last }], out)
            .map_err(|e| e.message)
    };
    assert!(step(&[0, 1, 2], 5, &mut out).unwrap_err().contains("past its cached length 0"));
    assert!(step(&[0; 40], 0, &mut out).unwrap_err().contains("exceed the context size 32"));
    assert!(step(&[], 0, &mut out).unwrap_err().contains("no tokens"));
    assert!(step(&[0, 1], 0, &mut out[..3]).unwrap_err().contains("logits buffer holds 3 floats"));
    // Rewinding a sequence past what its sliding window still holds is refused (window 16).
    step(&(0..30).collect::<Vec<u32>>(), 0, &mut out).unwrap();
    assert!(step(&[3], 10, &mut out).unwrap_err().contains("cannot rewind"));
    // Rewinding by one token is fine, and gives the same logits as the first time (up to f32
    // summation order: the first pass ran the prefill GEMM, this one the decode GEMV).
    let before = out.clone();
    step(&[29], 29, &mut out).unwrap();
    let d = before.iter().zip(&out).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(d < 1e-5, "rewound logits differ by {d:e}");
}

/// Every field of config.json set to a wrong value (zero, negative, fractional, huge, another
/// type, absent) is refused with an error naming config.json, or loads and runs one step:
/// never a panic. `SPARK_SHOW_LOADED=1` lists the values that loaded (ignored fields, defaults,
/// values that are valid after all).
#[test]
fn bad_config_values_are_errors_not_panics() {
    let text = std::fs::read_to_string(golden_dir().join("config.json")).unwrap();
    let cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    // Paths to every leaf (object keys and array indices).
    fn leaves(v: &serde_json::Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, c) in m {
                    path.push(k.clone());
                    leaves(c, path, out);
                    path.pop();
                }
            }
            serde_json::Value::Array(a) => {
                for (i, c) in a.iter().enumerate() {
                    path.push(i.to_string());
                    leaves(c, path, out);
                    path.pop();
                }
            }
            _ => out.push(path.clone()),
        }
    }
    let mut paths = Vec::new();
    leaves(&cfg, &mut Vec::new(), &mut paths);
    let bad = [
        serde_json::json!(0),
        serde_json::json!(-1),
        serde_json::json!(3),
        serde_json::json!(0.5),
        serde_json::json!(1e30),
        serde_json::json!(u64::MAX),
        serde_json::json!("x"),
        serde_json::json!(null),
        serde_json::json!([]),
        serde_json::Value::Null, // stands for: the field removed
    ];
    let d = tempfile::tempdir().unwrap();
    std::fs::copy(golden_dir().join("model.safetensors"), d.path().join("model.safetensors")).unwrap();
    let (mut refused, mut loaded, mut wrong) = (0, 0, Vec::new());
    for path in &paths {
        for (i, value) in bad.iter().enumerate() {
            let mut c = cfg.clone();
            let (last, parents) = path.split_last().unwrap();
            let mut node = &mut c;
            for k in parents {
                node = if node.is_array() { &mut node[k.parse::<usize>().unwrap()] } else { &mut node[k.as_str()] };
            }
            let remove = i == bad.len() - 1;
            match node {
                serde_json::Value::Object(m) if remove => {
                    m.remove(last);
                }
                serde_json::Value::Array(a) if remove => {
                    a.remove(last.parse::<usize>().unwrap());
                }
                serde_json::Value::Object(m) => {
                    m.insert(last.clone(), value.clone());
                }
                serde_json::Value::Array(a) => a[last.parse::<usize>().unwrap()] = value.clone(),
                _ => unreachable!(),
            }
            std::fs::write(d.path().join("config.json"), serde_json::to_string(&c).unwrap()).unwrap();
            let what =
                format!("{} = {}", path.join("."), if remove { "(removed)".to_string() } else { value.to_string() });
            let r = std::panic::catch_unwind(|| {
                let mut m = Model::load(CpuBackend::new(Some(1)).unwrap(), d.path(), &ModelOptions::default())?;
                let mut out = vec![0.0; m.info().vocab];
                let step = SeqStep { seq_id: 1, tokens: &[1, 2, 3], start_pos: 0, logits: LogitsMode::Last };
                m.forward(&[step], &mut out)
            });
            match r {
                Ok(Ok(())) => {
                    if std::env::var_os("SPARK_SHOW_LOADED").is_some() {
                        eprintln!("loaded: {what}");
                    }
                    loaded += 1
                }
                Ok(Err(e)) if e.message.contains("config.json") => refused += 1,
                Ok(Err(e)) => wrong.push(format!("{what}: the error does not name config.json: {e}")),
                Err(_) => wrong.push(format!("{what}: loading or running panicked")),
            }
        }
    }
    eprintln!("bad config values: {refused} refused, {loaded} loaded and ran");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Random damage to model.safetensors' header (its length prefix and JSON) never panics: each
/// damaged file is refused with an error naming it (or the checkpoint and the tensor a damaged
/// name no longer matches), or loads and runs one step.
#[test]
fn damaged_safetensors_headers_are_errors_not_panics() {
    let bytes = std::fs::read(golden_dir().join("model.safetensors")).unwrap();
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let d = tempfile::tempdir().unwrap();
    copy_config(d.path());
    let p = d.path().join("model.safetensors");
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    // Bytes that turn JSON into other valid JSON as often as into garbage.
    let alphabet = b"0123456789[]{}\":,.-eE \\FBUI";
    let (mut refused, mut loaded, mut wrong) = (0, 0, Vec::new());
    for case in 0..300 {
        let mut b = bytes.clone();
        for _ in 0..1 + next() % 3 {
            let at = (next() % header_end as u64) as usize;
            b[at] = if next() % 2 == 0 { alphabet[(next() % alphabet.len() as u64) as usize] } else { next() as u8 };
        }
        std::fs::write(&p, &b).unwrap();
        let r = std::panic::catch_unwind(|| {
            let mut m = Model::load(CpuBackend::new(Some(1)).unwrap(), d.path(), &ModelOptions::default())?;
            let mut out = vec![0.0; m.info().vocab];
            let step = SeqStep { seq_id: 1, tokens: &[1, 2, 3], start_pos: 0, logits: LogitsMode::Last };
            m.forward(&[step], &mut out)
        });
        match r {
            Ok(Ok(())) => loaded += 1,
            Ok(Err(e)) if e.message.contains("model.safetensors") => refused += 1,
            Ok(Err(e)) if e.message.contains(&*d.path().to_string_lossy()) && e.message.contains("tensor") => {
                refused += 1
            }
            Ok(Err(e)) => wrong.push(format!("case {case}: the error names neither the file nor a tensor: {e}")),
            Err(_) => wrong.push(format!("case {case}: loading or running panicked")),
        }
    }
    eprintln!("damaged safetensors headers: {refused} refused, {loaded} loaded and ran");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
