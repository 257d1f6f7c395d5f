//! Quantized weight matrices: the host-side formats, their scalar reference (de)quantization,
//! and how they are stored in safetensors.
//!
//! A [`QTensor`] is a `[rows, cols]` matrix quantized row by row in groups of `group` columns:
//!
//! ```text
//! value[r, c] = scale[r, g] * (q[r, c] - zero) + bias[r, g]      g = c / group
//! ```
//!
//! - [`QFormat::I8`]: `q` is a signed byte (`zero` = 0). `spark-run quantize --to int8` writes it
//!   symmetric per output channel (`group == cols`, no bias); GGUF Q8_0 (group 32) converts to
//!   it losslessly.
//! - [`QFormat::I4`]: `q` is an unsigned nibble 0..=15 (`zero` = 8), two per byte: element `2j`
//!   of a row in the low nibble of byte `j`, `2j+1` in the high nibble. GGUF Q4_0 and Q4_K
//!   (whose per-group minimum becomes `bias`) convert to it losslessly.
//! - [`QFormat::I6`]: `q` is unsigned 0..=63 (`zero` = 32): a row's low nibbles packed as int4's
//!   (`cols / 2` bytes), then its top two bits four per byte (`cols / 4` bytes, element `4j + i`
//!   at bits `2i..2i+2` of byte `j`; [`i6_stored`]); rows are a multiple of 4 columns. `--to
//!   int6` is symmetric in groups of 32 (f16 scales: 6.5 bits per weight); GGUF Q6_K (group 16)
//!   converts to it losslessly.
//!
//! What `--to int4` / `--quant int4` writes ([`QuantSpec::plan`], by tensor name): every matrix
//! in **asymmetric** int4 groups (32 columns by default; 64 or 128 on request), each with a
//! scale and a bias fitted by least squares to the group (`fit_i4_asym`: `x ≈ d * l + m`,
//! `l` in 0..=15, stored as `scale = d`, `bias = m + 8 d`), except the token embedding / output
//! head (`model.embedding.weight`, `lm_head.weight`), which is **int6 in groups of 32**, and,
//! given the layer count, `q_k_v_proj` and `down_proj` of llama.cpp's Q4_K_M "more bits" layers
//! ([`more_bits_layer`]), also int6 (older checkpoints hold these in int8 per output channel and
//! still load). Scales and biases of groups shorter than the row are rounded to f16 values
//! before the integers are chosen ([`QPlan::half_sides`]), so they are stored in half the bytes
//! (and read so by backends that gain from it: the CPU from its VNNI level up): 5 bits per
//! weight for the int4 matrices at group 32 (4.5 at 64, 4.25 at 128) and 6.5 for the int6 ones
//! (per-row scales stay f32). The int4 steps of each row's 256-column super-block are moreover `k * u` with one power of two `u` and integers `k <= 255`
//! ([`SUPER_COLS`]), and its biases `k * v` with another power of two `v` and integers
//! `|k| <= 127` ([`bias_unit`]; each grid pair then refined one unit either way for the least
//! squared error): exact f16 values, so nothing else changes, and a kernel may sum a
//! super-block in integers or read a byte per group for each side;
//! the head gate `g_proj` stays as stored. Checkpoints written before this (symmetric
//! int4 groups without bias, an int4 head) still load: the reader takes each tensor as stored.
//! [`quantize_planned`] / [`quantize_tensor_planned`] quantize to any [`QPlan`] (symmetric int4
//! included: values -8..=7 times a searched scale, no bias).
//!
//! Backends repack these into their kernels' layouts at upload; this module is the reference
//! every kernel is tested against.
//!
//! On disk (safetensors written by `spark-run quantize`): the weight keeps its name and holds `q`
//! (I8 `[rows, cols]`, U8 `[rows, cols/2]` for int4, U8 `[rows, 3 cols/4]` for int6),
//! `NAME_scale` holds the scales `[rows, cols/group]` (so the group size is `cols / scale_cols`)
//! and `NAME_bias`, if present, the biases of the same shape, both F16 where
//! [`QTensor::half_sides`] (F32 otherwise; the reader takes either, and checkpoints written with
//! f32 group scales still load); `config.json` carries `"quantization_config": {"quant_method":
//! "spark", "format": "int8"|"int6"|"int4", "group_size": G, ...}` (for int4 also `"symmetric":
//! false` and `"modules_in_int6"`, the tensors kept in int6).

use std::sync::Arc;

use rayon::prelude::*;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::weights::{Tensor, TensorBytes};

/// The integer format of a quantized matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QFormat {
    /// Signed 8-bit values.
    I8,
    /// Unsigned 4-bit values with zero point 8, packed two per byte.
    I4,
    /// Unsigned 6-bit values with zero point 32: a row's low nibbles packed as int4's, then its
    /// top two bits, four per byte (see the module documentation).
    I6,
}

impl QFormat {
    /// `int8` / `int4`.
    pub fn name(self) -> &'static str {
        match self {
            QFormat::I8 => "int8",
            QFormat::I4 => "int4",
            QFormat::I6 => "int6",
        }
    }
    /// Parse `int8`/`i8`/`q8`, `int6`/`i6`/`q6` or `int4`/`i4`/`q4`.
    pub fn parse(s: &str) -> Result<QFormat> {
        match s.to_ascii_lowercase().as_str() {
            "int8" | "i8" | "q8" => Ok(QFormat::I8),
            "int6" | "i6" | "q6" => Ok(QFormat::I6),
            "int4" | "i4" | "q4" => Ok(QFormat::I4),
            _ => Err(Error::invalid(format!("unknown quantization '{s}' (expected int8, int6 or int4)"))),
        }
    }
    /// The value that means 0 before scaling.
    pub fn zero(self) -> i32 {
        match self {
            QFormat::I8 => 0,
            QFormat::I4 => 8,
            QFormat::I6 => 32,
        }
    }
    /// The largest stored value minus the zero point (the symmetric range is `-zero..=max`).
    pub fn max(self) -> i32 {
        match self {
            QFormat::I8 => 127,
            QFormat::I4 => 7,
            QFormat::I6 => 31,
        }
    }
    /// Bytes of `q` for one row of `cols` values.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            QFormat::I8 => cols,
            QFormat::I4 => cols / 2,
            QFormat::I6 => cols / 2 + cols / 4,
        }
    }
    /// Columns a row length must be a multiple of (int4: 2 per byte; int6: the top bits 4 per
    /// byte).
    pub fn col_multiple(self) -> usize {
        match self {
            QFormat::I8 => 1,
            QFormat::I4 => 2,
            QFormat::I6 => 4,
        }
    }
}

/// Pack one int6 row: `values` (`-32..=31`, a multiple of 4 of them) into `out`
/// (`QFormat::I6.row_bytes(values.len())` bytes, overwritten) as [`i6_stored`] reads it.
pub fn pack_i6_row(values: &[i8], out: &mut [u8]) {
    let cols = values.len();
    out.fill(0);
    for (c, &v) in values.iter().enumerate() {
        let u = (v as i32 + 32) as u8;
        out[c / 2] |= (u & 0xF) << (4 * (c % 2));
        out[cols / 2 + c / 4] |= (u >> 4) << (2 * (c % 4));
    }
}

/// Element `c` of an int6 row of `cols` values as stored (`0..=63`, zero point not removed):
/// the low nibble from the first `cols / 2` bytes (int4's packing), the top two bits from the
/// `cols / 4` bytes after them (element `4j + i` at bits `2i..2i+2` of byte `j`).
#[inline]
pub fn i6_stored(row: &[u8], cols: usize, c: usize) -> u8 {
    let lo = (row[c / 2] >> (4 * (c & 1))) & 0xF;
    let hi = (row[cols / 2 + c / 4] >> (2 * (c & 3))) & 3;
    lo | (hi << 4)
}

impl std::fmt::Display for QFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What to quantize to: a format and a group size (`None`: per output channel for int8, 32 for
/// int4). [`QuantSpec::plan`] turns it into each matrix's [`QPlan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    pub format: QFormat,
    pub group: Option<usize>,
    /// The model's layer count, for int4's mix ([`more_bits_layer`]): the attention input
    /// (`q_k_v_proj`) and the MLP output (`down_proj`) of about half the layers stay int8, where
    /// llama.cpp's Q4_K_M keeps `attn_v` and `ffn_down` of the same layers in Q6_K. `None`:
    /// every layer's matrices in int4 (the model loader and `spark-run quantize` fill it in).
    pub layers: Option<usize>,
}

impl QuantSpec {
    /// `format` with the default group and no layer count.
    pub fn new(format: QFormat, group: Option<usize>) -> QuantSpec {
        QuantSpec { format, group, layers: None }
    }

    /// This spec for a model of `layers` layers (kept if already set).
    pub fn for_layers(self, layers: usize) -> QuantSpec {
        QuantSpec { layers: self.layers.or(Some(layers)), ..self }
    }
}

/// llama.cpp's choice of the layers whose `attn_v` / `ffn_down` get more bits in Q4_K_M: the
/// first and last eighth, and every third layer between (`use_more_bits`).
pub fn more_bits_layer(i: usize, layers: usize) -> bool {
    i < layers / 8 || i >= 7 * layers / 8 || (i - layers / 8) % 3 == 2
}

