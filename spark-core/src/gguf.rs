//! GGUF (llama.cpp's single-file model format), architecture `spark2_5` (SPARK.md section 7).
//!
//! - [`GgufFile`]: a GGUF v2/v3 file over a memory map: header, metadata of every value type
//!   (arrays included), tensor infos and their data ranges. Every count, length and offset is
//!   checked against the file, so a truncated or corrupt file gives an error that names the file
//!   and the key, tensor or offset at fault, never a panic or an out-of-bounds read.
//! - [`GgufFile::config`]: the `spark2_5.*` keys -> a [`ModelConfig`], validated by the same code
//!   as `config.json`.
//! - [`GgufFile::weights`]: the tensors -> the same [`ModelWeights`] the safetensors path fills.
//!   F32/F16/BF16 stay float tensors (used in place from the map); the quantized kinds convert
//!   losslessly (exact up to the f32 rounding of a product or a sum) to [`QTensor`]s:
//!   Q8_0/Q8_1 -> int8 group 32, Q8_K -> int8 group 256, Q6_K -> int6 group 16 (`q - 32`),
//!   Q5_0 -> int8 group 32, Q5_1/Q5_K -> int8 group 32 with bias, Q4_0 -> int4 group 32,
//!   Q4_1/Q4_K -> int4 group 32 with bias, Q3_K -> int4 group 16, Q2_K -> int4 group 16 with
//!   bias. Other kinds (IQ*, TQ*, MXFP4, ...) are refused by name.
//! - [`GgufFile::check_tensors`], [`GgufFile::layer_weights`], [`GgufFile::embedding_weight`]:
//!   the same, checked from the headers first and converted one piece at a time, which is how
//!   [`crate::Model::load`] uploads a GGUF file (a converted tensor lives only until its upload);
//!   [`GgmlType::served_plan`]: the layout a kind converts to, without converting.
//! - [`GgufFile::tokenizer`], [`GgufFile::chat_template`]: the `tokenizer.ggml.*` byte-level BPE
//!   as a Hugging Face tokenizer, and `tokenizer.chat_template`.
//! - [`load`] / [`is_gguf`]: what [`crate::Model::load`] uses for a `.gguf` path; [`write()`]: a
//!   minimal writer (tests, conversions).
//!
//! GGUF dims are innermost first: `ne[0]` is the row length, so a `[rows, cols]` matrix is stored
//! with dims `[cols, rows]`.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde_json::{json, Map, Value as Json};

use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::quant::{QFormat, QPlan, QTensor};
use crate::tokenizer::{tokens as tk, Tokenizer};
use crate::weights::{LayerWeights, ModelWeights, Tensor, TensorBytes, Weight};

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// The `general.architecture` this engine runs.
pub const ARCH: &str = "spark2_5";
/// Nested arrays deeper than this are refused (no GGUF writer produces more than 2).
const MAX_DEPTH: usize = 8;

/// The type tag of a metadata value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    Str,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    fn from_u32(t: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match t {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => Str,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }
    fn code(self) -> u32 {
        use ValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            Str => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }
    /// The fewest bytes one value of this type takes in a file.
    fn min_size(self) -> usize {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | Str => 8,
            Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    /// The element type (kept for empty arrays) and the elements.
    Array(ValueType, Vec<Value>),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::Str(_) => ValueType::Str,
            Value::Array(..) => ValueType::Array,
        }
    }
    /// A non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// An integer of any width.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().map(|v| v as i64),
        }
    }
    /// A number (integer or float).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }
    /// A short description for error messages: the type, and the value when it is short.
    fn describe(&self) -> String {
        match self {
            Value::Str(s) if s.len() <= 40 => format!("string '{s}'"),
            Value::Str(s) => format!("string of {} bytes", s.len()),
            Value::Array(t, v) => format!("array of {} {:?}", v.len(), t),
            other => format!("{other:?}"),
        }
    }
}

/// A ggml tensor type (`enum ggml_type`), by its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q5_0: GgmlType = GgmlType(6);
    pub const Q5_1: GgmlType = GgmlType(7);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const Q8_1: GgmlType = GgmlType(9);
    pub const Q2_K: GgmlType = GgmlType(10);
    pub const Q3_K: GgmlType = GgmlType(11);
    pub const Q4_K: GgmlType = GgmlType(12);
    pub const Q5_K: GgmlType = GgmlType(13);
    pub const Q6_K: GgmlType = GgmlType(14);
    pub const Q8_K: GgmlType = GgmlType(15);
    pub const IQ2_XXS: GgmlType = GgmlType(16);
    pub const IQ4_NL: GgmlType = GgmlType(20);
    pub const BF16: GgmlType = GgmlType(30);

    /// (name, elements per block, bytes per block) of every type ggml defines.
    fn table(self) -> Option<(&'static str, usize, usize)> {
        Some(match self.0 {
            0 => ("F32", 1, 4),
            1 => ("F16", 1, 2),
            2 => ("Q4_0", 32, 18),
            3 => ("Q4_1", 32, 20),
            6 => ("Q5_0", 32, 22),
            7 => ("Q5_1", 32, 24),
            8 => ("Q8_0", 32, 34),
            9 => ("Q8_1", 32, 36),
            10 => ("Q2_K", 256, 84),
            11 => ("Q3_K", 256, 110),
            12 => ("Q4_K", 256, 144),
            13 => ("Q5_K", 256, 176),
            14 => ("Q6_K", 256, 210),
            15 => ("Q8_K", 256, 292),
            16 => ("IQ2_XXS", 256, 66),
            17 => ("IQ2_XS", 256, 74),
            18 => ("IQ3_XXS", 256, 98),
            19 => ("IQ1_S", 256, 50),
            20 => ("IQ4_NL", 32, 18),
            21 => ("IQ3_S", 256, 110),
            22 => ("IQ2_S", 256, 82),
            23 => ("IQ4_XS", 256, 136),
            24 => ("I8", 1, 1),
            25 => ("I16", 1, 2),
            26 => ("I32", 1, 4),
            27 => ("I64", 1, 8),
            28 => ("F64", 1, 8),
            29 => ("IQ1_M", 256, 56),
            30 => ("BF16", 1, 2),
            34 => ("TQ1_0", 256, 54),
            35 => ("TQ2_0", 256, 66),
            39 => ("MXFP4", 32, 17),
            _ => return None,
        })
    }
    /// `Q4_K`, `BF16`, ... (`type 99` for a number ggml does not define).
    pub fn name(self) -> String {
        self.table().map_or_else(|| format!("type {}", self.0), |t| t.0.to_string())
    }
    /// (elements, bytes) of one block.
    pub fn block(self) -> Option<(usize, usize)> {
        self.table().map(|t| (t.1, t.2))
    }
    /// The float type of F32/F16/BF16.
    pub fn float(self) -> Option<DType> {
        match self {
            GgmlType::F32 => Some(DType::F32),
            GgmlType::F16 => Some(DType::F16),
            GgmlType::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
    /// The layout [`GgufFile::weight`] converts a quantized kind to (format, group, bias),
    /// known without converting (what `spark-run info` / `bench` count); `None` for float and
    /// unsupported kinds.
    pub fn served_plan(self) -> Option<QPlan> {
        let (format, group, bias) = match self.0 {
            8 | 9 => (QFormat::I8, 32, false),
            15 => (QFormat::I8, 256, false),
            2 => (QFormat::I4, 32, false),
            3 | 12 => (QFormat::I4, 32, true),
            6 => (QFormat::I8, 32, false),
            7 | 13 => (QFormat::I8, 32, true),
            10 => (QFormat::I4, 16, true),
            11 => (QFormat::I4, 16, false),
            14 => (QFormat::I6, 16, false),
            _ => return None,
        };
        Some(QPlan { format, group, bias })
    }
    /// Whether the group scales of this type are integer multiples of one unit per 256-column
    /// super-block: Q4_K's `d` times 6-bit sub-scales (a backend may hold them as the integers).
    pub fn integer_sub_scales(self) -> bool {
        self.0 == 12
    }
    /// Whether this engine can load a matrix of this type.
    pub fn supported(self) -> bool {
        self.float().is_some() || matches!(self.0, 2 | 3 | 6 | 7 | 8 | 9 | 10 | 11 | 12 | 13 | 14 | 15)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// One tensor's header entry and where its data lies in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub kind: GgmlType,
    /// Offset from the start of the data section, as stored.
    pub offset: u64,
    /// Absolute byte range in the file.
    pub start: usize,
    pub end: usize,
}

impl TensorInfo {
    /// Row-major shape (`[rows, cols]` for a matrix): the dims reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
    pub fn numel(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
    pub fn nbytes(&self) -> usize {
        self.end - self.start
    }
}

/// A parsed GGUF file over a memory map.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub alignment: usize,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    /// Absolute offset of the data section.
    pub data_start: usize,
    map: Arc<Mmap>,
    meta_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GgufFile({} v{}, {} keys, {} tensors)",
            self.path.display(),
            self.version,
            self.metadata.len(),
            self.tensors.len()
        )
    }
}

