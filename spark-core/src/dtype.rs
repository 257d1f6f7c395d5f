//! Element types of stored weights and activations, and the conversions between them.

use crate::error::{Error, Result};

/// A floating-point storage type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The name used on the command line and in `config.json` style (`f32`, `bf16`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// Parse a command-line or config name: `f32`/`float32`, `bf16`/`bfloat16`, `f16`/`float16`.
    pub fn parse(s: &str) -> Result<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "float16" | "fp16" | "half" => Ok(DType::F16),
            _ => Err(Error::invalid(format!("unsupported dtype '{s}' (expected f32, bf16 or f16)"))),
        }
    }

    /// Round an f32 value to this type and back (the identity for F32).
    #[inline(always)]
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F32 => x,
            DType::BF16 => round_bf16(x),
            DType::F16 => half::f16::from_f32(x).to_f32(),
        }
    }
}

/// `x` rounded to the nearest bf16 (ties to even) and widened back, as `half::bf16::from_f32`
/// does, but branch-free so loops over it vectorize. NaN stays NaN (quieted).
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    let quiet_nan = (b | 0x0040_0000) & 0xffff_0000;
    f32::from_bits(if x.is_nan() { quiet_nan } else { rounded })
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Decode little-endian stored elements of `dtype` into f32, appending to `out`.
pub fn decode_into(dtype: DType, bytes: &[u8], out: &mut Vec<f32>) {
    out.reserve(bytes.len() / dtype.size());
    match dtype {
        DType::F32 => out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        DType::BF16 => {
            out.extend(bytes.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()))
        }
        DType::F16 => {
            out.extend(bytes.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()))
        }
    }
}

/// Encode f32 values as little-endian elements of `dtype` (round to nearest even).
pub fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        match dtype {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_bf16_equals_half_on_edge_cases_and_a_sweep() {
        let mut cases = vec![
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x3f80_8000), // a tie that rounds to even (down)
            f32::from_bits(0x3f81_8000), // a tie that rounds to even (up)
            f32::from_bits(0x7f7f_ffff), // rounds up to infinity
        ];
        let mut bits = 0x0123_4567u32;
        for _ in 0..200_000 {
            bits = bits.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            cases.push(f32::from_bits(bits));
        }
        for x in cases {
            let want = half::bf16::from_f32(x).to_f32();
            let got = round_bf16(x);
            if x.is_nan() {
                assert!(got.is_nan(), "{x:e} ({:#x})", x.to_bits());
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{x:e} ({:#x})", x.to_bits());
            }
        }
    }
}
