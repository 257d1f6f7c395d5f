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
//!   symmetric per output channel (`group == cols`, no bias); GGUF Q8_0 (group 32) and Q6_K
//!   (group 16) convert to it losslessly.
//! - [`QFormat::I4`]: `q` is an unsigned nibble 0..=15 (`zero` = 8), two per byte: element `2j`
//!   of a row in the low nibble of byte `j`, `2j+1` in the high nibble. `--to int4` writes it
//!   symmetric with a searched scale per group (32, 64 or 128; no bias); GGUF Q4_0 and Q4_K
//!   (whose per-group minimum becomes `bias`) convert to it losslessly.
//!
//! Backends repack these into their kernels' layouts at upload; this module is the reference
//! every kernel is tested against.
//!
//! On disk (safetensors written by `spark-run quantize`): the weight keeps its name and holds `q`
//! (I8 `[rows, cols]`, or U8 `[rows, cols/2]` for int4), `NAME_scale` holds the f32 scales
//! `[rows, cols/group]` (so the group size is `cols / scale_cols`) and `NAME_bias`, if present,
//! the f32 biases of the same shape; `config.json` carries
//! `"quantization_config": {"quant_method": "spark", "format": "int8"|"int4", "group_size": G}`.

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
}

impl QFormat {
    /// `int8` / `int4`.
    pub fn name(self) -> &'static str {
        match self {
            QFormat::I8 => "int8",
            QFormat::I4 => "int4",
        }
    }
    /// Parse `int8`/`i8`/`q8` or `int4`/`i4`/`q4`.
    pub fn parse(s: &str) -> Result<QFormat> {
        match s.to_ascii_lowercase().as_str() {
            "int8" | "i8" | "q8" => Ok(QFormat::I8),
            "int4" | "i4" | "q4" => Ok(QFormat::I4),
            _ => Err(Error::invalid(format!("unknown quantization '{s}' (expected int8 or int4)"))),
        }
    }
    /// The value that means 0 before scaling.
    pub fn zero(self) -> i32 {
        match self {
            QFormat::I8 => 0,
            QFormat::I4 => 8,
        }
    }
    /// Bytes of `q` for one row of `cols` values.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            QFormat::I8 => cols,
            QFormat::I4 => cols / 2,
        }
    }
}

impl std::fmt::Display for QFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What to quantize to: a format and a group size (`None`: per output channel for int8, 64 for
/// int4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    pub format: QFormat,
    pub group: Option<usize>,
}