/// Whether `path` names a GGUF file: a `.gguf` extension, or a file starting with `GGUF`.
pub fn is_gguf(path: &Path) -> bool {
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        return true;
    }
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 4];
    File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && magic == MAGIC
}

/// Open a Spark-X2.5 GGUF file: its validated config and weights.
pub fn load(path: &Path) -> Result<(ModelConfig, ModelWeights)> {
    let g = GgufFile::open(path)?;
    let cfg = g.config()?;
    let w = g.weights(&cfg)?;
    Ok((cfg, w))
}

/// A bounds-checked reader over the header.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: &str, msg: String) -> Error {
        Error::model(format!("{}: {what} at offset {}: {msg}", self.path.display(), self.pos))
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(
                self.err(what, format!("needs {n} bytes but the file ends after {left} (truncated or corrupt GGUF)"))
            );
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let n = self.u64(what)?;
        let n = usize::try_from(n).ok().filter(|&n| n <= self.buf.len() - self.pos).ok_or_else(|| {
            Error::model(format!(
                "{}: {what} at offset {at}: string length {n} runs past the end of the file (truncated or corrupt GGUF)",
                self.path.display()
            ))
        })?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| {
            Error::model(format!("{}: {what} at offset {at}: string is not UTF-8: {e}", self.path.display()))
        })
    }
    /// The number of elements `n` of an array or list whose elements take at least `min` bytes
    /// each, checked against what is left of the file.
    fn count(&self, n: u64, min: usize, what: &str) -> Result<usize> {
        let left = (self.buf.len() - self.pos) as u64;
        if n.checked_mul(min as u64).is_none_or(|b| b > left) {
            return Err(
                self.err(what, format!("{n} elements cannot fit in the {left} bytes left (truncated or corrupt GGUF)"))
            );
        }
        Ok(n as usize)
    }
    fn value(&mut self, t: ValueType, what: &str, depth: usize) -> Result<Value> {
        Ok(match t {
            ValueType::U8 => Value::U8(self.arr::<1>(what)?[0]),
            ValueType::I8 => Value::I8(self.arr::<1>(what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.arr(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.arr(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.arr(what)?)),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.arr(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.arr(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.arr(what)?)),
            ValueType::Bool => match self.arr::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    self.pos -= 1;
                    return Err(self.err(what, format!("bool byte is {b}, not 0 or 1 (corrupt GGUF)")));
                }
            },
            ValueType::Str => Value::Str(self.string(what)?),
            ValueType::Array => {
                if depth >= MAX_DEPTH {
                    return Err(self.err(what, format!("arrays nested deeper than {MAX_DEPTH} (corrupt GGUF)")));
                }
                let tc = self.u32(what)?;
                let et = ValueType::from_u32(tc).ok_or_else(|| {
                    self.err(what, format!("unknown array element type {tc} (corrupt GGUF or a newer version)"))
                })?;
                let n = self.u64(what)?;
                let n = self.count(n, et.min_size(), what)?;
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.value(et, &format!("{what}[{i}]"), depth + 1)?);
                }
                Value::Array(et, v)
            }
        })
    }
}

fn map_file(path: &Path) -> Result<Arc<Mmap>> {
    let file = File::open(path).map_err(|e| Error::model(format!("cannot open {}: {e}", path.display())))?;
    let len = file.metadata().map_err(|e| Error::model(format!("cannot stat {}: {e}", path.display())))?.len();
    if len < 24 {
        return Err(Error::model(format!(
            "{}: {len} bytes is too small for a GGUF file (truncated or not GGUF)",
            path.display()
        )));
    }
    // SAFETY: the file is opened read-only and the map is never written through. Another process
    // truncating the file while it is mapped would make reads fault; that is the usual contract
    // of memory-mapped model files (llama.cpp, safetensors), as in `weights.rs`.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::model(format!("cannot map {}: {e}", path.display())))?;
    crate::memory::advise_huge_pages(&map);
    Ok(Arc::new(map))
}

impl GgufFile {
    /// Map and parse a GGUF file (v2 or v3, little-endian).
    pub fn open(path: &Path) -> Result<GgufFile> {
        let map = map_file(path)?;
        let mut c = Cursor { buf: &map[..], pos: 0, path };
        let magic = c.arr::<4>("magic")?;
        if magic != MAGIC {
            return Err(Error::model(format!(
                "{}: not a GGUF file (starts with {:?}, expected \"GGUF\")",
                path.display(),
                String::from_utf8_lossy(&magic)
            )));
        }
        let version = c.u32("version")?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(Error::unsupported(format!(
                    "{}: GGUF version 1 is not supported (only 2 and 3); re-convert with a current llama.cpp",
                    path.display()
                )))
            }
            v if v.swap_bytes() <= 3 => {
                return Err(Error::unsupported(format!(
                    "{}: big-endian GGUF (version {}) is not supported",
                    path.display(),
                    v.swap_bytes()
                )))
            }
            v => {
                return Err(Error::unsupported(format!(
                    "{}: GGUF version {v} is not supported (only 2 and 3)",
                    path.display()
                )))
            }
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        // A key takes at least 8 (length) + 4 (type) + 1 bytes; a tensor info at least 8 + 4 + 4 + 8.
        let n_kv = c.count(n_kv, 13, "metadata count")?;
        let n_tensors = c.count(n_tensors, 24, "tensor count")?;

