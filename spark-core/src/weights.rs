//! Checkpoint weights: memory-mapped safetensors (one file, or shards listed by
//! `model.safetensors.index.json`) exposed as named, typed tensor views with no copy.
//!
//! [`Checkpoint`] opens and indexes files; [`ModelWeights`] picks the Spark-X2.5 tensors out of it
//! and checks every name and shape against the [`ModelConfig`]; a quantized checkpoint (see
//! [`crate::quant`]) gives [`Weight::Quant`] matrices.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::quant::{QFormat, QTensor};

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

/// An integer tensor of a checkpoint (the values of a quantized matrix).
#[derive(Clone)]
pub struct IntTensor {
    pub name: String,
    /// `true` for I8, `false` for U8.
    pub signed: bool,
    pub shape: Vec<usize>,
    pub data: TensorBytes,
}

/// A matrix weight: floats, or quantized.
#[derive(Clone, Debug)]
pub enum Weight {
    Float(Tensor),
    Quant(QTensor),
}

impl Weight {
    pub fn name(&self) -> &str {
        match self {
            Weight::Float(t) => &t.name,
            Weight::Quant(q) => &q.name,
        }
    }
    /// `[rows, cols]` (or the float tensor's shape).
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Weight::Float(t) => t.shape.clone(),
            Weight::Quant(q) => vec![q.rows, q.cols],
        }
    }
    /// Bytes the weight occupies as stored.
    pub fn nbytes(&self) -> usize {
        match self {
            Weight::Float(t) => t.bytes().len(),
            Weight::Quant(q) => q.nbytes(),
        }
    }
    /// The float tensor, dequantizing a quantized weight into `dtype`.
    pub fn to_float(&self, dtype: DType) -> Tensor {
        match self {
            Weight::Float(t) => t.clone(),
            Weight::Quant(q) => q.to_tensor(dtype),
        }
    }
}

/// Every tensor of a checkpoint, by name.
pub struct Checkpoint {
    pub files: Vec<PathBuf>,
    pub tensors: HashMap<String, Tensor>,
    /// I8 / U8 tensors (quantized values), by name.
    pub ints: HashMap<String, IntTensor>,
    /// Bytes of tensor data across all files.
    pub total_bytes: u64,
}

fn map_file(path: &Path) -> Result<Arc<Mmap>> {
    let file = File::open(path).map_err(|e| Error::model(format!("cannot open {}: {e}", path.display())))?;
    // SAFETY: the file is opened read-only and the map is never written through. Another process
    // truncating the file while it is mapped would make reads fault; that is the usual contract
    // of memory-mapped model files (llama.cpp, safetensors) and is documented for users.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::model(format!("cannot map {}: {e}", path.display())))?;
    crate::memory::advise_huge_pages(&map);
    Ok(Arc::new(map))
}

/// A stored element type: a float [`DType`], or a byte of a quantized matrix.
enum Stored {
    Float(DType),
    Int { signed: bool },
}

