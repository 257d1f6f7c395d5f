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
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F32 => x,
            DType::BF16 => half::bf16::from_f32(x).to_f32(),
            DType::F16 => half::f16::from_f32(x).to_f32(),
        }
    }
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
