//! Weights as the CPU kernels read them: straight from the memory-mapped checkpoint when the
//! stored type is the compute type and the data is aligned, otherwise converted once at load;
//! quantized matrices repacked for the integer kernels ([`QMat`]).

use std::borrow::Cow;

use spark_core::quant::{QFormat, QTensor};
use spark_core::weights::{Tensor as HostTensor, TensorBytes};
use spark_core::{DType, Error, Result};

use crate::kernels::matmul::Mat;
use crate::kernels::qmatmul::QMat;
use crate::kernels::Row;

enum Store {
    /// Checkpoint bytes used in place (checked aligned for the element type).
    Mapped(TensorBytes),
    F32(Vec<f32>),
    U16(Vec<u16>),
    /// An int8/int4 matrix in the integer kernels' layout.
    Quant(QMat),
}

/// An uploaded weight: a vector (`rows == 1`) or an `[rows, cols]` matrix.
pub struct CpuWeight {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    store: Store,
}

impl CpuWeight {
    /// Take `t` in `dtype`: in place when possible, converted otherwise.
    pub fn from_host(t: &HostTensor, dtype: DType) -> Result<CpuWeight> {
        let (rows, cols) = match t.shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            s => return Err(Error::model(format!("tensor '{}' has shape {s:?}; expected 1 or 2 dims", t.name))),
        };
        let bytes = t.bytes();
        let aligned = (bytes.as_ptr() as usize).is_multiple_of(t.dtype.size());
        let store = if t.dtype == dtype && aligned {
            Store::Mapped(t.data.clone())
        } else {
            let mut v = Vec::with_capacity(rows * cols);
            spark_core::dtype::decode_into(t.dtype, bytes, &mut v);
            match dtype {
                DType::F32 => Store::F32(v),
                DType::BF16 => Store::U16(v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect()),
                DType::F16 => Store::U16(v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect()),
            }
        };
        Ok(CpuWeight { rows, cols, dtype, store })
    }

    /// Repack a quantized matrix for the integer kernels (`dtype`: the compute type, for
    /// reporting). `None` when its groups are not multiples of 16 (callers dequantize instead).
    pub fn from_quant(q: &QTensor, dtype: DType) -> Result<Option<CpuWeight>> {
        q.validate()?;
        if !QMat::supports(q) {
            return Ok(None);
        }
        Ok(Some(CpuWeight { rows: q.rows, cols: q.cols, dtype, store: Store::Quant(QMat::from_qtensor(q)) }))
    }

    /// The repacked quantized matrix, if this weight is one.
    pub fn quant(&self) -> Option<&QMat> {
        match &self.store {
            Store::Quant(q) => Some(q),
            _ => None,
        }
    }

    /// The integer format and group size the kernels use for this weight (`None`: float).
    pub fn quant_format(&self) -> Option<(QFormat, usize)> {
        self.quant().map(|q| (q.format, q.group))
    }

    fn f32s(&self) -> &[f32] {
        match &self.store {
            Store::Mapped(b) => bytemuck::cast_slice(b.as_slice()),
            Store::F32(v) => v,
            Store::U16(_) | Store::Quant(_) => &[],
        }
    }

    fn u16s(&self) -> &[u16] {
        match &self.store {
            Store::Mapped(b) => bytemuck::cast_slice(b.as_slice()),
            Store::U16(v) => v,
            Store::F32(_) | Store::Quant(_) => &[],
        }
    }

    /// The whole weight as a matrix view (float weights only: see [`CpuWeight::quant`]).
    pub fn mat(&self) -> Mat<'_> {
        assert!(self.quant().is_none(), "CpuWeight::mat on a quantized weight");
        match self.dtype {
            DType::F32 => Mat::F32(self.f32s()),
            DType::BF16 => Mat::BF16(self.u16s()),
            DType::F16 => Mat::F16(self.u16s()),
        }
    }

    /// Row `r` (float weights only: quantized ones have [`CpuWeight::dequant_row`]).
    pub fn row(&self, r: usize) -> Row<'_> {
        self.mat().row(r, self.cols)
    }

    /// Row `r` as f32 into `out` (`cols` long), dequantized if quantized.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        match &self.store {
            Store::Quant(q) => q.dequant_row(r, out),
            _ => {
                let row = self.row(r);
                for (j, v) in out.iter_mut().enumerate() {
                    *v = row.get(j);
                }
            }
        }
    }

    /// All elements as f32 (borrowed when stored as f32).
    pub fn f32_vec(&self) -> Cow<'_, [f32]> {
        if let Store::Quant(q) = &self.store {
            let mut v = vec![0.0; self.rows * self.cols];
            for (r, row) in v.chunks_exact_mut(self.cols).enumerate() {
                q.dequant_row(r, row);
            }
            return Cow::Owned(v);
        }
        match self.dtype {
            DType::F32 => Cow::Borrowed(self.f32s()),
            _ => {
                let r = self.row(0);
                Cow::Owned(
                    (0..self.rows * self.cols)
                        .map(|i| if self.rows == 1 { r.get(i) } else { self.row(i / self.cols).get(i % self.cols) })
                        .collect(),
                )
            }
        }
    }

    /// Bytes held in anonymous memory (0 when used in place from the mapped file).
    pub fn owned_bytes(&self) -> usize {
        match &self.store {
            Store::Mapped(_) => 0,
            Store::F32(v) => v.len() * 4,
            Store::U16(v) => v.len() * 2,
            Store::Quant(q) => q.nbytes(),
        }
    }
}
