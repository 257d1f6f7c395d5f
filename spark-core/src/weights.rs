//! Checkpoint weights: memory-mapped safetensors (one file, or shards listed by
//! `model.safetensors.index.json`) exposed as named, typed tensor views with no copy.
//!
//! [`Checkpoint`] opens and indexes files; [`ModelWeights`] picks the Spark-X2.5 tensors out of it
//! and checks every name and shape against the [`ModelConfig`].

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Bytes of one tensor: a range of a memory-mapped file, or an owned buffer.
#[derive(Clone)]
pub enum TensorBytes {
    Mapped { map: Arc<Mmap>, start: usize, end: usize },
    Owned(Arc<Vec<u8>>),
}

impl TensorBytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped { map, start, end } => &map[*start..*end],
            TensorBytes::Owned(v) => v,
        }
    }
}

/// One named tensor of a checkpoint.
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: TensorBytes,
}

impl Tensor {
    pub fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Build an owned tensor from f32 values, stored as `dtype`.
    pub fn from_f32(name: &str, shape: Vec<usize>, dtype: DType, values: &[f32]) -> Tensor {
        Tensor {
            name: name.to_string(),
            dtype,
            shape,
            data: TensorBytes::Owned(Arc::new(crate::dtype::encode(dtype, values))),
        }
    }
    /// All elements decoded to f32 (a copy).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = Vec::new();
        crate::dtype::decode_into(self.dtype, self.bytes(), &mut v);
        v
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} {:?} {})", self.name, self.shape, self.dtype)
    }
}

/// Every tensor of a checkpoint, by name.
pub struct Checkpoint {
    pub files: Vec<PathBuf>,
    pub tensors: HashMap<String, Tensor>,
    /// Bytes of tensor data across all files.
    pub total_bytes: u64,
}

fn map_file(path: &Path) -> Result<Arc<Mmap>> {
    let file = File::open(path).map_err(|e| Error::model(format!("cannot open {}: {e}", path.display())))?;
    // SAFETY: the file is opened read-only and the map is never written through. Another process
    // truncating the file while it is mapped would make reads fault; that is the usual contract
    // of memory-mapped model files (llama.cpp, safetensors) and is documented for users.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::model(format!("cannot map {}: {e}", path.display())))?;
    Ok(Arc::new(map))
}

fn convert_dtype(d: StDtype, name: &str, path: &Path) -> Result<DType> {
    match d {
        StDtype::F32 => Ok(DType::F32),
        StDtype::BF16 => Ok(DType::BF16),
        StDtype::F16 => Ok(DType::F16),
        other => Err(Error::unsupported(format!(
            "{}: tensor '{name}' has dtype {other:?}; spark reads F32, BF16 and F16 safetensors",
            path.display()
        ))),
    }
}

impl Checkpoint {
    /// Open a checkpoint: a directory holding `model.safetensors` or
    /// `model.safetensors.index.json` (+ shards), or one `.safetensors` file.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let files = if path.is_dir() {
            let index = path.join("model.safetensors.index.json");
            let single = path.join("model.safetensors");
            if index.exists() {
                Self::shards_from_index(&index)?
            } else if single.exists() {
                vec![single]
            } else {
                let mut found: Vec<PathBuf> = std::fs::read_dir(path)?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .collect();
                found.sort();
                if found.is_empty() {
                    return Err(Error::model(format!(
                        "{}: no model.safetensors, model.safetensors.index.json or *.safetensors file",
                        path.display()
                    )));
                }
                found
            }
        } else if path.exists() {
            vec![path.to_path_buf()]
        } else {
            return Err(Error::model(format!("model path does not exist: {}", path.display())));
        };

        let mut tensors = HashMap::new();
        let mut total_bytes = 0u64;
        for file in &files {
            let map = map_file(file)?;
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                Error::model(format!("{}: not a valid safetensors file (truncated or corrupt?): {e}", file.display()))
            })?;
            let base = 8 + header_len;
            for (name, info) in meta.tensors() {
                let dtype = convert_dtype(info.dtype, &name, file)?;
                let (s, e) = info.data_offsets;
                let numel: usize = info.shape.iter().product();
                if e - s != numel * dtype.size() {
                    return Err(Error::model(format!(
                        "{}: tensor '{name}' holds {} bytes but shape {:?} of {dtype} needs {}",
                        file.display(),
                        e - s,
                        info.shape,
                        numel * dtype.size()
                    )));
                }
                total_bytes += (e - s) as u64;
                let t = Tensor {
                    name: name.clone(),
                    dtype,
                    shape: info.shape.clone(),
                    data: TensorBytes::Mapped { map: map.clone(), start: base + s, end: base + e },
                };
                if tensors.insert(name.clone(), t).is_some() {
                    return Err(Error::model(format!(
                        "{}: tensor '{name}' appears in more than one shard",
                        file.display()
                    )));
                }
            }
        }
        Ok(Checkpoint { files, tensors, total_bytes })
    }

    fn shards_from_index(index: &Path) -> Result<Vec<PathBuf>> {
        let text = std::fs::read_to_string(index)
            .map_err(|e| Error::model(format!("cannot read {}: {e}", index.display())))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::model(format!("{}: invalid JSON: {e}", index.display())))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::model(format!("{}: missing 'weight_map' object", index.display())))?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut shards = BTreeMap::new();
        for (tensor, file) in map {
            let f = file.as_str().ok_or_else(|| {
                Error::model(format!("{}: weight_map['{tensor}'] must be a file name", index.display()))
            })?;
            if f.contains('/') || f.contains("..") {
                return Err(Error::model(format!(
                    "{}: weight_map['{tensor}'] = '{f}' is not a plain file name",
                    index.display()
                )));
            }
            shards.insert(f.to_string(), ());
        }
        let files: Vec<PathBuf> = shards.into_keys().map(|f| dir.join(f)).collect();
        for f in &files {
            if !f.exists() {
                return Err(Error::model(format!("{}: shard {} is missing", index.display(), f.display())));
            }
        }
        Ok(files)
    }

    /// A tensor by name, or an error naming it.
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| Error::model(format!("checkpoint has no tensor '{name}'")))
    }
}