        let mut metadata = Vec::with_capacity(n_kv);
        let mut meta_index = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let at = c.pos;
            let tc = c.u32(&format!("type of metadata '{key}'"))?;
            let t = ValueType::from_u32(tc).ok_or_else(|| {
                Error::model(format!(
                    "{}: metadata '{key}' at offset {at}: unknown value type {tc} (corrupt GGUF)",
                    path.display()
                ))
            })?;
            let v = c.value(t, &format!("metadata '{key}'"), 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(Error::model(format!("{}: metadata key '{key}' appears twice", path.display())));
            }
            metadata.push((key, v));
        }
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a as usize,
                _ => {
                    return Err(Error::model(format!(
                        "{}: general.alignment must be a power of two, got {}",
                        path.display(),
                        v.describe()
                    )))
                }
            },
        };

        let mut infos = Vec::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let name = c.string(&format!("name of tensor #{i}"))?;
            let what = format!("tensor '{name}'");
            let nd = c.u32(&what)?;
            if nd == 0 || nd > 4 {
                return Err(c.err(&what, format!("{nd} dimensions (ggml allows 1 to 4; corrupt GGUF)")));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(c.u64(&what)?);
            }
            let kind = GgmlType(c.u32(&what)?);
            let offset = c.u64(&what)?;
            infos.push((name, dims, kind, offset));
        }
        let data_start = c.pos.div_ceil(alignment) * alignment;
        let file_len = map.len();
        if data_start > file_len {
            return Err(Error::model(format!(
                "{}: the data section would start at offset {data_start}, past the end of the file ({file_len} bytes; truncated GGUF)",
                path.display()
            )));
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut tensor_index = HashMap::new();
        for (name, dims, kind, offset) in infos {
            let bad = |msg: String| Error::model(format!("{}: tensor '{name}': {msg}", path.display()));
            let (blk, bsize) = kind.block().ok_or_else(|| {
                Error::unsupported(format!(
                    "{}: tensor '{name}' has unknown ggml type {} (corrupt GGUF or a newer ggml)",
                    path.display(),
                    kind.0
                ))
            })?;
            let numel = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let numel = numel.filter(|&n| n <= 1 << 48).ok_or_else(|| bad(format!("dims {dims:?} are too large")))?;
            if dims[0] % blk as u64 != 0 {
                return Err(bad(format!(
                    "row length {} is not a multiple of the {} block size {blk}",
                    dims[0],
                    kind.name()
                )));
            }
            let nbytes = numel / blk as u64 * bsize as u64;
            if offset % alignment as u64 != 0 {
                return Err(bad(format!("data offset {offset} is not a multiple of the alignment {alignment}")));
            }
            let start = (data_start as u64).checked_add(offset);
            let end = start.and_then(|s| s.checked_add(nbytes));
            let (start, end) = match (start, end) {
                (Some(s), Some(e)) if e <= file_len as u64 => (s as usize, e as usize),
                _ => {
                    return Err(bad(format!(
                        "data at offset {offset} (+{nbytes} bytes) runs past the end of the file ({} data bytes; truncated GGUF)",
                        file_len - data_start
                    )))
                }
            };
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(Error::model(format!("{}: tensor '{name}' appears twice", path.display())));
            }
            tensors.push(TensorInfo { name, dims, kind, offset, start, end });
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            alignment,
            metadata,
            tensors,
            data_start,
            map,
            meta_index,
            tensor_index,
        })
    }

    fn err(&self, msg: impl std::fmt::Display) -> Error {
        Error::model(format!("{}: {msg}", self.path.display()))
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A tensor's info by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.start..t.end]
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(|v| v.as_str())
    }

    fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                self.err(format!("metadata '{key}' must be a non-negative integer, got {}", v.describe()))
            }),
        }
    }
    fn req_u64(&self, key: &str) -> Result<u64> {
        self.opt_u64(key)?.ok_or_else(|| self.err(format!("metadata '{key}' is missing")))
    }
    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| self.err(format!("metadata '{key}' must be a finite number, got {}", v.describe()))),
        }
    }

    /// The model configuration from the `spark2_5.*` metadata (SPARK.md section 7), checked
    /// by the same validation as `config.json`.
    pub fn config(&self) -> Result<ModelConfig> {
        match self.get("general.architecture") {
            None => return Err(self.err("metadata 'general.architecture' is missing")),
            Some(Value::Str(a)) if a == ARCH => {}
            Some(v) => {
                return Err(Error::unsupported(format!(
                    "{}: general.architecture is {}, not '{ARCH}': this engine runs Spark-X2.5 models only",
                    self.path.display(),
                    v.describe()
                )))
            }
        }
        let k = |s: &str| format!("{ARCH}.{s}");
        let hidden = self.req_u64(&k("embedding_length"))?;
        let n_layers = self.req_u64(&k("block_count"))?;
        let intermediate = self.req_u64(&k("feed_forward_length"))?;
        let n_heads = self.req_u64(&k("attention.head_count"))?;
        let n_kv = self.opt_u64(&k("attention.head_count_kv"))?.unwrap_or(n_heads);
        let head_dim = match self.opt_u64(&k("attention.key_length"))? {
            Some(d) => d,
            None if n_heads > 0 && hidden % n_heads == 0 => hidden / n_heads,
            None => return Err(self.err(format!("metadata '{}' is missing", k("attention.key_length")))),
        };
        if let Some(v) = self.opt_u64(&k("attention.value_length"))? {
            if v != head_dim {
                return Err(Error::unsupported(format!(
                    "{}: {} = {v} differs from {} = {head_dim}; Spark-X2.5 uses one head size",
                    self.path.display(),
                    k("attention.value_length"),
                    k("attention.key_length")
                )));
            }
        }
        let vocab = match self.opt_u64(&k("vocab_size"))? {
            Some(v) => v,
            None => match self.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
                Some(t) => t.len() as u64,
                None => match self.tensor("token_embd.weight") {
                    Some(t) if t.dims.len() == 2 => t.dims[1],
                    _ => return Err(self.err(format!("metadata '{}' is missing", k("vocab_size")))),
                },
            },
        };
        let mut obj = Map::new();
        obj.insert("model_type".into(), json!(ARCH));
        obj.insert("hidden_size".into(), json!(hidden));
        obj.insert("intermediate_size".into(), json!(intermediate));
        obj.insert("num_hidden_layers".into(), json!(n_layers));
        obj.insert("num_attention_heads".into(), json!(n_heads));
        obj.insert("num_key_value_heads".into(), json!(n_kv));
        obj.insert("head_dim".into(), json!(head_dim));
        obj.insert("vocab_size".into(), json!(vocab));
        if let Some(c) = self.opt_u64(&k("context_length"))? {
            obj.insert("max_position_embeddings".into(), json!(c));
        }
        if let Some(w) = self.opt_u64(&k("attention.sliding_window"))? {
            obj.insert("sliding_window".into(), json!(w));
        }
        let pkey = k("attention.sliding_window_pattern");
        if let Some(p) = self.get(&pkey) {
            let a = p
                .as_array()
                .ok_or_else(|| self.err(format!("metadata '{pkey}' must be an array, got {}", p.describe())))?;
            let types = a
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let sliding = v.as_bool().or_else(|| v.as_u64().filter(|&x| x <= 1).map(|x| x == 1));
                    match sliding {
                        Some(true) => Ok(json!("sliding_attention")),
                        Some(false) => Ok(json!("full_attention")),
                        None => Err(self.err(format!("metadata '{pkey}'[{i}] must be a bool, got {}", v.describe()))),
                    }
                })
                .collect::<Result<Vec<_>>>()?;
            obj.insert("layer_types".into(), Json::Array(types));
        }
        let mut rope = Map::new();
        for (t, base, dims) in [
            ("sliding_attention", "rope.freq_base_swa", "rope.dimension_count_swa"),
            ("full_attention", "rope.freq_base", "rope.dimension_count"),
        ] {
            let theta = self.opt_f64(&k(base))?.unwrap_or(10000.0);
            if theta <= 0.0 {
                return Err(self.err(format!("metadata '{}' = {theta}: the RoPE base must be > 0", k(base))));
            }
            let rot = self.opt_u64(&k(dims))?.unwrap_or(head_dim);
            if rot == 0 || rot > head_dim || rot % 2 != 0 {
                return Err(self.err(format!(
                    "metadata '{}' = {rot}: rotary dims must be even and in 2..={head_dim} (the head size)",
                    k(dims)
                )));
            }
            // The factor that gives exactly `rot` dims back (`head_dim * factor` truncated).
            let mut factor = rot as f64 / head_dim as f64;
            while ((head_dim as f64 * factor) as u64) < rot {
                factor = f64::from_bits(factor.to_bits() + 1);
            }
            rope.insert(t.into(), json!({"rope_theta": theta, "partial_rotary_factor": factor}));
        }
        obj.insert("rope_parameters".into(), Json::Object(rope));
        if let Some(eps) = self.opt_f64(&k("attention.layer_norm_rms_epsilon"))? {
            if !(eps > 0.0 && eps < 1.0) {
                return Err(self
                    .err(format!("metadata '{}' = {eps}: must be in (0, 1)", k("attention.layer_norm_rms_epsilon"))));
            }
            obj.insert("rms_norm_eps".into(), json!(eps));
        }
        obj.insert("tie_word_embeddings".into(), json!(self.tensor("output.weight").is_none()));
        for (hf, key) in [
            ("bos_token_id", "tokenizer.ggml.bos_token_id"),
            ("eos_token_id", "tokenizer.ggml.eos_token_id"),
            ("pad_token_id", "tokenizer.ggml.padding_token_id"),
        ] {
            if let Some(id) = self.opt_u64(key)? {
                obj.insert(hf.into(), json!(id));
            }
        }
        let stored = ["token_embd.weight", "output_norm.weight"]
            .iter()
            .find_map(|n| self.tensor(n).and_then(|t| t.kind.float()))
            .unwrap_or(DType::F32);
        let dtype = match stored {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        };
        obj.insert("dtype".into(), json!(dtype));
        ModelConfig::from_json(&obj).map_err(|e| {
            let msg = e.message.strip_prefix("config.json: ").unwrap_or(&e.message);
            Error::new(e.kind, format!("{}: GGUF metadata gives an invalid config: {msg}", self.path.display()))
        })
    }

    /// A tensor as a weight: F32/F16/BF16 as a float tensor (in place from the map when its
    /// start is aligned for its element type), a quantized kind converted to a [`QTensor`].
    /// `name` is the GGUF tensor name; the weight is named `as_name`.
    pub fn weight(&self, name: &str, as_name: &str) -> Result<Weight> {
        let t = self.tensor(name).ok_or_else(|| self.err(format!("has no tensor '{name}'")))?;
        let shape = t.shape();
        if let Some(dtype) = t.kind.float() {
            let data = if t.start % dtype.size() == 0 {
                TensorBytes::Mapped { map: self.map.clone(), start: t.start, end: t.end }
            } else {
                TensorBytes::Owned(Arc::new(self.tensor_bytes(t).to_vec()))
            };
            return Ok(Weight::Float(Tensor { name: as_name.to_string(), dtype, shape, data }));
        }
        let cols = t.dims[0] as usize;
        let rows = t.numel() / cols.max(1);
        let c = convert_parallel(t.kind, self.tensor_bytes(t)).ok_or_else(|| {
            Error::unsupported(format!(
                "{}: tensor '{name}' is {}, which spark cannot load (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K)",
                self.path.display(),
                t.kind.name()
            ))
        })?;
        let c = held_form(t.kind, c, rows, cols);
        let q = QTensor {
            name: as_name.to_string(),
            format: c.format,
            rows,
            cols,
            group: c.group,
            q: TensorBytes::Owned(Arc::new(c.q)),
            scales: Arc::new(c.scales),
            bias: c.bias.map(Arc::new),
        };
        q.validate().map_err(|e| self.err(format!("tensor '{name}' ({}): {}", t.kind.name(), e.message)))?;
        Ok(Weight::Quant(q))
    }

    /// Every tensor the file holds that a Spark-X2.5 GGUF may hold, with its checkpoint name
    /// (`model.layers.0.mlp.down_proj.weight`, ...), without reading its data.
    pub fn checkpoint_tensors(&self, n_layers: usize) -> Vec<(String, &TensorInfo)> {
        gguf_names(n_layers).into_iter().filter_map(|(g, h)| self.tensor(&g).map(|t| (h, t))).collect()
    }

    /// The Spark-X2.5 tensors, every one present with the shape `cfg` implies and nothing
    /// unexpected left over; named as in a safetensors checkpoint (`model.embedding.weight`, ...).
    pub fn weights(&self, cfg: &ModelConfig) -> Result<ModelWeights> {
        self.check_tensors(cfg)?;
        let layers = (0..cfg.n_layers).map(|i| self.layer_weights(cfg, i)).collect::<Result<Vec<_>>>()?;
        Ok(ModelWeights {
            embedding: self.checked(cfg, "token_embd.weight")?,
            layers,
            norm: self.norm_weight(cfg, "output_norm.weight")?,
            lm_head: self.lm_head_weight(cfg)?,
            compute: self.compute_dtype(),
        })
    }

    /// Every tensor's header against `cfg` (names, shapes, norm types), reading no data: what
    /// [`GgufFile::weights`] checks before converting anything.
    pub fn check_tensors(&self, cfg: &ModelConfig) -> Result<()> {
        let names = gguf_names(cfg.n_layers);
        let known: HashMap<&str, &str> = names.iter().map(|(g, h)| (g.as_str(), h.as_str())).collect();
        if let Some(u) = self.tensors.iter().find(|t| !known.contains_key(t.name.as_str())) {
            return Err(self.err(format!(
                "unexpected tensor '{}' ({}); is this a Spark-X2.5 GGUF?",
                u.name,
                u.kind.name()
            )));
        }
        let expected = cfg.expected_tensors();
        let shape_of: HashMap<&str, &Vec<usize>> = expected.iter().map(|(n, s)| (n.as_str(), s)).collect();
        for (g, hf) in &names {
            let required = g != "output.weight";
            let Some(t) = self.tensor(g) else {
                if required {
                    return Err(self.err(format!("is missing tensor '{g}'")));
                }
                continue;
            };
            let want =
                shape_of.get(hf.as_str()).copied().ok_or_else(|| self.err(format!("unexpected tensor '{g}'")))?;
            self.check_tensor(t, want)?;
        }
        Ok(())
    }

    /// One tensor's header against the shape the config implies (a vector is a norm, which
    /// must be a float type).
    fn check_tensor(&self, t: &TensorInfo, want: &[usize]) -> Result<()> {
        let g = &t.name;
        if t.shape() != want {
            return Err(self.err(format!(
                "tensor '{g}' has GGUF dims {:?} (shape {:?}), but the metadata implies shape {want:?}",
                t.dims,
                t.shape()
            )));
        }
        if want.len() == 1 && t.kind.float().is_none() {
            return Err(Error::unsupported(format!(
                "{}: tensor '{g}' is {}; norm weights must be F32, F16 or BF16",
                self.path.display(),
                t.kind.name()
            )));
        }
        Ok(())
    }

    /// Tensor `g` as its checkpoint-named weight (converted if quantized), its header checked
    /// first ([`GgufFile::check_tensor`], so a caller that skipped
    /// [`GgufFile::check_tensors`] still gets the same errors).
    fn checked(&self, cfg: &ModelConfig, g: &str) -> Result<Weight> {
        let unexpected = || self.err(format!("unexpected tensor '{g}'"));
        let hf = gguf_names(cfg.n_layers).into_iter().find(|(n, _)| n == g).map(|(_, h)| h).ok_or_else(unexpected)?;
        let t = self.tensor(g).ok_or_else(|| self.err(format!("is missing tensor '{g}'")))?;
        let want = cfg.expected_tensors().into_iter().find(|(n, _)| *n == hf).map(|(_, s)| s).ok_or_else(unexpected)?;
        self.check_tensor(t, &want)?;
        self.weight(g, &hf)
    }

    /// A norm vector `g` (a float tensor).
    pub fn norm_weight(&self, cfg: &ModelConfig, g: &str) -> Result<Tensor> {
        match self.checked(cfg, g)? {
            Weight::Float(t) => Ok(t),
            Weight::Quant(_) => Err(self.err(format!("tensor '{g}' must be a float tensor"))),
        }
    }

    /// Layer `i`'s weights, converted now (one layer's worth of memory).
    pub fn layer_weights(&self, cfg: &ModelConfig, i: usize) -> Result<LayerWeights> {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        Ok(LayerWeights {
            attn_norm: self.norm_weight(cfg, &b("attn_norm"))?,
            qkv: self.checked(cfg, &b("attn_qkv"))?,
            gate: self.checked(cfg, &b("attn_gate"))?,
            out: self.checked(cfg, &b("attn_output"))?,
            mlp_norm: self.norm_weight(cfg, &b("ffn_norm"))?,
            mlp_gate: self.checked(cfg, &b("ffn_gate"))?,
            mlp_up: self.checked(cfg, &b("ffn_up"))?,
            mlp_down: self.checked(cfg, &b("ffn_down"))?,
        })
    }

    /// The token embedding, converted now.
    pub fn embedding_weight(&self, cfg: &ModelConfig) -> Result<Weight> {
        self.checked(cfg, "token_embd.weight")
    }

    /// The untied output head, if the file has one, converted now.
    pub fn lm_head_weight(&self, cfg: &ModelConfig) -> Result<Option<Weight>> {
        if self.tensor("output.weight").is_none() {
            return Ok(None);
        }
        self.checked(cfg, "output.weight").map(Some)
    }

    /// The compute type the file implies ([`ModelWeights::compute`]): bf16 when the embedding
    /// is quantized (such files keep their norms in F32 by llama.cpp's convention, not because
    /// the model computes in f32: the reference computes in bf16), else none.
    pub fn compute_dtype(&self) -> Option<DType> {
        let quantized = self.tensor("token_embd.weight").is_some_and(|t| t.kind.float().is_none());
        quantized.then_some(DType::BF16)
    }

    /// Tensor count and bytes per ggml type (for `spark-run info`).
    pub fn kinds_summary(&self) -> BTreeMap<GgmlType, (usize, usize)> {
        let mut m = BTreeMap::new();
        for t in &self.tensors {
            let e = m.entry(t.kind).or_insert((0, 0));
            e.0 += 1;
            e.1 += t.nbytes();
        }
        m
    }

    /// Bytes of tensor data.
    pub fn data_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.nbytes()).sum()
    }

    /// `tokenizer.chat_template`, if present.
    pub fn chat_template(&self) -> Option<ChatTemplate> {
        self.get("tokenizer.chat_template").and_then(|v| v.as_str()).map(|s| ChatTemplate::Jinja {
            source: s.to_string(),
            origin: format!("{} (tokenizer.chat_template)", self.path.display()),
        })
    }

    /// The tokenizer described by `tokenizer.ggml.*`: a byte-level BPE (`model` = `gpt2`) built
    /// as the Hugging Face `tokenizer.json` it was converted from.
    ///
    /// Added tokens are the CONTROL (3) and USER_DEFINED (4) entries, matched in text before
    /// the BPE. GGUF keeps no "special" flag, and llama.cpp's converter marks every `<|...|>` /
    /// `<｜...｜>` token CONTROL, so: a CONTROL token is special (dropped by skip-special
    /// decoding) unless it is a Spark-X2.5 role, think, tool or FIM marker, which the original
    /// tokenizer flags non-special. UNUSED (5) padding entries are left out of the vocabulary.
    /// Pre-tokenizer by `tokenizer.ggml.pre`: `smollm` (what the converter writes for the demo
    /// and random test checkpoints: digits one by one, then GPT-2's regex), `spark2_5` (the
    /// released checkpoints; rebuilt from llama.cpp's `spark2_5` regexes), `gpt-2`.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let bad = |m: String| self.err(m);
        let model = self.get("tokenizer.ggml.model").and_then(|v| v.as_str());
        if model != Some("gpt2") {
            return Err(Error::unsupported(format!(
                "{}: tokenizer.ggml.model is {}; spark reads byte-level BPE ('gpt2') tokenizers only",
                self.path.display(),
                model.map_or("missing".to_string(), |m| format!("'{m}'"))
            )));
        }
        let tokens = self
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .ok_or_else(|| bad("metadata 'tokenizer.ggml.tokens' is missing or not an array".into()))?;
        let types: Vec<i64> = match self.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
            Some(a) if a.len() == tokens.len() => a
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_i64().ok_or_else(|| bad(format!("tokenizer.ggml.token_type[{i}] is {}", v.describe())))
                })
                .collect::<Result<_>>()?,
            Some(a) => {
                return Err(bad(format!(
                    "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
                    a.len(),
                    tokens.len()
                )))
            }
            None => vec![1; tokens.len()],
        };
        let merges = match self.get("tokenizer.ggml.merges") {
            None => vec![],
            Some(v) => v
                .as_array()
                .ok_or_else(|| bad(format!("tokenizer.ggml.merges must be an array, got {}", v.describe())))?
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    m.as_str()
                        .and_then(|s| s.split_once(' '))
                        .map(|(a, b)| json!([a, b]))
                        .ok_or_else(|| bad(format!("tokenizer.ggml.merges[{i}] is {}, not \"A B\"", m.describe())))
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let non_special = [
            tk::THINK,
            tk::END_THINK,
            tk::SYSTEM,
            tk::USER,
            tk::TOOL,
            tk::DEVELOPER,
            tk::BOT,
            tk::TOOL_CALL,
            tk::END_TOOL_CALL,
            tk::TOOL_RESPONSE,
            tk::END_TOOL_RESPONSE,
            tk::ARG_KEY,
            tk::END_ARG_KEY,
            tk::ARG_VALUE,
            tk::END_ARG_VALUE,
            "<｜fim▁begin｜>",
            "<｜fim▁hole｜>",
            "<｜fim▁end｜>",
        ];
        let mut vocab = Map::new();
        let mut added = vec![];
        for (id, (tok, &ty)) in tokens.iter().zip(&types).enumerate() {
            let tok = tok.as_str().ok_or_else(|| bad(format!("tokenizer.ggml.tokens[{id}] is not a string")))?;
            if ty == 5 {
                continue;
            }
            if vocab.insert(tok.to_string(), json!(id)).is_some() {
                return Err(bad(format!("tokenizer.ggml.tokens[{id}] = '{tok}' appears twice")));
            }
            if ty == 3 || ty == 4 {
                let special = ty == 3 && !non_special.contains(&tok);
                added.push(json!({"id": id, "content": tok, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": special}));
            }
        }
        let pre = self.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let split =
            |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
        let pre_tokenizer = match pre {
            "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            "spark2_5" => json!({"type": "Sequence", "pretokenizers": [
                split(r"\p{N}{1,3}"),
                split("[一-龥぀-ゟ゠-ヿ]+"),
                split("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+"),
                {"type": "Digits", "individual_digits": true},
                byte_level(false)]}),
            "gpt-2" | "gpt2" => byte_level(true),
            other => {
                return Err(Error::unsupported(format!(
                    "{}: tokenizer.ggml.pre '{other}' is not supported (expected spark2_5, smollm or gpt-2)",
                    self.path.display()
                )))
            }
        };
        let tj = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges}
        });
        let bytes = serde_json::to_vec(&tj).map_err(|e| Error::internal(format!("tokenizer JSON: {e}")))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| bad(format!("cannot build the tokenizer from tokenizer.ggml.*: {e}")))?;
        Ok(Tokenizer::from_inner(inner, format!("{} (tokenizer.ggml.*)", self.path.display())))
    }
}

