//! `config.json` -> [`ModelConfig`]: parsed, validated, with errors that name the field and value.
//!
//! Follows SPARK.md section 1: explicit `head_dim`, `layer_types`, RoPE parameters per layer type
//! from `rope_parameters`, the head-wise output gate. Anything this engine does not implement is
//! refused here rather than computed wrongly later.

use std::path::Path;

use serde_json::{Map, Value};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// The two kinds of decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerType {
    /// Attends to the `sliding_window` most recent positions, itself included.
    Sliding,
    /// Causal attention over the whole context.
    Full,
}

impl LayerType {
    /// The name used in `layer_types` and `rope_parameters`.
    pub fn name(self) -> &'static str {
        match self {
            LayerType::Sliding => "sliding_attention",
            LayerType::Full => "full_attention",
        }
    }
    /// Index into per-type tables (sliding 0, full 1).
    pub fn index(self) -> usize {
        match self {
            LayerType::Sliding => 0,
            LayerType::Full => 1,
        }
    }
}

/// RoPE parameters of one layer type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    pub theta: f64,
    /// Rotary dimensions per head: `head_dim * partial_rotary_factor`.
    pub rot_dims: usize,
}

/// Activation applied to the head-wise output gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateAct {
    Sigmoid,
    Silu,
}

/// A validated Spark-X2.5 configuration.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub hidden: usize,
    pub intermediate: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub layer_types: Vec<LayerType>,
    pub sliding_window: usize,
    /// Indexed by [`LayerType::index`].
    pub rope: [RopeParams; 2],
    pub rms_eps: f32,
    pub gate_act: GateAct,
    pub tie_embeddings: bool,
    pub bos: u32,
    pub eos: Vec<u32>,
    pub pad: Option<u32>,
    pub max_positions: usize,
    /// The checkpoint's declared dtype (`dtype` or `torch_dtype`).
    pub dtype: DType,
}

fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Result<&'a Value> {
    obj.get(name).ok_or_else(|| Error::model(format!("config.json: missing field '{name}'")))
}

fn usize_field(obj: &Map<String, Value>, name: &str) -> Result<usize> {
    let v = field(obj, name)?;
    v.as_u64()
        .map(|x| x as usize)
        .ok_or_else(|| Error::model(format!("config.json: field '{name}' must be a non-negative integer, got {v}")))
}

fn opt_usize(obj: &Map<String, Value>, name: &str) -> Result<Option<usize>> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => usize_field(obj, name).map(Some),
    }
}

fn opt_f64(obj: &Map<String, Value>, name: &str, ctx: &str) -> Result<Option<f64>> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| Error::model(format!("config.json: field '{ctx}{name}' must be a number, got {v}"))),
    }
}

fn opt_bool(obj: &Map<String, Value>, name: &str) -> Result<Option<bool>> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(Error::model(format!("config.json: field '{name}' must be true or false, got {v}"))),
    }
}

fn opt_str<'a>(obj: &'a Map<String, Value>, name: &str) -> Result<Option<&'a str>> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(Error::model(format!("config.json: field '{name}' must be a string, got {v}"))),
    }
}

fn token_ids(obj: &Map<String, Value>, name: &str) -> Result<Vec<u32>> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|x| x as u32)
                    .ok_or_else(|| Error::model(format!("config.json: '{name}' must hold token ids, got {v}")))
            })
            .collect(),
        Some(v) => v
            .as_u64()
            .map(|x| vec![x as u32])
            .ok_or_else(|| Error::model(format!("config.json: '{name}' must be a token id, got {v}"))),
    }
}

/// The most values one matrix of a checkpoint may have (2^40: 2 TB of bf16); larger products
/// of config sizes are refused before anything is allocated.
const MAX_ELEMENTS: usize = 1 << 40;