/// The layer index of a `...layers.{i}....` tensor name.
fn layer_index(name: &str) -> Option<usize> {
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    rest[..rest.find('.')?].parse().ok()
}

impl QuantSpec {
    /// The group size this spec gives a matrix of `cols` columns, checked.
    pub fn group_for(&self, name: &str, cols: usize) -> Result<usize> {
        let g = match (self.format, self.group) {
            (QFormat::I8, None) => cols,
            (QFormat::I4 | QFormat::I6, None) => 32,
            (_, Some(g)) => g,
        };
        if g == 0 || !g.is_multiple_of(2) || !cols.is_multiple_of(g) {
            return Err(Error::invalid(format!(
                "cannot quantize '{name}' to {} with group {g}: the group must be even and divide the row length {cols}",
                self.format
            )));
        }
        Ok(g)
    }
}

/// A quantized `[rows, cols]` matrix (see the module documentation for the formula).
#[derive(Clone)]
pub struct QTensor {
    pub name: String,
    pub format: QFormat,
    pub rows: usize,
    pub cols: usize,
    /// Columns per scale (divides `cols`; `cols` means one scale per row).
    pub group: usize,
    /// `rows * format.row_bytes(cols)` bytes, row-major.
    pub q: TensorBytes,
    /// `rows * cols / group` scales, row-major.
    pub scales: Arc<Vec<f32>>,
    /// Optional additive term per group, same layout as `scales`.
    pub bias: Option<Arc<Vec<f32>>>,
}

impl std::fmt::Debug for QTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QTensor({} [{}, {}] {} group {})", self.name, self.rows, self.cols, self.format, self.group)
    }
}

impl QTensor {
    /// Check that every buffer has the size the shape implies.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::model(format!("quantized tensor '{}': {what}", self.name)));
        if self.group == 0 || !self.cols.is_multiple_of(self.group) || !self.group.is_multiple_of(2) {
            return bad(format!("group {} does not divide the row length {} evenly", self.group, self.cols));
        }
        if !self.cols.is_multiple_of(self.format.col_multiple()) {
            return bad(format!(
                "{} rows need a multiple of {} columns, not {}",
                self.format,
                self.format.col_multiple(),
                self.cols
            ));
        }
        let want = self.rows * self.format.row_bytes(self.cols);
        if self.q.as_slice().len() != want {
            return bad(format!("holds {} bytes of values, shape needs {want}", self.q.as_slice().len()));
        }
        let ng = self.rows * self.groups_per_row();
        if self.scales.len() != ng {
            return bad(format!("has {} scales, shape and group {} need {ng}", self.scales.len(), self.group));
        }
        if let Some(b) = &self.bias {
            if b.len() != ng {
                return bad(format!("has {} biases, needs {ng}", b.len()));
            }
        }
        if let Some(i) = self.scales.iter().position(|s| !s.is_finite()) {
            return bad(format!("scale {i} is not finite ({})", self.scales[i]));
        }
        Ok(())
    }

    pub fn groups_per_row(&self) -> usize {
        self.cols / self.group
    }

    /// The stored bytes of row `r`.
    pub fn q_row(&self, r: usize) -> &[u8] {
        let n = self.format.row_bytes(self.cols);
        &self.q.as_slice()[r * n..(r + 1) * n]
    }

    /// The scales of row `r`.
    pub fn scales_row(&self, r: usize) -> &[f32] {
        let g = self.groups_per_row();
        &self.scales[r * g..(r + 1) * g]
    }

    /// The biases of row `r`, if any.
    pub fn bias_row(&self, r: usize) -> Option<&[f32]> {
        let g = self.groups_per_row();
        self.bias.as_ref().map(|b| &b[r * g..(r + 1) * g])
    }

    /// The integer value of element `c` of row `r` minus the zero point.
    #[inline]
    pub fn qval(&self, r: usize, c: usize) -> i32 {
        let row = self.q_row(r);
        match self.format {
            QFormat::I8 => row[c] as i8 as i32,
            QFormat::I4 => {
                let b = row[c / 2];
                ((b >> (4 * (c & 1))) & 0xF) as i32 - 8
            }
            QFormat::I6 => i6_stored(row, self.cols, c) as i32 - 32,
        }
    }

    /// Row `r` as f32 values into `out` (`cols` long).
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols, "dequant_row: output length");
        let s = self.scales_row(r);
        let b = self.bias_row(r);
        for (c, o) in out.iter_mut().enumerate() {
            let g = c / self.group;
            *o = s[g] * self.qval(r, c) as f32 + b.map_or(0.0, |b| b[g]);
        }
    }

    /// The whole matrix as f32 values.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.rows * self.cols];
        for (r, row) in v.chunks_exact_mut(self.cols).enumerate() {
            self.dequant_row(r, row);
        }
        v
    }

    /// The matrix dequantized into a float tensor of `dtype` (for backends without integer
    /// kernels).
    pub fn to_tensor(&self, dtype: DType) -> Tensor {
        Tensor::from_f32(&self.name, vec![self.rows, self.cols], dtype, &self.dequantize())
    }

    /// Whether the scales and biases are per group (not per row) and every one is exactly an
    /// f16 value: then they are stored on disk as f16, and backends may hold them so (what
    /// [`quantize_planned`] writes for groups, and GGUF Q8_0 / Q4_0 give). Scans the values.
    pub fn half_sides(&self) -> bool {
        // In parallel, as `sides_fit_f16` (a 1.7B-parameter model has ~10^8 values).
        let exact = |v: &Arc<Vec<f32>>| v.par_iter().with_min_len(1 << 16).all(|&x| is_f16_exact(x));
        self.groups_per_row() > 1 && exact(&self.scales) && self.bias.as_ref().is_none_or(exact)
    }

    /// Whether a backend may hold the scales and biases as f16 at no more than f16's own
    /// precision: per group (not per row); every scale exactly an f16 ([`is_f16_exact`]) or in
    /// f16's normal range, where rounding moves it by at most 2^-11 of itself ([`fits_f16`]);
    /// every bias likewise, or moved by at most 2^-11 of 8 times its group's scale (a bias near
    /// zero, whose f16 is subnormal). True for everything [`QTensor::half_sides`] accepts, and
    /// for GGUF K-quant products `d * sc` (an f16 times a 6- or 8-bit integer: up to 17
    /// significant bits): holding those as f16 moves a weight `s q + b` by at most
    /// `2^-11 (|s q| + max(|b|, 8 |s|))`, about 1 % of a quantization step.
    pub fn sides_fit_f16(&self) -> bool {
        // Scans every value (in parallel: a 1.7B-parameter model has ~10^8 of them).
        self.groups_per_row() > 1
            && self.scales.par_iter().with_min_len(1 << 16).all(|&v| fits_f16(v))
            && self.bias.as_ref().is_none_or(|b| {
                b.par_iter().zip(self.scales.par_iter()).with_min_len(1 << 16).all(|(&b, &s)| {
                    fits_f16(b) || {
                        let moved = (half::f16::from_f32(b).to_f32() - b).abs();
                        b.is_finite() && moved <= 2f32.powi(-11) * 8.0 * s.abs()
                    }
                })
            })
    }

    /// Bytes of values, scales and biases as stored (the scales and biases in f16 when
    /// [`QTensor::half_sides`]).
    pub fn nbytes(&self) -> usize {
        let side = if self.half_sides() { 2 } else { 4 };
        self.q.as_slice().len() + side * self.scales.len() * (1 + usize::from(self.bias.is_some()))
    }

    /// Bytes as a backend holds them that keeps scales and biases in f16 when `half_ok` and
    /// [`QTensor::sides_fit_f16`] (else in f32).
    pub fn nbytes_served(&self, half_ok: bool) -> usize {
        let side = if half_ok && self.sides_fit_f16() { 2 } else { 4 };
        self.q.as_slice().len() + side * self.scales.len() * (1 + usize::from(self.bias.is_some()))
    }

    /// Bits per weight, scales included.
    pub fn bits_per_weight(&self) -> f64 {
        self.nbytes() as f64 * 8.0 / (self.rows * self.cols) as f64
    }
}

/// How one matrix is quantized: its format, group size and whether its groups carry a bias.
/// [`QuantSpec::plan`] chooses it from the matrix's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QPlan {
    pub format: QFormat,
    /// Columns per scale (divides the row length).
    pub group: usize,
    /// int4 only: asymmetric groups, each with a scale and a bias fitted to its range (`q` 0..=15
    /// spans the group's minimum to maximum); `false`: symmetric (values -8..=7 times a scale).
    pub bias: bool,
}