/// (GGUF name, checkpoint name) of every tensor a Spark-X2.5 GGUF may hold.
fn gguf_names(n_layers: usize) -> Vec<(String, String)> {
    let mut v = vec![
        ("token_embd.weight".to_string(), "model.embedding.weight".to_string()),
        ("output_norm.weight".to_string(), "model.norm.weight".to_string()),
        ("output.weight".to_string(), "lm_head.weight".to_string()),
    ];
    for i in 0..n_layers {
        for (g, h) in [
            ("attn_norm", "input_layernorm"),
            ("attn_qkv", "self_attn.q_k_v_proj"),
            ("attn_gate", "self_attn.g_proj"),
            ("attn_output", "self_attn.out_proj"),
            ("ffn_norm", "post_attention_layernorm"),
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ] {
            v.push((format!("blk.{i}.{g}.weight"), format!("model.layers.{i}.{h}.weight")));
        }
    }
    v
}

/// A quantized tensor's blocks, converted.
struct Converted {
    format: QFormat,
    group: usize,
    q: Vec<u8>,
    scales: Vec<f32>,
    bias: Option<Vec<f32>>,
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Packs int4 nibbles (0..=15, one per element) two per byte: element 2j low, 2j+1 high.
fn pack_nibbles(nib: &[u8], out: &mut Vec<u8>) {
    out.extend(nib.chunks_exact(2).map(|p| (p[0] & 0xF) | (p[1] << 4)));
}

/// The 6-bit (scale, min) pair `j` of a Q4_K/Q5_K block's 12 scale bytes.
#[inline]
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// A conversion of `rows` rows of `cols` as the loader holds it ([`GgmlType::served_plan`]):
/// Q6_K's 6-bit values, converted as int8, become int6 (3/4 of the bytes); the rest as is.
fn held_form(kind: GgmlType, mut c: Converted, rows: usize, cols: usize) -> Converted {
    if kind == GgmlType::Q6_K && c.format == QFormat::I8 && cols.is_multiple_of(4) && c.q.len() == rows * cols {
        int8_rows_to_i6(&mut c.q, rows, cols);
        c.format = QFormat::I6;
    }
    c
}

/// Q6_K's values as [`convert_blocks`] gives them (int8 `-32..=31`, `rows` rows of `cols`)
/// repacked in place into int6 rows ([`crate::quant::pack_i6_row`]), one row at a time: row `r`
/// goes to bytes before `(r + 1) * cols`, where the rows not yet read begin.
fn int8_rows_to_i6(q: &mut Vec<u8>, rows: usize, cols: usize) {
    let rb = QFormat::I6.row_bytes(cols);
    let (mut row, mut out) = (vec![0i8; cols], vec![0u8; rb]);
    for r in 0..rows {
        for (d, &v) in row.iter_mut().zip(&q[r * cols..(r + 1) * cols]) {
            *d = v as i8;
        }
        crate::quant::pack_i6_row(&row, &mut out);
        q[r * rb..(r + 1) * rb].copy_from_slice(&out);
    }
    q.truncate(rows * rb);
    q.shrink_to_fit();
}

/// [`convert_blocks`] over a whole tensor, on up to one thread per core (large tensors only).
///
/// The output arrays are allocated once, here, at their final size; each thread fills its part
/// a few hundred blocks at a time through small temporaries. (Threads that built whole-part
/// vectors and appended them left ~1 GB of freed memory in the threads' malloc arenas while
/// loading a 1.7B model, which the allocator did not give back.)
fn convert_parallel(kind: GgmlType, data: &[u8]) -> Option<Converted> {
    /// Blocks per temporary: 512 Q4_K blocks are 128K weights, 64 KiB of nibbles.
    const SUB: usize = 512;
    let (_, bs) = kind.block()?;
    let nb = data.len() / bs;
    if nb <= SUB {
        return convert_blocks(kind, data);
    }
    // The per-block sizes, from the first block.
    let one = convert_blocks(kind, &data[..bs])?;
    let (qpb, spb, has_bias) = (one.q.len(), one.scales.len(), one.bias.is_some());
    let mut q = vec![0u8; nb * qpb];
    let mut scales = vec![0f32; nb * spb];
    let mut bias = if has_bias { vec![0f32; nb * spb] } else { Vec::new() };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(nb / 4096).max(1);
    let per = nb.div_ceil(threads);
    let fill = |data: &[u8], q: &mut [u8], s: &mut [f32], b: &mut [f32]| -> Option<()> {
        for (i, sub) in data.chunks(SUB * bs).enumerate() {
            let c = convert_blocks(kind, sub)?;
            let (nq, ns) = (sub.len() / bs * qpb, sub.len() / bs * spb);
            q[i * SUB * qpb..][..nq].copy_from_slice(&c.q);
            s[i * SUB * spb..][..ns].copy_from_slice(&c.scales);
            if let Some(m) = c.bias {
                b[i * SUB * spb..][..ns].copy_from_slice(&m);
            }
        }
        Some(())
    };
    let ok = std::thread::scope(|sc| {
        let (mut qr, mut sr, mut br) = (&mut q[..], &mut scales[..], &mut bias[..]);
        let mut handles = Vec::new();
        for part in data.chunks(per * bs) {
            let n = part.len() / bs;
            let (qa, qrest) = std::mem::take(&mut qr).split_at_mut(n * qpb);
            let (sa, srest) = std::mem::take(&mut sr).split_at_mut(n * spb);
            let (ba, brest) = std::mem::take(&mut br).split_at_mut(if has_bias { n * spb } else { 0 });
            (qr, sr, br) = (qrest, srest, brest);
            handles.push(sc.spawn(move || fill(part, qa, sa, ba)));
        }
        handles.into_iter().all(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)).is_some())
    });
    ok.then(|| Converted { format: one.format, group: one.group, q, scales, bias: has_bias.then_some(bias) })
}