impl QuantSpec {
    /// The group size this spec gives a matrix of `cols` columns, checked.
    pub fn group_for(&self, name: &str, cols: usize) -> Result<usize> {
        let g = match (self.format, self.group) {
            (QFormat::I8, None) => cols,
            (QFormat::I4, None) => 64,
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

    /// Bytes of values, scales and biases.
    pub fn nbytes(&self) -> usize {
        self.q.as_slice().len() + 4 * self.scales.len() * (1 + usize::from(self.bias.is_some()))
    }

    /// Bits per weight, scales included.
    pub fn bits_per_weight(&self) -> f64 {
        self.nbytes() as f64 * 8.0 / (self.rows * self.cols) as f64
    }
}

/// Quantize the `[rows, cols]` f32 matrix `values` (row-major).
///
/// int8: symmetric, `scale = max|x| / 127` per group (per row by default). int4: symmetric with
/// values -8..=7; each group's scale is searched among `max|x| / d` for d in 6.0..=8.5 (step
/// 0.125), then refined once by least squares for the chosen integers, keeping whichever gives
/// the smallest squared error.
pub fn quantize(name: &str, rows: usize, cols: usize, values: &[f32], spec: QuantSpec) -> Result<QTensor> {
    if values.len() != rows * cols {
        return Err(Error::internal(format!("quantize '{name}': {} values for shape [{rows}, {cols}]", values.len())));
    }
    let group = spec.group_for(name, cols)?;
    let mut q = vec![0u8; rows * spec.format.row_bytes(cols)];
    let mut scales = vec![0.0f32; rows * (cols / group)];
    quantize_rows(name, 0, cols, group, spec.format, values, &mut q, &mut scales)?;
    finish(name, rows, cols, group, spec.format, q, scales)
}

fn finish(
    name: &str,
    rows: usize,
    cols: usize,
    group: usize,
    format: QFormat,
    q: Vec<u8>,
    s: Vec<f32>,
) -> Result<QTensor> {
    let t = QTensor {
        name: name.to_string(),
        format,
        rows,
        cols,
        group,
        q: TensorBytes::Owned(Arc::new(q)),
        scales: Arc::new(s),
        bias: None,
    };
    t.validate()?;
    Ok(t)
}

/// Quantize whole rows `values` (starting at row `row0` of the matrix, for error messages) into
/// `q` and `scales`, rows in parallel (the int4 scale search is the costly part).
#[allow(clippy::too_many_arguments)]
fn quantize_rows(
    name: &str,
    row0: usize,
    cols: usize,
    group: usize,
    format: QFormat,
    values: &[f32],
    q: &mut [u8],
    scales: &mut [f32],
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
    let ng = cols / group;
    let rb = format.row_bytes(cols);
    q.par_chunks_mut(rb.max(1)).zip(scales.par_chunks_mut(ng.max(1))).enumerate().for_each(|(r, (qrow, srow))| {
        let row = &values[r * cols..(r + 1) * cols];
        let mut qs = vec![0i8; group];
        qrow.fill(0);
        for (g, s_out) in srow.iter_mut().enumerate() {
            let x = &row[g * group..(g + 1) * group];
            *s_out = match format {
                QFormat::I8 => quantize_group_i8(x, &mut qs),
                QFormat::I4 => quantize_group_i4(x, &mut qs),
            };
            for (j, &v) in qs.iter().enumerate() {
                let c = g * group + j;
                match format {
                    QFormat::I8 => qrow[c] = v as u8,
                    QFormat::I4 => qrow[c / 2] |= ((v as i32 + 8) as u8) << (4 * (c % 2)),
                }
            }
        }
    });
    Ok(())
}

/// Quantize a float checkpoint tensor (`[rows, cols]`), decoding it to f32 a block of rows at a
/// time so that no full f32 copy of a large matrix (the 131072-row embedding) is ever made.
pub fn quantize_tensor(t: &Tensor, spec: QuantSpec) -> Result<QTensor> {
    let (rows, cols) = match t.shape.as_slice() {
        [r, c] => (*r, *c),
        s => return Err(Error::invalid(format!("cannot quantize '{}' of shape {s:?}: not a matrix", t.name))),
    };
    let group = spec.group_for(&t.name, cols)?;
    let (rb, ng) = (spec.format.row_bytes(cols), cols / group);
    let mut q = vec![0u8; rows * rb];
    let mut scales = vec![0.0f32; rows * ng];
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
            group,
            spec.format,
            &vals,
            &mut q[r0 * rb..r1 * rb],
            &mut scales[r0 * ng..r1 * ng],
        )?;
    }
    finish(&t.name, rows, cols, group, spec.format, q, scales)
}

/// Round to nearest (ties to even) for |x| < 2^22, in plain f32 arithmetic: `f32::round` is a
/// library call, and the int4 scale search rounds every value ~20 times.
#[inline(always)]
fn rint(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (x + MAGIC) - MAGIC
}

fn quantize_group_i8(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let s = amax / 127.0;
    let inv = 1.0 / s;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = rint(v * inv).clamp(-127.0, 127.0) as i8;
    }
    s
}