impl QPlan {
    /// Whether a matrix of `cols` columns in this plan has its scales and biases in f16: every
    /// plan with groups shorter than the row ([`quantize_planned`] rounds them); per-row scales
    /// stay f32 (one per row: nothing to save).
    pub fn half_sides(&self, cols: usize) -> bool {
        self.group < cols
    }
    /// Bytes of a `[rows, cols]` matrix in this plan (values, scales and biases).
    pub fn nbytes(&self, rows: usize, cols: usize) -> usize {
        self.nbytes_served(rows, cols, true)
    }
    /// The same, as a backend holds it that keeps f16 scales and biases in f16 when `half_ok`.
    pub fn nbytes_served(&self, rows: usize, cols: usize, half_ok: bool) -> usize {
        let side = if half_ok && self.half_sides(cols) { 2 } else { 4 };
        rows * self.format.row_bytes(cols) + side * rows * (cols / self.group) * (1 + usize::from(self.bias))
    }
    /// `int8-ch`, `int4-g64`, `int4-g32+bias`, ... (`ch`: one scale per row of `cols`).
    pub fn label(&self, cols: usize) -> String {
        let g = if self.group == cols { "ch".to_string() } else { format!("g{}", self.group) };
        format!("{}-{g}{}", self.format, if self.bias { "+bias" } else { "" })
    }
}

/// Whether `name` is the token embedding or the output head (the tied embedding is both).
pub fn is_embedding_or_head(name: &str) -> bool {
    name.ends_with("embedding.weight") || name.ends_with("embed_tokens.weight") || name.ends_with("lm_head.weight")
}

impl QuantSpec {
    /// The plan for matrix `name` with rows of `cols` values.
    ///
    /// int8: symmetric per output channel (or in `group`s), every matrix. int4: asymmetric
    /// groups (a scale and a bias each; default 32 columns) for every matrix except the token
    /// embedding / output head, which is int6 in symmetric groups of 32: its error goes straight
    /// into the logits (llama.cpp's Q4_K_M keeps it in Q6_K for the same reason); and, given the
    /// layer count, `q_k_v_proj` and `down_proj` of the [`more_bits_layer`]s, also int6 in
    /// groups of 32.
    pub fn plan(&self, name: &str, cols: usize) -> Result<QPlan> {
        if self.format == QFormat::I4 && (is_embedding_or_head(name) || self.more_bits(name)) {
            return QuantSpec::new(QFormat::I6, Some(32)).plan(name, cols);
        }
        let group = self.group_for(name, cols)?;
        Ok(QPlan { format: self.format, group, bias: self.format == QFormat::I4 })
    }
}

impl QuantSpec {
    /// Whether int4 keeps `name` in int6 as one of the mix's more-bits matrices.
    fn more_bits(&self, name: &str) -> bool {
        let role = ["q_k_v_proj.weight", "v_proj.weight", "mlp.down_proj.weight"].iter().any(|r| name.ends_with(r));
        match (self.layers, layer_index(name)) {
            (Some(n), Some(i)) if role && i < n => more_bits_layer(i, n),
            _ => false,
        }
    }
}

/// Quantize the `[rows, cols]` f32 matrix `values` (row-major) as [`QuantSpec::plan`] says for
/// `name`.
pub fn quantize(name: &str, rows: usize, cols: usize, values: &[f32], spec: QuantSpec) -> Result<QTensor> {
    quantize_planned(name, rows, cols, values, spec.plan(name, cols)?)
}

/// Quantize the `[rows, cols]` f32 matrix `values` (row-major) in `plan`.
///
/// int8: symmetric, `scale = max|x| / 127` per group (per row by default). int4 symmetric
/// (`plan.bias == false`): values -8..=7; each group's scale is searched among `max|x| / d` for
/// d in 6.0..=8.5 (step 0.125), then refined once by least squares for the chosen integers.
/// int4 asymmetric: see `fit_i4_asym`.
pub fn quantize_planned(name: &str, rows: usize, cols: usize, values: &[f32], plan: QPlan) -> Result<QTensor> {
    if values.len() != rows * cols {
        return Err(Error::internal(format!("quantize '{name}': {} values for shape [{rows}, {cols}]", values.len())));
    }
    check_plan(name, cols, plan)?;
    let ng = cols / plan.group;
    let mut q = vec![0u8; rows * plan.format.row_bytes(cols)];
    let mut scales = vec![0.0f32; rows * ng];
    let mut bias = vec![0.0f32; if plan.bias { rows * ng } else { 0 }];
    quantize_rows(name, 0, cols, plan, values, &mut q, &mut scales, &mut bias)?;
    finish(name, rows, cols, plan, q, scales, bias)
}

fn check_plan(name: &str, cols: usize, plan: QPlan) -> Result<()> {
    let g = plan.group;
    if g == 0 || !g.is_multiple_of(2) || !cols.is_multiple_of(g) {
        return Err(Error::invalid(format!(
            "cannot quantize '{name}' to {} with group {g}: the group must be even and divide the row length {cols}",
            plan.format
        )));
    }
    if plan.bias && plan.format != QFormat::I4 {
        return Err(Error::invalid(format!("cannot quantize '{name}': only int4 groups carry a bias")));
    }
    let m = plan.format.col_multiple();
    if !cols.is_multiple_of(m) {
        return Err(Error::invalid(format!(
            "cannot quantize '{name}' to {}: its rows of {cols} columns are not a multiple of {m}",
            plan.format
        )));
    }
    Ok(())
}

fn finish(name: &str, rows: usize, cols: usize, plan: QPlan, q: Vec<u8>, s: Vec<f32>, b: Vec<f32>) -> Result<QTensor> {
    let t = QTensor {
        name: name.to_string(),
        format: plan.format,
        rows,
        cols,
        group: plan.group,
        q: TensorBytes::Owned(Arc::new(q)),
        scales: Arc::new(s),
        bias: if plan.bias { Some(Arc::new(b)) } else { None },
    };
    t.validate()?;
    Ok(t)
}

/// Quantize whole rows `values` (starting at row `row0` of the matrix, for error messages) into
/// `q`, `scales` and (asymmetric int4) `bias`, rows in parallel (the int4 searches are the
/// costly part).
#[allow(clippy::too_many_arguments)]
fn quantize_rows(
    name: &str,
    row0: usize,
    cols: usize,
    plan: QPlan,
    values: &[f32],
    q: &mut [u8],
    scales: &mut [f32],
    bias: &mut [f32],
) -> Result<()> {
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::model(format!(
            "cannot quantize '{name}': element {} (row {}, col {}) is {}",
            row0 * cols + i,
            row0 + i / cols.max(1),
            i % cols.max(1),
            values[i]
        )));
    }
    let (group, format) = (plan.group, plan.format);
    let ng = cols / group;
    let rb = format.row_bytes(cols);
    let half = plan.half_sides(cols);
    // Rows without a bias get an empty bias chunk each.
    let bias_chunks: Vec<&mut [f32]> = if plan.bias {
        bias.chunks_mut(ng.max(1)).collect()
    } else {
        (0..scales.len() / ng.max(1)).map(|_| &mut [][..]).collect()
    };
    q.par_chunks_mut(rb.max(1)).zip(scales.par_chunks_mut(ng.max(1))).zip(bias_chunks).enumerate().for_each(
        |(r, ((qrow, srow), brow))| {
            let row = &values[r * cols..(r + 1) * cols];
            let mut qs = vec![0i8; group];
            qrow.fill(0);
            // int6 values of the whole row, packed at the end.
            let mut i6row = vec![0i8; if format == QFormat::I6 { cols } else { 0 }];
            // Asymmetric int4 groups of f16 sides, several per super-block: every group's
            // least-squares fit first, then the steps snapped to the super-block's grid.
            let sub =
                format == QFormat::I4 && plan.bias && half && SUPER_COLS.is_multiple_of(group) && group < SUPER_COLS;
            let mut fits: Vec<(f32, f32)> =
                if sub { (0..ng).map(|g| fit_i4_asym(&row[g * group..(g + 1) * group])).collect() } else { Vec::new() };
            for sb in fits.chunks_mut((SUPER_COLS / group).max(1)) {
                snap_steps(sb);
            }
            // Their offsets refitted to the snapped steps, then the biases snapped to the
            // super-block's own grid ([`snap_biases`]) before any integer is chosen.
            let (mut grid_bias, mut units) = (Vec::new(), Vec::new());
            if sub {
                for (g, fit) in fits.iter_mut().enumerate() {
                    *fit = refit_offset(&row[g * group..(g + 1) * group], *fit);
                    grid_bias.push(i4_asym_sides(*fit, half).1);
                }
                let per = SUPER_COLS / group;
                for (sb, fs) in grid_bias.chunks_mut(per).zip(fits.chunks(per)) {
                    snap_biases(sb);
                    units.push(grid_units(fs, sb));
                }
            }
            for (g, s_out) in srow.iter_mut().enumerate() {
                let x = &row[g * group..(g + 1) * group];
                *s_out = match format {
                    QFormat::I8 => quantize_group_i8(x, &mut qs, half),
                    QFormat::I4 if plan.bias => {
                        let (s, b) = if sub {
                            let (su, bu) = units[g / (SUPER_COLS / group)];
                            best_on_grid(x, i4_asym_sides(fits[g], half).0, grid_bias[g], su, bu)
                        } else {
                            i4_asym_sides(fit_i4_asym(x), half)
                        };
                        quantize_group_i4_with(x, s, b, &mut qs);
                        brow[g] = b;
                        s
                    }
                    QFormat::I4 | QFormat::I6 => quantize_group_sym(x, &mut qs, half, format),
                };
                for (j, &v) in qs.iter().enumerate() {
                    let c = g * group + j;
                    match format {
                        QFormat::I8 => qrow[c] = v as u8,
                        QFormat::I4 => qrow[c / 2] |= ((v as i32 + 8) as u8) << (4 * (c % 2)),
                        QFormat::I6 => i6row[c] = v,
                    }
                }
            }
            if format == QFormat::I6 {
                pack_i6_row(&i6row, qrow);
            }
        },
    );
    Ok(())
}