/// Convert the blocks of a quantized tensor (`data` holds whole blocks, checked by the
/// caller's size computation); `None` for a kind this engine does not convert.
fn convert_blocks(kind: GgmlType, data: &[u8]) -> Option<Converted> {
    let (be, bs) = kind.block()?;
    let nb = data.len() / bs;
    let blocks = data.chunks_exact(bs);
    let n = nb * be;
    let mut q = Vec::with_capacity(n);
    let mut nib = [0u8; 256];
    let i8s = |q: &mut Vec<u8>, v: i32| q.push(v as i8 as u8);
    let (format, group, scales, bias) = match kind {
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            let off = if kind == GgmlType::Q8_0 { 2 } else { 4 };
            let mut s = Vec::with_capacity(nb);
            for b in blocks {
                s.push(f16_at(b, 0));
                q.extend_from_slice(&b[off..off + 32]);
            }
            (QFormat::I8, 32, s, None)
        }
        GgmlType::Q8_K => {
            let mut s = Vec::with_capacity(nb);
            for b in blocks {
                s.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                q.extend_from_slice(&b[4..260]);
            }
            (QFormat::I8, 256, s, None)
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let off = if kind == GgmlType::Q4_0 { 2 } else { 4 };
            let mut s = Vec::with_capacity(nb);
            let mut m = Vec::with_capacity(nb);
            for b in blocks {
                let d = f16_at(b, 0);
                s.push(d);
                if kind == GgmlType::Q4_1 {
                    // d * n + min = d * (n - 8) + (min + 8 d)
                    m.push(f16_at(b, 2) + 8.0 * d);
                }
                for j in 0..16 {
                    nib[j] = b[off + j] & 0xF;
                    nib[j + 16] = b[off + j] >> 4;
                }
                pack_nibbles(&nib[..32], &mut q);
            }
            (QFormat::I4, 32, s, (kind == GgmlType::Q4_1).then_some(m))
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let one = kind == GgmlType::Q5_1;
            let off = if one { 4 } else { 2 };
            let mut s = Vec::with_capacity(nb);
            let mut m = Vec::with_capacity(nb);
            for b in blocks {
                s.push(f16_at(b, 0));
                if one {
                    m.push(f16_at(b, 2));
                }
                let qh = u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]]);
                let qs = &b[off + 4..off + 20];
                let zero = if one { 0 } else { 16 };
                let mut hi = [0i32; 16];
                for j in 0..16 {
                    let v = (qs[j] & 0xF) as i32 | ((((qh >> j) & 1) as i32) << 4);
                    i8s(&mut q, v - zero);
                    hi[j] = (qs[j] >> 4) as i32 | ((((qh >> (j + 16)) & 1) as i32) << 4);
                }
                for v in hi {
                    i8s(&mut q, v - zero);
                }
            }
            (QFormat::I8, 32, s, one.then_some(m))
        }
        GgmlType::Q2_K => {
            // scales[16], qs[64], d, dmin: value = d*(sc & 15) * q - dmin*(sc >> 4), q in 0..=3,
            // stored as nibble q + 8 with bias -dmin*(sc >> 4) (exact).
            let mut s = Vec::with_capacity(nb * 16);
            let mut m = Vec::with_capacity(nb * 16);
            for b in blocks {
                let (sc, qs) = (&b[0..16], &b[16..80]);
                let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
                for &x in sc {
                    s.push(d * (x & 0xF) as f32);
                    m.push(-(dmin * (x >> 4) as f32));
                }
                for h in 0..2 {
                    for j in 0..4 {
                        for l in 0..32 {
                            nib[128 * h + 32 * j + l] = ((qs[32 * h + l] >> (2 * j)) & 3) + 8;
                        }
                    }
                }
                pack_nibbles(&nib, &mut q);
            }
            (QFormat::I4, 16, s, Some(m))
        }
        GgmlType::Q3_K => {
            // hmask[32], qs[64], scales[12], d: value = d*(sc - 32) * (q - 4*(1 - hbit)),
            // stored as nibble (that) + 8 (exact).
            let mut s = Vec::with_capacity(nb * 16);
            for b in blocks {
                let (hm, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
                let d = f16_at(b, 108);
                for k in 0..16 {
                    let lo = (sc[k % 8] >> (4 * (k / 8))) & 0xF;
                    let hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
                    s.push(d * ((lo | (hi << 4)) as i32 - 32) as f32);
                }
                for h in 0..2 {
                    for j in 0..4 {
                        for l in 0..32 {
                            let v = ((qs[32 * h + l] >> (2 * j)) & 3) as i32;
                            let hbit = (hm[l] >> (4 * h + j)) & 1;
                            let v = if hbit == 1 { v } else { v - 4 };
                            nib[128 * h + 32 * j + l] = (v + 8) as u8;
                        }
                    }
                }
                pack_nibbles(&nib, &mut q);
            }
            (QFormat::I4, 16, s, None)
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            // d, dmin, scales[12], (qh[32]), qs[128]: value = d*sc * q - dmin*m per 32.
            let five = kind == GgmlType::Q5_K;
            let mut s = Vec::with_capacity(nb * 8);
            let mut m = Vec::with_capacity(nb * 8);
            for b in blocks {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let sc = &b[4..16];
                let (qh, qs) = if five { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
                for j in 0..8 {
                    let (a, mm) = scale_min_k4(j, sc);
                    let dl = d * a as f32;
                    let ml = dmin * mm as f32;
                    s.push(dl);
                    // int4 has zero point 8: d*q - m = d*(q - 8) + (8 d - m). int8 stores q as is.
                    m.push(if five { -ml } else { 8.0 * dl - ml });
                }
                for c in 0..4 {
                    for l in 0..32 {
                        let x = qs[32 * c + l];
                        let (lo, hi) = (x & 0xF, x >> 4);
                        if five {
                            let h0 = (qh[l] >> (2 * c)) & 1;
                            let h1 = (qh[l] >> (2 * c + 1)) & 1;
                            nib[64 * c + l] = lo | (h0 << 4);
                            nib[64 * c + 32 + l] = hi | (h1 << 4);
                        } else {
                            nib[64 * c + l] = lo;
                            nib[64 * c + 32 + l] = hi;
                        }
                    }
                }
                if five {
                    q.extend_from_slice(&nib);
                } else {
                    pack_nibbles(&nib, &mut q);
                }
            }
            (if five { QFormat::I8 } else { QFormat::I4 }, 32, s, Some(m))
        }
        GgmlType::Q6_K => {
            // ql[128], qh[64], scales[16] (i8), d: value = d*sc * (q - 32) per 16.
            let mut s = Vec::with_capacity(nb * 16);
            for b in blocks {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = f16_at(b, 208);
                for &x in sc {
                    s.push(d * (x as i8) as f32);
                }
                let mut v = [0i32; 256];
                for h in 0..2 {
                    let (ql, qh) = (&ql[64 * h..], &qh[32 * h..]);
                    for l in 0..32 {
                        let e = 128 * h + l;
                        v[e] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        v[e + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        v[e + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        v[e + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    }
                }
                q.extend(v.iter().map(|&x| x as i8 as u8));
            }
            (QFormat::I8, 16, s, None)
        }
        _ => return None,
    };
    Some(Converted { format, group, q, scales, bias })
}

/// A tensor to write: its row-major shape (`[rows, cols]` for a matrix), type and raw bytes.
pub struct WriteTensor<'a> {
    pub name: String,
    pub kind: GgmlType,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::Str(s) => put_str(out, s),
        Value::Array(t, items) => {
            out.extend_from_slice(&t.code().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i);
            }
        }
    }
}