fn err_i4(x: &[f32], s: f32) -> f32 {
    let inv = 1.0 / s;
    let e = |v: f32| {
        let d = v - s * rint(v * inv).clamp(-8.0, 7.0);
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

fn quantize_group_i4(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let mut best = (f32::INFINITY, amax / 7.0);
    let mut d = 6.0f32;
    while d <= 8.5 {
        let s = amax / d;
        let e = err_i4(x, s);
        if e < best.0 {
            best = (e, s);
        }
        d += 0.125;
    }
    // One least-squares refinement of the scale for the integers the best scale chose.
    let s0 = best.1;
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for &v in x {
        let qi = rint(v / s0).clamp(-8.0, 7.0) as f64;
        num += v as f64 * qi;
        den += qi * qi;
    }
    if den > 0.0 {
        let s1 = (num / den) as f32;
        if s1 > 0.0 && s1.is_finite() {
            let e1 = err_i4(x, s1);
            if e1 < best.0 {
                best = (e1, s1);
            }
        }
    }
    let s = best.1;
    let inv = 1.0 / s;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = rint(v * inv).clamp(-8.0, 7.0) as i8;
    }
    s
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
        let q = quantize("w", r, c, &x, QuantSpec { format: QFormat::I8, group: None }).unwrap();
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

    #[test]
    fn int4_groups_and_packing() {
        let (r, c) = (3, 128);
        let x = ramp(r, c);
        for g in [32, 64, 128] {
            let q = quantize("w", r, c, &x, QuantSpec { format: QFormat::I4, group: Some(g) }).unwrap();
            assert_eq!(q.q.as_slice().len(), r * c / 2);
            assert_eq!(q.scales.len(), r * c / g);
            let y = q.dequantize();
            // Each value is scale * (an integer in -8..=7).
            for row in 0..r {
                for col in 0..c {
                    let v = q.qval(row, col);
                    assert!((-8..=7).contains(&v));
                    let s = q.scales[row * (c / g) + col / g];
                    assert_eq!(y[row * c + col], s * v as f32);
                }
            }
            let snr = snr_db(&x, &y);
            assert!(snr > 15.0, "group {g}: snr {snr}");
        }
    }

    #[test]
    fn scale_search_beats_plain_absmax() {
        let x = ramp(1, 64);
        let mut q = vec![0i8; 64];
        let s = quantize_group_i4(&x, &mut q);
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(err_i4(&x, s) <= err_i4(&x, amax / 7.0));
    }

    #[test]
    fn bad_groups_and_values_are_refused_by_name() {
        let x = ramp(2, 96);
        let e = quantize("blk.w", 2, 96, &x, QuantSpec { format: QFormat::I4, group: Some(64) }).unwrap_err();
        assert!(e.message.contains("blk.w") && e.message.contains("64"), "{e}");
        let mut y = x.clone();
        y[100] = f32::NAN;
        let e = quantize("blk.w", 2, 96, &y, QuantSpec { format: QFormat::I8, group: None }).unwrap_err();
        assert!(e.message.contains("row 1") && e.message.contains("col 4"), "{e}");
    }

    #[test]
    fn blockwise_tensor_quantization_equals_whole_matrix() {
        let (r, c) = (40_000, 64); // more than two decode blocks of 2^20 values
        let x: Vec<f32> = (0..r * c).map(|i| ((i * 2654435761usize % 2001) as f32 - 1000.0) / 997.0).collect();
        let t = Tensor::from_f32("m", vec![r, c], DType::BF16, &x);
        let xb = t.to_f32();
        for spec in [QuantSpec { format: QFormat::I8, group: None }, QuantSpec { format: QFormat::I4, group: Some(32) }]
        {
            let a = quantize_tensor(&t, spec).unwrap();
            let b = quantize("m", r, c, &xb, spec).unwrap();
            assert_eq!(a.q.as_slice(), b.q.as_slice());
            assert_eq!(a.scales, b.scales);
        }
        let mut y = xb.clone();
        y[(r - 1) * c + 3] = f32::INFINITY;
        let t = Tensor::from_f32("m", vec![r, c], DType::F32, &y);
        let e = quantize_tensor(&t, QuantSpec { format: QFormat::I8, group: None }).unwrap_err();
        assert!(e.message.contains(&format!("row {}", r - 1)) && e.message.contains("col 3"), "{e}");
    }

    #[test]
    fn zero_rows_quantize_to_zero() {
        let x = vec![0.0; 64];
        let q = quantize("z", 1, 64, &x, QuantSpec { format: QFormat::I4, group: Some(32) }).unwrap();
        assert!(q.dequantize().iter().all(|&v| v == 0.0));
    }
}