impl ModelConfig {
    /// Read and validate `config.json` at `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::model(format!("cannot read {}: {e}", path.display())))?;
        Self::from_json_str(&text).map_err(|e| Error::new(e.kind, format!("{}: {}", path.display(), e.message)))
    }

    /// Parse and validate the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::model(format!("config.json is not valid JSON: {e}")))?;
        let obj = v.as_object().ok_or_else(|| Error::model("config.json: the top level must be an object"))?;
        Self::from_json(obj)
    }

    /// Validate a parsed `config.json` object.
    pub fn from_json(obj: &Map<String, Value>) -> Result<Self> {
        if let Some(mt) = opt_str(obj, "model_type")? {
            if mt != "spark2_5" {
                return Err(Error::unsupported(format!(
                    "config.json: model_type '{mt}' is not supported (expected 'spark2_5')"
                )));
            }
        }
        if let Some(q) = obj.get("quantization_config").filter(|v| !v.is_null()) {
            let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("?");
            if method != "spark" {
                return Err(Error::unsupported(format!(
                    "config.json: quantization_config.quant_method '{method}' is not supported (spark reads its own \
                     int8/int4 checkpoints written by `spark-run quantize`, and GGUF files)"
                )));
            }
        }
        let hidden = usize_field(obj, "hidden_size")?;
        let intermediate = usize_field(obj, "intermediate_size")?;
        let n_layers = usize_field(obj, "num_hidden_layers")?;
        let n_heads = usize_field(obj, "num_attention_heads")?;
        let n_kv_heads = opt_usize(obj, "num_key_value_heads")?.unwrap_or(n_heads);
        let vocab = usize_field(obj, "vocab_size")?;
        for (name, val) in [
            ("hidden_size", hidden),
            ("intermediate_size", intermediate),
            ("num_hidden_layers", n_layers),
            ("num_attention_heads", n_heads),
            ("num_key_value_heads", n_kv_heads),
            ("vocab_size", vocab),
        ] {
            if val == 0 {
                return Err(Error::model(format!("config.json: '{name}' must be > 0, got 0")));
            }
        }
        if n_heads % n_kv_heads != 0 {
            return Err(Error::model(format!(
                "config.json: num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv_heads})"
            )));
        }
        let head_dim = match opt_usize(obj, "head_dim")? {
            Some(d) => d,
            None => {
                if hidden % n_heads != 0 {
                    return Err(Error::model(format!(
                        "config.json: no 'head_dim' and hidden_size {hidden} is not a multiple of num_attention_heads {n_heads}"
                    )));
                }
                hidden / n_heads
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(Error::model(format!("config.json: 'head_dim' must be even and > 0, got {head_dim}")));
        }

        let act = opt_str(obj, "hidden_act")?.unwrap_or("gelu");
        if act != "gelu" {
            return Err(Error::unsupported(format!(
                "config.json: hidden_act '{act}' is not supported (Spark-X2.5 uses 'gelu', the exact erf form)"
            )));
        }
        for name in ["attention_bias", "mlp_bias"] {
            if opt_bool(obj, name)? == Some(true) {
                return Err(Error::unsupported(format!(
                    "config.json: {name} = true is not supported (Spark-X2.5 has no biases)"
                )));
            }
        }
        if opt_bool(obj, "headwise_attn_output_gate")? == Some(false) {
            return Err(Error::unsupported(
                "config.json: headwise_attn_output_gate = false is not supported (Spark-X2.5 gates every head)",
            ));
        }
        let gate_act = match opt_str(obj, "gate_attn_act_mode")?.unwrap_or("sigmoid") {
            "sigmoid" => GateAct::Sigmoid,
            "silu" => GateAct::Silu,
            other => {
                return Err(Error::unsupported(format!(
                    "config.json: gate_attn_act_mode '{other}' is not supported (expected 'sigmoid' or 'silu')"
                )))
            }
        };

        let layer_types = match obj.get("layer_types") {
            None | Some(Value::Null) => {
                (0..n_layers).map(|i| if i % 4 == 3 { LayerType::Full } else { LayerType::Sliding }).collect::<Vec<_>>()
            }
            Some(Value::Array(a)) => {
                if a.len() != n_layers {
                    return Err(Error::model(format!(
                        "config.json: layer_types has {} entries but num_hidden_layers is {n_layers}",
                        a.len()
                    )));
                }
                a.iter()
                    .enumerate()
                    .map(|(i, t)| match t.as_str() {
                        Some("sliding_attention") => Ok(LayerType::Sliding),
                        Some("full_attention") => Ok(LayerType::Full),
                        _ => Err(Error::unsupported(format!(
                            "config.json: layer_types[{i}] = {t} is not supported (expected \"sliding_attention\" or \"full_attention\")"
                        ))),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            Some(v) => return Err(Error::model(format!("config.json: layer_types must be a list, got {v}"))),
        };
        let any_sliding = layer_types.contains(&LayerType::Sliding);
        let sliding_window = opt_usize(obj, "sliding_window")?.unwrap_or(0);
        if any_sliding && sliding_window == 0 {
            return Err(Error::model(
                "config.json: sliding_window must be > 0 when layer_types has sliding_attention layers",
            ));
        }

        let rope = Self::parse_rope(obj, head_dim)?;

        let rms_eps = opt_f64(obj, "rms_norm_eps", "")?.unwrap_or(1e-6);
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(Error::model(format!("config.json: rms_norm_eps must be in (0, 1), got {rms_eps}")));
        }
        let tie_embeddings = opt_bool(obj, "tie_word_embeddings")?.unwrap_or(true);
        let bos = token_ids(obj, "bos_token_id")?.first().copied().unwrap_or(0);
        let mut eos = token_ids(obj, "eos_token_id")?;
        if eos.is_empty() {
            eos.push(1);
        }
        let pad = token_ids(obj, "pad_token_id")?.first().copied();
        for (name, id) in std::iter::once(("bos_token_id", bos)).chain(eos.iter().map(|&e| ("eos_token_id", e))) {
            if id as usize >= vocab {
                return Err(Error::model(format!(
                    "config.json: {name} {id} is outside the vocabulary (vocab_size {vocab})"
                )));
            }
        }
        let max_positions = opt_usize(obj, "max_position_embeddings")?.unwrap_or(1 << 20);
        if max_positions == 0 {
            return Err(Error::model("config.json: 'max_position_embeddings' must be > 0, got 0"));
        }
        let dtype_name = opt_str(obj, "dtype")?.or(opt_str(obj, "torch_dtype")?).unwrap_or("bfloat16");
        let dtype = DType::parse(dtype_name).map_err(|_| {
            Error::unsupported(format!(
                "config.json: dtype '{dtype_name}' is not supported (expected float32, bfloat16 or float16)"
            ))
        })?;

        // Sizes whose products index the weights and activations: each product must fit (a
        // wrapped one would make a nonsense shape, named in no message).
        for (what, a, b) in [
            (
                "num_attention_heads + 2 * num_key_value_heads, times head_dim",
                n_heads.checked_add(n_kv_heads.saturating_mul(2)),
                Some(head_dim),
            ),
            ("vocab_size times hidden_size", Some(vocab), Some(hidden)),
            ("intermediate_size times hidden_size", Some(intermediate), Some(hidden)),
            ("num_attention_heads times head_dim, times hidden_size", n_heads.checked_mul(head_dim), Some(hidden)),
        ] {
            if a.zip(b).and_then(|(a, b)| a.checked_mul(b)).is_none_or(|p| p > MAX_ELEMENTS) {
                return Err(Error::model(format!(
                    "config.json: {what} is beyond any checkpoint spark can hold (more than 2^40 values)"
                )));
            }
        }
        Ok(ModelConfig {
            hidden,
            intermediate,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            layer_types,
            sliding_window,
            rope,
            rms_eps: rms_eps as f32,
            gate_act,
            tie_embeddings,
            bos,
            eos,
            pad,
            max_positions,
            dtype,
        })
    }

    fn parse_rope(obj: &Map<String, Value>, head_dim: usize) -> Result<[RopeParams; 2]> {
        let legacy_theta = opt_f64(obj, "rope_theta", "")?;
        let legacy_factor = opt_f64(obj, "partial_rotary_factor", "")?;
        let default = |theta: Option<f64>, factor: Option<f64>| (theta.unwrap_or(10000.0), factor.unwrap_or(1.0));
        let mut per_type = [default(legacy_theta, legacy_factor); 2];
        match obj.get("rope_parameters").or(obj.get("rope_scaling")) {
            None | Some(Value::Null) => {}
            Some(Value::Object(rp)) => {
                let is_flat = rp.contains_key("rope_theta") || rp.contains_key("rope_type");
                let entries: Vec<(usize, String, &Map<String, Value>)> = if is_flat {
                    vec![(0, String::new(), rp), (1, String::new(), rp)]
                } else {
                    let mut v = vec![];
                    for (k, val) in rp {
                        let idx = match k.as_str() {
                            "sliding_attention" => 0,
                            "full_attention" => 1,
                            _ => {
                                return Err(Error::unsupported(format!(
                                    "config.json: rope_parameters has an entry for unknown layer type '{k}'"
                                )))
                            }
                        };
                        let m = val.as_object().ok_or_else(|| {
                            Error::model(format!("config.json: rope_parameters.{k} must be an object, got {val}"))
                        })?;
                        v.push((idx, format!("{k}."), m));
                    }
                    v
                };
                for (idx, prefix, m) in entries {
                    let ctx = format!("rope_parameters.{prefix}");
                    if let Some(t) = m.get("rope_type").and_then(|t| t.as_str()) {
                        if t != "default" {
                            return Err(Error::unsupported(format!(
                                "config.json: {ctx}rope_type '{t}' is not supported (only 'default')"
                            )));
                        }
                    }
                    let theta = opt_f64(m, "rope_theta", &ctx)?.or(legacy_theta);
                    let factor = opt_f64(m, "partial_rotary_factor", &ctx)?.or(legacy_factor);
                    per_type[idx] = default(theta, factor);
                }
            }
            Some(v) => return Err(Error::model(format!("config.json: rope_parameters must be an object, got {v}"))),
        }
        let mut out = [RopeParams { theta: 0.0, rot_dims: 0 }; 2];
        for (i, (theta, factor)) in per_type.into_iter().enumerate() {
            let name = if i == 0 { "sliding_attention" } else { "full_attention" };
            if theta.is_nan() || theta <= 0.0 {
                return Err(Error::model(format!(
                    "config.json: rope_parameters.{name}.rope_theta must be > 0, got {theta}"
                )));
            }
            let rot = (head_dim as f64 * factor) as usize;
            if !(factor > 0.0 && factor <= 1.0) || rot == 0 || !rot.is_multiple_of(2) {
                return Err(Error::model(format!(
                    "config.json: rope_parameters.{name}.partial_rotary_factor {factor} gives {rot} rotary dims of head_dim {head_dim}; it must give an even number in 2..={head_dim}"
                )));
            }
            out[i] = RopeParams { theta, rot_dims: rot };
        }
        Ok(out)
    }

    /// Width of the fused Q|K|V projection output.
    pub fn qkv_dim(&self) -> usize {
        (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
    }
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    pub fn rope_for(&self, t: LayerType) -> RopeParams {
        self.rope[t.index()]
    }
    /// Layers of a type.
    pub fn count_layers(&self, t: LayerType) -> usize {
        self.layer_types.iter().filter(|&&l| l == t).count()
    }

    /// The expected shape of every checkpoint tensor, in checkpoint order.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden;
        let mut v = vec![("model.embedding.weight".to_string(), vec![self.vocab, h])];
        for i in 0..self.n_layers {
            let p = format!("model.layers.{i}.");
            v.push((format!("{p}input_layernorm.weight"), vec![h]));
            v.push((format!("{p}self_attn.q_k_v_proj.weight"), vec![self.qkv_dim(), h]));
            v.push((format!("{p}self_attn.g_proj.weight"), vec![self.n_heads, h]));
            v.push((format!("{p}self_attn.out_proj.weight"), vec![h, self.q_dim()]));
            v.push((format!("{p}post_attention_layernorm.weight"), vec![h]));
            v.push((format!("{p}mlp.gate_proj.weight"), vec![self.intermediate, h]));
            v.push((format!("{p}mlp.up_proj.weight"), vec![self.intermediate, h]));
            v.push((format!("{p}mlp.down_proj.weight"), vec![h, self.intermediate]));
        }
        v.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_embeddings {
            v.push(("lm_head.weight".to_string(), vec![self.vocab, h]));
        }
        v
    }

    /// Number of parameters (tied head counted once).
    pub fn param_count(&self) -> u64 {
        self.expected_tensors().iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum()
    }

    /// KV bytes per token of one layer at `bytes_per_elem` (K and V).
    pub fn kv_bytes_per_token_per_layer(&self, bytes_per_elem: usize) -> usize {
        2 * self.kv_dim() * bytes_per_elem
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        serde_json::json!({
            "model_type": "spark2_5", "hidden_size": 128, "intermediate_size": 384,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "vocab_size": 512, "sliding_window": 16, "hidden_act": "gelu",
            "layer_types": ["sliding_attention","sliding_attention","sliding_attention","full_attention"],
            "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 5000000},
                                 "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000}},
            "dtype": "float32"
        })
    }
    fn parse(v: &Value) -> Result<ModelConfig> {
        ModelConfig::from_json(v.as_object().unwrap())
    }
    fn err_with(mut f: impl FnMut(&mut Map<String, Value>)) -> String {
        let mut v = base();
        f(v.as_object_mut().unwrap());
        parse(&v).unwrap_err().message
    }

    /// Sizes whose products wrap around (or exceed 2^40 values) are refused, naming them.
    #[test]
    fn huge_sizes_are_refused_before_their_products_wrap() {
        let e = err_with(|o| {
            o.insert("num_attention_heads".into(), serde_json::json!(1u64 << 62));
            o.insert("num_key_value_heads".into(), serde_json::json!(1u64 << 62));
        });
        assert!(e.contains("num_attention_heads + 2 * num_key_value_heads, times head_dim"), "{e}");
        let e = err_with(|o| {
            o.insert("head_dim".into(), serde_json::json!(1u64 << 62));
        });
        assert!(e.contains("times head_dim"), "{e}");
        let e = err_with(|o| {
            o.insert("vocab_size".into(), serde_json::json!(1u64 << 40));
        });
        assert!(e.contains("vocab_size times hidden_size"), "{e}");
        let e = err_with(|o| {
            o.insert("intermediate_size".into(), serde_json::json!(1u64 << 39));
        });
        assert!(e.contains("intermediate_size times hidden_size"), "{e}");
    }

    #[test]
    fn parses_per_type_rope() {
        let c = parse(&base()).unwrap();
        assert_eq!(c.rope_for(LayerType::Sliding).rot_dims, 64);
        assert_eq!(c.rope_for(LayerType::Full).rot_dims, 16);
        assert_eq!(c.rope_for(LayerType::Full).theta, 5e6);
        assert_eq!(c.layer_types[3], LayerType::Full);
        assert_eq!(c.qkv_dim(), 512);
    }

    #[test]
    fn missing_rope_type_defaults() {
        let mut v = base();
        v["rope_parameters"].as_object_mut().unwrap().remove("full_attention");
        let c = parse(&v).unwrap();
        assert_eq!(c.rope_for(LayerType::Full), RopeParams { theta: 10000.0, rot_dims: 64 });
    }

    #[test]
    fn errors_name_field_and_value() {
        assert!(err_with(|o| {
            o.insert("hidden_act".into(), "silu".into());
        })
        .contains("hidden_act 'silu'"));
        assert!(err_with(|o| {
            o.insert("attention_bias".into(), true.into());
        })
        .contains("attention_bias"));
        assert!(err_with(|o| {
            o.remove("hidden_size");
        })
        .contains("'hidden_size'"));
        assert!(err_with(|o| {
            o.insert("num_key_value_heads".into(), 3.into());
        })
        .contains("num_key_value_heads (3)"));
        assert!(err_with(|o| {
            o.insert("gate_attn_act_mode".into(), "relu".into());
        })
        .contains("gate_attn_act_mode 'relu'"));
        assert!(err_with(|o| {
            o.insert("layer_types".into(), serde_json::json!(["sliding_attention"]));
        })
        .contains("layer_types has 1 entries"));
        assert!(err_with(|o| {
            o["layer_types"][2] = "chunked_attention".into();
        })
        .contains("layer_types[2]"));
        assert!(err_with(|o| {
            o["rope_parameters"]["full_attention"]["rope_type"] = "yarn".into();
        })
        .contains("rope_type 'yarn'"));
        assert!(err_with(|o| {
            o["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 0.3.into();
        })
        .contains("partial_rotary_factor 0.3"));
        assert!(err_with(|o| {
            o.insert("model_type".into(), "llama".into());
        })
        .contains("model_type 'llama'"));
        assert!(err_with(|o| {
            o.insert("hidden_size".into(), "big".into());
        })
        .contains("'hidden_size' must be a non-negative integer, got \"big\""));
        assert!(err_with(|o| {
            o.insert("headwise_attn_output_gate".into(), false.into());
        })
        .contains("headwise_attn_output_gate"));
        assert!(err_with(|o| {
            o.insert("dtype".into(), "int3".into());
        })
        .contains("dtype 'int3'"));
        assert!(ModelConfig::from_json_str("{nope").unwrap_err().message.contains("not valid JSON"));
    }

    #[test]
    fn spark_1_7b_param_count() {
        let mut v = base();
        let o = v.as_object_mut().unwrap();
        o.insert("hidden_size".into(), 2048.into());
        o.insert("intermediate_size".into(), 6656.into());
        o.insert("num_hidden_layers".into(), 28.into());
        o.insert("num_attention_heads".into(), 8.into());
        o.insert("head_dim".into(), 256.into());
        o.insert("vocab_size".into(), 131072.into());
        o.remove("layer_types");
        let c = parse(&v).unwrap();
        assert_eq!(c.param_count(), 1_707_657_216);
        assert_eq!(c.count_layers(LayerType::Full), 7);
    }
}