fn convert_dtype(d: StDtype, name: &str, path: &Path) -> Result<Stored> {
    match d {
        StDtype::F32 => Ok(Stored::Float(DType::F32)),
        StDtype::BF16 => Ok(Stored::Float(DType::BF16)),
        StDtype::F16 => Ok(Stored::Float(DType::F16)),
        StDtype::I8 => Ok(Stored::Int { signed: true }),
        StDtype::U8 => Ok(Stored::Int { signed: false }),
        other => Err(Error::unsupported(format!(
            "{}: tensor '{name}' has dtype {other:?}; spark reads F32, BF16, F16 (and I8/U8 quantized values) safetensors",
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
        let mut ints = HashMap::new();
        let mut total_bytes = 0u64;
        for file in &files {
            let map = map_file(file)?;
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
                Error::model(format!("{}: not a valid safetensors file (truncated or corrupt?): {e}", file.display()))
            })?;
            let base = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                let numel: usize = info.shape.iter().product();
                let dtype = match convert_dtype(info.dtype, &name, file)? {
                    Stored::Float(d) => d,
                    Stored::Int { signed } => {
                        if e - s != numel {
                            return Err(Error::model(format!(
                                "{}: tensor '{name}' holds {} bytes but shape {:?} of bytes needs {numel}",
                                file.display(),
                                e - s,
                                info.shape
                            )));
                        }
                        total_bytes += (e - s) as u64;
                        let t = IntTensor {
                            name: name.clone(),
                            signed,
                            shape: info.shape.clone(),
                            data: TensorBytes::Mapped { map: map.clone(), start: base + s, end: base + e },
                        };
                        if tensors.contains_key(&name) || ints.insert(name.clone(), t).is_some() {
                            return Err(Error::model(format!(
                                "{}: tensor '{name}' appears in more than one shard",
                                file.display()
                            )));
                        }
                        continue;
                    }
                };
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
                if ints.contains_key(&name) || tensors.insert(name.clone(), t).is_some() {
                    return Err(Error::model(format!(
                        "{}: tensor '{name}' appears in more than one shard",
                        file.display()
                    )));
                }
            }
        }
        Ok(Checkpoint { files, tensors, ints, total_bytes })
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

    /// Whether `name` is stored (as floats or as quantized values).
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.ints.contains_key(name)
    }

    /// The `[rows, cols]` matrix `name`: floats, or quantized values with their `NAME_scale`
    /// (and optional `NAME_bias`) tensors. Shapes are checked against `shape`.
    pub fn matrix(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        if let Some(t) = self.tensors.get(name) {
            if t.shape != shape {
                return Err(Error::model(format!(
                    "tensor '{name}' has shape {:?}, but config.json implies {shape:?}",
                    t.shape
                )));
            }
            return Ok(Weight::Float(t.clone()));
        }
        let Some(it) = self.ints.get(name) else {
            return Err(Error::model(format!("checkpoint has no tensor '{name}'")));
        };
        let [rows, cols] = *shape else {
            return Err(Error::model(format!("tensor '{name}' is quantized but is not a matrix ({shape:?})")));
        };
        // I8: int8; U8: packed int4 (`cols / 2` bytes per row) or int6 (`3 cols / 4`).
        let i6 = QFormat::I6.row_bytes(cols);
        let (format, want) = if it.signed {
            (QFormat::I8, vec![rows, cols])
        } else if it.shape == [rows, i6] && cols.is_multiple_of(4) {
            (QFormat::I6, vec![rows, i6])
        } else {
            (QFormat::I4, vec![rows, cols / 2])
        };
        if it.shape != want {
            return Err(Error::model(format!(
                "quantized tensor '{name}' ({}) has shape {:?}; a [{rows}, {cols}] matrix needs {want:?}",
                if it.signed {
                    "I8 = int8".to_string()
                } else {
                    format!("U8 = packed int4, or int6 as [{rows}, {i6}]")
                },
                it.shape
            )));
        }
        let f32_of = |suffix: &str| -> Result<Option<(Vec<usize>, Vec<f32>)>> {
            let n = format!("{name}_{suffix}");
            match self.tensors.get(&n) {
                None => Ok(None),
                Some(t) if t.dtype == DType::BF16 => {
                    Err(Error::model(format!("tensor '{n}' is BF16; quantization scales must be F32 or F16")))
                }
                // F16 values are exact in f32 (the kernels get them back as f16).
                Some(t) => Ok(Some((t.shape.clone(), t.to_f32()))),
            }
        };
        let (sshape, scales) =
            f32_of("scale")?.ok_or_else(|| Error::model(format!("quantized tensor '{name}' has no '{name}_scale'")))?;
        let ng = match sshape.as_slice() {
            [r, g] if *r == rows && *g > 0 && cols.is_multiple_of(*g) => *g,
            _ => {
                return Err(Error::model(format!(
                    "tensor '{name}_scale' has shape {sshape:?}; expected [{rows}, G] with G dividing {cols}"
                )))
            }
        };
        let bias = match f32_of("bias")? {
            None => None,
            Some((bshape, b)) if bshape == sshape => Some(Arc::new(b)),
            Some((bshape, _)) => {
                return Err(Error::model(format!(
                    "tensor '{name}_bias' has shape {bshape:?}; expected {sshape:?} like its scales"
                )))
            }
        };
        let q = QTensor {
            name: name.to_string(),
            format,
            rows,
            cols,
            group: cols / ng,
            q: it.data.clone(),
            scales: Arc::new(scales),
            bias,
        };
        q.validate()?;
        Ok(Weight::Quant(q))
    }
}

/// One decoder layer's weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Tensor,
    pub qkv: Weight,
    pub gate: Weight,
    pub out: Weight,
    pub mlp_norm: Tensor,
    pub mlp_gate: Weight,
    pub mlp_up: Weight,
    pub mlp_down: Weight,
}