/// Write a GGUF v3 file: `metadata` in order (its `general.alignment`, if any, is used), then
/// the tensors' infos and their data, each aligned.
pub fn write(path: &Path, metadata: &[(String, Value)], tensors: &[WriteTensor<'_>]) -> Result<()> {
    let alignment = metadata
        .iter()
        .find(|(k, _)| k == "general.alignment")
        .and_then(|(_, v)| v.as_u64())
        .map_or(DEFAULT_ALIGNMENT, |a| a as usize)
        .max(1);
    let mut h = Vec::new();
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&3u32.to_le_bytes());
    h.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    h.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        if let Value::Array(t, items) = v {
            if let Some(i) = items.iter().position(|x| x.value_type() != *t) {
                return Err(Error::invalid(format!("metadata '{k}': element {i} is not of the array's type {t:?}")));
            }
        }
        put_str(&mut h, k);
        h.extend_from_slice(&v.value_type().code().to_le_bytes());
        put_value(&mut h, v);
    }
    let mut offset = 0usize;
    for t in tensors {
        let (be, bs) = t.kind.block().ok_or_else(|| Error::invalid(format!("tensor '{}': unknown type", t.name)))?;
        let numel: usize = t.shape.iter().product();
        let cols = t.shape.last().copied().unwrap_or(1);
        if t.shape.is_empty() || t.shape.len() > 4 || cols % be != 0 || t.data.len() != numel / be * bs {
            return Err(Error::invalid(format!(
                "tensor '{}': {} bytes of {} do not make shape {:?}",
                t.name,
                t.data.len(),
                t.kind.name(),
                t.shape
            )));
        }
        put_str(&mut h, &t.name);
        h.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for &d in t.shape.iter().rev() {
            h.extend_from_slice(&(d as u64).to_le_bytes());
        }
        h.extend_from_slice(&t.kind.0.to_le_bytes());
        h.extend_from_slice(&(offset as u64).to_le_bytes());
        offset = (offset + t.data.len()).div_ceil(alignment) * alignment;
    }
    h.resize(h.len().div_ceil(alignment) * alignment, 0);
    let io = |e: std::io::Error| Error::new(ErrorKind::Io, format!("cannot write {}: {e}", path.display()));
    let mut f = std::io::BufWriter::new(File::create(path).map_err(io)?);
    f.write_all(&h).map_err(io)?;
    for t in tensors {
        f.write_all(t.data).map_err(io)?;
        let pad = t.data.len().div_ceil(alignment) * alignment - t.data.len();
        f.write_all(&vec![0u8; pad]).map_err(io)?;
    }
    f.flush().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("spark-gguf-unit-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d.join(name)
    }

    #[test]
    fn metadata_of_every_type_round_trips() {
        let meta = vec![
            ("a.u8".to_string(), Value::U8(7)),
            ("a.i8".into(), Value::I8(-7)),
            ("a.u16".into(), Value::U16(65535)),
            ("a.i16".into(), Value::I16(-300)),
            ("a.u32".into(), Value::U32(1 << 31)),
            ("a.i32".into(), Value::I32(-5)),
            ("a.u64".into(), Value::U64(1 << 40)),
            ("a.i64".into(), Value::I64(-(1 << 40))),
            ("a.f32".into(), Value::F32(1.5)),
            ("a.f64".into(), Value::F64(-2.25)),
            ("a.bool".into(), Value::Bool(true)),
            ("a.str".into(), Value::Str("héllo".into())),
            ("a.empty".into(), Value::Array(ValueType::I32, vec![])),
            (
                "a.nested".into(),
                Value::Array(
                    ValueType::Array,
                    vec![Value::Array(ValueType::Str, vec![Value::Str("x".into()), Value::Str("".into())])],
                ),
            ),
            ("general.alignment".into(), Value::U32(64)),
        ];
        let data: Vec<u8> = (0..24u8).collect();
        let p = tmp("types.gguf");
        let t = [WriteTensor { name: "t".into(), kind: GgmlType::F16, shape: vec![3, 4], data: &data }];
        write(&p, &meta, &t).unwrap();
        let g = GgufFile::open(&p).unwrap();
        assert_eq!(g.metadata, meta);
        assert_eq!(g.alignment, 64);
        assert_eq!(g.data_start % 64, 0);
        let ti = g.tensor("t").unwrap();
        assert_eq!(ti.dims, vec![4, 3]);
        assert_eq!(ti.shape(), vec![3, 4]);
        assert_eq!(g.tensor_bytes(ti), &data[..]);
        assert!(is_gguf(&p));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let meta = vec![
            ("general.architecture".to_string(), Value::Str("spark2_5".into())),
            ("x".into(), Value::Array(ValueType::U32, vec![Value::U32(1), Value::U32(2)])),
        ];
        let data = vec![0u8; 34 * 2];
        let p = tmp("full.gguf");
        write(&p, &meta, &[WriteTensor { name: "w".into(), kind: GgmlType::Q8_0, shape: vec![2, 32], data: &data }])
            .unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let q = tmp("cut.gguf");
        // The padding after the last tensor's data is not needed.
        let end = GgufFile::open(&p).unwrap().tensors[0].end;
        assert!(end < bytes.len());
        for n in 0..end {
            std::fs::write(&q, &bytes[..n]).unwrap();
            let e = GgufFile::open(&q).unwrap_err();
            assert!(e.message.contains("cut.gguf"), "{n}: {}", e.message);
        }
        std::fs::write(&q, &bytes[..end]).unwrap();
        GgufFile::open(&q).unwrap();
    }

    type SynthRow = (&'static str, f64, f64, [(usize, f32); 6]);

    /// Synthetic blocks (bytes from `synth_bytes`) as gguf-py's `quants.dequantize` gives them:
    /// (kind, sum, sum of |x|, [(flat index, value)]) for a [2, 256] matrix.
    #[rustfmt::skip]
    const SYNTH_REF: &[SynthRow] = &[
        ("Q4_0", -3.013153076171875, 25.003021240234375, [(0, -0.012298584), (1, -0.06149292), (33, -0.012298584), (200, -0.09838867), (300, 0.06149292), (511, 0.0)]),
        ("Q4_1", 51.37786865234375, 51.37786865234375, [(0, 0.19157791), (1, 0.14238358), (33, 0.09318924), (200, 0.06859207), (300, 0.11778641), (511, 0.0070991516)]),
        ("Q5_0", -2.201446533203125, 50.485687255859375, [(0, 0.073791504), (1, 0.024597168), (33, 0.073791504), (200, 0.13528442), (300, 0.06149292), (511, 0.08609009)]),
        ("Q5_1", 100.7935791015625, 100.7935791015625, [(0, 0.37605667), (1, 0.32686234), (33, 0.26536942), (200, 0.0070991516), (300, 0.019397736), (511, 0.19157791)]),
        ("Q8_0", 1.77099609375, 401.8193359375, [(0, 1.4635315), (1, 0.6272278), (33, 0.44274902), (200, -0.036895752), (300, -0.7871094), (511, 1.0822754)]),
        ("Q2_K", 43.376617431640625, 61.852989196777344, [(0, 0.0), (1, 0.0), (33, 0.122486115), (200, 0.07469177), (300, 0.16508102), (511, -0.070991516)]),
        ("Q3_K", -4.243011474609375, 243.00772094726562, [(0, -1.0699768), (1, 0.35665894), (33, 0.24597168), (200, -0.13528442), (300, -0.24597168), (511, 1.033081)]),
        ("Q4_K", 1228.5757751464844, 1253.1983795166016, [(0, 6.723427), (1, 4.411293), (33, 3.5172958), (200, 1.9241791), (300, -0.0886879), (511, 4.8180466)]),
        ("Q5_K", 2825.941680908203, 2839.698600769043, [(0, 3.2552261), (1, 0.94309235), (33, 7.7480087), (200, 0.3745575), (300, 1.3805428), (511, 3.953045)]),
        ("Q6_K", -112.02780151367188, 6247.914337158203, [(0, -0.0), (1, -5.140808), (33, -26.897003), (200, -31.742645), (300, -31.87793), (511, 8.2031555)]),
    ];

    /// Deterministic bytes for `n` blocks of `kind`, with its f16 fields (`d`, then `dmin`/`m`)
    /// set to 0.0123 and 0.0071.
    fn synth_bytes(kind: GgmlType, f16s: &[usize]) -> Vec<u8> {
        let (be, bs) = kind.block().unwrap();
        let nb = 512 / be;
        let mut raw: Vec<u8> = (0..nb * bs).map(|i| ((i as u64 * 2654435761) >> 13) as u8).collect();
        for b in 0..nb {
            for (j, &off) in f16s.iter().enumerate() {
                let v = half::f16::from_f32(if j == 0 { 0.0123 } else { 0.0071 }).to_bits().to_le_bytes();
                raw[b * bs + off..b * bs + off + 2].copy_from_slice(&v);
            }
        }
        raw
    }

    #[test]
    fn every_supported_kind_matches_gguf_py_on_synthetic_blocks() {
        for &(name, sum, sum_abs, samples) in SYNTH_REF {
            let (kind, f16s): (GgmlType, &[usize]) = match name {
                "Q4_0" => (GgmlType::Q4_0, &[0]),
                "Q4_1" => (GgmlType::Q4_1, &[0, 2]),
                "Q5_0" => (GgmlType::Q5_0, &[0]),
                "Q5_1" => (GgmlType::Q5_1, &[0, 2]),
                "Q8_0" => (GgmlType::Q8_0, &[0]),
                "Q2_K" => (GgmlType::Q2_K, &[80, 82]),
                "Q3_K" => (GgmlType::Q3_K, &[108]),
                "Q4_K" => (GgmlType::Q4_K, &[0, 2]),
                "Q5_K" => (GgmlType::Q5_K, &[0, 2]),
                "Q6_K" => (GgmlType::Q6_K, &[208]),
                _ => unreachable!(),
            };
            assert_eq!(kind.name(), name);
            let c = held_form(kind, convert_blocks(kind, &synth_bytes(kind, f16s)).unwrap(), 2, 256);
            let plan = QPlan { format: c.format, group: c.group, bias: c.bias.is_some() };
            assert_eq!(kind.served_plan(), Some(plan), "{name}: served_plan vs the conversion");
            let t = QTensor {
                name: name.into(),
                format: c.format,
                rows: 2,
                cols: 256,
                group: c.group,
                q: TensorBytes::Owned(Arc::new(c.q)),
                scales: Arc::new(c.scales),
                bias: c.bias.map(Arc::new),
            };
            t.validate().unwrap();
            let v = t.dequantize();
            let (s, a) = v.iter().fold((0.0f64, 0.0f64), |(s, a), &x| (s + x as f64, a + (x as f64).abs()));
            assert!((s - sum).abs() <= 1e-6 * sum_abs, "{name}: sum {s} vs gguf-py {sum}");
            assert!((a - sum_abs).abs() <= 1e-6 * sum_abs, "{name}: sum |x| {a} vs gguf-py {sum_abs}");
            for (i, want) in samples {
                assert!(
                    (v[i] - want).abs() <= 2.0 * f32::EPSILON * want.abs().max(0.1),
                    "{name}[{i}]: {} vs {want}",
                    v[i]
                );
            }
        }
        // Q8_K (f32 d, 256 int8, 16 bsums) and Q8_1 (d, s, 32 int8) by hand.
        let mut b = vec![0u8; 292];
        b[0..4].copy_from_slice(&0.5f32.to_le_bytes());
        b[4] = (-3i8) as u8;
        b[259] = 7;
        let c = convert_blocks(GgmlType::Q8_K, &b).unwrap();
        assert_eq!(GgmlType::Q8_K.served_plan(), Some(QPlan { format: c.format, group: 256, bias: false }));
        assert_eq!((c.group, c.scales.clone(), c.q[0] as i8, c.q[255] as i8), (256, vec![0.5], -3, 7));
        let mut b = vec![0u8; 36];
        b[0..2].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
        b[4] = 9;
        let c = convert_blocks(GgmlType::Q8_1, &b).unwrap();
        assert_eq!(GgmlType::Q8_1.served_plan(), Some(QPlan { format: c.format, group: 32, bias: c.bias.is_some() }));
        assert_eq!(GgmlType::BF16.served_plan(), None);
        assert_eq!(GgmlType::IQ4_NL.served_plan(), None);
        assert_eq!((c.group, c.scales.clone(), c.q[0] as i8), (32, vec![0.25], 9));
    }

    /// One block of each kind with recognisable fields, against hand-computed values.
    #[test]
    fn q4_0_and_q8_0_blocks() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        for j in 0..16 {
            b[2 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let c = convert_blocks(GgmlType::Q4_0, &b).unwrap();
        let t = QTensor {
            name: "x".into(),
            format: c.format,
            rows: 1,
            cols: 32,
            group: c.group,
            q: TensorBytes::Owned(Arc::new(c.q)),
            scales: Arc::new(c.scales),
            bias: None,
        };
        let v = t.dequantize();
        for j in 0..16 {
            assert_eq!(v[j], 0.5 * (j as f32 - 8.0));
            assert_eq!(v[j + 16], 0.5 * (7.0 - j as f32));
        }
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
        for j in 0..32 {
            b[2 + j] = (j as i8 - 16) as u8;
        }
        let c = convert_blocks(GgmlType::Q8_0, &b).unwrap();
        assert_eq!(c.q[0] as i8, -16);
        assert_eq!(c.scales, vec![0.25]);
        assert!(convert_blocks(GgmlType::IQ2_XXS, &[0u8; 66]).is_none());
    }
}