/// Quantize a float checkpoint tensor (`[rows, cols]`) as [`QuantSpec::plan`] says for its name.
pub fn quantize_tensor(t: &Tensor, spec: QuantSpec) -> Result<QTensor> {
    let cols = match t.shape.as_slice() {
        [_, c] => *c,
        s => return Err(Error::invalid(format!("cannot quantize '{}' of shape {s:?}: not a matrix", t.name))),
    };
    quantize_tensor_planned(t, spec.plan(&t.name, cols)?)
}

/// Quantize a float checkpoint tensor (`[rows, cols]`) in `plan`, decoding it to f32 a block of
/// rows at a time so that no full f32 copy of a large matrix (the 131072-row embedding) is ever
/// made.
pub fn quantize_tensor_planned(t: &Tensor, plan: QPlan) -> Result<QTensor> {
    let (rows, cols) = match t.shape.as_slice() {
        [r, c] => (*r, *c),
        s => return Err(Error::invalid(format!("cannot quantize '{}' of shape {s:?}: not a matrix", t.name))),
    };
    check_plan(&t.name, cols, plan)?;
    let (rb, ng) = (plan.format.row_bytes(cols), cols / plan.group);
    let nb = if plan.bias { ng } else { 0 };
    let mut q = vec![0u8; rows * rb];
    let mut scales = vec![0.0f32; rows * ng];
    let mut bias = vec![0.0f32; rows * nb];
    let block = (1 << 20) / cols.max(1) + 1;
    let bytes = t.bytes();
    let es = t.dtype.size();
    let mut vals = Vec::new();
    for r0 in (0..rows).step_by(block) {
        let r1 = (r0 + block).min(rows);
        vals.clear();
        crate::dtype::decode_into(t.dtype, &bytes[r0 * cols * es..r1 * cols * es], &mut vals);
        quantize_rows(
            &t.name,
            r0,
            cols,
            plan,
            &vals,
            &mut q[r0 * rb..r1 * rb],
            &mut scales[r0 * ng..r1 * ng],
            &mut bias[r0 * nb..r1 * nb],
        )?;
    }
    finish(&t.name, rows, cols, plan, q, scales, bias)
}

/// Round to nearest (ties to even) for |x| < 2^22, in plain f32 arithmetic: `f32::round` is a
/// library call, and the int4 searches round every value ~20 times.
#[inline(always)]
fn rint(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (x + MAGIC) - MAGIC
}

/// Whether `v` rounds to an f16 within f16's relative precision (at most 2^-11 of itself):
/// exactly an f16 value ([`is_f16_exact`]), or in the normal range `2^-14 <= |v| <= 65504`
/// (65504 is the largest f16; values up to 65520 would round to it too, but stay out).
pub fn fits_f16(v: f32) -> bool {
    const MIN_NORMAL: f32 = 6.103_515_6e-5; // 2^-14
    let a = v.abs();
    (MIN_NORMAL..=65504.0).contains(&a) || is_f16_exact(v)
}

/// Whether `v` is exactly a finite f16 value (so storing it as f16 loses nothing), from its
/// bits: zero; or an exponent within f16's and no mantissa bits below its precision (10 bits for
/// normal values, fewer for subnormal ones down to 2^-24).
pub fn is_f16_exact(v: f32) -> bool {
    if v == 0.0 {
        return true;
    }
    let bits = v.to_bits();
    let e = ((bits >> 23) & 0xFF) as i32 - 127;
    let man = bits & 0x7F_FFFF;
    if !(-24..=15).contains(&e) {
        return false;
    }
    // Low f32 mantissa bits an f16 cannot hold: 13 for normal f16 values (e >= -14), one more
    // per binade below.
    let low = 13 + (-14 - e).max(0);
    man & ((1u32 << low) - 1) == 0
}

/// `v` rounded to the nearest f16 value when `half` and that is finite; else `v` (a scale or
/// bias beyond f16's range keeps its f32 value, and its tensor then keeps f32 sides).
#[inline]
fn side_value(v: f32, half: bool) -> f32 {
    let h = half::f16::from_f32(v).to_f32();
    if half && h.is_finite() {
        h
    } else {
        v
    }
}

fn quantize_group_i8(x: &[f32], q: &mut [i8], half: bool) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let s = side_value(amax / 127.0, half);
    if s == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let inv = 1.0 / s;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = rint(v * inv).clamp(-127.0, 127.0) as i8;
    }
    s
}

/// The squared error of symmetric integers `lo..=hi` times `s` for `x`.
fn err_sym(x: &[f32], s: f32, lo: f32, hi: f32) -> f32 {
    let inv = 1.0 / s;
    let e = |v: f32| {
        let d = v - s * rint(v * inv).clamp(lo, hi);
        d * d
    };
    // Eight partial sums, so the compiler can vectorise the loop (a single float sum cannot be
    // reordered); the search calls this ~20 times per group.
    let mut acc = [0.0f32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += e(v);
        }
    }
    it.remainder().iter().map(|&v| e(v)).sum::<f32>() + acc.iter().sum::<f32>()
}

/// Symmetric int4 (`-8..=7`) or int6 (`-32..=31`) for one group: the scale is searched among
/// `max|x| / d` for `d` from a little below to a little above the largest integer (int4: 6.0 to
/// 8.5 in steps of 1/8; int6: 28 to 34 in steps of 1/4), then refined once by least squares
/// for the integers the best one chose. Returns the scale (rounded to f16 with `half`).
fn quantize_group_sym(x: &[f32], q: &mut [i8], half: bool, format: QFormat) -> f32 {
    let (lo, hi) = (-(format.zero() as f32), format.max() as f32);
    let (d0, d1, step) = if format == QFormat::I6 { (28.0f32, 34.0, 0.25) } else { (6.0f32, 8.5, 0.125) };
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let mut best = (f32::INFINITY, amax / hi);
    let mut d = d0;
    while d <= d1 {
        let s = amax / d;
        let e = err_sym(x, s, lo, hi);
        if e < best.0 {
            best = (e, s);
        }
        d += step;
    }
    // One least-squares refinement of the scale for the integers the best scale chose.
    let s0 = best.1;
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for &v in x {
        let qi = rint(v / s0).clamp(lo, hi) as f64;
        num += v as f64 * qi;
        den += qi * qi;
    }
    if den > 0.0 {
        let s1 = (num / den) as f32;
        if s1 > 0.0 && s1.is_finite() {
            let e1 = err_sym(x, s1, lo, hi);
            if e1 < best.0 {
                best = (e1, s1);
            }
        }
    }
    let s = side_value(best.1, half);
    if s == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let inv = 1.0 / s;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = rint(v * inv).clamp(lo, hi) as i8;
    }
    s
}

/// The fixed sums of a group for the least-squares fit of `x ≈ d * l + m`: `n`, `sum x`,
/// `sum x^2`.
#[derive(Clone, Copy)]
struct Fit {
    n: f32,
    sx: f32,
    sxx: f32,
}

impl Fit {
    /// `sum (d l + m - x)^2` for integers with sums `sl`, `sll` and `slx` (`sum l x`).
    #[inline]
    fn err(&self, d: f32, m: f32, (sl, sll, slx): (f32, f32, f32)) -> f32 {
        let e = d * d * sll + 2.0 * d * m * sl + m * m * self.n - 2.0 * d * slx - 2.0 * m * self.sx + self.sxx;
        e.max(0.0)
    }
    /// The least-squares `(d, m, error)` for integers with sums `s`; `None` when the integers
    /// are all equal (nothing to fit a step to) or the step comes out non-positive.
    #[inline]
    fn solve(&self, s: (f32, f32, f32)) -> Option<(f32, f32, f32)> {
        let (sl, sll, slx) = s;
        let det = self.n * sll - sl * sl;
        if det <= 0.0 {
            return None;
        }
        let d = (self.n * slx - sl * self.sx) / det;
        let m = (sll * self.sx - sl * slx) / det;
        if d <= 0.0 || !d.is_finite() || !m.is_finite() {
            return None;
        }
        Some((d, m, self.err(d, m, s)))
    }
}