impl LayerWeights {
    /// The matrices with their checkpoint names' short forms.
    pub fn matrices(&self) -> [(&'static str, &Weight); 6] {
        [
            ("q_k_v_proj", &self.qkv),
            ("g_proj", &self.gate),
            ("out_proj", &self.out),
            ("gate_proj", &self.mlp_gate),
            ("up_proj", &self.mlp_up),
            ("down_proj", &self.mlp_down),
        ]
    }
}

/// The Spark-X2.5 tensors, checked against the config.
#[derive(Clone, Debug)]
pub struct ModelWeights {
    pub embedding: Weight,
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,
    /// Present only for an untied checkpoint (or one that stores `lm_head.weight` anyway).
    pub lm_head: Option<Weight>,
    /// The default compute type where the stored floats do not say it ([`Self::float_dtype`]):
    /// a quantized GGUF file stores its norms in F32 by llama.cpp's convention, not because the
    /// model computes in f32 (the reference computes in bf16).
    pub compute: Option<DType>,
}

impl ModelWeights {
    /// Pick and validate the model's tensors: every expected tensor present with its exact
    /// shape (matrices may be quantized), nothing unexpected left over.
    pub fn from_checkpoint(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<ModelWeights> {
        let expected = cfg.expected_tensors();
        let shape_of: HashMap<&str, &Vec<usize>> = expected.iter().map(|(n, s)| (n.as_str(), s)).collect();
        let missing: Vec<&String> = expected.iter().map(|(n, _)| n).filter(|n| !ckpt.has(n)).collect();
        if !missing.is_empty() {
            let more = if missing.len() > 5 { format!(" and {} more", missing.len() - 5) } else { String::new() };
            return Err(Error::model(format!(
                "checkpoint is missing tensor(s) {}{more}",
                missing.iter().take(5).map(|s| format!("'{s}'")).collect::<Vec<_>>().join(", ")
            )));
        }
        let known = |k: &str| {
            let base = k.strip_suffix("_scale").or_else(|| k.strip_suffix("_bias"));
            shape_of.contains_key(k)
                || k == "lm_head.weight"
                || base
                    .is_some_and(|b| ckpt.ints.contains_key(b) && (shape_of.contains_key(b) || b == "lm_head.weight"))
        };
        let mut unexpected: Vec<&String> =
            ckpt.tensors.keys().chain(ckpt.ints.keys()).filter(|k| !known(k.as_str())).collect();
        unexpected.sort();
        if let Some(u) = unexpected.first() {
            return Err(Error::model(format!(
                "checkpoint has unexpected tensor '{u}' ({} unexpected in all); is this a Spark-X2.5 checkpoint?",
                unexpected.len()
            )));
        }
        let norm_of = |n: &str| -> Result<Tensor> {
            let t = ckpt.get(n)?;
            let want = shape_of[n];
            if &t.shape != want {
                return Err(Error::model(format!(
                    "tensor '{n}' has shape {:?}, but config.json implies {want:?}",
                    t.shape
                )));
            }
            Ok(t.clone())
        };
        let mat = |n: &str| ckpt.matrix(n, shape_of[n]);
        let lm_head = if ckpt.has("lm_head.weight") {
            Some(ckpt.matrix("lm_head.weight", &[cfg.vocab, cfg.hidden])?)
        } else {
            None
        };
        let layers = (0..cfg.n_layers)
            .map(|i| {
                let p = format!("model.layers.{i}.");
                Ok(LayerWeights {
                    attn_norm: norm_of(&format!("{p}input_layernorm.weight"))?,
                    qkv: mat(&format!("{p}self_attn.q_k_v_proj.weight"))?,
                    gate: mat(&format!("{p}self_attn.g_proj.weight"))?,
                    out: mat(&format!("{p}self_attn.out_proj.weight"))?,
                    mlp_norm: norm_of(&format!("{p}post_attention_layernorm.weight"))?,
                    mlp_gate: mat(&format!("{p}mlp.gate_proj.weight"))?,
                    mlp_up: mat(&format!("{p}mlp.up_proj.weight"))?,
                    mlp_down: mat(&format!("{p}mlp.down_proj.weight"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ModelWeights {
            embedding: mat("model.embedding.weight")?,
            layers,
            norm: norm_of("model.norm.weight")?,
            lm_head,
            compute: None,
        })
    }

    /// The output head: `lm_head.weight` if present, else the tied embedding.
    pub fn head(&self) -> &Weight {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    /// The default compute type: [`Self::compute`] if set, else the float type the checkpoint
    /// stores its (unquantized) tensors in.
    pub fn float_dtype(&self) -> DType {
        if let Some(d) = self.compute {
            return d;
        }
        match &self.embedding {
            Weight::Float(t) => t.dtype,
            Weight::Quant(_) => self.norm.dtype,
        }
    }

    /// Every tensor in checkpoint order with its checkpoint name (for writers).
    pub fn named(&self) -> Vec<(String, NamedRef<'_>)> {
        let mut v = vec![("model.embedding.weight".to_string(), NamedRef::W(&self.embedding))];
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}.");
            v.push((format!("{p}input_layernorm.weight"), NamedRef::T(&l.attn_norm)));
            v.push((format!("{p}self_attn.q_k_v_proj.weight"), NamedRef::W(&l.qkv)));
            v.push((format!("{p}self_attn.g_proj.weight"), NamedRef::W(&l.gate)));
            v.push((format!("{p}self_attn.out_proj.weight"), NamedRef::W(&l.out)));
            v.push((format!("{p}post_attention_layernorm.weight"), NamedRef::T(&l.mlp_norm)));
            v.push((format!("{p}mlp.gate_proj.weight"), NamedRef::W(&l.mlp_gate)));
            v.push((format!("{p}mlp.up_proj.weight"), NamedRef::W(&l.mlp_up)));
            v.push((format!("{p}mlp.down_proj.weight"), NamedRef::W(&l.mlp_down)));
        }
        v.push(("model.norm.weight".to_string(), NamedRef::T(&self.norm)));
        if let Some(h) = &self.lm_head {
            v.push(("lm_head.weight".to_string(), NamedRef::W(h)));
        }
        v
    }

    /// Bytes of all weights as stored.
    pub fn nbytes(&self) -> usize {
        self.named()
            .iter()
            .map(|(_, r)| match r {
                NamedRef::T(t) => t.bytes().len(),
                NamedRef::W(w) => w.nbytes(),
            })
            .sum()
    }
}

/// A tensor of [`ModelWeights::named`]: a plain tensor or a matrix weight.
pub enum NamedRef<'a> {
    T(&'a Tensor),
    W(&'a Weight),
}

/// Write tensors as one safetensors file (used by `gen-random` and tests).
pub fn write_safetensors(path: &Path, tensors: &[Tensor]) -> Result<()> {
    let w: Vec<Weight> = tensors.iter().map(|t| Weight::Float(t.clone())).collect();
    write_weights(path, &w, None)
}

/// Write float and quantized weights as one safetensors file: a quantized matrix becomes its
/// values (`NAME`, I8 or U8), `NAME_scale` and, if present, `NAME_bias` (F16 when every one is
/// exactly an f16 value and there are several per row, [`QTensor::half_sides`]; else F32).
/// `metadata` goes into the header's `__metadata__`.
pub fn write_weights(path: &Path, weights: &[Weight], metadata: Option<HashMap<String, String>>) -> Result<()> {
    use safetensors::tensor::TensorView;
    let side_bytes = |v: &[f32], half: bool| -> Vec<u8> {
        if half {
            v.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect()
        } else {
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        }
    };
    // Scale/bias bytes must outlive the views.
    let mut extra: Vec<(String, Vec<usize>, StDtype, Vec<u8>)> = vec![];
    for w in weights {
        if let Weight::Quant(q) = w {
            let shape = vec![q.rows, q.groups_per_row()];
            let half = q.half_sides();
            let dt = if half { StDtype::F16 } else { StDtype::F32 };
            extra.push((format!("{}_scale", q.name), shape.clone(), dt, side_bytes(&q.scales, half)));
            if let Some(b) = &q.bias {
                extra.push((format!("{}_bias", q.name), shape, dt, side_bytes(b, half)));
            }
        }
    }
    let mut views: Vec<(String, TensorView<'_>)> = vec![];
    let err = |n: &str, e: safetensors::SafeTensorError| Error::internal(format!("tensor '{n}': {e}"));
    for w in weights {
        let (name, view) = match w {
            Weight::Float(t) => {
                let dt = match t.dtype {
                    DType::F32 => StDtype::F32,
                    DType::BF16 => StDtype::BF16,
                    DType::F16 => StDtype::F16,
                };
                (&t.name, TensorView::new(dt, t.shape.clone(), t.bytes()).map_err(|e| err(&t.name, e))?)
            }
            Weight::Quant(q) => {
                let (dt, shape) = match q.format {
                    QFormat::I8 => (StDtype::I8, vec![q.rows, q.cols]),
                    QFormat::I4 | QFormat::I6 => (StDtype::U8, vec![q.rows, q.format.row_bytes(q.cols)]),
                };
                (&q.name, TensorView::new(dt, shape, q.q.as_slice()).map_err(|e| err(&q.name, e))?)
            }
        };
        views.push((name.clone(), view));
    }
    for (n, shape, dt, bytes) in &extra {
        views.push((n.clone(), TensorView::new(*dt, shape.clone(), bytes).map_err(|e| err(n, e))?));
    }
    safetensors::serialize_to_file(views, metadata, path)
        .map_err(|e| Error::new(crate::error::ErrorKind::Io, format!("cannot write {}: {e}", path.display())))
}