/// One decoder layer's weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Tensor,
    pub qkv: Tensor,
    pub gate: Tensor,
    pub out: Tensor,
    pub mlp_norm: Tensor,
    pub mlp_gate: Tensor,
    pub mlp_up: Tensor,
    pub mlp_down: Tensor,
}

/// The Spark-X2.5 tensors, checked against the config.
#[derive(Clone, Debug)]
pub struct ModelWeights {
    pub embedding: Tensor,
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,
    /// Present only for an untied checkpoint (or one that stores `lm_head.weight` anyway).
    pub lm_head: Option<Tensor>,
}

impl ModelWeights {
    /// Pick and validate the model's tensors: every expected tensor present with its exact
    /// shape, nothing unexpected left over.
    pub fn from_checkpoint(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<ModelWeights> {
        let expected = cfg.expected_tensors();
        let mut missing = vec![];
        for (name, shape) in &expected {
            match ckpt.tensors.get(name) {
                None => missing.push(name.clone()),
                Some(t) if &t.shape != shape => {
                    return Err(Error::model(format!(
                        "tensor '{name}' has shape {:?}, but config.json implies {:?}",
                        t.shape, shape
                    )))
                }
                Some(_) => {}
            }
        }
        if !missing.is_empty() {
            let more = if missing.len() > 5 { format!(" and {} more", missing.len() - 5) } else { String::new() };
            return Err(Error::model(format!(
                "checkpoint is missing tensor(s) {}{more}",
                missing.iter().take(5).map(|s| format!("'{s}'")).collect::<Vec<_>>().join(", ")
            )));
        }
        let mut unexpected: Vec<&String> = ckpt
            .tensors
            .keys()
            .filter(|k| !expected.iter().any(|(n, _)| n == *k) && k.as_str() != "lm_head.weight")
            .collect();
        unexpected.sort();
        if let Some(u) = unexpected.first() {
            return Err(Error::model(format!(
                "checkpoint has unexpected tensor '{u}' ({} unexpected in all); is this a Spark-X2.5 checkpoint?",
                unexpected.len()
            )));
        }
        let lm_head = match ckpt.tensors.get("lm_head.weight") {
            Some(t) => {
                let want = vec![cfg.vocab, cfg.hidden];
                if t.shape != want {
                    return Err(Error::model(format!(
                        "tensor 'lm_head.weight' has shape {:?}, but config.json implies {want:?}",
                        t.shape
                    )));
                }
                Some(t.clone())
            }
            None => None,
        };
        let g = |n: String| ckpt.get(&n).cloned();
        let layers = (0..cfg.n_layers)
            .map(|i| {
                let p = format!("model.layers.{i}.");
                Ok(LayerWeights {
                    attn_norm: g(format!("{p}input_layernorm.weight"))?,
                    qkv: g(format!("{p}self_attn.q_k_v_proj.weight"))?,
                    gate: g(format!("{p}self_attn.g_proj.weight"))?,
                    out: g(format!("{p}self_attn.out_proj.weight"))?,
                    mlp_norm: g(format!("{p}post_attention_layernorm.weight"))?,
                    mlp_gate: g(format!("{p}mlp.gate_proj.weight"))?,
                    mlp_up: g(format!("{p}mlp.up_proj.weight"))?,
                    mlp_down: g(format!("{p}mlp.down_proj.weight"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ModelWeights {
            embedding: g("model.embedding.weight".into())?,
            layers,
            norm: g("model.norm.weight".into())?,
            lm_head,
        })
    }

    /// The output head: `lm_head.weight` if present, else the tied embedding.
    pub fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }
}

/// Write tensors as one safetensors file (used by `gen-random` and tests).
pub fn write_safetensors(path: &Path, tensors: &[Tensor]) -> Result<()> {
    use safetensors::tensor::TensorView;
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let dt = match t.dtype {
                DType::F32 => StDtype::F32,
                DType::BF16 => StDtype::BF16,
                DType::F16 => StDtype::F16,
            };
            TensorView::new(dt, t.shape.clone(), t.bytes())
                .map(|v| (t.name.clone(), v))
                .map_err(|e| Error::internal(format!("tensor '{}': {e}", t.name)))
        })
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| Error::new(crate::error::ErrorKind::Io, format!("cannot write {}: {e}", path.display())))
}