/// `(sum l, sum l^2, sum l x)` of the integers `l = clamp(rint((x - m) * inv), 0, 15)`, in
/// eight partial sums so the loop vectorises (the search calls this ~15 times per group).
#[inline]
fn sums_i4(x: &[f32], m: f32, inv: f32) -> (f32, f32, f32) {
    let (mut a, mut b, mut c) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
    let mut it = x.chunks_exact(8);
    for xs in &mut it {
        let xs: &[f32; 8] = xs.try_into().unwrap();
        for k in 0..8 {
            let l = rint((xs[k] - m) * inv).clamp(0.0, 15.0);
            a[k] += l;
            b[k] += l * l;
            c[k] += l * xs[k];
        }
    }
    let (mut sl, mut sll, mut slx) = (0.0, 0.0, 0.0);
    for &v in it.remainder() {
        let l = rint((v - m) * inv).clamp(0.0, 15.0);
        sl += l;
        sll += l * l;
        slx += l * v;
    }
    (sl + a.iter().sum::<f32>(), sll + b.iter().sum::<f32>(), slx + c.iter().sum::<f32>())
}

/// Fit one asymmetric int4 group: `x ≈ d * l + m` with integers `l` in 0..=15, minimising the
/// squared error. Candidates: the plain min-max grid (`d = (max - min) / 15`, `m = min`), then
/// 11 inverse steps `(14 + 0.2 k) / (max - min)` from the minimum (k = 0..=10), each followed
/// by the least-squares `(d, m)` for the integers it chose (a 2x2 normal system; the error
/// follows from the same sums); the best is then refined by rounding to its own `(d, m)` and
/// fitting again while that lowers the error. Returns `(d, m)`; `d` is 0 for a constant group.
fn fit_i4_asym(x: &[f32]) -> (f32, f32) {
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    let mut f = Fit { n: x.len() as f32, sx: 0.0, sxx: 0.0 };
    for &v in x {
        lo = lo.min(v);
        hi = hi.max(v);
        f.sx += v;
        f.sxx += v * v;
    }
    let d0 = (hi - lo) / 15.0;
    // A constant group (or a range too narrow / wide for an f32 step): one value, exactly.
    if hi <= lo || !(1.0 / d0).is_finite() || !d0.is_finite() {
        return (0.0, if hi <= lo { lo } else { 0.5 * lo + 0.5 * hi });
    }
    let mut best = (f.err(d0, lo, sums_i4(x, lo, 1.0 / d0)), d0, lo);
    for k in 0..=10 {
        let inv = (14.0 + 0.2 * k as f32) / (hi - lo);
        if let Some((d, m, e)) = f.solve(sums_i4(x, lo, inv)) {
            if e < best.0 {
                best = (e, d, m);
            }
        }
    }
    for _ in 0..3 {
        match f.solve(sums_i4(x, best.2, 1.0 / best.1)) {
            Some((d, m, e)) if e < best.0 * (1.0 - 1e-6) => best = (e, d, m),
            _ => break,
        }
    }
    (best.1, best.2)
}

/// Columns of an int4 super-block: asymmetric int4 groups shorter than this with f16 sides have
/// steps `k * 2^e` with one exponent `e` per row and super-block and integers `k` in 0..=255
/// (`snap_steps`). Such a step is an exact f16 value, so the stored format is unchanged; a
/// kernel may then accumulate a super-block's groups in integers, `k` as an integer weight of
/// each group's dot product (the CPU's AVX2 level does: `QMat`'s sub-scales).
pub const SUPER_COLS: usize = 256;

/// The smallest power of two `u >= 2^-24` with `d / u <= 255` for the super-block's largest
/// step `d` (2^-24 is f16's smallest step: every `k u` is then an exact f16 value).
pub fn super_unit(dmax: f32) -> f32 {
    let mut u = 2f32.powi(((dmax / 255.0).log2().ceil() as i32).max(-24));
    while dmax / u > 255.0 {
        u *= 2.0;
    }
    u
}

/// Snap the fitted steps `(d, m)` of one super-block's groups to `k * u` ([`super_unit`] of
/// their largest, `k` the nearest integer, at most 255). The largest keeps 8 significant bits
/// (a relative change of at most 2^-8); the offsets are refitted afterwards ([`refit_offset`]).
fn snap_steps(fits: &mut [(f32, f32)]) {
    let dmax = fits.iter().fold(0.0f32, |a, f| a.max(f.0));
    if dmax <= 0.0 || !dmax.is_finite() {
        return;
    }
    let u = super_unit(dmax);
    for f in fits.iter_mut() {
        f.0 = (f.0 / u).round().min(255.0) * u;
    }
}

/// The smallest power of two `u >= 2^-24` with `|b| / u <= 127` for a super-block's largest
/// bias magnitude `bmax` (so `k u`, `|k| <= 127`, is an exact f16 value).
pub fn bias_unit(bmax: f32) -> f32 {
    let mut u = 2f32.powi(((bmax / 127.0).log2().ceil() as i32).max(-24));
    while bmax / u > 127.0 {
        u *= 2.0;
    }
    u
}

/// Snap one super-block's stored biases to `k * u` ([`bias_unit`] of the largest magnitude, `k`
/// the nearest integer in -127..=127): each moves by at most `u / 2 <= max|b| / 127`, before its
/// group's integers are chosen. A backend may then hold a byte per group and a power of two per
/// super-block (the CPU's VNNI level does).
fn snap_biases(bias: &mut [f32]) {
    let bmax = bias.iter().fold(0.0f32, |a, b| a.max(b.abs()));
    if bmax <= 0.0 || !bmax.is_finite() {
        return;
    }
    let u = bias_unit(bmax);
    for b in bias.iter_mut() {
        *b = (*b / u).round().clamp(-127.0, 127.0) * u;
    }
}

/// One super-block's step and bias units: [`super_unit`] of its largest step, [`bias_unit`]
/// of its largest bias magnitude (0 where all are 0).
fn grid_units(fits: &[(f32, f32)], bias: &[f32]) -> (f32, f32) {
    let dmax = fits.iter().fold(0.0f32, |a, f| a.max(f.0));
    let bmax = bias.iter().fold(0.0f32, |a, b| a.max(b.abs()));
    (if dmax > 0.0 { super_unit(dmax) } else { 0.0 }, if bmax > 0.0 { bias_unit(bmax) } else { 0.0 })
}

/// The grid pair `(scale, bias)` nearest `(s, b)` (one unit either way of each, inside the
/// grids' ranges: `k <= 255` steps of `su`, `|k| <= 127` of `bu`) with the least squared error
/// for the group's nearest integers.
fn best_on_grid(x: &[f32], s: f32, b: f32, su: f32, bu: f32) -> (f32, f32) {
    let err = |s: f32, b: f32| -> f32 {
        if s == 0.0 {
            return x.iter().map(|&v| (v - b) * (v - b)).sum();
        }
        let inv = 1.0 / s;
        x.iter()
            .map(|&v| {
                let e = v - (s * rint((v - b) * inv).clamp(-8.0, 7.0) + b);
                e * e
            })
            .sum()
    };
    let mut best = (err(s, b), s, b);
    for ds in [-1.0f32, 0.0, 1.0] {
        for db in [-1.0f32, 0.0, 1.0] {
            let (s2, b2) = (s + ds * su, b + db * bu);
            if (ds == 0.0 && db == 0.0)
                || s2 < 0.0
                || (su > 0.0 && s2 / su > 255.0)
                || (bu > 0.0 && (b2 / bu).abs() > 127.0)
            {
                continue;
            }
            let e = err(s2, b2);
            if e < best.0 {
                best = (e, s2, b2);
            }
        }
    }
    (best.1, best.2)
}

/// The least-squares offset `m` for a fixed step `d` (the integers chosen for `(d, m)`, `m`
/// refitted, twice): after [`snap_steps`] moved `d`.
fn refit_offset(x: &[f32], (d, mut m): (f32, f32)) -> (f32, f32) {
    if d <= 0.0 {
        return (d, m);
    }
    let (n, sx) = (x.len() as f32, x.iter().sum::<f32>());
    for _ in 0..2 {
        let (sl, _, _) = sums_i4(x, m, 1.0 / d);
        m = (sx - d * sl) / n;
    }
    (d, m)
}

/// Asymmetric int4 for one group of fitted `(d, m)`: fills `q` with `l - 8` (the stored nibble
/// minus the zero point) and returns `(scale, bias)` of the stored form `scale * q + bias = d *
/// l + m`, i.e. `scale = d`, `bias = m + 8 d`. With `half`, both are rounded to f16 first and
/// the integers chosen for the rounded pair (nearest to each value).
#[cfg(test)]
fn quantize_group_i4_asym(x: &[f32], fit: (f32, f32), q: &mut [i8], half: bool) -> (f32, f32) {
    let (s, b) = i4_asym_sides(fit, half);
    quantize_group_i4_with(x, s, b, q);
    (s, b)
}

/// The stored `(scale, bias)` of a fitted `(d, m)`: `(d, m + 8 d)`, or `(0, m)` for a constant
/// group (`d == 0`), each rounded to f16 with `half`.
fn i4_asym_sides((d, m): (f32, f32), half: bool) -> (f32, f32) {
    let s = side_value(d, half);
    if s == 0.0 {
        (0.0, side_value(m, half))
    } else {
        (s, side_value(m + 8.0 * d, half))
    }
}

/// The integers `q` (`l - 8`, nearest to each value) of one asymmetric int4 group stored as
/// `scale * q + bias`; all 0 for a zero scale.
fn quantize_group_i4_with(x: &[f32], s: f32, b: f32, q: &mut [i8]) {
    if s == 0.0 {
        q.fill(0);
        return;
    }
    let inv = 1.0 / s;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = rint((v - b) * inv).clamp(-8.0, 7.0) as i8;
    }
}

/// Signal-to-noise ratio in dB of `test` against `reference`: `10 log10(sum ref^2 / sum (ref -
/// test)^2)` (infinite when equal).
pub fn snr_db(reference: &[f32], test: &[f32]) -> f64 {
    let (mut sig, mut noise) = (0.0f64, 0.0f64);
    for (&a, &b) in reference.iter().zip(test) {
        sig += (a as f64) * (a as f64);
        noise += ((a - b) as f64) * ((a - b) as f64);
    }
    if noise == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (sig / noise).log10()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i / cols) as f32)).collect()
    }

    #[test]
    fn int8_per_channel_round_trips_within_half_a_step() {
        let (r, c) = (5, 96);
        let x = ramp(r, c);
        let q = quantize("w", r, c, &x, QuantSpec::new(QFormat::I8, None)).unwrap();
        assert_eq!(q.group, c);
        let y = q.dequantize();
        for row in 0..r {
            let s = q.scales[row];
            for col in 0..c {
                assert!((x[row * c + col] - y[row * c + col]).abs() <= 0.5 * s + 1e-6);
            }
        }
        assert!(snr_db(&x, &y) > 35.0);
    }

    /// int6: symmetric `-32..=31` per group, packed as the low nibbles (int4's order) then the
    /// top two bits four to a byte; every value on its nearest integer.
    #[test]
    fn int6_groups_and_packing() {
        let (r, c) = (3, 128);
        let x = ramp(r, c);
        let q = quantize("w", r, c, &x, QuantSpec::new(QFormat::I6, None)).unwrap();
        assert_eq!((q.format, q.group, q.bias.is_none()), (QFormat::I6, 32, true));
        assert_eq!(q.q.as_slice().len(), r * 96);
        assert!(q.half_sides());
        let y = q.dequantize();
        for row in 0..r {
            let qrow = q.q_row(row);
            for col in 0..c {
                let s = q.scales[row * 4 + col / 32];
                let v = q.qval(row, col);
                assert!((-32..=31).contains(&v));
                // The packing, bit by bit.
                let lo = (qrow[col / 2] >> (4 * (col % 2))) & 15;
                let hi = (qrow[64 + col / 4] >> (2 * (col % 4))) & 3;
                assert_eq!((lo | hi << 4) as i32 - 32, v);
                // The nearest integer on the group's grid (the scale search may clip the
                // largest magnitude to 31 or -32).
                let e = (x[row * c + col] - y[row * c + col]).abs();
                let best = (-32..=31).map(|l| (x[row * c + col] - s * l as f32).abs()).fold(f32::MAX, f32::min);
                assert!(e <= best + 1e-6, "{row} {col}: {e} vs {best}");
            }
        }
        let i4 = quantize("w", r, c, &x, QuantSpec::new(QFormat::I4, Some(32))).unwrap();
        assert!(snr_db(&x, &y) > snr_db(&x, &i4.dequantize()) + 8.0);
        // Rows must be a multiple of 4 columns.
        let e = quantize("w", 1, 66, &ramp(1, 66), QuantSpec::new(QFormat::I6, Some(2))).unwrap_err();
        assert!(e.message.contains("multiple of 4"), "{}", e.message);
    }

    #[test]
    fn int4_groups_and_packing() {
        let (r, c) = (3, 128);
        let x = ramp(r, c);
        for g in [32, 64, 128] {
            let spec = QuantSpec::new(QFormat::I4, Some(g));
            let plan = spec.plan("w", c).unwrap();
            assert_eq!(plan, QPlan { format: QFormat::I4, group: g, bias: true });
            let q = quantize("w", r, c, &x, spec).unwrap();
            assert_eq!((q.format, q.group), (QFormat::I4, g));
            assert_eq!(q.q.as_slice().len(), r * c / 2);
            assert_eq!(q.scales.len(), r * c / g);
            let b = q.bias.as_ref().expect("asymmetric int4 carries a bias");
            assert_eq!(b.len(), r * c / g);
            assert_eq!(q.nbytes(), plan.nbytes(r, c));
            // Groups shorter than the row: f16 scale and bias.
            assert_eq!(q.half_sides(), g < c);
            assert_eq!(q.bits_per_weight(), 4.0 + if g < c { 32.0 } else { 64.0 } / g as f64);
            let y = q.dequantize();
            // Each value is scale * (an integer in -8..=7) + bias.
            for row in 0..r {
                for col in 0..c {
                    let v = q.qval(row, col);
                    assert!((-8..=7).contains(&v));
                    let k = row * (c / g) + col / g;
                    assert_eq!(y[row * c + col], q.scales[k] * v as f32 + b[k]);
                }
            }
            let snr = snr_db(&x, &y);
            assert!(snr > 20.0, "group {g}: snr {snr}");
            // Symmetric groups are still available through a plan (and carry no bias).
            let sym = QPlan { bias: false, ..plan };
            let s = quantize_planned("w", r, c, &x, sym).unwrap();
            assert!(s.bias.is_none());
            let ys = s.dequantize();
            for (i, &v) in ys.iter().enumerate() {
                assert_eq!(v, s.scales[i / g] * s.qval(i / c, i % c) as f32);
            }
            assert!(snr_db(&x, &ys) > 15.0);
        }
    }

    /// The default group, the embedding / head rule and the plans' sizes.
    #[test]
    fn int4_plan_keeps_the_head_in_int6() {
        let i4 = QuantSpec::new(QFormat::I4, None);
        assert_eq!(i4.plan("model.layers.0.mlp.down_proj.weight", 768).unwrap().label(768), "int4-g32+bias");
        for head in ["model.embedding.weight", "lm_head.weight", "model.embed_tokens.weight"] {
            let p = i4.plan(head, 256).unwrap();
            assert_eq!(p, QPlan { format: QFormat::I6, group: 32, bias: false }, "{head}");
            assert_eq!(p.label(256), "int6-g32");
            // 3/4 of a byte per value and an f16 scale per 32.
            assert_eq!(p.nbytes(10, 256), 10 * 192 + 2 * 10 * 8);
        }
        let g128 = QuantSpec::new(QFormat::I4, Some(128));
        assert_eq!(g128.plan("lm_head.weight", 256).unwrap().group, 32);
        assert_eq!(g128.plan("w", 256).unwrap().nbytes(2, 256), 2 * 128 + 2 * 2 * 2 * 2);
        let i8 = QuantSpec::new(QFormat::I8, None);
        assert_eq!(
            i8.plan("model.embedding.weight", 64).unwrap(),
            QPlan { format: QFormat::I8, group: 64, bias: false }
        );
        assert!(i8.plan("w", 64).unwrap().label(64) == "int8-ch");
        // The head of an int4 model comes out int6 in groups of 32.
        let x = ramp(4, 64);
        let q = quantize("model.embedding.weight", 4, 64, &x, i4).unwrap();
        assert_eq!((q.format, q.group, q.bias.is_some()), (QFormat::I6, 32, false));
        // A bias on int8 is refused.
        let bad = QPlan { format: QFormat::I8, group: 64, bias: true };
        assert!(quantize_planned("w", 4, 64, &x, bad).unwrap_err().message.contains("bias"));
    }

    /// int4's Q4_K_M-style mix: with the layer count, q_k_v_proj and down_proj of llama.cpp's
    /// more-bits layers are int6 in groups of 32; every other matrix (and every layer without
    /// the count) stays int4.
    #[test]
    fn int4_mix_keeps_the_more_bits_layers_attention_input_and_mlp_output_in_int6() {
        // llama.cpp's use_more_bits for 28 layers: 0-2, 24-27, and 5, 8, ..., 23.
        let more: Vec<usize> = (0..28).filter(|&i| more_bits_layer(i, 28)).collect();
        assert_eq!(more, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]);
        let eight: Vec<usize> = (0..8).filter(|&i| more_bits_layer(i, 8)).collect();
        assert_eq!(eight, [0, 3, 6, 7]);
        let mix = QuantSpec::new(QFormat::I4, None).for_layers(28);
        let label = |spec: QuantSpec, name: &str| spec.plan(name, 256).unwrap().label(256);
        for i in 0..28 {
            let want = if more.contains(&i) { "int6-g32" } else { "int4-g32+bias" };
            for role in ["self_attn.q_k_v_proj", "mlp.down_proj"] {
                assert_eq!(label(mix, &format!("model.layers.{i}.{role}.weight")), want, "layer {i} {role}");
            }
            for role in ["self_attn.out_proj", "mlp.gate_proj", "mlp.up_proj"] {
                assert_eq!(label(mix, &format!("model.layers.{i}.{role}.weight")), "int4-g32+bias", "{i} {role}");
            }
        }
        // Without a layer count, or past it, or for int8: no mix.
        let plain = QuantSpec::new(QFormat::I4, None);
        assert_eq!(label(plain, "model.layers.0.mlp.down_proj.weight"), "int4-g32+bias");
        assert_eq!(
            label(QuantSpec::new(QFormat::I4, None).for_layers(2), "model.layers.5.mlp.down_proj.weight"),
            "int4-g32+bias"
        );
        assert_eq!(
            label(QuantSpec::new(QFormat::I8, Some(32)).for_layers(28), "model.layers.0.mlp.down_proj.weight"),
            "int8-g32"
        );
        // for_layers keeps a count already set.
        assert_eq!(mix.for_layers(8).layers, Some(28));
    }

    fn group_sse(x: &[f32], y: &[f32]) -> f64 {
        x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum()
    }

    /// Every group's error is at most that of the plain min-max grid (one of the candidates;
    /// within 1 % since the steps snap to their super-block's grid, [`snap_steps`]: 0.3 % seen),
    /// and no element is off by more than one min-max step.
    #[test]
    fn asymmetric_int4_round_trip_error_is_bounded() {
        let (r, c) = (64, 256);
        // Pseudo-random values with a different offset and spread per row.
        let x: Vec<f32> = (0..r * c)
            .map(|i| {
                let u = ((i as u64).wrapping_mul(6364136223846793005) >> 40) as f32 / (1u64 << 24) as f32;
                let row = (i / c) as f32;
                (u - 0.3) * (0.1 + row / 16.0) + 0.01 * row
            })
            .collect();
        for g in [32, 64, 128] {
            let q = quantize("w", r, c, &x, QuantSpec::new(QFormat::I4, Some(g))).unwrap();
            let y = q.dequantize();
            for (k, (xg, yg)) in x.chunks(g).zip(y.chunks(g)).enumerate() {
                let (lo, hi) = xg.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| (a.min(v), b.max(v)));
                let step = (hi - lo) / 15.0;
                let minmax: Vec<f32> = xg.iter().map(|&v| lo + step * ((v - lo) / step).round()).collect();
                let (e, e0) = (group_sse(xg, yg), group_sse(xg, &minmax));
                assert!(e <= e0 * 1.01 + 1e-12, "group {g} #{k}: error {e} > min-max grid's {e0}");
                for (a, b) in xg.iter().zip(yg) {
                    assert!((a - b).abs() <= step * 1.001 + 1e-7, "group {g} #{k}: {a} -> {b} (step {step})");
                }
            }
            let snr = snr_db(&x, &y);
            assert!(snr > 24.0, "group {g}: SNR {snr:.1} dB");
        }
    }

    /// On groups whose values are not centred on zero, asymmetric groups are far better than
    /// symmetric ones at the same group size; on centred ones they are no worse.
    #[test]
    fn asymmetric_beats_symmetric_on_skewed_groups() {
        let (r, c, g) = (16, 128, 32);
        let centred: Vec<f32> = (0..r * c).map(|i| ((i * 7919 % 1009) as f32 / 504.5 - 1.0) * 0.05).collect();
        let skewed: Vec<f32> = centred.iter().enumerate().map(|(i, v)| v.abs() + 0.02 * (i % 3) as f32).collect();
        let run = |x: &[f32], bias: bool| {
            let q = quantize_planned("w", r, c, x, QPlan { format: QFormat::I4, group: g, bias }).unwrap();
            snr_db(x, &q.dequantize())
        };
        let (a, s) = (run(&skewed, true), run(&skewed, false));
        assert!(a > s + 4.0, "skewed: asymmetric {a:.1} dB vs symmetric {s:.1} dB");
        let (a, s) = (run(&centred, true), run(&centred, false));
        assert!(a > s - 0.5, "centred: asymmetric {a:.1} dB vs symmetric {s:.1} dB");
    }

    #[test]
    fn constant_and_tiny_groups_are_exact() {
        let mut x = vec![0.25f32; 64];
        x[32..].fill(-3.0);
        let q = quantize("w", 1, 64, &x, QuantSpec::new(QFormat::I4, Some(32))).unwrap();
        assert_eq!(q.dequantize(), x);
        assert_eq!(q.scales.as_slice(), &[0.0, 0.0]);
        // Two distinct values per group: with f32 sides (one group per row) both hit exactly
        // (up to rounding of d * l + m).
        let y: Vec<f32> = (0..64).map(|i| if i % 2 == 0 { 1.5 } else { -0.5 }).collect();
        let row = quantize_planned("w", 1, 64, &y, QPlan { format: QFormat::I4, group: 64, bias: true }).unwrap();
        for (a, b) in y.iter().zip(row.dequantize()) {
            assert!((a - b).abs() < 1e-6, "{a} -> {b}");
        }
        // Groups of 32 also snap their step to 8 significant bits ([`snap_steps`]: at most 2^-8
        // of it, over 15 levels, the offset refitted) and their bias to the super-block's grid
        // ([`snap_biases`]: at most half its unit): within 1/32 of a step plus half that unit.
        let q = quantize("w", 1, 64, &y, QuantSpec::new(QFormat::I4, Some(32))).unwrap();
        let step = 2.0 / 15.0;
        let bmax = q.bias.as_ref().unwrap().iter().fold(0.0f32, |a, b| a.max(b.abs()));
        let tol = step / 32.0 + bias_unit(bmax) / 2.0;
        for (a, b) in y.iter().zip(q.dequantize()) {
            assert!((a - b).abs() < tol, "{a} -> {b}");
        }
    }

    /// Grouped plans store their scales and biases as f16 values: every one is exactly an f16,
    /// the integers are the nearest for the rounded pair, and the error stays that of the
    /// 4-bit (8-bit) grid: within 1 % in SNR terms of the unrounded f32 fit.
    #[test]
    fn grouped_scales_and_biases_are_f16_values() {
        let (r, c) = (16, 256);
        let x = ramp(r, c);
        for plan in [
            QPlan { format: QFormat::I4, group: 32, bias: true },
            QPlan { format: QFormat::I4, group: 64, bias: false },
            QPlan { format: QFormat::I8, group: 32, bias: false },
            QPlan { format: QFormat::I6, group: 32, bias: false },
        ] {
            let q = quantize_planned("w", r, c, &x, plan).unwrap();
            assert!(q.half_sides(), "{plan:?}");
            assert!(q.scales.iter().chain(q.bias.iter().flat_map(|b| b.iter())).all(|&v| is_f16_exact(v)));
            let y = q.dequantize();
            // Each value's integer is the nearest on its group's (rounded) grid.
            for row in 0..r {
                for col in 0..c {
                    let k = row * (c / plan.group) + col / plan.group;
                    let (s, b) = (q.scales[k], q.bias.as_ref().map_or(0.0, |b| b[k]));
                    let e = (x[row * c + col] - y[row * c + col]).abs();
                    let lo = if plan.format == QFormat::I8 { -127 } else { -plan.format.zero() };
                    let hi = plan.format.max();
                    let best =
                        (lo..=hi).map(|l| (x[row * c + col] - (s * l as f32 + b)).abs()).fold(f32::MAX, f32::min);
                    assert!(e <= best + 1e-6 * (1.0 + best), "{plan:?} row {row} col {col}: {e} vs {best}");
                }
            }
            // The same plan with f32 sides, through the per-group functions directly.
            let mut qs = vec![0i8; plan.group];
            let mut yf = vec![0.0f32; r * c];
            for (gi, (xg, yg)) in x.chunks(plan.group).zip(yf.chunks_mut(plan.group)).enumerate() {
                let (s, b) = match (plan.format, plan.bias) {
                    (QFormat::I8, _) => (quantize_group_i8(xg, &mut qs, false), 0.0),
                    (QFormat::I4, true) => quantize_group_i4_asym(xg, fit_i4_asym(xg), &mut qs, false),
                    (f, _) => (quantize_group_sym(xg, &mut qs, false, f), 0.0),
                };
                assert!(gi < r * c / plan.group);
                for (o, &l) in yg.iter_mut().zip(&qs) {
                    *o = s * l as f32 + b;
                }
            }
            let (h, f) = (snr_db(&x, &y), snr_db(&x, &yf));
            assert!(h > 0.99 * f, "{plan:?}: f16 sides {h:.2} dB vs f32 {f:.2} dB");
        }
        // Per-row scales stay f32 (not rounded).
        let q = quantize("w", r, c, &x, QuantSpec::new(QFormat::I8, None)).unwrap();
        assert!(!q.half_sides());
        assert!(q.scales.iter().any(|&v| !is_f16_exact(v)));
    }

    /// Asymmetric int4 groups shorter than a super-block: each super-block's steps are `k u`
    /// with one power of two `u` ([`super_unit`] of the largest) and integers `k <= 255`, its
    /// biases `k u` with `|k| <= 127` ([`bias_unit`]), and the fidelity stays within 0.5 dB of
    /// the unconstrained per-group fit.
    #[test]
    fn int4_steps_share_a_power_of_two_unit_per_super_block() {
        let (r, c) = (6, 768);
        // Rows whose groups differ in range by up to 100x (small steps are the hard case).
        let x: Vec<f32> =
            ramp(r, c).iter().enumerate().map(|(i, v)| v * (1.0 + ((i % c) / 32 % 7) as f32).powi(2) * 0.01).collect();
        for g in [32, 64, 128] {
            let q = quantize("w", r, c, &x, QuantSpec::new(QFormat::I4, Some(g))).unwrap();
            for (i, sb) in q.scales.chunks(SUPER_COLS / g).enumerate() {
                let dmax = sb.iter().fold(0.0f32, |a, &v| a.max(v));
                assert!(dmax > 0.0);
                let u = super_unit(dmax);
                assert!(u.log2().fract() == 0.0 && dmax / u <= 255.0 && dmax / u > 127.0, "g{g} super-block {i}");
                for &v in sb {
                    assert!((v / u).fract() == 0.0 && is_f16_exact(v), "g{g} super-block {i}: {v} is not k * {u}");
                }
            }
            // The biases likewise: `k u` with `|k| <= 127`, `u` the power of two of the largest.
            let bias = q.bias.as_ref().unwrap();
            let mut spread = 0usize;
            for (i, sb) in bias.chunks(SUPER_COLS / g).enumerate() {
                let bmax = sb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let u = bias_unit(bmax);
                assert!(u.log2().fract() == 0.0 && bmax / u <= 127.0 && (bmax == 0.0 || bmax / u > 63.0), "g{g} {i}");
                for &v in sb {
                    assert!((v / u).fract() == 0.0 && is_f16_exact(v), "g{g} super-block {i}: bias {v} is not k * {u}");
                }
                spread += usize::from(sb.iter().any(|&v| v != sb[0]));
            }
            assert!(spread > 0, "g{g}: the biases must not all be equal");
            let mut free = vec![0.0f32; r * c];
            let mut qs = vec![0i8; g];
            for (xg, yg) in x.chunks(g).zip(free.chunks_mut(g)) {
                let (s, b) = quantize_group_i4_asym(xg, fit_i4_asym(xg), &mut qs, true);
                for (o, &l) in yg.iter_mut().zip(&qs) {
                    *o = s * l as f32 + b;
                }
            }
            let (snapped, unconstrained) = (snr_db(&x, &q.dequantize()), snr_db(&x, &free));
            assert!(snapped > unconstrained - 0.5, "g{g}: {snapped:.2} dB vs {unconstrained:.2} dB");
        }
    }

    /// The bit test agrees with an f16 round trip on normal, subnormal, boundary and
    /// out-of-range values.
    #[test]
    fn f16_exactness_matches_a_round_trip() {
        let mut seed = 7u64;
        let mut vals = vec![0.0f32, -0.0, 65504.0, 65520.0, 6.1035156e-5, 5.9604645e-8, 2.9802322e-8, 1e-9, 1e30];
        for _ in 0..20000 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let bits = (seed >> 32) as u32;
            let v = f32::from_bits(bits);
            if v.is_finite() {
                vals.push(v);
                vals.push(half::f16::from_f32(v).to_f32());
            }
        }
        for e in -30..20 {
            let v = 2f32.powi(e);
            vals.extend([v, -v, v * 1.5, v * (1.0 + 2f32.powi(-10)), v * (1.0 + 2f32.powi(-11))]);
        }
        let mut exact = 0;
        for v in vals {
            let h = half::f16::from_f32(v).to_f32();
            let want = h.is_finite() && h == v;
            assert_eq!(is_f16_exact(v), want, "{v:e} ({:#010x})", v.to_bits());
            exact += usize::from(want);
        }
        assert!(exact > 10000, "too few exact values exercised: {exact}");
    }

    /// `fits_f16` admits exactly the values whose f16 rounding stays within 2^-11 of them, and
    /// `sides_fit_f16` holds for K-quant-like products but not for per-row scales or values
    /// outside f16's normal range.
    #[test]
    fn f16_fit_bounds_the_rounding_error() {
        let mut seed = 11u64;
        let mut fit = 0;
        for _ in 0..20000 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let v = f32::from_bits((seed >> 32) as u32);
            if !v.is_finite() {
                continue;
            }
            let h = half::f16::from_f32(v).to_f32();
            if fits_f16(v) {
                fit += 1;
                assert!(h.is_finite() && (h - v).abs() <= v.abs() * 2f32.powi(-11), "{v:e} -> {h:e}");
            } else {
                assert!(!is_f16_exact(v) && (v.abs() < 2f32.powi(-14) || v.abs() > 65504.0), "{v:e}");
            }
        }
        assert!(fit > 1000, "too few values in range: {fit}");
        assert!(fits_f16(65504.0) && !fits_f16(65505.0) && fits_f16(2f32.powi(-14)) && fits_f16(2f32.powi(-24)));
        assert!(!fits_f16(1.5 * 2f32.powi(-24)) && !fits_f16(f32::NAN) && !fits_f16(f32::INFINITY));
        // A K-quant-like tensor: d (an f16) times 6-bit integers, 8 groups per row.
        let d = half::f16::from_f32(0.0123).to_f32();
        let mut t = QTensor {
            name: "k".into(),
            format: QFormat::I4,
            rows: 2,
            cols: 256,
            group: 32,
            q: TensorBytes::Owned(Arc::new(vec![0x88; 256])),
            scales: Arc::new((0..16).map(|i| d * (i * 4 + 3) as f32).collect()),
            bias: Some(Arc::new((0..16).map(|i| -d * (i + 40) as f32 * 0.37).collect())),
        };
        t.validate().unwrap();
        assert!(!t.half_sides() && t.sides_fit_f16());
        assert_eq!(t.nbytes_served(true), 256 + 2 * 32);
        assert_eq!(t.nbytes_served(false), 256 + 4 * 32);
        assert_eq!(t.nbytes(), 256 + 4 * 32);
        // A bias near zero (subnormal in f16) fits beside a normal scale, not beside a zero one.
        t.bias = Some(Arc::new((0..16).map(|i| if i == 3 { 1.234e-7 } else { -d }).collect()));
        assert!(t.sides_fit_f16());
        t.scales = Arc::new((0..16).map(|i| if i == 3 { 0.0 } else { d }).collect());
        assert!(!t.sides_fit_f16());
        t.scales = Arc::new((0..16).map(|i| if i == 5 { 1e-7 } else { d }).collect());
        assert!(!t.sides_fit_f16());
        // One scale per row: nothing to gain, never held as f16.
        t.group = 256;
        t.scales = Arc::new(vec![d, d]);
        t.bias = None;
        assert!(!t.sides_fit_f16());
    }

    #[test]
    fn scale_search_beats_plain_absmax() {
        let x = ramp(1, 64);
        let mut q = vec![0i8; 64];
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for f in [QFormat::I4, QFormat::I6] {
            let s = quantize_group_sym(&x, &mut q, false, f);
            let (lo, hi) = (-(f.zero() as f32), f.max() as f32);
            assert!(err_sym(&x, s, lo, hi) <= err_sym(&x, amax / hi, lo, hi), "{f}");
        }
    }

    #[test]
    fn bad_groups_and_values_are_refused_by_name() {
        let x = ramp(2, 96);
        let e = quantize("blk.w", 2, 96, &x, QuantSpec::new(QFormat::I4, Some(64))).unwrap_err();
        assert!(e.message.contains("blk.w") && e.message.contains("64"), "{e}");
        let mut y = x.clone();
        y[100] = f32::NAN;
        let e = quantize("blk.w", 2, 96, &y, QuantSpec::new(QFormat::I8, None)).unwrap_err();
        assert!(e.message.contains("row 1") && e.message.contains("col 4"), "{e}");
    }

    #[test]
    fn blockwise_tensor_quantization_equals_whole_matrix() {
        let (r, c) = (40_000, 64); // more than two decode blocks of 2^20 values
        let x: Vec<f32> = (0..r * c).map(|i| ((i * 2654435761usize % 2001) as f32 - 1000.0) / 997.0).collect();
        let t = Tensor::from_f32("m", vec![r, c], DType::BF16, &x);
        let xb = t.to_f32();
        for spec in [QuantSpec::new(QFormat::I8, None), QuantSpec::new(QFormat::I4, Some(32))] {
            let a = quantize_tensor(&t, spec).unwrap();
            let b = quantize("m", r, c, &xb, spec).unwrap();
            assert_eq!(a.q.as_slice(), b.q.as_slice());
            assert_eq!(a.scales, b.scales);
            assert_eq!(a.bias, b.bias);
            assert_eq!(a.bias.is_some(), spec.format == QFormat::I4);
        }
        let mut y = xb.clone();
        y[(r - 1) * c + 3] = f32::INFINITY;
        let t = Tensor::from_f32("m", vec![r, c], DType::F32, &y);
        let e = quantize_tensor(&t, QuantSpec::new(QFormat::I8, None)).unwrap_err();
        assert!(e.message.contains(&format!("row {}", r - 1)) && e.message.contains("col 3"), "{e}");
    }

    #[test]
    fn zero_rows_quantize_to_zero() {
        let x = vec![0.0; 64];
        let q = quantize("z", 1, 64, &x, QuantSpec::new(QFormat::I4, Some(32))).unwrap();
        assert!(q.dequantize().iter().all(|&v| v == 0.0));
    }
}
